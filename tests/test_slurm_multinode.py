"""Two nodes under a real SLURM on one machine (tests/slurm_cluster.py, ``slurm_two_nodes``: two ``slurmd -N``
daemons, nodes 127.0.0.1 and 127.0.0.2) and under torchrun (two agents with a c10d rendezvous on 127.0.0.1).

What differs between nodes is what is checked: the master address from the nodelist, node ranks and node-local
ranks, a run of world size 4 over 2 nodes x 2 tasks that equals the accounting done here with dp-accounting, the
parameters identical on every rank of both nodes, rank 0 alone writing to MLflow, logging once per node.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import REPO, run_cli
from tests.test_distributed import _direct_epsilon
from workbench.distributed import expand_nodelist

pytestmark = pytest.mark.slow

NODES = ["127.0.0.1", "127.0.0.2"]


class NodeReport:
    """A callback (``callbacks=[{_target_: tests.test_slurm_multinode.NodeReport, folder: ...}]``) run on every rank:
    at the end of training it writes where this rank ran and a digest of its parameters to ``folder/rank<R>.json``."""

    def __init__(self, folder: str):
        self.folder = Path(folder)

    def on_train_end(self, state) -> None:
        from workbench.distributed import detect_env

        env = detect_env()
        digest = hashlib.sha256()
        for p in state.model.parameters():
            digest.update(p.detach().cpu().contiguous().numpy().tobytes())
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"rank{env.rank}.json").write_text(json.dumps({
            "rank": env.rank, "world_size": env.world_size, "local_rank": env.local_rank, "node_rank": env.node_rank,
            "num_nodes": env.num_nodes, "master_addr": env.master_addr, "params": digest.hexdigest(),
            "slurmd": os.environ.get("SLURMD_NODENAME"), "slurm_nodeid": os.environ.get("SLURM_NODEID"),
            "group_rank": os.environ.get("GROUP_RANK"),
        }))


def eval_in_dataset_order(pred) -> dict:
    """compute_metrics for experiment=quick: whether the cluster-wide gathered labels are the eval set's, in its order
    (conf/data/synthetic.yaml: Synthetic(size=512, seed=1)), with no padded duplicates."""
    import numpy as np

    from workbench.data import Synthetic
    from workbench.metrics import accuracy

    expected = Synthetic(size=512, in_features=64, num_classes=10, seed=1).tensors[1].numpy()
    labels = np.asarray(pred.label_ids)
    return {**accuracy(pred), "gathered": float(len(labels)),
            "in_dataset_order": float(labels.shape == expected.shape and np.array_equal(labels, expected))}


def _reports(folder: Path, world_size: int) -> list[dict]:
    reports = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world_size)]
    assert [r["rank"] for r in reports] == list(range(world_size))
    return reports


def _callback(folder: Path) -> str:
    return f"callbacks=[{{_target_:tests.test_slurm_multinode.NodeReport,folder:'{folder}'}}]"


def _one_run(uri: str):
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("workbench").experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]  # one run per job, not one per rank or per node
    return client, runs[0]


def _rank_zero_alone_logged(client, run) -> None:
    """Every rank holds the same learning rate at each step; had another rank logged too, a step would appear twice."""
    history = client.get_metric_history(run.info.run_id, "learning_rate")
    steps = [m.step for m in history]
    assert steps and len(steps) == len(set(steps)), steps


def test_two_slurmd_daemons_make_two_nodes(slurm_two_nodes):
    r = slurm_two_nodes.run_cmd("sinfo", "-h", "-N", "-o", "%N %t")
    assert sorted(line.split()[0] for line in r.stdout.splitlines()) == NODES
    assert {line.split()[1].rstrip("*") for line in r.stdout.splitlines()} == {"idle"}
    r = slurm_two_nodes.run_cmd("srun", "-N", "2", "--ntasks-per-node=2", "bash", "-c",
                                'echo "$SLURM_PROCID $SLURM_NODEID $SLURM_LOCALID $SLURMD_NODENAME $SLURM_JOB_NODELIST"')
    rows = sorted(line.split() for line in r.stdout.splitlines())
    assert rows == [["0", "0", "0", "127.0.0.1", "127.0.0.[1-2]"], ["1", "0", "1", "127.0.0.1", "127.0.0.[1-2]"],
                    ["2", "1", "0", "127.0.0.2", "127.0.0.[1-2]"], ["3", "1", "1", "127.0.0.2", "127.0.0.[1-2]"]]


@pytest.mark.parametrize("nodelist", ["127.0.0.[1-2]", "node[1-3,5],gpu01", "n[08-10],x[1-2]y[3-4]", "a,b[9-11]"])
def test_nodelist_expander_agrees_with_scontrol(slurm_two_nodes, nodelist):
    out = slurm_two_nodes.run_cmd("scontrol", "show", "hostnames", nodelist).stdout.split()
    assert expand_nodelist(nodelist) == out


@pytest.mark.parametrize("shard, log_on_each_node, logging_ranks", [("per_rank", True, [0, 2]), ("global", False, [0])])
def test_two_nodes_two_tasks_each_are_one_run_of_world_size_four(slurm_two_nodes, tmp_path, shard, log_on_each_node,
                                                                 logging_ranks):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    reports = tmp_path / "reports"
    proc = run_cli("launcher=slurm", "launcher.nodes=2", "launcher.tasks_per_node=2", "backend=gloo",
                   "experiment=quick", f"shard={shard}", f"log_on_each_node={str(log_on_each_node).lower()}",
                   "disable_tqdm=false", _callback(reports), "compute_metrics=tests.test_slurm_multinode.eval_in_dataset_order",
                   cwd=tmp_path, env={"MLFLOW_TRACKING_URI": uri})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    job_id = proc.stdout.split("submitted job ")[1].split()[0]
    assert slurm_two_nodes.wait_state(job_id, "COMPLETED", timeout=60) == "COMPLETED"
    nodes_of_job = slurm_two_nodes.run_cmd("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "NNodes,NodeList").stdout
    assert nodes_of_job.split() == ["2|127.0.0.[1-2]"]

    client, run = _one_run(uri)
    m = run.data.metrics
    assert run.info.status == "FINISHED" and m["world_size"] == 4 and run.data.tags["world_size"] == "4"
    assert run.data.tags["job_id"] == job_id and run.data.tags["ddp_shard"] == shard
    # q from the config (experiment=quick: 64 per process, synthetic N = 2048, no tail at W = 4), not read back
    q = 64 * 4 / 2048 if shard == "per_rank" else 64 * 4 / (4 * 2048)
    assert m["sample_rate"] == pytest.approx(q)
    assert m["epsilon"] == pytest.approx(_direct_epsilon({**m, "sample_rate": q}, shard, 4), rel=1e-6)
    _rank_zero_alone_logged(client, run)
    # the eval gather over both nodes: every eval example once, in dataset order
    assert (m["eval_gathered"], m["eval_in_dataset_order"]) == (512, 1.0), {k: v for k, v in m.items() if "eval" in k}

    ranks = _reports(reports, 4)
    assert [(r["slurmd"], r["node_rank"], r["local_rank"]) for r in ranks] == [
        ("127.0.0.1", 0, 0), ("127.0.0.1", 0, 1), ("127.0.0.2", 1, 0), ("127.0.0.2", 1, 1)]
    assert all(r["slurm_nodeid"] == str(r["node_rank"]) and r["num_nodes"] == 2 for r in ranks)
    assert {r["master_addr"] for r in ranks} == {"127.0.0.1"}  # the nodelist's first host, on both nodes
    assert len({r["params"] for r in ranks}) == 1  # identical parameters on all four ranks, both nodes

    logs = sorted(p.name for p in tmp_path.rglob("*_log.out"))
    assert logs == [f"{job_id}_{r}_log.out" for r in range(4)]  # every rank's output is kept
    # log_on_each_node: the progress bar (stderr) on each node's local rank 0, else on rank 0 alone
    bars = [r for r in range(4) if "train: 100%" in next(tmp_path.rglob(f"{job_id}_{r}_log.err")).read_text()]
    assert bars == logging_ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_nodes_are_one_run_with_node_ranks(tmp_path):
    """Two torchrun agents (``--nnodes=2 --node-rank=0/1``, one process each) meet at a c10d rendezvous on 127.0.0.1."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    reports = tmp_path / "reports"
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": uri}
    for name in [k for k in env if k.startswith("SLURM_")]:
        env.pop(name)
    # The run folder is chosen by rank 0 and broadcast; the MLflow store is made before either agent starts
    # (two processes creating one SQLite store at once race in its migration).
    MlflowClient(tracking_uri=uri).create_experiment("workbench")
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", f"--node-rank={node}",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=wbtest", "-m", "workbench",
         "backend=gloo", "experiment=quick", "disable_tqdm=false", _callback(reports),
         "compute_metrics=tests.test_slurm_multinode.eval_in_dataset_order"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    outputs = [a.communicate(timeout=600) for a in agents]
    for agent, (out, err) in zip(agents, outputs):
        assert agent.returncode == 0, out[-2000:] + err[-3000:]

    client, run = _one_run(uri)
    m = run.data.metrics
    assert run.info.status == "FINISHED" and m["world_size"] == 2 and run.data.tags["world_size"] == "2"
    q = 64 * 2 / 2048
    assert m["epsilon"] == pytest.approx(_direct_epsilon({**m, "sample_rate": q}, "per_rank", 2), rel=1e-6)
    _rank_zero_alone_logged(client, run)
    assert (m["eval_gathered"], m["eval_in_dataset_order"]) == (512, 1.0)
    # log_on_each_node=true (the default): each node's one process is its local rank 0, so both show progress
    assert all("train: 100%" in err for _, err in outputs), [err[-500:] for _, err in outputs]
    ranks = _reports(reports, 2)
    # rendezvous decides which agent is which node; each process's node rank is its agent's GROUP_RANK
    assert sorted((r["node_rank"], r["local_rank"], r["num_nodes"]) for r in ranks) == [(0, 0, 2), (1, 0, 2)]
    assert all(r["group_rank"] == str(r["node_rank"]) for r in ranks)
    assert len({r["params"] for r in ranks}) == 1
    assert len(list((tmp_path / "outputs").glob("*/*"))) == 1  # one run folder for the job


