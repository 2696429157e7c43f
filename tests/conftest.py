"""Shared test helpers: fixture locations and layout comparison."""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import sys
import zipfile
from pathlib import Path

# Before torch loads OpenMP: on a shared, oversubscribed machine (the 2-core dev box) threads
# that spin while they wait burn the cores every other process needs; sleeping instead made
# the recipe tests 3-6x faster in wall time there. It changes no result, only waiting.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# One intra-op thread per test process (and the processes tests start; torchrun's ranks already
# get 1): CI runs 2 xdist workers on 2 cores, and the tiny models gain nothing from a second
# thread but its scheduling (measured: ~10% less CPU for the in-process training tests).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# A test module may import a sibling folder's helpers (``from test_errors import ...``): every
# folder of tests/ is on the path, so that ``pytest tests/convert`` also runs alone.
sys.path[:0] = [str(p) for p in sorted(Path(__file__).parent.iterdir()) if p.is_dir() and p.name[0] not in "._"]

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
META_FAMILIES = ("llama2", "llama3", "llama3_1", "llama3_2", "mistral")
ALL_FAMILIES = META_FAMILIES + ("qwen2", "gemma", "phi3")


def fixture_dirs() -> list[Path]:
    """Every fixture checkpoint directory (hf/*, hf-bin/*, meta/*)."""
    return sorted(p for fmt in ("hf", "hf-bin", "meta") for p in (FIXTURES / fmt).iterdir() if p.is_dir())


def fixture_family(path: Path) -> str:
    return path.name.split("-")[0]


def tree_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def raw_layout(root: Path) -> dict:
    """Weight files, tensor names in stored order, dtypes, shapes and bytes, read independently
    of ckptkit: safetensors by the library, pickles by torch.load(weights_only=True)."""
    from safetensors import safe_open

    files = {}
    for p in sorted(root.iterdir()):
        if p.suffix == ".safetensors":
            with safe_open(p, "pt") as f:
                header_len = int.from_bytes(p.read_bytes()[:8], "little")
                header = json.loads(p.read_bytes()[8 : 8 + header_len])
                header.pop("__metadata__", None)
                order = sorted(header, key=lambda k: header[k]["data_offsets"][0])
                files[p.name] = [(k, f.get_tensor(k)) for k in order]
        elif p.suffix in (".pth", ".bin"):
            sd = torch.load(p, weights_only=True, map_location="cpu")
            files[p.name] = list(sd.items())
    return files


def assert_same_layout(a: Path, b: Path) -> None:
    """Same weight file names, same tensor names in the same order, same dtypes and bytes,
    same index weight_map."""
    la, lb = raw_layout(a), raw_layout(b)
    assert list(la) == list(lb), "weight file names differ"
    for name in la:
        ka, kb = [k for k, _ in la[name]], [k for k, _ in lb[name]]
        assert ka == kb, f"{name}: tensor names or order differ"
        for (k, ta), (_, tb) in zip(la[name], lb[name], strict=True):
            assert ta.dtype == tb.dtype and ta.shape == tb.shape, f"{name}:{k} dtype/shape differ"
            assert torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)), f"{name}:{k} bytes differ"
    for index in a.glob("*.index.json"):
        wa = json.loads(index.read_text())["weight_map"]
        wb = json.loads((b / index.name).read_text())["weight_map"]
        assert wa == wb, f"{index.name}: weight_map differs"


FUZZ_SEED = "CKPTKIT_FUZZ_SEED"  # tests/convert/test_fuzz.py's random run; set it to reproduce one


def pytest_configure(config: pytest.Config) -> None:
    """Draw the fuzz seed once per session (before xdist starts its workers, which inherit it)."""
    os.environ.setdefault(FUZZ_SEED, str(random.SystemRandom().randrange(2**32)))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the modules with slow tests first, each module's tests in their order: pyproject's
    ``--dist loadscope`` hands each module to one xdist worker whole (a module-scoped run or
    conversion is made once, not once on each worker), and the modules of quick tests then fill
    the end of the run on both workers."""
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow)  # a stable sort


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The seed, at the end of any session that ran the fuzz tests (shown with ``-q`` too)."""
    reports = [r for group in terminalreporter.stats.values() for r in group]
    if any("test_fuzz.py" in getattr(r, "nodeid", "") for r in reports):
        seed = os.environ[FUZZ_SEED]
        terminalreporter.write_line(f"fuzz seed: {FUZZ_SEED}={seed} (set it to reproduce test_fuzz.py)")


@pytest.fixture(scope="session")
def fixtures() -> Path:
    return FIXTURES


SERIALIZATION_ID = ".data/serialization_id"  # torch.save writes a random one into every archive


def _masked(path: Path) -> bytes:
    """A .pth file's bytes with its random serialization id and that record's CRCs zeroed."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        start_dir = z.start_dir
        for zi in z.infolist():
            if zi.filename.endswith(SERIALIZATION_ID):
                name_len, extra_len = struct.unpack_from("<HH", data, zi.header_offset + 26)
                at = zi.header_offset + 30 + name_len + extra_len
                data[at : at + zi.file_size] = bytes(zi.file_size)
                data[at + zi.file_size + 4 : at + zi.file_size + 8] = bytes(4)  # the data descriptor's CRC
                data[zi.header_offset + 14 : zi.header_offset + 18] = bytes(4)
                central = data.index(zi.filename.encode(), start_dir) - 46
                data[central + 16 : central + 20] = bytes(4)
    return bytes(data)


def assert_same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        if name.endswith((".pth", ".bin")):
            assert _masked(a / name) == _masked(b / name), name
        else:
            assert (a / name).read_bytes() == (b / name).read_bytes(), name


def direct_supported(folder: Path) -> bool:
    """Whether files in ``folder`` open with ``O_DIRECT`` (tmpfs before Linux 6.6 refuses):
    a plain ``os.open``, independent of ckptkit's own probe."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = folder / f".direct-probe-{os.getpid()}"
    probe.touch()
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_DIRECT)
    except OSError:
        return False
    else:
        os.close(fd)
        return True
    finally:
        probe.unlink()


# --- llama.cpp's converters (the llama-cpp-python sdist vendors them with gguf-py) ---


@pytest.fixture(scope="session")
def llama_cpp() -> Path:
    """The unpacked llama.cpp converter directory (fetched once into the test cache)."""
    from tokenizer_helpers import llama_cpp_dir

    return llama_cpp_dir()
