"""compressed-tensors releases (``quant_method: "compressed-tensors"``, as llm-compressor
writes them): ``float-quantized`` (FP8 e4m3) and ``int-quantized`` (int8) weights with a
``weight_scale`` per tensor, channel, group or block, which *multiplies* the stored element.

``config_groups`` give each group's ``targets`` (a module name, ``re:`` a regular expression
matched at the start of the name, or a class name such as ``Linear``, which ckptkit takes to
mean every module with a scale) and its ``weights`` arguments (``strategy``, ``group_size``,
``block_structure``, ``type``, ``num_bits``, ``symmetric``); ``ignore`` lists the modules
left unquantized. Activation-only tensors (``input_scale``, ``k_scale``, ``v_scale``, their
zero points) are dropped on read.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from ckptkit.errors import CkptkitError
from ckptkit.quant.grid import E4M3, INT8, GridScaled
from ckptkit.quant.method import Stored, register_method

PACKED_DTYPE = "int32"
ACTIVATION: tuple[str, ...] = (".input_scale", ".input_zero_point", ".input_global_scale", ".k_scale", ".v_scale")
ACTIVATION += (".output_scale", ".output_zero_point")
NAIVE_FORMATS = ("float-quantized", "int-quantized", "naive-quantized")
PACKED = "pack-quantized"  # 1- to 8-bit ints packed densely into int32 words (packed.py)
STRATEGIES = ("tensor", "channel", "group", "block")


class Scheme:
    """One config group's weight arguments, checked."""

    def __init__(self, name: str, group: Any, default_format: Any, where: Path) -> None:
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise CkptkitError(f"{where}: quantization_config.config_groups.{name} has no weights arguments")
        w = group["weights"]
        self.format = group.get("format") or default_format
        if self.format not in (*NAIVE_FORMATS, PACKED):
            raise CkptkitError(
                f"{where}: compressed-tensors format {self.format!r} ({name}): ckptkit reads "
                f"{', '.join((*NAIVE_FORMATS, PACKED))}; nothing converted"
            )
        kind, bits = w.get("type"), w.get("num_bits")
        self.symmetric = w.get("symmetric", True) is not False
        self.bits = bits if type(bits) is int else 0
        if self.format == PACKED:
            if kind != "int" or not 1 <= self.bits <= 8:
                raise CkptkitError(
                    f"{where}: {name}: {PACKED} {bits}-bit {kind} weights: compressed-tensors packs 1- to 8-bit int"
                )
        elif (kind, bits) not in (("float", 8), ("int", 8)):
            raise CkptkitError(f"{where}: {name}: {bits}-bit {kind} weights: ckptkit reads 8-bit float or int")
        elif not self.symmetric:
            raise CkptkitError(f"{where}: {name}: asymmetric weights (zero points): ckptkit reads symmetric ones")
        if w.get("dynamic", False) not in (False, None):
            raise CkptkitError(f"{where}: {name}: dynamic weight scales: not a stored checkpoint's weights")
        self.stored = PACKED_DTYPE if self.format == PACKED else E4M3 if kind == "float" else INT8
        self.strategy = w.get("strategy")
        if self.strategy not in STRATEGIES:
            raise CkptkitError(
                f"{where}: {name}: weight strategy {self.strategy!r}: not one of {', '.join(STRATEGIES)}"
            )
        self.block = _block_arg(w, self.strategy, name, where)
        targets = group.get("targets") or []
        if not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
            raise CkptkitError(f"{where}: {name}: targets must be a list of names")
        self.targets = targets

    def matches(self, module: str) -> bool:
        return any(_matches(module, t, classes=True) for t in self.targets)

    def block_of(self, shape: tuple[int, ...]) -> tuple[int, int]:
        rows, cols = shape[-2:]
        if self.strategy == "tensor":
            return rows, cols
        if self.strategy == "channel":
            return 1, cols
        return self.block

    def describe(self) -> str:
        what = {"tensor": "per tensor", "channel": "per channel"}.get(self.strategy, f"{self.strategy} {self.block}")
        return f"{self.format} {self.stored} {what}"


