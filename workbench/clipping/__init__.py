"""The old import path of workbench/privacy/clipping/, kept so that existing imports work: ``workbench.clipping`` and
``workbench.clipping.<module>`` are the very module objects of ``workbench.privacy.clipping`` (one copy of each, so
monkeypatching and isinstance see the same thing under either name). New code imports workbench.privacy.clipping."""

import sys

from workbench.privacy import clipping as _clipping
from workbench.privacy.clipping import base, book_keeping, bound, layers, nonprivate, opacus_modes

for _module in (base, book_keeping, bound, layers, nonprivate, opacus_modes):
    sys.modules[f"{__name__}.{_module.__name__.rpartition('.')[2]}"] = _module
sys.modules[__name__] = _clipping
