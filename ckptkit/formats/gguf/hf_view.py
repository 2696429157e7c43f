"""The HF tensors a llama.cpp GGUF was converted from, for the families whose GGUF tensors are
not each one HF tensor renamed: what :mod:`.tensors` does on writing, undone on reading.

Each HF tensor of the family's layout (one tensor per expert where llama.cpp merges experts)
is made from the GGUF tensors it was written as: an expert from its slice of the merged
``ffn_*_exps`` tensor (bytes copied where they lie), DeepSeek's ``kv_b_proj`` from its
per-head ``attn_k_b`` (transposed back) and ``attn_v_b``, gpt-oss's stacked experts
transposed back with the gate and up rows interleaved again (Llama 4's with the gate and up
halves joined again), the hybrid Qwen stacks' tensors
through :mod:`.hybrid_read`, any other renamed. Every GGUF tensor must be used, or the read
is refused, as for the formats read through a layout.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError
from ckptkit.formats.base import RawCheckpoint
from ckptkit.formats.gguf import mxfp4_read
from ckptkit.formats.gguf.experts import expert_gguf_name, per_expert
from ckptkit.formats.gguf.made import Made, Reader, expert
from ckptkit.formats.gguf.tensors import gguf_name, name_map
from ckptkit.formats.tensor_info import TensorInfo
from ckptkit.io import Span
from ckptkit.models import canonical_shapes
from ckptkit.models.moe import experts
from ckptkit.quant.mxfp4 import BLOCKS

if TYPE_CHECKING:
    import torch

    from ckptkit.formats.gguf.reader import GGUFHeader
    from ckptkit.models import Family, ModelConfig
    from ckptkit.models.gguf_spec import GGUFSpec
    from ckptkit.models.spec import Layout

_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_STACKED = re.compile(r"(model\.layers\.(\d+)\.(?:mlp|feed_forward)\.experts\.)(gate_up_proj|down_proj)(_bias)?")


class HFView:
    """A :class:`~ckptkit.formats.base.TensorReader` of the made HF tensors."""

    def __init__(self, made: dict[str, Made], file: str, inner: Any = None) -> None:
        self.made = made
        self.infos = {n: TensorInfo(n, m.shape, m.dtype, file) for n, m in made.items()}
        self.inner = inner  # the GGUF's reader, closed with the view

    def read(self, name: str) -> torch.Tensor:
        return self.made[name].get()

    def span(self, name: str) -> Span | None:
        spans = self.made[name].spans()
        return spans[0] if spans is not None and len(spans) == 1 else None

    def sample(self, name: str, nbytes: int) -> bytes:
        import torch

        t = self.read(name).contiguous().reshape(-1)
        return bytes(t.view(torch.uint8).numpy()[:nbytes].tobytes())

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


def needs_view(spec: GGUFSpec) -> bool:
    """Whether llama.cpp writes the family otherwise than one renamed HF tensor per GGUF tensor
    (or its experts merged): split, fused, transposed or computed tensors, or MTP layers as blocks."""
    nextn = "block_count_nextn" in spec.parameters
    stacked = spec.interleaved_experts or spec.halved_experts
    return spec.latent_attention or spec.linear_attention is not None or stacked or nextn


def hf_layout(family: Family, cfg: ModelConfig, spec: GGUFSpec) -> Layout:
    """The family's HF layout the view holds: one tensor per expert where llama.cpp merges them."""
    merged = spec.experts is not None or spec.linear_attention is not None
    return family.hf_layout(per_expert(cfg) if merged and experts(cfg) is not None else cfg)


def hf_view(raw: RawCheckpoint, family: Family, cfg: ModelConfig, spec: GGUFSpec) -> RawCheckpoint:
    """``raw`` (a GGUF) as the HF checkpoint llama.cpp converted, lazily."""
    from ckptkit.formats.gguf import hybrid_read

    reader = Reader(raw)
    layers = cfg.num_layers
    blocks = layers + _mtp_blocks(raw, layers)
    tmap = name_map(spec, blocks)
    expected = canonical_shapes(cfg)
    made: dict[str, Made] = {}
    for rule in hf_layout(family, cfg, spec).expand(layers):
        shape = rule.kind.native_shape([expected[c] for c in rule.canonical])
        name = rule.native
        if spec.interleaved_experts and name.endswith(BLOCKS):  # MXFP4 experts: the release's bytes
            made[name], made[mxfp4_read.scales_name(name)] = mxfp4_read.experts(reader, tmap, name, shape)
            continue
        if spec.linear_attention:
            got = hybrid_read.made(reader, tmap, name, shape, raw.config, spec, layers)
        else:
            got = _made(reader, tmap, name, shape, spec)
        if got is None and rule.optional:
            continue
        if got is None:
            raise CkptkitError(f"{raw.root / raw.config_name}: llama.cpp has no GGUF tensor for {name!r}")
        made[name] = got
    unknown = [n for n in raw.infos if n not in reader.used and n != "rope_freqs.weight"]
    if unknown:
        raise CkptkitError(
            f"{raw.root / raw.config_name}: unknown tensor name(s) for {cfg.model_type}: {', '.join(unknown[:3])}"
            + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else "")
        )
    view = HFView(made, raw.config_name, raw.readers.get(raw.config_name))
    return RawCheckpoint(
        format=raw.format,
        root=raw.root,
        files={raw.config_name: list(made)},
        infos=dict(view.infos),
        readers={raw.config_name: view},
        config_name=raw.config_name,
        config_text=raw.config_text,
        config=raw.config,
        lossy=dict(raw.lossy),
    )


