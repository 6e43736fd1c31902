"""Small value helpers every floor uses, importing nothing of ours: config values as plain Python."""

from __future__ import annotations

from enum import Enum
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf


def enum_value(v: Any) -> str:
    """The string of an enum config value (OmegaConf hands enums back as Enum members)."""
    return v.value if isinstance(v, Enum) else str(v)

def section(cfg: DictConfig, key: str) -> Any:
    """A resolved, plain-dict copy of one config section (for fingerprints and manifests)."""
    node = OmegaConf.select(cfg, key) if "." in key else cfg.get(key)
    if node is None:
        return {}
    if not isinstance(node, (DictConfig, ListConfig)):
        return node.value if isinstance(node, Enum) else node
    return OmegaConf.to_container(node, resolve=True, enum_to_str=True)  # type: ignore[return-value]
