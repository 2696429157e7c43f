"""Shared helper of the per-family GGUF tests: llama.cpp's GGUFs of an HF folder, every
outtype from one converter process, made on first use."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from test_gguf import OUTTYPES, llama_cpp_ggufs


def llama_cpp_references(
    llama_cpp: Path, tmp_path_factory: pytest.TempPathFactory, pre: str
) -> Callable[[Path, str | None], Path]:
    """A function giving llama.cpp's GGUF of an HF folder for a dtype of ``OUTTYPES`` (every
    outtype of a folder written by one converter run, with pre-tokenizer ``pre``)."""
    made: dict[Path, dict[str, Path]] = {}

    def get(src: Path, dtype: str | None) -> Path:
        if src not in made:
            tmp = tmp_path_factory.mktemp(src.name)
            made[src] = llama_cpp_ggufs(llama_cpp, src, {t: tmp / f"{t}.gguf" for t in OUTTYPES.values()}, pre)
        return made[src][OUTTYPES[dtype]]

    return get


# config.json fields a GGUF does not hold: training-only ones; its tokenizer's ids (bos, eos)
NOT_IN_GGUF = {"router_aux_loss_coef", "bos_token_id", "eos_token_id", "pad_token_id"}


def assert_reads_back(
    gguf: Path,
    src: Path,
    out: Path,
    left_out: str | None = None,
    ignored: frozenset[str] = frozenset(),
    logits_diff: float = 0.0,
) -> None:
    """``gguf`` (llama.cpp's, of ``src``) converts back to HF with ``src``'s tensors bit for bit
    (in ``src``'s dtypes where the GGUF has them; float32 of them from an f32 GGUF), but those
    starting with ``left_out`` (which llama.cpp does not write), the same config but what the GGUF
    cannot hold (``NOT_IN_GGUF``, ``ignored``), and transformers gives it ``src``'s logits
    (within ``logits_diff``, the measured max abs diff where it is not 0)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ckptkit.checkpoint import open_checkpoint
    from ckptkit.convert import ConvertOptions, convert

    convert(gguf, out, ConvertOptions("hf"))
    with open_checkpoint(src) as a, open_checkpoint(out) as b, open_checkpoint(gguf) as g:
        assert a.family.name == b.family.name == g.family.name
        kept = [k for k in a.tensors if left_out is None or not k.startswith(left_out)]
        assert sorted(b.tensors) == sorted(kept)
        f32 = gguf.stem == "f32"  # llama_cpp_references names its files by outtype
        for k in kept:
            theirs, ours = a.tensors[k].get(), b.tensors[k].get()
            same_dtype = ours.dtype in (theirs.dtype, torch.float32) if f32 else ours.dtype == theirs.dtype
            assert torch.equal(theirs.float(), ours.float()) and same_dtype, k
        differ = {k for k, v in a.config.to_dict().items() if b.config.to_dict()[k] != v}
        assert differ <= NOT_IN_GGUF | ignored, differ
    ids = torch.randint(0, 384, (2, 13), generator=torch.Generator().manual_seed(0))
    logits = []
    for folder in (src, out):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert float((logits[0] - logits[1]).abs().max()) <= logits_diff
