"""Bad inputs through the real CLI: exit 1 (2 for bad usage), one clear line, nothing touched.

Every case builds a broken copy of a fixture and runs ``python -m ckptkit`` on it. For each
it checks the CLI contract (``shared/CLI.md``): the return code; stderr is exactly one
non-empty line naming the offending file and the problem, with no traceback anywhere; the
source is byte-identical afterwards; the destination is absent and no
``.<dst>.*.ckptkit-tmp`` directory is left beside it.

A CLI process costs 1-3 s (mostly importing torch), so the cases run in a thread pool as
soon as the first one is asked for; each test then waits for its own. Follow-ups that only
need the library (``--force`` then works, ``--model-type`` then works) run in-process.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptkit.convert import convert
from ckptkit.errors import CkptkitError

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
LLAMA2_SHARDS = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
INDEX = "model.safetensors.index.json"


# --- building broken checkpoints -------------------------------------------------------


def copy_fixture(rel: str, dest: Path) -> Path:
    """A private copy of ``fixtures/<rel>`` at ``dest``."""
    shutil.copytree(FIXTURES / rel, dest)
    return dest


def edit_json(path: Path, **changes: object) -> None:
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc, indent=2))


def edit_index(root: Path, edit: Callable[[dict[str, str]], None]) -> None:
    doc = json.loads((root / INDEX).read_text())
    edit(doc["weight_map"])
    (root / INDEX).write_text(json.dumps(doc, indent=2))


def edit_shard(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Rewrite a safetensors shard through the library after ``edit`` changed its tensors."""
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def truncate(path: Path, size: int) -> None:
    with path.open("r+b") as f:
        f.truncate(size)


def header_length(path: Path) -> int:
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


