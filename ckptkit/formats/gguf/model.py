"""The model a GGUF holds, read back: its family, its config.json fields, its layout (GGUF
tensor names, with the Q/K permutation undone), and Gemma's ``1 + w`` norms undone exactly.

Everything comes from the header and the family's :class:`~ckptkit.models.gguf_spec.GGUFSpec`
(read as llama.cpp wrote it): nothing here knows a family by name.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError, UnknownModel
from ckptkit.formats.gguf import per_layer
from ckptkit.formats.gguf.arch_params import arch_fields
from ckptkit.formats.gguf.experts import merged_rules, per_expert
from ckptkit.formats.gguf.params import hparams_from_metadata
from ckptkit.formats.gguf.reader import GGUFHeader, meta_int, meta_str
from ckptkit.formats.gguf.tensors import gguf_name, name_map, rope_freqs
from ckptkit.formats.gguf.tensors import renamed as llama_cpp_renamed
from ckptkit.models.fields import check_config_fields
from ckptkit.models.gguf_spec import GGUFSpec
from ckptkit.models.spec import Layout, Rule
from ckptkit.tensors.transforms import COPY, ROPE_K, ROPE_Q

if TYPE_CHECKING:
    import torch

    from ckptkit.models import Family, ModelConfig

ROPE_FREQS = "rope_freqs.weight"
EMBEDDINGS, OUTPUT = "token_embd.weight", "output.weight"
LLAMA3_SCALING = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def candidates(arch: str) -> list[Family]:
    """The families llama.cpp writes as ``arch``, in registry order."""
    from ckptkit.models import REGISTRY

    return [f for f in REGISTRY.values() if (s := f.gguf_spec()) is not None and s.arch == arch and s.reads_back]


def _spec(family: Family) -> GGUFSpec:
    spec = family.gguf_spec()
    assert spec is not None
    return spec


def architecture(h: GGUFHeader) -> str:
    arch = meta_str(h, "general.architecture")
    if arch is None:
        raise h.error("metadata lacks general.architecture")
    return arch


def _hf_model_type(h: GGUFHeader, families: list[Family]) -> Family:
    """Among families sharing an architecture (Llama, Mistral), the one ``general.name`` or
    ``general.basename`` names, else the first: the HF ``model_type`` to read the config as."""
    named = " ".join(str(h.metadata.get(k, "")) for k in ("general.basename", "general.name")).lower()
    for family in families[1:]:
        if family.hf_model_types[0] != families[0].hf_model_types[0] and family.hf_model_types[0] in named:
            return family
    return families[0]


def hf_config(h: GGUFHeader, read_rope_freqs: Any) -> dict[str, Any]:
    """config.json as the GGUF describes it (``{}`` for an architecture no family has);
    ``read_rope_freqs()`` returns the stored ``rope_freqs.weight``."""
    arch = architecture(h)
    moe = f"{arch}.expert_count" in h.metadata  # llama.cpp's llama class writes Mixtral too
    found = candidates(arch)
    families = [f for f in found if _has_experts(_spec(f)) == moe] if len(found) > 1 else found
    if not families:
        return {}
    family = _hf_model_type(h, families)
    spec = _spec(family)
    shapes = {t.name: t.shape for t in h.tensors}
    if spec.proportional_rope:  # Gemma 4's layers of two kinds
        out = hparams_from_metadata(per_layer.scalar_view(h.metadata, arch), arch)
        per_layer.hparams_from_layers(h.metadata, arch, out, read_rope_freqs, shapes)
    else:
        out = hparams_from_metadata(h.metadata, arch)
    arch_fields(h.metadata, arch, out, set(shapes))
    for field, value in spec.implied:
        out.setdefault(field, value)
    if "vocab_size" not in out and EMBEDDINGS in shapes:
        out["vocab_size"] = shapes[EMBEDDINGS][0]
    out.update(model_type=family.hf_model_types[0], architectures=[family.hf_architecture])
    out["tie_word_embeddings"] = spec.drops_output or OUTPUT not in shapes
    for what, field in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        if (tid := meta_int(h, f"tokenizer.ggml.{what}_token_id")) is not None:
            out[field] = tid
    out.update(assumed_fields(spec, out))
    if spec.rope_freqs and ROPE_FREQS in shapes:
        out["rope_parameters"] = _llama3_scaling(h, out, read_rope_freqs())
        out["rope_scaling"] = {k: v for k, v in out["rope_parameters"].items() if k != "rope_theta"}
    check_config_fields("config.json", out, f"{h.path} (metadata as config.json)")
    return out


def _has_experts(spec: GGUFSpec) -> bool:
    """Whether llama.cpp writes ``expert_count`` for the spec's models (every model of its class)."""
    counted = any(p.rstrip("?") == "expert_count" for p in spec.parameters)
    return spec.experts is not None or spec.interleaved_experts or counted


