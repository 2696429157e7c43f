"""How llama.cpp's ``convert_hf_to_gguf.py`` writes (and so reads back) a family: data that
the ``gguf`` format interprets, so that a new family is a :class:`GGUFSpec` on its class
(in its own module), not an edit of the format.

llama.cpp picks its model class by the HF ``architectures`` name; a family inherits its
parent's spec only where its own HF architecture is one the spec lists (Mixtral and Qwen3
subclass Llama and Qwen2 but are other llama.cpp models): :meth:`Family.gguf_spec`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GGUFSpec:
    """One llama.cpp model class.

    Attributes:
        arch: ``general.architecture`` (a name in the ``gguf`` package's ``MODEL_ARCH_NAMES``).
        hf_architectures: the HF ``architectures`` values llama.cpp converts with this class.
        parameters: the ``<arch>.*`` keys in the order its ``set_gguf_parameters`` adds
            them, by the names :mod:`ckptkit.formats.gguf.params` defines (``?``: only when
            config.json has the field).
        vocab: its ``set_vocab``: ``llama`` (sentencepiece, else byte-level BPE), ``gemma``,
            ``phi3``, ``bpe_or_spm`` (Qwen2), ``bpe`` (byte-level BPE only), ``spm_unprefixed``
            (sentencepiece, ``add_space_prefix`` false) or ``spm_unprefixed_or_bpe``.
        permute_qk: q/k rows go back to Meta's interleaved pairs (llama.cpp's ``permute``).
        norm_plus_one: norms are stored as ``1 + w`` (Gemma).
        drops_output: ``lm_head.weight`` is not written (Gemma always ties it).
        rope_freqs: Llama 3 rope scaling is written as the ``rope_freqs.weight`` tensor.
        sliding_pattern: llama.cpp runs every ``n``-th layer with global attention and the
            others in the sliding window (``layer_types`` is not stored; read back as this).
        query_scale_layers: llama.cpp scales queries by ``1/sqrt(head_dim)`` (HF
            ``query_pre_attn_scalar``, not stored), or by ``1/sqrt(hidden/heads)`` for models
            with one of these block counts (Gemma 2 and 3 27B); None: by the config's own.
        embeddings_to_vocab: the embedding rows past the tokenizer's tokens are dropped.
        experts: how it merges a layer's experts into 3-D tensors (None: no experts).
        implied: config.json fields its llama.cpp architecture assumes without a key
            (set when reading a GGUF back).
        latent_attention: DeepSeek's: ``kv_b_proj`` written split per head as ``attn_k_b``
            (transposed) and ``attn_v_b``, the MTP layers past ``num_hidden_layers`` not written.
        linear_attention: the hybrid Qwen stacks' Gated DeltaNet layers and MTP layers
            (:mod:`ckptkit.formats.gguf.hybrid`): ``tiled`` (Qwen3.5: value heads reordered) or
            ``fused`` (Qwen3-Next: ``in_proj_qkvz`` split); None: not a hybrid stack.
        reads_back: ckptkit reads its GGUFs back into the family (else written only).
        interleaved_experts: gpt-oss's: the stacked ``experts.gate_up_proj`` [E, cols, 2 *
            rows] / ``down_proj`` [E, cols, rows] written transposed, the interleaved gate and
            up rows (and biases) split, the attention ``sinks`` named ``attn_sinks.weight``.
        halved_experts: Llama 4's: the stacked ``feed_forward.experts.gate_up_proj`` [E,
            cols, 2 * rows] / ``down_proj`` [E, rows, cols] written transposed, the gate
            (first) and up (second) halves split.
        renames: (HF name past ``model.layers.{i}.``, GGUF name past ``blk.{i}.``) for layer
            tensors its ``modify_tensors`` names itself (the ``gguf`` package's map lacks them);
            such a tensor is written as stored (Gemma 4's stacked experts not split).
        skipped: HF name prefixes past ``model.`` of tensors its text model does not write
            (the vision and audio towers: ``--mmproj``'s).
        proportional_rope: Gemma 4's: ``rope_freqs.weight`` leaves the full-attention heads'
            dimensions past ``partial_rotary_factor`` unrotated
            (:func:`ckptkit.formats.gguf.per_layer.proportional_rope_freqs`).
        assumed: config.json fields its llama.cpp architecture fixes without a key, as it
            runs the model, from a config.json (or the metadata read as one): set when a GGUF
            is read back, noted on writing where the source's differ.
    """

    arch: str
    hf_architectures: tuple[str, ...]
    parameters: tuple[str, ...]
    vocab: str
    permute_qk: bool = False
    norm_plus_one: bool = False
    drops_output: bool = False
    rope_freqs: bool = False
    sliding_pattern: int | None = None
    query_scale_layers: tuple[int, ...] | None = None
    embeddings_to_vocab: bool = False
    experts: GGUFExperts | None = None
    implied: tuple[tuple[str, Any], ...] = ()
    latent_attention: bool = False
    linear_attention: str | None = None
    reads_back: bool = True
    interleaved_experts: bool = False
    renames: tuple[tuple[str, str], ...] = ()
    skipped: tuple[str, ...] = ()
    proportional_rope: bool = False
    halved_experts: bool = False
    assumed: Callable[[dict[str, Any]], dict[str, Any]] | None = None


@dataclass(frozen=True)
class GGUFExperts:
    """How a llama.cpp model class writes a layer's experts: one 3-D tensor per projection
    (``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps`` [E, rows, cols], experts
    stacked in order, nothing transposed) and the router as ``ffn_gate_inp``.

    Attributes:
        order: the canonical projections (``w1`` gate, ``w3`` up, ``w2`` down) in the order
            it writes the merged tensors, once a layer's last expert tensor is read.
        takes_stacked: it reads transformers' stacked ``experts.gate_up_proj`` /
            ``experts.down_proj`` as they come (else only one tensor per expert; a stacked
            source is then written as llama.cpp writes its per-expert HF copy).
    """

    order: tuple[str, ...]
    takes_stacked: bool = False


# llama.cpp's TextModel.set_gguf_parameters, the keys our families have
TEXT_MODEL_PARAMETERS = (
    "block_count", "context_length?", "embedding_length", "feed_forward_length", "head_count", "head_count_kv?",
    "rope_scaling", "rope_freq_base?", "layer_norm_rms_eps?", "head_dim?", "file_type",
)  # fmt: skip

# TextModel adds expert_count / expert_used_count after the norm epsilon when config.json has them.
_EPS = TEXT_MODEL_PARAMETERS.index("layer_norm_rms_eps?") + 1
MOE_TEXT_MODEL_PARAMETERS = (
    *TEXT_MODEL_PARAMETERS[:_EPS],
    "expert_count",
    "expert_used_count",
    *TEXT_MODEL_PARAMETERS[_EPS:],
)
