"""What the user typed: the Hydra group choices and the keys set under the free-form nodes (kept in the config as
tags, so a launched, resumed or notebook job still knows them), and the arguments a replaced ``_target_`` receives."""

from __future__ import annotations

from typing import Any, Dict, List

from omegaconf import DictConfig, OmegaConf, open_dict

from workbench.config import CONF_DIR, USER_OBJECTS

SET_KEYS_TAG = "hydra/set_keys"  # the keys of free-form nodes the overrides set (own_arguments keeps them)


def record_choices(cfg: DictConfig, choices: Dict[str, Any], overrides: List[str] = ()) -> None:
    """Keep the Hydra group choices in the config itself (tags "hydra/<group>"), so that a job without a HydraConfig
    (launched, resumed, composed in a notebook) still tags its run and knows which option each group came from; and
    the keys under the free-form nodes that ``overrides`` set (tag ``hydra/set_keys``, keys only, comma-separated),
    so that it knows which arguments the user typed. Tag keys avoid dots (OmegaConf reads them as paths)."""
    with open_dict(cfg):
        for k, v in choices.items():
            if v is not None and not k.startswith("hydra/"):
                cfg.tracking.tags.setdefault(f"hydra/{k}", str(v))
        keys = set_keys(overrides)
        if keys:
            cfg.tracking.tags.setdefault(SET_KEYS_TAG, ",".join(keys))


def set_keys(overrides: List[str]) -> List[str]:
    """The dotted keys under data, model, optimizer, criterion that Hydra ``overrides`` set or add, whatever their
    values (``data.train={size: 3}`` -> data.train.size); not a group choice (``model=mlp``) nor a deletion."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    def flat(key: str, value: Any) -> List[str]:
        return [k for name, v in value.items() for k in flat(f"{key}.{name}", v)] if isinstance(value, dict) else [key]

    return list(dict.fromkeys(k for o in OverridesParser.create().parse_overrides([str(x) for x in overrides])
                              if not o.is_delete() and o.key_or_group.split(".")[0] in USER_OBJECTS
                              and ("." in o.key_or_group or isinstance(o.value(), dict))
                              for k in flat(o.key_or_group, o.value())))


def own_arguments(cfg: DictConfig, path: str) -> Any:
    """The node at ``path`` (``model``, ``data.train``, ``data.eval``, ``data.collator``, ``optimizer``) as its
    ``_target_`` receives it. When the user points ``_target_`` at another class than the chosen option's
    (``model._target_=my_pkg.MyNet``), the option's arguments still at the option's values are not passed to it;
    arguments set or added by the user (``+model.width=3``, or ``model.in_features=64`` even where 64 is the option's
    value: record_choices's ``hydra/set_keys``) are. So one override swaps the class without deleting the old class's
    keys."""
    node = OmegaConf.select(cfg, path)
    group, _, sub = path.partition(".")
    choice = cfg.tracking.tags.get(f"hydra/{group}")
    option_file = CONF_DIR / group / f"{choice}.yaml"
    if not isinstance(node, DictConfig) or choice is None or not option_file.is_file():
        return node
    option = OmegaConf.load(option_file)
    option = OmegaConf.select(option, sub) if sub else option
    if not isinstance(option, DictConfig) or option.get("_target_") == node.get("_target_"):
        return node
    own = OmegaConf.create(OmegaConf.to_container(node, resolve=True))
    # Compared as written: an option's ${data.root} cannot be resolved apart from the config, and is still the
    # option's value where the node holds the same interpolation
    written, defaults = OmegaConf.to_container(node, resolve=False), OmegaConf.to_container(option, resolve=False)
    typed = [k for k in cfg.tracking.tags.get(SET_KEYS_TAG, "").split(",") if k]
    for key in list(own.keys()):
        hydra_key = str(key).startswith("_") and str(key).endswith("_")  # _target_, _partial_, ...: how to build it
        mine = f"{path}.{key}"  # typed as it is, or a value inside it (model.config.vocab_size=64)
        if not hydra_key and key in defaults and written[key] == defaults[key] and not any(
                k == mine or k.startswith(mine + ".") for k in typed):
            del own[key]
    return own
