"""What an MLflow user sees of a run and a sweep (issue 25), read back from a real store: the experiment marked as
model training, MLflow's standard tags, the closing line as the run's note, the trained model as an MLflow model (loaded
back, same predictions as the checkpoint) with the privacy budget on it and on its registered version, the data as run
inputs from metadata only, system metrics sampled off the training process, and a sweep's parent spanning its points.
The browser test opens such a store in Chromium."""

import json
import os
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from tests.conftest import run_cli
from workbench import checkpoint, compose, sweep, train
from workbench.errors import WorkbenchError
from workbench.privacy.accounting.accountant import LINE_SLACK
from workbench.models import MLP
from workbench.tracking import MlflowTracker, Store

# The CLI job below, run with an atexit line saying whether the training process ever imported MLflow.
_CLI = ("import atexit, sys; atexit.register(lambda: print('MLFLOW_IN_TRAINING_PROCESS', 'mlflow' in sys.modules)); "
        "sys.argv = ['workbench', *sys.argv[1:]]; from workbench.__main__ import cli; sys.exit(cli())")


@pytest.mark.slow
def test_a_cli_job_shows_in_mlflow_as_model_training_with_its_model_data_and_system_metrics(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = run_cli(_CLI, "experiment=quick", f"tracking.uri={uri}", "tracking.register_model=digits-dp",
                   "tracking.system_metrics_interval=0.5", "max_steps=60", f"output_dir={tmp_path / 'run'}",
                   "disable_tqdm=true", cwd=tmp_path, module=("-c",))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.strip().splitlines()
    assert out[-1] == "MLFLOW_IN_TRAINING_PROCESS False"  # the model went through the tracking worker
    closing = next(line for line in out if line.startswith("done: "))
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("workbench")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # MLflow 3's training view
    (run,) = client.search_runs([experiment.experiment_id])
    tags = run.data.tags
    assert run.info.status == "FINISHED"
    assert tags["mlflow.source.name"] == "workbench" and tags["mlflow.source.type"] == "LOCAL"
    assert tags["mlflow.source.git.commit"] == tags["git_sha"] and len(tags["git_sha"]) == 40
    assert tags["mlflow.user"] and tags["mlflow.note.content"] == closing
    assert tags["backend"] and tags["launcher"] == "inline"  # ours are kept

    # The data as run inputs: metadata only (the config's node, N, the row shapes), never an example's values.
    inputs = {d.tags[0].value: d.dataset for d in run.inputs.dataset_inputs}
    assert set(inputs) == {"training", "eval"}
    train_set = inputs["training"]
    assert train_set.name == "train: Synthetic" and json.loads(train_set.profile) == {"num_examples": 2048}
    source = json.loads(json.loads(train_set.source)["tags"]["workbench.data"])
    assert source == {"_target_": "workbench.data.Synthetic", "in_features": 64, "num_classes": 10, "seed": 0,
                      "size": 2048}
    features = json.loads(json.loads(train_set.schema)["mlflow_tensorspec"]["features"])
    assert [f["tensor-spec"]["shape"] for f in features] == [[-1, 64], [-1]]
    assert json.loads(inputs["eval"].profile) == {"num_examples": 512}

    # The model: an MLflow model of the run, with the budget; its registered version carries the budget too.
    (output,) = run.outputs.model_outputs
    logged = client.get_logged_model(output.model_id)
    assert str(logged.status).endswith("READY")
    epsilon = run.data.metrics["epsilon"]
    assert float(logged.tags["workbench.epsilon"]) == pytest.approx(epsilon)
    assert logged.tags["workbench.privacy_unit"] == "example" and logged.tags["workbench.accountant"] == "pld"
    assert logged.tags["workbench.mechanism"] == "dpsgd"  # what its sample_rate is the rate of
    assert float(logged.tags["workbench.delta"]) == run.data.metrics["delta"]
    assert logged.source_run_id == run.info.run_id and logged.experiment_id == experiment.experiment_id
    (version,) = client.search_model_versions("name='digits-dp'")
    assert version.source == f"models:/{output.model_id}" and version.run_id == run.info.run_id
    assert float(version.tags["workbench.epsilon"]) == pytest.approx(epsilon)
    assert version.tags["workbench.privacy_unit"] == "example"
    assert tags["workbench.registered_model"] == "digits-dp/1"

    import mlflow.pytorch

    loaded = mlflow.pytorch.load_model(f"models:/digits-dp/{version.version}")
    own = MLP()
    own.load_state_dict(checkpoint.load(sorted((tmp_path / "run" / "checkpoints").glob("*.pt"))[-1])["model"])
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(x), own(x))

    # System metrics: MLflow's sampler, in the tracking worker, under system/.
    assert any(k.startswith("system/cpu_utilization") for k in run.data.metrics), sorted(run.data.metrics)


