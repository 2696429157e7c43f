"""Bitwise, streaming comparison of two checkpoints in any formats, reported in each
checkpoint's own tensor names.

Both checkpoints are mapped to canonical tensors and compared one tensor at a time. A
tensor that is not bitwise equal is one of:

- ``cast``: the same values in another dtype (every value of one is exactly the other's);
- ``rounded``: one is the other cast to its dtype (round to nearest even), values differ
  by that rounding: what ``convert --dtype`` writes;
- ``values``: the bytes differ otherwise;
- ``shape``: the shapes differ.

Exit codes of ``ckptkit verify``, as the command-line contract fixes them: 0 identical
(or, with ``--allow-cast``, the only differences are casts: ``cast`` / ``rounded``), 1
otherwise, an input error included. The verdict line and ``--json``'s ``verdict`` tell a
cast from any other difference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckptkit.checkpoint import Checkpoint, open_checkpoint
from ckptkit.progress import byte_progress
from ckptkit.tensors.dtypes import dtype_name, to_torch

EXIT_IDENTICAL, EXIT_DIFFERENT = 0, 1
CAST_KINDS = ("cast", "rounded")


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

    def label(self) -> str:
        a, b = self.name_a or self.name, self.name_b or self.name
        return a if a == b else f"{a} (A) / {b} (B)"

    def describe(self) -> str:
        where = self.label()
        if self.kind == "shape":
            return f"{where}: shape {list(self.shape_a)} vs {list(self.shape_b)}"
        if self.kind == "cast":
            return f"{where}: same values, dtype {self.dtype_a} vs {self.dtype_b}"
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

    def exit_code(self, allow_cast: bool = False) -> int:
        if self.ok or (self.cast_only and allow_cast):
            return EXIT_IDENTICAL
        return EXIT_DIFFERENT

    def verdict(self, allow_cast: bool = False) -> str:
        """The one summary line, printed first."""
        n = self.compared
        if self.ok:
            return f"IDENTICAL: all {n} tensors bitwise equal"
        same = sum(d.kind == "cast" for d in self.differences)
        rounded = sum(d.kind == "rounded" for d in self.differences)
        cast_parts = []
        if same:
            cast_parts.append(f"{same} hold the same values in another dtype")
        if rounded:
            cast_parts.append(f"{rounded} equal the other's values rounded to their dtype")
        if self.cast_only:
            head = "CAST (accepted: --allow-cast)" if allow_cast else "CAST"
            hint = "" if allow_cast else "; pass --allow-cast to accept casts"
            return f"{head}: {self.identical} of {n} tensors bitwise equal, {', '.join(cast_parts)}{hint}"
        parts = [f"{self.identical} of {n} tensors bitwise equal"]
        differ = len(self.differences) - same - rounded
        if differ:
            parts.append(f"{differ} differ in value or shape")
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
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _classify(ta: torch.Tensor, tb: torch.Tensor) -> tuple[str, str]:
    """What kind of difference two unequal tensors of one shape have: (kind, for "rounded"
    the dtype one of them equals the other rounded to)."""
    if ta.dtype == tb.dtype or not (ta.dtype.is_floating_point and tb.dtype.is_floating_point):
        return "values", ""
    for x, y in ((ta, tb), (tb, ta)):  # x rounded to y's dtype is y
        if _bitwise_equal(x.to(y.dtype), y):
            return ("cast", "") if _bitwise_equal(y.to(x.dtype), x) else ("rounded", dtype_name(y.dtype))
    return "values", ""


def compare(a: Checkpoint, b: Checkpoint, cast: torch.dtype | None = None, quiet: bool = True) -> Report:
    """Compare canonical tensors one at a time; ``cast`` applies to A's floating tensors."""
    names_a, names_b = native_names(a), native_names(b)
    report = Report()
    report.only_in_a = [names_a.get(k, k) for k in a.tensors if k not in b.tensors]
    report.only_in_b = [names_b.get(k, k) for k in b.tensors if k not in a.tensors]
    report.ignored = sorted(set(a.unused) | set(b.unused))
    common = [k for k in a.tensors if k in b.tensors]
    total = sum(a.tensors[k].nbytes for k in common)
    with byte_progress("verifying", total, quiet) as bar:
        for name in common:
            ta, tb = a.tensors[name].get(), b.tensors[name].get()
            if cast is not None and ta.dtype.is_floating_point:
                ta = ta.to(cast)
            report.compared += 1
            if _bitwise_equal(ta, tb):
                report.identical += 1
            else:
                diff, kind, rounded_to = None, "shape", ""
                if ta.shape == tb.shape:
                    diff = (
                        float((ta.double() - tb.double()).abs().nan_to_num(nan=float("inf")).max())
                        if ta.numel()
                        else 0.0
                    )
                    kind, rounded_to = _classify(ta, tb)
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
                    )
                )
            del ta, tb
            bar.advance(a.tensors[name].nbytes)
    return report


def verify_paths(a: str | Path, b: str | Path, quiet: bool = True) -> Report:
    with open_checkpoint(a) as ca, open_checkpoint(b, model_type=ca.family.name) as cb:
        report = compare(ca, cb, quiet=quiet)
    report.model_type = ca.family.name
    return report


def verify_against(src: Checkpoint, out: Path, fmt: str, dtype: str | None, quiet: bool = True) -> Report:
    """Check a freshly written output ``out`` (a folder, or the one file of a one-file
    format), of format ``fmt``, against its (still open) source; ``dtype``: the source's
    floating tensors cast to it first."""
    with open_checkpoint(out, fmt, model_type=src.family.name) as written:
        return compare(src, written, to_torch(dtype) if dtype else None, quiet=quiet)
