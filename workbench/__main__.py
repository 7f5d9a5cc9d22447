"""``python -m workbench [overrides]``: compose the config with Hydra and hand it to the launcher."""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig

from workbench import config
from workbench.errors import WorkbenchError

config.register()


@hydra.main(version_base="1.3", config_path=str(config.CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    from workbench.launch import launch
    from workbench.sweep import point_configs

    from workbench.interrupt import Interrupted, resume_hint

    try:
        for job_cfg in point_configs(cfg):  # one; under sweep.tuning=random_stopping, the trials drawn for this point
            launch(job_cfg)
    except WorkbenchError as e:  # Hydra would print a traceback: bad input gets one line and exit code 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except Interrupted as e:  # SIGTERM / SIGINT: one line, the shell's exit code for that signal
        if os.environ.get("RANK", "0") == "0":  # the job's one line, not one per rank
            print(resume_hint(e, [a for a in sys.argv[1:] if not a.startswith(("hydra.", "hydra/"))]), file=sys.stderr)
        sys.exit(128 + e.signum)


def _non_zero_rank_overrides() -> list[str]:
    """Under torchrun/srun every rank runs this entry point; only rank 0 gets a Hydra run folder and log file."""
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID")
    if rank in (None, "", "0") or "-m" in sys.argv[1:] or "--multirun" in sys.argv[1:]:
        return []
    return ["hydra.output_subdir=null", "hydra/job_logging=stdout", "hydra.run.dir=."]


def cli() -> int:
    sys.argv += _non_zero_rank_overrides()
    main()
    return 0


if __name__ == "__main__":
    sys.exit(cli())
