"""Checkpoint, resume and their refusals, through the real CLI and a real MLflow store."""

import os

import pytest
import torch
from mlflow import MlflowClient

from tests.conftest import assert_same_history, run_cli
from workbench import checkpoint
from workbench.errors import WorkbenchError
from workbench.privacy import sampling

# A fixed secure_seed makes two separate runs comparable bit for bit (by default each run draws a fresh secret).
ARGS = ["experiment=quick", "data.train._target_=tests.plugins.DyingSynthetic", "max_steps=20", "save_steps=5",
        "save_total_limit=2", "disable_tqdm=true", "privacy.secure_seed=1234"]


def _final_model(run_dir):
    return checkpoint.load(checkpoint.list_checkpoints(run_dir)[-1])


def test_killed_run_resumes_to_the_same_parameters_and_epsilon(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {"MLFLOW_TRACKING_URI": uri}
    whole = run_cli(*ARGS, f"output_dir={tmp_path / 'whole'}", cwd=tmp_path, env=env)
    assert whole.returncode == 0, whole.stderr[-2000:]

    crashed = run_cli(*ARGS, f"output_dir={tmp_path / 'crashed'}", cwd=tmp_path, env={**env, "WB_KILL_AT_FETCH": "13"})
    assert crashed.returncode == -9  # SIGKILL during step 12: checkpoints at 5 and 10 exist
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "crashed")] == ["checkpoint-5.pt", "checkpoint-10.pt"]
    resumed = run_cli(*ARGS, f"output_dir={tmp_path / 'crashed'}", "resume_from_checkpoint=latest", cwd=tmp_path, env=env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    a, b = _final_model(tmp_path / "whole"), _final_model(tmp_path / "crashed")
    assert a["step"] == b["step"] == 20
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["accountant"] == b["accountant"]

    client = MlflowClient(tracking_uri=uri)
    runs = {r.data.params["output_dir"]: r for r in client.search_runs([client.get_experiment_by_name("workbench").experiment_id])}
    assert len(runs) == 2  # the resumed job continued its own run
    run_a, run_b = runs[str(tmp_path / "whole")], runs[str(tmp_path / "crashed")]
    assert run_b.info.status == "FINISHED" and run_b.info.run_id == b["run_id"]
    assert run_a.data.metrics["epsilon"] == run_b.data.metrics["epsilon"]
    steps_a = [m.step for m in client.get_metric_history(run_a.info.run_id, "learning_rate")]
    steps_b = [m.step for m in client.get_metric_history(run_b.info.run_id, "learning_rate")]
    assert sorted(steps_b) == sorted(steps_a) == sorted(set(steps_b)) == [5, 10, 15, 20]  # no step logged twice
    eps_b = [m.step for m in client.get_metric_history(run_b.info.run_id, "epsilon")]
    assert sorted(eps_b) == sorted(set(eps_b)) and 20 in eps_b
    assert_same_history(uri, run_b.info.run_id, run_a.info.run_id)

    # One MLflow model, logged at the resumed job's end with the final epsilon; it predicts what the final checkpoint
    # does, loaded as mlflow.pytorch and as a pyfunc.
    import mlflow.pyfunc
    import mlflow.pytorch
    import numpy as np

    from workbench.models import MLP

    (output,) = run_b.outputs.model_outputs
    logged = client.get_logged_model(output.model_id)
    assert logged.source_run_id == run_b.info.run_id and output.step == 20
    assert float(logged.tags["workbench.epsilon"]) == run_b.data.metrics["epsilon"] and logged.tags["workbench.steps"] == "20"
    own = MLP()
    own.load_state_dict(b["model"])
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # models:/ is read from the process's tracking URI
    with torch.no_grad():
        expected = own(x)
        assert torch.equal(mlflow.pytorch.load_model(f"models:/{output.model_id}")(x), expected)
        predicted = mlflow.pyfunc.load_model(f"models:/{output.model_id}").predict(x.numpy())
    assert np.array_equal(np.asarray(predicted), expected.numpy())


def test_a_truncated_checkpoint_is_named_and_the_run_resumes_from_the_newest_intact_one(tmp_path):
    """A node lost while its newest checkpoint was copied: that file is cut short (one byte: torch says only
    'Invalid argument'). The resume names it, continues from the one before, and ends where the whole run ends; with
    every checkpoint cut, it is refused in one line and nothing trains."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {"MLFLOW_TRACKING_URI": uri}
    whole = run_cli(*ARGS, f"output_dir={tmp_path / 'whole'}", cwd=tmp_path, env=env)
    crashed = run_cli(*ARGS, f"output_dir={tmp_path / 'crashed'}", cwd=tmp_path, env={**env, "WB_KILL_AT_FETCH": "13"})
    assert whole.returncode == 0 and crashed.returncode == -9, whole.stderr[-2000:]
    five, ten = checkpoint.list_checkpoints(tmp_path / "crashed")
    os.truncate(ten, ten.stat().st_size - 1)

    resumed = run_cli(*ARGS, f"output_dir={tmp_path / 'crashed'}", "resume_from_checkpoint=latest", cwd=tmp_path, env=env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    said = resumed.stdout + resumed.stderr
    assert f"checkpoint '{ten}' is truncated or corrupt" in said and "Errno" not in said
    assert f"resuming from the newest intact checkpoint, {five}" in said
    a, b = _final_model(tmp_path / "whole"), _final_model(tmp_path / "crashed")
    assert a["step"] == b["step"] == 20 and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    # Steps 6..10 were logged before the kill and are trained again: logged once, as the uninterrupted run logs them
    assert_same_history(uri, b["run_id"], a["run_id"])

    cut = tmp_path / "cut"
    cut.mkdir()
    for p in checkpoint.list_checkpoints(tmp_path / "crashed"):
        (cut / "checkpoints").mkdir(exist_ok=True)
        (cut / "checkpoints" / p.name).write_bytes(p.read_bytes()[:-1])
    before = {p: p.stat().st_mtime_ns for p in (cut / "checkpoints").iterdir()}
    refused = run_cli(*ARGS, f"output_dir={cut}", "resume_from_checkpoint=latest_or_new", cwd=tmp_path, env=env)
    assert refused.returncode == 2, refused.stderr[-2000:]
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "is truncated or corrupt" in lines[0] and "no intact checkpoint before it" in lines[0]
    assert {p: p.stat().st_mtime_ns for p in (cut / "checkpoints").iterdir()} == before  # never trained afresh


def test_resume_refusals(tmp_path, mlflow_uri):
    from workbench import compose
    from workbench.launch import launch

    def cfg(*extra):
        return compose([*ARGS, f"tracking.uri={mlflow_uri}", *extra])

    run_dir = tmp_path / "run"
    launch(cfg(f"output_dir={run_dir}"))
    ckpts = checkpoint.list_checkpoints(run_dir)
    assert [p.name for p in ckpts] == ["checkpoint-15.pt", "checkpoint-20.pt"]  # save_total_limit=2 rotates
    assert not list((run_dir / "checkpoints").glob(".*tmp*"))  # no half-written file left behind

    # In-process: the CLI prints exactly these messages (tests/test_cli.py checks the CLI's one-line path).
    with pytest.raises(WorkbenchError, match="different privacy config"):
        launch(cfg(f"output_dir={run_dir}", "resume_from_checkpoint=latest", "privacy.max_grad_norm=2"))
    with pytest.raises(WorkbenchError, match="does not exist"):
        launch(cfg(f"output_dir={tmp_path / 'x'}", f"resume_from_checkpoint={tmp_path / 'nope.pt'}"))

    # Run folders are never shared by accident: a new run is refused where another one saved checkpoints, and
    # `latest` with nothing to resume (a mistyped output_dir) is refused instead of spending a second budget.
    with pytest.raises(WorkbenchError, match="already holds another run's checkpoints"):
        launch(cfg(f"output_dir={run_dir}"))
    with pytest.raises(WorkbenchError, match="resume_from_checkpoint=latest: there is no checkpoint"):
        launch(cfg(f"output_dir={tmp_path / 'typo'}", "resume_from_checkpoint=latest"))
    assert [p.name for p in checkpoint.list_checkpoints(run_dir)] == ["checkpoint-15.pt", "checkpoint-20.pt"]

    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(ckpts[-1].read_bytes()[:1000])
    bad = run_cli(*ARGS, f"output_dir={tmp_path / 'y'}", f"resume_from_checkpoint={corrupt}", cwd=tmp_path,
                  env={"MLFLOW_TRACKING_URI": mlflow_uri})
    assert bad.returncode == 2 and f"checkpoint '{corrupt}' is truncated or corrupt (1000 bytes" in bad.stderr
    assert "Traceback" not in bad.stderr

    # A checkpoint of another batch sampler (before issue 44: no "sampler" field; or a later one) would draw other
    # batches from the same secret than the run it continues: refused in one line, before any work
    for name, written_by in ((None, "of a float32 uniform per example (before issue 44)"), ("v9", "v9")):
        folder = tmp_path / f"sampler-{name}"
        (folder / "checkpoints").mkdir(parents=True)
        state = checkpoint.load(ckpts[-1])
        assert state.pop("sampler") == sampling.SAMPLER
        torch.save({**state, **({"sampler": name} if name else {})}, folder / "checkpoints" / ckpts[-1].name)
        refused = run_cli(*ARGS, f"output_dir={folder}", "resume_from_checkpoint=latest", cwd=tmp_path,
                          env={"MLFLOW_TRACKING_URI": mlflow_uri})
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode == 2 and len(lines) == 1, refused.stderr[-2000:]
        assert f"written by the batch sampler {written_by}, not this version's {sampling.SAMPLER}" in lines[0]

    # The checkpoint's run is not in the store it is pointed at: refused, and that store is not created (README)
    elsewhere = tmp_path / "elsewhere.db"
    with pytest.raises(WorkbenchError, match=f"is not in sqlite:///{elsewhere}; point tracking.uri at the store"):
        launch(compose([*ARGS, f"tracking.uri=sqlite:///{elsewhere}", f"output_dir={run_dir}",
                        "resume_from_checkpoint=latest"]))
    assert not elsewhere.exists()

    client = MlflowClient(tracking_uri=mlflow_uri)
    statuses = [r.info.status for r in client.search_runs([client.get_experiment_by_name("workbench").experiment_id])]
    assert statuses == ["FINISHED"]  # refusals happen before any run starts


def test_not_a_checkpoint_is_refused(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"weight": torch.zeros(2)}, path)
    with pytest.raises(WorkbenchError, match="not a workbench checkpoint"):
        checkpoint.load(path)


def test_streams_are_secret_unless_pinned(make_cfg, mlflow_uri):
    from workbench import train

    a = train(make_cfg("experiment=quick"))
    b = train(make_cfg("experiment=quick"))  # same seed, same config: a fresh secret, other batches and noise
    assert not all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))
    assert a.epsilon == b.epsilon
    pinned = [train(make_cfg("experiment=quick", "privacy.secure_seed=7")) for _ in range(2)]
    assert all(torch.equal(x, y) for x, y in zip(pinned[0].model.parameters(), pinned[1].model.parameters()))
    client = MlflowClient(tracking_uri=mlflow_uri)
    run = client.get_run(pinned[0].run_id)
    assert run.data.params["privacy.secure_seed"] == "<redacted>"
    # The checkpoint published to MLflow leaves the secret out; the run folder's own copy keeps it for resume.
    local = client.download_artifacts(run.info.run_id, "checkpoints", str(pinned[0].output_dir / "published"))
    published = checkpoint.load(next(__import__("pathlib").Path(local).glob("*.pt")))
    assert "secret" not in published and checkpoint.load(pinned[0].checkpoint)["secret"] == 7


def test_an_unpinned_run_resumes_with_the_secret_of_its_checkpoint(make_cfg, tmp_path, monkeypatch):
    """No secure_seed: the run draws a fresh secret and keeps it in its checkpoints. Resumed after a crash, it must
    replay that secret's batches and noise: it ends exactly where an uninterrupted run pinned to that secret ends."""
    from workbench import train

    args = ["experiment=quick", "data.train._target_=tests.plugins.FailingSynthetic", "max_steps=20", "save_steps=5",
            "tracking.enabled=false"]
    crashed = tmp_path / "crashed"
    monkeypatch.setenv("WB_FAIL_AT_FETCH", "13")  # the pre-run check's fetch, then steps 0..10: fails in step 11
    with pytest.raises(RuntimeError, match="injected failure"):
        train(make_cfg(*args, f"output_dir={crashed}"))
    monkeypatch.delenv("WB_FAIL_AT_FETCH")
    latest = checkpoint.list_checkpoints(crashed)[-1]
    assert latest.name == "checkpoint-10.pt"
    secret = checkpoint.load(latest)["secret"]

    resumed = train(make_cfg(*args, f"output_dir={crashed}", "resume_from_checkpoint=latest"))
    pinned = train(make_cfg(*args, f"output_dir={tmp_path / 'pinned'}", f"privacy.secure_seed={secret}"))
    assert resumed.steps == pinned.steps == 20 and resumed.epsilon == pinned.epsilon
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(), pinned.model.parameters()))


