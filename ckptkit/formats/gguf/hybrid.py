"""The hybrid Qwen stacks (Qwen3-Next, Qwen3.5 dense and MoE) as llama.cpp's converter writes
them: its config (the multimodal ``text_config`` lifted to the top, the MTP layers counted),
its names (``language_model.`` dropped, the vision tower skipped, the MTP layers as blocks
past ``num_hidden_layers``) and its tensor transforms (``A_log`` as ``-exp(A_log)``, the
conv kernel squeezed, norms as ``1 + w`` but the gated one, Qwen3.5's value heads from
grouped to tiled order, Qwen3-Next's fused ``in_proj_qkvz`` split into ``attn_qkv`` and
``attn_gate``). The reorders are row orders (and Qwen3.5's ``out_proj`` a transposition of
each row's blocks), so that the writer takes them from the stored bytes (:mod:`.rows`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ckptkit.formats.gguf.experts import MergedMaker
from ckptkit.formats.gguf.gguf_tensor import Moved
from ckptkit.io import take_ranges
from ckptkit.tensors.dtypes import ITEMSIZE

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch

    from ckptkit.io import Span
    from ckptkit.tensors.lazy import Lazy

_MTP_LAYER = re.compile(r"mtp\.layers\.(\d+)\.(.+)")
_MTP_PARTS = {
    "fc": "eh_proj",
    "pre_fc_norm_embedding": "enorm",
    "pre_fc_norm_hidden": "hnorm",
    "norm": "shared_head.norm",
}


def is_vision(name: str) -> bool:
    """Whether llama.cpp's text model skips ``name`` (the vision tower, for ``--mmproj``)."""
    return "visual." in name or "vision" in name


