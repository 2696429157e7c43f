"""Text generation with the native model: greedy or temperature / top-k sampling, KV-cached."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ckptkit.errors import CkptkitError, note
from ckptkit.train.attention import KVCache
from ckptkit.train.tokenizer import Tokenizer, load_tokenizer, tokenizer_folder
from ckptkit.train.transformer import Transformer, load_model


def sample_next(
    logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Next token ids (B,) from last-position logits (B, vocab); ``temperature <= 0`` is greedy."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: Transformer,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    on_token: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Prompt plus up to ``max_new_tokens`` new tokens, (B, T + n).

    Batched prompts are left-padded with ``attention_mask`` marking real tokens. A
    sequence that emits an EOS id is padded afterwards with ``pad_token_id`` (default:
    the first EOS id), and decoding stops once every sequence has finished, as in
    ``transformers`` ``generate``. ``on_token`` gets each step's new ids (B,) as they come.
    """
    if input_ids.ndim != 2:
        raise CkptkitError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    eos = torch.tensor(
        [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or []), device=input_ids.device
    )
    pad = pad_token_id if pad_token_id is not None else (int(eos[0]) if len(eos) else 0)
    weight = model.tok_embeddings.weight
    cache = KVCache(model.config, B, T + max_new_tokens, device=weight.device, dtype=weight.dtype)
    finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    tokens, step_input = input_ids, input_ids
    for _ in range(max_new_tokens):
        logits = model(step_input, attention_mask=attention_mask, cache=cache)[:, -1]
        next_ids = sample_next(logits, temperature, top_k, generator)
        next_ids = torch.where(finished, torch.full_like(next_ids, pad), next_ids)
        tokens = torch.cat([tokens, next_ids[:, None]], dim=1)
        if on_token is not None:
            on_token(next_ids)
        if len(eos):
            finished |= torch.isin(next_ids, eos)
            if bool(finished.all()):
                break
        step_input = next_ids[:, None]
        if attention_mask is not None:
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(B, 1)], dim=1)
    return tokens


def generate_text(
    checkpoint: str,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    adapter: str | None = None,
    seed: int = 0,
    on_text: Callable[[str], None] | None = None,
    on_note: Callable[[str], None] | None = None,
    chat: bool = False,
) -> str:
    """Body of ``ckptkit generate``: load checkpoint (+ adapter) and tokenizer, return prompt + completion
    (with ``chat``: ``prompt`` is a user message in the chat template, and only the reply is returned).

    ``max_new_tokens`` is capped so that prompt plus completion fit the model's context
    (``on_note`` says so); ``on_text`` receives the text piece by piece as tokens come.
    """
    from ckptkit.train.peft_io import load_adapter

    tokenizer = load_tokenizer(checkpoint)  # first: fail before reading any weights
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(checkpoint, device=device, dtype=None if device == "cuda" else torch.float32)
    eos = model.config.eos_token_id
    eos_ids = sorted(set(tokenizer.eos_ids) | set([eos] if isinstance(eos, int) else eos or []))
    if adapter is not None:
        load_adapter(model, adapter, merge=True, base=checkpoint)
    prompt_ids = chat_prompt_ids(checkpoint, prompt, tokenizer) if chat else tokenizer.encode(prompt)
    if not prompt_ids:
        raise CkptkitError("the prompt encodes to no tokens")
    max_new_tokens = fit_context(len(prompt_ids), max_new_tokens, model.config.max_position_embeddings, on_note)
    start = len(prompt_ids) if chat else 0  # what is shown: the reply only, or prompt and completion
    ids = list(prompt_ids[start:])
    stream = TextStream(tokenizer.decode, ids, on_text)

    def on_token(next_ids: torch.Tensor) -> None:
        ids.append(int(next_ids[0]))
        if int(next_ids[0]) not in eos_ids:
            stream.push(ids)

    generator = torch.Generator(device=device).manual_seed(seed)
    out = generate(
        model,
        torch.tensor([prompt_ids], device=device),
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        eos_token_id=eos_ids,
        generator=generator,
        on_token=on_token,
    )
    new_ids = out[0, len(prompt_ids) :].tolist()
    new_ids = new_ids[: next((i for i, t in enumerate(new_ids) if t in eos_ids), len(new_ids))]  # up to EOS
    text = tokenizer.decode([*prompt_ids[start:], *new_ids])
    stream.finish(text)
    why = empty_completion(new_ids, len(new_ids) < out.shape[1] - len(prompt_ids), tokenizer.decode)
    if why and on_note is not None:
        on_note(note(why, "to get text, change the prompt, sample with --temperature, or use --chat with a chat model"))
    return text