class Evil:
    """Unpickling this runs ``os.system``: weights_only=True must refuse before it does."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch '{self.marker}'",)


# --- the CLI ---------------------------------------------------------------------------


def run_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckptkit", *map(str, args)], capture_output=True, text=True, timeout=120
    )


def snapshot(root: Path | None) -> dict[str, str | None]:
    """Every path under ``root`` with the sha256 of its bytes (None for directories)."""
    if root is None or not root.exists():
        return {}
    if root.is_file():
        return {root.name: hashlib.sha256(root.read_bytes()).hexdigest()}
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


def leftovers(dst: Path) -> list[Path]:
    return sorted(dst.parent.glob("*.ckptkit-tmp")) if dst.parent.exists() else []


def one_line(stderr: str) -> str:
    """The single error line, or an assertion that shows everything that was printed."""
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"expected one line on stderr, got {len(lines)}:\n{stderr}"
    return lines[0]


# --- the cases -------------------------------------------------------------------------


@dataclass
class Case:
    """One CLI run on a broken input and what it must print."""

    args: list[str | Path]
    phrases: tuple[str, ...]  # each must appear in the one stderr line
    src: Path | None = None  # must be byte-identical after the run
    dst: Path | None = None  # must be absent afterwards (and no temp dir beside it)
    code: int = 1
    keep: Path | None = None  # must exist and be byte-identical after the run (a refused DST)


CASES: dict[str, Callable[[Path], Case]] = {}


def case(name: str) -> Callable[[Callable[[Path], Case]], Callable[[Path], Case]]:
    def register(build: Callable[[Path], Case]) -> Callable[[Path], Case]:
        CASES[name] = build
        return build

    return register


def to_hf(src: Path, tmp: Path, *phrases: str) -> Case:
    """``convert SRC DST --to hf`` (Meta sources) or ``--to meta`` (HF sources) must fail."""
    dst = tmp / "out"
    to = "hf" if (src / "params.json").exists() else "meta"
    return Case(["convert", src, dst, "--to", to], phrases, src, dst)


# safetensors damage ------------------------------------------------------------------


@case("truncated-shard")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    shard = src / LLAMA2_SHARDS[1]
    truncate(shard, shard.stat().st_size // 2)
    return to_hf(src, tmp, LLAMA2_SHARDS[1], "truncated")


@case("truncated-in-header")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    truncate(src / LLAMA2_SHARDS[0], 8 + header_length(src / LLAMA2_SHARDS[0]) // 2)
    return to_hf(src, tmp, LLAMA2_SHARDS[0], "truncated or corrupt safetensors header")


@case("truncated-before-header-length")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    truncate(src / LLAMA2_SHARDS[0], 5)
    return to_hf(src, tmp, LLAMA2_SHARDS[0], "not a safetensors file")


@case("garbage-header-json")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    shard = src / LLAMA2_SHARDS[2]
    data = bytearray(shard.read_bytes())
    n = header_length(shard)
    data[8 : 8 + n] = b"{nonsense" + b"\xff" * (n - 9)
    shard.write_bytes(bytes(data))
    return to_hf(src, tmp, LLAMA2_SHARDS[2], "corrupt safetensors header")


@case("header-length-past-eof")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    shard = src / LLAMA2_SHARDS[3]
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", len(data) * 2)
    shard.write_bytes(bytes(data))
    return to_hf(src, tmp, LLAMA2_SHARDS[3], "header length")


@case("header-length-huge")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    shard = src / LLAMA2_SHARDS[3]
    data = bytearray(shard.read_bytes())
    data[:8] = b"\xff" * 8
    shard.write_bytes(bytes(data))
    return to_hf(src, tmp, LLAMA2_SHARDS[3], "header length")


# index vs shards ---------------------------------------------------------------------


@case("index-names-missing-shard")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    (src / LLAMA2_SHARDS[2]).unlink()
    return to_hf(src, tmp, INDEX, LLAMA2_SHARDS[2], "does not exist")


@case("index-misses-tensor")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    edit_index(src, lambda wm: wm.pop("model.norm.weight"))
    return to_hf(src, tmp, INDEX, "does not list tensor 'model.norm.weight'")


@case("index-lists-absent-tensor")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    edit_index(src, lambda wm: wm.update({"model.layers.0.mlp.extra.weight": LLAMA2_SHARDS[0]}))
    return to_hf(src, tmp, INDEX, "model.layers.0.mlp.extra.weight", "does not hold it")


@case("index-wrong-shard")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    edit_index(src, lambda wm: wm.update({"model.norm.weight": LLAMA2_SHARDS[0]}))
    return to_hf(src, tmp, INDEX, "model.norm.weight", LLAMA2_SHARDS[2])


@case("index-garbage-json")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    (src / INDEX).write_text('{"weight_map": {')
    return to_hf(src, tmp, INDEX, "invalid JSON")


# config vs tensors -------------------------------------------------------------------


for _field, _value in (("hidden_size", 128), ("intermediate_size", 256), ("vocab_size", 500)):

    @case(f"config-{_field}")
    def _(tmp: Path, field: str = _field, value: int = _value) -> Case:
        src = copy_fixture("hf/llama2", tmp / "src")
        edit_json(src / "config.json", **{field: value})
        return to_hf(src, tmp, "config.json", "contradicts the tensor shapes")


@case("config-heads-gqa")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama3", tmp / "src")  # 4 query heads, 2 kv heads, head_dim 16
    edit_json(src / "config.json", num_attention_heads=8)
    return to_hf(src, tmp, "config.json", "q_proj", "contradicts the tensor shapes")


@case("config-kv-heads-gqa")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama3", tmp / "src")
    edit_json(src / "config.json", num_key_value_heads=4)
    return to_hf(src, tmp, "config.json", "k_proj", "contradicts the tensor shapes")


@case("config-missing-field")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    doc = json.loads((src / "config.json").read_text())
    del doc["num_hidden_layers"]
    (src / "config.json").write_text(json.dumps(doc))
    return to_hf(src, tmp, "config.json", "num_hidden_layers")


@case("config-garbage-json")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    (src / "config.json").write_text("{ not json")
    return to_hf(src, tmp, "config.json", "invalid JSON")


@case("params-multiple-of")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    edit_json(src / "params.json", multiple_of=256)
    return to_hf(src, tmp, "params.json", "multiple_of 256", "w1")


@case("params-vocab-size")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama3", tmp / "src")
    edit_json(src / "params.json", vocab_size=500)
    return to_hf(src, tmp, "params.json", "vocab_size 500", "tok_embeddings")


@case("params-missing-dim")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    doc = json.loads((src / "params.json").read_text())
    del doc["dim"]
    (src / "params.json").write_text(json.dumps(doc))
    return to_hf(src, tmp, "params.json", "dim")


# tensor names ------------------------------------------------------------------------


@case("unknown-tensor")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    name = "model.layers.0.mlp.extra.weight"
    edit_shard(src / LLAMA2_SHARDS[1], lambda t: t.update({name: torch.zeros(4, 4, dtype=torch.bfloat16)}))
    edit_index(src, lambda wm: wm.update({name: LLAMA2_SHARDS[1]}))
    return to_hf(src, tmp, LLAMA2_SHARDS[1], "unknown tensor name", name)


@case("missing-tensor")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    name = "model.layers.1.mlp.up_proj.weight"
    edit_shard(src / LLAMA2_SHARDS[2], lambda t: t.pop(name))
    edit_index(src, lambda wm: wm.pop(name))
    return to_hf(src, tmp, "src", name, "missing")


@case("meta-missing-tensor")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    path = src / "consolidated.00.pth"
    state = torch.load(path, weights_only=True)
    del state["layers.1.attention.wk.weight"]
    torch.save(state, path)
    return to_hf(src, tmp, "src", "layers.1.attention.wk.weight", "missing")


@case("meta-rank-mismatch")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2-2rank", tmp / "src")
    path = src / "consolidated.01.pth"
    state = torch.load(path, weights_only=True)
    del state["norm.weight"]
    torch.save(state, path)
    return to_hf(src, tmp, "consolidated.01.pth", "norm.weight")


@case("tied-copy-differs")
def _(tmp: Path) -> Case:
    """A tied model whose stored lm_head differs: found while writing, so DST must vanish."""
    src = copy_fixture("hf-bin/qwen2", tmp / "src")
    path = src / "pytorch_model.bin"
    state = torch.load(path, weights_only=True)
    state["lm_head.weight"] = state["model.embed_tokens.weight"] + 1
    torch.save(state, path)
    dst = tmp / "out"
    return Case(["convert", src, dst, "--to", "hf"], ("src", "lm_head.weight", "differs"), src, dst)


# pickles -----------------------------------------------------------------------------


@case("pth-needs-unpickler")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    torch.save({"x": torch.nn.Linear(2, 2)}, src / "consolidated.00.pth")
    return to_hf(src, tmp, "consolidated.00.pth", "refusing to load", "weights_only")


@case("pth-malicious")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    torch.save({"x": Evil(tmp / "pwned")}, src / "consolidated.00.pth")
    return to_hf(src, tmp, "consolidated.00.pth", "refusing to load", "system")


@case("bin-malicious")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf-bin/qwen2", tmp / "src")
    torch.save({"x": Evil(tmp / "pwned")}, src / "pytorch_model.bin")
    dst = tmp / "out"
    return Case(["convert", src, dst, "--to", "hf"], ("pytorch_model.bin", "refusing to load"), src, dst)


@case("pth-garbage")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    (src / "consolidated.00.pth").write_bytes(b"\x00garbage\xff" * 1000)
    return to_hf(src, tmp, "consolidated.00.pth", "torch checkpoint")


@case("pth-truncated")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    path = src / "consolidated.00.pth"
    truncate(path, path.stat().st_size // 2)
    return to_hf(src, tmp, "consolidated.00.pth", "torch checkpoint")


@case("bin-garbage")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf-bin/llama2", tmp / "src")
    (src / "pytorch_model-00002-of-00002.bin").write_bytes(os.urandom(4096))
    dst = tmp / "out"
    return Case(["convert", src, dst, "--to", "hf"], ("pytorch_model-00002-of-00002.bin", "torch checkpoint"), src, dst)


@case("bin-not-a-state-dict")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf-bin/qwen2", tmp / "src")
    torch.save([torch.zeros(2)], src / "pytorch_model.bin")
    dst = tmp / "out"
    return Case(["convert", src, dst, "--to", "hf"], ("pytorch_model.bin", "state dict"), src, dst)


# what SRC is -------------------------------------------------------------------------


@case("empty-dir")
def _(tmp: Path) -> Case:
    (src := tmp / "src").mkdir()
    return Case(["convert", src, tmp / "out", "--to", "hf"], ("src", "empty"), src, tmp / "out")


@case("readme-only")
def _(tmp: Path) -> Case:
    (src := tmp / "src").mkdir()
    (src / "README.md").write_text("# not a model\n")
    return Case(["convert", src, tmp / "out", "--to", "hf"], ("src", "not a recognised checkpoint"), src, tmp / "out")


@case("nonexistent")
def _(tmp: Path) -> Case:
    return Case(["convert", tmp / "nope", tmp / "out", "--to", "hf"], ("nope", "no such file"), None, tmp / "out")


@case("file-as-src")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    return Case(
        ["convert", src / "consolidated.00.pth", tmp / "out", "--to", "hf"],
        ("consolidated.00.pth", "directory"), src, tmp / "out",
    )


@case("from-wrong-format")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    return Case(["convert", src, tmp / "out", "--to", "hf", "--from", "meta"], ("src", "not a Meta checkpoint"), src, tmp / "out")


@case("unknown-model-type")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    edit_json(src / "config.json", model_type="mamba")
    return to_hf(src, tmp, "config.json", "unsupported model_type 'mamba'")


def ambiguous_rope(tmp: Path) -> Path:
    src = copy_fixture("hf/llama2", tmp / "src")
    edit_json(src / "config.json", rope_parameters={"rope_theta": 12345.0, "rope_type": "default"})
    return src


@case("ambiguous-rope")
def _(tmp: Path) -> Case:
    return to_hf(ambiguous_rope(tmp), tmp, "config.json", "--model-type")


# what DST is -------------------------------------------------------------------------


@case("dst-inside-src")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    return Case(["convert", src, src / "out", "--to", "meta"], ("out", "inside"), src, src / "out")


@case("dst-is-src")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    return Case(["convert", src, src, "--to", "meta", "--force"], ("src", "may not be the source"), src)


def nonempty_dst(tmp: Path) -> tuple[Path, Path]:
    src = copy_fixture("meta/llama2", tmp / "src")
    (dst := tmp / "out").mkdir()
    (dst / "keep.txt").write_text("mine\n")
    return src, dst


@case("dst-not-empty")
def _(tmp: Path) -> Case:
    src, dst = nonempty_dst(tmp)
    return Case(["convert", src, dst, "--to", "hf"], ("out", "not empty", "--force"), src, keep=dst)


@case("dst-is-file")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    (dst := tmp / "out").write_text("a file\n")
    return Case(["convert", src, dst, "--to", "hf", "--force"], ("out", "not a directory"), src, keep=dst)


@case("src-inside-dst-force")
def _(tmp: Path) -> Case:
    outer = tmp / "outer"
    src = copy_fixture("meta/llama2", outer / "src")
    return Case(["convert", src, outer, "--to", "hf", "--force"], ("outer", "contains the source"), src, keep=outer)


# unsupported conversions and bad flags ------------------------------------------------


for _family in ("qwen2", "gemma", "phi3"):

    @case(f"no-meta-layout-{_family}")
    def _(tmp: Path, family: str = _family) -> Case:
        src = copy_fixture(f"hf/{family}", tmp / "src")
        return to_hf(src, tmp, "src", family, "no Meta layout")


@case("shards-not-dividing")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    dst = tmp / "out"
    return Case(["convert", src, dst, "--to", "meta", "--shards", "3"], ("--shards 3", "not divisible"), src, dst)


@case("shards-to-hf")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    dst = tmp / "out"
    return Case(["convert", src, dst, "--to", "hf", "--shards", "2"], ("--shards", "--to meta"), src, dst)


@case("shards-zero")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    dst = tmp / "out"
    return Case(["convert", src, dst, "--to", "meta", "--shards", "0"], ("--shards",), src, dst)


@case("bad-max-shard-size")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    dst = tmp / "out"
    return Case(["convert", src, dst, "--to", "hf", "--max-shard-size", "lots"], ("--max-shard-size",), src, dst)


@case("bad-dtype")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    dst = tmp / "out"
    return Case(["convert", src, dst, "--to", "hf", "--dtype", "int3"], ("--dtype", "int3"), src, dst, code=2)


@case("bad-to")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    dst = tmp / "out"
    return Case(["convert", src, dst, "--to", "gguf"], ("--to", "gguf"), src, dst, code=2)


# inspect and verify ------------------------------------------------------------------


@case("inspect-truncated-file")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    shard = src / LLAMA2_SHARDS[1]
    truncate(shard, shard.stat().st_size // 2)
    return Case(["inspect", shard], (LLAMA2_SHARDS[1], "truncated"), src)


@case("inspect-truncated-dir")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    truncate(src / LLAMA2_SHARDS[0], 8 + header_length(src / LLAMA2_SHARDS[0]) // 2)
    return Case(["inspect", src, "--json"], (LLAMA2_SHARDS[0], "header"), src)


@case("inspect-index-missing-shard")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    (src / LLAMA2_SHARDS[3]).unlink()
    return Case(["inspect", src / INDEX], (INDEX, LLAMA2_SHARDS[3], "does not exist"), src)


@case("inspect-garbage-bin")
def _(tmp: Path) -> Case:
    (src := tmp / "src").mkdir()
    (src / "pytorch_model.bin").write_bytes(b"not a pickle at all")
    return Case(["inspect", src / "pytorch_model.bin"], ("pytorch_model.bin", "torch checkpoint"), src)


@case("inspect-malicious-pth")
def _(tmp: Path) -> Case:
    (src := tmp / "src").mkdir()
    torch.save({"x": Evil(tmp / "pwned")}, src / "consolidated.00.pth")
    return Case(["inspect", src / "consolidated.00.pth"], ("consolidated.00.pth", "refusing to load"), src)


@case("inspect-unrecognised")
def _(tmp: Path) -> Case:
    (src := tmp / "src").mkdir()
    (src / "README.md").write_text("# hello\n")
    return Case(["inspect", src], ("src", "not a recognised checkpoint"), src)


@case("inspect-nonexistent")
def _(tmp: Path) -> Case:
    return Case(["inspect", tmp / "nope.safetensors"], ("nope.safetensors", "no such file"))


@case("inspect-wrong-suffix")
def _(tmp: Path) -> Case:
    (src := tmp / "src").mkdir()
    (src / "notes.txt").write_text("hi\n")
    return Case(["inspect", src / "notes.txt"], ("notes.txt", "not a weight file"), src)


@case("verify-bad-b")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    shard = src / LLAMA2_SHARDS[1]
    truncate(shard, shard.stat().st_size - 10)
    return Case(["verify", FIXTURES / "hf/llama2", src], (LLAMA2_SHARDS[1], "truncated"), src)


@case("verify-bad-a")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    edit_json(src / "params.json", multiple_of=256)
    return Case(["verify", src, FIXTURES / "hf/llama2"], ("params.json", "multiple_of 256"), src)


@case("verify-nonexistent")
def _(tmp: Path) -> Case:
    return Case(["verify", FIXTURES / "hf/llama2", tmp / "nope"], ("nope", "no such file"))


# --- running them ----------------------------------------------------------------------


@dataclass
class Outcome:
    tmp: Path
    case: Case
    proc: subprocess.CompletedProcess[str]
    before: dict[str, str | None]
    after: dict[str, str | None]
    kept_before: dict[str, str | None]
    kept_after: dict[str, str | None]


def run_case(name: str, tmp: Path) -> Outcome:
    c = CASES[name](tmp)
    before, kept_before = snapshot(c.src), snapshot(c.keep)
    proc = run_cli(*c.args)
    return Outcome(tmp, c, proc, before, snapshot(c.src), kept_before, snapshot(c.keep))


@pytest.fixture(scope="module")
def outcome_of(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """``outcome_of(name)``: the run of case ``name``; every selected case starts at once."""
    selected = [
        item.callspec.params["name"]
        for item in request.session.items
        if item.module is request.module and "name" in getattr(getattr(item, "callspec", None), "params", {})
    ]
    futures: dict[str, Future[Outcome]] = {}
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:

        def get(name: str) -> Outcome:
            if not futures:
                for n in dict.fromkeys([name, *selected]):
                    futures[n] = pool.submit(run_case, n, tmp_path_factory.mktemp(n))
            return futures[name].result()

        yield get


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name: str, outcome_of: Callable[[str], Outcome]) -> None:
    o = outcome_of(name)
    c, proc = o.case, o.proc
    shown = f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stdout + proc.stderr, shown
    assert proc.returncode == c.code, shown
    if c.code == 1:
        line = one_line(proc.stderr)
        for phrase in c.phrases:
            assert phrase in line, f"{phrase!r} not in {line!r}"
    else:  # usage errors: typer's own message, which names the option and the bad value
        for phrase in c.phrases:
            assert phrase in proc.stderr, shown
    assert o.after == o.before, "the source changed"
    assert o.kept_after == o.kept_before, "a refused destination changed"
    if c.dst is not None:
        assert not c.dst.exists(), f"{c.dst} was created"
        assert not leftovers(c.dst), f"temporary directories left: {leftovers(c.dst)}"
    assert not (o.tmp / "pwned").exists(), "the malicious pickle ran its payload"


def test_malicious_pickle_is_live(tmp_path: Path) -> None:
    """The payload the cases above refuse does run when loaded without weights_only."""
    torch.save({"x": Evil(tmp_path / "pwned")}, tmp_path / "evil.pth")
    torch.load(tmp_path / "evil.pth", weights_only=False)
    assert (tmp_path / "pwned").exists()


# --- follow-ups in-process -------------------------------------------------------------


def test_force_replaces_nonempty_destination(tmp_path: Path) -> None:
    src, dst = nonempty_dst(tmp_path)
    with pytest.raises(CkptkitError, match="not empty"):
        convert(src, dst, "hf")
    assert (dst / "keep.txt").read_text() == "mine\n"
    convert(src, dst, "hf", force=True)
    assert not (dst / "keep.txt").exists()
    assert (dst / "config.json").is_file() and (dst / "model.safetensors").is_file()
    assert not leftovers(dst)


def test_model_type_resolves_ambiguous_rope(tmp_path: Path) -> None:
    src = ambiguous_rope(tmp_path)
    before = snapshot(src)
    with pytest.raises(CkptkitError, match="--model-type"):
        convert(src, tmp_path / "out", "meta")
    convert(src, tmp_path / "out", "meta", model_type="llama2")
    assert json.loads((tmp_path / "out" / "params.json").read_text())["rope_theta"] == 12345.0
    assert snapshot(src) == before


def test_verify_lists_differing_tensor(tmp_path: Path) -> None:
    src = copy_fixture("hf/llama2", tmp_path / "b")

    def bump(t: dict[str, torch.Tensor]) -> None:
        t["model.norm.weight"] = t["model.norm.weight"] + 0.5

    edit_shard(src / LLAMA2_SHARDS[2], bump)
    before = snapshot(src)
    proc = run_cli("verify", FIXTURES / "hf/llama2", src)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    differs = [line for line in proc.stdout.splitlines() if line.startswith("differs:")]
    assert differs == ["differs: norm.scale: max abs diff 0.5"], proc.stdout
    assert "DIFFERENT" in proc.stdout
    assert snapshot(src) == before