def hybrid_hparams(hparams: dict[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """config.json as llama.cpp reads it: ``text_config`` at the top, ``mtp_num_hidden_layers``
    counted from the tensor names where the config has none."""
    out = {**hparams, **hparams.get("text_config", {})}
    if not out.get("mtp_num_hidden_layers"):
        stored = [int(m.group(1)) for n in names if (m := _MTP_LAYER.fullmatch(n.removeprefix("model.")))]
        if stored:
            out["mtp_num_hidden_layers"] = max(stored) + 1
    return out


def blocks(hparams: dict[str, Any]) -> int:
    """``block_count``: the text layers and the MTP layers."""
    return int(hparams["num_hidden_layers"]) + int(hparams.get("mtp_num_hidden_layers") or 0)


def llama_cpp_name(name: str, layers: int) -> str:
    """The HF name llama.cpp maps ``name`` from (the MTP layers as layers past ``layers``)."""
    name = name.replace("language_model.", "")
    if name.startswith("model.mtp."):
        name = name.removeprefix("model.")
    if not name.startswith("mtp."):
        return name
    if m := _MTP_LAYER.fullmatch(name):
        return f"model.layers.{layers + int(m.group(1))}.{m.group(2)}"
    part, _, rest = name.removeprefix("mtp.").partition(".")
    return f"model.layers.{layers}.{_MTP_PARTS.get(part, part)}.{rest}"


_NEXTN = re.compile(
    r"model\.layers\.(\d+)\.(eh_proj|enorm|hnorm|shared_head\.norm|embed_tokens|shared_head\.head)\.weight"
)


def nextn_name(name: str) -> str | None:
    """``blk.N.nextn.*``: an MTP layer's own tensors, named from the ``gguf`` package's names
    (its tensor map has them for these architectures only in later releases)."""
    import gguf

    if not (m := _NEXTN.fullmatch(name)):
        return None
    kind = getattr(gguf.MODEL_TENSOR, "NEXTN_" + m.group(2).replace(".", "_").upper())
    return str(gguf.TENSOR_NAMES[kind]).format(bid=m.group(1)) + ".weight"


def tiled(t: torch.Tensor, dim: int, k_heads: int, head_dim: int) -> torch.Tensor:
    """``t``'s value heads along ``dim`` from grouped by key head (each key head's value heads
    together) to tiled order (the first value head of every key head, then the second...)."""
    shape = list(t.shape)
    per_k = shape[dim] // head_dim // k_heads
    grouped = t.reshape(*shape[:dim], k_heads, per_k, head_dim, *shape[dim + 1 :])
    return grouped.transpose(dim, dim + 1).reshape(shape)


def tiled_rows(n: int, k_heads: int, head_dim: int) -> npt.NDArray[np.int64]:
    """The order (source row of each output row) that takes ``n`` rows of value heads of
    ``head_dim`` rows from grouped by key head (each key head's value heads together) to
    tiled order (the first value head of every key head, then the second...)."""
    import numpy as np

    per_k = n // head_dim // k_heads
    return np.arange(n).reshape(k_heads, per_k, head_dim).transpose(1, 0, 2).reshape(-1)


def _heads(h: dict[str, Any]) -> tuple[int, int, int, int]:
    k, v = int(h["linear_num_key_heads"]), int(h["linear_num_value_heads"])
    return k, v, int(h["linear_key_head_dim"]), int(h["linear_value_head_dim"])


def row_order(name: str, h: dict[str, Any], reorder: bool, rows: int) -> npt.NDArray[np.int64] | None:
    """The source rows of the ``rows`` output rows of ``name`` (its conv kernel's channels) as
    llama.cpp orders Qwen3.5's value heads (None: as stored)."""
    import numpy as np

    kh, vh, kd, vd = _heads(h)
    if not (reorder and kh != vh and "linear_attn." in name):
        return None
    qk = 2 * kh * kd
    if ".in_proj_qkv." in name or ".conv1d" in name:
        return np.concatenate([np.arange(qk), qk + tiled_rows(rows - qk, kh, vd)])
    if ".in_proj_z." in name:
        return tiled_rows(rows, kh, vd)
    if name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_bias")):
        return tiled_rows(rows, kh, 1)
    return None


def moved_columns(name: str, h: dict[str, Any], reorder: bool, cols: int) -> Moved | None:
    """Qwen3.5's ``out_proj`` columns (``cols`` of them), value heads tiled as llama.cpp tiles
    them: each row's blocks transposed (None: another tensor)."""
    kh, vh, _, vd = _heads(h)
    if not (reorder and kh != vh and ".linear_attn.out_proj." in name):
        return None
    return Moved(1, (kh, cols // vd // kh, vd), (1, 0, 2))


def plus_one(name: str) -> bool:
    """Whether llama.cpp stores the norm ``name`` as ``1 + w`` (all but the gated one)."""
    return name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")


def transform(name: str, h: dict[str, Any], reorder: bool) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What llama.cpp does to the tensor HF names ``name`` (None: nothing), with torch (imported
    only when it runs): the row order and column moves of :func:`row_order` and
    :func:`moved_columns`, then arithmetic."""
    steps: list[Callable[[torch.Tensor], torch.Tensor]] = []
    if ".conv1d" in name:
        steps.append(lambda t: t.squeeze())

    def rows(t: torch.Tensor) -> torch.Tensor:
        import torch

        order = row_order(name, h, reorder, t.shape[0])
        return t if order is None else t[torch.from_numpy(order)]

    def cols(t: torch.Tensor) -> torch.Tensor:
        moved = moved_columns(name, h, reorder, t.shape[-1])
        return t if moved is None else moved.apply(t)

    if "linear_attn." in name and reorder:
        steps += [rows, cols]
    if name.endswith(".A_log"):
        steps.append(lambda t: -t.exp())
    elif plus_one(name):
        steps.append(lambda t: t + 1)
    if not steps:
        return None

    def apply(t: torch.Tensor) -> torch.Tensor:
        for step in steps:
            t = step(t)
        return t

    return apply


def arithmetic(name: str) -> bool:
    """Whether the transform computes (in float32, as llama.cpp does) rather than moves values."""
    return name.endswith(".A_log") or plus_one(name)


def qkvz_rows(h: dict[str, Any], part: int) -> npt.NDArray[np.int64]:
    """The rows of Qwen3-Next's ``in_proj_qkvz`` (per key head: q, k, its value heads, their
    gates) that llama.cpp writes as part 0 (``attn_qkv``: every q, then every k, then every v)
    or part 1 (``attn_gate``: the gates), in its order."""
    import numpy as np

    kh, vh, kd, vd = _heads(h)
    per = vh // kh * vd
    heads = np.arange(kh)[:, None] * (2 * kd + 2 * per)

    def rows(start: int, n: int) -> npt.NDArray[np.int64]:
        return (heads + start + np.arange(n)).reshape(-1)

    if part == 1:
        return rows(2 * kd + per, per)
    return np.concatenate([rows(0, kd), rows(kd, kd), rows(2 * kd, per)])


_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.)?(gate_up_proj|gate_proj|up_proj|down_proj)(?:\.weight)?"
)
Made = tuple[str, tuple[int, ...], Callable[[], "torch.Tensor"]]  # HF name llama.cpp maps, shape, make


class Experts:
    """llama.cpp's Qwen2MoeModel experts: transformers' stacked ``gate_up_proj`` split into the
    gate and up halves and ``down_proj`` as they come; one tensor per expert held until its
    layer's are all read, then written stacked (down, gate, up), one merged tensor at a time."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.held: dict[str, dict[str, Lazy]] = {}

    def take(self, name: str, lazy: Lazy) -> list[Made] | None:
        """The merged tensors ``name`` completes (None: no expert's; ``[]``: held)."""
        if not (m := _EXPERT.fullmatch(name)):
            return None
        bid, expert, proj = m.groups()
        p = f"model.layers.{bid}.mlp.experts."
        if expert is None and proj == "gate_up_proj":
            e, rows, cols = lazy.shape
            half = rows // 2
            return [
                (p + "gate_proj.weight", (e, half, cols), _half(lazy, 0)),
                (p + "up_proj.weight", (e, half, cols), _half(lazy, 1)),
            ]
        if expert is None:
            return [(p + proj + ".weight", lazy.shape, MergedMaker(lazy.get, lazy.shape, lazy.dtype, lazy.spans))]
        held = self.held.setdefault(bid, {})
        held[f"{expert}.{proj}"] = lazy
        if len(held) < 3 * self.n:
            return []
        del self.held[bid]
        return [
            (p + w + ".weight", (self.n, *held[f"0.{w}"].shape), _stacked([held[f"{e}.{w}"] for e in range(self.n)]))
            for w in ("down_proj", "gate_proj", "up_proj")
        ]


def _stacked(lazies: list[Lazy]) -> Callable[[], torch.Tensor]:
    from ckptkit.formats.gguf.experts import stacked

    return stacked(lazies)


def _half(lazy: Lazy, i: int) -> MergedMaker:
    """Half ``i`` (0: gate, 1: up) of each expert's rows of a stacked [E, 2 * I, H] ``gate_up_proj``."""
    e, rows, cols = lazy.shape
    half = rows // 2
    nbytes = half * cols * ITEMSIZE[lazy.dtype]

    def spans() -> list[Span] | None:
        whole = lazy.spans()
        return None if whole is None else take_ranges(whole, [((2 * x + i) * nbytes, nbytes) for x in range(e)])

    part = slice(i * half, (i + 1) * half)
    return MergedMaker(lambda: lazy.get()[:, part].contiguous(), (e, half, cols), lazy.dtype, spans)