def test_latest_or_new_starts_afresh_then_resumes(make_cfg, mlflow_uri):
    """What a requeued job uses: a fresh start where nothing was saved yet, the newest checkpoint once there is one."""
    from workbench import train

    first = train(make_cfg("experiment=quick", "resume_from_checkpoint=latest_or_new"))
    assert first.steps == 20 and first.checkpoint.name == "checkpoint-20.pt"
    cfg = make_cfg("experiment=quick", "resume_from_checkpoint=latest_or_new")
    cfg.output_dir = str(first.output_dir)
    again = train(cfg)  # resumes at the end: no step retrained, the same run continued
    assert again.run_id == first.run_id and again.steps == 20
    assert [m.step for m in MlflowClient(tracking_uri=mlflow_uri).get_metric_history(first.run_id, "learning_rate")] == [5, 10, 15, 20]


@pytest.mark.slow
def test_runs_started_at_once_keep_their_own_folders(tmp_path):
    import subprocess
    import sys

    from tests.conftest import REPO

    env = {**__import__("os").environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "workbench", "experiment=quick", "max_steps=2", "tracking=off",
                               "disable_tqdm=true"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for _ in range(8)]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-2000:]
    saved = list((tmp_path / "outputs").rglob("checkpoint-2.pt"))
    assert len(saved) == len({p.parent for p in saved}) == 8


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root (CI runs as root to install SLURM: "
                                                 "it runs there)")
