"""The notebook API: the same config and trainer as the CLI, callable from Python.

    from workbench import compose, train
    cfg = compose(["privacy.target_epsilon=3", "tracking.experiment_name=notebook"])
    result = train(cfg)
    result.epsilon, result.metrics["eval_accuracy"], result.run_id
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable, Sequence

from omegaconf import DictConfig, open_dict

from workbench import config


def compose(overrides: Sequence[str] = (), config_name: str = "config") -> DictConfig:
    """Compose ``conf/`` with Hydra overrides, exactly as the CLI would. Safe to call again in a notebook cell."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    config.register()
    if GlobalHydra.instance().is_initialized():  # a previous cell (or an interrupted one) left Hydra initialised
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config.CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
    config.record_choices(cfg, cfg.hydra.runtime.choices)  # as the CLI does: tags, and each group's option
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, payload: bytes, results) -> None:
    import cloudpickle

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    fn, args, kwargs = cloudpickle.loads(payload)
    try:
        results.put((rank, "ok", cloudpickle.dumps(fn(*args, **kwargs))))
    except BaseException as e:  # noqa: BLE001 - handed to the parent, which raises it
        import traceback

        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1)
    _exit_once_reported(results)


def _exit_once_reported(results) -> None:
    """Leave without the interpreter's teardown once the result is out: torch's C++ threads (gloo) can abort the
    process there ("terminate called without an active exception"), turning a finished rank into a failed one."""
    import sys

    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch_distributed(fn: Callable[..., Any], nprocs: int = 2, *args, timeout: float = 600, **kwargs) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` local processes that form one job (torchrun-style environment, so
    workbench.train inside joins a gloo/nccl group); return every rank's result, in rank order. ``fn`` may be defined
    in a notebook (it travels by cloudpickle)."""
    import multiprocessing as mp
    import queue

    import cloudpickle

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    payload = cloudpickle.dumps((fn, args, kwargs))
    procs = [ctx.Process(target=_worker, args=(r, nprocs, port, payload, results), daemon=False) for r in range(nprocs)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < nprocs:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                # A rank that died before reporting (killed, or crashed at start-up) fails the launch at once.
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in out and r not in errors]
                if dead:
                    errors[dead[0]] = f"exited with code {procs[dead[0]].exitcode} before returning a result"
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"launch_distributed: no result from some rank within {timeout} s") from None
                continue
            if status == "ok":
                out[rank] = cloudpickle.loads(value)
            else:
                errors[rank] = value
                break  # one rank failed: the others will fail or hang on their collectives; stop them below
    finally:
        for p in procs:
            p.join(timeout=30 if not errors else 5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        rank, message = sorted(errors.items())[0]
        raise RuntimeError(f"rank {rank} failed: {message}")
    return [out[r] for r in range(nprocs)]
