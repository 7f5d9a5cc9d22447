"""`python -m benchmarks --quick` runs end to end and writes every figure. No timing is asserted here: speed is what the
benchmarks measure (benchmarks/RESULTS.md), not what tests check."""

import json
import math
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

FIGURES = ("dp_vs_nonprivate", "vs_opacus", "distributed_scaling", "scaling_vs_ddp", "accounting", "tracking_overhead", "startup",
           "end_to_end")


@pytest.mark.slow
def test_quick_benchmarks_write_every_figure(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    # From the repository root: opacus installs a top-level `benchmarks` package of its own into site-packages.
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--out", str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) == set(FIGURES)
    for name in FIGURES:
        fig = results[name]
        assert fig["mode"] == "quick" and fig["command"] == "python -m benchmarks --quick", name
        assert fig["machine"]["cores"] >= 1 and fig["machine"]["versions"]["torch"], name
        assert fig["threads_per_process"] == 1
        assert fig["summary"], name
        for key, value in fig["summary"].items():
            assert isinstance(value, (int, float)) and not isinstance(value, bool), (name, key, value)
            assert math.isfinite(value) and value > 0, (name, key, value)
        for t in fig["targets"]:
            assert isinstance(t["met"], bool) and math.isfinite(t["value"]) and t["goal"] > 0, (name, t)
    assert len([t for fig in results.values() for t in fig["targets"]]) >= 10  # every target of the issue

    ddp = results["scaling_vs_ddp"]  # W=2 weak scaling, ours beside torch DDP (issue 10)
    assert {f"w{w}/{k}/samples_per_s" for w in (1, 2) for k in ("ours", "ddp")} | {
        "efficiency/ours", "efficiency/ddp", "ours_vs_ddp"} <= set(ddp["summary"])
    assert [t["goal"] for t in ddp["targets"]] == [0.95] and ddp["targets"][0]["value"] == ddp["ours_vs_ddp"]

    table = (tmp_path / "RESULTS.md").read_text()
    assert "| Figure | Comparison (same run) | Measured | Target | Met | Gap |" in table
    assert "python -m benchmarks --quick" in table
    for name in FIGURES:
        assert f"`{name}`" in table, name
