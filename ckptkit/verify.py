"""Bitwise, canonical, streaming comparison of two checkpoints in any formats."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckptkit.checkpoint import Checkpoint, open_checkpoint
from ckptkit.dtypes import dtype_name, to_torch
from ckptkit.progress import byte_progress


@dataclass
class Difference:
    name: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    dtype_a: str
    dtype_b: str
    max_abs_diff: float | None  # None when shapes differ

    def describe(self) -> str:
        if self.shape_a != self.shape_b:
            return f"{self.name}: shape {list(self.shape_a)} vs {list(self.shape_b)}"
        what = f"dtype {self.dtype_a} vs {self.dtype_b}, " if self.dtype_a != self.dtype_b else ""
        return f"{self.name}: {what}max abs diff {self.max_abs_diff:.6g}"


@dataclass
class Report:
    compared: int = 0
    identical: int = 0
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    differences: list[Difference] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)  # tensors the model does not use

    @property
    def ok(self) -> bool:
        return not (self.only_in_a or self.only_in_b or self.differences)

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

    def to_json(self) -> dict[str, Any]:
        return {
            "identical": self.ok,
            "compared": self.compared,
            "identical_tensors": self.identical,
            "only_in_a": self.only_in_a,
            "only_in_b": self.only_in_b,
            "differences": [
                {
                    "name": d.name,
                    "shape_a": list(d.shape_a),
                    "shape_b": list(d.shape_b),
                    "dtype_a": d.dtype_a,
                    "dtype_b": d.dtype_b,
                    "max_abs_diff": d.max_abs_diff,
                }
                for d in self.differences
            ],
            "ignored_unused": self.ignored,
        }


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def compare(a: Checkpoint, b: Checkpoint, cast: torch.dtype | None = None, quiet: bool = True) -> Report:
    """Compare canonical tensors one at a time; ``cast`` applies to A's floating tensors."""
    report = Report()
    report.only_in_a = [k for k in a.tensors if k not in b.tensors]
    report.only_in_b = [k for k in b.tensors if k not in a.tensors]
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
                diff = None
                if ta.shape == tb.shape:
                    diff = float((ta.double() - tb.double()).abs().max()) if ta.numel() else 0.0
                report.differences.append(
                    Difference(name, tuple(ta.shape), tuple(tb.shape), dtype_name(ta.dtype), dtype_name(tb.dtype), diff)
                )
            del ta, tb
            bar.advance(a.tensors[name].nbytes)
    return report


def verify_paths(a: str | Path, b: str | Path, quiet: bool = True) -> Report:
    with open_checkpoint(a) as ca, open_checkpoint(b, model_type=ca.family.name) as cb:
        return compare(ca, cb, quiet=quiet)


def verify_against(src: Checkpoint, out_dir: Path, dtype: str | None, quiet: bool = True) -> Report:
    """Check a freshly written output against its (still open) source."""
    with open_checkpoint(out_dir, model_type=src.family.name) as out:
        return compare(src, out, to_torch(dtype) if dtype else None, quiet=quiet)
