"""A checkpoint's chat template (``tokenizer_config.json`` / ``chat_template.jinja``) rendered with jinja2.

The environment matches what transformers' ``apply_chat_template`` gives a template:
a sandbox, ``trim_blocks`` and ``lstrip_blocks``, loop controls, a ``tojson`` filter that
keeps non-ASCII text, ``raise_exception`` and ``strftime_now``, the special tokens of
``tokenizer_config.json`` as variables, and ``{% generation %}`` blocks rendered as
plain text.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

from ckptkit.errors import CkptkitError
from ckptkit.formats.base import read_json

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplate:
    """A jinja chat template plus the special-token strings it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str], origin: str) -> None:
        import jinja2

        self.origin = origin
        self.special_tokens = special_tokens
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise CkptkitError(f"{origin}: invalid chat template: {exc}") from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The conversation as one text, as the model saw such conversations in training."""
        import jinja2

        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=None, documents=None,
                **self.special_tokens,
            )  # fmt: skip
        except (jinja2.TemplateError, TemplateRaised) as exc:
            raise CkptkitError(f"{self.origin}: chat template failed: {exc}") from None


class TemplateRaised(Exception):
    """``raise_exception(...)`` called by a template (e.g. roles out of order)."""


def load_chat_template(
    folder: Path, override: str | None = None, missing: str = "set dataset.chat_template to a .jinja file"
) -> ChatTemplate:
    """The chat template for the tokenizer in ``folder``; ``override`` is a ``.jinja`` file instead.
    ``missing`` says what to do when there is none."""
    config_path = folder / "tokenizer_config.json"
    config = read_json(config_path)[1] if config_path.is_file() else {}
    special = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[key] = value
    if override is not None:
        path = Path(override)
        if not path.is_file():
            raise CkptkitError(f"dataset.chat_template: {override}: no such file")
        return ChatTemplate(path.read_text(encoding="utf-8"), special, str(path))
    jinja_file = folder / "chat_template.jinja"  # where transformers >= 4.43 saves it
    if jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(encoding="utf-8"), special, str(jinja_file))
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str):
        where = config_path if config_path.is_file() else folder
        raise CkptkitError(
            f"{where} has no chat template (no chat_template key, no chat_template.jinja beside it); {missing}"
        )
    return ChatTemplate(template, special, str(config_path))


@cache
def _environment() -> Any:
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}`` (assistant-mask markers) rendered as their body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    def raise_exception(message: str) -> None:
        raise TemplateRaised(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    extensions = [GenerationBlock, loopcontrols]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=extensions)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