def test_an_experiment_is_marked_as_model_training_unless_it_has_a_kind(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    client.create_experiment("old")  # made before workbench marked its experiments
    client.create_experiment("genai", tags={"mlflow.experimentKind": "genai_development"})  # a user's choice
    store = Store(uri)
    for name in ("old", "genai", "new"):
        store.experiment_id(name)
    kinds = {n: client.get_experiment_by_name(n).tags.get("mlflow.experimentKind") for n in ("old", "genai", "new")}
    assert kinds == {"old": "custom_model_development", "genai": "genai_development", "new": "custom_model_development"}
    # The runs table's shared view (the link's viewStateShareKey=workbench): epsilon is its first column.
    for name in ("old", "genai", "new"):
        view = json.loads(client.get_experiment_by_name(name).tags["mlflow.sharedViewState.workbench"])
        assert view["selectedColumns"][0] == view["columnOrder"][0] == "metrics.`epsilon`"


@pytest.mark.parametrize("name", ["", "  ", "a/b", "team:model", "100%", ".."])
def test_a_bad_registered_model_name_is_refused_before_any_run(make_cfg, mlflow_uri, tmp_path, name):
    cfg = make_cfg("experiment=quick", f"tracking.register_model='{name}'")
    with pytest.raises(WorkbenchError, match="tracking.register_model") as e:
        train(cfg)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "mlflow.db").exists()  # refused before any store was opened


def test_register_model_needs_the_model_logged(make_cfg):
    with pytest.raises(WorkbenchError, match="tracking.log_model=true"):
        train(make_cfg("experiment=quick", "tracking.register_model=m", "tracking.log_model=false"))


class UnpicklableMLP(MLP):
    """A model torch.save cannot pickle (a lambda attribute): the run must not be lost for it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hook = lambda x: x


def _boom():
    raise RuntimeError("this model cannot be loaded back")


class UnloadableMLP(MLP):
    """A model that pickles but fails where it is logged (the tracking store's side)."""

    def __reduce_ex__(self, protocol):
        return _boom, ()


@pytest.mark.parametrize("model", ["UnpicklableMLP", "UnloadableMLP"])
def test_a_model_that_cannot_be_logged_leaves_the_run_finished_with_its_records(make_cfg, mlflow_uri, model):
    result = train(make_cfg("experiment=quick", f"model._target_=tests.test_mlflow_ui.{model}", "~model.hidden",
                            "tracking.register_model=never", "tracking.system_metrics_interval=0"))
    client = MlflowClient(mlflow_uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and "epsilon" in run.data.metrics
    assert "workbench.model_error" in run.data.tags and "mlflow.note.content" in run.data.tags
    assert client.search_model_versions("name='never'") == []
    assert {a.path for a in client.list_artifacts(result.run_id)} >= {"config.yaml", "checkpoints"}


def test_a_sweep_parent_spans_its_points_and_ends_with_their_status(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    cfg = compose([f"tracking.uri={uri}"])
    for outcome in ("FINISHED", "FAILED"):
        folder = tmp_path / f"sweep-{outcome}"
        state = sweep.start(cfg, folder)
        parent = state["parent_run_id"]
        assert client.get_run(parent).info.status == "RUNNING"  # the sweep has started, its points not yet
        points = [MlflowTracker(cfg) for _ in range(2)]
        for i, t in enumerate(points):
            t.start({"overrides": f"seed={i}"}, sweep_dir=str(folder))
            t.log_metrics({"eval_accuracy": 0.5 + i / 10}, 1)
        points[0].finish()
        assert sweep.finish(folder) is None  # the driver leaves while a point still runs
        assert client.get_run(parent).info.status == "RUNNING"
        import time

        time.sleep(0.05)  # the last point ends measurably after the driver left
        points[1].finish(outcome)
        summary = sweep.point_ended(folder)
        assert summary["parent_status"] == outcome
        run = client.get_run(parent)
        children = [client.get_run(t.run_id) for t in points]
        assert run.info.status == outcome
        assert run.info.start_time <= min(c.info.start_time for c in children)
        assert run.info.end_time == max(c.info.end_time for c in children)
        assert run.data.tags["mlflow.note.content"].startswith("sweep of") and run.data.tags["mlflow.user"]


def test_logging_a_model_in_this_process_leaves_its_tracking_uri_as_it_was(make_cfg, mlflow_uri, monkeypatch):
    """A sweep's points run one after another in the driver's process: the model of the first must not move the
    second's runs to ./mlflow.db (MLflow's own restore of the tracking URI drops $MLFLOW_TRACKING_URI)."""
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    before = mlflow.get_tracking_uri()
    cfg = make_cfg("experiment=quick", "tracking.system_metrics_interval=0")
    cfg.tracking.uri = None  # the job reads $MLFLOW_TRACKING_URI, as a sweep's points do
    assert MlflowClient(mlflow_uri).get_run(train(cfg).run_id).outputs.model_outputs
    assert os.environ["MLFLOW_TRACKING_URI"] == mlflow_uri and mlflow.get_tracking_uri() == before


@pytest.mark.parametrize("mode", ["hooks", "ew", "functorch", "vmap", "bk"])
def test_the_published_model_holds_the_trained_weights_and_nothing_of_the_last_batch(make_cfg, mlflow_uri, tmp_path,
                                                                                      mode):
    """The per-sample modes leave the last batch's per-example gradients (``grad_sample``) and activations on the
    trained module, and hooks that hold them: pickling it would publish unclipped, un-noised functions of private
    examples. The MLflow model is the trained weights in a freshly built copy: the same outputs, only its state."""
    import mlflow.artifacts
    import mlflow.pytorch

    result = train(make_cfg("experiment=quick", f"privacy.grad_sample_mode={mode}", "max_steps=3",
                            f"tracking.register_model=m-{mode}", "tracking.system_metrics_interval=0"))
    trained = result.model
    leftovers = [n for n, p in trained.named_parameters() if vars(p)]
    if mode != "bk":  # the premise: the trained module does carry per-example state in these modes
        assert leftovers, "the trained module carries no per-example state: this test no longer tests the leak"
    uri = f"models:/m-{mode}/1"
    published = mlflow.pytorch.load_model(uri)
    assert all(not vars(p) for p in published.parameters())
    for name, module in published.named_modules():
        assert not [k for k, v in vars(module).items() if k.endswith("hooks") and isinstance(v, dict) and v], name
        assert not hasattr(module, "activations"), name
    state_bytes = sum(t.numel() * t.element_size() for t in published.state_dict().values())
    (tmp_path / "download").mkdir()
    (pickled,) = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / "download"))).rglob("model.pth")
    assert pickled.stat().st_size < state_bytes + 64 * 1024  # the state and the module's structure, nothing more
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(published(x), trained.cpu()(x))


