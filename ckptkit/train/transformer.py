"""One readable decoder-only transformer for every ckptkit model type.

The families differ only in the decoder features they use: the knobs of
:class:`~ckptkit.models.config.ModelConfig` (biases, tied output, GeGLU, rope scaling),
their :class:`~ckptkit.models.config.Decoder` (Gemma's ``(1 + w)`` norm and scaled
embeddings, norm placement, q/k norms) and the groups of fields they carry
(:mod:`ckptkit.models.features`, experts, DeepSeek's latent attention), so one module tree
composes them all and never asks which family it runs. Each mechanism is a module of its
own: :mod:`~ckptkit.train.attention` (grouped-query attention, masks, KV cache),
:mod:`~ckptkit.train.mla` (latent attention), :mod:`~ckptkit.train.deltanet` (Gated DeltaNet,
the linear attention of the hybrid Qwen3-Next and Qwen3.5 layers), :mod:`~ckptkit.train.experts` and
:mod:`~ckptkit.train.routers` (mixtures of experts), :mod:`~ckptkit.train.rope`,
:mod:`~ckptkit.train.layers` (norms, MLPs). Module and parameter names are the canonical
tensor names, so ``Transformer(cfg).load_state_dict(canonical_sd)`` just works.

Numerics follow transformers' eager path (float32 norms, rope angles and routers) so logits
match ``AutoModelForCausalLM`` to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ckptkit.errors import CkptkitError
from ckptkit.models import canonical_shapes, get_family
from ckptkit.models.config import ModelConfig
from ckptkit.models.deepseek_v3 import MTP_PREFIX, DeepseekV3Fields
from ckptkit.models.features import SoftCapping
from ckptkit.models.gemma4 import Gemma4Fields
from ckptkit.models.gpt_oss import GptOssFields
from ckptkit.models.hybrid import LINEAR, VISION, HybridFields
from ckptkit.models.llama4 import Llama4Fields
from ckptkit.models.moe import MoEFields, is_moe_layer
from ckptkit.train.attention import Attention, KVCache, causal_mask
from ckptkit.train.chunked import ChunkedAttention, chunked_mask
from ckptkit.train.deltanet import GatedDeltaNet
from ckptkit.train.experts import Llama4MoE, SparseMoE, StackedMoE
from ckptkit.train.gemma4 import Gemma4Block, PerLayerInputs, SharedKV, full_head_dim
from ckptkit.train.layers import Carried, GatedMLP, RMSNorm
from ckptkit.train.mla import LatentAttention
from ckptkit.train.moe_loss import load_balancing_loss
from ckptkit.train.rope import RotaryEmbedding, local_theta


class Block(nn.Module):
    """Pre-norm decoder layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; in the
    hybrid families' linear layers ``linear_attn`` (Gated DeltaNet) takes the place of ``attn``."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        decoder = cfg.decoder
        h, eps, plus = cfg.hidden_size, cfg.norm_eps, decoder.norm_plus_one
        self.input_norms, self.post_norms = decoder.input_norms, decoder.post_norms
        if decoder.input_norms:
            self.sa_norm = RMSNorm(h, eps, plus)
        latent, llama4 = cfg.feature(DeepseekV3Fields) is not None, cfg.feature(Llama4Fields)
        hybrid = cfg.feature(HybridFields)
        self.linear = hybrid is not None and hybrid.kind(layer_idx) == LINEAR
        if self.linear:
            split = get_family(cfg.model_type).split_in_proj  # type: ignore[attr-defined]
            self.linear_attn = GatedDeltaNet(cfg, layer_idx, split)
        else:
            self.attn: nn.Module = (
                ChunkedAttention(cfg, layer_idx) if llama4 is not None
                else LatentAttention(cfg, layer_idx) if latent
                else Attention(cfg, layer_idx)
            )  # fmt: skip
        if decoder.input_norms:
            self.mlp_norm = RMSNorm(h, eps, plus)
        self.mlp: nn.Module = SparseMoE(cfg) if is_moe_layer(cfg, layer_idx) else GatedMLP(cfg)
        if cfg.feature(GptOssFields) is not None:  # stacked experts in every layer
            self.mlp = StackedMoE(cfg)
        if llama4 is not None:  # stacked experts and a shared one, or a dense MLP of its own width
            moe = is_moe_layer(cfg, layer_idx)
            self.mlp = Llama4MoE(cfg) if moe else GatedMLP(cfg, llama4.intermediate_size_mlp)
        if decoder.post_norms:  # Gemma 2/3, OLMo 2: norms on the sublayers' outputs
            self.attn_post_norm = RMSNorm(h, eps, plus)
            self.mlp_post_norm = RMSNorm(h, eps, plus)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """``mask``: the attention mask, or for a linear layer the (B, T) padding mask."""
        h = self.sa_norm(x) if self.input_norms else x
        if self.linear:
            a = self.linear_attn(h, mask, cache.linear if cache is not None else None)
        elif isinstance(self.attn, ChunkedAttention):  # its temperature goes by position
            a = self.attn(h, cos, sin, mask, cache, positions)
        else:
            a = self.attn(h, cos, sin, mask, cache)
        x = x + (self.attn_post_norm(a) if self.post_norms else a)
        m = self.mlp(self.mlp_norm(x) if self.input_norms else x)
        return x + (self.mlp_post_norm(m) if self.post_norms else m)


