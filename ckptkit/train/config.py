"""Recipe configs: YAML files with ``key.sub=value`` overrides, validated by a pydantic schema.

Every recipe declares a schema (:mod:`ckptkit.train.schema`); :func:`parse_config`
checks the whole config against it before any work: unknown keys (with the nearest
valid key suggested), types and ranges, each reported as one line naming the key. It
returns the schema's typed object, which is what the recipe's code reads from then on.
torchtune spellings that mean the same thing are accepted: ``${key}`` interpolation,
a top-level ``output_dir`` and ``_component_`` where it names one of ckptkit's parts.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, ClassVar, TypeVar, Union

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, ValidationError, model_validator

from ckptkit.errors import CkptkitError, ConfigError

CONFIG_DIR = Path(__file__).parent / "configs"
# A bundled config's relative paths to read (the tiny fixtures, datasets) are relative to the
# ckptkit checkout that ships it, so it runs from any directory; outputs stay relative to the cwd.
BUNDLE_ROOT = Path(__file__).resolve().parents[2]
INPUT_KEYS = (
    "checkpointer.checkpoint_dir",
    "checkpointer.adapter_checkpoint",
    "checkpointer.recipe_checkpoint",
    "checkpointer.hf_base_dir",
    "tokenizer",
    "dataset.source",
)
_INTERPOLATION = re.compile(r"\$\{([A-Za-z0-9_.]+)\}")


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
    """Read a YAML config, apply ``a.b.c=value`` overrides (values parsed as YAML), resolve ``${key}``."""
    path = resolve_config(name_or_path)
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise CkptkitError(f"{path}:{where} invalid YAML ({getattr(e, 'problem', e)})") from None
    except UnicodeDecodeError as e:
        raise CkptkitError(f"{path}: not UTF-8 text (byte offset {e.start}); save the config as UTF-8") from None
    if not isinstance(cfg, dict):
        raise CkptkitError(f"{path}: a config must be a YAML mapping")
    if path.parent == CONFIG_DIR:
        anchor_inputs(cfg, BUNDLE_ROOT)
    for item in overrides:
        apply_override(cfg, item)
    return resolve_interpolations(cfg)


def anchor_inputs(cfg: dict[str, Any], root: Path) -> None:
    """Make each relative path of :data:`INPUT_KEYS` in ``cfg`` that exists under ``root``
    absolute (a bundled dataset name, ``tiny_alpaca``, stays a name)."""
    for key in INPUT_KEYS:
        *parents, leaf = key.split(".")
        node: Any = cfg
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        value = node.get(leaf) if isinstance(node, dict) else None
        if isinstance(value, str) and value and not Path(value).is_absolute() and (root / value).exists():
            node[leaf] = str(root / value)


def config_path(key: str, value: str) -> Path:
    """The path config key ``key`` names; a one-line error naming the key when nothing is there."""
    path = Path(value).expanduser()
    if not path.exists():
        raise ConfigError(f"config key {key}: {value}: no such file or directory")
    return path


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
    try:
        value = parse_value(raw)
    except yaml.YAMLError as e:
        raise CkptkitError(f"override {item!r}: the value is not valid YAML ({getattr(e, 'problem', e)})") from None
    node = cfg
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise CkptkitError(f"override {item!r}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def resolve_interpolations(cfg: dict[str, Any]) -> dict[str, Any]:
    """Replace OmegaConf-style ``${a.b}`` references (as torchtune configs use) with their values."""

    def lookup(key: str, seen: tuple[str, ...]) -> Any:
        if key in seen:
            raise ConfigError(f"config: ${{{key}}} refers to itself ({' -> '.join((*seen, key))})")
        node: Any = cfg
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                raise ConfigError(f"config: ${{{key}}} refers to a key the config does not have")
            node = node[part]
        return resolve(node, (*seen, key))

    def resolve(value: Any, seen: tuple[str, ...]) -> Any:
        if isinstance(value, dict):
            return {k: resolve(v, seen) for k, v in value.items()}
        if isinstance(value, list):
            return [resolve(v, seen) for v in value]
        if isinstance(value, str) and "${" in value:
            whole = _INTERPOLATION.fullmatch(value)
            if whole:
                return lookup(whole.group(1), seen)
            return _INTERPOLATION.sub(lambda m: str(lookup(m.group(1), seen)), value)
        return value

    return resolve(cfg, ())


# --- schema ----------------------------------------------------------------------------------


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("must be a number, not true/false")
    return value


# Value types of config keys: integers must be integers (1.5, "2" and true are refused); floats
# also come as strings (YAML 1.1 reads 3e-4 as one) but never as true/false, inf or nan.
Int = Annotated[int, Strict()]
PositiveInt = Annotated[int, Strict(), Field(ge=1)]
NonNegativeInt = Annotated[int, Strict(), Field(ge=0)]
Float = Annotated[float, BeforeValidator(_not_bool), Field(allow_inf_nan=False)]
PositiveFloat = Annotated[float, BeforeValidator(_not_bool), Field(gt=0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, BeforeValidator(_not_bool), Field(ge=0, allow_inf_nan=False)]
Bool = Annotated[bool, Strict()]
Text = Annotated[str, Strict(), Field(min_length=1)]


class Section(BaseModel):
    """A config section: unknown keys are errors; ``_component_`` may name one of ``components``.

    ``components`` maps the torchtune (or ckptkit) component names that mean this section's
    behaviour to the key values they imply (e.g. a dataset builder implying ``type``).
    """

    model_config = ConfigDict(extra="forbid", validate_default=True)
    components: ClassVar[dict[str, dict[str, Any]]] = {}

    @classmethod
    def component_keys(cls, name: str) -> dict[str, Any] | None:
        """The key values ``_component_: name`` implies; None: not a component of this section."""
        return cls.components.get(name)

    @classmethod
    def accepted_components(cls) -> list[str]:
        return list(cls.components)

    @model_validator(mode="before")
    @classmethod
    def _component(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "_component_" not in data:
            return data
        data = dict(data)
        name = data.pop("_component_")
        keys = cls.component_keys(name) if isinstance(name, str) else None
        if keys is None:
            accepted = ", ".join(cls.accepted_components()) or "none: leave _component_ out"
            raise ValueError(f"_component_ {name!r} is not a ckptkit component for this section (accepted: {accepted})")
        for key, value in keys.items():
            data.setdefault(key, value)
        return data


M = TypeVar("M", bound=BaseModel)


def parse_config(raw: dict[str, Any], schema: type[M]) -> M:
    """The config checked against ``schema``, defaults filled in, as the schema's typed object;
    the first problem as a one-line error naming the key."""
    try:
        return schema.model_validate(raw)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        more = f" (and {len(errors) - 1} more problem{'s' * (len(errors) > 2)})" if len(errors) > 1 else ""
        raise ConfigError(describe_error(errors[0], schema) + more) from None


def describe_error(error: Any, schema: type[BaseModel]) -> str:
    """One line for one pydantic error: the dotted key, what is wrong, the value given."""
    loc = [p for p in error["loc"] if not str(p).startswith("function-")]
    index = None
    if loc and isinstance(loc[-1], int):
        index, loc = loc[-1], loc[:-1]
    loc = [str(p) for p in loc]
    key = ".".join(loc)
    kind = error["type"]
    if kind == "missing" and index is not None:
        return f"config key {key}: too few values"
    if index is not None:
        key += f"[{index}]"
    if kind == "extra_forbidden":
        parent, leaf = loc[:-1], loc[-1]
        valid = _keys_at(schema, parent)
        near = difflib.get_close_matches(leaf, valid, n=1, cutoff=0.6)
        hint = f"; did you mean {'.'.join([*parent, near[0]])}?" if near else f"; valid keys: {', '.join(valid)}"
        return f"config: unknown key {key}{hint}"
    if kind == "missing":
        return f"config: missing required key {key}"
    message = error["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        message = "must be a section of keys (a YAML mapping)"
    message = message[:1].lower() + message[1:]
    where = f"config key {key}" if key else "config"
    return (
        f"{where}: {message} (got {error['input']!r})"
        if "input" in error and kind != "value_error"
        else (f"{where}: {message}")
    )


def _keys_at(schema: type[BaseModel], path: list[str]) -> list[str]:
    """The keys a (nested) section of ``schema`` accepts, aliases included."""
    model: Any = schema
    for part in path:
        fields = {f.alias or n: f for n, f in model.model_fields.items()}
        field = fields.get(part)
        model = _model_in(field.annotation) if field is not None else None
        if model is None:
            return []
    names = []
    for name, field in model.model_fields.items():
        names.append(field.alias or name)
    return names + (["_component_"] if issubclass(model, Section) and model.accepted_components() else [])


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None
