"""The one error type a user sees: a single line, raised before any work where possible."""


class WorkbenchError(Exception):
    """Bad input or an impossible request. ``python -m workbench`` prints it as one line and exits 2."""
