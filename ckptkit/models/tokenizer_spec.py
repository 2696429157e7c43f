"""What each family's tokenizer looks like in Meta's and HF's releases.

Meta's Llama 3.x ship a tiktoken rank file whose special tokens live only in Meta's code:
256 of them, appended after the ranked tokens in a fixed order (Llama 3 and Llama 3.1+
name some differently). Llama 2 and Mistral ship a sentencepiece model. The HF side
(BOS/EOS, stop tokens, sampling defaults, chat template) follows the official HF repos
and Meta's own generation code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SENTENCEPIECE, TIKTOKEN = "sentencepiece", "tiktoken"
RESERVED_SPECIALS = 256


def _llama3_specials(named: list[str], first_reserved: int) -> tuple[str, ...]:
    reserved = [f"<|reserved_special_token_{first_reserved + i}|>" for i in range(RESERVED_SPECIALS - len(named))]
    return (*named, *reserved)


# Meta Llama 3 (April 2024).
LLAMA3_SPECIALS = _llama3_specials(
    [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|reserved_special_token_2|>",
        "<|reserved_special_token_3|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|reserved_special_token_4|>",
        "<|eot_id|>",
    ],
    5,
)
# Meta Llama 3.1 and later (llama_models' tokenizer).
LLAMA3_1_SPECIALS = _llama3_specials(
    [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|step_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
        "<|image|>",
    ],
    2,
)

# Meta's chat format for Llama 3.x (llama_models' ChatFormat): a header per message, the
# content as given, <|eot_id|> after it; the prompt ends with an open assistant header.
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

META_SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.9}  # Meta's generation defaults


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


def _llama3(specials: tuple[str, ...], stop: tuple[str, ...]) -> TokenizerSpec:
    return TokenizerSpec(
        TIKTOKEN,
        specials,
        "<|begin_of_text|>",
        "<|end_of_text|>",
        stop,
        META_SAMPLING,
        LLAMA3_CHAT_TEMPLATE,
    )


LLAMA2_TOKENIZER = TokenizerSpec(SENTENCEPIECE, generation={**META_SAMPLING, "pad_token": "<unk>"})
LLAMA3_TOKENIZER = _llama3(LLAMA3_SPECIALS, ("<|end_of_text|>", "<|eot_id|>"))
LLAMA3_1_TOKENIZER = _llama3(LLAMA3_1_SPECIALS, ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"))
MISTRAL_TOKENIZER = TokenizerSpec(SENTENCEPIECE)