def empty_completion(new_ids: list[int], ended: bool, decode: Callable[[list[int]], str]) -> str | None:
    """Why the completion ``new_ids`` (``ended``: by end-of-sequence) shows no text; None when it shows some."""
    if not new_ids and ended:
        return "the model produced end-of-sequence as its first token: the completion is empty"
    if not decode(new_ids).strip():
        return f"the model produced {len(new_ids)} tokens that decode to no visible text"
    return None


def chat_prompt_ids(checkpoint: str, prompt: str, tokenizer: Tokenizer) -> list[int]:
    """``prompt`` as one user message in the checkpoint's chat template, with the assistant's turn
    opened, tokenised as transformers' ``apply_chat_template`` does (the template writes any BOS)."""
    from ckptkit.train.chat_template import load_chat_template

    own = Path(checkpoint) if Path(checkpoint).is_dir() else Path(checkpoint).parent
    with tokenizer_folder(checkpoint) as folder:
        if folder == own:
            missing = (
                "drop --chat to continue PROMPT as plain text, "
                f"or save the model's chat template as {own / 'chat_template.jinja'}"
            )
            template = load_chat_template(folder, missing=missing)
        else:  # rebuilt from the checkpoint's metadata (a GGUF's tokenizer.chat_template)
            try:
                template = load_chat_template(folder)
            except CkptkitError:
                raise CkptkitError(
                    f"{checkpoint}: holds no chat template; drop --chat to continue PROMPT as plain text"
                ) from None
    text = template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tokenizer.encode(text, add_bos=False)


def fit_context(prompt_len: int, max_new_tokens: int, context: int, on_note: Callable[[str], None] | None) -> int:
    """``max_new_tokens`` capped so that the prompt plus the completion fit ``context`` tokens."""
    if prompt_len >= context:
        raise CkptkitError(f"the prompt is {prompt_len} tokens, the model's context is {context}; shorten it")
    room = context - prompt_len
    if max_new_tokens > room:
        if on_note is not None:
            on_note(
                note(
                    f"--max-new-tokens {max_new_tokens} capped at {room}: the prompt ({prompt_len} tokens) "
                    f"plus the completion fill the model's context of {context} tokens"
                )
            )
        return room
    return max_new_tokens


class TextStream:
    """Decoded text handed out as it grows. The whole sequence is decoded again after each
    token and only text up to its last whitespace is passed on (byte-fallback pieces and
    half characters can still change until a word ends); the rest comes with ``finish``."""

    def __init__(self, decode: Callable[[list[int]], str], ids: list[int], on_text: Callable[[str], None] | None):
        self.decode, self.on_text = decode, on_text
        self.sent = ""
        if on_text is not None:
            self._send(decode(ids))

    def push(self, ids: list[int]) -> None:
        if self.on_text is not None:
            self._send(self.decode(ids))

    def finish(self, text: str) -> None:
        if self.on_text is not None:
            self._send(text, final=True)

    def _send(self, text: str, final: bool = False) -> None:
        if not final:
            text = text[: max(text.rfind(" "), text.rfind("\n")) + 1]
        if text.startswith(self.sent) and len(text) > len(self.sent):
            self.on_text(text[len(self.sent) :])  # type: ignore[misc]
            self.sent = text
