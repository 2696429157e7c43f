"""The tensors of a GGUF as llama.cpp's converter names, orders, transforms and types them.

The tensors come from the source as the HF layout names them (whatever the source's own
format), in the order llama.cpp reads an HF folder (shard by shard, names sorted inside a
safetensors shard); each is transformed as the family's
:class:`~ckptkit.models.gguf_spec.GGUFSpec` says (Q/K permutation back to Meta's layout,
Gemma's norm + 1) and given llama.cpp's GGML type for the file type.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError, UnknownModel, note
from ckptkit.formats.base import QuantOptions
from ckptkit.formats.gguf import hybrid, latent, mxfp4, nvfp4
from ckptkit.formats.gguf.experts import (
    ExpertMerger,
    llama_cpp_view,
    refuse_dense_layers,
    source_of,
    stacked_experts,
)
from ckptkit.formats.gguf.gguf_tensor import NEG_EXP, PLUS_ONE, GGUFTensor, Moved
from ckptkit.formats.gguf.imatrix import Imatrix
from ckptkit.formats.gguf.mix import FILE_TYPES, model_facts, quantize_type, requantized
from ckptkit.formats.gguf.params import rope
from ckptkit.formats.gguf.per_layer import proportional_rope_freqs
from ckptkit.formats.gguf.rows import reordered
from ckptkit.formats.registry import find_format, transformers_format
from ckptkit.models.gguf_spec import GGUFSpec
from ckptkit.models.moe import experts

if TYPE_CHECKING:
    import torch

    from ckptkit.formats.base import OpenedCheckpoint
    from ckptkit.models.family import Family
    from ckptkit.tensors.lazy import Lazy

GGUF_DTYPES = ("float32", "float16", "bfloat16", "q8_0")
# llama.cpp keeps MoE routers and the linear attention's conv kernels in float32 whatever the file type
ALWAYS_F32 = (".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight", ".ssm_conv1d.weight")


def spec_of(family: Family, where: object) -> GGUFSpec:
    spec = family.gguf_spec()
    if spec is None:
        raise UnknownModel(family.no_gguf(where))
    return spec


def loads_in_transformers(fmt: object) -> bool:
    """Whether the format named ``fmt`` (a checkpoint's, or a recorded origin's) is a folder
    transformers loads as it is: its weights and config.json are an HF folder's."""
    found = find_format(fmt)
    return found is not None and found.info.loads_in_transformers


def hf_targets(ckpt: OpenedCheckpoint) -> dict[str, Lazy]:
    """The tensors of ``ckpt`` as the format transformers loads names them."""
    hf = transformers_format()
    return hf.planner(hf).targets(ckpt, {}, with_optional=False)[0]


def hf_hparams(ckpt: OpenedCheckpoint) -> dict[str, Any]:
    """config.json as llama.cpp would read it in the HF folder of this model: the source's
    own, the one it was converted from (recorded), or the one ckptkit writes for HF."""
    if ckpt.raw.hf_config:
        return dict(ckpt.raw.config)
    recorded = ckpt.origin.get("config") or {}
    if loads_in_transformers(ckpt.origin.get("format")):  # checked to be a JSON object when the origin was read
        config: dict[str, Any] = json.loads(recorded["text"])
        return config
    weights = list(ckpt.tensors.values())
    main = max(weights, key=lambda t: t.nbytes).dtype if weights else "float32"
    return ckpt.family.config_to_hf(ckpt.config, main)


def _hf_files(ckpt: OpenedCheckpoint, targets: dict[str, Lazy], fresh: bool) -> list[tuple[str, list[str]]]:
    """The weight files (name, keys as stored) of the HF folder llama.cpp would be given:
    the source itself, the HF folder it was converted from (recorded), or (always when
    ``fresh``) what ``--to hf`` writes for it."""
    from ckptkit.formats.base import Options

    raw = ckpt.raw
    hf = loads_in_transformers(raw.format)
    if hf and not fresh:
        return [(f, list(keys)) for f, keys in raw.files.items()]
    origin = ckpt.origin
    if not fresh and loads_in_transformers(origin.get("format")) and origin.get("files"):
        return [(f["name"], list(f["keys"])) for f in origin["files"]]
    fmt = transformers_format()
    files, _ = fmt.planner(fmt).default_files(ckpt, targets, Options(fmt.name))
    return [(f.name, list(f.keys)) for f in files]


