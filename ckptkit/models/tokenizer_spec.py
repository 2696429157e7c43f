"""How a family's tokenizer looks in Meta's and HF's releases: the type a family module fills
in (Llama's and Mistral's: :mod:`ckptkit.models.llama`, :mod:`ckptkit.models.mistral`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SENTENCEPIECE, TIKTOKEN = "sentencepiece", "tiktoken"


@dataclass(frozen=True)
class TokenizerSpec:
    """A family's tokenizer conventions.

    Attributes:
        kind: ``sentencepiece`` or ``tiktoken`` (Meta's ``tokenizer.model``).
        specials: tiktoken only: the special tokens Meta appends after the ranks.
        bos, eos: token texts (sentencepiece: taken from the model when None).
        stop: tokens that end generation (``generation_config.json`` ``eos_token_id``).
        generation: other ``generation_config.json`` fields, ``pad_token`` as a token text.
        chat_template: a Jinja chat template, when the family's tokenizer defines one.
    """

    kind: str
    specials: tuple[str, ...] = ()
    bos: str | None = None
    eos: str | None = None
    stop: tuple[str, ...] = ()
    generation: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
