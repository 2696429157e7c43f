"""Writing a GGUF file as llama.cpp's ``convert_hf_to_gguf.py`` writes it, streamed.

The tensors come from the source as the HF layout names them (whatever the source's own
format), in the order llama.cpp reads an HF folder (shard by shard, names sorted inside a
safetensors shard); each is transformed as llama.cpp transforms it (Q/K permutation back to
Meta's layout, Gemma's norm + 1), cast through float32 and quantized by the ``gguf``
package, a block of rows at a time. Header, key/value metadata and tensor infos are
encoded by the ``gguf`` package's :class:`gguf.GGUFWriter` from shapes and types alone;
tensor bytes are then written one tensor at a time, never the whole model in memory.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError
from ckptkit.formats.format import CheckpointFormat
from ckptkit.formats.registry import register
from ckptkit.io import publishing_file
from ckptkit.untrusted import copy_regular_file

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ckptkit.formats.base import OpenedCheckpoint, RawCheckpoint
    from ckptkit.models.family import Family
    from ckptkit.tensors.lazy import Lazy

# family name -> llama.cpp architecture
ARCH = {
    "llama2": "llama",
    "llama3": "llama",
    "llama3_1": "llama",
    "llama3_2": "llama",
    "mistral": "llama",
    "gemma": "gemma",
    "phi3": "phi3",
    "qwen2": "qwen2",
}
GGUF_DTYPES = ("float32", "float16", "bfloat16", "q8_0")
CHUNK_BYTES = 16 << 20  # float32 bytes quantized at a time

# sha256 of str(ids of CHKTXT) -> tokenizer.ggml.pre, for the byte-level BPE tokenizers of
# our families (llama.cpp's get_vocab_base_pre knows many more and refuses the rest)
PRE_TOKENIZERS = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",
}
CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) "
    "✅ 🦙🦙 3 33 "
    "333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you "
    "sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)


def _gguf() -> Any:
    try:
        import gguf
    except ImportError:  # pragma: no cover - a dependency
        raise CkptkitError("--to gguf needs the gguf package (pip install gguf)") from None
    return gguf


@dataclass
class GGUFTensor:
    """One tensor of the output: its name, llama.cpp's type for it, and how to make it."""

    name: str
    shape: tuple[int, ...]
    qtype: Any  # gguf.GGMLQuantizationType
    make: Callable[[], torch.Tensor]  # float32 or float16, transformed, not yet quantized

    @property
    def nbytes(self) -> int:
        gguf = _gguf()
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape[:-1]) * (self.shape[-1] // block) * size


# --- the model's tensors as llama.cpp names and transforms them --------------------------------


def hf_hparams(ckpt: OpenedCheckpoint) -> dict[str, Any]:
    """config.json as llama.cpp would read it: the source's own, or the one ckptkit writes for HF."""
    if ckpt.raw.config_name == "config.json":
        return dict(ckpt.raw.config)
    weights = list(ckpt.tensors.values())
    main = max(weights, key=lambda t: t.nbytes).dtype if weights else "float32"
    return ckpt.family.config_to_hf(ckpt.config, main)


def _hf_order(ckpt: OpenedCheckpoint, names: list[str]) -> list[str]:
    """The order llama.cpp reads an HF folder in; a source with no HF shards is one sorted shard."""
    raw = ckpt.raw
    wanted = set(names)
    if raw.config_name == "config.json" and all(f.endswith((".safetensors", ".bin")) for f in raw.files):
        order: list[str] = []
        for f in sorted(raw.files):
            keys = [k for k in raw.files[f] if k in wanted]
            order += sorted(keys) if f.endswith(".safetensors") else keys
        rest = [k for k in names if k not in set(order)]
        return order + sorted(rest)
    return sorted(names)


def _permute(w: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute``: HF's rotate-half rows back to Meta's pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_freqs(hparams: dict[str, Any]) -> torch.Tensor | None:
    """llama.cpp's Llama 3 rope factors (``rope_freqs.weight``), computed as it computes them."""
    import torch

    rope = hparams.get("rope_parameters", hparams.get("rope_scaling")) or {}
    rope = rope.get("full_attention", rope)
    if "rope_type" not in rope and rope.get("type") is not None:
        rope = {**rope, "rope_type": rope["type"]}
    if rope.get("rope_type", "").lower() != "llama3":
        return None
    base = rope.get("rope_theta", hparams.get("rope_theta", 10000.0))
    dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
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


def _file_type(dtype: str | None, first_dtype: str) -> Any:
    gguf = _gguf()
    t = gguf.LlamaFileType
    if dtype is None:  # llama.cpp's --outtype auto
        return t.MOSTLY_BF16 if first_dtype == "bfloat16" else t.MOSTLY_F16
    return {"float32": t.ALL_F32, "float16": t.MOSTLY_F16, "bfloat16": t.MOSTLY_BF16, "q8_0": t.MOSTLY_Q8_0}[dtype]


def _qtype(name: str, shape: tuple[int, ...], ftype: Any) -> Any:
    """The GGML type llama.cpp gives a tensor: 1-D, norms and non-weights F32, else the file type."""
    gguf = _gguf()
    q, t = gguf.GGMLQuantizationType, gguf.LlamaFileType
    if len(shape) <= 1 or name.endswith("_norm.weight") or name[-7:] not in (".weight", ".lora_a", ".lora_b"):
        return q.F32
    chosen = {t.ALL_F32: q.F32, t.MOSTLY_F16: q.F16, t.MOSTLY_BF16: q.BF16, t.MOSTLY_Q8_0: q.Q8_0}[ftype]
    if chosen == q.Q8_0 and shape[-1] % gguf.GGML_QUANT_SIZES[q.Q8_0][0]:
        return q.F16  # llama.cpp's fallback when the rows do not split into blocks
    return chosen


def model_tensors(ckpt: OpenedCheckpoint, hparams: dict[str, Any], dtype: str | None) -> tuple[list[GGUFTensor], Any]:
    """The output tensors in llama.cpp's order, with the file type."""
    gguf = _gguf()
    import torch

    from ckptkit.formats.registry import get_format

    family = ckpt.family.name
    arch_name = ARCH.get(family)
    if arch_name is None:
        raise CkptkitError(f"{ckpt.path}: llama.cpp has no architecture for model type {family}")
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    hf_targets, _ = get_format("hf").targets(ckpt, {}, with_optional=False)
    names = [n for n in hf_targets if not n.endswith(".rotary_emb.inv_freq")]
    if arch_name == "gemma":
        names = [n for n in names if n != "lm_head.weight"]
    order = _hf_order(ckpt, names)
    first = hf_targets[order[0]].dtype if order else "float32"
    ftype = _file_type(dtype, first)
    n_blocks = hparams["num_hidden_layers"]
    tmap = gguf.get_tensor_name_map(arch, n_blocks)
    n_head = hparams["num_attention_heads"]
    n_kv = hparams.get("num_key_value_heads") or n_head
    out: list[GGUFTensor] = []
    freqs = _rope_freqs(hparams) if arch_name == "llama" else None
    if freqs is not None:
        name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
        factors: torch.Tensor = freqs
        out.append(GGUFTensor(name, tuple(factors.shape), gguf.GGMLQuantizationType.F32, lambda: factors))
    for hf_name in order:
        new = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise CkptkitError(f"{ckpt.path}: llama.cpp has no GGUF name for tensor {hf_name!r}")
        lazy = hf_targets[hf_name]
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None
        if arch_name == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            transform = lambda w: _permute(w, n_head, n_head)  # noqa: E731
        elif arch_name == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            transform = lambda w: _permute(w, n_head, n_kv)  # noqa: E731
        elif arch_name == "gemma" and hf_name.endswith("norm.weight"):
            transform = lambda w: w + 1  # noqa: E731
        out.append(GGUFTensor(new, lazy.shape, _qtype(new, lazy.shape, ftype), _maker(lazy, transform, torch)))
    return out, ftype


def _maker(
    lazy: Lazy, transform: Callable[[torch.Tensor], torch.Tensor] | None, torch: Any
) -> Callable[[], torch.Tensor]:
    def make() -> torch.Tensor:
        t = lazy.get()
        if t.dtype not in (torch.float16, torch.float32):  # as llama.cpp: anything else goes through f32
            t = t.to(torch.float32)
        return transform(t) if transform is not None else t

    return make


def quantized_chunks(t: torch.Tensor, qtype: Any) -> Iterator[bytes]:
    """The GGML bytes of ``t`` (float32 or float16), a block of whole rows at a time: row
    blocks quantize independently, so the bytes are those of quantizing it whole."""
    gguf = _gguf()
    arr: np.ndarray = t.contiguous().numpy()
    if arr.ndim == 0:
        arr = arr.reshape(1)
    rows = arr.reshape(-1, arr.shape[-1])
    step = max(1, CHUNK_BYTES // max(1, arr.shape[-1] * 4))
    for start in range(0, rows.shape[0], step):
        yield gguf.quants.quantize(rows[start : start + step], qtype).tobytes()


# --- tokenizer and key/value metadata ------------------------------------------------------------


@contextmanager
def hf_folder(ckpt: OpenedCheckpoint, hparams: dict[str, Any]) -> Iterator[Path]:
    """The tokenizer side of the source as an HF folder: the source itself when it is one,
    else a temporary folder with what ``--to hf`` would write beside the weights."""
    if ckpt.raw.config_name == "config.json" and ckpt.path.is_dir():
        yield ckpt.path
        return
    from ckptkit.formats.registry import get_format

    plan = get_format("hf").tokenizer(ckpt)
    with tempfile.TemporaryDirectory(prefix="ckptkit-gguf-") as tmp:
        folder = Path(tmp) / ckpt.path.name
        folder.mkdir()
        extra = getattr(ckpt, "extra_files", None)
        for src in extra() if extra is not None else []:
            if src.name not in plan.skip:
                copy_regular_file(src, folder / src.name)
        for name, data in plan.files.items():
            (folder / name).write_bytes(data)
        ids = {k: v for k, v in plan.ids.items() if hparams.get(k) is None and v is not None}
        (folder / "config.json").write_text(json.dumps({**hparams, **ids}, indent=2), encoding="utf-8")
        yield folder


def _look_special(token: str) -> bool:
    """llama.cpp's ``does_token_look_special``."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<｜") and token.endswith("｜>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def _read_json(path: Path) -> dict[str, Any]:
    from ckptkit.formats.base import read_json

    return read_json(path)[1] if path.is_file() else {}


def sentencepiece_vocab(
    folder: Path, hparams: dict[str, Any], phi3: bool = False
) -> tuple[list[bytes], list[float], list[int]]:
    """llama.cpp's ``_create_vocab_sentencepiece`` (and Phi-3's variant), from ckptkit's
    reader of the sentencepiece format."""
    from ckptkit.tokenization import spm_proto as spm

    path = folder / "tokenizer.model"
    if not path.is_file():
        raise FileNotFoundError(path)
    model = spm.read_spm_model(path)
    n = len(model.pieces)
    vocab_size = hparams.get("vocab_size") or n
    tokens = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    types = [spm.UNUSED] * vocab_size
    for i, piece in enumerate(model.pieces):
        if i >= vocab_size:
            break
        kind = piece.type if piece.type in (spm.UNKNOWN, spm.CONTROL, spm.UNUSED, spm.BYTE) else spm.NORMAL
        tokens[i], scores[i], types[i] = piece.text.encode(), piece.score, kind
    for key, tid in _read_json(folder / "added_tokens.json").items():
        if isinstance(tid, int) and tid < vocab_size:
            tokens[tid], scores[tid], types[tid] = key.encode(), -1000.0, spm.USER_DEFINED
    decoder = _read_json(folder / "tokenizer_config.json").get("added_tokens_decoder", {})
    sources = [(int(k), v) for k, v in decoder.items()]
    if phi3:
        sources += [(int(v["id"]), v) for v in _read_json(folder / "tokenizer.json").get("added_tokens", [])]
    for tid, data in sources:
        if tid >= vocab_size:
            continue
        token: str = data["content"]
        if phi3:
            types[tid] = spm.CONTROL if data.get("special") else spm.USER_DEFINED
        elif data.get("special") or _look_special(token):
            types[tid] = spm.CONTROL
        else:
            token = token.replace("\u2581", " ")
            types[tid] = spm.USER_DEFINED
        scores[tid], tokens[tid] = -1000.0, token.encode()
    return tokens, scores, types


def bpe_vocab(folder: Path, hparams: dict[str, Any]) -> tuple[list[str], list[int], str]:
    """llama.cpp's ``get_vocab_base`` for byte-level BPE, with the ``tokenizers`` library."""
    gguf = _gguf()
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise CkptkitError(f"{folder}: no tokenizer.json or tokenizer.model; llama.cpp needs a tokenizer")
    tok = Tokenizer.from_file(str(path))
    ids = tok.encode(CHKTXT, add_special_tokens=True).ids
    pre = PRE_TOKENIZERS.get(sha256(str(ids).encode()).hexdigest())
    if pre is None:
        raise CkptkitError(
            f"{path}: llama.cpp does not recognise this BPE pre-tokenizer (its encoding of llama.cpp's probe "
            "text matches no known tokenizer), so it cannot be written to GGUF"
        )
    vocab = tok.get_vocab(with_added_tokens=True)
    vocab_size = hparams.get("vocab_size", len(vocab))
    reverse = {i: t for t, i in vocab.items()}
    added = {int(a["id"]): a for a in _read_json(path).get("added_tokens", [])}
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if i in added:
            info = added[i]
            if not info.get("normalized", True) and not info.get("special"):
                token = tok.decode(tok.encode(token, add_special_tokens=False).ids, skip_special_tokens=False)
            if info.get("special") or _look_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    return tokens, types, pre


def special_vocab(folder: Path, **kwargs: Any) -> Any:
    """``gguf.SpecialVocab``, as the gguf-py that llama.cpp's converter vendors reads it: PyPI's
    gguf 0.19 does not yet default ``add_bos``/``add_eos`` to False for a ByteLevel post-processor
    (Llama 3), so ``tokenizer.ggml.add_eos_token`` would be missing."""
    gguf = _gguf()
    special = gguf.SpecialVocab(folder, **kwargs)
    post = (_read_json(folder / "tokenizer.json").get("post_processor") or {}) if kwargs.get("load_merges") else {}
    processors = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    if any(isinstance(p, dict) and p.get("type") == "ByteLevel" for p in processors):
        added = special.add_special_token
        special.add_special_token = {"bos": added.get("bos", False), "eos": added.get("eos", False), **added}
    return special


def add_vocab(w: Any, arch: str, folder: Path, hparams: dict[str, Any]) -> None:
    """The ``tokenizer.ggml.*`` keys, as each llama.cpp model class's ``set_vocab`` adds them."""
    gguf = _gguf()
    config = _read_json(folder / "tokenizer_config.json")

    def spm_keys(phi3: bool = False) -> int:
        tokens, scores, types = sentencepiece_vocab(folder, hparams, phi3)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        return len(tokens)

    def gpt2_keys() -> None:
        tokens, types, pre = bpe_vocab(folder, hparams)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        special_vocab(folder, load_merges=True).add_to_gguf(w)

    if arch == "llama":
        if (prefix := config.get("add_prefix_space")) is not None:
            w.add_add_space_prefix(prefix)
        if (folder / "tokenizer.model").is_file():
            gguf.SpecialVocab(folder, n_vocab=spm_keys()).add_to_gguf(w)
        else:
            try:
                gguf.LlamaHfVocab(folder)
            except (FileNotFoundError, TypeError):
                gpt2_keys()
            else:
                raise CkptkitError(
                    f"{folder}: a sentencepiece-style tokenizer.json without tokenizer.model is not supported"
                )
    elif arch == "gemma":
        gguf.SpecialVocab(folder, n_vocab=spm_keys()).add_to_gguf(w)
        special = gguf.SpecialVocab(
            folder, load_merges=False, special_token_types=["prefix", "suffix", "middle", "fsep", "eot"]
        )
        for kind, tid in (("prefix", 67), ("suffix", 69), ("middle", 68), ("fsep", 70), ("eot", 107)):
            special._set_special_token(kind, tid)
        special.chat_template = None
        special.add_to_gguf(w)
        w.add_add_space_prefix(False)
    elif arch == "phi3":
        if config.get("tokenizer_class") == "GPT2Tokenizer":
            gpt2_keys()
        else:
            gguf.SpecialVocab(folder, n_vocab=spm_keys(phi3=True)).add_to_gguf(w)
    else:  # qwen2
        if (folder / "tokenizer.model").is_file():
            gguf.SpecialVocab(folder, n_vocab=spm_keys()).add_to_gguf(w)
        else:
            gpt2_keys()


def _rope(hparams: dict[str, Any]) -> dict[str, Any]:
    rope = dict(hparams.get("rope_parameters", hparams.get("rope_scaling")) or {})
    if "rope_theta" not in rope and hparams.get("rope_theta") is not None:
        rope["rope_theta"] = hparams["rope_theta"]
    if "rope_type" not in rope and rope.get("type") is not None:
        rope["rope_type"] = rope["type"]
    return rope


def _text_parameters(w: Any, hparams: dict[str, Any], ftype: Any) -> None:
    """llama.cpp's ``TextModel.set_gguf_parameters`` for the keys our families have."""
    gguf = _gguf()
    w.add_block_count(hparams["num_hidden_layers"])
    if (n_ctx := hparams.get("max_position_embeddings")) is not None:
        w.add_context_length(n_ctx)
    w.add_embedding_length(hparams["hidden_size"])
    w.add_feed_forward_length(hparams["intermediate_size"])
    w.add_head_count(hparams["num_attention_heads"])
    if (kv := hparams.get("num_key_value_heads")) is not None:
        w.add_head_count_kv(kv)
    rope = _rope(hparams)
    if (rope_type := rope.get("rope_type")) is not None:
        factor = rope.get("factor")
        if rope_type == "linear" and factor is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(factor)
        elif rope_type == "yarn" and factor is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(factor)
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        elif rope_type in ("su", "longrope"):
            w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    if (theta := rope.get("rope_theta")) is not None:
        w.add_rope_freq_base(theta)
    if (eps := hparams.get("rms_norm_eps")) is not None:
        w.add_layer_norm_rms_eps(eps)
    if (head_dim := hparams.get("head_dim")) is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(ftype)


def add_parameters(w: Any, arch: str, hparams: dict[str, Any], ftype: Any) -> None:
    """Each model class's ``set_gguf_parameters``."""
    if arch == "gemma":
        w.add_context_length(hparams["max_position_embeddings"])
        w.add_embedding_length(hparams["hidden_size"])
        w.add_block_count(hparams["num_hidden_layers"])
        w.add_feed_forward_length(hparams["intermediate_size"])
        w.add_head_count(hparams["num_attention_heads"])
        w.add_head_count_kv(hparams.get("num_key_value_heads", hparams["num_attention_heads"]))
        w.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
        w.add_key_length(hparams["head_dim"])
        w.add_value_length(hparams["head_dim"])
        w.add_file_type(ftype)
        return
    if arch == "phi3":
        rope = _rope(hparams)
        n_embd, n_head = hparams["hidden_size"], hparams["num_attention_heads"]
        rope_dims = int(rope.get("partial_rotary_factor", 1.0) * n_embd) // n_head
        w.add_context_length(hparams["max_position_embeddings"])
        orig = rope.get("original_max_position_embeddings", hparams.get("original_max_position_embeddings"))
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(hparams["intermediate_size"])
        w.add_block_count(hparams["num_hidden_layers"])
        w.add_head_count(n_head)
        w.add_head_count_kv(hparams["num_key_value_heads"])
        w.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
        w.add_rope_dimension_count(rope_dims)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_file_type(ftype)
        w.add_sliding_window(hparams.get("sliding_window") or 0)
        return
    _text_parameters(w, hparams, ftype)
    if arch == "llama":
        w.add_vocab_size(hparams["vocab_size"])
        w.add_rope_dimension_count(hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"])


# --- the streaming write ---------------------------------------------------------------------------


@contextmanager
def _quiet_gguf() -> Iterator[None]:
    """The gguf package logs llama.cpp's conversion chatter as warnings; not ours to show."""
    import logging

    logger = logging.getLogger("gguf")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _model_name(ckpt: OpenedCheckpoint) -> str:
    return ckpt.path.name if ckpt.path.is_dir() else ckpt.path.stem


def write_gguf(ckpt: OpenedCheckpoint, dst: Path, dtype: str | None, quiet: bool = True, force: bool = False) -> int:
    """Write ``ckpt`` as the GGUF file ``dst``, as llama.cpp's converter would; returns its size.

    Header, metadata and tensor infos come first, from shapes and types; then each tensor's
    bytes. The file is written beside ``dst`` under a temporary name, fsynced, and renamed
    into place: ``dst`` is complete or absent.
    """
    gguf = _gguf()
    import numpy as np

    from ckptkit.progress import byte_progress

    hparams = hf_hparams(ckpt)
    arch = ARCH.get(ckpt.family.name, "")
    tensors, ftype = model_tensors(ckpt, hparams, dtype)
    w = gguf.GGUFWriter(None, arch)
    for t in tensors:
        w.add_tensor_info(t.name, t.shape, np.float32, t.nbytes, raw_dtype=t.qtype)  # shape as given
    total, shared, expert, experts = w.get_total_parameter_count()
    with hf_folder(ckpt, hparams) as folder, _quiet_gguf():
        w.add_type(gguf.GGUFType.MODEL)
        meta = gguf.Metadata.load(None, folder, None, total)
        if meta.name is None:
            meta.name = _model_name(ckpt)
        if meta.size_label is None and total > 0:
            meta.size_label = gguf.size_label(total, shared, expert, experts)
        meta.set_gguf_meta_model(w)
        add_parameters(w, arch, hparams, ftype)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        add_vocab(w, arch, folder, hparams)
    size = sum(t.nbytes for t in tensors)
    if dst.suffix != ".gguf":
        raise CkptkitError(f"{dst}: a GGUF destination is a file path ending in .gguf")
    with publishing_file(dst, force) as tmp:
        w.write_header_to_file(path=tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        fout = w.fout[0]
        try:
            w.write_padding(fout, fout.tell())
            with byte_progress("converting", size, quiet) as bar:
                for t in tensors:
                    written = 0
                    for chunk in quantized_chunks(t.make(), t.qtype):
                        fout.write(chunk)
                        written += len(chunk)
                    if written != t.nbytes:
                        raise RuntimeError(f"{t.name}: wrote {written} bytes, planned {t.nbytes}")
                    w.write_padding(fout, written)
                    bar.advance(written)
            fout.flush()
        finally:
            fout.close()
            w.fout = None
    return dst.stat().st_size


# --- the format -------------------------------------------------------------------------------------


class GGUFFormat(CheckpointFormat):
    """One ``.gguf`` file as llama.cpp writes it; as DST, a file path ending in ``.gguf``."""

    name = "gguf"
    expects = "a .gguf file"
    detect_order = 5
    weight_file = re.compile(r"[^/]+\.gguf")
    writes_file = True  # DST is one file, not a folder
    extra_dtypes = ("q8_0",)

    def detect(self, root: Path) -> bool:
        return root.is_file() and root.suffix == ".gguf"

    def owns_file(self, name: str) -> bool:
        return name.endswith(".gguf")

    def open(self, root: Path) -> RawCheckpoint:
        raise CkptkitError(f"{root}: reading GGUF is not supported yet; ckptkit writes GGUF (--to gguf)")

    def supports(self, family: Family) -> tuple[bool, bool]:
        """Written for the model types llama.cpp's converter takes (its architecture names); not read yet."""
        return False, family.name in ARCH

    def tokenizer_support(self, family: Family) -> str:
        return "tokenizer.ggml.* (from the source's tokenizer)"

    def write_file(self, ckpt: OpenedCheckpoint, dst: Path, dtype: str | None, quiet: bool, force: bool) -> int:
        if dtype is not None and dtype not in GGUF_DTYPES:
            raise CkptkitError(f"--dtype for --to gguf must be one of {', '.join(GGUF_DTYPES)}, not {dtype!r}")
        return write_gguf(ckpt, dst, dtype, quiet, force)


register(GGUFFormat())