def _hf_order(ckpt: OpenedCheckpoint, targets: dict[str, Lazy], names: list[str], fresh: bool = False) -> list[str]:
    """The order llama.cpp reads that HF folder in: shard by shard, names sorted inside a
    safetensors shard, stored order inside a torch pickle."""
    wanted = set(names)
    order: list[str] = []
    for f, keys in sorted(_hf_files(ckpt, targets, fresh)):
        found = [k for k in keys if k in wanted]
        order += sorted(found) if f.endswith(".safetensors") else found
    placed = set(order)
    return order + sorted(k for k in names if k not in placed)


def permute(w: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute``: HF's rotate-half rows back to Meta's pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_freqs(hparams: dict[str, Any]) -> torch.Tensor | None:
    """llama.cpp's Llama 3 rope factors (``rope_freqs.weight``), computed as it computes them."""
    settings = rope(hparams)
    settings = settings.get("full_attention", settings)
    if "rope_type" not in settings and settings.get("type") is not None:
        settings = {**settings, "rope_type": settings["type"]}
    if settings.get("rope_type", "").lower() != "llama3":
        return None
    import torch

    base = settings.get("rope_theta", hparams.get("rope_theta", 10000.0))
    dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = settings.get("factor", 8.0)
    low, high = settings.get("low_freq_factor", 1.0), settings.get("high_freq_factor", 4.0)
    old = settings.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old / low, old / high
    factors: list[Any] = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def file_type(dtype: str | None, first_dtype: str) -> Any:
    """``general.file_type`` for ``--dtype`` (None: llama.cpp's ``--outtype auto``)."""
    import gguf

    t = gguf.LlamaFileType
    if dtype is None:
        return t.MOSTLY_BF16 if first_dtype == "bfloat16" else t.MOSTLY_F16
    return {"float32": t.ALL_F32, "float16": t.MOSTLY_F16, "bfloat16": t.MOSTLY_BF16, "q8_0": t.MOSTLY_Q8_0}[dtype]


def qtype(name: str, shape: tuple[int, ...], ftype: Any) -> Any:
    """The GGML type llama.cpp gives a tensor: 1-D, norms and non-weights F32, else the file type."""
    import gguf

    q, t = gguf.GGMLQuantizationType, gguf.LlamaFileType
    if (
        len(shape) <= 1
        or name.endswith(("_norm.weight", *ALWAYS_F32))
        or name[-7:] not in (".weight", ".lora_a", ".lora_b")
    ):
        return q.F32
    chosen = {t.ALL_F32: q.F32, t.MOSTLY_F16: q.F16, t.MOSTLY_BF16: q.BF16, t.MOSTLY_Q8_0: q.Q8_0}[ftype]
    if chosen == q.Q8_0 and shape[-1] % gguf.GGML_QUANT_SIZES[q.Q8_0][0]:
        return q.F16  # llama.cpp's fallback when the rows do not split into blocks
    return chosen


def name_map(spec: GGUFSpec, n_blocks: int) -> Any:
    """The ``gguf`` package's HF name -> GGUF name map for ``spec``'s architecture."""
    import gguf

    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == spec.arch), None)
    if arch is None:  # pragma: no cover - a spec naming an architecture the gguf package lacks
        raise CkptkitError(f"the gguf package has no architecture {spec.arch!r}")
    return gguf.get_tensor_name_map(arch, n_blocks)


def gguf_name(tmap: Any, hf_name: str) -> str | None:
    if hf_name.endswith("e_score_correction_bias"):  # as llama.cpp's map_tensor_name renames a router bias
        hf_name = hf_name.removesuffix("_bias") + ".bias"
    found: str | None = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    return found


