"""Bitwise, streaming comparison of two checkpoints in any formats, reported in each
checkpoint's own tensor names.

Both checkpoints are mapped to canonical tensors and compared one tensor at a time. A
tensor that is not bitwise equal is one of:

- ``cast``: the same values in another dtype (every value of one is exactly the other's);
- ``rounded``: one is the other cast to its dtype (round to nearest even), values differ
  by that rounding: what ``convert --dtype`` writes;
- ``dequantized``: one side holds a quantized weight (:mod:`ckptkit.quant`), the other its
  dequantization: re-quantizing the other with the quantized side's own scales gives back
  every quantized byte;
- ``quantized``: one side is the other quantized with the scales it holds (``--dtype fp8``),
  lossy: the error figure says how far;
- ``ggml``: one side is a GGUF holding the weight in a llama.cpp quantized type (Q4_K...),
  the other not: lossy, the error figure says how far (``--logits``: how far the outputs);
- ``values``: the bytes differ otherwise;
- ``shape``: the shapes differ.

Exit codes of ``ckptkit verify``, as the command-line contract fixes them: 0 identical
or dequantized (every difference ``dequantized``), or, with ``--allow-cast``, the only
differences are casts (``cast`` / ``rounded``); 1 otherwise, an input error included.
The verdict line and ``--json``'s ``verdict`` tell a cast from any other difference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckptkit.checkpoint import Checkpoint, Lazy, open_checkpoint
from ckptkit.progress import byte_progress
from ckptkit.tensors.dtypes import dtype_name, to_torch

EXIT_IDENTICAL, EXIT_DIFFERENT = 0, 1
CAST_KINDS = ("cast", "rounded")
QUANT_KINDS = ("dequantized", "quantized")


@dataclass
class Difference:
    name: str  # canonical
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    dtype_a: str
    dtype_b: str
    max_abs_diff: float | None  # None when shapes differ
    kind: str = "values"  # cast, rounded, values, shape
    name_a: str = ""  # the tensor's name in A (native)
    name_b: str = ""  # in B
    rounded_to: str = ""  # kind "rounded": the dtype the other tensor equals once rounded to
    ggml_type: str = ""  # kind "ggml": the GGML type the GGUF side holds the weight in
    lost: tuple[int, int] | None = None  # kind "codes": (stored bytes not given back, stored bytes)

    def label(self) -> str:
        a, b = self.name_a or self.name, self.name_b or self.name
        return a if a == b else f"{a} (A) / {b} (B)"

    def describe(self) -> str:
        where = self.label()
        if self.kind == "shape":
            return f"{where}: shape {list(self.shape_a)} vs {list(self.shape_b)}"
        if self.kind == "cast":
            return f"{where}: same values, dtype {self.dtype_a} vs {self.dtype_b}"
        if self.kind == "dequantized":
            return f"{where}: {self.dtype_a} vs {self.dtype_b}, re-quantized with its scales: every byte back"
        if self.kind == "quantized":
            return (
                f"{where}: {self.dtype_a} vs {self.dtype_b}, quantized with the scales it holds "
                f"(max abs diff {self.max_abs_diff:.6g})"
            )
        if self.kind == "codes":
            assert self.lost is not None
            return (
                f"{where}: {self.dtype_a} vs {self.dtype_b}, dequantized exactly, but {self.lost[0]} of "
                f"{self.lost[1]} stored bytes do not come back re-quantized with its scales (codes that "
                "dequantize to the same value, as every code under a block scale of 0 does)"
            )
        if self.kind == "ggml":
            return (
                f"{where}: {self.dtype_a} vs {self.dtype_b}, held as llama.cpp's {self.ggml_type} "
                f"(lossy: max abs diff {self.max_abs_diff:.6g})"
            )
        if self.kind == "rounded":
            return (
                f"{where}: dtype {self.dtype_a} vs {self.dtype_b}, equal once rounded to {self.rounded_to} "
                f"(max abs diff {self.max_abs_diff:.6g})"
            )
        what = f"dtype {self.dtype_a} vs {self.dtype_b}, " if self.dtype_a != self.dtype_b else ""
        return f"{where}: {what}bytes differ, max abs diff {self.max_abs_diff:.6g}"


@dataclass
class Report:
    compared: int = 0
    identical: int = 0
    only_in_a: list[str] = field(default_factory=list)  # A's names
    only_in_b: list[str] = field(default_factory=list)  # B's names
    differences: list[Difference] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)  # tensors the model does not use
    logits: dict[str, Any] | None = None  # verify --logits: the models' outputs compared
    model_type: str | None = None  # the family both were read as

    @property
    def ok(self) -> bool:
        return not (self.only_in_a or self.only_in_b or self.differences)

    @property
    def casts(self) -> list[Difference]:
        return [d for d in self.differences if d.kind in CAST_KINDS]

    @property
    def cast_only(self) -> bool:
        """Every difference is a cast (same values, or one rounded to the other's dtype)."""
        return (
            not (self.only_in_a or self.only_in_b)
            and bool(self.differences)
            and len(self.casts) == len(self.differences)
        )

    def of_kind(self, *kinds: str) -> bool:
        """Every difference is one of ``kinds`` (and at least one exists)."""
        return (
            not (self.only_in_a or self.only_in_b)
            and bool(self.differences)
            and all(d.kind in kinds for d in self.differences)
        )

    def exit_code(self, allow_cast: bool = False) -> int:
        if self.ok or (self.cast_only and allow_cast) or self.of_kind("dequantized"):
            return EXIT_IDENTICAL
        return EXIT_DIFFERENT

    def verdict(self, allow_cast: bool = False) -> str:
        """The one summary line, printed first."""
        n = self.compared
        if self.ok:
            return f"IDENTICAL: all {n} tensors bitwise equal"
        quantized = [d for d in self.differences if d.kind in QUANT_KINDS]
        if self.of_kind("dequantized"):
            return (
                f"DEQUANTIZED: {self.identical} of {n} tensors bitwise equal, {len(quantized)} dequantized weights "
                "give back every quantized byte re-quantized with the quantized side's own scales"
            )
        if self.of_kind(*QUANT_KINDS):
            lossy = [d for d in quantized if d.kind == "quantized"]
            kept = f"{len(quantized) - len(lossy)} dequantized exactly, " if len(lossy) < len(quantized) else ""
            worst = max(d.max_abs_diff or 0.0 for d in lossy)
            return (
                f"QUANTIZED: {self.identical} of {n} tensors bitwise equal, {kept}{len(lossy)} are the other side "
                f"quantized with the scales they hold (lossy: max abs diff {worst:.6g})"
            )
        same = sum(d.kind == "cast" for d in self.differences)
        rounded = sum(d.kind == "rounded" for d in self.differences)
        cast_parts = []
        if same:
            cast_parts.append(f"{same} hold the same values in another dtype")
        if rounded:
            cast_parts.append(f"{rounded} equal the other's values rounded to their dtype")
        ggml = [d for d in self.differences if d.kind == "ggml"]
        if ggml and self.of_kind("ggml", *CAST_KINDS):
            types = ", ".join(sorted({d.ggml_type for d in ggml}))
            worst = max(d.max_abs_diff or 0.0 for d in ggml)
            return (
                f"GGML-QUANTIZED: {self.identical} of {n} tensors bitwise equal, {len(ggml)} held in llama.cpp's "
                f"quantized types ({types}; lossy: max abs diff {worst:.6g})"
                + "".join(f", {p}" for p in cast_parts)
                + ("" if self.logits is not None else "; --logits measures KL divergence and top-1 agreement")
            )
        if self.cast_only:
            head = "CAST (accepted: --allow-cast)" if allow_cast else "CAST"
            hint = "" if allow_cast else "; pass --allow-cast to accept casts"
            return f"{head}: {self.identical} of {n} tensors bitwise equal, {', '.join(cast_parts)}{hint}"
        parts = [f"{self.identical} of {n} tensors bitwise equal"]
        exact = sum(d.kind == "dequantized" for d in self.differences)
        codes = sum(d.kind == "codes" for d in self.differences)
        differ = len(self.differences) - same - rounded - exact - codes
        if differ:
            parts.append(f"{differ} differ in value or shape")
        if codes:
            parts.append(f"{codes} dequantized exactly from codes that do not all come back")
        if exact:
            parts.append(f"{exact} dequantized exactly")
        parts += cast_parts
        if self.only_in_a:
            parts.append(f"{len(self.only_in_a)} only in A")
        if self.only_in_b:
            parts.append(f"{len(self.only_in_b)} only in B")
        return "DIFFERENT: " + ", ".join(parts)

    def summary(self) -> str:
        if self.ok:
            return f"{self.identical} tensors identical"
        parts = []
        if self.only_in_a:
            parts.append(f"{len(self.only_in_a)} only in A ({', '.join(self.only_in_a[:3])})")
        if self.only_in_b:
            parts.append(f"{len(self.only_in_b)} only in B ({', '.join(self.only_in_b[:3])})")
        if self.differences:
            parts.append(f"{len(self.differences)} differ ({self.differences[0].describe()})")
        return "; ".join(parts)

    def to_json(self, allow_cast: bool = False) -> dict[str, Any]:
        return {
            "verdict": self.verdict(allow_cast).split(":")[0].split(" ")[0].lower(),
            "identical": self.ok,
            "exit_code": self.exit_code(allow_cast),
            "compared": self.compared,
            "identical_tensors": self.identical,
            "only_in_a": self.only_in_a,
            "only_in_b": self.only_in_b,
            "differences": [
                {
                    "name_a": d.name_a or d.name,
                    "name_b": d.name_b or d.name,
                    "canonical_name": d.name,
                    "kind": d.kind,
                    "shape_a": list(d.shape_a),
                    "shape_b": list(d.shape_b),
                    "dtype_a": d.dtype_a,
                    "dtype_b": d.dtype_b,
                    "max_abs_diff": d.max_abs_diff,
                    **({"stored_bytes_not_back": d.lost[0]} if d.lost is not None else {}),
                }
                for d in self.differences
            ],
            "ignored_unused": self.ignored,
            **({"logits": self.logits} if self.logits is not None else {}),
        }


def native_names(ckpt: Checkpoint) -> dict[str, str]:
    """Canonical name -> the name this checkpoint stores it under (a fused tensor's part says
    which part; a tied copy is never preferred to the tensor itself)."""
    from ckptkit.tensors.transforms import TIED

    try:
        rules = ckpt.fmt.layout(ckpt.family, ckpt.config).expand(ckpt.config.num_layers)
    except Exception:  # a layout that cannot be built: canonical names are all there is
        return {}
    names: dict[str, str] = {}
    for rule in sorted(rules, key=lambda r: r.kind is TIED):  # stable: TIED rules last
        for j, canonical in enumerate(rule.canonical):
            if len(rule.canonical) == 1 or rule.kind is TIED:
                names.setdefault(canonical, rule.native)
            else:
                names.setdefault(canonical, f"{rule.native} (part {j + 1} of {len(rule.canonical)})")
    return names


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))  # 0-d ones too


