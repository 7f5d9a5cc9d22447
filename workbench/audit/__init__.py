"""The one-run privacy audit under its public path: ``workbench.audit.audit``, ``workbench.audit.epsilon_lower_bound``...

The bound itself is workbench/privacy/auditing/bound.py (pure math, importable by the job and the canaries below it); this package
adds only the command line, ``python -m workbench.audit`` (workbench/audit/__main__.py), which runs a job and so sits
above the job runner.
"""

from workbench.privacy.auditing.bound import (GUESS_GRID, IDEAL_SEED, SIGNIFICANCE, AuditResult, audit, correct_guesses,
                                   epsilon_lower_bound, guess_counts, ideal_lower_bound, multiplicity_probs, p_value,
                                   white_box_llr)

__all__ = ["GUESS_GRID", "IDEAL_SEED", "SIGNIFICANCE", "AuditResult", "audit", "correct_guesses", "epsilon_lower_bound",
           "guess_counts", "ideal_lower_bound", "main", "multiplicity_probs", "p_value", "white_box_llr"]


def main(argv=None) -> int:
    """``python -m workbench.audit [hydra overrides]`` (kept as ``workbench.audit.main``)."""
    from workbench.audit.__main__ import main as cli

    return cli(argv)
