"""Where this process stands in the job: environment detection, the backend matrix, the process group, rank gating,
gathers, and collective phases whose failure on one rank reaches every rank."""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import logging
import os
import re
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from workbench.errors import TrainingStopped, WorkbenchError

log = logging.getLogger(__name__)

FIRST_CLASS_BACKENDS = ("nccl", "gloo", "mpi")
# Vendor backends accepted for parity with Hugging Face; each needs its vendor's torch extension.
VENDOR_BACKENDS = {
    "xccl": ("Intel XPU", None),
    "hccl": ("Ascend NPU", "torch_npu"),
    "cncl": ("Cambricon MLU", "torch_mlu"),
    "mccl": ("Moore Threads MUSA", "torch_musa"),
}
BACKENDS = ("auto",) + FIRST_CLASS_BACKENDS + tuple(VENDOR_BACKENDS)


@dataclass(frozen=True)
class JobEnv:
    """Rank layout of this process, and where it came from. A node is one machine (one slurmd, one torchrun agent):
    ``node_rank`` of ``num_nodes``; ``local_rank`` counts the processes on this node from 0."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    source: str = "single"  # torchrun | submitit | slurm | single
    node_rank: int = 0
    num_nodes: int = 1


def _int_env(name: str, default: int | None = None) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def expand_nodelist(nodelist: str) -> list[str]:
    """A SLURM hostlist expanded as ``scontrol show hostnames`` does, in its order: ``node[1-3,5],gpu01`` -> node1,
    node2, node3, node5, gpu01; zero padding kept (``n[08-10]`` -> n08, n09, n10); several bracket groups in one name
    multiply out (``r[1-2]n[1-2]`` -> r1n1, r1n2, r2n1, r2n2); duplicates are kept, as scontrol keeps them."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_host(item))
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets (and on whitespace, which scontrol also accepts)."""
    items, depth, current = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in nodelist {text!r}")
        if depth == 0 and (ch == "," or ch.isspace()):
            if current:
                items.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth:
        raise ValueError(f"unbalanced '[' in nodelist {text!r}")
    if current:
        items.append("".join(current))
    return items


def _expand_host(item: str) -> list[str]:
    found = re.search(r"\[([^\]]*)\]", item)
    if found is None:
        return [item]
    prefix, rest = item[: found.start()], item[found.end():]
    tails = _expand_host(rest)
    out = []
    for part in found.group(1).split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = part.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise ValueError(f"bad range {part!r} in nodelist item {item!r}")
            width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
            numbers = [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
        elif part.isdigit():
            numbers = [part]
        else:
            raise ValueError(f"bad entry {part!r} in nodelist item {item!r}")
        out.extend(prefix + n + tail for n in numbers for tail in tails)
    return out


def _slurm_master_addr() -> str:
    """The first host of the job's nodelist (as ``scontrol show hostnames $SLURM_JOB_NODELIST | head -1``)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        return socket.gethostname()
    try:
        return expand_nodelist(nodelist)[0]
    except (ValueError, IndexError) as e:
        raise WorkbenchError(f"cannot read the master address from SLURM_JOB_NODELIST={nodelist!r}: {e}") from None


def _node_rank(rank: int, local_world_size: int) -> int:
    """The node of a process whose rank came in torchrun's variables: torchrun's GROUP_RANK (its agent's rank), else
    NODE_RANK, else, in a submitit task (whose job environment exported RANK and friends), SLURM's SLURM_NODEID, else
    the block layout every launcher here uses (ranks fill a node before the next)."""
    for name in ("GROUP_RANK", "NODE_RANK") + (("SLURM_NODEID",) if os.environ.get("SUBMITIT_EXECUTOR") else ()):
        value = _int_env(name)
        if value is not None:
            return value
    return rank // max(1, local_world_size)


