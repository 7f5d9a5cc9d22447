"""The accountant of amplified BandMF (correlated.py, cyclic.py; Choquette-Choo et al., NeurIPS 2023, Theorem 4).

With a b-banded strategy of unit column norm and cyclic Poisson sampling at in-band rate p, T steps are as private as
DP-SGD's Poisson(p)-subsampled Gaussian(sigma) self-composed ceil(T / b) times: an example is in one part, which is
sampled at steps k, k + b, k + 2b, ... (at most ceil(T/b) of them), and its columns of C at those steps are
orthogonal with norm <= 1. jax_privacy 2.0.0's ``amplified_bandmf_event`` is this same event (tests/test_bandmf.py
checks both against each other and against dp_accounting built directly).

:class:`BandMFAccountant` is :class:`Accountant` with steps counted in participations, so everything that reads an
accountant (the epsilon schedule of every logged line, the budget stop, noise calibration, the privacy-utility bounds,
a sweep's composition) reads the BandMF epsilon through the same interface.
"""

from __future__ import annotations

from typing import Any

from workbench.errors import WorkbenchError
from workbench.privacy.accounting.accountant import Accountant
from workbench.privacy.accounting.events import _is_int
from workbench.privacy.accounting.lazy import _pld, dp_accounting
from workbench.privacy.accounting.pld import DEFAULT_PLD_DISCRETIZATION


def participations(steps: int, num_bands: int) -> int:
    """The most times one example can be sampled in ``steps`` steps of cyclic Poisson over b parts: ceil(T / b)."""
    return -(-int(steps) // int(num_bands))


class BandMFAccountant(Accountant):
    """Epsilon of T BandMF steps = the DP-SGD accountant's epsilon of ceil(T / b) steps at (p, sigma)."""

    def __init__(self, kind: str, sample_rate: float, noise_multiplier: float, num_bands: int, world_size: int = 1,
                 shard: str = "per_rank", pld_discretization: float = DEFAULT_PLD_DISCRETIZATION):
        if not (_is_int(num_bands) and num_bands >= 1):
            raise WorkbenchError(f"num_bands must be an integer >= 1, got {num_bands!r}")
        if shard != "per_rank":
            raise WorkbenchError("bandmf is accounted for shard=per_rank only (cyclic Poisson over each rank's shard)")
        super().__init__(kind, sample_rate, noise_multiplier, world_size, shard, pld_discretization)
        self.num_bands = int(num_bands)

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", num_bands={self.num_bands})"

    # Accountant's pld and rdp routes go through pld() and event(); prv's reads the steps itself. Each converts once.
    def event(self, steps: int) -> dp_accounting.DpEvent:
        return super().event(participations(steps, self.num_bands))

    def pld(self, steps: int) -> _pld.PrivacyLossDistribution:
        return super().pld(participations(steps, self.num_bands))

    def _compute_epsilon(self, steps: int, delta: float) -> float:
        if self.kind == "prv":
            return super()._compute_epsilon(participations(steps, self.num_bands), delta)
        return super()._compute_epsilon(steps, delta)  # through pld() / event() above

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "mechanism": "bandmf", "num_bands": self.num_bands}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("mechanism") != "bandmf" or state.get("num_bands") != self.num_bands:
            raise WorkbenchError(f"accountant state is of mechanism {state.get('mechanism', 'dpsgd')!r} with num_bands="
                                 f"{state.get('num_bands')!r}, but this run is bandmf with num_bands={self.num_bands}; "
                                 "a resumed run must keep its privacy mechanism")
        super().load_state_dict(state)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "BandMFAccountant":
        acc = cls(state["kind"], state["sample_rate"], state["noise_multiplier"], state["num_bands"],
                  state["world_size"], state["shard"], state["pld_discretization"])
        acc.load_state_dict(state)
        return acc


def accountant_of(fields: dict[str, Any], kind: str = "pld") -> Accountant:
    """The accountant of a run's ``workbench.dp_event`` fields of the built-in mechanisms (dpsgd, bandmf, blt): the
    old import path. privacy/mechanism.py's ``accountant_of`` reads any registered mechanism's (what a sweep uses);
    the registry imports accounting/, so accounting/ cannot ask it back."""
    if fields.get("mechanism") == "blt":
        from workbench.privacy.accounting.blt import BLTAccountant, blt_of

        return BLTAccountant(kind, fields["noise_multiplier"], blt_of(fields), fields["min_sep"],
                             fields["strategy_steps"], fields["world_size"], fields["shard"])
    if fields.get("mechanism", "dpsgd") == "bandmf":
        return BandMFAccountant(kind, fields["sample_rate"], fields["noise_multiplier"], fields["num_bands"],
                                fields["world_size"], fields["shard"])
    return Accountant(kind, fields["sample_rate"], fields["noise_multiplier"], fields["world_size"], fields["shard"])
