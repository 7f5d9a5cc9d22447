"""The accountant of BLT with min-separation participation, without amplification (workbench/privacy/blt.py,
cyclic.py's FixedBatchSampler).

The first t steps release C G + sigma C_clip Z restricted to t rows, G's rows the clipped sums; one example changes
C G by at most C_clip sens(t) in L2 (blt.sensitivity: fixed batches, k steps apart). Under zero-out of one example
(N and the batches fixed: adding or removing one would change a batch of public size) that is one Gaussian
mechanism of noise multiplier sigma / sens(t): epsilon(t) is dp-accounting's ``GaussianDpEvent(sigma / sens(t))``,
built as a Poisson-sampled Gaussian at rate 1 (the same PLD route and calibration as DP-SGD's). No sampling
amplification is claimed.

:class:`BLTAccountant` is :class:`Accountant` with that event, so the epsilon schedule of every logged line, the
budget stop, noise calibration (:func:`calibrate_blt`) and a sweep's composition read it through the same interface.
"""

from __future__ import annotations

from typing import Any

from workbench.errors import WorkbenchError
from workbench.privacy.accounting.accountant import Accountant
from workbench.privacy.accounting.calibration import calibrate_noise
from workbench.privacy.accounting.events import _is_int
from workbench.privacy.accounting.lazy import _pld, dp_accounting
from workbench.privacy.accounting.pld import DEFAULT_PLD_DISCRETIZATION
from workbench.privacy.blt import BLT, check_blt, sensitivity


class BLTAccountant(Accountant):
    """Epsilon of t BLT steps = the Gaussian mechanism's at noise multiplier sigma / sens(t)."""

    def __init__(self, kind: str, noise_multiplier: float, blt: BLT, min_sep: int, planned_steps: int,
                 world_size: int = 1, shard: str = "per_rank",
                 pld_discretization: float = DEFAULT_PLD_DISCRETIZATION):
        if not (_is_int(min_sep) and min_sep >= 1 and _is_int(planned_steps) and planned_steps >= 1):
            raise WorkbenchError(f"min_sep and planned_steps must be integers >= 1, got {min_sep!r}, {planned_steps!r}")
        if shard != "per_rank":
            raise WorkbenchError("blt is accounted for shard=per_rank only (fixed batches over each rank's shard)")
        super().__init__(kind, 1.0, noise_multiplier, world_size, shard, pld_discretization)
        self.blt, self.min_sep, self.planned_steps = blt, int(min_sep), int(planned_steps)
        self.sensitivities = sensitivity(blt, self.planned_steps, self.min_sep)  # sens(1..T)

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", blt={self.blt}, min_sep={self.min_sep})"

    def multiplier(self, steps: int) -> float:
        """sigma / sens(steps): the Gaussian mechanism the first ``steps`` steps are."""
        if steps > self.planned_steps:
            raise WorkbenchError(f"blt's accountant was built for {self.planned_steps} steps, asked for {steps}")
        return self.noise_multiplier / float(self.sensitivities[steps - 1])

    def _gaussian(self, steps: int) -> dp_accounting.DpEvent:
        return dp_accounting.PoissonSampledDpEvent(1.0, dp_accounting.GaussianDpEvent(self.multiplier(steps)))

    def event(self, steps: int) -> dp_accounting.DpEvent:
        return self._gaussian(steps) if steps > 0 else dp_accounting.NoOpDpEvent()

    def pld(self, steps: int) -> _pld.PrivacyLossDistribution:
        from workbench.privacy.accounting.pld import _step_pld

        d = self.pld_discretization
        if steps == 0:
            return _pld.identity(value_discretization_interval=d)
        return _pld.identity(value_discretization_interval=d).compose(_step_pld(self._gaussian(steps), d))

    def _compute_epsilon(self, steps: int, delta: float) -> float:
        if self.kind == "prv" and steps > 0 and self.noise_multiplier > 0:
            from opacus.accountants import PRVAccountant

            prv = PRVAccountant()
            prv.history = [(self.multiplier(steps), 1.0, 1)]
            return float(prv.get_epsilon(delta))
        return super()._compute_epsilon(steps, delta)  # through pld() / event() above

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "mechanism": "blt", "buf_decay": list(self.blt.buf_decay),
                "output_scale": list(self.blt.output_scale), "min_sep": self.min_sep,
                "planned_steps": self.planned_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        if any(state.get(k) != mine[k] for k in ("mechanism", "buf_decay", "output_scale", "min_sep", "planned_steps")):
            raise WorkbenchError(f"accountant state is of mechanism {state.get('mechanism', 'dpsgd')!r} with "
                                 f"{ {k: state.get(k) for k in ('min_sep', 'planned_steps')} }, but this run is blt "
                                 f"with min_sep={self.min_sep}, planned_steps={self.planned_steps}, {self.blt}; "
                                 "a resumed run must keep its privacy mechanism")
        super().load_state_dict(state)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "BLTAccountant":
        acc = cls(state["kind"], state["noise_multiplier"], blt_of(state), state["min_sep"], state["planned_steps"],
                  state["world_size"], state["shard"], state["pld_discretization"])
        acc.load_state_dict(state)
        return acc


def blt_of(fields: dict[str, Any]) -> BLT:
    """The BLT recorded in an accountant's state or a run's ``workbench.dp_event`` fields."""
    return check_blt(fields["buf_decay"], fields["output_scale"], len(fields["buf_decay"]))


def calibrate_blt(kind: str, blt: BLT, min_sep: int, steps: int, target_epsilon: float, delta: float,
                  world_size: int = 1) -> float:
    """The smallest sigma (to calibrate_noise's tolerance) whose BLTAccountant meets ``target_epsilon`` after
    ``steps`` steps: the one Gaussian's multiplier z from calibrate_noise (rate 1, one step: the same event and PLD
    route), times sens(T) and the sensitivity margin's bit of slack, then checked."""
    z = calibrate_noise(kind, 1.0, 1, target_epsilon, delta)
    sens = float(sensitivity(blt, steps, min_sep)[-1])
    sigma = z * sens * (1 + 1e-12)  # sigma / sens must not round below z
    if not BLTAccountant(kind, sigma, blt, min_sep, steps, world_size).epsilon(steps, delta) <= target_epsilon:
        raise AssertionError(f"calibrate_blt overshot target_epsilon={target_epsilon} at sigma={sigma}")
    return sigma