def detect_env() -> JobEnv:
    """torchrun's env, else submitit's job environment, else SLURM's env, else one process."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world, local_world = _int_env("WORLD_SIZE"), _int_env("LOCAL_WORLD_SIZE", _int_env("WORLD_SIZE"))
        return JobEnv(
            rank=_int_env("RANK"), world_size=world, local_rank=_int_env("LOCAL_RANK", 0),
            local_world_size=local_world,
            master_addr=os.environ.get("MASTER_ADDR"), master_port=_int_env("MASTER_PORT"), source="torchrun",
            node_rank=_node_rank(_int_env("RANK"), local_world),
            num_nodes=max(1, world // max(1, local_world)),  # torchrun's nodes (agents) all run as many processes
        )
    if os.environ.get("SUBMITIT_EXECUTOR"):
        import submitit

        env = submitit.JobEnvironment()
        job_id = "".join(c for c in str(env.job_id) if c.isdigit()) or "0"
        return JobEnv(
            rank=env.global_rank, world_size=env.num_tasks, local_rank=env.local_rank,
            local_world_size=env.num_tasks // max(1, env.num_nodes),
            master_addr=env.hostnames[0] if env.num_nodes > 1 else "127.0.0.1",
            master_port=_int_env("MASTER_PORT", 20000 + int(job_id) % 20000), source="submitit",
            node_rank=env.node, num_nodes=env.num_nodes,
        )
    if _int_env("SLURM_NTASKS", 1) > 1 and "SLURM_PROCID" in os.environ:
        ntasks = _int_env("SLURM_NTASKS")
        nnodes = _int_env("SLURM_JOB_NUM_NODES", _int_env("SLURM_NNODES", 1))
        return JobEnv(
            rank=_int_env("SLURM_PROCID"), world_size=ntasks, local_rank=_int_env("SLURM_LOCALID", 0),
            local_world_size=_int_env("SLURM_NTASKS_PER_NODE", ntasks // max(1, nnodes)), master_addr=_slurm_master_addr(),
            master_port=_int_env("MASTER_PORT", 20000 + _int_env("SLURM_JOB_ID", 0) % 20000), source="slurm",
            node_rank=_int_env("SLURM_NODEID", 0), num_nodes=nnodes,
        )
    return JobEnv()


def resolve_backend(name: str) -> str:
    """Map ``ddp_backend`` to a backend this machine can run, or fail with one line naming what is missing."""
    if name not in BACKENDS:
        raise WorkbenchError(f"ddp_backend={name!r} is unknown; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if name == "nccl":
        if not dist.is_nccl_available():
            raise WorkbenchError("ddp_backend=nccl needs a torch built with NCCL; this torch has no NCCL (CPU build?)")
        if not torch.cuda.is_available():
            raise WorkbenchError("ddp_backend=nccl needs CUDA GPUs, but none is visible (torch.cuda.is_available() is False)")
    elif name == "gloo":
        if not dist.is_gloo_available():
            raise WorkbenchError("ddp_backend=gloo is not available in this torch build")
    elif name == "mpi":
        if not dist.is_mpi_available():
            raise WorkbenchError("ddp_backend=mpi needs a torch built with MPI; this torch has no MPI support")
    elif name == "xccl":
        xpu = getattr(torch, "xpu", None)
        if not (getattr(dist, "is_xccl_available", lambda: False)() and xpu is not None and xpu.is_available()):
            raise WorkbenchError("ddp_backend=xccl needs Intel XPU devices and a torch built with XCCL; neither is present")
    else:
        device, package = VENDOR_BACKENDS[name]
        if importlib.util.find_spec(package) is None:
            raise WorkbenchError(f"ddp_backend={name} needs the {device} runtime: the Python package {package!r} is not installed")
    return name


def device_type(backend: str) -> str:
    """The kind of device a (resolved) backend's ranks compute on."""
    return {"nccl": "cuda", "xccl": "xpu"}.get(backend, "cpu")


def device_for(backend: str, local_rank: int) -> torch.device:
    """One process per device: the local rank picks it."""
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    kind = device_type(backend)
    return torch.device(kind, local_rank) if kind != "cpu" else torch.device("cpu")