def _classify(ta: torch.Tensor, tb: torch.Tensor) -> tuple[str, str]:
    """What kind of difference two unequal tensors of one shape have: (kind, for "rounded"
    the dtype one of them equals the other rounded to)."""
    if ta.dtype == tb.dtype or not (ta.dtype.is_floating_point and tb.dtype.is_floating_point):
        return "values", ""
    for x, y in ((ta, tb), (tb, ta)):  # x rounded to y's dtype is y
        if _bitwise_equal(x.to(y.dtype), y):
            return ("cast", "") if _bitwise_equal(y.to(x.dtype), x) else ("rounded", dtype_name(y.dtype))
    return "values", ""


def _with_scales(ckpt: Checkpoint, names: dict[str, str], other: Checkpoint) -> dict[str, Lazy]:
    """``ckpt``'s canonical tensors plus the scales of its quantized weights that ``other``
    holds quantized too (a dequantized weight's scales are checked through the weight)."""
    out = dict(ckpt.tensors)
    if ckpt.quant is None:
        return out
    kept = other.quant.scales if other.quant is not None else {}
    method = ckpt.quant.method
    for name, scales in ckpt.quant.scales.items():
        if name in kept:
            native = method.scale_names(names.get(name, name))
            for scale_name, scale, native_name in zip(method.scale_names(name), scales, native, strict=True):
                out[scale_name] = scale
                names[scale_name] = native_name
    return out


