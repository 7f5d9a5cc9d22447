"""``python -m workbench [overrides]``: compose the config with Hydra and hand it to the launcher.

Bad input gets one ``error:`` line and exit code 2 before any work: the overrides are composed and validated (every
point of a sweep, and every combination the config alone decides: workbench/job.py's refuse_unsupported) before Hydra's
app starts, so a refused config leaves no run folder; a refusal that needs the data (found by the pre-run check inside
the job) removes the folder Hydra made for it. Under torchrun or srun only rank 0 prints the line; every rank exits 2.
"""

from __future__ import annotations

import gc

if __name__ == "__main__":  # the CLI's process only, not one that imports this module (a test)
    gc.disable()  # start-up makes objects that live as long as the job; workbench.run resumes collection for training

import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Sequence

import hydra
from omegaconf import DictConfig

from workbench import config
from workbench.errors import TrainingStopped, WorkbenchError

config.register()
_STARTED = time.time()  # files older than this are not this job's to remove


def _rank() -> str | None:
    """This process's rank under torchrun or srun (None: a single process)."""
    return os.environ.get("RANK") or os.environ.get("SLURM_PROCID")


# How long a rank > 0 that refused waits, under torchrun, for rank 0 to end the job (torchrun stops the other ranks
# within about a second of a rank's exit); past it, rank 0 did not refuse alike, and this rank says why itself.
PEER_REFUSAL_WAIT_S = 30.0


def refuse(error: WorkbenchError, alike: bool | None = None) -> None:
    """One line; exit 2 for bad input, 1 for a run that started and had to stop. Under torchrun or srun, a refusal
    every rank makes alike (``alike``: the config's checks, which are the same everywhere, or one the job found rank 0
    made too, ``error.alike``: workbench/interrupt.py's Peers.refused_alike) is said by rank 0 alone; under torchrun
    the others wait for it to stop them, so that none leaves first and has rank 0 stopped before it has said why.
    Anything else (a stop, a refusal of this rank's own data) every rank says, naming itself."""
    code = 1 if isinstance(error, TrainingStopped) else 2
    line = "error: " + " ".join(str(error).split())
    if _rank() not in (None, "", "0"):
        line = f"error: rank {_rank()}: " + line.removeprefix("error: ")
        if (getattr(error, "alike", False) if alike is None else alike) and not isinstance(error, TrainingStopped):
            if not os.environ.get("TORCHELASTIC_RUN_ID"):
                sys.exit(code)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun's stop ends this rank where it waits
            time.sleep(PEER_REFUSAL_WAIT_S)
    print(line, file=sys.stderr, flush=True)
    sys.exit(code)


