"""Tokenizer files converted with the weights (Meta ``tokenizer.model`` <-> HF tokenizer files).

Between layouts of one format (HF -> HF, HF -> hf-bin, HF -> internal -> HF) every
tokenizer file is carried byte for byte and none is added: files are generated only when
crossing from Meta to HF.

To HF from Meta: the HF files come from, in order, the ones recorded when this checkpoint
was converted from HF (if its ``tokenizer.model`` is still the one written then), the
source's own HF files, or a conversion of Meta's ``tokenizer.model``. A tiktoken rank file is
not carried into an HF folder; a sentencepiece model is, as HF's Llama 2 repos keep it.

To Meta: ``tokenizer.model`` is the source's own, or rebuilt from ``tokenizer.json``
(Llama 3.x: the tiktoken rank file; Llama 2 / Mistral: a sentencepiece model with the same
pieces, merges and settings); a ``tokenizer.json`` neither can stand for exactly gets no
``tokenizer.model`` (a note says so), never an approximate one. The HF-only files are
recorded in the origin file so that converting back restores them byte for byte.

Built with the ``tokenizers`` library and a small reader of the sentencepiece format:
no transformers, tiktoken or protobuf is needed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptkit.errors import CkptkitError, note
from ckptkit.io import is_file, read_file
from ckptkit.models.tokenizer_spec import TIKTOKEN, TokenizerSpec
from ckptkit.tokenization import sentencepiece_bpe, tiktoken_bpe
from ckptkit.tokenization.hf_files import HFTokenizer, build_hf_tokenizer
from ckptkit.tokenization.spm_proto import write_spm_model

MODEL_FILE = "tokenizer.model"
TOKENIZER_OPTION = "--tokenizer PATH (its tokenizer.model or tokenizer.json, or a folder with its tokenizer files)"
ADD_TOKENIZER = f"to have one, convert again with {TOKENIZER_OPTION}"
HF_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)
# What --tokenizer takes from a folder, and replaces in the source: the tokenizer itself
TOKENIZER_FILES = (MODEL_FILE, *(name for name in HF_FILES if name != "generation_config.json"))
__all__ = [
    "HF_FILES",
    "MODEL_FILE",
    "TOKENIZER_FILES",
    "TOKENIZER_OPTION",
    "HFTokenizer",
    "TokenizerPlan",
    "supplied_tokenizer",
    "tokenizer_for_hf",
    "tokenizer_for_meta",
]


@dataclass
class TokenizerPlan:
    """What a conversion does with the tokenizer files of its source.

    Attributes:
        files: name -> content to write into the output.
        skip: source files not to copy as they are (replaced or not carried).
        record: HF-only files to keep in the origin file (HF -> Meta), or None.
        ids: bos/eos/pad ids for ``config.json`` when the tokenizer was converted.
    """

    files: dict[str, bytes] = field(default_factory=dict)
    skip: set[str] = field(default_factory=set)
    record: dict[str, Any] | None = None
    ids: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _packed(data: bytes) -> str:
    return base64.b64encode(zlib.compress(data, 9)).decode("ascii")


def _unpacked(text: str) -> bytes:
    return zlib.decompress(base64.b64decode(text))


def _json_file(path: Path) -> dict[str, Any]:
    """A JSON object from ``path`` ({} when absent); a one-line error naming it when unreadable."""
    if not is_file(path):
        return {}
    try:
        doc = json.loads(read_file(path).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CkptkitError(f"{path}: unreadable JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CkptkitError(f"{path}: not a JSON object")
    return doc


def supplied_tokenizer(path: Path) -> dict[str, Path]:
    """The tokenizer files ``--tokenizer PATH`` gives, by the name they take in the output: a
    file (``tokenizer.json`` if its name ends in ``.json``, else ``tokenizer.model``), or
    those of :data:`TOKENIZER_FILES` in a folder; a one-line error when there are none."""
    if path.is_file():
        return {"tokenizer.json" if path.suffix == ".json" else MODEL_FILE: path}
    if not path.is_dir():
        raise CkptkitError(f"--tokenizer {path}: no such file or folder")
    found = {name: path / name for name in TOKENIZER_FILES if (path / name).is_file()}
    if MODEL_FILE not in found and "tokenizer.json" not in found:
        raise CkptkitError(f"--tokenizer {path}: the folder has no tokenizer.model or tokenizer.json")
    return found


def _model_file(src: Path) -> Path | None:
    """Meta's ``tokenizer.model``: in the folder, or beside it as Meta's Llama 2 downloads keep it."""
    for candidate in (src / MODEL_FILE, src.parent / MODEL_FILE):
        if is_file(candidate):
            return candidate
    return None


def tokenizer_for_hf(
    src: Path,
    spec: TokenizerSpec | None,
    vocab_size: int,
    max_positions: int,
    recorded: dict[str, Any] | None = None,
    from_hf: bool = False,
) -> TokenizerPlan:
    """The tokenizer side of writing the checkpoint in ``src`` as an HF folder (``spec``: its
    family's). ``from_hf``: the source holds HF files as they were (:func:`holds_hf_files`);
    they are carried byte for byte and nothing is added."""
    if spec is None or from_hf:
        return TokenizerPlan()
    plan = TokenizerPlan()
    model = src / MODEL_FILE
    if is_file(model) and tiktoken_bpe.is_rank_file(model):
        plan.skip.add(MODEL_FILE)
    current = _digest(bytes(read_file(model))) if is_file(model) else None
    if recorded and recorded.get("model_sha256") == current:
        plan.files = {name: _unpacked(text) for name, text in recorded["files"].items()}
        plan.skip.update(HF_FILES)
        if not recorded.get("model_in_hf", False):
            plan.skip.add(MODEL_FILE)
        return plan
    if is_file(src / "tokenizer.json"):
        return plan
    found = _model_file(src)
    if found is None:
        plan.notes.append(note("no tokenizer.model found: the output has no tokenizer", ADD_TOKENIZER))
        return plan
    hf = build_hf_tokenizer(spec, found, vocab_size, max_positions)
    plan.files = {name: data for name, data in hf.files.items() if not is_file(src / name)}
    plan.notes = hf.notes
    if found != model and spec.kind != TIKTOKEN:
        plan.files[MODEL_FILE] = bytes(read_file(found))
    plan.ids = {"bos_token_id": hf.bos_token_id, "eos_token_id": hf.eos_token_id}
    return plan


def tokenizer_for_meta(src: Path, spec: TokenizerSpec | None, from_hf: bool = False) -> TokenizerPlan:
    """The tokenizer side of writing the checkpoint in ``src`` as a Meta folder (``spec``: its
    family's). ``from_hf``: the source holds HF files as they were; the record then lists them
    even when there are none, so that converting back adds none."""
    if spec is None:
        return TokenizerPlan()
    kind = spec.kind
    plan = TokenizerPlan(skip=set(HF_FILES))
    present = {name: bytes(read_file(src / name)) for name in HF_FILES if is_file(src / name)}
    model = src / MODEL_FILE
    data: bytes | None = None
    if is_file(model):
        data = bytes(read_file(model))
    elif kind == TIKTOKEN and is_file(src / "tokenizer.json"):
        ranks = tiktoken_bpe.ranks_from_tokenizer_json(src / "tokenizer.json")
        if ranks is not None:
            data = plan.files[MODEL_FILE] = tiktoken_bpe.ranks_text(ranks)
    elif is_file(src / "tokenizer.json"):
        spm = sentencepiece_bpe.model_from_tokenizer_json(
            _json_file(src / "tokenizer.json"), _json_file(src / "tokenizer_config.json")
        )
        if spm is not None:
            data = plan.files[MODEL_FILE] = write_spm_model(spm)
    if data is None and present:
        why = "is not a Llama 3 byte-level BPE" if kind == TIKTOKEN else "cannot be written as sentencepiece"
        plan.notes.append(
            note(f"tokenizer.json {why} and the source has no tokenizer.model: the output has none", ADD_TOKENIZER)
        )
    if present or from_hf:
        plan.record = {
            "model_sha256": _digest(data) if data is not None else None,
            "model_in_hf": is_file(model),
            "files": {name: _packed(content) for name, content in present.items()},
        }
    return plan