def _renamed(ckpt: Checkpoint, mine: dict[str, Lazy], other: dict[str, Lazy], names: dict[str, str]) -> dict[str, str]:
    """Key ``mine``'s quantized weights by the name they have once dequantized where only
    ``other`` holds that name (MXFP4's ``X_blocks`` is ``X``): dequantized name -> stored one."""
    renamed: dict[str, str] = {}
    if ckpt.quant is None:
        return renamed
    for name in list(ckpt.quant.scales):
        new, _ = ckpt.quant.method.dequantized_as(name, mine[name].shape) if name in mine else (name, ())
        if new != name and new in other and name not in other:
            mine[new] = mine.pop(name)
            names[new] = names.get(name, name)
            renamed[new] = name
    return renamed


def _quantized_side(
    a: Checkpoint, b: Checkpoint, name: str, renamed: dict[str, str], ta: torch.Tensor, tb: torch.Tensor
) -> Checkpoint | None:
    """The side holding weight ``name`` (``ta`` / ``tb``) quantized, where only one does and
    the other holds it in the shape it dequantizes to."""
    qa = a.quant is not None and renamed.get(name, name) in a.quant.scales
    qb = b.quant is not None and renamed.get(name, name) in b.quant.scales
    side = None if qa == qb else a if qa else b
    if side is None or side.quant is None or name in renamed:
        return side
    q, plain = (ta, tb) if side is a else (tb, ta)
    return side if side.quant.method.dequantized_as(name, tuple(q.shape))[1] == tuple(plain.shape) else None