@hydra.main(version_base="1.3", config_path=str(config.CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    from workbench.interrupt import Interrupted, resume_hint

    try:
        launch_or_clean_up(cfg, _hydra_run_dir())
    except WorkbenchError as e:  # Hydra would print a traceback: bad input gets one line and exit code 2
        refuse(e)
    except Interrupted as e:  # SIGTERM / SIGINT: one line, the shell's exit code for that signal
        if os.environ.get("RANK", "0") == "0":  # the job's one line, not one per rank
            print(resume_hint(e, [a for a in sys.argv[1:] if not a.startswith(("hydra.", "hydra/"))]), file=sys.stderr)
        # The run is already KILLED and its checkpoint whole: leave without the interpreter's teardown, where threads
        # still in C++ (torch, the epsilon schedule) can abort the process (seen once: exit -6 instead of 130).
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + e.signum)


def launch_or_clean_up(cfg: DictConfig, hydra_dir: Path | None = None):
    """launch() each config of this Hydra job; on a refusal, remove the folders this job created that hold nothing but
    Hydra's own files."""
    from workbench.launch import launch
    from workbench.sweep import point_configs

    created = _first_missing(Path(cfg.output_dir).expanduser().resolve()) if cfg.output_dir else None
    try:
        # One config; under sweep.tuning=random_stopping, the trials drawn for this point (maybe none).
        return [launch(job_cfg) for job_cfg in point_configs(cfg)]
    except WorkbenchError as e:
        if isinstance(e, TrainingStopped):  # a run exists: its folder (log, checkpoints) stays
            raise
        cwd = Path.cwd().resolve()
        for folder in (created, hydra_dir):  # never the working dir or above it (hydra.run.dir=. on ranks > 0)
            if folder is not None and folder.resolve() not in (cwd, *cwd.parents) and _only_bookkeeping(folder):
                shutil.rmtree(folder, ignore_errors=True)
                _prune_empty_parents(folder)
        raise


def _hydra_run_dir() -> Path | None:
    from hydra.core.hydra_config import HydraConfig

    try:
        path = Path(HydraConfig.get().runtime.output_dir)
    except ValueError:
        return None
    return path if path.is_dir() and path.stat().st_mtime >= _STARTED - 1 else None


def _first_missing(path: Path) -> Path | None:
    """The topmost folder of `path` that does not exist yet (what mkdir(parents=True) would create), if any."""
    missing = None
    for p in (path, *path.parents):
        if p.exists():
            return missing
        missing = p
    return missing


def _only_bookkeeping(folder: Path) -> bool:
    """Nothing but empty folders, Hydra's .hydra/ and log files, all written by this job: safe to remove."""
    if not folder.is_dir():
        return False
    for f in folder.rglob("*"):
        if f.is_dir():
            continue
        ours = ".hydra" in f.relative_to(folder).parts or f.suffix == ".log"
        if not ours or f.stat().st_mtime < _STARTED - 1:
            return False
    return True


def _prune_empty_parents(folder: Path) -> None:
    """Hydra's outputs/<date>/ and outputs/ when the removed run folder was all they held (never the working dir)."""
    cwd = Path.cwd().resolve()
    for parent in folder.resolve().parents:
        if parent == cwd or cwd not in parent.parents:
            return
        try:
            parent.rmdir()  # only if empty
        except OSError:
            return


def check_args(argv: Sequence[str]) -> list[DictConfig]:
    """Compose and validate what `python -m workbench argv` would run (each value of each swept key, with -m) before
    Hydra's app makes any folder. Raises WorkbenchError. Hydra's own flags (--help, --cfg, ...) are left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    from workbench.api import _one_line, compose

    multirun = any(a in ("-m", "--multirun") for a in argv)
    argv = list(argv)
    for i, a in reversed(list(enumerate(argv))):  # printing the config (--cfg job) checks the overrides too
        if a in ("--cfg", "-c", "--package", "-p") and i + 1 < len(argv):
            del argv[i:i + 2]
        elif a == "--resolve":
            del argv[i]
    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in argv):
        return []  # --help, --info, another config (-cn, -cp, -cd): Hydra's own business
    overrides = [a for a in argv if not a.startswith(("-", "hydra.", "+hydra.", "++hydra.", "~hydra."))]
    points = [overrides]
    if multirun:
        try:
            parsed = OverridesParser.create().parse_overrides(overrides)
        except OverrideParseException as e:
            raise WorkbenchError(_one_line(e, overrides)) from None
        first = [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" if o.is_sweep_override()
                 else o.input_line for o in parsed]
        points = [first]
        for i, o in enumerate(parsed):
            if o.is_sweep_override():
                points += [first[:i] + [f"{o.get_key_element()}={v}"] + first[i + 1:]
                           for v in list(o.sweep_string_iterator())[1:]]
    # Hydra's own launcher (hydra/launcher=submitit_slurm) may run the job elsewhere: its device is asked there
    elsewhere = any(a.split("=", 1)[0].lstrip("+") == "hydra/launcher" and a.split("=", 1)[-1] not in LOCAL_LAUNCHERS
                    for a in argv)
    configs = []
    for point in points:
        cfg = compose(point)
        config.validate(cfg)
        from workbench.job import refuse_unsupported  # torch: imported once the config is read
        refuse_unsupported(cfg, runs_here=not elsewhere)
        configs.append(cfg)
    config.check_shared_streams(configs)
    return configs


LOCAL_LAUNCHERS = ("basic", "submitit_local")  # Hydra launchers that run the job on this machine


def _non_zero_rank_overrides() -> list[str]:
    """Under torchrun/srun every rank runs this entry point; only rank 0 gets a Hydra run folder and log file."""
    rank = _rank()
    if rank in (None, "", "0") or "-m" in sys.argv[1:] or "--multirun" in sys.argv[1:]:
        return []
    return ["hydra.output_subdir=null", "hydra/job_logging=stdout", "hydra.run.dir=."]


def _prestart_tracking(configs: list[DictConfig]) -> None:
    """One job whose rank 0 tracks: its MLflow worker process starts now, importing MLflow on another core while this
    one imports torch and builds the job (workbench.tracking.worker.WorkerStore)."""
    rank = _rank()
    multirun = "-m" in sys.argv[1:] or "--multirun" in sys.argv[1:]  # its driver tracks in process (workbench.sweep)
    if len(configs) == 1 and not multirun and rank in (None, "", "0") and configs[0].tracking.enabled:
        from workbench.tracking.uris import tracking_uri
        from workbench.tracking.worker import prestart

        prestart(tracking_uri(configs[0].tracking.uri))


def cli() -> int:
    try:
        configs = check_args(sys.argv[1:])
    except WorkbenchError as e:
        refuse(e, alike=True)  # from the config alone: every rank refuses it alike
    _prestart_tracking(configs)
    sys.argv += _non_zero_rank_overrides()
    main()
    gc.freeze()  # the job is done: no collection over the whole heap while the interpreter tears down (~1.5 s)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
