"""Bad inputs through the CLI: exit 1 (2 for bad usage), one clear line, nothing touched.

Every case builds a broken copy of a fixture in a temporary directory and runs the ``ckptkit``
command line on it. For each it checks the contract of ``docs/cli.md``: the return code;
stderr is exactly one non-empty line naming the offending file and the problem; no
traceback anywhere; the source is byte-identical afterwards; the destination is absent and
nothing (no ``.<dst>.*`` temporary folder or lock file) is left beside it.

A ``python -m ckptkit`` process spends 1-3 s importing torch, too slow for ~80 cases. So
one driver process imports ckptkit once and forks a child per case that runs the same entry
point as ``python -m ckptkit`` (``ckptkit.cli.app``) with its stdout and stderr on files;
an uncaught exception prints its traceback and exits 1 as the interpreter would. A few
cases also run as genuine ``python -m ckptkit`` processes, which would catch anything
printed while importing. Follow-ups that need the library only run in-process.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError

from conftest import FIXTURES

LLAMA2_SHARDS = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
INDEX = "model.safetensors.index.json"


# --- building broken checkpoints -------------------------------------------------------


def copy_fixture(rel: str, dest: Path) -> Path:
    """A private copy of ``fixtures/<rel>`` at ``dest``."""
    shutil.copytree(FIXTURES / rel, dest)
    return dest


def edit_json(path: Path, drop: tuple[str, ...] = (), **changes: object) -> None:
    doc = json.loads(path.read_text())
    doc.update(changes)
    for key in drop:
        del doc[key]
    path.write_text(json.dumps(doc, indent=2))


def edit_index(root: Path, edit: Callable[[dict[str, str]], object]) -> None:
    doc = json.loads((root / INDEX).read_text())
    edit(doc["weight_map"])
    (root / INDEX).write_text(json.dumps(doc, indent=2))


def edit_shard(path: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    """Rewrite a safetensors file through the library after ``edit`` changed its tensors."""
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def edit_pickle(path: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)


def truncate(path: Path, size: int) -> None:
    with path.open("r+b") as f:
        f.truncate(size)


def header_length(path: Path) -> int:
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


def set_header_length(path: Path, n: int) -> None:
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", n)
    path.write_bytes(bytes(data))


class Evil:
    """Unpickling this runs ``os.system``: weights_only=True must refuse before it does."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch '{self.marker}'",)


# --- looking at the result -------------------------------------------------------------


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
    """Anything a writer of ``dst`` put beside it (temporary folders, the lock file)."""
    return sorted(dst.parent.glob(f".{dst.name}.*")) if dst.parent.exists() else []


def run_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """``python -m ckptkit ARGS`` as a user would run it."""
    return subprocess.run(
        [sys.executable, "-m", "ckptkit", *map(str, args)], capture_output=True, text=True, timeout=300
    )


# --- the cases -------------------------------------------------------------------------


@dataclass
class Case:
    """One CLI run on a broken input and what it must print."""

    args: list[str | Path]
    phrases: tuple[str, ...]  # each must appear in the one stderr line
    src: Path | None = None  # must be byte-identical after the run
    dst: Path | None = None  # must be absent afterwards, with no temp dir beside it
    code: int = 1
    keep: Path | None = None  # a refused DST: must be byte-identical after the run
    unsaid: tuple[str, ...] = field(default_factory=tuple)  # must not appear (misleading)


CASES: dict[str, Callable[[Path], Case]] = {}


def case(name: str) -> Callable[[Callable[[Path], Case]], Callable[[Path], Case]]:
    """Register a builder: given an empty directory, it makes the broken input and the Case."""

    def register(build: Callable[[Path], Case]) -> Callable[[Path], Case]:
        assert name not in CASES, name
        CASES[name] = build
        return build

    return register


def converting(src: Path, tmp: Path, *phrases: str, to: str | None = None, **kw: object) -> Case:
    """``convert SRC TMP/out`` to the other family of formats (hf for Meta sources, else meta)."""
    dst = tmp / "out"
    to = to or ("hf" if (src / "params.json").exists() else "meta")
    return Case(["convert", src, dst, "--to", to], phrases, src, dst, **kw)  # type: ignore[arg-type]


