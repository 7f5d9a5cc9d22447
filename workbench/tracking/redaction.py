"""What MLflow may see of a run: the resolved config as flat params, with a pinned privacy.secure_seed redacted from
its own field and from every tag and override string (whoever knows it can strip the noise and see the batches)."""

from __future__ import annotations

import re
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


# A pinned privacy.secure_seed as it appears in override strings (`privacy.secure_seed=N`, `+privacy.secure_seed=N`).
_SECRET_OVERRIDE = re.compile(r"(secure_seed\s*=\s*)[^\s,]+")


def scrub(text: str) -> str:
    """Text as MLflow may show it: whoever knows a pinned secure_seed can strip the noise and see the batches."""
    return _SECRET_OVERRIDE.sub(r"\1<redacted>", text)


def redacted(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as MLflow may show it: no pinned privacy.secure_seed, in its own field or in a tag."""
    container = OmegaConf.to_container(cfg, resolve=True)
    if container.get("privacy", {}).get("secure_seed") is not None:
        container["privacy"]["secure_seed"] = "<redacted>"
    tags = container.get("tracking", {}).get("tags") or {}
    for k, v in tags.items():
        tags[k] = scrub(str(v))
    return container