class Dist:
    """This process's place in the job and the few collectives the trainer uses. Works unchanged with one process."""

    def __init__(self, env: JobEnv, backend: str, device: torch.device, owns_group: bool,
                 log_on_each_node: bool = True, save_on_each_node: bool = False):
        self.env, self.backend, self.device, self.owns_group = env, backend, device, owns_group
        self.rank, self.world_size, self.local_rank = env.rank, env.world_size, env.local_rank
        self.node_rank, self.num_nodes = env.node_rank, env.num_nodes
        self.is_main = self.rank == 0
        self.is_local_main = self.local_rank == 0  # one process per node: each node's local rank 0
        self.save_on_each_node = save_on_each_node
        # Once per node (local rank 0 of each node) with the *_on_each_node options, else once per job (rank 0).
        self.should_log = self.is_local_main if log_on_each_node else self.is_main
        self.should_save = self.is_local_main if save_on_each_node else self.is_main

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(tensor)
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's rows in rank order; ranks may hold different row counts (padded, then trimmed)."""
        if not self.distributed:
            return tensor
        count = torch.tensor([tensor.shape[0]], device=self.device)
        counts = [torch.zeros_like(count) for _ in range(self.world_size)]
        dist.all_gather(counts, count)
        counts = [int(c) for c in counts]
        padded = tensor.new_zeros((max(counts),) + tuple(tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        return torch.cat([p[:c] for p, c in zip(parts, counts)])

    def gather_payload(self, payload: Any, force_object: bool = False) -> Any:
        """Gather a tensor (fast path) or any picklable payload (object path) from every rank, in rank order.

        The tensor path needs every rank's tensor to agree beyond the batch dimension (shape and dtype); ranks decide
        together, so a ragged payload on one rank sends every rank down the object path.
        """
        if not self.distributed:
            return payload
        signature = (tuple(payload.shape[1:]), str(payload.dtype)) if isinstance(payload, torch.Tensor) else None
        signatures = self.all_gather_object(None if force_object else signature)
        if signature is not None and all(s == signature for s in signatures):
            return self.all_gather_rows(payload.to(self.device)).cpu()
        parts = self.all_gather_object(payload.cpu() if isinstance(payload, torch.Tensor) else payload)
        return concat_parts(parts)

    @contextlib.contextmanager
    def collective_phase(self, name: str) -> Iterator[None]:
        """Run a phase on every rank; if it fails anywhere, raise on every rank, naming the failing ranks and errors.

        Every rank reaches the closing all-gather whatever happened, so one rank's failure is an error, never a hang.
        """
        error: BaseException | None = None
        try:
            yield
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = e
        report = None if error is None else (str(error) if isinstance(error, WorkbenchError) else repr(error),
                                             isinstance(error, WorkbenchError), isinstance(error, TrainingStopped))
        failures = [(r, rep) for r, rep in enumerate(self.all_gather_object(report)) if rep is not None]
        if failures:
            detail = "; ".join(f"rank {r}: {msg}" for r, (msg, _, _) in failures)
            # Refusals that explain themselves (a full disk, say) stay one line, and a run that had to stop stays one
            # (exit 1, not bad input's 2); anything else keeps its traceback.
            kind = RuntimeError if not all(known for _, (_, known, _) in failures) else \
                TrainingStopped if any(stopped for _, (_, _, stopped) in failures) else WorkbenchError
            raise kind(f"{name} failed on {detail}") from error

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def check_node_folders(self, output_dir: Path) -> None:
        """With ``save_on_each_node`` on several nodes, each node writes its checkpoints into its own ``output_dir``;
        refuse (on every rank alike) when that folder is one folder shared by the nodes (a network file system),
        where they would write the same files. Each node's local rank 0 leaves a probe file there; a node that sees
        another node's probe is sharing the folder. No collective when the option is off or there is one node."""
        if not (self.save_on_each_node and self.num_nodes > 1 and self.distributed):
            return
        token = self.broadcast_object(uuid.uuid4().hex[:12] if self.is_main else None)
        probe = Path(output_dir) / f".node-probe-{token}-node{self.node_rank}"
        error = None
        if self.is_local_main:
            try:
                Path(output_dir).mkdir(parents=True, exist_ok=True)
                probe.write_text(str(self.node_rank))
            except OSError as e:
                error = f"node {self.node_rank} cannot write to {output_dir}: {e}"
        self.barrier()  # every node's probe is written before any node looks
        seen = sorted(p.name for p in Path(output_dir).glob(f".node-probe-{token}-node*")) if self.is_local_main else []
        views = self.all_gather_object((error, len(seen)))
        if self.is_local_main:
            probe.unlink(missing_ok=True)
        errors = [e for e, _ in views if e]
        if errors:
            raise WorkbenchError(errors[0])
        shared = max(n for _, n in views)
        if shared > 1:
            raise WorkbenchError(
                f"save_on_each_node=true, but the {self.num_nodes} nodes share output_dir {output_dir} (each sees "
                "the others' files): they would write the same checkpoint files; set save_on_each_node=false (rank 0 "
                "writes one copy) or give each node an output_dir on its own local disk")


def pad_concat(chunks: list[torch.Tensor], empty: torch.Tensor) -> torch.Tensor:
    """Tensors in order along dim 0 (``empty`` when there are none); chunks padded to different lengths (text batches)
    are padded to the longest with -100, as Hugging Face does. Empty chunks (a rank or batch with no examples) carry no
    shape to agree with and are left out."""
    chunks = [c for c in chunks if c.shape[0] > 0]
    if not chunks:
        return empty
    shape = [max(sizes) for sizes in zip(*(c.shape[1:] for c in chunks))]
    if all(list(c.shape[1:]) == shape for c in chunks):
        return torch.cat(chunks)
    out = torch.full((sum(len(c) for c in chunks), *shape), -100, dtype=chunks[0].dtype)
    start = 0
    for c in chunks:
        out[(slice(start, start + len(c)), *(slice(0, k) for k in c.shape[1:]))] = c
        start += len(c)
    return out


def concat_parts(parts: list[Any]) -> Any:
    """Concatenate per-rank payloads: tensors and arrays along dim 0, lists by extension, dicts key-wise."""
    import numpy as np

    first = next((p for p in parts if p is not None), None)
    if isinstance(first, torch.Tensor):
        return pad_concat([p for p in parts if p is not None], first)
    if isinstance(first, np.ndarray):
        return np.concatenate([p for p in parts if p is not None])
    if isinstance(first, dict):
        return {k: concat_parts([p[k] for p in parts]) for k in first}
    out: list[Any] = []
    for p in parts:
        out.extend(p)
    return out


def setup(ddp_backend: str, ddp_timeout: int = 1800, log_on_each_node: bool = True,
          save_on_each_node: bool = False) -> Dist:
    """Join the process group started outside us, or start one when the environment says there are several ranks."""
    if dist.is_available() and dist.is_initialized():
        actual = dist.get_backend()
        if ddp_backend != "auto" and actual != ddp_backend:
            raise WorkbenchError(
                f"the process group was started outside workbench with backend {actual!r}, but ddp_backend={ddp_backend!r}; "
                "make them agree"
            )
        env = detect_env()
        env = JobEnv(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=env.local_rank,
                     local_world_size=env.local_world_size, source=env.source if env.source != "single" else "external",
                     node_rank=env.node_rank, num_nodes=env.num_nodes)
        backend = resolve_backend(actual)
        return Dist(env, backend, device_for(backend, env.local_rank), False, log_on_each_node, save_on_each_node)
    backend = resolve_backend(ddp_backend)
    env = detect_env()
    device = device_for(backend, env.local_rank)
    if env.world_size > 1:
        if env.master_addr:
            os.environ["MASTER_ADDR"] = env.master_addr
        if env.master_port:
            os.environ["MASTER_PORT"] = str(env.master_port)
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                                timeout=datetime.timedelta(seconds=ddp_timeout),
                                device_id=device if backend == "nccl" else None)
    return Dist(env, backend, device, env.world_size > 1, log_on_each_node, save_on_each_node)


def store():
    """The process group's key-value store (under torchrun, its agent's: it outlives any rank)."""
    return dist.distributed_c10d._get_default_store()


def teardown(d: Dist | None) -> None:
    if d is not None and d.owns_group and dist.is_initialized():
        dist.destroy_process_group()