def renamed(spec: GGUFSpec, hf_name: str) -> str | None:
    """The GGUF name llama.cpp gives a layer tensor its model class names itself (``spec.renames``)."""
    found = _LAYER.fullmatch(hf_name.replace("language_model.", ""))
    if found is None:
        return None
    new = dict(spec.renames).get(found.group(2))
    return None if new is None else f"blk.{found.group(1)}.{new}"


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def model_tensors(
    ckpt: OpenedCheckpoint,
    hparams: dict[str, Any],
    dtype: str | None,
    quant: QuantOptions | None = None,
    imatrix: Imatrix | None = None,
) -> tuple[list[GGUFTensor], Any]:
    """The output tensors in llama.cpp's order, with the file type. A llama-quantize type
    (``Q4_K_M``): the converter's 16-bit tensors (``--outtype auto``) retyped and reordered
    as llama-quantize does with ``quant``'s options and ``imatrix`` (its file, loaded)
    (:mod:`~ckptkit.formats.gguf.mix`), with its file type."""
    import gguf

    quantized = quantize_type(dtype)
    if quantized is not None:
        kept = ckpt.quant.method.ggml_type if ckpt.quant is not None else None
        if kept is not None:
            what = "MXFP4 experts" if kept == "MXFP4" else f"{kept} weights"
            raise CkptkitError(
                f"{ckpt.path}: --dtype {dtype}: ckptkit does not re-quantize {what} as llama-quantize does; "
                f"write --to gguf without --dtype ({kept} kept) and run llama-quantize on that"
            )
        base, _ = model_tensors(ckpt, hparams, None)
        spec = spec_of(ckpt.family, ckpt.path)
        moe = experts(ckpt.config)
        facts = model_facts(spec.arch, hparams, moe.num_experts if moe else 0)
        mixed = requantized(base, quantized, facts, quant or QuantOptions(), imatrix)
        return mixed, gguf.LlamaFileType(FILE_TYPES[quantized][0])

    spec = spec_of(ckpt.family, ckpt.path)
    merger, regrouped = None, False
    if spec.experts is not None and experts(ckpt.config) is not None:
        ckpt, regrouped = llama_cpp_view(ckpt, spec, spec.experts)
        merger = ExpertMerger(ckpt, spec.experts)
    targets = hf_targets(ckpt)
    names = [n for n in targets if not n.endswith(".rotary_emb.inv_freq")]
    if spec.drops_output:
        names = [n for n in names if n != "lm_head.weight"]
    order = _hf_order(ckpt, targets, names, fresh=regrouped)
    layers = hparams["num_hidden_layers"]
    blocks = (
        hybrid.blocks(hparams) if spec.linear_attention else layers + int(hparams.get("num_nextn_predict_layers") or 0)
    )
    tmap = name_map(spec, blocks)
    out: list[GGUFTensor] = []
    n_head = hparams["num_attention_heads"]
    n_kv = hparams.get("num_key_value_heads") or n_head
    if mxfp4.is_mxfp4(ckpt):  # kept as llama.cpp keeps them, written first
        mx = gguf.GGMLQuantizationType.MXFP4
        out += [GGUFTensor(n, shape, mx, make) for n, shape, make in mxfp4.expert_tensors(ckpt, order, targets, tmap)]
        order = [n for n in order if not n.endswith(mxfp4.BLOCKS)]
    if nvfp4.is_nvfp4(ckpt):  # the same, with their scales
        nvfp4.check_layout(ckpt, spec)
        out += nvfp4.tensors(ckpt, order, targets, tmap, lambda n: _qk_permute(spec, n, n_head, n_kv), hparams)
        order = [n for n in order if targets[n].dtype != "uint8"]
    ftype = file_type(dtype, targets[order[0]].dtype if order else "float32")
    freqs = rope_freqs(hparams) if spec.rope_freqs else None
    if spec.proportional_rope:
        freqs = proportional_rope_freqs(hparams)
    if freqs is not None:
        name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
        factors: torch.Tensor = freqs
        out.append(GGUFTensor(name, tuple(factors.shape), gguf.GGMLQuantizationType.F32, lambda: factors))
    mtp, skipped = left_out(spec, hparams, list(dict.fromkeys([*order, *ckpt.unused])))  # towers unused too
    if mtp:  # llama.cpp's deepseek2 skips the multi-token-prediction layers
        fact = f"{len(mtp)} tensor(s) of the MTP layer(s) past num_hidden_layers not written, as llama.cpp skips them"
        ckpt.notes.append(note(fact))
    hybrid_experts = hybrid.Experts(int(hparams.get("num_experts") or 0))
    if spec.linear_attention and hybrid_experts.n:
        refuse_dense_layers(ckpt, spec)
    if skipped:
        towers = "tensor(s) of the vision (or audio) tower not written"
        fact = f"{len(skipped)} {towers}: llama.cpp writes them with --mmproj"
        ckpt.notes.append(note(fact, "ckptkit does not write the vision part (--mmproj) as GGUF"))
    for source_name in order:
        if source_name in mtp or source_name in skipped:
            continue
        hf_name = hybrid.llama_cpp_name(source_name, layers) if spec.linear_attention else source_name
        if spec.renames and (out_name := renamed(spec, source_name)) is not None:
            lazy = targets[source_name]
            kind = qtype(out_name, lazy.shape, ftype)
            out.append(GGUFTensor(out_name, lazy.shape, kind, _maker(lazy, None, False), lazy))
            continue
        if spec.linear_attention and (merged := hybrid_experts.take(hf_name, targets[source_name])) is not None:
            out += [_merged(n, shape, make, ftype) for n, shape, make in _named(tmap, merged)]
            continue
        if spec.linear_attention:
            out += _linear_attention(tmap, hf_name, targets[source_name], hparams, spec, ftype)
            continue
        if spec.latent_attention and hf_name.endswith("kv_b_proj.weight"):
            out += _kv_b_split(tmap, hf_name, targets[hf_name], hparams, ftype)
            continue
        if merger is not None and (merged := merger.take(hf_name)) is not None:
            out += [_merged(name, shape, make, ftype) for name, shape, make in merged]
            continue
        if split := stacked_experts(spec, hf_name, targets[hf_name], tmap):
            out += [GGUFTensor(name, shape, qtype(name, shape, ftype), make) for name, shape, make in split]
            continue
        sinks = spec.interleaved_experts and hf_name.endswith("sinks")
        new = gguf_name(tmap, hf_name.replace("language_model.", "") + (".weight" if sinks else ""))
        if new is None:
            raise CkptkitError(f"{ckpt.path}: llama.cpp has no GGUF name for tensor {hf_name!r}")
        lazy = targets[source_name]
        heads = _qk_heads(spec, hf_name, n_head, n_kv)
        transform = _qk_permute(spec, hf_name, n_head, n_kv)
        plus_one = spec.norm_plus_one and hf_name.endswith("norm.weight")
        if plus_one:
            transform = lambda w: w + 1  # noqa: E731
        made = _maker(lazy, transform, plus_one)
        kind = qtype(new, lazy.shape, ftype)
        out.append(GGUFTensor(new, lazy.shape, kind, made, lazy, heads, PLUS_ONE if plus_one else None))
    if merger is not None:
        merger.check_done()
    return out, _with_kept(ckpt, ftype)