def as_release(raw: RawCheckpoint, h: GGUFHeader) -> bool:
    """Show ``raw`` (a GGUF holding MXFP4 experts) as the release it was written from, in place
    (:mod:`.mxfp4_read`): its tensors the release's (:func:`hf_view`), its config with the release's
    ``quantization_config``. False (``raw`` unchanged) where the family is not gpt-oss's."""
    from ckptkit.formats.gguf import model
    from ckptkit.quant import QUANT_KEY

    family = model.family_of(h, raw.config)
    spec = family.gguf_spec()
    if spec is None or not spec.interleaved_experts:
        return False
    try:
        cfg = family.refine_config(family.config_from_hf(raw.config), [mxfp4_read.GATE_UP])
    except (KeyError, TypeError, ValueError) as e:
        raise CkptkitError(f"{h.path}: metadata lacks or misstates {e}") from None
    inner = dataclasses.replace(raw)  # the GGUF's own tensors, which the view reads
    view = hf_view(inner, family, cfg, spec)
    raw.files, raw.infos, raw.readers = view.files, view.infos, view.readers
    raw.config = {**raw.config, QUANT_KEY: dict(mxfp4_read.RELEASE_CONFIG)}
    raw.lossy = {n: k for n, k in raw.lossy.items() if k != mxfp4_read.MXFP4}
    return True


def _mtp_blocks(raw: RawCheckpoint, layers: int) -> int:
    found = [int(m.group(1)) for n in raw.infos if (m := re.match(r"blk\.(\d+)\.", n))]
    return max(0, max(found, default=-1) + 1 - layers)


def _made(reader: Reader, tmap: Any, name: str, shape: tuple[int, ...], spec: GGUFSpec) -> Made | None:
    """The HF tensor ``name`` from the GGUF tensors it was written as (None: none)."""
    if spec.experts is not None and (m := _EXPERT.fullmatch(name)):
        return expert(reader, f"blk.{m.group(1)}.ffn_{m.group(3)}_exps.weight", int(m.group(2)))
    if spec.latent_attention and name.endswith("kv_b_proj.weight"):
        return _kv_b(reader, tmap, name, shape)
    if (spec.interleaved_experts or spec.halved_experts) and (m := _STACKED.fullmatch(name)):
        return _interleaved(reader, tmap, m, shape, spec.halved_experts)
    suffix = ".weight" if spec.interleaved_experts and name.endswith(".sinks") else ""
    new = gguf_name(tmap, name + suffix)
    if new is None or not reader.has(new):
        return None
    return reader.renamed(new)


def _kv_b(reader: Reader, tmap: Any, name: str, shape: tuple[int, ...]) -> Made:
    """``kv_b_proj`` [heads * (nope + v), rank] from ``attn_k_b`` [heads, rank, nope] and
    ``attn_v_b`` [heads, v, rank]: each head's key rows then its value rows."""
    k_name, v_name = (gguf_name(tmap, name.replace("kv_b_proj", p)) for p in ("k_b_proj", "v_b_proj"))
    if k_name is None or v_name is None:  # pragma: no cover - the gguf package names both for deepseek2
        raise CkptkitError(f"llama.cpp has no GGUF names for the parts of {name}")
    k, v = reader.info(k_name), reader.info(v_name)
    heads, rank = k.shape[0], k.shape[1]
    if v.shape[0] != heads or v.shape[2] != rank or shape != (heads * (k.shape[2] + v.shape[1]), rank):
        raise CkptkitError(f"{k_name} {list(k.shape)} and {v_name} {list(v.shape)} do not make {name} {list(shape)}")

    def get() -> torch.Tensor:
        import torch

        key, value = reader.raw.read(k_name).transpose(1, 2), reader.raw.read(v_name)
        return torch.cat([key, value], dim=1).reshape(shape)

    return Made(shape, k.dtype, get)


def _interleaved(reader: Reader, tmap: Any, m: re.Match[str], shape: tuple[int, ...], halves: bool) -> Made:
    """The stacked ``gate_up_proj`` [E, cols, 2 * rows] and ``down_proj`` [E, rows, cols]
    transposed back, the gate and up rows interleaved again (gpt-oss's) or joined as halves
    (``halves``: Llama 4's), and gpt-oss's biases."""
    prefix, proj, bias = m.group(1), m.group(3), m.group(4) is not None
    suffix = ".bias" if bias else ".weight"

    def named(hf: str) -> str:
        return expert_gguf_name(tmap, prefix + hf + suffix)

    if proj == "down_proj":
        down = reader.info(named("down_proj"))
        if bias:
            return reader.renamed(down.name)
        return Made(shape, down.dtype, lambda: reader.raw.read(down.name).transpose(1, 2).contiguous())
    gate, up = reader.info(named("gate_proj")), reader.info(named("up_proj"))

    def get() -> torch.Tensor:
        import torch

        parts = [reader.raw.read(gate.name), reader.raw.read(up.name)]
        if halves:  # gate rows then up rows, back to [E, cols, 2 * rows] (a bias: [E, 2 * rows])
            return torch.cat(parts, dim=-1) if bias else torch.cat(parts, dim=1).transpose(1, 2).contiguous()
        both = torch.stack(parts, dim=2 if not bias else -1)
        if bias:
            return both.reshape(shape)
        e, rows, _, cols = both.shape
        return both.reshape(e, 2 * rows, cols).transpose(1, 2).contiguous()

    return Made(shape, gate.dtype, get)