def test_full_disk_is_one_line_and_keeps_the_last_good_checkpoint(tmp_path):
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], check=True, capture_output=True)
    try:
        good = checkpoint.save({"model": {"w": torch.zeros(1000)}, "step": 1}, disk, 1, None)
        with pytest.raises(WorkbenchError) as refused:
            checkpoint.save({"model": {"w": torch.zeros(200_000)}, "step": 2}, disk, 2, None)  # 800 kB > 256 kB
        message = str(refused.value)
        assert "\n" not in message and "No space left on device" in message
        assert str(disk / "checkpoints" / "checkpoint-2.pt") in message and str(good) in message
        assert checkpoint.list_checkpoints(disk) == [good] and checkpoint.load(good)["step"] == 1
        assert not list((disk / "checkpoints").glob(".*tmp*"))
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root (CI runs as root to install SLURM: "
                                                 "it runs there)")
def test_a_disk_that_fills_mid_run_stops_it_with_exit_1_and_the_run_failed(tmp_path):
    """The checkpoint folder's disk fills after the first checkpoint (a 4 kB tmpfs mounted over it mid-run): one line,
    exit 1 (a run that started and had to stop, not bad input), the MLflow run FAILED, the earlier checkpoint whole."""
    import subprocess
    import sys
    import time

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(checkpoint.Path(__file__).resolve().parent.parent), "OMP_NUM_THREADS": "1",
           "WB_FETCH_SLEEP": "0.2", "MLFLOW_TRACKING_URI": uri}
    proc = subprocess.Popen([sys.executable, "-m", "workbench", *ARGS, "data.train._target_=tests.plugins.SlowSynthetic",
                             "max_steps=40", f"output_dir={run_dir}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    folder = run_dir / "checkpoints"
    mounted = False
    try:
        while not (folder / "checkpoint-5.pt").exists():
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            time.sleep(0.05)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(folder)], check=True, capture_output=True)
        mounted = True
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
        if mounted:
            subprocess.run(["umount", str(folder)], check=True)
    assert proc.returncode == 1, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: checkpoint save at step 10 failed on rank 0: could not write "
                                                   f"checkpoint {folder / 'checkpoint-10.pt'}: No space left on device")
    assert checkpoint.load(folder / "checkpoint-5.pt")["step"] == 5
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("workbench").experiment_id])
    assert run.info.status == "FAILED" and "No space left on device" in run.data.tags["error"]

    # Space freed (the tmpfs gone), the resume command trains steps 6..10 again and ends where an uninterrupted run
    # ends, each (metric, step) logged once (issue 45)
    args = [*ARGS, "data.train._target_=tests.plugins.SlowSynthetic", "max_steps=40"]
    resumed = run_cli(*args, f"output_dir={run_dir}", "resume_from_checkpoint=latest", cwd=tmp_path,
                      env={"MLFLOW_TRACKING_URI": uri})
    assert resumed.returncode == 0 and f"resuming from {folder / 'checkpoint-5.pt'}" in resumed.stdout + resumed.stderr
    whole = run_cli(*args, f"output_dir={tmp_path / 'whole'}", cwd=tmp_path, env={"MLFLOW_TRACKING_URI": uri})
    assert whole.returncode == 0, whole.stderr[-2000:]
    assert_same_history(uri, run.info.run_id, checkpoint.load(checkpoint.list_checkpoints(tmp_path / "whole")[-1])["run_id"])