class Transformer(nn.Module):
    """Decoder-only LM whose ``state_dict`` keys are ckptkit's canonical names."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        gemma4 = cfg.feature(Gemma4Fields)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        block = Gemma4Block if gemma4 is not None else Block
        self.layers = nn.ModuleList(block(cfg, i) for i in range(cfg.num_layers))
        # Gemma 4: per-layer inputs (PLE); keys and values shared across layers; norms x * w in float32
        self.ple = PerLayerInputs(cfg) if gemma4 is not None and gemma4.hidden_size_per_layer_input else None
        self.shares_kv = gemma4 is not None
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cfg.decoder.norm_plus_one, scaled_in_float=self.shares_kv)
        self.output = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg, head_dim=full_head_dim(cfg) if gemma4 is not None else None)
        self.local_rope = RotaryEmbedding(cfg, local=True) if local_theta(cfg) else None
        self.windows = get_family(cfg.model_type).sliding_windows(cfg)
        llama4 = cfg.feature(Llama4Fields)
        self.chunks = [llama4.chunk(i) if llama4 else None for i in range(cfg.num_layers)]
        self.rope_dtype = torch.float32 if llama4 else None  # its rope multiplies in float32
        shapes = canonical_shapes(cfg)
        carried = {k[len(MTP_PREFIX) :]: v for k, v in shapes.items() if k.startswith(MTP_PREFIX)}
        self.mtp = Carried(carried) if carried else None
        vision = {k[len(VISION) :]: v for k, v in shapes.items() if k.startswith(VISION)}
        self.visual = Carried(vision) if vision else None
        for head, tensors in _towers(cfg).items():
            self.add_module(head, Carried(tensors))
        _check_supported(self, cfg)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, vocab) for ``input_ids`` (B, T).

        ``attention_mask`` (B, past + T), 1 for real tokens and 0 for padding (left or
        right), covers the cached tokens too; or a boolean (B, 1, T, past + T) mask used as
        given (packed documents; pass their ``position_ids`` too). Positions default to the count of real
        tokens before each one (as ``transformers.generate`` does), or ``past + arange(T)``
        without a mask. With ``cache``, the new keys/values are appended to it.
        """
        B, T = input_ids.shape
        past = cache.length if cache is not None else 0
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
            else:
                position_ids = torch.arange(past, past + T, device=input_ids.device).expand(B, T)

        x = self.tok_embeddings(input_ids)
        if self.config.decoder.embed_scale:  # Gemma; the normalizer is rounded to the weight dtype like transformers
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        cos, sin = self.rope(position_ids, self.rope_dtype or x.dtype)
        # Sliding-window layers with their own rope base (Gemma 3) use the local tables.
        local = self.local_rope(position_ids, x.dtype) if self.local_rope is not None else (cos, sin)
        kinds = list(zip(self.windows, self.chunks, strict=True))  # (window, Llama 4's chunk) per layer
        masks = {kind: causal_mask(attention_mask, past, T, kind[0], x.device) for kind in set(kinds)}
        for kind in masks:
            if kind[1] is not None:
                masks[kind] = chunked_mask(masks[kind], attention_mask, past, position_ids, kind[1])
        pad = linear_padding(attention_mask, T)
        per_layer = self.ple(input_ids, x) if self.ple is not None else None
        shared: SharedKV = {}
        for i, (layer, kind) in enumerate(zip(self.layers, kinds, strict=True)):
            c, s = (cos, sin) if kind[0] is None else local
            if self.shares_kv:  # Gemma 4
                x = layer(x, c, s, masks[kind], cache, None if per_layer is None else per_layer[:, :, i], shared)
            else:
                x = layer(x, c, s, pad if layer.linear else masks[kind], cache, position_ids)
        if cache is not None:
            cache.length += T
        x = self.norm(x)
        logits = F.linear(x, self.tok_embeddings.weight) if self.output is None else self.output(x)
        caps = self.config.feature(SoftCapping)
        cap = caps.final_logit_softcapping if caps else None
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def router_logits(self) -> list[torch.Tensor]:
        """The router logits of every MoE layer in the last forward (empty when dense)."""
        return [m.router_logits for m in self.modules() if isinstance(m, SparseMoE) and m.router_logits is not None]

    def aux_loss(
        self, attention_mask: torch.Tensor | None = None, reduce: Callable[[torch.Tensor], None] | None = None
    ) -> torch.Tensor | None:
        """The load-balancing loss of the last forward, unweighted (None: no experts); see
        :func:`load_balancing_loss` for ``attention_mask`` (B, T) and ``reduce``."""
        logits = self.router_logits()
        if not logits:
            return None
        moe = self.config.fields(MoEFields)
        return load_balancing_loss(logits, moe.num_experts, moe.num_experts_per_tok, attention_mask, reduce)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Random init for training from scratch (normal linears/embeddings, unit norms)."""
        for name, p in self.named_parameters():
            if name.endswith("linear_attn.norm.scale"):  # the gated norm: x * w (and silu(z))
                nn.init.ones_(p)
            elif name.endswith("A_log"):  # Gated DeltaNet's decay rates, log(uniform(0.01, 16)) as transformers
                p.copy_(torch.empty_like(p).uniform_(0.01, 16).log())
            elif name.endswith("dt_bias"):
                nn.init.ones_(p)
            elif name.endswith((".scale", ".per_expert_scale")):
                nn.init.zeros_(p) if self.config.decoder.norm_plus_one else nn.init.ones_(p)
            elif name.endswith((".bias", "_bias")):  # gpt-oss: experts.gate_up_proj_bias...
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, std=std)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> Transformer:
    """An uninitialised-weights :class:`Transformer` built directly on ``device`` in ``dtype``."""
    dtype = dtype or torch.float32
    with torch.device(device):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            return Transformer(cfg)
        finally:
            torch.set_default_dtype(previous)


def load_model(
    path: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    model_type: str | None = None,
) -> Transformer:
    """Load any checkpoint ckptkit reads (HF dir, Meta dir, ...) into a native model.

    ``dtype`` None keeps the stored dtype of the weights (the embeddings' for a quantized
    checkpoint, whose weights are dequantized to it by the reference recipe).
    """
    from ckptkit.checkpoint import open_checkpoint
    from ckptkit.plan import dequantized_checkpoint
    from ckptkit.tensors.dtypes import dtype_name, to_torch

    with open_checkpoint(path, model_type=model_type) as ckpt:
        if dtype is None:
            dtype = to_torch(ckpt.tensors["tok_embeddings.weight"].dtype)
        view = dequantized_checkpoint(ckpt, dtype_name(dtype))
        cfg, state_dict = view.config, {k: v.get() for k, v in view.tensors.items()}
    model = build_model(cfg, device="meta", dtype=dtype)
    _check_keys(model, state_dict)
    model.load_state_dict({k: v.to(dtype) for k, v in state_dict.items()}, assign=True)
    return model.to(device).eval()


def linear_padding(attention_mask: torch.Tensor | None, T: int) -> torch.Tensor | None:
    """The (B, T) padding mask of the new tokens for linear attention (None: none padded).

    A packed batch's 4-D document mask is refused: the linear layers' state would carry
    from one document into the next."""
    if attention_mask is None or T == 1:
        return None
    if attention_mask.dim() == 4:
        return attention_mask
    mask = attention_mask[:, -T:]
    return None if bool(mask.all()) else mask


def _towers(cfg: ModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """A multimodal release's tower tensors (Gemma 4's), by their first name component."""
    gemma4 = cfg.feature(Gemma4Fields)
    out: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in (gemma4.towers if gemma4 is not None else {}).items():
        head, _, rest = name.partition(".")
        out.setdefault(head, {})[rest] = shape
    return out


def _check_supported(model: nn.Module, cfg: ModelConfig) -> None:
    """A family whose tensors the decoder lacks a module for (or holds in other shapes): one line."""
    oss = cfg.feature(GptOssFields)
    if oss is not None and oss.mxfp4_experts:
        raise CkptkitError(
            f"model type {cfg.model_type}: its experts are MXFP4 (*_blocks, *_scales), which the native decoder "
            "does not run; dequantize them first: ckptkit convert SRC DST --to hf --dtype bfloat16"
        )
    want, have = canonical_shapes(cfg), {k: tuple(v.shape) for k, v in model.state_dict().items()}
    odd = sorted(k for k in want.keys() | have.keys() if want.get(k) != have.get(k))
    if odd:
        why = "holds in another shape" if odd[0] in want and odd[0] in have else "has no module for"
        why = why if odd[0] in want else "would make"
        raise CkptkitError(
            f"model type {cfg.model_type}: the native decoder (training, generate, verify --logits) does not run "
            f"it yet: it {why} {odd[0]}{f' ({len(odd)} tensors differ)' if len(odd) > 1 else ''}"
        )


def _check_keys(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    expected, got = set(model.state_dict()), set(state_dict)
    missing, unexpected = sorted(expected - got), sorted(got - expected)
    if missing or unexpected:
        raise CkptkitError(
            f"checkpoint does not match model config: missing {_short(missing)}, unexpected {_short(unexpected)}"
        )


def _short(keys: Sequence[str], n: int = 3) -> str:
    return "[" + ", ".join(keys[:n]) + (f", ... ({len(keys)} total)" if len(keys) > n else "") + "]"