# --------------------------------------------------------------------------- faults across nodes

LONG_ARGS = ["experiment=quick", "data.train._target_=tests.plugins.SlowSynthetic", "save_steps=5",
             "disable_tqdm=true", "privacy.secure_seed=99"]


def _node_tasks(job_id: str, node: int) -> list[int]:
    """PIDs of the job's task processes (submitit's workers) that run on node ``node``, found by their environment."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = dict(item.split("=", 1) for item in Path(f"/proc/{entry}/environ").read_text().split("\0") if "=" in item)
            cmdline = Path(f"/proc/{entry}/cmdline").read_text()
        except OSError:
            continue
        if env.get("SLURM_JOB_ID") == job_id and env.get("SLURM_NODEID") == str(node) and "submitit" in cmdline \
                and "SLURM_STEP_ID" in env:
            pids.append(int(entry))
    return pids


def _submitted(proc) -> str:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout.split("submitted job ")[1].split()[0]


def test_a_node_lost_mid_run_ends_the_run_failed_on_the_other_node(slurm_two_nodes, tmp_path):
    """SIGKILL to node 127.0.0.2's tasks mid-run: node 0's ranks fail their next collective (never a hang: the wait
    below only guards against one) and rank 0 ends the MLflow run FAILED; the job ends FAILED."""
    import signal
    import time

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_dir = tmp_path / "run"
    proc = run_cli("launcher=slurm", "launcher.nodes=2", "launcher.tasks_per_node=1", "backend=gloo", "launcher.wait=false",
                   "ddp_timeout=120", "max_steps=2000", f"output_dir={run_dir}", *LONG_ARGS, cwd=tmp_path,
                   env={"MLFLOW_TRACKING_URI": uri, "WB_FETCH_SLEEP": "0.2"})
    job_id = _submitted(proc)
    from workbench import checkpoint

    while not checkpoint.list_checkpoints(run_dir):  # training runs on both nodes
        assert slurm_two_nodes.job_state(job_id).split()[0] in ("PENDING", "RUNNING"), slurm_two_nodes.job_state(job_id)
        time.sleep(0.2)
    victims = _node_tasks(job_id, 1)
    assert victims, "node 127.0.0.2's task should be running"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    state = slurm_two_nodes.wait_state(job_id, ("FAILED", "CANCELLED", "COMPLETED", "TIMEOUT", "NODE_FAIL"), timeout=300)
    assert state.split()[0] == "FAILED", state
    client, run = _one_run(uri)
    assert run.info.status == "FAILED", run.info.status
    assert max(m.step for m in client.get_metric_history(run.info.run_id, "learning_rate")) < 2000  # it stopped mid-run


def _train_on_rank(overrides):
    from workbench import compose, train

    result = train(compose(overrides))
    return result.epsilon, result.steps


def test_a_preempted_two_node_job_requeues_and_resumes_bit_exactly(slurm_two_nodes, tmp_path, monkeypatch):
    """Preempted mid-run (submitit's USR2 path: checkpoint, scontrol requeue), the 2-node job resumes from its newest
    checkpoint and ends with the parameters and epsilon of an uninterrupted W=2 run (two local processes)."""
    import time

    import torch

    from workbench import checkpoint, compose, launch_distributed
    from workbench.launch import launch

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("WB_FETCH_SLEEP", "0.15")
    monkeypatch.chdir(tmp_path)
    args = [*LONG_ARGS, "max_steps=60", "backend=gloo"]
    # timeout_min > 10: submitit 1.5.4 counts any USR2 in a shorter job as a timeout, not a preemption.
    cfg = compose([*args, f"output_dir={tmp_path / 'preempted'}", "launcher=slurm", "launcher.nodes=2",
                   "launcher.tasks_per_node=1", "launcher.wait=false", "launcher.timeout_min=30"])
    job = launch(cfg)
    while not checkpoint.list_checkpoints(tmp_path / "preempted"):
        assert not job.done(), "the job ended without writing its first checkpoint"
        time.sleep(0.2)
    job._interrupt()
    slurm_two_nodes.release_requeued(job.job_id)
    results = job.results()
    assert slurm_two_nodes.requeue_count(job.job_id) == 1
    assert slurm_two_nodes.wait_state(job.job_id, "COMPLETED", timeout=60) == "COMPLETED"
    assert sorted(r["rank"] for r in results) == [0, 1]

    monkeypatch.setenv("WB_FETCH_SLEEP", "0")
    (eps, steps), _ = launch_distributed(_train_on_rank, 2, [*args, f"output_dir={tmp_path / 'whole'}"])
    main = next(r for r in results if r["rank"] == 0)
    assert main["epsilon"] == eps and main["steps"] == steps == 60
    a = checkpoint.load(checkpoint.list_checkpoints(tmp_path / "whole")[-1])
    b = checkpoint.load(checkpoint.list_checkpoints(tmp_path / "preempted")[-1])
    assert a["step"] == b["step"] == 60 and a["world_size"] == b["world_size"] == 2
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(main["run_id"])
    assert run.info.status == "FINISHED"
    steps_logged = [m.step for m in client.get_metric_history(run.info.run_id, "learning_rate")]
    assert sorted(steps_logged) == sorted(set(steps_logged)) == list(range(5, 61, 5))
