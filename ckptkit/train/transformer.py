"""One readable decoder-only transformer for every ckptkit model type.

The families differ only in the decoder features they use: the knobs of
:class:`~ckptkit.models.config.ModelConfig` (biases, tied output, GeGLU, Llama 3 rope
scaling), their :class:`~ckptkit.models.config.Decoder` (Gemma's ``(1 + w)`` norm and
scaled embeddings, norm placement, q/k norms) and the groups of fields they carry
(:mod:`ckptkit.models.features`, experts), so one module tree composes them all and never
asks which family it runs. Module and parameter names are the canonical
tensor names, so ``Transformer(cfg).load_state_dict(canonical_sd)`` just works.

q/k weights are in the HF rotate-half layout, hence :func:`rotate_half` rope.
Numerics follow transformers (float32 norms and rope angles) so logits match
``AutoModelForCausalLM`` to float32 rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ckptkit.errors import CkptkitError
from ckptkit.models import get_family
from ckptkit.models.config import ModelConfig
from ckptkit.models.features import LocalRope, PartialRotary, SoftCapping
from ckptkit.models.moe import MoEFields, expert_size, is_moe_layer
from ckptkit.train.moe_loss import load_balancing_loss

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; Gemma's variant scales by ``1 + scale``."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.plus_one = plus_one
        self.scale = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.plus_one:  # Gemma: (x * (1 + w)) in float32, then cast
            return (normed * (1.0 + self.scale.float())).type_as(x)
        return self.scale * normed.type_as(x)  # Llama: cast, then x * w


def _local_theta(cfg: ModelConfig) -> float | None:
    local = cfg.feature(LocalRope)
    return local.local_rope_theta if local else None


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse rotary frequencies (float32), with Llama 3 scaling if configured; ``local``:
    those of sliding-window layers with their own base (``local_rope_theta``, unscaled)."""
    partial = cfg.feature(PartialRotary)
    dim = int(cfg.head_dim * (partial.partial_rotary_factor if partial else 1.0))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    local_theta = _local_theta(cfg)
    theta = local_theta if local and local_theta else cfg.rope_theta
    inv_freq = 1.0 / (theta**exponents)
    scaling = None if local else cfg.rope_scaling
    rope_type = (scaling or {}).get("rope_type", scaling and scaling.get("type")) or "default"
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3" or scaling is None:
        raise CkptkitError(f"rope scaling type {rope_type!r} is not supported by the native model")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for arbitrary (per-row) position ids, computed in float32."""

    def __init__(self, cfg: ModelConfig, local: bool = False) -> None:
        super().__init__()
        # A plain attribute, not a buffer: model.to(bfloat16) must not round it.
        self.inv_freq = rope_inv_freq(cfg, local)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * self.inv_freq  # (B, T, rot_dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, H, T, D); only the first ``cos.shape[-1]`` dims (partial rotary)."""
    cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


