"""LoRA on mixture-of-experts weights in PEFT's format (``target_parameters``).

transformers 5 holds a layer's experts stacked (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]) and its router as a bare parameter (``mlp.gate.weight``),
so PEFT adapts them through ``target_parameters`` (its ``ParamWrapper``), not
``target_modules``:

- a stacked [E, out, in] parameter gets one ``lora_A`` [E * r, in] (expert e's A: rows
  ``e*r`` to ``e*r + r``) and one ``lora_B`` [out, r * E] (expert e's B: columns ``j*E + e``),
  ``delta_e = scaling * B_e @ A_e``; ``gate_up_proj``'s rows are gate then up, so an expert's
  gate and up adapters share one A;
- the router, 2-D, is one plain pair;
- parameters of one module nest, the first in the module's order innermost: with both
  stacked tensors adapted, ``experts.base_layer.lora_A.weight`` is ``gate_up_proj``'s and
  ``experts.lora_A.weight`` ``down_proj``'s;
- the dense MLPs of a model with experts (Qwen3-MoE's ``mlp_only_layers``, DeepSeek's
  ``first_k_dense_replace``) and its shared experts are 2-D parameters too: PEFT takes
  ``target_modules`` ``gate_proj``/``up_proj``/``down_proj`` (and Mixtral's ``w1``...) of
  such a model, even by full name, for transformers 4's per-expert modules and rewrites them
  into the stacked experts, so they cannot be named there.

gpt-oss's and Llama 4's experts are canonical as they are stacked: their adapters are PEFT's
pair as it is (:mod:`ckptkit.train.stacked_lora`), adapted whole.

ckptkit's native model has one LoRA module per expert projection and on the router; this
module converts between the two. Which HF tensor holds which canonical ones comes from the
family's stacked HF layout.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import torch

from ckptkit.errors import CkptkitError
from ckptkit.models import ModelConfig, get_family
from ckptkit.models.gpt_oss import GptOssFields
from ckptkit.models.moe import MoEFields, experts
from ckptkit.tensors.transforms import Stacked
from ckptkit.train.stacked_lora import STACKED

Pair = tuple[torch.Tensor, torch.Tensor]
"""A LoRA pair (A (r, in), B (out, r)) of one canonical module."""


@dataclasses.dataclass(frozen=True)
class MoeParam:
    """One HF parameter PEFT adapts through ``target_parameters``."""

    name: str  # model.layers.N.mlp.experts.gate_up_proj
    modules: tuple[str, ...]  # the canonical modules it holds, expert by expert
    parts: int  # canonical modules per expert (2: gate and up); 0: one module (router, stacked whole)
    experts: int = 0  # a stacked parameter adapted whole (gpt-oss, Llama 4): its number of experts
    transposed: bool = True  # [E, in, out] to PEFT (gpt-oss); else [E, out, in] (Llama 4)

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0]

    @property
    def generic(self) -> str:
        """The name without its layer prefix, as ``target_parameters`` lists it."""
        return re.sub(r"^.*?layers\.\d+\.", "", self.name)


def moe_params(cfg: ModelConfig) -> list[MoeParam]:
    """Every stacked expert tensor, router and dense MLP weight of ``cfg``'s HF model
    (transformers 5) that PEFT adapts as a parameter, in order; gpt-oss's: its routers and its
    stacked experts, canonical as they are (:mod:`ckptkit.train.stacked_lora`)."""
    gpt_oss = cfg.feature(GptOssFields)
    if gpt_oss is not None:
        params = []
        for i in range(cfg.num_layers):
            params.append(MoeParam(f"model.layers.{i}.mlp.router.weight", (f"layers.{i}.mlp.router",), 0))
            for t in STACKED:
                name, module = f"model.layers.{i}.mlp.experts.{t}", f"layers.{i}.mlp.experts.{t}"
                params.append(MoeParam(name, (module,), 0, gpt_oss.num_local_experts))
        return params
    if experts(cfg) is None:
        return []
    stacked = cfg.replace_fields(experts_layout="stacked")
    out = []
    for rule in get_family(cfg.model_type).hf_layout(stacked).expand(cfg.num_layers):
        modules = tuple(c.removesuffix(".weight") for c in rule.canonical)
        if not modules[0].startswith("layers."):  # the MTP layers' experts (carried, never adapted)
            continue
        if isinstance(rule.kind, Stacked):
            out.append(MoeParam(rule.native, modules, rule.kind.k))
        elif len(modules) == 1 and re.fullmatch(r"layers\.\d+\.mlp\.(shared\.)?(router|w1|w2|w3)", modules[0]):
            out.append(MoeParam(rule.native, modules, 0))
        elif len(modules) == 1 and re.fullmatch(r"layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)", modules[0]):
            out.append(MoeParam(rule.native, modules, 0, cfg.fields(MoEFields).num_experts, transposed=False))
    return out


def _keys(params: list[MoeParam]) -> dict[str, str]:
    """HF parameter -> its adapter's key stem (``...experts.base_layer.``) among ``params``, the
    adapted ones: nested in module order, the first innermost."""
    by_module: dict[str, list[MoeParam]] = {}
    for p in params:
        by_module.setdefault(p.module, []).append(p)
    return {
        p.name: f"{module}." + "base_layer." * (len(group) - 1 - i)
        for module, group in by_module.items()
        for i, p in enumerate(group)
    }


def to_peft(cfg: ModelConfig, pairs: Mapping[str, Pair]) -> tuple[dict[str, torch.Tensor], list[str], set[str]]:
    """PEFT's tensors (keys without ``base_model.model.``) for the expert and router adapters in
    ``pairs`` (canonical module -> pair), ``target_parameters``, and the modules used."""
    adapted = []
    for p in moe_params(cfg):
        have = [m in pairs for m in p.modules]
        if any(have) and not all(have):
            raise CkptkitError(f"LoRA adapts only some experts of {p.name}; PEFT adapts the stacked tensor whole")
        if all(have):
            adapted.append(p)
    tensors: dict[str, torch.Tensor] = {}
    stems = _keys(adapted)
    for p in adapted:
        stem = stems[p.name]
        if not p.parts:
            a, b = pairs[p.modules[0]]
        else:
            a_rows, b_cols = [], []
            for e in range(len(p.modules) // p.parts):
                mine = [pairs[m] for m in p.modules[e * p.parts : (e + 1) * p.parts]]
                if any(not torch.equal(x[0], mine[0][0]) for x in mine[1:]):
                    raise CkptkitError(f"expert {e}'s parts in {p.name} have separate LoRA A matrices; PEFT has one")
                a_rows.append(mine[0][0])
                b_cols.append(torch.cat([x[1] for x in mine]))
            if len({tuple(a.shape) for a in a_rows}) != 1:
                raise CkptkitError(f"the experts of {p.name} need one LoRA rank")
            a = torch.cat(a_rows)
            b = torch.stack(b_cols, dim=-1).flatten(1)  # column j * E + e: expert e's column j
        tensors[f"{stem}lora_A.weight"] = a
        tensors[f"{stem}lora_B.weight"] = b
    used = {m for p in adapted for m in p.modules}
    return tensors, sorted({p.generic for p in adapted}), used


def from_peft(cfg: ModelConfig, targets: list[str], tensors: Mapping[str, torch.Tensor]) -> dict[str, Pair]:
    """Canonical module -> pair for the ``target_parameters`` adapters in ``tensors`` (keys
    without ``base_model.model.``; those of other modules are left alone)."""
    params = moe_params(cfg)
    adapted = [p for p in params if any(p.name == t or p.name.endswith("." + t) for t in targets)]
    unknown = [t for t in targets if not any(p.name == t or p.name.endswith("." + t) for p in params)]
    if unknown:
        raise CkptkitError(f"adapter targets parameter {unknown[0]!r}, which {cfg.model_type} does not have")
    out: dict[str, Pair] = {}
    stems = _keys(adapted)
    for p in adapted:
        stem = stems[p.name]
        try:
            a, b = tensors[f"{stem}lora_A.weight"], tensors[f"{stem}lora_B.weight"]
        except KeyError as exc:
            raise CkptkitError(f"adapter has no LoRA pair {exc.args[0]} for {p.name}") from None
        if not p.parts:
            if p.experts and (a.ndim != 2 or b.ndim != 2 or a.shape[0] % p.experts or b.shape[1] != a.shape[0]):
                raise CkptkitError(
                    f"adapter LoRA A/B shapes {tuple(a.shape)}, {tuple(b.shape)} do not fit {p.experts} experts"
                )
            out[p.modules[0]] = (a, b)
            continue
        n = len(p.modules) // p.parts
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] % n or b.shape[1] != a.shape[0]:
            raise CkptkitError(f"adapter LoRA A/B shapes {tuple(a.shape)}, {tuple(b.shape)} do not fit {n} experts")
        r = a.shape[0] // n
        for e in range(n):
            b_e = b.reshape(b.shape[0], r, n)[:, :, e]
            rows = b_e.shape[0] // p.parts
            for j, m in enumerate(p.modules[e * p.parts : (e + 1) * p.parts]):
                out[m] = (a[e * r : (e + 1) * r], b_e[j * rows : (j + 1) * rows].contiguous())
    return out


def moe_keys(cfg: ModelConfig, targets: list[str]) -> set[str]:
    """The adapter keys (without ``base_model.model.``) :func:`from_peft` reads."""
    params = moe_params(cfg)
    adapted = [p for p in params if any(p.name == t or p.name.endswith("." + t) for t in targets)]
    stems = _keys(adapted)
    return {f"{stems[p.name]}lora_{x}.weight" for p in adapted for x in "AB"}


def stacked_param(cfg: ModelConfig, module: str) -> MoeParam | None:
    """``module``'s parameter when it is a stacked expert tensor adapted whole, else None."""
    return next((p for p in moe_params(cfg) if p.experts and p.modules == (module,)), None)


def moe_rank(cfg: ModelConfig, module: str, a: torch.Tensor) -> int:
    """The LoRA rank of ``module``'s A (a stacked parameter's A stacks one per expert)."""
    p = stacked_param(cfg, module)
    return a.shape[0] // (p.experts if p is not None else 1)


def adapted_shape(cfg: ModelConfig, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    """The canonical tensor a LoRA pair of ``module`` adapts and the shape the pair implies for it."""
    p = stacked_param(cfg, module)
    if p is None:
        return f"{module}.weight", (b.shape[0], a.shape[1])
    return module, (p.experts, *((a.shape[1], b.shape[0]) if p.transposed else (b.shape[0], a.shape[1])))