def assumed_fields(spec: GGUFSpec, hparams: dict[str, Any]) -> dict[str, Any]:
    """config.json fields the GGUF has no key for, as llama.cpp runs the model: its fixed
    interleave of sliding and global layers, its query scale, and the spec's own (``assumed``)."""
    out: dict[str, Any] = {}
    layers, heads, hidden = hparams["num_hidden_layers"], hparams["num_attention_heads"], hparams["hidden_size"]
    if spec.sliding_pattern is not None:
        n = spec.sliding_pattern
        out["layer_types"] = ["full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(layers)]
    if spec.query_scale_layers is not None:
        by_hidden = layers in spec.query_scale_layers
        out["query_pre_attn_scalar"] = hidden // heads if by_hidden else hparams.get("head_dim", hidden // heads)
    if spec.assumed is not None:
        out.update(spec.assumed(hparams))
    return out


def _llama3_scaling(h: GGUFHeader, hparams: dict[str, Any], stored: torch.Tensor) -> dict[str, Any]:
    """Llama 3 rope scaling whose factors llama.cpp computes as exactly ``stored``: low and
    high frequency factors 1 and 4 (Llama 3.1 to 3.3), else 1 and 1 (Llama 4 Scout)."""
    import torch

    factor = float(stored.max()) if stored.numel() else 0.0
    for high in (4.0, 1.0):
        settings = {**hparams.get("rope_parameters", {}), **LLAMA3_SCALING, "high_freq_factor": high, "factor": factor}
        settings["original_max_position_embeddings"] = 8192
        made = rope_freqs({**hparams, "rope_parameters": settings})
        if made is not None and made.shape == stored.shape and torch.equal(made, stored.to(torch.float32)):
            return settings
    raise h.error(
        f"{ROPE_FREQS} holds rope factors that Llama 3 scaling (factor {factor:g}, low/high frequency "
        "factors 1/4 or 1/1, original context 8192) does not give; config.json cannot state them"
    )


def family_of(h: GGUFHeader, config: dict[str, Any]) -> Family:
    from ckptkit.models import detect_from_hf

    if not config:
        arch = architecture(h)
        known = sorted({s.arch for f in _all() if (s := f.gguf_spec()) is not None and s.reads_back})
        raise UnknownModel(
            f"{h.path}: llama.cpp architecture {arch!r} is no model type ckptkit reads ({', '.join(known)}); "
            "pass --model-type to read it as one of them"
        )
    return detect_from_hf(config, str(h.path))


def _all() -> list[Family]:
    from ckptkit.models import REGISTRY

    return list(REGISTRY.values())


def spec_for(family: Family, where: object) -> GGUFSpec:
    spec = family.gguf_spec()
    if spec is None:
        raise UnknownModel(family.no_gguf(where))
    if not spec.reads_back:
        raise UnknownModel(f"{where}: ckptkit writes {family.name} as GGUF but does not read it back yet")
    return spec


def layout(family: Family, cfg: ModelConfig) -> Layout:
    """The family's HF layout in GGUF tensor names; q/k rows in Meta's pair order where
    llama.cpp permutes them (read back with the same rope transform as Meta's ``wq``/``wk``)."""
    spec = spec_for(family, family.name)
    hf = family.hf_layout(cfg if spec.experts is None else per_expert(cfg))
    tmap = name_map(spec, max(cfg.num_layers, 1))

    def rename(rule: Rule, per_layer: bool) -> Rule | None:
        probe = rule.native.format(i=0) if per_layer else rule.native
        name = llama_cpp_renamed(spec, probe) or gguf_name(tmap, probe)
        if name is None and rule.optional:  # Gemma's lm_head: llama.cpp never writes it
            return None
        if name is None:
            raise CkptkitError(f"llama.cpp has no GGUF name for {family.name} tensor {probe!r}")
        if per_layer:
            name = name.replace("blk.0.", "blk.{i}.", 1)
        kind = rule.kind
        if spec.permute_qk and kind is COPY and probe.endswith(("q_proj.weight", "q_proj.bias")):
            kind = ROPE_Q
        elif spec.permute_qk and kind is COPY and probe.endswith(("k_proj.weight", "k_proj.bias")):
            kind = ROPE_K
        return replace(rule, native=name, kind=kind)

    def renamed(rules: tuple[Rule, ...], per_layer: bool) -> tuple[Rule, ...]:
        if spec.experts is not None:  # one ffn_*_exps tensor per layer and projection
            return merged_rules(rules, lambda rule: rename(rule, per_layer))
        return tuple(r for r in (rename(rule, per_layer) for rule in rules) if r is not None)

    return Layout(
        head=renamed(hf.head, False),
        layer=renamed(hf.layer, True),
        tail=renamed(hf.tail, False),
        unused=(r"rope_freqs\.weight",) if spec.rope_freqs or spec.proportional_rope else (),
    )


def plus_one_norms(family: Family, cfg: ModelConfig) -> set[str]:
    """The canonical names of the norms a family's GGUF stores as ``1 + w``."""
    spec = spec_for(family, family.name)
    if not spec.norm_plus_one:
        return set()
    rules = family.hf_layout(cfg).expand(cfg.num_layers)
    return {c for r in rules if r.native.endswith("norm.weight") for c in r.canonical}


# The smallest |w| at which float32's 1 + w keeps every bit of a w stored in that dtype.
_EXACT_FROM = {"bfloat16": 2.0**-16, "float16": 2.0**-13, "float32": 1.0}


def minus_one(stored: torch.Tensor, name: str, where: object) -> torch.Tensor:
    """``w`` from llama.cpp's float32 ``1 + w``, exactly, or a one-line refusal.

    ``y - 1`` is computed exactly (in float64). It is the original ``w`` if ``w`` was held in
    the narrowest of bfloat16, float16, float32 that holds every ``y - 1`` and was either 0 or
    large enough that adding 1 in float32 dropped none of its bits; otherwise several ``w``
    give the same ``y`` and the original cannot be told: refused. (A stored 1.0 reads as 0.)
    """
    import torch

    y = stored.to(torch.float64)
    w = y - 1
    if not torch.equal(w.to(torch.float32).to(torch.float64), w):
        raise CkptkitError(f"{where}: {name}: 1 + w is stored with bits that float32 w cannot hold; not a GGUF norm")
    dtype = next(d for d in _EXACT_FROM if torch.equal(w.to(getattr(torch, d)).to(torch.float64), w))
    small = (w != 0) & (w.abs() < _EXACT_FROM[dtype])
    if bool(small.any()):
        value = float(w[small].reshape(-1)[0])
        raise CkptkitError(
            f"{where}: {name}: llama.cpp stored these norm weights as 1 + w in float32, which rounds away the "
            f"low bits of w as small as {value:.3g} ({dtype}); w cannot be recovered exactly, so it is not converted"
        )
    return w.to(torch.float32)