def _quantization_kind(
    side: Checkpoint, name: str, q: torch.Tensor, plain: torch.Tensor
) -> tuple[str, float, tuple[int, int] | None]:
    """(kind, max abs difference of ``plain`` and ``q`` dequantized in float32, for ``codes``
    the stored bytes not given back and all of them): ``dequantized`` when ``plain`` is the
    reference dequantization of ``q`` and re-quantizing it with ``side``'s scale gives back
    every byte of ``q``; ``quantized`` when only the latter holds; ``codes`` when only the former."""
    assert side.quant is not None
    method, scale = side.quant.method, side.quant.scale(name)
    plain = method.unloaded(plain)
    again = method.requantize(plain, scale)
    back = _bitwise_equal(again, q)
    exact = _bitwise_equal(method.dequantize(q, scale, plain.dtype), plain)
    wide = method.dequantize(q, scale, torch.float32)
    diff = _max_difference(wide, plain)
    if back:
        return ("dequantized" if exact else "quantized"), diff, None
    if exact and again.shape == q.shape and again.dtype == q.dtype:
        stored, bytes_back = q.reshape(-1).view(torch.uint8), again.reshape(-1).view(torch.uint8)
        return "codes", diff, (int((stored != bytes_back).sum()), stored.numel())
    return "values", diff, None


def _max_difference(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 20) -> float:
    """The largest ``|a - b|`` in float64 (NaN: inf), a chunk of elements at a time (no
    float64 copy of a whole tensor); 0 for empty tensors."""
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    worst = 0.0
    for i in range(0, flat_a.numel(), chunk):
        d = (flat_a[i : i + chunk].double() - flat_b[i : i + chunk].double()).abs().nan_to_num(nan=float("inf"))
        worst = max(worst, float(d.max()))
    return worst


