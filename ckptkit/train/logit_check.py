"""``ckptkit verify A B --logits``: both checkpoints through the native decoder on fixed
prompts, their next-token distributions compared.

The check to run after a lossy cast or a quantization (a GGUF's blocks are read back
dequantized): it says what the weights' differences do to the model's output. The prompts
are the bundled corpus (``datasets/tiny_corpus.txt``) in A's tokenizer when A has one whose
ids fit the vocabulary, else token ids drawn with a fixed seed; both models compute in
float32 on the same device, so what differs is the weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ckptkit.errors import CkptkitError

PROMPTS, PROMPT_TOKENS, SEED = 4, 16, 20240611
CORPUS_TOKENS = 64  # per prompt, from the bundled corpus
CORPUS = Path(__file__).resolve().parent / "datasets" / "tiny_corpus.txt"


def fixed_prompts(vocab_size: int, context: int) -> torch.Tensor:
    """(PROMPTS, T) token ids drawn with a fixed seed, T at most the context."""
    generator = torch.Generator().manual_seed(SEED)
    length = max(1, min(PROMPT_TOKENS, context))
    return torch.randint(0, vocab_size, (PROMPTS, length), generator=generator)


def corpus_prompts(checkpoint: str | Path, vocab_size: int, context: int) -> torch.Tensor | None:
    """(PROMPTS, T) ids of consecutive pieces of the bundled corpus in ``checkpoint``'s
    tokenizer (T at most the context), or None: no tokenizer, or ids outside the vocabulary."""
    from ckptkit.train.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(checkpoint)
    except CkptkitError:
        return None
    length = max(1, min(CORPUS_TOKENS, context))
    ids = tok.encode(CORPUS.read_text(encoding="utf-8"), add_bos=False)[: PROMPTS * length]
    if len(ids) < PROMPTS * length or max(ids) >= vocab_size or min(ids) < 0:
        return None
    return torch.tensor(ids).reshape(PROMPTS, length)


@torch.no_grad()
def compare_logits(a: str | Path, b: str | Path, model_type: str | None = None) -> dict[str, Any]:
    """Max abs logit difference, KL(A || B) per position (mean and max, nats) and how often
    the most likely next token agrees, over :func:`corpus_prompts` of A, else
    :func:`fixed_prompts`."""
    from ckptkit.train.transformer import load_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_a = load_model(str(a), device=device, dtype=torch.float32, model_type=model_type)
    vocab, context = model_a.config.vocab_size, model_a.config.max_position_embeddings
    corpus = corpus_prompts(a, vocab, context)
    ids = (fixed_prompts(vocab, context) if corpus is None else corpus).to(device)
    logits_a = model_a(ids).double()
    del model_a
    model_b = load_model(str(b), device=device, dtype=torch.float32, model_type=model_type)
    if model_b.config.vocab_size != vocab:
        raise CkptkitError(
            f"{b}: vocabulary of {model_b.config.vocab_size} tokens, {a} has {vocab}; logits differ in size"
        )
    logits_b = model_b(ids).double()
    del model_b
    log_pa, log_pb = logits_a.log_softmax(-1), logits_b.log_softmax(-1)
    kl = (log_pa.exp() * (log_pa - log_pb)).sum(-1)  # (prompts, positions)
    agree = (logits_a.argmax(-1) == logits_b.argmax(-1)).double().mean()
    return {
        "prompts": PROMPTS,
        "tokens_per_prompt": int(ids.shape[1]),
        "tokens": "random" if corpus is None else "corpus",
        "max_abs_logit_diff": float((logits_a - logits_b).abs().max()),
        "kl_mean": float(kl.mean().clamp_min(0)),
        "kl_max": float(kl.max().clamp_min(0)),
        "top1_agreement": float(agree),
    }


def describe(result: dict[str, Any]) -> str:
    """The one line ``verify --logits`` prints."""
    n, t = result["prompts"], result["tokens_per_prompt"]
    what = f"{n} pieces of {t} tokens of the bundled corpus" if result.get("tokens") == "corpus" else None
    return (
        f"logits on {what or f'{n} fixed prompts of {t} tokens'}: "
        f"max abs diff {result['max_abs_logit_diff']:.6g}, KL(A||B) mean {result['kl_mean']:.3g} "
        f"max {result['kl_max']:.3g} nats, top-1 agreement {result['top1_agreement']:.1%}"
    )
