"""Write ``llama_quantize_golden.json``: what llama.cpp's two steps give for the sources and runs
of ``llama_quantize_cases`` (its converter ``convert_hf_to_gguf.py --outtype auto`` to the
source's 16-bit type, then ``llama-quantize [options] IN OUT TYPE``): per run the tensor types
in file order, the sha256 of every tensor's bytes (kept once per tensor, type and imatrix)
and the metadata (sha256 of all of it, and the keys the 16-bit file lacks).

The llama.cpp: the one vendored in the llama-cpp-python 0.3.36 sdist (``tokenizer_helpers.
LLAMA_CPP_PYTHON``; ggml 0.25.3, commit 0c1e570), ``llama-quantize`` built with

    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=OFF \\
        -DCMAKE_C_FLAGS=-ffp-contract=off -DCMAKE_CXX_FLAGS=-ffp-contract=off -DLLAMA_CURL=OFF
    cmake --build build --target llama-quantize

(``-ffp-contract=off``: no multiply-adds fused into FMA, which would round differently; the
quantizers are ggml-base's plain C, built without ``-march``). Run, from the repository root::

    python tests/formats/make_llama_quantize_golden.py LLAMA_CPP_DIR [WORK_DIR]

with ``LLAMA_CPP_DIR`` the sdist's ``vendor/llama.cpp`` holding ``build/bin/llama-quantize``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from llama_quantize_cases import (  # noqa: E402
    PRE,
    facts,
    imatrix_entries,
    meta_sha,
    run_id,
    runs,
    source,
    write_imatrix,
)
from test_gguf import CONVERTER  # noqa: E402

GOLDEN = HERE / "llama_quantize_golden.json"
LLAMA_CPP = "llama-cpp-python 0.3.36 vendor/llama.cpp (ggml 0.25.3, commit 0c1e570)"
BUILD = "Release, GGML_NATIVE=OFF, static, C/CXX flags -ffp-contract=off, target llama-quantize"


def convert_16bit(llama_cpp: Path, hf: Path, out: Path, pre: str | None) -> None:
    """llama.cpp's converter, ``--outtype auto``, told the pre-tokenizer ``pre`` (``test_gguf.CONVERTER``)."""
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
    cmd = [sys.executable, "-c", CONVERTER, str(hf), pre or "", str(out), "auto"]
    subprocess.run(cmd, cwd=llama_cpp, env=env, check=True, capture_output=True, timeout=600)


def main(llama_cpp: Path, work: Path) -> None:
    binary = llama_cpp / "build" / "bin" / "llama-quantize"
    golden: dict[str, Any] = {"llama_cpp": LLAMA_CPP, "build": BUILD, "models": {}, "runs": {}, "data": {}}
    bases: dict[str, Path] = {}
    for model, ftype, opts in runs():
        if model not in bases:
            bases[model] = work / f"{model}-16.gguf"
            if not bases[model].exists():  # a WORK_DIR given again keeps them
                convert_16bit(llama_cpp, source(model, work), bases[model], PRE.get(model))
            base = facts(bases[model])
            golden["models"][model] = {"meta": base["meta"], "tensors": base["tensors"]}
            golden["data"][model] = {}
            for name in ("IMATRIX.dat", "IMATRIX.gguf"):
                write_imatrix(work / f"{model}-{name}", imatrix_entries(base["tensors"]))
        out = work / "out.gguf"
        args = [a if not a.startswith("IMATRIX.") else f"{model}-{a}" for a in opts]
        res = subprocess.run(
            [str(binary), *args, str(bases[model]), str(out), ftype, "1"],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if res.returncode != 0:
            raise SystemExit(f"{run_id(model, ftype, opts)}: {res.stderr[-2000:]}")
        got = facts(out)
        known = golden["models"][model]
        order = [n for n, _, _ in got["tensors"]]
        known.setdefault("order", order)
        assert known["order"] == order, run_id(model, ftype, opts)
        keys = {json.dumps(m) for m in known["meta"]}
        imatrix = next((a for a in args if a.endswith((".dat", ".gguf"))), "")
        for (name, kind, _), sha in zip(got["tensors"], got["data"].values(), strict=True):
            key = f"{name} {kind} {imatrix}".strip()
            assert golden["data"][model].setdefault(key, sha) == sha, key
        golden["runs"][run_id(model, ftype, opts)] = {
            "types": [kind for _, kind, _ in got["tensors"]],
            "meta": meta_sha(got["meta"]),
            "new_meta": [m for m in got["meta"] if json.dumps(m) not in keys],
        }
        print(run_id(model, ftype, opts), flush=True)
    GOLDEN.write_text(json.dumps(golden, indent=0, sort_keys=False) + "\n")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        raise SystemExit(__doc__)
    with tempfile.TemporaryDirectory() as tmp:
        main(Path(sys.argv[1]).resolve(), Path(sys.argv[2] if len(sys.argv) == 3 else tmp).resolve())
