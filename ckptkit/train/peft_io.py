"""LoRA adapters in PEFT's on-disk format (``adapter_model.safetensors`` + ``adapter_config.json``).

Keys are ``base_model.model.<HF module>.lora_{A,B}.weight`` with HF module names from
:mod:`ckptkit.train.peft_names`, so adapters round-trip with ``peft.PeftModel`` on the
matching ``transformers`` model. Supported: LoRA (optionally rsLoRA, DoRA's ``lora_magnitude_vector``,
per-module ranks) on linear layers. Where a family fuses projections into one HF module (Phi-3's
``qkv_proj``, ``gate_up_proj``), PEFT adapts the fused module whole: one A, and a B (DoRA magnitude)
whose rows stack the parts; ckptkit's separate q/k/v (w1/w3) adapters then share one ``lora_a``
and their ``lora_b`` are that B's row blocks. Experts and routers are PEFT's
``target_parameters`` (:mod:`ckptkit.train.peft_experts`). Anything else fails with one line.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from ckptkit.errors import CkptkitError
from ckptkit.formats.peft_adapter import (
    read_adapter_config,
    read_adapter_tensors,
    write_adapter,
)
from ckptkit.models import ModelConfig, canonical_shapes
from ckptkit.train.lora import LoRALinear, add_lora, lora_modules, merge_lora, model_config, targeted
from ckptkit.train.lora_targets import fused_part, fused_parts, share_fused_lora
from ckptkit.train.peft_experts import adapted_shape, from_peft, moe_keys, moe_params, moe_rank, to_peft
from ckptkit.train.peft_names import NotInBase, canonical_module, hf_module, module_names
from ckptkit.train.stacked_lora import StackedLoRA, add_stacked_lora, stacked_modules, stacked_names

_PREFIX = "base_model.model."
_MAGNITUDE = "lora_magnitude_vector"  # DoRA's, 1-D (out_features)

# Every field PEFT 0.21 writes for a LoraConfig, at PEFT's defaults.
_PEFT_DEFAULTS: dict[str, Any] = {
    "alora_invocation_tokens": None,
    "alpha_pattern": {},
    "arrow_config": None,
    "auto_mapping": None,
    "base_model_name_or_path": None,
    "bias": "none",
    "corda_config": None,
    "ensure_weight_tying": False,
    "eva_config": None,
    "exclude_modules": None,
    "fan_in_fan_out": False,
    "inference_mode": True,
    "init_lora_weights": True,
    "kasa_config": None,
    "layer_replication": None,
    "layers_pattern": None,
    "layers_to_transform": None,
    "loftq_config": {},
    "lora_alpha": 8,
    "lora_bias": False,
    "lora_dropout": 0.0,
    "lora_ga_config": None,
    "megatron_config": None,
    "megatron_core": "megatron.core",
    "modules_to_save": None,
    "monteclora_config": None,
    "peft_type": "LORA",
    "qalora_group_size": 16,
    "r": 8,
    "rank_pattern": {},
    "revision": None,
    "target_modules": None,
    "target_parameters": None,
    "task_type": "CAUSAL_LM",
    "trainable_token_indices": None,
    "use_bdlora": None,
    "use_dora": False,
    "use_qalora": False,
    "use_rslora": False,
    "velora_config": None,
}


def prepare_for_peft(model: nn.Module) -> None:
    """Share one A across each fused module's parts and check that every adapter has a PEFT
    name: after :func:`apply_lora`, so that a save can only fail for disk reasons."""
    share_fused_lora(model)
    _peft_tensors(model)


def save_adapter(
    model: nn.Module,
    out_dir: str | Path,
    base_model_name_or_path: str | None = None,
    weights: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Write the model's LoRA adapters as a PEFT adapter directory.

    ``weights`` (``<module>.lora_a``/``.lora_b`` -> full tensor) replaces the modules' own
    tensors, e.g. when those are shards of a distributed model.
    """
    modules, stacked = lora_modules(model), list(stacked_modules(model).values())
    if not modules and not stacked:
        raise CkptkitError("model has no LoRA adapters to save")
    alphas = {m.alpha for m in [*modules.values(), *stacked]}
    dropouts = {m.dropout.p if isinstance(m.dropout, nn.Dropout) else 0.0 for m in modules.values()} or {0.0}
    rslora = {m.use_rslora for m in [*modules.values(), *stacked]}
    dora = {m.use_dora for m in modules.values()} or {False}
    if len(alphas) > 1 or len(dropouts) > 1 or len(rslora) > 1 or len(dora) > 1:
        raise CkptkitError("PEFT format needs one lora_alpha, lora_dropout, use_rslora and use_dora for all adapters")
    if any(m.merged for m in [*modules.values(), *stacked]):
        raise CkptkitError("unmerge the LoRA adapters before saving them")

    tensors, hf_names, target_parameters = _peft_tensors(model, weights)
    rank = Counter(m.rank for m in [*modules.values(), *stacked]).most_common(1)[0][0]
    moe_ranks = [m.rank for n, m in modules.items() if n not in hf_names] + [m.rank for m in stacked]
    if target_parameters and (dropouts != {0.0} or any(r != rank for r in moe_ranks)):
        raise CkptkitError("LoRA on experts or router takes one rank for every adapter and no dropout in PEFT format")
    modules = {n: m for n, m in modules.items() if n in hf_names}  # linear modules: target_modules

    # Leaf names when every linear with that leaf is adapted, full module names otherwise.
    canonical_leaves = {n.rsplit(".", 1)[-1] for n in modules}
    candidates = [
        n
        for n, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and targeted(n, canonical_leaves) and n.rsplit(".", 1)[-1] in canonical_leaves
    ]
    if not modules:
        target_modules = None
    elif len(candidates) == len(modules) and all(
        h.startswith("model.layers.") or "." not in h for h in hf_names.values()
    ):
        # (a multimodal release's towers have linears of those leaf names too: full names there)
        target_modules = sorted({hf.rsplit(".", 1)[-1] for hf in hf_names.values()})
    else:
        target_modules = sorted(hf_names.values())
    rank_pattern = {hf_names[n]: m.rank for n, m in modules.items() if m.rank != rank}

    config = dict(_PEFT_DEFAULTS)
    config.update(
        base_model_name_or_path=base_model_name_or_path,
        lora_alpha=alphas.pop(),
        lora_dropout=dropouts.pop(),
        r=rank,
        rank_pattern=rank_pattern,
        target_modules=target_modules,
        target_parameters=target_parameters or None,
        use_rslora=rslora.pop(),
        use_dora=dora.pop(),
    )
    write_adapter(Path(out_dir), config, tensors)


