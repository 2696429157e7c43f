"""PyTorch distributed checkpoints (DCP): folders torch's ``dcp.save`` writes, from one
process or from two gloo ranks with sharded DTensors, read and converted bitwise; folders
ckptkit writes, read back by torch's own ``dcp.load``; ``.metadata`` read without running
anything; bad folders refused with one line and nothing written."""

from __future__ import annotations

import itertools
import json
import os
import pickle
import shutil
import socket
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from typer.testing import CliRunner

from ckptkit.checkpoint import open_checkpoint
from ckptkit.cli import app
from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError
from ckptkit.formats import detect_format
from ckptkit.formats.dcp.metadata import Chunk
from ckptkit.formats.dcp.reading import stitch
from ckptkit.inspection import inspect_path
from ckptkit.io import Span, read_spans
from ckptkit.verify import verify_paths

from conftest import FIXTURES, assert_same_files

META = FIXTURES / "meta" / "llama2"
HF = FIXTURES / "hf" / "llama2"


def _meta_tensors() -> dict[str, torch.Tensor]:
    sd = torch.load(META / "consolidated.00.pth", weights_only=True)
    return {k: v for k, v in sd.items() if k != "rope.freqs"}


def _save(state: dict[str, Any], folder: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in a single process"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)))


def _load(folder: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: torch.empty_like(v) for k, v in like.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=dcp.FileSystemReader(str(folder)))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(_bits(a[k]), _bits(b[k])), k


def _cli(*args: str | Path) -> tuple[int, str, str]:
    """(exit code, stderr, stdout) of the command line."""
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.stderr, result.stdout


def _verified(a: Path, b: Path) -> None:
    report = verify_paths(a, b)
    assert report.ok, report.summary()


# --- ckptkit writes, torch reads ----------------------------------------------------------


@pytest.mark.parametrize("shards", [1, 2])
def test_torch_dcp_load_fills_meta_named_tensors_bitwise(tmp_path: Path, shards: int) -> None:
    convert(HF, tmp_path / "dcp", ConvertOptions("dcp", shards=shards))
    files = sorted(p.name for p in (tmp_path / "dcp").glob("*.distcp"))
    assert files == [f"__{r}_0.distcp" for r in range(shards)]
    assert detect_format(tmp_path / "dcp").name == "dcp"
    # torch's own reader, one process, no process group: Meta names and Meta's Q/K layout.
    _assert_equal(_load(tmp_path / "dcp", _meta_tensors()), _meta_tensors())
    _verified(tmp_path / "dcp", META)
    # params.json beside it: read back without --config, and back to HF as it was.
    assert json.loads((tmp_path / "dcp" / "params.json").read_text())["n_layers"] == 2
    convert(tmp_path / "dcp", tmp_path / "hf", ConvertOptions("hf"))
    assert_same_files(HF, tmp_path / "hf")


@pytest.mark.parametrize("fixture", ["llama2-2rank", "mixtral-2rank"])  # Mixtral: experts whole on each rank
def test_meta_to_dcp_and_back_to_meta_keeps_every_tensor(fixture: str, tmp_path: Path) -> None:
    convert(FIXTURES / "meta" / fixture, tmp_path / "dcp", ConvertOptions("dcp", shards=2))
    convert(tmp_path / "dcp", tmp_path / "meta", ConvertOptions("meta"))
    _verified(tmp_path / "meta", FIXTURES / "meta" / fixture)
    a = torch.load(tmp_path / "meta" / "consolidated.01.pth", weights_only=True)
    b = torch.load(FIXTURES / "meta" / fixture / "consolidated.01.pth", weights_only=True)
    _assert_equal(a, b)


def test_written_chunks_are_torch_save_archives_torch_reads(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    convert(HF, tmp_path / "dcp", ConvertOptions("dcp", shards=2))
    dcp_to_torch_save(str(tmp_path / "dcp"), str(tmp_path / "all.pt"))
    _assert_equal(torch.load(tmp_path / "all.pt", weights_only=True), _meta_tensors())


# --- torch writes, ckptkit reads ----------------------------------------------------------


def _torchtitan_state(model: dict[str, torch.Tensor], prefix: str = "") -> dict[str, Any]:
    """Model keys beside optimizer, scheduler and train state, as torchtitan saves them."""
    state: dict[str, Any] = {prefix + k: v for k, v in model.items()}
    state["optimizer"] = {"state": {k: {"exp_avg": torch.zeros_like(v)} for k, v in list(model.items())[:2]}}
    state["lr_scheduler"] = {"last_epoch": 7}
    state["train_state"] = {"step": 7, "ntokens_seen": 1000}
    return state


def _new_spelling(model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in model.items():
        k = k.replace(".attention.wq.", ".attention.qkv_linear.wq.").replace(
            ".attention.wk.", ".attention.qkv_linear.wk."
        )
        k = k.replace(".attention.wv.", ".attention.qkv_linear.wv.")
        out["lm_head.weight" if k == "output.weight" else k] = v
    return out


@pytest.mark.parametrize(
    "spelling,prefix", [("meta", ""), ("meta", "model."), ("2026", ""), ("2026", "model.")], ids=str
)
def test_a_single_process_save_converts_to_the_same_weights(tmp_path: Path, spelling: str, prefix: str) -> None:
    model = _meta_tensors() if spelling == "meta" else _new_spelling(_meta_tensors())
    folder = tmp_path / "ckpt"
    _save(_torchtitan_state(model, prefix), folder)
    shutil.copy(META / "params.json", tmp_path / "params.json")

    info = inspect_path(folder, config=tmp_path / "params.json")
    assert info["format"] == ("dcp" if spelling == "meta" else "dcp-titan") and info["model_type"] == "llama2"
    assert {t["name"] for t in info["tensors"]} == set(_meta_tensors())
    assert "train_state.step" in info["ignored"] and any(k.startswith("optimizer.") for k in info["ignored"])

    convert(folder, tmp_path / "hf", ConvertOptions("hf", config=tmp_path / "params.json"))
    _verified(tmp_path / "hf", HF)
    convert(folder, tmp_path / "meta", ConvertOptions("meta", config=tmp_path / "params.json"))
    _verified(tmp_path / "meta", META)


def test_config_json_names_the_model_too(tmp_path: Path) -> None:
    _save(_meta_tensors(), tmp_path / "ckpt")
    convert(tmp_path / "ckpt", tmp_path / "hf", ConvertOptions("hf", config=HF / "config.json"))
    _verified(tmp_path / "hf", HF)


def test_a_folder_without_config_says_what_is_missing(tmp_path: Path) -> None:
    _save(_meta_tensors(), tmp_path / "ckpt")
    code, err, _ = _cli("convert", tmp_path / "ckpt", tmp_path / "out", "--to", "hf")
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "params.json or config.json" in err and "--config" in err
    assert not (tmp_path / "out").exists()
    code, _, out = _cli("inspect", tmp_path / "ckpt", "--config", META / "params.json")
    assert code == 0 and "dcp" in out and "llama2" in out


def test_the_newest_step_folder_is_chosen_or_the_one_named(tmp_path: Path) -> None:
    model = _meta_tensors()
    older = {k: torch.zeros_like(v) for k, v in model.items()}
    _save(_torchtitan_state(older), tmp_path / "run" / "step-5")
    _save(_torchtitan_state(model), tmp_path / "run" / "step-20")
    (tmp_path / "run" / "step-30").mkdir()  # being written: no .metadata yet
    shutil.copy(META / "params.json", tmp_path / "run" / "params.json")
    convert(tmp_path / "run", tmp_path / "newest", ConvertOptions("meta"))
    _verified(tmp_path / "newest", META)
    convert(tmp_path / "run" / "step-5", tmp_path / "named", ConvertOptions("meta", config=META / "params.json"))
    with open_checkpoint(tmp_path / "named") as ckpt:
        assert all(not torch.any(_bits(t.get())) for t in ckpt.tensors.values())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PLACEMENTS = {"wq": "shard0", "wo": "shard1", "w1": "shard0", "w2": "shard1", "norm": "replicate"}


def _placement(name: str) -> str:
    return next((p for key, p in PLACEMENTS.items() if f".{key}." in f".{name}"), "shard0")


def _rank_save(rank: int, world: int, port: int, folder: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        state: dict[str, Any] = {}
        for name, t in _meta_tensors().items():
            kind = _placement(name)
            placement = Replicate() if kind == "replicate" or t.dim() < 2 else Shard(0 if kind == "shard0" else 1)
            state[name] = distribute_tensor(t, mesh, [placement])
        state["train_state"] = {"step": 3}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder))
    finally:
        dist.destroy_process_group()


# Tensors sharded on a dimension other than the first or last (row-major runs of a chunk are
# then shorter than its rows), kept under a prefix of their own and read by open_state.
MIDDLE = {"extra.a": ((3, 7, 5), 1), "extra.b": ((2, 3, 5, 4), 1), "extra.c": ((2, 5, 3, 4), 2)}


def _middle_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    return {k: torch.randn(shape, generator=gen).to(torch.bfloat16) for k, (shape, _) in MIDDLE.items()}


def _rank_save_middle(rank: int, world: int, port: int, folder: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        tensors = _middle_tensors()
        dcp.save(
            {k: distribute_tensor(t, mesh, [Shard(MIDDLE[k][1])]) for k, t in tensors.items()},
            storage_writer=dcp.FileSystemWriter(folder),
        )
    finally:
        dist.destroy_process_group()


def test_tensors_sharded_on_a_middle_dimension_stitch_bitwise(tmp_path: Path) -> None:
    from ckptkit.formats.dcp.folder import open_state

    folder = tmp_path / "ckpt"
    mp.start_processes(_rank_save_middle, args=(2, _free_port(), str(folder)), nprocs=2, start_method="fork")
    raw = open_state(folder, "extra.")
    for fqn, t in _middle_tensors().items():
        name, dim = fqn.removeprefix("extra."), MIDDLE[fqn][1]
        half = (t.shape[dim] + 1) // 2  # torch's split: the first rank takes the larger half
        assert sorted((c.offsets[dim], c.sizes[dim]) for c in raw.entries[name].chunks) == [
            (0, half),
            (half, t.shape[dim] - half),
        ]
        assert torch.equal(_bits(raw.read(name)), _bits(t)), fqn
        spans = raw.spans(name)
        assert spans is not None and read_spans(spans) == _bits(t).numpy().tobytes(), fqn


def test_two_ranks_sharded_tensors_stitch_bitwise(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    mp.start_processes(_rank_save, args=(2, _free_port(), str(folder)), nprocs=2, start_method="fork")
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    shutil.copy(META / "params.json", folder / "params.json")
    with open_checkpoint(folder) as ckpt:
        raw: Any = ckpt.raw
        for name, placement in (("layers.0.attention.wo.weight", "shard1"), ("layers.0.attention.wq.weight", "shard0")):
            entry = raw.entries[name]
            assert len(entry.chunks) == 2, (name, placement)
            assert {c.file for c in entry.chunks} == {"__0_0.distcp", "__1_0.distcp"}
        # Each tensor, read from its chunks and as stitched byte ranges, is the original.
        for name, t in _meta_tensors().items():
            assert torch.equal(_bits(raw.read(name)), _bits(t)), name
            spans = raw.spans(name)
            assert spans is not None and read_spans(spans) == _bits(t).numpy().tobytes(), name
    convert(folder, tmp_path / "meta", ConvertOptions("meta"))
    _verified(tmp_path / "meta", META)
    convert(folder, tmp_path / "hf", ConvertOptions("hf"))
    _verified(tmp_path / "hf", HF)


def _with_tokenizer(folder: Path) -> Path:
    """``folder`` as torchtitan users keep it: params.json and tokenizer.model beside the weights
    (or beside the ``step-N`` folders)."""
    for name in ("params.json", "tokenizer.model"):
        shutil.copy(META / name, folder / name)
    return folder


@pytest.mark.parametrize("dtype", [None, "q8_0"])
@pytest.mark.parametrize("source", ["step folders", "two ranks"])
def test_dcp_to_gguf_is_the_gguf_of_the_same_meta_checkpoint(tmp_path: Path, source: str, dtype: str | None) -> None:
    """The GGUF of a DCP checkpoint is, byte for byte, the GGUF of the Meta checkpoint holding
    the same weights (whose GGUF test_gguf.py checks against llama.cpp's converter); both
    folders are named alike, since GGUF's general.name comes from the folder's name."""
    folder = tmp_path / "dcp" / "llama2"
    if source == "step folders":  # torch's single-process save in step-10, with optimizer state
        shutil.copytree(FIXTURES / "dcp" / "llama2", folder)
    else:  # two gloo ranks, DTensors sharded on dim 0 and 1 or replicated
        mp.start_processes(_rank_save, args=(2, _free_port(), str(folder)), nprocs=2, start_method="fork")
    _with_tokenizer(folder)
    convert(folder, tmp_path / "dcp.gguf", ConvertOptions("gguf", dtype=dtype))
    convert(META, tmp_path / "meta.gguf", ConvertOptions("gguf", dtype=dtype))
    assert (tmp_path / "dcp.gguf").read_bytes() == (tmp_path / "meta.gguf").read_bytes()


def test_stitching_any_chunk_grid_gives_the_row_major_bytes(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    for shape, cuts in [
        ((6, 8), ([0, 2, 6], [0, 8])),
        ((6, 8), ([0, 6], [0, 3, 8])),
        ((4, 6, 5), ([0, 1, 4], [0, 6], [0, 2, 5])),
        ((4, 7, 5), ([0, 4], [0, 4, 7], [0, 5])),  # a middle dimension only
        ((3, 4, 6, 5), ([0, 3], [0, 1, 4], [0, 2, 6], [0, 5])),  # two middle dimensions
    ]:
        full = torch.randint(0, 255, shape, generator=gen, dtype=torch.uint8)
        blob, pieces, pos = bytearray(), [], 0
        for box in itertools.product(*[list(zip(c[:-1], c[1:], strict=True)) for c in cuts]):
            part = full[tuple(slice(a, b) for a, b in box)].contiguous()
            data = part.numpy().tobytes()
            chunk = Chunk(tuple(a for a, _ in box), tuple(b - a for a, b in box))
            pieces.append((chunk, Span(tmp_path / "blob", pos, len(data))))
            blob += data
            pos += len(data)
        (tmp_path / "blob").write_bytes(bytes(blob))
        assert read_spans(stitch(shape, 1, pieces[::-1])) == full.numpy().tobytes()


# --- .metadata runs nothing; bad folders ---------------------------------------------------


class _Boom:
    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.target}",))


def _valid_dcp(tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    _save(_meta_tensors(), folder)
    shutil.copy(META / "params.json", folder / "params.json")
    return folder


def test_a_hostile_metadata_is_refused_and_never_runs(tmp_path: Path) -> None:
    folder = _valid_dcp(tmp_path)
    target = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": _Boom(str(target))}))
    for args in (["inspect", folder], ["convert", folder, tmp_path / "out", "--to", "hf"]):
        code, err, _ = _cli(*args)
        assert code == 1 and len(err.strip().splitlines()) == 1, err
        assert "refusing to load" in err and "posix.system" in err
    assert not target.exists() and not (tmp_path / "out").exists()
    # torch's own reader would have run it: the file above is a live exploit.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(BaseException):  # noqa: B017 (torch raises CheckpointException after running it)
            dcp.load({"x": torch.empty(1)}, storage_reader=dcp.FileSystemReader(str(folder)))
    assert target.exists()


def _bad_case(folder: Path, case: str) -> None:
    files = sorted(folder.glob("*.distcp"))
    if case == "truncated":
        data = files[0].read_bytes()
        files[0].write_bytes(data[: len(data) // 2])
    elif case == "missing":
        files[0].unlink()
    elif case in ("lying offsets", "swapped chunks"):
        import torch.distributed.checkpoint.filesystem as fs

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            meta = dcp.FileSystemReader(str(folder)).read_metadata()
        infos = meta.storage_data
        size = files[0].stat().st_size
        if case == "lying offsets":  # each chunk 16 bytes on, inside the file: in the middle of an archive
            moved = {k: fs._StorageInfo(v.relative_path, v.offset + 16, v.length) for k, v in infos.items()}
            meta.storage_data = {k: v for k, v in moved.items() if v.offset + v.length <= size}
            meta.storage_data |= {k: v for k, v in infos.items() if k not in meta.storage_data}
        else:  # the embeddings' record names the norm's archive: a whole archive, the wrong tensor
            emb = next(k for k in infos if k.fqn == "tok_embeddings.weight")
            norm = next(k for k in infos if k.fqn == "norm.weight")
            infos[emb], infos[norm] = infos[norm], infos[emb]
        (folder / ".metadata").write_bytes(pickle.dumps(meta))
    elif case == "corrupt bytes":
        data = bytearray(files[0].read_bytes())
        data[len(data) // 2] ^= 0xFF
        files[0].write_bytes(bytes(data))
    elif case == "garbage metadata":
        (folder / ".metadata").write_bytes(b"\x80\x04not a pickle")


@pytest.mark.parametrize(
    "case", ["truncated", "missing", "lying offsets", "swapped chunks", "corrupt bytes", "garbage metadata"]
)
def test_bad_folders_fail_with_one_line_and_write_nothing(tmp_path: Path, case: str) -> None:
    folder = _valid_dcp(tmp_path)
    _bad_case(folder, case)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    code, err, _ = _cli("convert", folder, tmp_path / "out", "--to", "hf")
    assert code == 1, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert str(folder) in err
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_max_shard_size_is_refused_for_dcp(tmp_path: Path) -> None:
    with pytest.raises(CkptkitError, match="--shards"):
        convert(HF, tmp_path / "dcp", ConvertOptions("dcp", max_shard_size="1MB"))


# Rows of wq (64 x 64) each chunk of a rewritten .metadata holds, and the one line refusing them.
GRIDS = {
    "outside": ([(1, 64)], "a chunk of 'layers.0.attention.wq.weight' lies outside its shape [64, 64]"),
    "overlap": ([(0, 40), (39, 24)], "chunks of 'layers.0.attention.wq.weight' overlap"),  # 64 rows, row 63 in none
    "gap": ([(0, 32), (33, 31)], "the chunks of 'layers.0.attention.wq.weight' do not cover its shape [64, 64]"),
}


@pytest.mark.parametrize("case", list(GRIDS))
def test_a_chunk_grid_that_does_not_tile_the_tensor_is_refused(tmp_path: Path, case: str) -> None:
    """torch's own .metadata, wq's one chunk replaced by row blocks (each pointing at the stored
    archive): one outside the tensor, two that overlap by a row (as many elements as the tensor,
    so only the overlap check can tell), two that leave a row out."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    folder = _valid_dcp(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meta = dcp.FileSystemReader(str(folder)).read_metadata()
    fqn = "layers.0.attention.wq.weight"
    record = meta.storage_data.pop(MetadataIndex(fqn, torch.Size([0, 0])))
    blocks, message = GRIDS[case]
    meta.state_dict_metadata[fqn].chunks = [
        ChunkStorageMetadata(torch.Size([start, 0]), torch.Size([rows, 64])) for start, rows in blocks
    ]
    for start, _ in blocks:
        meta.storage_data[MetadataIndex(fqn, torch.Size([start, 0]))] = record
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    code, err, _ = _cli("convert", folder, tmp_path / "out", "--to", "hf")
    assert code == 1 and err.strip().splitlines() == [f"error: {folder / '.metadata'}: {message}"], err
    assert not (tmp_path / "out").exists()
