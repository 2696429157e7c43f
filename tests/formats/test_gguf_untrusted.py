"""A GGUF is untrusted input: every lie in it is one line on stderr, exit 1, nothing written.

The files are built byte by byte here (magic, counts, key/values, tensor infos, padding, data:
the GGUF v3 layout as llama.cpp's ``gguf.h`` defines it), so that each field can lie on its
own; a valid one is converted first, so each refusal is the lie's doing. The fuzz test
mutates a valid file with a seeded generator (``CKPTKIT_GGUF_FUZZ_SEED``; the seed is in
every failure message) and runs ``inspect`` and ``convert`` on each mutant in-process.
"""

from __future__ import annotations

import os
import random
import signal
import struct
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ckptkit.cli import app
from ckptkit.formats import detect_format, get_format

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
GGML_F32, GGML_F16, GGML_Q8_0, GGML_Q4_K, GGML_NVFP4 = 0, 1, 8, 12, 40
DIM, FFN, VOCAB, HEADS = 32, 64, 32, 2


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def string(text: str) -> bytes:
    data = text.encode()
    return u64(len(data)) + data


def kv(key: str, kind: int, payload: bytes) -> bytes:
    return string(key) + u32(kind) + payload


def kv_u32(key: str, value: int) -> bytes:
    return kv(key, U32, u32(value))


def kv_str(key: str, value: str) -> bytes:
    return kv(key, STR, string(value))


def kv_array(key: str, kind: int, items: list[bytes]) -> bytes:
    return kv(key, ARR, u32(kind) + u64(len(items)) + b"".join(items))


def tensor_info(name: str, shape: tuple[int, ...], ggml: int, offset: int) -> bytes:
    dims = tuple(reversed(shape))
    return string(name) + u32(len(dims)) + b"".join(u64(d) for d in dims) + u32(ggml) + u64(offset)


def model_kvs(tokenizer: bool = True) -> list[bytes]:
    out = [
        kv_str("general.architecture", "llama"),
        kv_u32("llama.block_count", 1),
        kv_u32("llama.context_length", 64),
        kv_u32("llama.embedding_length", DIM),
        kv_u32("llama.feed_forward_length", FFN),
        kv_u32("llama.attention.head_count", HEADS),
        kv_u32("llama.attention.head_count_kv", HEADS),
        kv("llama.attention.layer_norm_rms_epsilon", F32, struct.pack("<f", 1e-5)),
        kv("llama.rope.freq_base", F32, struct.pack("<f", 10000.0)),
    ]
    if tokenizer:
        pieces = ["<unk>", "<s>", "</s>", "\u2581", *"abcdefghijklmnopqrstuvwxyz", "\u2581a", "\u2581b", "ab"]
        types = [2, 3, 3] + [1] * (len(pieces) - 3)
        out += [
            kv_str("tokenizer.ggml.model", "llama"),
            kv_array("tokenizer.ggml.tokens", STR, [string(p) for p in pieces]),
            kv_array("tokenizer.ggml.scores", F32, [struct.pack("<f", -float(i)) for i in range(len(pieces))]),
            kv_array("tokenizer.ggml.token_type", I32, [struct.pack("<i", t) for t in types]),
            kv_u32("tokenizer.ggml.bos_token_id", 1),
            kv_u32("tokenizer.ggml.eos_token_id", 2),
        ]
    return out


TENSORS = {
    "token_embd.weight": ((VOCAB, DIM), GGML_Q8_0),
    "blk.0.attn_q.weight": ((DIM, DIM), GGML_F32),
    "blk.0.attn_k.weight": ((DIM, DIM), GGML_F16),
    "blk.0.attn_v.weight": ((DIM, DIM), GGML_F32),
    "blk.0.attn_output.weight": ((DIM, DIM), GGML_F32),
    "blk.0.ffn_gate.weight": ((FFN, DIM), GGML_F32),
    "blk.0.ffn_up.weight": ((FFN, DIM), GGML_F32),
    "blk.0.ffn_down.weight": ((DIM, FFN), GGML_F32),
    "blk.0.attn_norm.weight": ((DIM,), GGML_F32),
    "blk.0.ffn_norm.weight": ((DIM,), GGML_F32),
    "output_norm.weight": ((DIM,), GGML_F32),
    "output.weight": ((VOCAB, DIM), GGML_F32),
}


