"""The notebook API: the same config and trainer as the CLI, callable from Python.

    from workbench import compose, train
    cfg = compose(["privacy.target_epsilon=3", "tracking.experiment_name=notebook"])
    result = train(cfg)
    result.epsilon, result.metrics["eval_accuracy"], result.run_id
"""

from __future__ import annotations

import os
import re
import time
from typing import Any, Callable, Sequence

from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from workbench import config
from workbench.overrides import record_choices
from workbench.errors import WorkbenchError


def compose(overrides: Sequence[str] = (), config_name: str = "config") -> DictConfig:
    """Compose ``conf/`` with Hydra overrides, exactly as the CLI would. Safe to call again in a notebook cell.
    Hydra's own refusals (unknown key or group choice, wrong type, unparsable override) raise WorkbenchError."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    config.register()
    if GlobalHydra.instance().is_initialized():  # a previous cell (or an interrupted one) left Hydra initialised
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config.CONF_DIR), version_base="1.3"):
        try:
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
        except (HydraException, OmegaConfBaseException, ValueError) as e:
            raise WorkbenchError(_one_line(e, overrides)) from None
    overrides = OmegaConf.to_container(cfg.hydra.overrides.task)  # as typed: ${...} left unresolved
    record_choices(cfg, cfg.hydra.runtime.choices, overrides)  # as the CLI does: tags, each group's option
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def _one_line(e: Exception, overrides: Sequence[str]) -> str:
    """Hydra's 3-9 line composition errors as the one line a user needs."""
    from hydra.errors import MissingConfigException, OverrideParseException

    text = str(e)
    if isinstance(e, MissingConfigException) and (m := re.search(r"Could not find '(.+)/([^/']+)'", text)):
        group, choice = m.groups()
        options = re.findall(r"^\t(\S+)$", text.split("Available options", 1)[-1].split("Config search path", 1)[0], re.M)
        return f"{group}={choice} is unknown; choose one of {', '.join(options)}" if options else \
            f"{group}={choice} is unknown: there is no conf/{group}/{choice}.yaml"
    cause = e.__cause__
    if isinstance(cause, ConfigKeyError) or isinstance(cause, ConfigAttributeError):
        key = cause.full_key
        if key.split(".")[0] in config.USER_OBJECTS or key.startswith(("tracking.tags.", "launcher.additional_parameters.")):
            return f"{key} is not set in this config; add it with +{key}=... (a free-form node takes new keys)"
        return str(config.unknown_key(key))
    if isinstance(cause, ValidationError):
        return f"wrong type for {cause.full_key}: {str(cause).splitlines()[0]}"
    if isinstance(e, OverrideParseException):
        bad = next((o for o in overrides if _unparsable(o)), None)
        return f"cannot parse the override {bad!r}: {text.splitlines()[0]}" if bad else text.splitlines()[0]
    first = " ".join(text.split("\n")[0:2]) if text.startswith("Could not append") else text.splitlines()[0]
    return f"bad override: {first}" + (f": {str(cause).splitlines()[0]}" if cause is not None else "")


def _unparsable(override: str) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        OverridesParser.create().parse_override(override)
        return False
    except Exception:  # noqa: BLE001
        return True


_RENDEZVOUS: list = []  # rank 0's store server: alive as long as the worker, shared by its process groups


def _rendezvous_port(rank: int, world_size: int, results, ports) -> int:
    """Rank 0 binds the rendezvous store on a port the OS picks (port 0) and keeps it; the parent hands that port
    to the other ranks. No port is chosen first and bound later, so no other process can take it in between.
    ``init_process_group`` on rank 0 then shares this server (a multi-tenant TCPStore on the same port)."""
    if rank != 0:
        return ports.get()
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, world_size, is_master=True, multi_tenant=True, wait_for_workers=False)
    _RENDEZVOUS.append(store)
    results.put((0, "port", store.port))
    return store.port


def _worker(rank: int, world_size: int, ports, payload: bytes, results) -> None:
    import cloudpickle

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    port = _rendezvous_port(rank, world_size, results, ports)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
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
    results, ports = ctx.Queue(), ctx.Queue()
    payload = cloudpickle.dumps((fn, args, kwargs))
    procs = [ctx.Process(target=_worker, args=(r, nprocs, ports, payload, results), daemon=False) for r in range(nprocs)]
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
            if status == "port":  # rank 0's rendezvous store is up: tell the others where
                for _ in range(nprocs - 1):
                    ports.put(value)
            elif status == "ok":
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