def _merged(name: str, shape: tuple[int, ...], make: Callable[[], torch.Tensor], ftype: Any) -> GGUFTensor:
    """A merged expert tensor, copied a chunk at a time from its source's bytes where they lie there."""
    return GGUFTensor(name, shape, qtype(name, shape, ftype), make, source_of(make))


def _qk_heads(spec: GGUFSpec, hf_name: str, n_head: int, n_kv: int) -> int | None:
    """The heads llama.cpp's ``permute`` takes ``hf_name``'s rows over (None: not permuted)."""
    if spec.permute_qk and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return n_head
    if spec.permute_qk and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return n_kv  # permute(w, n_head, n_kv) permutes over the KV heads
    return None


def _qk_permute(spec: GGUFSpec, hf_name: str, n_head: int, n_kv: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    heads = _qk_heads(spec, hf_name, n_head, n_kv)
    return None if heads is None else functools.partial(permute, n_head=heads, n_head_kv=None)


def _with_kept(ckpt: OpenedCheckpoint, ftype: Any) -> Any:
    """llama.cpp's ``general.file_type`` where it keeps a source's MXFP4 or NVFP4 weights:
    theirs where the other tensors are F32, F16 or BF16."""
    import gguf

    t = gguf.LlamaFileType
    kept = ckpt.quant.method.ggml_type if ckpt.quant is not None else None
    if kept is None or ftype not in (t.ALL_F32, t.MOSTLY_F16, t.MOSTLY_BF16):
        return ftype
    return {"MXFP4": t.MOSTLY_MXFP4_MOE, "NVFP4": t.MOSTLY_NVFP4}[kept]


def _linear_attention(
    tmap: Any, hf_name: str, lazy: Lazy, hparams: dict[str, Any], spec: GGUFSpec, ftype: Any
) -> list[GGUFTensor]:
    """A tensor of a hybrid Qwen stack as llama.cpp writes it (:mod:`~ckptkit.formats.gguf.hybrid`)."""
    if hf_name.endswith("in_proj_qkvz.weight"):
        bid, gates = hf_name.split(".")[2], hparams["linear_num_value_heads"] * hparams["linear_value_head_dim"]
        out = []
        for i, (part, rows) in enumerate((("attn_qkv", lazy.shape[0] - gates), ("attn_gate", gates))):
            name = f"blk.{bid}.{part}.weight"
            shape: tuple[int, ...] = (rows, lazy.shape[1])
            source = reordered(lazy, hybrid.qkvz_rows(hparams, i))
            out.append(GGUFTensor(name, shape, qtype(name, shape, ftype), source.get, source))
        return out
    key = hf_name.removesuffix(".dt_bias") + ".dt_proj.bias" if hf_name.endswith(".dt_bias") else hf_name
    new = gguf_name(tmap, key) or hybrid.nextn_name(hf_name)
    if new is None:
        raise CkptkitError(f"llama.cpp has no GGUF name for tensor {hf_name!r}")
    shape = tuple(d for d in lazy.shape if d != 1) if ".conv1d" in hf_name else lazy.shape
    tiled = spec.linear_attention == "tiled"
    change = hybrid.transform(hf_name, hparams, tiled)
    made = _maker(lazy, change, hybrid.arithmetic(hf_name))
    source = reordered(lazy, hybrid.row_order(hf_name, hparams, tiled, shape[0]), shape)
    if hf_name.endswith(".A_log"):  # -exp as torch computes it (bfloat16 only; else torch itself)
        moved: Moved | None = NEG_EXP
    else:
        moved = PLUS_ONE if hybrid.plus_one(hf_name) else hybrid.moved_columns(hf_name, hparams, tiled, shape[-1])
    return [GGUFTensor(new, shape, qtype(new, shape, ftype), made, source, moved=moved)]


def _named(tmap: Any, made: list[hybrid.Made]) -> list[hybrid.Made]:
    """``made`` under llama.cpp's GGUF names."""
    out = []
    for hf_name, shape, make in made:
        if (name := gguf_name(tmap, hf_name)) is None:
            raise CkptkitError(f"llama.cpp has no GGUF name for tensor {hf_name!r}")
        out.append((name, shape, make))
    return out


def left_out(spec: GGUFSpec, hparams: dict[str, Any], names: list[str]) -> tuple[list[str], list[str]]:
    """The tensors among ``names`` (HF names) llama.cpp does not write: (the MTP layers past
    ``num_hidden_layers`` of deepseek2, the towers of a multimodal release)."""
    mtp = [n for n in names if spec.latent_attention and _past_blocks(n, hparams["num_hidden_layers"])]
    towers = [
        n
        for n in names
        if (spec.linear_attention and hybrid.is_vision(n)) or n.removeprefix("model.").startswith(spec.skipped)
    ]
    return mtp, towers


def _past_blocks(hf_name: str, blocks: int) -> bool:
    found = re.match(r"model\.layers\.(\d+)\.", hf_name)
    return found is not None and int(found.group(1)) >= blocks


def _kv_b_split(tmap: Any, hf_name: str, lazy: Lazy, hparams: dict[str, Any], ftype: Any) -> list[GGUFTensor]:
    """llama.cpp's deepseek2 ``kv_b_proj`` as ``attn_k_b`` and ``attn_v_b`` (:mod:`.latent`)."""
    out = []
    for part, shape, source, moved in latent.kv_b_parts(hf_name, lazy, hparams):
        name = gguf_name(tmap, part)
        if name is None:  # pragma: no cover - the gguf package names both for deepseek2
            raise CkptkitError(f"llama.cpp has no GGUF name for {part}")
        make = latent.maker(source, moved, shape)
        out.append(GGUFTensor(name, shape, qtype(name, shape, ftype), make, source, moved=moved))
    return out


def _maker(
    lazy: Lazy, transform: Callable[[torch.Tensor], torch.Tensor] | None, arithmetic: bool
) -> Callable[[], torch.Tensor]:
    """The tensor as stored, transformed. llama.cpp casts anything but float16/float32 to
    float32 before its transforms; a row permutation commutes with that cast, so it is done
    in the stored dtype (the cast comes a chunk at a time, :func:`quantized_chunks`), and only
    ``arithmetic`` transforms (Gemma's + 1) get the whole tensor in float32."""

    def make() -> torch.Tensor:
        import torch

        t = lazy.get()
        if arithmetic and t.dtype not in (torch.float16, torch.float32):
            t = t.to(torch.float32)
        return transform(t) if transform is not None else t

    return make
