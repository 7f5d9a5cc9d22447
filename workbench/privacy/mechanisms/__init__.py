"""The registry of mechanisms (``privacy.mechanism``): one module each, registered by name in ``MECHANISMS``.

- base.py     :class:`Mechanism` (the run's plan), :class:`MechanismSpec` (what a mechanism's module implements),
              ``MECHANISMS``, ``register``, the budget stop and C's schedule
- dpsgd.py    DP-SGD: Poisson sampling, independent Gaussian noise
- bandmf.py   BandMF: cyclic Poisson, banded correlated noise, amplified-BandMF accounting
- blt.py      BLT: fixed batches, buffered linear Toeplitz noise, one Gaussian of sigma / sens(T)

Adding a mechanism: docs/DESIGN.md, "Adding a mechanism".
"""

# each registers itself, in this order (the order refusals list them in)
from workbench.privacy.mechanisms import dpsgd  # noqa: F401, I001
from workbench.privacy.mechanisms import bandmf  # noqa: F401, I001
from workbench.privacy.mechanisms import blt  # noqa: F401, I001
from workbench.privacy.mechanisms.base import MECHANISMS, Mechanism, MechanismSpec, register, spec_of

__all__ = ["MECHANISMS", "Mechanism", "MechanismSpec", "register", "spec_of"]
