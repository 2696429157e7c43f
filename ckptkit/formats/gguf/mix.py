"""llama-quantize's file types (``--dtype Q4_K_M``): which GGML type each tensor of the
16-bit GGUF gets, in the order llama-quantize writes them, as its ``llama_tensor_get_type``
chooses (no imatrix, no ``--pure``, no overrides).

The choice: tensors it never quantizes (under 2-D, norms, routers, not ``*weight``) keep
their 16-bit type; ``output.weight`` (and a tied ``token_embd.weight``) gets Q6_K, or Q8_0
when its rows do not split into the file type's blocks; the ``_M`` / ``_S`` mixes give more
bits to some layers' ``attn_v`` and ``ffn_down`` (counted in file order), and the 8-expert
rules; a type whose block does not divide a row falls back (Q4_K -> Q5_0, Q5_K -> Q5_1,
Q6_K -> Q8_0, then F16). File order: tensors outside blocks by name, then block by block,
names sorted inside a block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ckptkit.errors import CkptkitError

# llama-quantize's name -> (general.file_type, the type most tensors get)
FILE_TYPES: dict[str, tuple[int, str]] = {
    "Q4_0": (2, "Q4_0"),
    "Q4_1": (3, "Q4_1"),
    "Q5_0": (8, "Q5_0"),
    "Q5_1": (9, "Q5_1"),
    "Q4_K_S": (14, "Q4_K"),
    "Q4_K_M": (15, "Q4_K"),
    "Q5_K_S": (16, "Q5_K"),
    "Q5_K_M": (17, "Q5_K"),
    "Q6_K": (18, "Q6_K"),
}
NOT_YET = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "TQ1_0", "TQ2_0", "IQ4_NL", "IQ4_XS")
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
BLOCK = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}
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
_BLK = re.compile(r"blk\.(\d+)\.")


def quantize_type(dtype: str | None) -> str | None:
    """The llama-quantize file type ``dtype`` names (any case), None for other dtypes; a
    llama-quantize name ckptkit cannot write yet is a one-line error."""
    if dtype is None:
        return None
    name = dtype.upper()
    if name in FILE_TYPES:
        return name
    if name in NOT_YET:
        raise CkptkitError(f"--dtype {dtype}: not yet supported (ckptkit writes {', '.join(FILE_TYPES)} and q8_0)")
    return None


def file_order(names: list[str]) -> list[str]:
    """llama-quantize's tensor order: outside blocks first, then by block, by name inside each."""

    def key(name: str) -> tuple[int, str]:
        m = _BLK.match(name)
        return (int(m.group(1)) if m else -1, name)

    return sorted(names, key=key)


def _quantizable(name: str, dims: int) -> bool:
    return dims >= 2 and name.endswith("weight") and "_norm.weight" not in name and not any(k in name for k in KEPT)


def _more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@dataclass
class Mixer:
    """The per-tensor choice for file type ``ftype`` over one model's tensors (in file order)."""

    ftype: str
    names: list[str]
    n_layer: int
    n_expert: int = 0
    is_70b: bool = False

    def __post_init__(self) -> None:
        self.default = FILE_TYPES[self.ftype][1]
        self.n_attn_v = sum(1 for n in self.names if _category(n) in ("attn_v", "attn_qkv", "attn_kv_b"))
        self.tied = "output.weight" not in self.names
        self.i_attn_v = self.i_ffn_down = 0

    def choose(self, name: str, shape: tuple[int, ...], current: str) -> str:
        """The GGML type (by name) of tensor ``name`` (numpy shape order: the row last), stored
        as ``current`` in the 16-bit GGUF; called once per tensor, in file order."""
        if not _quantizable(name, len(shape)):
            return current
        return _fallback(self._mixed(name, shape[-1]), shape[-1])

    def _mixed(self, name: str, ncols: int) -> str:
        ft, new, cat = self.ftype, self.default, _category(name)
        if cat == "output" or (self.tied and cat == "token_embd"):
            if ncols % BLOCK[new]:
                return "Q8_0"
            return "Q6_K" if new != "Q8_0" else new
        if cat == "token_embd":
            return new
        if cat in ("attn_v", "attn_qkv", "attn_kv_b"):
            if ft in ("Q4_K_M", "Q5_K_M") and _more_bits(self.i_attn_v, self.n_attn_v):
                new = "Q6_K"
            elif ft == "Q4_K_S" and self.i_attn_v < 4:
                new = "Q5_K"
            if self.is_70b and new == "Q4_K":
                new = "Q5_K"
            if self.n_expert == 8:
                new = "Q8_0"
            self.i_attn_v += 1
        elif cat == "attn_k":
            if self.n_expert == 8:
                new = "Q8_0"
        elif cat == "ffn_down":
            layer = self.i_ffn_down
            if self.n_expert > 1:
                m = _BLK.match(name)
                if m is None or not 0 <= int(m.group(1)) < self.n_layer:
                    raise CkptkitError(f"cannot tell the layer of tensor {name}")
                layer = int(m.group(1))
            if ft in ("Q4_K_M", "Q5_K_M") and _more_bits(layer, self.n_layer):
                new = "Q6_K"
            elif ft == "Q4_K_S" and layer < self.n_layer // 8:
                new = "Q5_K"
            self.i_ffn_down += 1
        elif cat == "attn_output" and self.n_expert == 8 and ft in ("Q4_K_S", "Q4_K_M"):
            new = "Q5_K"
        return new


def _fallback(kind: str, ncols: int) -> str:
    if ncols % BLOCK[kind] == 0:
        return kind
    kind = FALLBACK.get(kind, kind)
    return kind if ncols % BLOCK[kind] == 0 else "F16"


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


def is_70b(arch: str, hparams: dict[str, Any]) -> bool:
    """llama.cpp's LLM_TYPE_70B: 80 layers of a Qwen2, OLMo or DeciLM, or of a Llama with
    fewer KV heads than heads (68 of a Jais2)."""
    layers, heads = hparams.get("num_hidden_layers"), hparams.get("num_attention_heads")
    if arch == "llama":
        return layers == 80 and (hparams.get("num_key_value_heads") or heads) != heads
    return (arch, layers) in (("qwen2", 80), ("olmo", 80), ("deci", 80), ("jais2", 68))