class KVCache:
    """Preallocated key/value cache for all layers of one generation batch."""

    def __init__(
        self, cfg: ModelConfig, batch_size: int, max_len: int, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        shape = (batch_size, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.length = 0  # tokens already stored (same for every layer)
        self.max_len = max_len

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k``/``v`` (B, H_kv, T, D) at ``self.length``; return everything stored so far."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise CkptkitError(f"KV cache overflow: {end} tokens > max_len {self.max_len}")
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


class Attention(nn.Module):
    """Grouped-query self-attention with rotary embeddings, via SDPA."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.output_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        decoder = cfg.decoder
        self.qk_norm = decoder.qk_norm
        if decoder.qk_norm:
            head = decoder.qk_norm == "head"
            q_dim, k_dim = (
                (cfg.head_dim, cfg.head_dim)
                if head
                else (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
            )
            self.q_norm = RMSNorm(q_dim, cfg.norm_eps, decoder.norm_plus_one)
            self.k_norm = RMSNorm(k_dim, cfg.norm_eps, decoder.norm_plus_one)
        caps = cfg.feature(SoftCapping)
        scalar = caps.query_pre_attn_scalar if caps else None
        self.scale = scalar**-0.5 if scalar else None
        self.softcap = caps.attn_logit_softcapping if caps else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)
        if self.qk_norm == "proj":  # OLMo 2: over the whole projection
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":  # Qwen3, Gemma 3: per head
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        if self.softcap is not None:
            y = self._eager(q, k, v, mask)
        else:
            y = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=mask is None and T > 1,
                enable_gqa=self.num_kv_heads != self.num_heads,
                scale=self.scale,
            )
        return self.output_proj(y.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))

    def _eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention with soft-capped scores (SDPA cannot cap), as transformers' eager path."""
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scale = self.scale if self.scale is not None else self.head_dim**-0.5
        scores = torch.matmul(q, k.transpose(2, 3)) * scale
        assert self.softcap is not None
        scores = torch.tanh(scores / self.softcap) * self.softcap
        T, S = q.shape[2], k.shape[2]
        if mask is None:
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)


class GatedMLP(nn.Module):
    """SwiGLU / GeGLU feed-forward: ``w2(act(w1 x) * w3 x)``."""

    def __init__(self, cfg: ModelConfig, size: int | None = None) -> None:
        super().__init__()
        if cfg.hidden_act not in _ACTIVATIONS:
            raise CkptkitError(f"activation {cfg.hidden_act!r} is not supported by the native model")
        self.act = _ACTIVATIONS[cfg.hidden_act]
        size = size or cfg.intermediate_size
        self.w1 = nn.Linear(cfg.hidden_size, size, bias=False)  # gate
        self.w3 = nn.Linear(cfg.hidden_size, size, bias=False)  # up
        self.w2 = nn.Linear(size, cfg.hidden_size, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    """Top-k routed experts, as transformers routes them: softmax in float32, top-k (ties as
    ``torch.topk`` breaks them), optional renormalisation, experts summed in index order.
    The router logits of the last forward are kept in ``router_logits`` for the aux loss."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.fields(MoEFields)
        self.top_k, self.norm_topk_prob = moe.num_experts_per_tok, moe.norm_topk_prob
        self.router = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(cfg, expert_size(cfg)) for _ in range(moe.num_experts))
        self.router_logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.router(flat)
        self.router_logits = logits
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):  # also on no tokens: every expert gets a
            slot, token = torch.where((chosen == e).T)  # gradient (zero), as FSDP reduces them together
            y = expert(flat[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out.reshape(shape)


class Block(nn.Module):
    """Pre-norm decoder layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        decoder = cfg.decoder
        h, eps, plus = cfg.hidden_size, cfg.norm_eps, decoder.norm_plus_one
        self.input_norms, self.post_norms = decoder.input_norms, decoder.post_norms
        if decoder.input_norms:
            self.sa_norm = RMSNorm(h, eps, plus)
        self.attn = Attention(cfg, layer_idx)
        if decoder.input_norms:
            self.mlp_norm = RMSNorm(h, eps, plus)
        self.mlp: nn.Module = SparseMoE(cfg) if is_moe_layer(cfg, layer_idx) else GatedMLP(cfg)
        if decoder.post_norms:  # Gemma 2/3, OLMo 2: norms on the sublayers' outputs
            self.attn_post_norm = RMSNorm(h, eps, plus)
            self.mlp_post_norm = RMSNorm(h, eps, plus)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None, cache: KVCache | None
    ) -> torch.Tensor:
        a = self.attn(self.sa_norm(x) if self.input_norms else x, cos, sin, mask, cache)
        x = x + (self.attn_post_norm(a) if self.post_norms else a)
        m = self.mlp(self.mlp_norm(x) if self.input_norms else x)
        return x + (self.mlp_post_norm(m) if self.post_norms else m)


class Transformer(nn.Module):
    """Decoder-only LM whose ``state_dict`` keys are ckptkit's canonical names."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cfg.decoder.norm_plus_one)
        self.output = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg)
        self.local_rope = RotaryEmbedding(cfg, local=True) if _local_theta(cfg) else None
        self.windows = get_family(cfg.model_type).sliding_windows(cfg)

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
        cos, sin = self.rope(position_ids, x.dtype)
        # Sliding-window layers with their own rope base (Gemma 3) use the local tables.
        local = self.local_rope(position_ids, x.dtype) if self.local_rope is not None else (cos, sin)
        masks = {w: self._attention_mask(attention_mask, past, T, w, x.device) for w in set(self.windows)}
        for layer, window in zip(self.layers, self.windows, strict=True):
            c, s = (cos, sin) if window is None else local
            x = layer(x, c, s, masks[window], cache)
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

    @staticmethod
    def _attention_mask(
        attention_mask: torch.Tensor | None, past: int, T: int, window: int | None, device: torch.device
    ) -> torch.Tensor | None:
        """Boolean SDPA mask (B or 1, 1, T, past + T), or None when plain ``is_causal`` suffices.

        Causal, limited to the last ``window`` keys (by index, like transformers) if set,
        and hiding padded keys.
        """
        S = past + T
        window = window if window is not None and S > window else None
        if attention_mask is not None and attention_mask.dim() == 4:  # a full (B, 1, T, S) mask, e.g. packed documents
            if window is None:
                return attention_mask.bool()
            q, k = torch.arange(past, S, device=device)[:, None], torch.arange(S, device=device)[None, :]
            return attention_mask.bool() & (k > q - window)
        if attention_mask is None and window is None and (past == 0 or T == 1):
            return None  # causal within the chunk (T > 1) or full attention to the cache (T == 1)
        q_idx = torch.arange(past, S, device=device)[:, None]
        k_idx = torch.arange(S, device=device)[None, :]
        mask = k_idx <= q_idx
        if window is not None:
            mask = mask & (k_idx > q_idx - window)
        mask = mask[None, None]
        if attention_mask is not None:
            mask = mask & attention_mask[:, None, None, :S].bool()
            # Padding queries would attend to nothing (NaN in SDPA); let them see themselves.
            mask = mask | (k_idx == q_idx)
        return mask

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Random init for training from scratch (normal linears/embeddings, unit norms)."""
        for name, p in self.named_parameters():
            if name.endswith(".scale"):
                nn.init.zeros_(p) if self.config.decoder.norm_plus_one else nn.init.ones_(p)
            elif name.endswith(".bias"):
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

    ``dtype`` None keeps the stored dtype of the weights.
    """
    from ckptkit.checkpoint import load_checkpoint

    cfg, state_dict = load_checkpoint(path, model_type=model_type)
    if dtype is None:
        dtype = state_dict["tok_embeddings.weight"].dtype
    model = build_model(cfg, device="meta", dtype=dtype)
    _check_keys(model, state_dict)
    model.load_state_dict({k: v.to(dtype) for k, v in state_dict.items()}, assign=True)
    return model.to(device).eval()


def _check_keys(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    expected, got = set(model.state_dict()), set(state_dict)
    missing, unexpected = sorted(expected - got), sorted(got - expected)
    if missing or unexpected:
        raise CkptkitError(
            f"checkpoint does not match model config: missing {_short(missing)}, unexpected {_short(unexpected)}"
        )


def _short(keys: Sequence[str], n: int = 3) -> str:
    return "[" + ", ".join(keys[:n]) + (f", ... ({len(keys)} total)" if len(keys) > n else "") + "]"
