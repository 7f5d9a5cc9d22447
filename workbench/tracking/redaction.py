"""What MLflow may see of a run: the resolved config as flat params, with a pinned privacy.secure_seed redacted from
its own field and from every text MLflow is sent: tags, override strings, the run name, any string of the config
(whoever knows it can strip the noise and see the batches)."""

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


# A pinned privacy.secure_seed as it appears in override strings (`privacy.secure_seed=N`, `+privacy.secure_seed=N`,
# a sweep's `=1,2,3` or `=choice(1, 2)`) and in YAML (`secure_seed: N`): its whole value, up to the next override.
_SECRET_OVERRIDE = re.compile(r"(secure_seed\s*[=:]\s*)(.*?)(?=\s+[+~]{0,2}[\w./-]+\s*=|$)", re.M)


# A pinned seed's digits are redacted wherever they stand alone only from this many digits on: a shorter seed is
# guessed by trying them all anyway (README), and its digits ("1") would garble every text ("BatchNorm1d").
SECRET_DIGITS = 6


def scrub(text: str, secret: Any = None) -> str:
    """Text as MLflow may show it: whoever knows a pinned secure_seed can strip the noise and see the batches. With
    the pinned ``secret`` (of ``SECRET_DIGITS`` digits or more), also its digits wherever they stand alone (a run name
    or folder built from it)."""
    text = _SECRET_OVERRIDE.sub(r"\1<redacted>", text)
    if secret is not None and len(str(abs(int(secret)))) >= SECRET_DIGITS:
        text = re.sub(rf"(?<!\d){abs(int(secret))}(?!\d)", "<redacted>", text)
    return text


def redacted(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as MLflow may show it: no pinned privacy.secure_seed, in its own field or in any text of
    the config (a tag, an output_dir or run name built from it)."""
    container = OmegaConf.to_container(cfg, resolve=True)
    secret = container.get("privacy", {}).get("secure_seed")
    if secret is None:
        return container
    container["privacy"]["secure_seed"] = "<redacted>"

    def clean(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: clean(v) for k, v in node.items()}
        if isinstance(node, list):
            return [clean(v) for v in node]
        return scrub(node, secret) if isinstance(node, str) else node

    return clean(container)
