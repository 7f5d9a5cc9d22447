"""Accounting: what the mechanism spends, computed with dp_accounting (docs/DESIGN.md, "Accounting").

- events.py       the DP event of one run's steps (Poisson-subsampled Gaussian; "parallel Poisson" for shard=global)
- pld.py          one step's privacy loss distribution (pld_losses.py: dp_accounting's losses, vectorised)
- accountant.py   :class:`Accountant`, a run's ledger (pld | rdp | prv), and :class:`EpsilonSchedule`
- calibration.py  the smallest sigma for a target epsilon; the default delta; argument checks
- solve.py        the one root solver: where epsilon crosses a target (calibration's sigma, the most steps)
- banded.py       amplified BandMF: DP-SGD's event over ceil(T/b) participations, as an Accountant
- blt.py          BLT over fixed batches: one Gaussian of multiplier sigma / sens(t), as an Accountant
- tuning.py       composition across runs: what a sweep costs (all points, or only the best of K, selection.py)
- tradeoff.py     what epsilon means: the most any membership-inference attack achieves (f-DP from the PLD)

Nothing here imports dp_accounting until a number is asked for (lazy.py): scipy's import is seconds.
"""

from workbench.privacy.accounting.accountant import ACCOUNTANTS, Accountant, EpsilonSchedule, code_version
from workbench.privacy.accounting.calibration import (SIGMA_MAX, SIGMA_MIN, SIGMA_RTOL, calibrate_noise, default_delta,
                                                      validate_privacy_args)
from workbench.privacy.accounting.events import dp_event, multiplicity_probs
from workbench.privacy.accounting.pld import DEFAULT_PLD_DISCRETIZATION

__all__ = ["ACCOUNTANTS", "Accountant", "DEFAULT_PLD_DISCRETIZATION", "EpsilonSchedule", "SIGMA_MAX", "SIGMA_MIN",
           "SIGMA_RTOL", "calibrate_noise", "code_version", "default_delta", "dp_event", "multiplicity_probs",
           "validate_privacy_args"]
