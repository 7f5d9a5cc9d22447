"""The mechanism of a run (workbench/privacy/mechanism.py), built once from its settings: what it plans is what the run
does (here: a fixed sigma cuts the steps to the budget, as dp_accounting computed directly counts them)."""

import pytest

from tests.test_accounting import DELTA, REL, direct_poisson_pld
from workbench import privacy


def test_a_run_with_fixed_noise_stops_at_the_budget(make_cfg, mlflow_uri):
    """With sigma fixed and a target below what the planned steps cost, the run takes exactly the steps
    dp_accounting allows (one more would exceed the target) and reports an epsilon within it, everywhere."""
    from mlflow import MlflowClient

    from workbench import train

    q, sigma, planned = 64 / 2048, 1.0, 20  # experiment=quick: N=2048, B=64, max_steps=20
    eps8, eps9 = (direct_poisson_pld(q, sigma, t, DELTA, privacy.DEFAULT_PLD_DISCRETIZATION) for t in (8, 9))
    target = (eps8 + eps9) / 2  # 8 steps meet it, 9 exceed it
    with pytest.warns(UserWarning, match=f"stops after 8 of {planned} steps"):
        result = train(make_cfg("experiment=quick", f"privacy.noise_multiplier={sigma}",
                                f"privacy.target_epsilon={target!r}", f"privacy.target_delta={DELTA}"))
    assert result.steps == 8 and result.sample_rate == q and result.noise_multiplier == sigma
    assert result.epsilon <= target
    assert result.epsilon == pytest.approx(eps8, rel=REL)
    client = MlflowClient(tracking_uri=mlflow_uri)
    assert client.get_run(result.run_id).data.metrics["steps"] == 8
    logged = client.get_metric_history(result.run_id, "epsilon")
    assert logged and all(m.value <= target for m in logged) and max(m.step for m in logged) == 8