def llama2_hf(tmp: Path) -> Path:
    return copy_fixture("hf/llama2", tmp / "src")


# safetensors damage


@case("truncated-shard")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    shard = src / LLAMA2_SHARDS[1]
    truncate(shard, shard.stat().st_size // 2)
    return converting(src, tmp, LLAMA2_SHARDS[1], "truncated")


@case("truncated-shard-last-byte")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    shard = src / LLAMA2_SHARDS[3]
    truncate(shard, shard.stat().st_size - 1)
    return converting(src, tmp, LLAMA2_SHARDS[3], "truncated")


@case("truncated-in-header")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    truncate(src / LLAMA2_SHARDS[0], 8 + header_length(src / LLAMA2_SHARDS[0]) // 2)
    return converting(src, tmp, LLAMA2_SHARDS[0], "truncated or corrupt safetensors header")


@case("truncated-in-header-length")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    truncate(src / LLAMA2_SHARDS[0], 5)
    return converting(src, tmp, LLAMA2_SHARDS[0], "not a safetensors file")


@case("header-garbage-json")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    shard = src / LLAMA2_SHARDS[2]
    data = bytearray(shard.read_bytes())
    n = header_length(shard)
    data[8 : 8 + n] = b"{nonsense" + b"\xff" * (n - 9)
    shard.write_bytes(bytes(data))
    return converting(src, tmp, LLAMA2_SHARDS[2], "corrupt safetensors header")


@case("header-not-an-object")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    shard = src / LLAMA2_SHARDS[2]
    data = bytearray(shard.read_bytes())
    n = header_length(shard)
    data[8 : 8 + n] = b"[1, 2]".ljust(n)
    shard.write_bytes(bytes(data))
    return converting(src, tmp, LLAMA2_SHARDS[2], "corrupt safetensors header")


@case("header-bad-entry")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    shard = src / LLAMA2_SHARDS[2]
    data = shard.read_bytes()
    n = header_length(shard)
    header = json.loads(data[8 : 8 + n])
    header["model.norm.weight"]["dtype"] = "F13"
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(raw) == n
    shard.write_bytes(data[:8] + raw + data[8 + n :])
    return converting(src, tmp, LLAMA2_SHARDS[2], "model.norm.weight", "corrupt")


@case("header-length-past-eof")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    shard = src / LLAMA2_SHARDS[3]
    set_header_length(shard, shard.stat().st_size * 2)
    return converting(src, tmp, LLAMA2_SHARDS[3], "header length")


@case("header-length-huge")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    set_header_length(src / LLAMA2_SHARDS[3], 2**64 - 1)
    return converting(src, tmp, LLAMA2_SHARDS[3], "header length")


# index vs shards


@case("index-names-missing-shard")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    (src / LLAMA2_SHARDS[2]).unlink()
    return converting(src, tmp, INDEX, LLAMA2_SHARDS[2], "does not exist")


@case("index-misses-tensor")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    edit_index(src, lambda wm: wm.pop("model.norm.weight"))
    return converting(src, tmp, INDEX, "does not list tensor 'model.norm.weight'", LLAMA2_SHARDS[2])


@case("index-lists-absent-tensor")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    edit_index(src, lambda wm: wm.update({"model.layers.0.mlp.extra.weight": LLAMA2_SHARDS[0]}))
    return converting(src, tmp, INDEX, "model.layers.0.mlp.extra.weight", "does not hold it")


@case("index-wrong-shard")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    edit_index(src, lambda wm: wm.update({"model.norm.weight": LLAMA2_SHARDS[0]}))
    return converting(src, tmp, INDEX, "model.norm.weight", LLAMA2_SHARDS[2])


@case("index-garbage-json")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    (src / INDEX).write_text('{"weight_map": {')
    return converting(src, tmp, INDEX, "invalid JSON")


@case("index-without-weight-map")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    (src / INDEX).write_text('{"metadata": {}}')
    return converting(src, tmp, INDEX, "weight_map")


@case("shards-without-index")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    (src / INDEX).unlink()
    return converting(src, tmp, "src", INDEX)


# config vs tensors

for _field, _value, _tensor in (
    ("hidden_size", 128, "tok_embeddings"),
    ("intermediate_size", 256, "mlp.w1"),
    ("vocab_size", 500, "tok_embeddings"),
    ("num_hidden_layers", 3, "layers.2"),
    ("head_dim", 8, "q_proj"),
):

    @case(f"config-{_field}")
    def _(tmp: Path, field: str = _field, value: int = _value, tensor: str = _tensor) -> Case:
        src = llama2_hf(tmp)
        edit_json(src / "config.json", **{field: value})
        return converting(src, tmp, "config.json" if field != "num_hidden_layers" else "src", tensor)


@case("config-heads-gqa")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama3", tmp / "src")  # 4 query heads, 2 kv heads, head_dim 16
    edit_json(src / "config.json", num_attention_heads=8)
    return converting(src, tmp, "config.json", "q_proj", "contradicts the tensor shapes")


@case("config-kv-heads-gqa")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama3", tmp / "src")
    edit_json(src / "config.json", num_key_value_heads=4)
    return converting(src, tmp, "config.json", "k_proj", "contradicts the tensor shapes")


@case("config-heads-fused-qkv")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/phi3", tmp / "src")  # qkv_proj holds q, k and v stacked
    edit_json(src / "config.json", num_key_value_heads=1)
    return converting(src, tmp, "qkv_proj", "contradicts the tensor shapes", to="hf-bin")


@case("config-missing-field")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    edit_json(src / "config.json", drop=("num_attention_heads",))
    return converting(src, tmp, "config.json", "num_attention_heads")


@case("config-garbage-json")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    (src / "config.json").write_text("{ not json")
    return converting(src, tmp, "config.json", "invalid JSON")


@case("config-not-an-object")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    (src / "config.json").write_text("[]")
    return converting(src, tmp, "config.json", "JSON object")


@case("params-multiple-of")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    edit_json(src / "params.json", multiple_of=256)
    return converting(src, tmp, "params.json", "multiple_of 256", "w1")


@case("params-ffn-multiplier")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama3", tmp / "src")
    edit_json(src / "params.json", ffn_dim_multiplier=1.3)
    return converting(src, tmp, "params.json", "ffn_dim_multiplier 1.3", "w1")


@case("params-vocab-size")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama3", tmp / "src")
    edit_json(src / "params.json", vocab_size=500)
    return converting(src, tmp, "params.json", "vocab_size 500", "tok_embeddings")


@case("params-kv-heads-gqa")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama3", tmp / "src")  # 4 query heads, 2 kv heads
    edit_json(src / "params.json", n_kv_heads=4)
    return converting(src, tmp, "params.json", "consolidated.00.pth", "k_proj", "contradicts the tensor shapes")


@case("params-missing-field")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    edit_json(src / "params.json", drop=("n_heads",))
    return converting(src, tmp, "params.json", "n_heads")


@case("params-mistral-hidden-dim")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/mistral", tmp / "src")
    edit_json(src / "params.json", hidden_dim=256)
    return converting(src, tmp, "params.json", "hidden_dim 256")


# tensor names


@case("unknown-tensor")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    name = "model.layers.0.mlp.extra.weight"
    edit_shard(src / LLAMA2_SHARDS[1], lambda t: t.update({name: torch.zeros(4, 4, dtype=torch.bfloat16)}))
    edit_index(src, lambda wm: wm.update({name: LLAMA2_SHARDS[1]}))
    return converting(src, tmp, LLAMA2_SHARDS[1], "unknown tensor name", name)


@case("unknown-tensor-meta")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    edit_pickle(src / "consolidated.00.pth", lambda t: t.update({"adapter.weight": torch.zeros(2)}))
    return converting(src, tmp, "consolidated.00.pth", "unknown tensor name", "adapter.weight")


@case("missing-tensor")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    name = "model.layers.1.mlp.up_proj.weight"
    edit_shard(src / LLAMA2_SHARDS[2], lambda t: t.pop(name))
    edit_index(src, lambda wm: wm.pop(name))
    return converting(src, tmp, "src", name, "missing")


@case("missing-tensor-meta")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    edit_pickle(src / "consolidated.00.pth", lambda t: t.pop("layers.1.attention.wk.weight"))
    return converting(src, tmp, "src", "layers.1.attention.wk.weight", "missing")


@case("missing-tensor-bin")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf-bin/qwen2", tmp / "src")
    edit_pickle(src / "pytorch_model.bin", lambda t: t.pop("model.layers.0.self_attn.q_proj.bias"))
    return converting(src, tmp, "src", "q_proj.bias", "missing", to="hf")


@case("meta-rank-mismatch")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2-2rank", tmp / "src")
    edit_pickle(src / "consolidated.01.pth", lambda t: t.pop("norm.weight"))
    return converting(src, tmp, "consolidated.01.pth", "norm.weight")


@case("meta-rank-shape-mismatch")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2-2rank", tmp / "src")
    edit_pickle(src / "consolidated.01.pth", lambda t: t.update({"norm.weight": torch.zeros(3)}))
    return converting(src, tmp, "src", "norm.weight", "across ranks")


@case("meta-rank-gap")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2-2rank", tmp / "src")
    (src / "consolidated.00.pth").unlink()
    return converting(src, tmp, "src/consolidated.00.pth: missing", "up to consolidated.01.pth", "2 model-parallel")


@pytest.mark.parametrize("fixture", ["meta/llama2-2rank", "meta/mixtral-2rank"])
def test_a_missing_last_rank_file_is_named(fixture: str, tmp_path: Path) -> None:
    """params.json says nothing of ranks: the query projection's rows it gives tell how many."""
    src = copy_fixture(fixture, tmp_path / "src")
    (src / "consolidated.01.pth").unlink()
    with pytest.raises(CkptkitError) as caught:
        convert(src, tmp_path / "out", ConvertOptions("hf"))
    message = str(caught.value)
    assert message.startswith(f"{src / 'consolidated.01.pth'}: missing: ")
    assert message.endswith("so the checkpoint has 2 model-parallel ranks; copy every rank file")
    assert not (tmp_path / "out").exists()


@case("tied-copy-differs")
def _(tmp: Path) -> Case:
    """A tied model whose stored lm_head differs: found while writing, so DST must vanish."""
    src = copy_fixture("hf-bin/qwen2", tmp / "src")

    def untie(t: dict[str, torch.Tensor]) -> None:
        t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1

    edit_pickle(src / "pytorch_model.bin", untie)
    return converting(src, tmp, "src", "lm_head.weight", "differs", to="hf")


# pickles


@case("pth-needs-unpickler")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    torch.save({"x": torch.nn.Linear(2, 2)}, src / "consolidated.00.pth")
    return converting(src, tmp, "consolidated.00.pth", "refusing to load", "weights_only", "Linear")


@case("pth-malicious")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    torch.save({"x": Evil(tmp / "pwned")}, src / "consolidated.00.pth")
    return converting(src, tmp, "consolidated.00.pth", "refusing to load", "system")


@case("bin-malicious")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf-bin/qwen2", tmp / "src")
    torch.save({"x": Evil(tmp / "pwned")}, src / "pytorch_model.bin")
    return converting(src, tmp, "pytorch_model.bin", "refusing to load", "system", to="hf")


GARBAGE = {
    "random": random.Random(0).randbytes(4096),
    "text": b"this is not a checkpoint\n" * 40,
    "empty-pickle": b"\x80\x02.",  # a STOP with nothing on the stack
    "pickle-opcodes": b"\x80\x02]q\x00(K\x01e0.",
    "zip-magic": b"PK\x03\x04" + b"\x00" * 200,
    "empty": b"",
}

for _kind, _payload in GARBAGE.items():

    @case(f"pth-garbage-{_kind}")
    def _(tmp: Path, payload: bytes = _payload) -> Case:
        src = copy_fixture("meta/llama2", tmp / "src")
        (src / "consolidated.00.pth").write_bytes(payload)
        return converting(src, tmp, "consolidated.00.pth", "torch checkpoint", unsaid=("refusing",))


@case("bin-garbage")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf-bin/llama2", tmp / "src")
    (src / "pytorch_model-00002-of-00002.bin").write_bytes(GARBAGE["empty-pickle"])
    return converting(src, tmp, "pytorch_model-00002-of-00002.bin", "torch checkpoint", to="hf", unsaid=("refusing",))


@case("pth-truncated")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    path = src / "consolidated.00.pth"
    truncate(path, path.stat().st_size // 2)
    return converting(src, tmp, "consolidated.00.pth", "torch checkpoint")


@case("bin-not-a-state-dict")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf-bin/qwen2", tmp / "src")
    torch.save([torch.zeros(2)], src / "pytorch_model.bin")
    return converting(src, tmp, "pytorch_model.bin", "state dict", to="hf")


# internal format


def internal_copy(tmp: Path) -> Path:
    src = tmp / "src"
    convert(FIXTURES / "hf/llama2", src, ConvertOptions("internal"))
    return src


@case("internal-missing-weights")
def _(tmp: Path) -> Case:
    src = internal_copy(tmp)
    (src / "weights.safetensors").unlink()
    return converting(src, tmp, "ckptkit.json", "weights.safetensors", "does not exist", to="hf")


@case("internal-bad-version")
def _(tmp: Path) -> Case:
    src = internal_copy(tmp)
    edit_json(src / "ckptkit.json", version=99)
    return converting(src, tmp, "ckptkit.json", "version", to="hf")


@case("internal-truncated")
def _(tmp: Path) -> Case:
    src = internal_copy(tmp)
    path = src / "weights.safetensors"
    truncate(path, path.stat().st_size // 2)
    return converting(src, tmp, "weights.safetensors", "truncated", to="meta")


# what SRC is


@case("empty-dir")
def _(tmp: Path) -> Case:
    (src := tmp / "src").mkdir()
    return converting(src, tmp, "src", "empty", to="hf")


@case("readme-only")
def _(tmp: Path) -> Case:
    (src := tmp / "src").mkdir()
    (src / "README.md").write_text("# not a model\n")
    return converting(src, tmp, "src", "not a recognised checkpoint", to="hf")


@case("nonexistent")
def _(tmp: Path) -> Case:
    return Case(["convert", tmp / "nope", tmp / "out", "--to", "hf"], ("nope", "no such file"), None, tmp / "out")


@case("file-as-src")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    dst = tmp / "out"
    return Case(
        ["convert", src / "consolidated.00.pth", dst, "--to", "hf"], ("consolidated.00.pth", "directory"), src, dst
    )


@case("from-wrong-format")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    dst = tmp / "out"
    return Case(["convert", src, dst, "--to", "hf", "--from", "meta"], ("src", "not a Meta checkpoint"), src, dst)


@case("unknown-model-type")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    edit_json(src / "config.json", model_type="mamba")
    return converting(src, tmp, "config.json", "unsupported model_type 'mamba'")


def ambiguous_rope(tmp: Path) -> Path:
    src = llama2_hf(tmp)
    edit_json(src / "config.json", rope_parameters={"rope_theta": 12345.0, "rope_type": "default"})
    return src


@case("ambiguous-rope")
def _(tmp: Path) -> Case:
    return converting(ambiguous_rope(tmp), tmp, "config.json", "--model-type")


@case("ambiguous-rope-meta")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    edit_json(src / "params.json", rope_theta=12345.0)
    return converting(src, tmp, "params.json", "--model-type")


@case("meta-forced-to-hf-only-model-type")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    c = converting(src, tmp, "params.json", "qwen2", "no Meta layout")
    c.args += ["--model-type", "qwen2", "--force-model-type"]
    return c


@case("meta-model-type-contradicting-params")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    c = converting(src, tmp, "params.json", "describes a llama2 model, not qwen2", "--force-model-type")
    c.args += ["--model-type", "qwen2"]
    return c


# what DST is


@case("dst-inside-src")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    return Case(["convert", src, src / "out", "--to", "meta"], ("out", "inside"), src, src / "out")


@case("dst-is-src")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    return Case(["convert", src, src, "--to", "meta", "--force"], ("src", "may not be the source"), src, keep=src)


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


# unsupported conversions and bad flags

for _family in ("qwen2", "gemma", "phi3"):

    @case(f"no-meta-layout-{_family}")
    def _(tmp: Path, family: str = _family) -> Case:
        src = copy_fixture(f"hf/{family}", tmp / "src")
        return converting(src, tmp, "src", family, "no Meta layout; convert it to hf, hf-bin, internal or gguf")


@case("no-meta-layout-gemma4")  # the formats that write it: the support matrix's, not a list of the family's own
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/gemma4", tmp / "src")
    return converting(src, tmp, "gemma4 has no Meta layout; convert it to hf, hf-bin, internal, dcp, dcp-titan or gguf")


@case("no-dcp-layout-qwen2")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/qwen2", tmp / "src")
    return converting(src, tmp, "qwen2 has no Meta layout (which dcp writes); convert it to", to="dcp")


def with_flags(base: str, tmp: Path, phrases: tuple[str, ...], *flags: str, to: str, code: int = 1) -> Case:
    src = copy_fixture(base, tmp / "src")
    dst = tmp / "out"
    return Case(["convert", src, dst, "--to", to, *flags], phrases, src, dst, code=code)


@case("shards-not-dividing")
def _(tmp: Path) -> Case:
    return with_flags("hf/llama2", tmp, ("--shards 3", "not divisible"), "--shards", "3", to="meta")


@case("shards-to-hf")
def _(tmp: Path) -> Case:
    return with_flags("meta/llama2", tmp, ("--shards", "--to meta"), "--shards", "2", to="hf", code=2)


@case("shards-zero")
def _(tmp: Path) -> Case:
    return with_flags("meta/llama2", tmp, ("--shards", "at least 1"), "--shards", "0", to="meta", code=2)


@case("bad-max-shard-size")
def _(tmp: Path) -> Case:
    return with_flags("meta/llama2", tmp, ("--max-shard-size", "lots"), "--max-shard-size", "lots", to="hf", code=2)


@case("bad-dtype")
def _(tmp: Path) -> Case:
    return with_flags("meta/llama2", tmp, ("--dtype", "int3"), "--dtype", "int3", to="hf", code=2)


@case("bad-to")
def _(tmp: Path) -> Case:
    return with_flags("meta/llama2", tmp, ("--to", "ggml"), to="ggml", code=2)


@case("bad-from")
def _(tmp: Path) -> Case:
    return with_flags("meta/llama2", tmp, ("--from", "onnx"), "--from", "onnx", to="hf", code=2)


@case("bad-model-type")
def _(tmp: Path) -> Case:
    return with_flags("meta/llama2", tmp, ("--model-type", "llama9"), "--model-type", "llama9", to="hf", code=2)


@case("missing-to")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    return Case(["convert", src, tmp / "out"], ("--to",), src, tmp / "out", code=2)


# inspect and verify


@case("inspect-truncated-file")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    shard = src / LLAMA2_SHARDS[1]
    truncate(shard, shard.stat().st_size // 2)
    return Case(["inspect", shard], (LLAMA2_SHARDS[1], "truncated"), src)


@case("inspect-truncated-dir")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    truncate(src / LLAMA2_SHARDS[0], 8 + header_length(src / LLAMA2_SHARDS[0]) // 2)
    return Case(["inspect", src, "--json"], (LLAMA2_SHARDS[0], "header"), src)


@case("inspect-config-contradiction")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    edit_json(src / "config.json", intermediate_size=256)
    return Case(["inspect", src], ("config.json", "contradicts"), src)


@case("inspect-index-missing-shard")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    (src / LLAMA2_SHARDS[3]).unlink()
    return Case(["inspect", src / INDEX], (INDEX, LLAMA2_SHARDS[3], "does not exist"), src)


@case("inspect-garbage-bin")
def _(tmp: Path) -> Case:
    (src := tmp / "src").mkdir()
    (src / "pytorch_model.bin").write_bytes(GARBAGE["text"])
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
    src = llama2_hf(tmp)
    shard = src / LLAMA2_SHARDS[1]
    truncate(shard, shard.stat().st_size - 10)
    return Case(["verify", FIXTURES / "hf/llama2", src], (LLAMA2_SHARDS[1], "truncated"), src)


@case("verify-bad-a")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    edit_json(src / "params.json", multiple_of=256)
    return Case(["verify", src, FIXTURES / "hf/llama2"], ("params.json", "multiple_of 256"), src)


@case("verify-malicious")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    torch.save({"x": Evil(tmp / "pwned")}, src / "consolidated.00.pth")
    return Case(["verify", FIXTURES / "meta/llama2", src], ("consolidated.00.pth", "refusing to load"), src)


@case("verify-nonexistent")
def _(tmp: Path) -> Case:
    return Case(["verify", FIXTURES / "hf/llama2", tmp / "nope"], ("nope", "no such file"))


# --- running them ----------------------------------------------------------------------

# Imports ckptkit once, then runs each job in a forked child exactly as `python -m ckptkit`
# would (same entry point, stdout/stderr on files, tracebacks printed, exit code kept).
DRIVER = r"""
import json, os, sys, traceback
import ckptkit.cli, ckptkit.convert, ckptkit.inspection, ckptkit.verify

def child(job):
    for fd, name in ((1, job["stdout"]), (2, job["stderr"])):
        os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    try:
        ckptkit.cli.app(args=job["args"], prog_name="ckptkit")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

jobs = json.load(open(sys.argv[1]))
codes, running = {}, {}
for i, job in enumerate(jobs):
    if len(running) >= (os.cpu_count() or 2):
        pid, status = os.wait()
        codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        child(job)
    running[pid] = i
while running:
    pid, status = os.wait()
    codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
print(json.dumps([codes[i] for i in range(len(jobs))]))
"""


@dataclass
class Outcome:
    tmp: Path
    case: Case
    proc: subprocess.CompletedProcess[str]
    before: dict[str, str | None]
    kept_before: dict[str, str | None]


def run_in_driver(cases: dict[str, tuple[Path, Case]], logs: Path) -> dict[str, subprocess.CompletedProcess[str]]:
    jobs = [
        {"args": list(map(str, c.args)), "stdout": str(logs / f"{n}.out"), "stderr": str(logs / f"{n}.err")}
        for n, (_, c) in cases.items()
    ]
    (logs / "jobs.json").write_text(json.dumps(jobs))
    driver = subprocess.run(
        [sys.executable, "-c", DRIVER, str(logs / "jobs.json")], capture_output=True, text=True, timeout=600
    )
    assert driver.returncode == 0 and not driver.stderr, driver.stderr
    codes = json.loads(driver.stdout)
    return {
        n: subprocess.CompletedProcess(c.args, code, (logs / f"{n}.out").read_text(), (logs / f"{n}.err").read_text())
        for (n, (_, c)), code in zip(cases.items(), codes, strict=True)
    }


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    """Every selected case, built and run through one driver process."""
    names = [
        item.callspec.params["name"]
        for item in request.session.items
        if item.module is request.module and item.originalname == "test_bad_input"
    ]
    built = {}
    for name in names:
        tmp = tmp_path_factory.mktemp(name)
        built[name] = (tmp, CASES[name](tmp))
    before = {n: (snapshot(c.src), snapshot(c.keep)) for n, (_, c) in built.items()}
    procs = run_in_driver(built, tmp_path_factory.mktemp("logs"))
    return {n: Outcome(tmp, c, procs[n], *before[n]) for n, (tmp, c) in built.items()}


def check(o: Outcome) -> None:
    """Everything the contract promises for a failed command."""
    c, proc = o.case, o.proc
    shown = f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stdout + proc.stderr, shown
    assert proc.returncode == c.code, shown
    if c.code == 1:
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and lines[0].strip(), f"expected one line on stderr:\n{shown}"
        for phrase in c.phrases:
            assert phrase in lines[0], f"{phrase!r} not in {lines[0]!r}"
        for phrase in c.unsaid:
            assert phrase not in lines[0], f"{phrase!r} (misleading) in {lines[0]!r}"
    else:  # bad usage: one line that names the option (and the value)
        assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("error: "), shown
        for phrase in c.phrases:
            assert phrase in proc.stderr, shown
    assert snapshot(c.src) == o.before, "the source changed"
    assert snapshot(c.keep) == o.kept_before, "a refused destination changed"
    if c.dst is not None:
        assert not c.dst.exists(), f"{c.dst} was created"
    for dst in (c.dst, c.keep):
        assert dst is None or not leftovers(dst), f"temporary directories left: {leftovers(dst)}"
    assert not (o.tmp / "pwned").exists(), "the malicious pickle ran its payload"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the case driver forks")
@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name: str, outcomes: dict[str, Outcome]) -> None:
    check(outcomes[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["truncated-shard", "pth-malicious", "pth-garbage-empty-pickle", "dst-not-empty"])
def test_bad_input_real_process(name: str, tmp_path: Path) -> None:
    """The same checks on a genuine ``python -m ckptkit`` (imports included)."""
    c = CASES[name](tmp_path)
    before, kept_before = snapshot(c.src), snapshot(c.keep)
    check(Outcome(tmp_path, c, run_cli(*c.args), before, kept_before))


def test_malicious_pickle_is_live(tmp_path: Path) -> None:
    """The payload the cases refuse does run when loaded without weights_only."""
    torch.save({"x": Evil(tmp_path / "pwned")}, tmp_path / "evil.pth")
    torch.load(tmp_path / "evil.pth", weights_only=False)
    assert (tmp_path / "pwned").exists()


def test_undamaged_fixtures_convert(tmp_path: Path) -> None:
    """The undamaged fixtures the cases start from convert fine (sanity of the setup)."""
    for rel, to in (("hf/llama2", "meta"), ("meta/llama2", "hf"), ("hf-bin/qwen2", "hf"), ("hf/llama3", "meta")):
        convert(FIXTURES / rel, tmp_path / rel.replace("/", "-"), ConvertOptions(to))


# --- follow-ups ------------------------------------------------------------------------


def test_force_replaces_nonempty_destination(tmp_path: Path) -> None:
    src, dst = nonempty_dst(tmp_path)
    with pytest.raises(CkptkitError, match="not empty"):
        convert(src, dst, ConvertOptions("hf"))
    assert (dst / "keep.txt").read_text() == "mine\n"
    before = snapshot(src)
    convert(src, dst, ConvertOptions("hf", force=True))
    assert not (dst / "keep.txt").exists()
    assert (dst / "config.json").is_file() and (dst / "model.safetensors").is_file()
    assert not leftovers(dst)
    assert snapshot(src) == before


def test_model_type_resolves_ambiguous_rope(tmp_path: Path) -> None:
    src = ambiguous_rope(tmp_path)
    before = snapshot(src)
    with pytest.raises(CkptkitError, match="--model-type"):
        convert(src, tmp_path / "out", ConvertOptions("meta"))
    convert(src, tmp_path / "out", ConvertOptions("meta", model_type="llama2"))
    assert json.loads((tmp_path / "out" / "params.json").read_text())["rope_theta"] == 12345.0
    assert snapshot(src) == before


def test_verify_lists_differing_tensor(tmp_path: Path) -> None:
    src = copy_fixture("hf/llama2", tmp_path / "b")
    diff = {}

    def bump(t: dict[str, torch.Tensor]) -> None:
        old = t["model.norm.weight"]
        t["model.norm.weight"] = old + 0.5  # rounded to bfloat16
        diff["max"] = (t["model.norm.weight"].double() - old.double()).abs().max().item()

    edit_shard(src / LLAMA2_SHARDS[2], bump)
    before = snapshot(src)
    proc = run_cli("verify", FIXTURES / "hf/llama2", src)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    differs = [line for line in proc.stdout.splitlines() if line.startswith("differs:")]
    assert differs == [f"differs: model.norm.weight: bytes differ, max abs diff {diff['max']:.6g}"], proc.stdout
    assert proc.stdout.splitlines()[0] == "DIFFERENT: 20 of 21 tensors bitwise equal, 1 differ in value or shape"
    assert snapshot(src) == before
