"""llama-quantize's file types (``--dtype Q4_K_M``): which GGML type each tensor of the
16-bit GGUF gets, in the order llama-quantize writes them, as ``llama_tensor_get_type``
(``src/llama-quant.cpp``) chooses, with its options (:class:`~ckptkit.formats.base.QuantOptions`).

The choice: tensors it never quantizes (under 2-D, norms, routers, not ``*weight``, and
``output.weight`` with ``--leave-output-tensor``) keep their 16-bit type;
``--token-embedding-type`` / ``--output-tensor-type`` name those tensors' types outright;
otherwise ``--pure`` gives every tensor the file type's, else the mix rules pick: the output
(and a tied ``token_embd``) Q6_K, or Q8_0 when its rows do not split into the file type's
blocks; the ``_S`` / ``_M`` / ``_L`` mixes give more bits to some layers' ``attn_v`` /
``ffn_down`` / ``attn_output`` (counted in file order, by block number for MoE models); the
grouped-query, 8-expert, 70B and imatrix rules. Last, a type whose block does not divide a
row falls back (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K / Q3_K / TQ -> Q4_0,
IQ4_XS -> IQ4_NL), then to F16. File order: tensors outside blocks by name, then block by
block, names sorted inside a block.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError, note

if TYPE_CHECKING:
    import torch

    from ckptkit.formats.base import QuantOptions
    from ckptkit.formats.gguf.gguf_tensor import GGUFTensor
    from ckptkit.formats.gguf.imatrix import Imatrix

# llama-quantize's name -> (general.file_type, the type most tensors get)
FILE_TYPES: dict[str, tuple[int, str]] = {
    "Q4_0": (2, "Q4_0"), "Q4_1": (3, "Q4_1"), "Q5_0": (8, "Q5_0"), "Q5_1": (9, "Q5_1"), "Q8_0": (7, "Q8_0"),
    "Q2_K": (10, "Q2_K"), "Q3_K_S": (11, "Q3_K"), "Q3_K_M": (12, "Q3_K"), "Q3_K_L": (13, "Q3_K"),
    "Q4_K_S": (14, "Q4_K"), "Q4_K_M": (15, "Q4_K"), "Q5_K_S": (16, "Q5_K"), "Q5_K_M": (17, "Q5_K"),
    "Q6_K": (18, "Q6_K"), "IQ4_NL": (25, "IQ4_NL"), "IQ4_XS": (30, "IQ4_XS"), "TQ1_0": (36, "TQ1_0"),
    "TQ2_0": (37, "TQ2_0"),
}  # fmt: skip
# names --dtype keeps for llama.cpp's converter (convert_hf_to_gguf --outtype q8_0)
CONVERTER_NAMES = ("Q8_0",)
FALLBACK = {
    "Q2_K": "Q4_0", "Q3_K": "Q4_0", "TQ1_0": "Q4_0", "TQ2_0": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1",
    "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL",
}  # fmt: skip
# names llama-quantize never quantizes, besides norms and tensors under 2-D
KEPT = (
    "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj", "ssm_conv1d",
    "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight", "attn_rel_b.weight",
    ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger",
    "a.rvq.codebook", "mm.a.code_embd", "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight",
    "time_mix_w2.weight", "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight", "time_mix_a0.weight",
    "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight", "time_mix_g2.weight",
    "time_mix_decay_w1.weight", "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight",
)  # fmt: skip
UNQUANTIZED = ("F32", "F16", "BF16")
_BLK = re.compile(r"blk\.(\d+)\.")


def writable() -> set[str]:
    """The GGML types ckptkit writes: the 16-bit ones, Q8_0 and those with an encoder."""
    from ckptkit.formats.gguf.encoders import ENCODERS

    return {*UNQUANTIZED, "Q8_0", *ENCODERS}


def quantize_type(dtype: str | None) -> str | None:
    """The llama-quantize file type ``dtype`` names (any case), None for other dtypes; a
    llama-quantize name ckptkit cannot write yet is a one-line error."""
    if dtype is None or dtype.upper() not in FILE_TYPES or dtype.upper() in CONVERTER_NAMES:
        return None
    name = dtype.upper()
    if FILE_TYPES[name][1] not in writable():
        can = [n for n, (_, kind) in FILE_TYPES.items() if kind in writable() and n not in CONVERTER_NAMES]
        raise CkptkitError(f"--dtype {dtype}: not yet supported (ckptkit writes {', '.join(can)} and q8_0)")
    return name


def ggml_type(value: str, flag: str) -> str:
    """The GGML type ``value`` names (any case, as llama-quantize's ``parse_ggml_type``) for
    ``flag``; an unknown name, or one ckptkit does not write, is a one-line error."""
    import gguf

    names = {t.name.upper(): t.name for t in gguf.GGMLQuantizationType}
    kind = names.get(value.upper())
    if kind is None:
        raise CkptkitError(f"{flag} {value}: not a GGML type ({', '.join(sorted(writable()))} are written)")
    if kind not in writable():
        raise CkptkitError(f"{flag} {value}: ckptkit does not write {kind} yet ({', '.join(sorted(writable()))})")
    return kind


def block(kind: str) -> int:
    """Values per block of GGML type ``kind``."""
    import gguf

    size: int = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]
    return size


def file_order(names: list[str]) -> list[str]:
    """llama-quantize's tensor order: outside blocks first, then by block, by name inside each."""

    def key(name: str) -> tuple[int, str]:
        m = _BLK.match(name)
        return (int(m.group(1)) if m else -1, name)

    return sorted(names, key=key)


def _quantizable(name: str, shape: tuple[int, ...], leave_output: bool) -> bool:
    """llama-quantize's ``tensor_allows_quantization`` (``ggml_n_dims``: leading 1s of the
    numpy shape do not count)."""
    dims = len(shape) - next((i for i, d in enumerate(shape) if d != 1), len(shape))
    if (leave_output and name == "output.weight") or name in ("position_embd.weight", "token_types.weight"):
        return False
    return dims >= 2 and name.endswith("weight") and "_norm.weight" not in name and not any(k in name for k in KEPT)


def _more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@dataclass
class ModelFacts:
    """What llama-quantize's rules read of the model besides tensor names."""

    arch: str
    n_layer: int  # block count
    n_expert: int = 0
    n_gqa: int = 1  # heads over KV heads
    is_70b: bool = False


@dataclass
class Mixer:
    """The per-tensor choice for file type ``ftype`` over one model's tensors (in file order),
    with llama-quantize's options (output / token embedding types, pure, leave output, imatrix)."""

    ftype: str
    names: list[str]
    model: ModelFacts
    output_type: str | None = None
    embedding_type: str | None = None
    pure: bool = False
    leave_output: bool = False
    has_imatrix: bool = False
    counters: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.default = FILE_TYPES[self.ftype][1]
        self.n_attn_v = sum(1 for n in self.names if _category(n) in ("attn_v", "attn_qkv", "attn_kv_b"))
        self.tied = "output.weight" not in self.names

    def choose(self, name: str, shape: tuple[int, ...], current: str) -> str:
        """The GGML type (by name) of tensor ``name`` (numpy shape order: the row last), stored
        as ``current`` in the 16-bit GGUF; called once per tensor, in file order."""
        if not _quantizable(name, shape, self.leave_output):
            return current
        cat = _category(name)
        if self.embedding_type is not None and cat == "token_embd":
            return self.embedding_type
        if self.output_type is not None and cat == "output":
            return self.output_type
        kind = self.default if self.pure else self._mixed(name, cat, shape[-1])
        return _fallback(kind, shape[-1])

    def _count(self, what: str) -> int:
        i = self.counters.get(what, 0)
        self.counters[what] = i + 1
        return i

    def _layer(self, what: str, name: str) -> tuple[int, int]:
        """llama-quantize's ``layer_info``: the ``what`` counter, or the block number of a MoE model's tensor."""
        i, n = self._count(what), self.model.n_layer
        if self.model.n_expert > 1:
            m = _BLK.match(name)
            if m is None or not 0 <= int(m.group(1)) < n:
                raise CkptkitError(f"cannot tell the layer of tensor {name}")
            i = int(m.group(1))
        return i, n

    def _mixed(self, name: str, cat: str, ncols: int) -> str:
        ft, new, m = self.ftype, self.default, self.model
        if cat == "output" or (self.tied and cat == "token_embd"):
            if self.output_type is not None:
                return self.output_type
            if m.arch == "falcon" or ncols % block(new):
                return "Q8_0"
            return "Q6_K" if new != "Q8_0" else new
        if cat == "token_embd":
            return "Q4_K" if ft in ("TQ1_0", "TQ2_0") else new
        if cat in ("attn_v", "attn_qkv", "attn_kv_b"):
            return self._attn_v(new)
        if cat == "attn_k":
            return "Q8_0" if m.n_expert == 8 else new
        if cat == "ffn_down":
            return self._ffn_down(name, new)
        if cat == "attn_output":
            return self._attn_output(new)
        if cat in ("ffn_gate", "ffn_up"):
            self._layer(cat, name)
        return new

    def _attn_v(self, new: str) -> str:
        ft, m, i = self.ftype, self.model, self.counters.get("attn_v", 0)
        if ft == "Q2_K":
            new = "Q4_K" if m.n_gqa >= 4 else "Q3_K"
        elif ft == "Q3_K_M":
            new = "Q5_K" if i < 2 else "Q4_K"
        elif ft == "Q3_K_L":
            new = "Q5_K"
        elif ft in ("IQ4_NL", "IQ4_XS") and m.n_gqa >= 4:
            new = "Q5_K"
        elif ft in ("Q4_K_M", "Q5_K_M") and _more_bits(i, self.n_attn_v):
            new = "Q6_K"
        elif ft == "Q4_K_S" and i < 4:
            new = "Q5_K"
        if m.is_70b and new in ("Q3_K", "Q4_K"):
            new = "Q5_K"
        if m.n_expert == 8:
            new = "Q8_0"
        self._count("attn_v")
        return new

    def _ffn_down(self, name: str, new: str) -> str:
        ft, m = self.ftype, self.model
        i, n = self._layer("ffn_down", name)
        falcon = m.arch == "falcon"
        if ft == "Q2_K":
            new = "Q3_K"
        elif ft == "Q3_K_M":
            new = "Q5_K" if i < n // 16 else "Q4_K" if not falcon or _more_bits(i, n) else "Q3_K"
        elif ft == "Q3_K_L":
            new = "Q4_K" if falcon else "Q5_K"
        elif ft == "Q4_K_M":
            if falcon:
                new = "Q6_K" if i < n // 16 else "Q5_K" if _more_bits(i, n) else "Q4_K"
            elif _more_bits(i, n):
                new = "Q6_K"
        elif i < n // 8 and ft in ("IQ4_NL", "IQ4_XS") and not self.has_imatrix:
            new = "Q5_K"
        elif ft == "Q5_K_M" and _more_bits(i, n):
            new = "Q6_K"
        elif ft == "Q4_K_S" and not falcon and i < n // 8:
            new = "Q5_K"
        elif ft in ("Q4_0", "Q5_0") and self.has_imatrix and i < n // 8:
            new = "Q4_1" if ft == "Q4_0" else "Q5_1"
        return new

    def _attn_output(self, new: str) -> str:
        ft, m = self.ftype, self.model
        if m.arch == "falcon":
            return "Q4_K" if ft == "Q3_K_L" else new
        if m.n_expert == 8:
            eight = ("Q2_K", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ4_XS")
            return "Q5_K" if ft in eight else new
        return {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(ft, new)


def _fallback(kind: str, ncols: int) -> str:
    if kind in UNQUANTIZED or ncols % block(kind) == 0:
        return kind
    kind = FALLBACK.get(kind, kind)
    return kind if ncols % block(kind) == 0 else "F16"


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for cat in ("attn_qkv", "attn_kv_b", "attn_v", "attn_k", "attn_q", "attn_output"):
        if f"{cat}.weight" in name:
            return cat
    for cat in ("ffn_up", "ffn_gate", "ffn_down"):
        if cat in name:
            return cat
    return "other"


def model_facts(arch: str, hparams: dict[str, Any], n_expert: int) -> ModelFacts:
    """llama-quantize's view of the model: block count, experts, GQA ratio, 70B."""
    heads = hparams.get("num_attention_heads") or 0
    kv = hparams.get("num_key_value_heads") or heads
    return ModelFacts(arch, hparams["num_hidden_layers"], n_expert, heads // kv if kv else 0, is_70b(arch, hparams))


def is_70b(arch: str, hparams: dict[str, Any]) -> bool:
    """llama.cpp's LLM_TYPE_70B: 80 layers of a Qwen2, OLMo or DeciLM, or of a Llama with
    fewer KV heads than heads (68 of a Jais2)."""
    layers, heads = hparams.get("num_hidden_layers"), hparams.get("num_attention_heads")
    if arch == "llama":
        return layers == 80 and (hparams.get("num_key_value_heads") or heads) != heads
    return (arch, layers) in (("qwen2", 80), ("olmo", 80), ("deci", 80), ("jais2", 68))


def mixed_types(
    base: list[GGUFTensor], ftype: str, facts: Any, opts: QuantOptions, has_imatrix: bool
) -> list[tuple[GGUFTensor, str]]:
    """``base`` (the 16-bit GGUF's tensors) in llama-quantize's order, each with the GGML type
    (by name) it gives them for ``ftype`` and ``opts``, whether ckptkit writes it or not."""
    import gguf

    by_name = {t.name: t for t in base}
    order = file_order(list(by_name))
    out_type = opts.output_tensor_type and ggml_type(opts.output_tensor_type, "--output-tensor-type")
    embd_type = opts.token_embedding_type and ggml_type(opts.token_embedding_type, "--token-embedding-type")
    mixer = Mixer(ftype, order, facts, out_type, embd_type, opts.pure, opts.leave_output_tensor, has_imatrix)
    kind = gguf.GGMLQuantizationType
    return [(by_name[n], mixer.choose(n, by_name[n].shape, kind(by_name[n].qtype).name)) for n in order]


def requantized(
    base: list[GGUFTensor], ftype: str, facts: Any, opts: QuantOptions, imatrix: Imatrix | None
) -> list[GGUFTensor]:
    """``base`` as llama-quantize writes it (:func:`mixed_types`); a retyped tensor is
    quantized from its 16-bit values, weighted by ``imatrix`` where it has the tensor's entry."""
    import gguf

    q = gguf.GGMLQuantizationType
    out: list[GGUFTensor] = []
    for t, chosen in mixed_types(base, ftype, facts, opts, imatrix is not None):
        if chosen not in writable():
            made = f"llama-quantize makes {t.name} {chosen}"
            raise CkptkitError(f"--dtype {ftype}: {made}, which ckptkit does not write yet")
        kind = q[chosen]
        if kind == t.qtype:
            out.append(t)
        else:
            stored = _stored_as(t.make, q(t.qtype).name)
            out.append(replace(t, qtype=kind, make=stored, source=None, heads=None, moved=None, weights=None))
    if imatrix is not None:
        _weigh(out, {t.name: t for t in base}, imatrix)
    return out


def _weigh(out: list[GGUFTensor], base: dict[str, GGUFTensor], imatrix: Imatrix) -> None:
    """Give the quantized tensors of ``out`` their ``imatrix`` weights (checked to be this model's)."""
    from ckptkit.formats.gguf.weighted import UNWEIGHTED, WEIGHTED

    retyped = [t for t in out if t.qtype != base[t.name].qtype]
    imatrix.check({t.name: t.shape for t in retyped})
    for t in retyped:
        t.weights = imatrix.weights(t.name, t.shape)
        kind = type(t.qtype)(t.qtype).name
        if t.weights is not None and kind not in WEIGHTED and kind not in UNWEIGHTED:
            raise CkptkitError(f"--imatrix: ckptkit does not write {kind} weighted by an imatrix yet ({t.name})")


def _stored_as(make: Callable[[], torch.Tensor], kind: str) -> Callable[[], torch.Tensor]:
    """``make``'s tensor with the values of its 16-bit GGML type ``kind`` (F16 / BF16)."""

    def made() -> torch.Tensor:
        import torch

        t = make()
        dtype = {"F16": torch.float16, "BF16": torch.bfloat16}.get(kind)
        return t.to(dtype) if dtype is not None and t.dtype != dtype else t

    return made


def kept_dtype(ftype: int | None) -> str | None:
    """The ``--dtype`` of a ``general.file_type`` ckptkit writes (None: another, or none)."""
    import gguf

    t = gguf.LlamaFileType
    kept = {t.ALL_F32: "float32", t.MOSTLY_F16: "float16", t.MOSTLY_BF16: "bfloat16", t.MOSTLY_Q8_0: "q8_0"}
    return next((dtype for kind, dtype in kept.items() if int(kind) == ftype), None)


def keep_types(tensors: list[GGUFTensor], types: dict[str, str], where: object) -> list[str]:
    """Give each tensor the GGML type it has in the GGUF ``types`` (name -> type) was read
    from, where ckptkit writes that type; notes on the others (left as the file type says)."""
    import gguf

    from ckptkit.formats.gguf.encoders import ENCODERS

    q = gguf.GGMLQuantizationType
    writable = {"F32", "F16", "BF16", "Q8_0", *ENCODERS}
    others: dict[str, str] = {}
    for t in tensors:
        kind = types.get(t.name)
        if kind is None or kind == q(t.qtype).name:
            continue
        plain = kind in ("F32", "F16", "BF16")
        if kind in writable and (plain or t.shape[-1] % gguf.GGML_QUANT_SIZES[q[kind]][0] == 0):
            t.qtype = q[kind]
        else:
            others.setdefault(kind, q(t.qtype).name)
    if not others:
        return []
    written = ", ".join(f"{kind} as {now}" for kind, now in sorted(others.items()))
    kinds = ", ".join(sorted(writable))
    fact = (
        f"{where}: ckptkit writes GGUF tensors as {kinds}, in rows of whole blocks; "
        f"tensors of other types or rows written {written}"
    )
    return [note(fact, "to quantize them as before, run llama.cpp's llama-quantize on the output")]
