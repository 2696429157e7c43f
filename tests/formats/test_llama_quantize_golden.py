"""``convert --to gguf --dtype TYPE [options]`` against what llama.cpp's two steps wrote for the
same sources (its converter to the source's 16-bit type, then ``llama-quantize``): the golden
facts ``llama_quantize_golden.json`` that ``make_llama_quantize_golden.py`` records (the build
is named there and in docs/formats.md).

Every run: our tensor types, tensor by tensor in file order, are llama-quantize's. Runs whose
every type ckptkit writes: the whole file, the metadata (all of it, in order) and each
tensor's bytes (sha256). Runs needing a type (or an imatrix-weighted type) ckptkit does not
write yet: the one-line refusal, nothing written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from llama_quantize_cases import PRE, facts, imatrix_entries, meta_sha, source, write_imatrix

from ckptkit.checkpoint import open_checkpoint
from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError
from ckptkit.formats.base import QuantOptions
from ckptkit.formats.gguf.mix import FILE_TYPES, mixed_types, model_facts, writable
from ckptkit.formats.gguf.tensors import hf_hparams, model_tensors, spec_of
from ckptkit.formats.gguf.weighted import UNWEIGHTED, WEIGHTED
from ckptkit.models.moe import experts

GOLDEN_FILE = Path(__file__).parent / "llama_quantize_golden.json"
if not GOLDEN_FILE.exists():  # until make_llama_quantize_golden.py has run once with the documented build
    pytest.skip("llama_quantize_golden.json not recorded yet", allow_module_level=True)
GOLDEN: dict[str, Any] = json.loads(GOLDEN_FILE.read_text())
RUNS = list(GOLDEN["runs"])
# whole files compared by default: the bundled fixtures' runs and three imatrix runs (with llama3's
# Q4_0 one, every weighted type but Q4_1 / Q5_0 / Q5_1 / IQ4_XS, which the slow runs check)
FAST = ("llama3 ", "qwen2 ", "mixtral ", "wide Q2_K --imatrix IMATRIX.gguf", "wide IQ4_NL --imatrix IMATRIX.dat")
FAST += ("moe8 Q4_K_M --imatrix",)


def _marks(rid: str) -> tuple[pytest.MarkDecorator, ...]:
    return () if rid.startswith(FAST) else (pytest.mark.slow,)


def _parse(rid: str) -> tuple[str, str, QuantOptions]:
    model, ftype, *opts = rid.split()
    kw: dict[str, Any] = {}
    it = iter(opts)
    for flag in it:
        if flag in ("--pure", "--leave-output-tensor"):
            kw[flag[2:].replace("-", "_")] = True
        else:
            kw[flag[2:].replace("-", "_")] = next(it)
    if "imatrix" in kw:
        kw["imatrix"] = f"{model}-{kw['imatrix']}"
    return model, ftype, QuantOptions(**kw)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the made models and the imatrix files (named as the golden run named them) lie."""
    root = tmp_path_factory.mktemp("lq")
    for model, known in GOLDEN["models"].items():
        entries = imatrix_entries(known["tensors"])
        for name in ("IMATRIX.dat", "IMATRIX.gguf"):
            write_imatrix(root / f"{model}-{name}", entries)
    return root


def _ours(model: str, ftype: str, quant: QuantOptions, work: Path) -> list[tuple[str, str]]:
    """Our tensor types for the run, in file order (planned, nothing written)."""
    with open_checkpoint(source(model, work), None, None, None) as ckpt:
        hparams = hf_hparams(ckpt)
        base, _ = model_tensors(ckpt, hparams, None)
        moe = experts(ckpt.config)
        facts_ = model_facts(spec_of(ckpt.family, ckpt.path).arch, hparams, moe.num_experts if moe else 0)
        return [(t.name, kind) for t, kind in mixed_types(base, ftype, facts_, quant, quant.imatrix is not None)]


@pytest.mark.parametrize("rid", RUNS)
def test_types_as_llama_quantize(rid: str, work: Path) -> None:
    model, ftype, quant = _parse(rid)
    want = list(zip(GOLDEN["models"][model]["order"], GOLDEN["runs"][rid]["types"], strict=True))
    assert _ours(model, ftype, quant, work) == want


@pytest.mark.parametrize("rid", [r for r in RUNS if r.split()[1:] == ["Q8_0"]])
def test_q8_0_is_llama_quantize_s_in_the_converter_s_order(rid: str, work: Path) -> None:
    """``--dtype q8_0`` (any case) stays the converter's: llama-quantize's Q8_0 tensors, types
    and bytes, and its keys, but in the converter's tensor order and key order."""
    model = rid.split()[0]
    out = work / f"{model}-q8_0.gguf"
    convert(source(model, work), out, ConvertOptions("gguf", dtype="Q8_0", force=True, gguf_pre=PRE.get(model)))
    got, run = facts(out), GOLDEN["runs"][rid]
    imatrix = ""
    want = dict(zip(GOLDEN["models"][model]["order"], run["types"], strict=True))
    assert {n: k for n, k, _ in got["tensors"]} == want
    data = GOLDEN["data"][model]
    assert got["data"] == {n: data[f"{n} {k} {imatrix}".strip()] for n, k in want.items()}
    keys = {m[0]: json.dumps(m) for m in GOLDEN["models"][model]["meta"] + run["new_meta"]}  # file_type replaced
    assert {json.dumps(m) for m in got["meta"]} == set(keys.values())


def _writes(model: str, rid: str, quant: QuantOptions, work: Path) -> bool:
    types = set(GOLDEN["runs"][rid]["types"])
    if FILE_TYPES[rid.split()[1]][1] not in writable() or not types <= writable():  # the file type refused outright
        return False
    if quant.imatrix is None:
        return True
    base = {name: kind for name, kind, _ in GOLDEN["models"][model]["tensors"]}
    order, types = GOLDEN["models"][model]["order"], GOLDEN["runs"][rid]["types"]
    retyped = {k for n, k in zip(order, types, strict=True) if base[n] != k}
    return retyped <= set(WEIGHTED) | set(UNWEIGHTED)


@pytest.mark.parametrize("rid", [pytest.param(r, marks=_marks(r)) for r in RUNS if r.split()[1:] != ["Q8_0"]])
def test_file_as_llama_quantize(rid: str, work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, ftype, quant = _parse(rid)
    monkeypatch.chdir(work)  # the imatrix named as llama-quantize was given it (the file key records that)
    out = work / f"{rid.replace(' ', '_')}.gguf"
    opts = ConvertOptions("gguf", dtype=ftype, quant=quant, force=True, gguf_pre=PRE.get(model))
    if not _writes(model, rid, quant, work):
        with pytest.raises(CkptkitError, match="not yet supported|does not write .* yet"):
            convert(source(model, work), out, opts)
        assert not out.exists()
        return
    convert(source(model, work), out, opts)
    got = facts(out)
    run = GOLDEN["runs"][rid]
    known = {json.dumps(m) for m in GOLDEN["models"][model]["meta"]}
    assert [m for m in got["meta"] if json.dumps(m) not in known] == run["new_meta"]
    assert meta_sha(got["meta"]) == run["meta"]
    imatrix = Path(quant.imatrix).name if quant.imatrix is not None else ""
    data = GOLDEN["data"][model]
    for name, kind, _ in got["tensors"]:
        assert got["data"][name] == data[f"{name} {kind} {imatrix}".strip()], f"{name} {kind}"
    out.unlink()
