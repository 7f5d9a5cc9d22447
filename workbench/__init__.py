"""workbench: experiment-tracked, distributed differentially private training in PyTorch.

The public API is imported lazily, so that ``workbench.distributed`` (and spawned ranks) start without the accounting
and tracking stacks.
"""

from importlib import import_module

_API = {
    "compose": "workbench.api", "launch_distributed": "workbench.api",
    "train": "workbench.run", "TrainResult": "workbench.run", "WorkbenchError": "workbench.errors",
}

_MODULES = {"audit": "workbench.audit"}  # the one-run privacy audit: audit.audit, audit.epsilon_lower_bound, ...

__all__ = sorted([*_API, *_MODULES])


def __getattr__(name: str):
    if name in _MODULES:
        return import_module(_MODULES[name])
    if name in _API:
        return getattr(import_module(_API[name]), name)
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")
