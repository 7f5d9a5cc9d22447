"""The one error type a user sees: a single line, raised before any work where possible."""


class WorkbenchError(Exception):
    """Bad input or an impossible request. ``python -m workbench`` prints it as one line and exits 2."""


class TrainingStopped(WorkbenchError):
    """Training began and had to stop (non-finite values in what a step released): one line, the MLflow run ends
    FAILED, the run folder and its earlier checkpoints are kept. ``python -m workbench`` exits 1."""