def _peft_tensors(
    model: nn.Module, weights: Mapping[str, torch.Tensor] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    """PEFT's tensors for the model's adapters (or for ``weights``, full tensors by parameter
    name), each adapted linear's HF module name (canonical module -> HF module; experts and
    routers left out), and the ``target_parameters`` (experts, routers)."""
    cfg = model_config(model)
    model_type = cfg.model_type
    moe_modules = {m for p in moe_params(cfg) for m in p.modules}
    own = module_names(cfg)
    tensors: dict[str, torch.Tensor] = {}
    hf_names: dict[str, str] = {}
    moe: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    fused_b: dict[str, list[tuple[int, str, torch.Tensor]]] = {}
    counts: dict[str, int] = {}
    for name, m in lora_modules(model).items():
        a, b = (m.lora_a, m.lora_b) if weights is None else (weights[f"{name}.lora_a"], weights[f"{name}.lora_b"])
        mag = None if not m.use_dora else m.lora_magnitude if weights is None else weights[f"{name}.lora_magnitude"]
        if name in moe_modules and mag is not None:
            raise CkptkitError(f"DoRA on {name}: PEFT has no DoRA for experts or routers")
        if name in moe_modules:
            moe[name] = (a.detach(), b.detach())
            continue
        hf = hf_names[name] = hf_module(model_type, name, own)
        a_key = f"{_PREFIX}{hf}.lora_A.weight"
        part = fused_part(model_type, name)
        if part is not None:
            shared = a_key not in tensors or tensors[a_key].data_ptr() == a.data_ptr()
            if not shared and not (weights is not None and torch.equal(tensors[a_key], a)):  # gathered copies
                raise CkptkitError(f"the parts of fused {hf} have separate LoRA A matrices; PEFT has one")
            rows = (("lora_B.weight", b), (_MAGNITUDE, mag))
            fused_b.setdefault(hf, []).extend((part[1], k, t) for k, t in rows if t is not None)
            counts[hf] = part[2]
        tensors[a_key] = a.detach()
        if part is None:
            tensors[f"{_PREFIX}{hf}.lora_B.weight"] = b.detach()
            if mag is not None:
                tensors[f"{_PREFIX}{hf}.{_MAGNITUDE}"] = mag.detach()
    for hf, parts in fused_b.items():
        if len({i for i, _, _ in parts}) != counts[hf]:
            raise CkptkitError(f"LoRA adapts only some parts of the fused {hf}; PEFT adapts it whole")
        for key in {k for _, k, _ in parts}:
            tensors[f"{_PREFIX}{hf}.{key}"] = torch.cat([t.detach() for _, k, t in sorted(parts) if k == key])
    for name, sm in stacked_modules(model).items():  # gpt-oss's stacked experts: PEFT's pair as it is
        a, b = (
            (sm.lora_a, sm.lora_b)
            if weights is None
            else (weights[f"{name}_lora.lora_a"], weights[f"{name}_lora.lora_b"])
        )
        moe[name] = (a.detach(), b.detach())
    moe_tensors, target_parameters, _ = to_peft(cfg, moe)
    tensors.update({_PREFIX + k: v for k, v in moe_tensors.items()})
    return {k: v if v.is_meta else v.contiguous().cpu() for k, v in tensors.items()}, hf_names, target_parameters


def read_adapter(adapter_dir: str | Path, merging: bool = False) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Validated PEFT adapter config and its tensors (keys as stored); ``merging`` (into a
    checkpoint on disk) also takes ``modules_to_save``."""
    folder = Path(adapter_dir)
    config = read_adapter_config(folder)
    _check_supported(config, merging)
    return config, read_adapter_tensors(folder)


def _check_supported(config: dict[str, Any], merging: bool = False) -> None:
    def unsupported(what: str) -> CkptkitError:
        return CkptkitError(f"unsupported PEFT adapter: {what}")

    if config.get("peft_type") != "LORA":
        raise unsupported(f"peft_type {config.get('peft_type')!r} (only LORA)")
    checks = {
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        f"bias={config.get('bias')!r}": config.get("bias", "none") != "none",
        "lora_bias": bool(config.get("lora_bias")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "modules_to_save": bool(config.get("modules_to_save")) and not merging,
        "layer_replication": bool(config.get("layer_replication")),
        "trainable_token_indices": bool(config.get("trainable_token_indices")),
        "use_qalora": bool(config.get("use_qalora")),
        "alora_invocation_tokens": bool(config.get("alora_invocation_tokens")),
    }
    for what, bad in checks.items():
        if bad:
            raise unsupported(what)


class AdapterWeights(NamedTuple):
    """One LoRA pair for a canonical module: ``delta W = scaling * b @ a`` (and DoRA's magnitude)."""

    a: torch.Tensor  # (r, in)
    b: torch.Tensor  # (out, r)
    scaling: float
    magnitude: torch.Tensor | None = None  # (out,), DoRA only


class Adapter(NamedTuple):
    """A parsed PEFT LoRA adapter in canonical names."""

    config: dict[str, Any]
    lora: dict[str, AdapterWeights]  # canonical module name -> pair
    # Base weights PEFT stores beside the adapter when embeddings / lm_head are targeted
    # (``save_embedding_layers="auto"``); canonical tensor name -> tensor.
    base_copies: dict[str, torch.Tensor]
    # ``modules_to_save``: whole tensors that replace the base's (read only for a merge).
    replaced: dict[str, torch.Tensor] = {}  # noqa: RUF012 - never mutated


def read_lora_weights(
    adapter_dir: str | Path,
    model: ModelConfig,
    base: str = "the model",
    fix: str = "use it with the model",
    merging: bool = False,
) -> Adapter:
    """Parse a PEFT LoRA adapter into canonical module names (fused modules split into their parts).

    An adapter trained on another model (other hidden size, layers or modules than
    ``model``, the config of ``base``) is refused in one line that names the adapter
    folder, the mismatch and what to do (``fix`` ... "it was trained on").
    """
    try:
        adapter = _read_lora_weights(adapter_dir, model, merging)
        misfit = _misfit(adapter, model, base)
    except NotInBase as exc:
        misfit = str(exc)
    if misfit:
        trained_on = read_adapter_config(Path(adapter_dir)).get("base_model_name_or_path")
        raise CkptkitError(
            f"{adapter_dir}: adapter for another model: {misfit}; {fix} it was trained on"
            + (f" ({trained_on}, adapter_config.json)" if trained_on else "")
        )
    return adapter


def _misfit(adapter: Adapter, model: ModelConfig, base: str) -> str | None:
    """How ``adapter`` does not fit ``model`` (None: it fits), in the adapter's own (HF) names."""
    shapes = canonical_shapes(model)
    # the dimensions that are the hidden size: those that change with it
    wider = canonical_shapes(dataclasses.replace(model, hidden_size=model.hidden_size + 1))
    weights: dict[str, tuple[int, ...]] = dict(adapted_shape(model, m, w.a, w.b) for m, w in adapter.lora.items())
    weights |= {k: tuple(t.shape) for k, t in (adapter.base_copies | adapter.replaced).items()}
    for key, got in weights.items():
        want = shapes.get(key)
        if want is None or got == want:
            continue
        for mine, theirs, other in zip(got, want, wider[key], strict=False):  # ndims may differ
            if mine != theirs and theirs != other:
                return f"it was trained on a model with hidden size {mine}; {base} has {theirs}"
        hf = hf_module(model.model_type, key.removesuffix(".weight"), module_names(model))
        if len(got) != 2 or len(want) != 2:
            return f"{hf} has shape {list(got)} in the adapter, {list(want)} in {base}"
        return f"{hf} maps {got[1]} -> {got[0]} features in the adapter, {want[1]} -> {want[0]} in {base}"
    for key in weights:
        if key not in shapes:
            hf = hf_module(model.model_type, key.removesuffix(".weight"), module_names(model))
            layer = key.split(".")[1] if key.startswith("layers.") else None
            why = (
                f" ({model.num_layers} layers)" if layer is not None and int(layer) >= model.num_layers
                else " (it ties the output projection to the embeddings)" if key == "output.weight"
                else ""
            )  # fmt: skip
            return f"the adapter has {hf}; {base} does not{why}"
    return None


def _read_lora_weights(adapter_dir: str | Path, model: ModelConfig, merging: bool = False) -> Adapter:
    """See :func:`read_lora_weights`; ``merging`` also takes embedding LoRA and ``modules_to_save``."""
    model_type = model.model_type
    own = {hf: canonical for canonical, hf in module_names(model).items()}
    config, tensors = read_adapter(adapter_dir, merging)
    saved = config.get("modules_to_save") or []
    saved = {saved} if isinstance(saved, str) else set(map(str, saved))
    targets = config.get("target_parameters") or []
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise CkptkitError(f"{adapter_dir}: the adapter config's target_parameters is not a list of names")
    bodies = {k.removeprefix(_PREFIX): v for k, v in tensors.items()}
    moe = from_peft(model, targets, bodies) if targets else {}
    stacked = {_PREFIX + k for k in moe_keys(model, targets)}
    tensors = {k: v for k, v in tensors.items() if k not in stacked}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    base_copies: dict[str, torch.Tensor] = {}
    replaced: dict[str, torch.Tensor] = {}
    # embedding LoRA (merged only): delta W = (B @ A).T, i.e. a = B.T and b = A.T
    embedding = {".lora_embedding_A": ("lora_B", True), ".lora_embedding_B": ("lora_A", True)} if merging else {}
    suffixes = {".lora_A.weight": ("lora_A", False), ".lora_B.weight": ("lora_B", False), **embedding}
    if config.get("use_dora"):
        suffixes[f".{_MAGNITUDE}"] = ("magnitude", False)
    for key, tensor in tensors.items():
        body = key.removeprefix(_PREFIX)
        for suffix, (part, flip) in suffixes.items():
            if body.endswith(suffix):
                hf_module = body.removesuffix(suffix)
                fused = fused_parts(model_type, hf_module)
                module = hf_module if fused else canonical_module(model_type, hf_module, own)
                pairs.setdefault(module, {})[part] = tensor.T if flip else tensor
                break
        else:
            if not body.endswith(".weight") or ".lora_" in body:
                raise CkptkitError(f"unsupported tensor {key!r} in adapter (only LoRA A/B weights of linear layers)")
            hf_module = body.removesuffix(".weight")
            name = canonical_module(model_type, hf_module.removesuffix(".base_layer"), own) + ".weight"
            if not hf_module.endswith(".base_layer") and ({hf_module, hf_module.rsplit(".", 1)[-1]} & saved):
                replaced[name] = tensor
            else:
                base_copies[name] = tensor
    if not pairs and not moe:
        raise CkptkitError(f"adapter in {adapter_dir} has no LoRA weights")
    alpha = float(config.get("lora_alpha", 8))
    lora = {}
    if config.get("use_dora") and moe:
        raise CkptkitError(f"{adapter_dir}: DoRA on experts or routers (target_parameters), which PEFT lacks")
    for module, (a, b) in moe.items():
        rank = moe_rank(model, module, a)
        lora[module] = AdapterWeights(a, b, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank))
    for module, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B", *(("magnitude",) if config.get("use_dora") else ())}:
            raise CkptkitError(f"adapter has an incomplete LoRA pair for {module}")
        a, b, mag = ab["lora_A"], ab["lora_B"], ab.get("magnitude")
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or (mag is not None and mag.shape != b.shape[:1]):
            got = ", ".join(str(tuple(t.shape)) for t in (a, b, mag) if t is not None)
            raise CkptkitError(f"adapter LoRA A/B(/magnitude) shapes {got} do not pair up for {module}")
        rank = a.shape[0]
        scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        parts = fused_parts(model_type, module)
        if parts is None:
            lora[module] = AdapterWeights(a, b, scaling, mag)
            continue
        shapes = canonical_shapes(model)
        rows = [shapes[f"{p}.weight"][0] if f"{p}.weight" in shapes else -1 for p in parts]
        if min(rows) < 0 or sum(rows) != b.shape[0]:
            raise NotInBase(f"the adapter's {module} has {b.shape[0]} output rows, the model's {sum(rows)}")
        mags = torch.split(mag, rows) if mag is not None else [None] * len(parts)
        for part, b_part, m_part in zip(parts, torch.split(b, rows), mags, strict=True):
            lora[part] = AdapterWeights(a, b_part, scaling, m_part)
    return Adapter(config, lora, base_copies, replaced)


def check_base_copies(adapter: Adapter, base: dict[str, torch.Tensor]) -> None:
    """Base weights stored in the adapter must equal the model's: ckptkit does not replace them."""
    for name, stored in adapter.base_copies.items():
        if name not in base:
            raise CkptkitError(f"adapter stores base weight {name}, which the model does not have")
        ours = base[name]
        if stored.shape != ours.shape or not torch.equal(stored.float(), ours.detach().float().cpu()):
            raise CkptkitError(f"adapter stores a modified copy of {name} (e.g. resized embeddings); not supported")


def copy_lora_weights(model: nn.Module, adapter: Adapter) -> None:
    """Copy an adapter's A/B matrices into the model's existing LoRA modules of the same shapes."""
    modules: dict[str, LoRALinear | StackedLoRA] = {**lora_modules(model), **stacked_modules(model)}
    with torch.no_grad():
        for name, w in adapter.lora.items():
            m = modules[name]
            if w.a.shape != m.lora_a.shape or w.b.shape != m.lora_b.shape:
                raise CkptkitError(
                    f"adapter shapes for {name} ({tuple(w.a.shape)}, {tuple(w.b.shape)}) "
                    f"do not fit the model ({tuple(m.lora_a.shape)}, {tuple(m.lora_b.shape)})"
                )
            m.lora_a.copy_(w.a)
            m.lora_b.copy_(w.b)
            if (w.magnitude is not None) != m.use_dora:
                raise CkptkitError(f"the adapter {'has' if m.use_dora else 'lacks'} DoRA on {name}; the model does not")
            if w.magnitude is not None:  # assigned: on the meta device until the base is read
                m.lora_magnitude = nn.Parameter(w.magnitude.to(m.lora_a.device, m.lora_a.dtype))


def load_adapter(model: nn.Module, adapter_dir: str | Path, merge: bool = False, base: str = "the model") -> nn.Module:
    """Add the PEFT LoRA adapter in ``adapter_dir`` to ``model`` (read from ``base``, for
    messages) in place; ``merge`` folds it in."""
    adapter = read_lora_weights(adapter_dir, model_config(model), base)
    check_base_copies(adapter, model.state_dict())
    alpha = float(adapter.config.get("lora_alpha", 8))
    dropout = float(adapter.config.get("lora_dropout") or 0.0)
    rslora, dora = bool(adapter.config.get("use_rslora")), bool(adapter.config.get("use_dora"))
    cfg, stacked = model_config(model), set(stacked_names(model))
    add_lora(
        model,
        {n: w.a.shape[0] for n, w in adapter.lora.items() if n not in stacked},
        alpha,
        dropout,
        rslora,
        None,
        dora,
    )
    add_stacked_lora(model, {n: moe_rank(cfg, n, w.a) for n, w in adapter.lora.items() if n in stacked}, alpha, rslora)
    share_fused_lora(model)
    copy_lora_weights(model, adapter)
    if merge:
        merge_lora(model)
    return model
