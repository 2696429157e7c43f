"""llama-quantize's options on ``convert --to gguf --dtype TYPE``: passed through by the CLI,
refused in one line where they do not apply, and bad imatrix files refused with nothing
written (what each option does to a file is checked against llama-quantize itself in
``test_llama_quantize_golden.py``)."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from llama_quantize_cases import write_imatrix
from typer.testing import CliRunner

from ckptkit.cli import app
from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError, FlagError
from ckptkit.formats.base import QuantOptions

from conftest import FIXTURES
from tokenizer_helpers import gguf_reader

SRC = FIXTURES / "hf" / "llama2"  # 2 layers, rows of 64 and 192


def _legacy(path: Path, entries: dict[str, np.ndarray]) -> Path:
    blob = struct.pack("<i", len(entries))
    for name, v in entries.items():
        blob += struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", 1, v.size) + v.astype("<f4").tobytes()
    path.write_bytes(blob)
    return path


def _refused(tmp_path: Path, match: str, error: type[Exception] = CkptkitError, **quant: object) -> None:
    out = tmp_path / "m.gguf"
    dtype = str(quant.pop("dtype", "Q4_0"))
    with pytest.raises(error, match=match):
        convert(SRC, out, ConvertOptions("gguf", dtype=dtype, quant=QuantOptions(**quant)))  # type: ignore[arg-type]
    assert not out.exists()


def test_cli_passes_the_options(tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    args = ["convert", str(SRC), str(out), "--to", "gguf", "--dtype", "q4_0", "--quiet"]
    res = CliRunner().invoke(app, [*args, "--token-embedding-type", "Q8_0", "--pure"])
    assert res.exit_code == 0, res.output
    types = {t.name: t.tensor_type.name for t in gguf_reader(out).tensors}  # type: ignore[attr-defined]
    assert types["token_embd.weight"] == "Q8_0"
    assert types["output.weight"] == "Q4_0"  # --pure: not the output's Q6_K (Q8_0 for rows of 64)
    res = CliRunner().invoke(app, [*args, "--output-tensor-type", "f16", "--leave-output-tensor", "--force"])
    assert res.exit_code == 0, res.output
    types = {t.name: t.tensor_type.name for t in gguf_reader(out).tensors}  # type: ignore[attr-defined]
    assert types["output.weight"] == "BF16" and types["token_embd.weight"] == "Q4_0"  # left: the 16-bit type


def test_options_need_a_llama_quantize_type(tmp_path: Path) -> None:
    _refused(
        tmp_path,
        r"^--pure applies with --to gguf --dtype one of llama-quantize's types",
        FlagError,
        pure=True,
        dtype="bfloat16",
    )
    res = CliRunner().invoke(app, ["convert", str(SRC), str(tmp_path / "m"), "--to", "hf", "--leave-output-tensor"])
    assert res.exit_code == 2 and "--leave-output-tensor applies with --to gguf --dtype" in res.output


def test_bad_ggml_types_are_one_line(tmp_path: Path) -> None:
    _refused(tmp_path, r"^--output-tensor-type q9_9: not a GGML type", output_tensor_type="q9_9")
    _refused(
        tmp_path, r"^--token-embedding-type iq2_xxs: ckptkit does not write IQ2_XXS yet", token_embedding_type="iq2_xxs"
    )


def test_imatrix_with_nan_is_one_line(tmp_path: Path) -> None:
    v = np.ones(64, np.float32)
    v[5] = np.nan
    bad = _legacy(tmp_path / "nan.dat", {"blk.0.attn_q.weight": v})
    _refused(tmp_path, r"^--imatrix .*nan.dat: entry blk.0.attn_q.weight holds a NaN or infinite value$", imatrix=bad)


def test_imatrix_of_another_model_is_one_line(tmp_path: Path) -> None:
    other = tmp_path / "other.gguf"
    write_imatrix(other, {"blk.0.attn_q.weight": (4096, 1), "blk.0.ffn_down.weight": (14336, 1)})
    _refused(
        tmp_path, r"^--imatrix .*other.gguf: 4096 values for blk.0.attn_q.weight, which has 64 columns", imatrix=other
    )
    names = _legacy(tmp_path / "names.dat", {"model.layers.0.self_attn.q_proj.weight": np.ones(64, np.float32)})
    _refused(tmp_path, r"^--imatrix .*names.dat: none of its entries names a tensor of this model$", imatrix=names)


@pytest.mark.parametrize(
    "blob", [b"", b"\x01\x00\x00\x00\x05\x00", b"GGUF\x03\x00\x00\x00"], ids=["empty", "cut", "bad gguf"]
)
def test_unreadable_imatrix_is_one_line(blob: bytes, tmp_path: Path) -> None:
    bad = tmp_path / "bad.imatrix"
    bad.write_bytes(blob)
    _refused(tmp_path, r"^[^\n]*bad.imatrix: ", imatrix=bad)
    _refused(tmp_path, r"^--imatrix .*absent.dat: cannot read it", imatrix=tmp_path / "absent.dat")


def test_q8_0_in_llama_quantize_s_spelling_is_the_converter_s(tmp_path: Path) -> None:
    convert(SRC, tmp_path / "upper.gguf", ConvertOptions("gguf", dtype="Q8_0"))
    convert(SRC, tmp_path / "lower.gguf", ConvertOptions("gguf", dtype="q8_0"))
    assert (tmp_path / "upper.gguf").read_bytes() == (tmp_path / "lower.gguf").read_bytes()
