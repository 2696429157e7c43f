"""Recipe configs: YAML files with ``key.sub=value`` command-line overrides."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from ckptkit.errors import CkptkitError

CONFIG_DIR = Path(__file__).parent / "configs"


def bundled_configs() -> dict[str, Path]:
    """Bundled config name -> file."""
    return {p.stem: p for p in sorted(CONFIG_DIR.glob("*.yaml"))}


def resolve_config(name_or_path: str) -> Path:
    """A bundled config name or a YAML path."""
    bundled = bundled_configs()
    if name_or_path in bundled:
        return bundled[name_or_path]
    path = Path(name_or_path)
    if path.is_file():
        return path
    raise CkptkitError(
        f"{name_or_path}: no such config file or bundled config (bundled: {', '.join(bundled)}; see `ckptkit ls`)"
    )


def load_config(name_or_path: str, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Read a YAML config and apply ``a.b.c=value`` overrides (values parsed as YAML)."""
    path = resolve_config(name_or_path)
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise CkptkitError(f"{path}:{where} invalid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(cfg, dict):
        raise CkptkitError(f"{path}: a config must be a YAML mapping")
    for item in overrides:
        apply_override(cfg, item)
    return cfg


def parse_value(text: str) -> Any:
    """YAML scalars, plus exponent floats YAML 1.1 reads as strings (``3e-4``)."""
    value = yaml.safe_load(text) if text != "" else ""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def apply_override(cfg: dict[str, Any], item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise CkptkitError(f"override {item!r} is not KEY=VALUE (e.g. optimizer.lr=3e-4)")
    node = cfg
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise CkptkitError(f"override {item!r}: {part} is not a section")
        node = child
    node[parts[-1]] = parse_value(raw)


def get(cfg: dict[str, Any], key: str, default: Any = None, required: bool = False) -> Any:
    """A dotted key's value; ``required`` makes a missing key a one-line error naming it."""
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            if required:
                raise CkptkitError(f"config is missing required key {key}")
            return default
        node = node[part]
    return copy.deepcopy(node)