def test_models_at_checkpoints_when_asked_each_at_its_step_with_its_epsilon(make_cfg, mlflow_uri, monkeypatch):
    """tracking.log_model_checkpoints=true: every save_steps checkpoint is also an MLflow model linked to its step, with
    the epsilon spent by then, holding that checkpoint's weights; the end's model alone is registered."""
    import mlflow.pytorch

    result = train(make_cfg("experiment=quick", "save_steps=5", "save_total_limit=10", "tracking.log_model_checkpoints=true",
                            "tracking.register_model=ckpt", "tracking.system_metrics_interval=0"))
    client = MlflowClient(mlflow_uri)
    run = client.get_run(result.run_id)
    outputs = sorted(run.outputs.model_outputs, key=lambda o: o.step)
    models = [client.get_logged_model(o.model_id) for o in outputs]
    assert [(o.step, m.name) for o, m in zip(outputs, models)] == [(5, "checkpoint-5"), (10, "checkpoint-10"),
                                                                   (15, "checkpoint-15"), (20, "model")]
    epsilon = {m.step: m.value for m in client.get_metric_history(result.run_id, "epsilon")}  # logged every 5 steps
    for o, m in zip(outputs, models):
        assert str(m.status).endswith("READY") and m.source_run_id == result.run_id
        # the model's epsilon is the exact one at its step; a logged line before the last may be up to LINE_SLACK
        # above it (the schedule's coarse grid), never below
        spent = float(m.tags["workbench.epsilon"])
        assert spent <= epsilon[o.step] <= spent * (1 + LINE_SLACK) and m.tags["workbench.steps"] == str(o.step)
    assert float(models[-1].tags["workbench.epsilon"]) == pytest.approx(result.epsilon, rel=1e-12)
    assert epsilon[5] < epsilon[10] < epsilon[15] < epsilon[20] == pytest.approx(result.epsilon)
    (version,) = client.search_model_versions("name='ckpt'")
    assert version.source == f"models:/{outputs[-1].model_id}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    for o in outputs[:-1]:
        own = MLP()
        own.load_state_dict(checkpoint.load(result.output_dir / "checkpoints" / f"checkpoint-{o.step}.pt")["model"])
        with torch.no_grad():
            assert torch.equal(mlflow.pytorch.load_model(f"models:/{o.model_id}")(x), own(x)), o.step


def test_models_at_checkpoints_need_the_model_logged(make_cfg):
    with pytest.raises(WorkbenchError, match="tracking.log_model_checkpoints needs tracking.log_model=true") as e:
        train(make_cfg("experiment=quick", "tracking.log_model_checkpoints=true", "tracking.log_model=false"))
    assert "\n" not in str(e.value)


def test_rerunning_a_finished_run_logs_and_registers_its_model_once(make_cfg, mlflow_uri):
    """A finished run started again on its own folder (a requeued job with resume_from_checkpoint=latest_or_new that
    had already ended) resumes its MLflow run at its last step: its model is already there, READY, and registered.
    It stays one MLflow model and one registered version."""
    cfg = make_cfg("experiment=quick", "max_steps=4", "tracking.register_model=once", "tracking.system_metrics_interval=0")
    first = train(cfg)
    cfg.resume_from_checkpoint = "latest_or_new"
    again = train(cfg)
    client = MlflowClient(mlflow_uri)
    assert again.run_id == first.run_id and again.steps == first.steps == 4
    run = client.get_run(first.run_id)
    models = client.search_logged_models([run.info.experiment_id], filter_string=f"source_run_id = '{first.run_id}'")
    assert [(m.name, m.tags["workbench.steps"]) for m in models] == [("model", "4")]
    assert [str(v.version) for v in client.search_model_versions("name='once'")] == ["1"]
    assert run.info.status == "FINISHED"