def tensor_bytes(shape: tuple[int, ...], ggml: int, rng: np.random.Generator) -> bytes:
    n = int(np.prod(shape))
    if ggml == GGML_F32:
        return rng.normal(0, 1, n).astype(np.float32).tobytes()
    if ggml == GGML_F16:
        return rng.normal(0, 1, n).astype(np.float16).tobytes()
    blocks = rng.integers(-127, 128, size=(n // 32, 34)).astype(np.int8).view(np.uint8)
    blocks[:, :2] = rng.uniform(0.001, 0.01, n // 32).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.tobytes()


def build(
    kvs: list[bytes] | None = None,
    tensors: dict[str, tuple[tuple[int, ...], int]] | list[tuple[str, tuple[tuple[int, ...], int]]] | None = None,
    *,
    n_tensors: int | None = None,
    n_kv: int | None = None,
    offsets: dict[str, int] | None = None,
    version: int = 3,
    seed: int = 0,
) -> bytes:
    """A GGUF v3 file: header, key/values, tensor infos, zero padding to 32, tensor data
    (each padded to 32); any count or offset may be given instead of the true one."""
    kvs = model_kvs() if kvs is None else kvs
    items = list((TENSORS if tensors is None else tensors).items() if not isinstance(tensors, list) else tensors)
    rng = np.random.default_rng(seed)
    data, infos = b"", []
    for name, (shape, ggml) in items:
        blob = tensor_bytes(shape, ggml, rng)
        at = (offsets or {}).get(name, len(data))
        infos.append(tensor_info(name, shape, ggml, at))
        data += blob + bytes(-len(blob) % 32)
    head = b"GGUF" + u32(version) + u64(len(items) if n_tensors is None else n_tensors)
    head += u64(len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(infos)
    return head + bytes(-len(head) % 32) + data


def run(*args: object) -> tuple[int, str]:
    """The CLI in this process: (exit code, stderr), after checking it ended cleanly: exit 0,
    or exit 1 with exactly one ``error:`` line; never a traceback or a hang."""

    def alarm(signum: int, frame: object) -> None:
        raise TimeoutError("no result within 30 s")

    signal.signal(signal.SIGALRM, alarm)
    signal.alarm(30)
    try:
        result = CliRunner().invoke(app, [str(a) for a in args])
    finally:
        signal.alarm(0)
    shown = f"ckptkit {' '.join(map(str, args))}\nexit {result.exit_code}\nstderr:\n{result.stderr}"
    assert result.exit_code in (0, 1), f"{shown}\n{result.exception!r}"
    assert result.exception is None or isinstance(result.exception, SystemExit), f"{shown}\n{result.exception!r}"
    if result.exit_code == 1:
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), shown
    return result.exit_code, result.stderr


def refused(path: Path, dst: Path) -> str:
    """inspect and convert both refuse ``path`` in one line; nothing is written."""
    code, err = run("inspect", path, "--json")
    assert code == 1, f"inspect accepted {path.name}"
    code, err2 = run("convert", path, dst, "--to", "hf", "--dtype", "float32", "--quiet")
    assert code == 1, f"convert accepted {path.name}"
    assert not dst.exists() and sorted(p.name for p in dst.parent.iterdir()) == [path.name]
    return err + err2


def test_the_hand_built_gguf_is_valid(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(build())
    code, err = run("convert", tmp_path / "m.gguf", tmp_path / "hf", "--to", "hf", "--dtype", "float32", "--quiet")
    assert code == 0, err
    code, err = run("verify", tmp_path / "m.gguf", tmp_path / "hf", "--allow-cast")
    assert code == 0, err
    from gguf import GGUFReader  # the reference reader agrees with the layout

    assert [t.name for t in GGUFReader(tmp_path / "m.gguf").tensors] == list(TENSORS)


def _overlapping() -> bytes:
    return build(offsets={"blk.0.attn_v.weight": 0})


def _array_items(n: int) -> bytes:
    return build([*model_kvs(), kv_array("x.big", U8, [b"\0"] * n)])


def _duplicate_tensor() -> bytes:
    return build(tensors=[*TENSORS.items(), ("output.weight", ((VOCAB, DIM), GGML_F32))])


LIES = {
    "bad magic": (lambda: b"GGUX" + build()[4:], "not a GGUF file"),
    "version 1": (lambda: build(version=1), "GGUF version 1"),
    "truncated header": (lambda: build()[:200], "bytes left cannot hold them"),
    "truncated data": (lambda: build()[:-100], "runs past the end of the file"),
    "lying tensor count": (lambda: build(n_tensors=1 << 40), "lying tensor count"),
    "lying key/value count": (lambda: build(n_kv=1 << 50), "lying key/value count"),
    "one more key than stored": (lambda: build(n_kv=len(model_kvs()) + 1), "bytes, more than 65536"),
    "lying string length": (lambda: build([kv("general.architecture", STR, u64(1 << 62) + b"llama")]), "lying"),
    "lying array length": (lambda: build([*model_kvs(), kv("x.a", ARR, u32(U32) + u64(1 << 60))]), "lying array"),
    "huge array": (lambda: _array_items((1 << 23) + 1), "arrays of more than"),
    "unknown value type": (lambda: build([*model_kvs(), kv("x.t", 99, b"")]), "unknown value type 99"),
    "unknown array type": (lambda: build([*model_kvs(), kv("x.t", ARR, u32(77) + u64(1))]), "unknown array item"),
    "bool that is 7": (lambda: build([*model_kvs(), kv("x.b", BOOL, b"\x07")]), "bool value 7"),
    "duplicate key": (lambda: build([*model_kvs(), kv_u32("llama.block_count", 1)]), "appears twice"),
    "key not UTF-8": (lambda: build([*model_kvs(), u64(2) + b"\xff\xfe" + u32(U32) + u32(1)]), "not valid UTF-8"),
    "unknown tensor type": (
        lambda: build(tensors={**TENSORS, "output.weight": ((VOCAB, DIM), 200)}),
        "unknown GGML type 200",
    ),
    "five dimensions": (lambda: build(tensors={"x": ((1, 1, 1, 1, 32), GGML_F32)}), "5 dimensions"),
    "a zero dimension": (lambda: build(tensors={"x": ((0, 32), GGML_F32)}), "cannot hold"),
    "rows not whole blocks": (lambda: build(tensors={"x": ((2, 30), GGML_Q8_0)}), "cannot hold"),
    "rows not whole K blocks": (lambda: build(tensors={"x": ((2, 128), GGML_Q4_K)}), "Q4_K blocks of 256 cannot"),
    "rows not whole NVFP4 blocks": (lambda: build(tensors={"x": ((2, 48), GGML_NVFP4)}), "NVFP4 blocks of 64 cannot"),
    "a retired type id": (lambda: build(tensors={**TENSORS, "output.weight": ((VOCAB, DIM), 4)}), "GGML type 4"),
    "misaligned offset": (lambda: build(offsets={"output.weight": 4}), "not a multiple of the alignment"),
    "offset past the end": (lambda: build(offsets={"output.weight": 1 << 40}), "runs past the end"),
    "overlapping tensors": (_overlapping, "overlap"),
    "duplicate tensor": (_duplicate_tensor, "appears twice"),
    "alignment not a power of two": (
        lambda: build([*model_kvs(), kv_u32("general.alignment", 48)]),
        "not a power of two",
    ),
}


# Lies in what the metadata says of the model: inspect still lists the tensors (model type
# unknown), convert refuses.
MODEL_LIES = {
    "block count a string": (
        lambda: build([model_kvs()[0], kv_str("llama.block_count", "1"), *model_kvs()[2:]]),
        "must be a positive integer",
    ),
    "token ids out of range": (
        lambda: build([*model_kvs(), kv_u32("tokenizer.ggml.unknown_token_id", 1 << 30)]),
        "is not a token id",
    ),
}


@pytest.mark.parametrize("make", [v[0] for v in MODEL_LIES.values()], ids=list(MODEL_LIES))
def test_metadata_that_misstates_the_model_is_refused_by_convert(
    make: object, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    expected = MODEL_LIES[request.node.callspec.id][1]
    path = tmp_path / "m.gguf"
    path.write_bytes(make())  # type: ignore[operator]
    run("inspect", path, "--json")
    code, err = run("convert", path, tmp_path / "out", "--to", "hf", "--dtype", "float32", "--quiet")
    assert code == 1 and expected in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


@pytest.mark.parametrize("make", [v[0] for v in LIES.values()], ids=list(LIES))
def test_a_lying_gguf_is_refused_in_one_line(make: object, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    expected = LIES[request.node.callspec.id][1]
    path = tmp_path / "m.gguf"
    path.write_bytes(make())  # type: ignore[operator]
    message = refused(path, tmp_path / "out")
    assert expected in message, message
    assert str(path) in message


def test_a_gguf_file_is_a_source_and_other_files_are_not(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(build())
    assert detect_format(tmp_path / "m.gguf") is get_format("gguf")
    (tmp_path / "notes.txt").write_text("x")
    code, err = run("convert", tmp_path / "notes.txt", tmp_path / "out", "--to", "hf")
    assert code == 1 and "expected a checkpoint directory or a .gguf file" in err


# --- fuzzing ------------------------------------------------------------------------------------------

EXAMPLES = int(os.environ.get("CKPTKIT_GGUF_FUZZ_EXAMPLES", "120"))
SEED = int(os.environ.get("CKPTKIT_GGUF_FUZZ_SEED", "24"))


def mutate(data: bytes, header_end: int, rng: random.Random) -> tuple[bytes, str]:
    """One mutation, aimed at the header nine times in ten: byte flips, a u32 / u64 overwritten
    with a boundary value, a truncation, an insertion or a deletion."""
    out = bytearray(data)
    end = header_end if rng.random() < 0.9 else len(data)
    at = rng.randrange(4, end)
    how = rng.choice(["flip", "u32", "u64", "truncate", "insert", "delete"])
    if how == "flip":
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(4, end)] ^= 1 << rng.randrange(8)
    elif how in ("u32", "u64"):
        value = rng.choice([0, 1, 2, 3, 4, 5, 9, 12, 13, 31, 32, 33, 255, (1 << 31) - 1, 1 << 31, (1 << 32) - 1,
                            1 << 40, (1 << 63) - 1, (1 << 64) - 1])  # fmt: skip
        packed = struct.pack("<Q", value)[: 4 if how == "u32" else 8]
        out[at : at + len(packed)] = packed
    elif how == "truncate":
        del out[at:]
    elif how == "insert":
        out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    else:
        del out[at : at + rng.randint(1, 16)]
    return bytes(out), f"{how} at {at}"


def test_mutated_gguf_files_are_converted_or_refused_in_one_line(tmp_path: Path) -> None:
    """Each mutant: inspect and convert end in exit 0 or one line and exit 1; a conversion that
    succeeds verifies equal to its source; a failed one leaves nothing."""
    from ckptkit.formats.gguf.reader import read_header

    valid = build(seed=SEED)
    (tmp_path / "valid.gguf").write_bytes(valid)
    header_end = read_header(tmp_path / "valid.gguf").data_start
    rng = random.Random(SEED)
    print(f"GGUF fuzz seed {SEED} (CKPTKIT_GGUF_FUZZ_SEED), {EXAMPLES} examples")
    outcomes = {0: 0, 1: 0}
    for i in range(EXAMPLES):
        data, how = mutate(valid, header_end, rng)
        work = tmp_path / f"m{i}"
        work.mkdir()
        src = work / "m.gguf"
        src.write_bytes(data)
        note = f"seed {SEED}, example {i}: {how}"
        try:
            run("inspect", src, "--json")
            code, _ = run("convert", src, work / "out", "--to", "hf", "--dtype", "float32", "--quiet")
            outcomes[code] += 1
            if code == 1:
                assert sorted(p.name for p in work.iterdir()) == ["m.gguf"], "a failed conversion wrote something"
            else:
                code, err = run("verify", src, work / "out", "--allow-cast")
                assert code == 0, f"converted but does not verify equal to its source: {err}"
        except AssertionError as e:
            raise AssertionError(f"{note}\n{e}") from None
        assert src.read_bytes() == data, f"{note}: the source changed"
    assert outcomes[1] > EXAMPLES // 4, outcomes  # the mutations reach the checks
