"""Types and ranges of the config fields ckptkit reads, checked in one place before use.

``config.json`` (Hugging Face), ``params.json`` (Meta) and the ``config`` of
``ckptkit.json`` (canonical) each have a table: field name -> check. A field that is
present must pass its check; absent fields keep the defaults the families apply. The
fields only some families have are checked as their ``FamilyFields.checks`` say (the
registry hands them here: :func:`set_family_checks`), in config.json and ckptkit.json.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from ckptkit.errors import CkptkitError

Check = Callable[[Any], bool]


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def positive_int(v: Any) -> bool:
    return _int(v) and v > 0


def non_negative_int(v: Any) -> bool:
    return _int(v) and v >= 0


def positive_float(v: Any) -> bool:
    return (_int(v) or isinstance(v, float)) and math.isfinite(v) and v > 0


def non_negative_float(v: Any) -> bool:
    return (_int(v) or isinstance(v, float)) and math.isfinite(v) and v >= 0


def boolean(v: Any) -> bool:
    return isinstance(v, bool)


def text(v: Any) -> bool:
    return isinstance(v, str)


def token_ids(v: Any) -> bool:
    return non_negative_int(v) or (isinstance(v, list) and all(non_negative_int(x) for x in v))


def rope_scaling(v: Any, nested: bool = True) -> bool:
    """Rope parameters: scalar fields, or (transformers 5, Gemma 3) one such object per layer type."""
    return isinstance(v, dict) and all(
        isinstance(k, str)
        and (
            isinstance(x, str | bool)  # yarn's "truncate" (gpt-oss), Qwen3.5's mrope_interleaved
            or positive_float(x)
            or x is None
            or isinstance(x, list)
            or (nested and rope_scaling(x, nested=False))
        )
        for k, x in v.items()
    )


def optional(check: Check) -> Check:
    def ok(v: Any) -> bool:
        return v is None or check(v)

    ok.__name__ = check.__name__
    return ok


def meta_vocab(v: Any) -> bool:
    return v == -1 or positive_int(v)


EXPECTED = {
    "positive_int": "a positive integer",
    "non_negative_int": "a non-negative integer",
    "positive_float": "a finite positive number",
    "non_negative_float": "a finite non-negative number",
    "boolean": "true or false",
    "text": "a string",
    "token_ids": "a token id or a list of them",
    "rope_scaling": "an object of rope scaling parameters",
    "meta_vocab": "a positive integer or -1",
}

_SAME_NAME_IN_HF_AND_CANONICAL: dict[str, Check] = {
    "bos_token_id": optional(token_ids),
    "eos_token_id": optional(token_ids),
    "pad_token_id": optional(token_ids),
}
_COMMON_HF = {
    "hidden_size": positive_int,
    "num_hidden_layers": positive_int,
    "num_attention_heads": positive_int,
    "num_key_value_heads": optional(positive_int),
    "intermediate_size": positive_int,
    "vocab_size": positive_int,
    "head_dim": optional(positive_int),
    "max_position_embeddings": positive_int,
    "rms_norm_eps": positive_float,
    "rope_theta": positive_float,
    "rope_scaling": optional(rope_scaling),
    "rope_parameters": optional(rope_scaling),
    "tie_word_embeddings": boolean,
    "attention_bias": boolean,
    "hidden_act": text,
    "hidden_activation": optional(text),
    "model_type": text,
    **_SAME_NAME_IN_HF_AND_CANONICAL,
}
_META = {
    "dim": positive_int,
    "n_layers": positive_int,
    "n_heads": positive_int,
    "n_kv_heads": optional(positive_int),
    "head_dim": optional(positive_int),
    "hidden_dim": positive_int,
    "vocab_size": meta_vocab,
    "multiple_of": positive_int,
    "ffn_dim_multiplier": optional(positive_float),
    "norm_eps": positive_float,
    "rope_theta": positive_float,
    "max_seq_len": positive_int,
}
_CANONICAL = {
    "model_type": text,
    "vocab_size": positive_int,
    "hidden_size": positive_int,
    "num_layers": positive_int,
    "num_heads": positive_int,
    "num_kv_heads": positive_int,
    "head_dim": positive_int,
    "intermediate_size": positive_int,
    "norm_eps": positive_float,
    "rope_theta": positive_float,
    "rope_scaling": optional(rope_scaling),
    "max_position_embeddings": positive_int,
    "tie_word_embeddings": boolean,
    "attention_bias": boolean,
    "hidden_act": text,
    "norm_plus_one": boolean,
    "embed_scale": boolean,
    **_SAME_NAME_IN_HF_AND_CANONICAL,
}
TABLES: dict[str, dict[str, Check]] = {"config.json": _COMMON_HF, "params.json": _META, "ckptkit.json": _CANONICAL}
_FAMILY_CHECKS: dict[str, Check] = {}  # the registered families' own fields (config.json, ckptkit.json)


def set_family_checks(checks: dict[str, Check]) -> None:
    """The checks of the registered families' own fields (the registry's, on each change)."""
    _FAMILY_CHECKS.clear()
    _FAMILY_CHECKS.update(checks)


REQUIRED = {
    "ckptkit.json": (
        "model_type", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
        "intermediate_size",
    )
}  # fmt: skip


def check_config_fields(file_name: str, config: dict[str, Any], where: object) -> None:
    """A one-line error naming ``where`` and the field unless every known field present in
    ``config`` has its type and range (and, for ckptkit.json, every needed one is there)."""
    table = TABLES.get(file_name, {})
    if file_name in ("config.json", "ckptkit.json"):
        table = table | {k: c for k, c in _FAMILY_CHECKS.items() if k not in table}
    for key in REQUIRED.get(file_name, ()):
        if key not in config:
            raise CkptkitError(f"{where}: missing field {key!r}")
    for key, check in table.items():
        if key in config and not check(config[key]):
            value = config[key]
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            raise CkptkitError(f"{where}: field {key!r} must be {EXPECTED[check.__name__]}, not {shown}")


LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks|blk)\.(\d+)\.")  # blk: GGUF


def layers_in(names: list[str] | dict[str, Any]) -> int:
    """How many transformer layers the tensor names hold (highest layer index + 1)."""
    found = [int(m.group(1)) for n in names if (m := LAYER_INDEX.search(n))]
    return max(found) + 1 if found else 0


def check_layer_count(num_layers: int, names: list[str] | dict[str, Any], where: object, field: str) -> None:
    """A one-line error unless the tensors hold exactly ``num_layers`` layers: checked
    before any per-layer structure is built, so a huge count costs nothing."""
    held = layers_in(names)
    if held != num_layers:
        which = f"no layers.{held}" if held < num_layers else f"up to layers.{held - 1}"
        raise CkptkitError(f"{where}: {field} is {num_layers} but the tensors hold {held} layers ({which})")
