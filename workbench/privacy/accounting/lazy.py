"""dp_accounting and its parts, imported on first use (see :class:`_Lazy`)."""

from __future__ import annotations

import importlib


class _Lazy:
    """A module imported on its first attribute access: dp_accounting pulls in scipy (seconds), which a run whose
    calibration is cached (workbench.cache) needs only for the epsilon it logs, computed off the training thread."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        module = importlib.import_module(self._name)
        self.__dict__.update(vars(module))  # later lookups skip __getattr__
        return getattr(module, attr)


dp_accounting = _Lazy("dp_accounting")
_pld = _Lazy("dp_accounting.pld.privacy_loss_distribution")
_plm = _Lazy("dp_accounting.pld.privacy_loss_mechanism")
_rdp = _Lazy("dp_accounting.rdp.rdp_privacy_accountant")
_vectorized = _Lazy("workbench.privacy.accounting.pld_losses")  # subclasses of dp_accounting's privacy losses
