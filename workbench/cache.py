"""An on-disk cache for results that are pure functions of their inputs (noise calibration, the step budget, the
digits split): a rerun with the same inputs skips seconds before its first step -- PLD work and the scipy and
scikit-learn imports under it.

The key hashes every input the caller names; callers name the code too (:func:`code_version`: the source of the
modules that compute the result and the versions of the packages they use), so an edit or an upgrade computes
afresh. Folder: ``$WORKBENCH_CACHE_DIR``, else ``~/.cache/workbench``. A cache that cannot be read or written is
passed by: the value is computed as if there were none.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def folder() -> Path:
    return Path(os.environ.get("WORKBENCH_CACHE_DIR") or Path.home() / ".cache" / "workbench")


@functools.lru_cache(maxsize=None)  # once per process: a key is made for every epsilon a run logs
def code_version(modules: tuple[str, ...] = (), packages: tuple[str, ...] = ()) -> str:
    """A hash of workbench modules' source (file names in this package) and installed packages' versions."""
    here = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for name in modules:
        h.update((here / name).read_bytes())
    for package in packages:
        h.update(metadata.version(package).encode())
    return h.hexdigest()


def cached(name: str, compute: Callable[[], T], **inputs: Any) -> T:
    """``compute()``, or the value stored for (name, inputs) by an earlier call. Values must be JSON."""
    key = hashlib.sha256(json.dumps([name, inputs], sort_keys=True).encode()).hexdigest()
    path = folder() / f"{name}-{key[:32]}.json"
    try:
        return json.loads(path.read_text())["value"]
    except (OSError, ValueError, KeyError):
        pass
    value = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump({"name": name, "inputs": inputs, "value": value}, f)
        os.replace(f.name, path)  # atomic: a concurrent reader sees the whole file or none
    except OSError:
        pass
    return value
