"""workbench: experiment-tracked, distributed differentially private training in PyTorch."""

from workbench.api import compose, launch_distributed
from workbench.errors import WorkbenchError
from workbench.run import TrainResult, train

__all__ = ["compose", "launch_distributed", "train", "TrainResult", "WorkbenchError"]
