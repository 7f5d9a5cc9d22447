"""How many processes a launcher starts for one job, known before it starts them.

Below the launchers and the job: a sweep bounds each point's privacy with it before any point trains
(workbench/run.py, planned_mechanism), and the launcher sizes its executor with it (workbench/launch.py).
"""

from __future__ import annotations

import os

from omegaconf import DictConfig


def slurm_tasks_per_node(lc: DictConfig) -> int:
    return lc.tasks_per_node or (lc.gpus_per_node if lc.gpus_per_node else 1)


def planned_world_size(cfg: DictConfig) -> int:
    """The number of processes the launcher starts for one job (a sweep bounds its points with it before they run)."""
    lc = cfg.launcher
    if lc.name == "local":
        return lc.nprocs or local_gpus() or 2
    if lc.name == "slurm":
        return lc.nodes * slurm_tasks_per_node(lc)
    return int(os.environ.get("WORLD_SIZE", "1"))  # inline: this process, or the group torchrun/srun started


def local_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