def compare(
    a: Checkpoint,
    b: Checkpoint,
    cast: torch.dtype | None = None,
    quiet: bool = True,
    left_out: frozenset[str] = frozenset(),
) -> Report:
    """Compare canonical tensors one at a time; ``cast`` applies to A's floating tensors.
    A weight one side holds quantized and the other not is checked by re-quantizing the
    other with the quantized side's own scales (kinds ``dequantized`` / ``quantized``).
    ``left_out``: A's canonical names B's format does not hold by design (ignored, not missing)."""
    names_a, names_b = native_names(a), native_names(b)
    tensors_a, tensors_b = _with_scales(a, names_a, b), _with_scales(b, names_b, a)
    renamed = _renamed(a, tensors_a, tensors_b, names_a) | _renamed(b, tensors_b, tensors_a, names_b)
    report = Report()
    report.only_in_a = [names_a.get(k, k) for k in tensors_a if k not in tensors_b and k not in left_out]
    report.only_in_b = [names_b.get(k, k) for k in tensors_b if k not in tensors_a]
    unwritten = {names_a.get(k, k) for k in tensors_a if k not in tensors_b and k in left_out}
    report.ignored = sorted(set(a.unused) | set(b.unused) | unwritten)
    common = [k for k in tensors_a if k in tensors_b]
    total = sum(tensors_a[k].nbytes for k in common)
    with byte_progress("verifying", total, quiet) as bar:
        for name in common:
            ta, tb = tensors_a[name].get(), tensors_b[name].get()
            side = _quantized_side(a, b, name, renamed, ta, tb)
            if cast is not None and ta.dtype.is_floating_point and side is None:
                ta = ta.to(cast)
            report.compared += 1
            if _bitwise_equal(ta, tb):
                report.identical += 1
            else:
                diff, kind, rounded_to, held, lost = None, "shape", "", None, None
                if side is not None:
                    q, plain = (ta, tb) if side is a else (tb, ta)
                    kind, diff, lost = _quantization_kind(side, renamed.get(name, name), q, plain)
                elif ta.shape == tb.shape:
                    diff = (
                        float((ta.double() - tb.double()).abs().nan_to_num(nan=float("inf")).max())
                        if ta.numel()
                        else 0.0
                    )
                    kind, rounded_to = _classify(ta, tb)
                    held = a.raw.lossy.get(names_a.get(name, name)) or b.raw.lossy.get(names_b.get(name, name))
                    kind = "ggml" if held and kind == "values" else kind
                report.differences.append(
                    Difference(
                        name,
                        tuple(ta.shape),
                        tuple(tb.shape),
                        dtype_name(ta.dtype),
                        dtype_name(tb.dtype),
                        diff,
                        kind,
                        names_a.get(name, name),
                        names_b.get(name, name),
                        rounded_to,
                        (held or "") if kind == "ggml" else "",
                        lost,
                    )
                )
            del ta, tb
            bar.advance(tensors_a[name].nbytes)
    return report


def verify_paths(a: str | Path, b: str | Path, quiet: bool = True) -> Report:
    with open_checkpoint(a) as ca, open_checkpoint(b, model_type=ca.family.name) as cb:
        report = compare(ca, cb, quiet=quiet)
    report.model_type = ca.family.name
    return report


def verify_against(
    src: Checkpoint, out: Path, fmt: str, dtype: str | None, quiet: bool = True, left_out: frozenset[str] = frozenset()
) -> Report:
    """Check a freshly written output ``out`` (a folder, or the one file of a one-file
    format), of format ``fmt``, against its (still open) source; ``dtype``: the source's
    floating tensors cast to it first; ``left_out``: the source's tensors the plan does not write."""
    with open_checkpoint(out, fmt, model_type=src.family.name) as written:
        return compare(src, written, to_torch(dtype) if dtype else None, quiet=quiet, left_out=left_out)
