"""What MLflow may see (workbench/tracking/redaction.py): no secret reaches the store or its artifacts."""

from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import run_cli


def _store_and_artifacts(tmp_path: Path, *own: Path) -> list[Path]:
    """Every file the tracking store holds: the SQLite file and the whole artifact tree (all of tmp_path but the run
    folders and Hydra's log folder, which are the user's own: a run folder keeps the secret for resuming)."""
    own = (*own, tmp_path / "outputs")
    return [p for p in tmp_path.rglob("*") if p.is_file() and not any(d in p.parents for d in own)]


@pytest.mark.slow
def test_secrets_never_reach_mlflow(tmp_path):
    """A pinned secure_seed and a run's stream secret appear nowhere in the store or its artifacts, in any form, and
    the published checkpoint holds nothing (such as a digest of config + seed) that would let a seed be brute-forced."""
    import struct

    import torch

    from workbench import checkpoint

    seed = 271828182845
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # The pinned seed also copied where a user might put it: the run's name, a tag.
    pinned = [f"privacy.secure_seed={seed}", f"tracking.run_name=seed-{seed}", f"+tracking.tags.note=from_{seed}"]
    for name, extra in [("pinned", pinned), ("fresh", [])]:
        run_dir = tmp_path / name
        proc = run_cli("experiment=quick", "save_steps=5", f"output_dir={run_dir}", "disable_tqdm=true", *extra,
                       cwd=tmp_path, env={"MLFLOW_TRACKING_URI": uri})
        assert proc.returncode == 0, proc.stderr[-2000:]
        secret = checkpoint.load(checkpoint.list_checkpoints(run_dir)[-1])["secret"]
        if name == "pinned":
            assert secret == seed
        forms = [str(secret).encode(), hex(secret).encode(), struct.pack("<q", secret), struct.pack(">q", secret)]
        files = _store_and_artifacts(tmp_path, tmp_path / "pinned", tmp_path / "fresh")
        published = [p for p in files if p.suffix == ".pt"]
        assert (tmp_path / "mlflow.db") in files and published and any(p.name == "config.yaml" for p in files)
        for path in files:
            blob = path.read_bytes()
            assert not [f for f in forms if f in blob], f"the secret leaked into {path}"
        for path in published:
            state = torch.load(path, weights_only=True)
            assert "secret" not in state and "privacy_digest" not in state
    client = MlflowClient(tracking_uri=uri)
    run = client.search_runs([client.get_experiment_by_name("workbench").experiment_id],
                             "params.output_dir LIKE '%pinned'")[0]
    assert run.data.params["privacy.secure_seed"] == "<redacted>"
    assert "privacy.secure_seed=<redacted>" in run.data.tags["overrides"]


@pytest.mark.parametrize("text, shown", [
    ("privacy.secure_seed=123 max_steps=5", "privacy.secure_seed=<redacted> max_steps=5"),
    ("+privacy.secure_seed=1,2,3 seed=4", "+privacy.secure_seed=<redacted> seed=4"),  # a sweep over seeds: every one
    ("privacy.secure_seed=choice(11, 12) lr=0.1", "privacy.secure_seed=<redacted> lr=0.1"),
    ("privacy:\n  secure_seed: 77\n  unit: user", "privacy:\n  secure_seed: <redacted>\n  unit: user"),
])
def test_an_override_string_loses_the_whole_value_of_a_pinned_seed(text, shown):
    from workbench.tracking import scrub

    assert scrub(text) == shown


def test_a_pinned_seed_is_redacted_from_every_text_of_the_config_and_kept_out_of_hydra_folder_names():
    from hydra import compose as hydra_compose, initialize_config_dir

    from workbench import compose
    from workbench.tracking import flatten, redacted

    cfg = compose(["privacy.secure_seed=902101", "tracking.run_name=run_902101", "output_dir=outputs/s902101/x"])
    shown = flatten(redacted(cfg))
    assert shown["privacy.secure_seed"] == "<redacted>"
    assert shown["tracking.run_name"] == "run_<redacted>" and shown["output_dir"] == "outputs/s<redacted>/x"
    assert not [k for k, v in shown.items() if "902101" in str(v)]
    assert flatten(redacted(compose(["seed=902101"])))["seed"] == 902101  # unpinned: nothing is a secret
    # A short pinned seed (guessed by trying them all anyway) is redacted from its field and overrides only: its
    # digits alone would garble every text.
    small = flatten(redacted(compose(["privacy.secure_seed=1", "tracking.run_name=BatchNorm1d-1"])))
    assert small["privacy.secure_seed"] == "<redacted>" and small["tracking.run_name"] == "BatchNorm1d-1"
    conf = str(Path(__file__).resolve().parent.parent / "conf")
    with initialize_config_dir(config_dir=conf, version_base=None):
        hc = hydra_compose("config", ["privacy.secure_seed=5", "seed=3"], return_hydra_config=True)
    assert "privacy.secure_seed" in hc.hydra.job.config.override_dirname.exclude_keys
