"""Node semantics without a cluster: the SLURM nodelist, rank / local rank / node rank and the master address from each
launcher's environment, and which processes log and save with log_on_each_node / save_on_each_node."""

from __future__ import annotations

import pytest
import torch

from workbench import launch_distributed
from workbench.distributed import Dist, JobEnv, detect_env, expand_nodelist
from workbench.errors import WorkbenchError

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
               "MASTER_PORT", "SUBMITIT_EXECUTOR", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
               "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_JOB_ID",
               "SLURM_NTASKS_PER_NODE")


@pytest.fixture
def clean_env(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[1-3,5],gpu01", ["node1", "node2", "node3", "node5", "gpu01"]),
    ("gpu01", ["gpu01"]),
    ("n[08-10]", ["n08", "n09", "n10"]),          # zero padding kept
    ("n[8-10]", ["n8", "n9", "n10"]),             # none to keep
    ("r[1-2]n[3-4]", ["r1n3", "r1n4", "r2n3", "r2n4"]),
    ("x[0-1]-ib,y", ["x0-ib", "x1-ib", "y"]),     # text after the brackets
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),  # the two-node test cluster's own nodelist
    ("a, b", ["a", "b"]),
])
def test_nodelist_expands_as_scontrol_show_hostnames(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[1-3", "node1-3]", "node[3-1]", "node[a-b]"])
def test_a_malformed_nodelist_is_an_error_naming_it(bad):
    with pytest.raises(ValueError, match="nodelist"):
        expand_nodelist(bad)


def test_slurm_env_gives_ranks_node_and_the_first_host_as_master(clean_env):
    clean_env.setenv("SLURM_NTASKS", "4")
    clean_env.setenv("SLURM_PROCID", "3")
    clean_env.setenv("SLURM_LOCALID", "1")
    clean_env.setenv("SLURM_NODEID", "1")
    clean_env.setenv("SLURM_JOB_NUM_NODES", "2")
    clean_env.setenv("SLURM_JOB_NODELIST", "gpu[07-08]")
    clean_env.setenv("SLURM_JOB_ID", "42")
    env = detect_env()
    assert (env.source, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("slurm", 3, 4, 1, 2)
    assert (env.node_rank, env.num_nodes, env.master_addr) == (1, 2, "gpu07")


def test_slurm_env_with_an_unreadable_nodelist_fails_in_one_line(clean_env):
    for name, value in dict(SLURM_NTASKS="2", SLURM_PROCID="0", SLURM_JOB_NODELIST="gpu[07-").items():
        clean_env.setenv(name, value)
    with pytest.raises(WorkbenchError, match=r"SLURM_JOB_NODELIST='gpu\[07-'"):
        detect_env()


def test_submitit_env_gives_node_rank_and_master(clean_env):
    for name, value in dict(SUBMITIT_EXECUTOR="slurm", SLURM_JOB_ID="42", SLURM_PROCID="2", SLURM_LOCALID="0",
                            SLURM_NODEID="1", SLURM_NTASKS="4", SLURM_JOB_NUM_NODES="2", SLURM_NNODES="2",
                            SLURM_JOB_NODELIST="node[3-4]").items():
        clean_env.setenv(name, value)
    env = detect_env()
    assert (env.source, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("submitit", 2, 4, 0, 2)
    assert (env.node_rank, env.num_nodes, env.master_addr) == (1, 2, "node3")


def test_torchrun_env_gives_node_rank_from_group_rank(clean_env):
    for name, value in dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", GROUP_RANK="1",
                            MASTER_ADDR="10.0.0.1", MASTER_PORT="29500").items():
        clean_env.setenv(name, value)
    env = detect_env()
    assert (env.source, env.rank, env.local_rank, env.node_rank, env.num_nodes) == ("torchrun", 3, 1, 1, 2)
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 29500)


def test_a_submitit_task_that_exported_torchrun_variables_keeps_its_slurm_node(clean_env):
    """workbench's SLURM job exports submitit's TorchDistributedEnvironment (RANK, LOCAL_RANK, ... but no node rank)."""
    for name, value in dict(RANK="2", WORLD_SIZE="4", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="node3",
                            MASTER_PORT="20042", SUBMITIT_EXECUTOR="slurm", SLURM_NODEID="1").items():
        clean_env.setenv(name, value)
    env = detect_env()
    assert (env.rank, env.local_rank, env.node_rank, env.num_nodes, env.master_addr) == (2, 0, 1, 2, "node3")


def test_without_a_node_variable_ranks_fill_nodes_in_blocks(clean_env):
    for name, value in dict(RANK="5", WORLD_SIZE="6", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2").items():
        clean_env.setenv(name, value)
    assert (detect_env().node_rank, detect_env().num_nodes) == (2, 3)


def test_one_process_is_node_zero_of_one(clean_env):
    env = detect_env()
    assert (env.rank, env.world_size, env.node_rank, env.num_nodes) == (0, 1, 0, 1)


def _layout(nodes: int, per_node: int) -> list[JobEnv]:
    world = nodes * per_node
    return [JobEnv(rank=r, world_size=world, local_rank=r % per_node, local_world_size=per_node,
                   node_rank=r // per_node, num_nodes=nodes) for r in range(world)]


@pytest.mark.parametrize("on_each_node, expected", [(True, {0, 2, 4}), (False, {0})])
def test_log_and_save_on_each_node_act_once_per_node(on_each_node, expected):
    """3 nodes x 2 processes: each node's local rank 0 (ranks 0, 2, 4), not every process and not only rank 0."""
    dists = [Dist(e, "gloo", torch.device("cpu"), False, log_on_each_node=on_each_node, save_on_each_node=on_each_node)
             for e in _layout(3, 2)]
    assert {d.rank for d in dists if d.should_log} == expected
    assert {d.rank for d in dists if d.should_save} == expected
    assert sorted(d.node_rank for d in dists if d.should_save) == sorted({d.node_rank for d in dists if d.rank in expected})


def test_no_node_check_without_save_on_each_node_or_with_one_node(tmp_path):
    """No collective is started (there is no process group here): the check returns before any."""
    for env, save in [(_layout(2, 2)[1], False), (_layout(1, 2)[1], True)]:
        Dist(env, "gloo", torch.device("cpu"), False, save_on_each_node=save).check_node_folders(tmp_path)
    assert list(tmp_path.iterdir()) == []


def _node_folder_check(folders: list[str]) -> str:
    """Each rank plays a node of its own (node rank = rank, one process per node) with its own output_dir."""
    import os

    os.environ.update(GROUP_RANK=os.environ["RANK"], LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    from workbench.distributed import setup, teardown

    d = setup("gloo", save_on_each_node=True)
    try:
        assert (d.node_rank, d.num_nodes, d.should_save) == (d.rank, 2, True)
        try:
            d.check_node_folders(folders[d.rank])
            return "ok"
        except WorkbenchError as e:
            return str(e)
    finally:
        d.barrier()
        teardown(d)


@pytest.mark.slow
def test_save_on_each_node_refuses_a_folder_the_nodes_share(tmp_path):
    shared = str(tmp_path / "shared")
    messages = launch_distributed(_node_folder_check, 2, [shared, shared])
    assert len(set(messages)) == 1 and "the 2 nodes share output_dir" in messages[0]
    assert "save_on_each_node=false" in messages[0]
    assert list((tmp_path / "shared").iterdir()) == []  # the probes are gone


@pytest.mark.slow
def test_save_on_each_node_accepts_a_folder_of_its_own_per_node(tmp_path):
    own = [str(tmp_path / "node0-disk"), str(tmp_path / "node1-disk")]
    assert launch_distributed(_node_folder_check, 2, own) == ["ok", "ok"]
    assert all(list((tmp_path / name).iterdir()) == [] for name in ("node0-disk", "node1-disk"))
