"""Where a composed config runs: here (inline), on local processes (submitit), or on SLURM (submitit)."""

from __future__ import annotations

from omegaconf import DictConfig

from workbench.errors import WorkbenchError


def launch(cfg: DictConfig):
    if cfg.launcher.name == "inline":
        from workbench.run import train

        return train(cfg)
    raise WorkbenchError(f"launcher={cfg.launcher.name} is not available yet")
