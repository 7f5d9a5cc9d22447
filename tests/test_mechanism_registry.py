"""The mechanism registry (workbench/privacy/mechanisms/): a mechanism registered from outside the product, here a
test module alone, runs through the normal job path: its refusal is asked up front, its plan, sampler and noise are
what the run uses, its DP event is the run's tag, and the epsilon it reports is dp_accounting's, computed directly."""

import json

import pytest
import torch
from omegaconf import OmegaConf

from tests.test_accounting import DELTA, REL, direct_poisson_pld
from workbench import privacy
from workbench.errors import WorkbenchError
from workbench.privacy import mechanism
from workbench.privacy.accounting import Accountant
from workbench.privacy.clipping.adaptive import FixedClip
from workbench.privacy.mechanisms import MECHANISMS, Mechanism, MechanismSpec
from workbench.privacy.noise import GaussianNoise
from workbench.privacy.sampling import PoissonBatchSampler

SIGMA = 1.7  # the toy's own noise multiplier, whatever privacy.noise_multiplier says (it must say one)


class _CountedNoise(GaussianNoise):
    def add_(self, update: torch.Tensor, step: int, scale: float = 1.0) -> None:
        FixedNoise.noised.append(step)
        super().add_(update, step, scale)


class FixedNoise(MechanismSpec):
    """DP-SGD at a sigma of its own: Poisson sampling at q, C fixed, N(0, (SIGMA C)^2) per step, no calibration."""

    name = "fixed_noise"
    independent_noise = True
    noised: list[int] = []  # the steps its noise was drawn for
    sampled: list[int] = []  # the start steps its sampler was asked for

    def size(self, get, shard_mode):
        if get("noise_multiplier") is None or get("target_epsilon") is not None:
            raise WorkbenchError("privacy.mechanism=fixed_noise takes no target_epsilon: set "
                                 "privacy.noise_multiplier (any value) and privacy.target_epsilon=null")
        return 1

    def make(self, p, shard, shard_mode, world_size, steps, delta, notes, size, unit):
        accountant = Accountant(p.accountant, shard.sample_rate, SIGMA, world_size, shard_mode)
        return Mechanism(shard, shard_mode, world_size, steps, p.max_grad_norm, SIGMA, delta, accountant, notes,
                         FixedClip(p.max_grad_norm), self.name)

    def sampler(self, m, seed, rank, start_step):
        self.sampled.append(start_step)
        return PoissonBatchSampler(m.shard, m.steps, seed, rank, start_step)

    def accountant_of(self, fields, kind):
        return Accountant(kind, fields["sample_rate"], fields["noise_multiplier"], fields["world_size"],
                          fields["shard"])

    def noise(self, m, numel, rank, device, seed, dtype):
        return _CountedNoise(m.gradient_noise_multiplier, m.max_grad_norm, numel, rank, device, seed)


@pytest.fixture
def fixed_noise(monkeypatch):
    spec = FixedNoise()
    FixedNoise.noised, FixedNoise.sampled = [], []
    monkeypatch.setitem(MECHANISMS, spec.name, spec)  # gone again after the test
    return spec


def test_a_registered_mechanism_trains_through_the_job_and_reports_dp_accountings_epsilon(fixed_noise, make_cfg,
                                                                                         mlflow_uri):
    from mlflow import MlflowClient

    from workbench import train

    q, steps = 64 / 2048, 5  # experiment=quick: N=2048, B=64
    result = train(make_cfg("experiment=quick", f"max_steps={steps}", "privacy.mechanism=fixed_noise",
                            "privacy.noise_multiplier=0.5", "privacy.target_epsilon=null",
                            f"privacy.target_delta={DELTA}"))
    expected = direct_poisson_pld(q, SIGMA, steps, DELTA, privacy.DEFAULT_PLD_DISCRETIZATION)
    assert result.steps == steps and result.noise_multiplier == SIGMA and result.sample_rate == q
    assert result.epsilon == pytest.approx(expected, rel=REL)
    assert FixedNoise.noised == list(range(steps)) and FixedNoise.sampled == [0]  # its noise, its sampler
    tag = json.loads(MlflowClient(tracking_uri=mlflow_uri).get_run(result.run_id).data.tags["workbench.dp_event"])
    assert tag["mechanism"] == "fixed_noise" and tag["noise_multiplier"] == SIGMA
    assert mechanism.accountant_of(tag).epsilon(steps, DELTA) == pytest.approx(expected, rel=REL)  # a sweep's reading


def test_a_registered_mechanisms_refusal_is_asked_before_any_work(fixed_noise, make_cfg, tmp_path):
    from workbench import train

    cfg = make_cfg("experiment=quick", "privacy.mechanism=fixed_noise", "privacy.noise_multiplier=1.0")
    with pytest.raises(WorkbenchError, match="fixed_noise takes no target_epsilon"):
        train(cfg)
    assert FixedNoise.sampled == [] and not (tmp_path / "run").exists()
    with pytest.raises(WorkbenchError, match="supports privacy.unit=example only"):  # user level: not declared
        mechanism.mechanism_kind({**OmegaConf.to_container(cfg.privacy), "unit": "user", "target_epsilon": None},
                                 "per_rank")


def test_an_unregistered_mechanism_is_refused_naming_the_registered_ones():
    with pytest.raises(WorkbenchError, match="privacy.mechanism='fixed_noise' is unknown; choose one of dpsgd, "
                                             "bandmf, blt$"):
        mechanism.mechanism_kind({"mechanism": "fixed_noise"}, "per_rank")


@pytest.mark.parametrize("name", ("dpsgd", "bandmf", "blt"))
def test_each_mechanisms_conf_file_selects_it_as_the_key_does(name):
    from workbench import compose

    preset, key = (OmegaConf.to_container(compose([o]).privacy) for o in (f"privacy={name}", f"privacy.mechanism={name}"))
    assert preset == key and preset["mechanism"] == name and name in MECHANISMS
