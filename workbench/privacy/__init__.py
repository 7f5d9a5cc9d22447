"""The DP mechanism, and nothing else (docs/DESIGN.md, "The privacy contract").

Where each part of DP-SGD lives:

- sampling.py     which examples a rank may draw (shard modes), the secret streams, the Poisson batch sampler
- clipping/       per-example gradients clipped to C, with the floating-point bound (clipping/bound.py)
- noise.py        the Gaussian noise: sigma C, added by rank 0 alone, once per logical step
- correlated.py   privacy.mechanism=bandmf: the banded Toeplitz strategy and its correlated noise (an O(b x model) ring);
                  blt's noise (BLTNoise, d buffers)
- blt.py          privacy.mechanism=blt: the Buffered Linear Toeplitz strategy, its inverse, its sensitivity
- cyclic.py       bandmf's cyclic Poisson sampling: each rank's shard in b parts, part t mod b drawn at step t; blt's
                  fixed batches (k secret parts of exactly B / W, part t mod k at step t)
- accounting/     the DP event, the accountants (PLD, RDP, PRV), noise calibration, composition across runs
- auditing/       the one-run lower bound on epsilon and its canaries
- mechanism.py    :class:`Mechanism`: the one object a run is built from. It holds the sampler's shard and rate, C,
                  sigma, the planned steps and the accountant of exactly that event, and hands out the sampler and
                  the step's noise; the step, the loop, the checkpoint and MLflow all read it, nothing re-derives q
                  or sigma.
- mechanisms/     one module per mechanism (dpsgd, bandmf, blt) behind the ``MECHANISMS`` registry

The names below are re-exported for ``from workbench.privacy import Accountant`` and friends.
"""

from workbench.privacy.accounting import (ACCOUNTANTS, DEFAULT_PLD_DISCRETIZATION, SIGMA_MAX, SIGMA_MIN, SIGMA_RTOL,
                                          Accountant, EpsilonSchedule, calibrate_noise, code_version, default_delta,
                                          dp_event, multiplicity_probs, validate_privacy_args)
from workbench.privacy.sampling import SHARDS

__all__ = ["ACCOUNTANTS", "Accountant", "DEFAULT_PLD_DISCRETIZATION", "EpsilonSchedule", "SHARDS", "SIGMA_MAX",
           "SIGMA_MIN", "SIGMA_RTOL", "calibrate_noise", "code_version", "default_delta", "dp_event",
           "multiplicity_probs", "validate_privacy_args"]