def _block_arg(w: dict[str, Any], strategy: str, name: str, where: Path) -> tuple[int, int]:
    if strategy == "group":
        g = w.get("group_size")
        if type(g) is not int or g <= 0:
            raise CkptkitError(f"{where}: {name}: group strategy without a positive group_size")
        return 1, g
    if strategy == "block":
        b = w.get("block_structure")
        if not (isinstance(b, list) and len(b) == 2 and all(type(x) is int and x > 0 for x in b)):
            raise CkptkitError(f"{where}: {name}: block strategy without two positive block_structure sizes")
        return b[0], b[1]
    return 0, 0


def _matches(module: str, target: str, classes: bool) -> bool:
    """compressed-tensors' matching: ``re:`` a regex at the start, else the name itself (or,
    ``classes``, a class name: every module)."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module or (classes and "." not in target and target[:1].isupper())


class CompressedTensors(GridScaled):
    """``quant_method: "compressed-tensors"`` with naive (float / int) quantized weights."""

    activation_scales = ACTIVATION

    name = "compressed-tensors"
    skip_key = "ignore"

    packed: ClassVar[type[CompressedTensors] | None] = None  # the pack-quantized reader (packed.py)

    @classmethod
    def for_config(cls, config: Mapping[str, Any], where: Path) -> CompressedTensors:
        groups = config.get("config_groups")
        formats = (
            {g.get("format") or config.get("format") for g in groups.values() if isinstance(g, dict)}
            if isinstance(groups, dict)
            else set()
        )
        if PACKED in formats and cls.packed is not None:
            return cls.packed(config, where)
        return cls(config, where)

    def __init__(self, config: Mapping[str, Any], where: Path) -> None:
        super().__init__(config, where)
        status = config.get("quantization_status", "compressed")
        if status != "compressed":
            raise CkptkitError(
                f"{where}: compressed-tensors quantization_status {status!r}: the weights are not stored "
                "compressed; ckptkit reads compressed checkpoints"
            )
        groups = config.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise CkptkitError(f"{where}: compressed-tensors quantization_config without config_groups")
        self.schemes = [Scheme(k, v, config.get("format"), where) for k, v in groups.items()]
        stored = {s.stored for s in self.schemes}
        if len(stored) > 1:
            raise CkptkitError(
                f"{where}: compressed-tensors groups of {' and '.join(sorted(stored))} weights: not read"
            )
        self.stored = stored.pop()
        ignore = config.get("ignore") or []
        if not (isinstance(ignore, list) and all(isinstance(m, str) for m in ignore)):
            raise CkptkitError(f"{where}: quantization_config.ignore must be a list of names")
        self.ignore = ignore

    def keeps_unquantized(self, name: str) -> bool:
        module = name.rsplit(".", 1)[0]
        return any(_matches(module, t, classes=False) for t in self.ignore)

    def reads_as_quantized(self, native: str) -> bool:
        module = native.rsplit(".", 1)[0]
        return any(scheme.matches(module) for scheme in self.schemes)

    def scheme_of(self, weight: Stored) -> Scheme:
        return self.scheme_named(weight.name)

    def scheme_named(self, name: str) -> Scheme:
        """The config group's scheme of the weight stored as ``name``."""
        module = name.rsplit(".", 1)[0]
        for scheme in self.schemes:
            if scheme.matches(module):
                return scheme
        raise CkptkitError(f"{self.where}: {name} is stored quantized, but no config group targets {module}")

    def block_of(self, weight: Stored) -> tuple[int, int]:
        return self.scheme_of(weight).block_of(weight.shape)

    def block_rows(self) -> int:
        rows = [s.block[0] if s.strategy in ("group", "block") else 1 for s in self.schemes if s.strategy != "tensor"]
        return math.gcd(*rows) if rows else 0

    def describe(self) -> dict[str, Any]:
        blocks = {s.strategy if s.strategy in ("tensor", "channel") else tuple(s.block) for s in self.schemes}
        shown = sorted(b if isinstance(b, str) else f"{b[0]}x{b[1]}" for b in blocks)
        one = next(iter(blocks))
        return {
            "method": self.name,
            "block": list(one) if len(blocks) == 1 and isinstance(one, tuple) else ", ".join(shown),
            "stored": self.stored,
            "scales": "per " + ", ".join(sorted({s.strategy for s in self.schemes})),
            "schemes": "; ".join(sorted({s.describe() for s in self.schemes})),
        }


register_method(CompressedTensors)
