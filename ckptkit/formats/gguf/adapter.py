"""A PEFT LoRA adapter written as llama.cpp's LoRA GGUF, as its ``convert_lora_to_gguf.py`` writes it.

The adapter folder (``adapter_config.json`` + ``adapter_model.safetensors`` or ``.bin``;
ckptkit's trainer writes the same) gives the tensors, ``lora_alpha`` and the model card;
the base (``--base``, else the adapter's ``base_model_name_or_path`` when it is a local
checkpoint of any format ckptkit reads; opened by the caller) gives the architecture and the shapes. Keys:
``general.type = adapter``, ``adapter.type = lora``, the model card's ``general.*`` keys,
``adapter.lora.alpha``. Tensors, in the order the adapter file holds their first half:
``<GGUF name>.lora_a`` (A, ``rank x in``) and ``.lora_b`` (B, ``out x rank``), the Q/K
permutation applied to B's rows only; the embeddings' A is stored transposed, as llama.cpp
reads it. No ``rope_freqs`` (a LoRA GGUF never holds one) and no vocabulary.

Where the script writes what llama.cpp cannot load or run (LoRA on the output layer or the
embeddings of a model whose output layer is its embeddings: llama.cpp finds the first under
no tensor and applies the second to its output layer too) or silently changes the adapter
(rsLoRA scaling), this is refused in one line, or (rsLoRA with one rank) the alpha is
written that gives the same scaling.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError

if TYPE_CHECKING:
    import torch

    from ckptkit.formats.base import OpenedCheckpoint, Options
    from ckptkit.formats.gguf.tensors import GGUFTensor
    from ckptkit.formats.gguf.writer import GGUFPlan

PREFIX = "base_model.model."
HALVES = {  # PEFT's key suffix -> (which half, the base weight's suffix)
    ".lora_A.weight": ("a", ".weight"),
    ".lora_B.weight": ("b", ".weight"),
    ".lora_embedding_A": ("a", ".weight"),
    ".lora_embedding_B": ("b", ".weight"),
}
LOSSLESS = "float32"  # convert_lora_to_gguf.py's default --outtype (its `auto` fails on adapters)


def merge_hint(adapter: Path) -> str:
    return (
        f"merge it into its base instead (ckptkit merge BASE {adapter} MERGED), then convert the merged "
        "model (ckptkit convert MERGED out.gguf --to gguf)"
    )


def _checked_config(adapter: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> float:
    """The ``adapter.lora.alpha`` to write, or a one-line refusal of what a LoRA GGUF cannot hold."""
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise CkptkitError(f"{adapter}: a {kind} adapter; llama.cpp's adapter GGUF holds LoRA only")
    if config.get("lora_bias") or any(k.endswith(".lora_B.bias") for k in tensors):
        raise CkptkitError(f"{adapter}: LoRA with a bias (lora_bias), which a LoRA GGUF lacks; {merge_hint(adapter)}")
    saved = sorted(k for k in tensors if not k.endswith((*HALVES, ".base_layer.weight")))
    listed = config.get("modules_to_save") or []
    if listed or saved:
        names = [k.removeprefix(PREFIX) for k in saved[:3]] or ([listed] if isinstance(listed, str) else list(listed))
        what = ", ".join(map(str, names))
        raise CkptkitError(
            f"{adapter}: the adapter replaces whole tensors (modules_to_save: {what}), which a LoRA GGUF "
            f"cannot hold; {merge_hint(adapter)}"
        )
    if config.get("use_dora"):
        raise CkptkitError(f"{adapter}: a DoRA adapter; llama.cpp's LoRA GGUF cannot hold its magnitudes")
    if config.get("target_parameters"):
        raise CkptkitError(f"{adapter}: LoRA on experts or routers (target_parameters); {merge_hint(adapter)}")
    alpha = config.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise CkptkitError(f"{adapter}: adapter_config.json's lora_alpha is {alpha!r}, not a number")
    patterns = config.get("alpha_pattern") or {}
    if not isinstance(patterns, dict) or any(v != alpha for v in patterns.values()):
        raise CkptkitError(f"{adapter}: alpha_pattern gives modules their own alpha; a LoRA GGUF holds one")
    if config.get("use_rslora"):
        ranks = {t.shape[0] for k, t in tensors.items() if k.endswith((".lora_A.weight", ".lora_embedding_A"))}
        if len(ranks) != 1:
            raise CkptkitError(f"{adapter}: rsLoRA with several ranks; llama.cpp scales every tensor by alpha / rank")
        alpha = alpha * math.sqrt(ranks.pop())  # alpha' / r == alpha / sqrt(r)
    return float(alpha)


def _pairs(adapter: Path, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """HF weight name -> {"a": A, "b": B}, in the order the adapter file first names each."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        found = next(((s, h) for s, h in HALVES.items() if key.endswith(s)), None)
        if found is None:
            continue  # .base_layer.weight: the base's own copy, not part of the adapter
        suffix, (half, weight) = found
        pairs.setdefault(key.removeprefix(PREFIX).removesuffix(suffix) + weight, {})[half] = t
    for name, pair in pairs.items():
        if len(pair) != 2:
            have = next(iter(pair))
            raise CkptkitError(f"{adapter}: {name} has lora_{have.upper()} but no lora_{'BA'['ab'.index(have)]}")
        a, b = pair["a"], pair["b"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise CkptkitError(
                f"{adapter}: {name}'s lora_A {list(a.shape)} and lora_B {list(b.shape)} are not a rank-r pair"
            )
    if not pairs:
        raise CkptkitError(f"{adapter}: the adapter holds no LoRA tensors")
    return pairs


def adapter_tensors(
    adapter: Path, base: OpenedCheckpoint, tensors: dict[str, torch.Tensor], dtype: str | None
) -> tuple[list[GGUFTensor], Any]:
    """The output tensors in llama.cpp's order, with the file type."""
    import gguf

    from ckptkit.formats.gguf.tensors import (
        GGUFTensor,
        file_type,
        gguf_name,
        hf_hparams,
        hf_targets,
        name_map,
        permute,
        qtype,
        spec_of,
    )

    spec = spec_of(base.family, base.path)
    hparams = hf_hparams(base)  # config.json as llama.cpp reads it
    shapes = {k: v.shape for k, v in hf_targets(base).items()}
    tmap = name_map(spec, hparams["num_hidden_layers"])
    n_head = hparams["num_attention_heads"]
    n_kv = hparams.get("num_key_value_heads") or n_head
    ftype = file_type(dtype or LOSSLESS, "float32")
    embeddings = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.TOKEN_EMBD] + ".weight"
    out: list[GGUFTensor] = []
    for name, pair in _pairs(adapter, tensors).items():
        a, b = pair["a"], pair["b"]
        new = gguf_name(tmap, name)
        if name not in shapes or new is None or (spec.drops_output and name == "lm_head.weight"):
            tied = name == "lm_head.weight"
            why = (
                " (its output layer is its embeddings, so llama.cpp's GGUF of it has no output.weight)" if tied else ""
            )
            raise CkptkitError(f"{adapter}: the adapter adapts {name}, which {base.path} does not have{why}")
        embedding = new == embeddings
        if embedding and ("lm_head.weight" not in shapes or spec.drops_output):
            raise CkptkitError(
                f"{adapter}: LoRA on the embeddings of a model whose output layer is its embeddings: llama.cpp "
                f"applies a token_embd.weight LoRA to its output layer too, where it cannot; {merge_hint(adapter)}"
            )
        want = tuple(shapes[name])
        got = (a.shape[1], b.shape[0]) if embedding else (b.shape[0], a.shape[1])
        if got != want:
            raise CkptkitError(f"{adapter}: {name} is {list(got)} in the adapter, {list(want)} in {base.path}")
        if a.dtype != b.dtype:  # llama.cpp's LoraTorchTensor
            a, b = a.float(), b.float()
        if spec.permute_qk and name.endswith("q_proj.weight"):
            b = permute(b, n_head, n_head)
        elif spec.permute_qk and name.endswith("k_proj.weight"):
            b = permute(b, n_head, n_kv)
        if embedding:
            a = a.T.contiguous()  # llama.cpp gathers the embeddings' A by token: rows of rank r
        for half, t in ((f"{new}.lora_a", a), (f"{new}.lora_b", b)):
            shape = tuple(t.shape)
            out.append(GGUFTensor(half, shape, qtype(half, shape, ftype), functools.partial(_same, t)))
    return out, ftype


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def plan_adapter(fmt: str, adapter: Path, base: OpenedCheckpoint, opts: Options) -> GGUFPlan:
    """The LoRA adapter folder ``adapter`` as llama.cpp's LoRA GGUF: header, key/values and
    tensor infos, and each tensor in llama.cpp's order."""
    import gguf

    from ckptkit.formats.gguf.tensors import spec_of
    from ckptkit.formats.gguf.writer import NARROWING, add_model_card, gguf_plan, model_name, planned_writer, quiet_gguf
    from ckptkit.formats.peft_adapter import read_adapter_config, read_adapter_tensors

    dtype = opts.dtype
    config = read_adapter_config(adapter)
    tensors = read_adapter_tensors(adapter)
    alpha = _checked_config(adapter, config, tensors)
    invocation = config.get("alora_invocation_tokens")
    if config.get("invocation_string") and not invocation:
        raise CkptkitError(f"{adapter}: an aLoRA with an invocation_string but no alora_invocation_tokens")
    spec = spec_of(base.family, base.path)
    planned, _ = adapter_tensors(adapter, base, tensors, dtype)
    w = planned_writer(spec.arch, planned)
    with quiet_gguf():
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        add_model_card(w, adapter, model_name(base.path))
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
        if invocation:
            uint32 = gguf.GGUFValueType.UINT32
            w.add_key_value(gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS, invocation, gguf.GGUFValueType.ARRAY, uint32)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    checked = dtype in NARROWING and not opts.allow_lossy_cast
    return gguf_plan(fmt, w, planned, model_name(adapter) + ".gguf", checked)
