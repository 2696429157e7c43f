"""Converting a quantized source is streamed: the process's peak memory grows by about one
tensor and its scale (dequantized, in float32 while it is computed), never by the model.

The source is a block-FP8 Llama (DeepSeek's ``weight_scale_inv``, 128 x 128 blocks) of
8 layers whose MLP weights are the largest tensors, made in the test: random e4m3 codes
(no NaN) and power-of-two scales. The peak is the kernel's (``VmHWM``), reset before the
conversion through ``/proc/self/clear_refs``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckptkit.tensors import float_bits

from conftest import FIXTURES

HIDDEN, INTER, LAYERS, BLOCK = 512, 2048, 8, 128
CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}
LARGEST = HIDDEN * INTER  # elements of the largest weight
MiB = 1 << 20


def _fp8(rows: int, cols: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # e4m3's NaN codes
    exponents = torch.randint(-8, 2, (-(-rows // BLOCK), -(-cols // BLOCK)), generator=gen).float()
    return codes.view(torch.float8_e4m3fn), torch.exp2(exponents)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("fp8-stream")
    gen = torch.Generator().manual_seed(0)
    vocab = 384  # the tokenizer's
    tensors = {
        "model.embed_tokens.weight": torch.randn(vocab, HIDDEN, generator=gen).to(torch.bfloat16),
        "lm_head.weight": torch.randn(vocab, HIDDEN, generator=gen).to(torch.bfloat16),
        "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
    }
    shapes = {
        "self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (128, HIDDEN), "self_attn.v_proj": (128, HIDDEN),
        "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
        "mlp.down_proj": (HIDDEN, INTER),
    }  # fmt: skip
    for i in range(LAYERS):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{norm}.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        for name, shape in shapes.items():
            w, s = _fp8(*shape, gen)
            tensors[f"model.layers.{i}.{name}.weight"], tensors[f"model.layers.{i}.{name}.weight_scale_inv"] = w, s
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": 8,
        "num_key_value_heads": 2, "vocab_size": vocab, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": CONFIG,
    }  # fmt: skip
    (src / "config.json").write_text(json.dumps(config, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "fp8" / "llama-overhang" / f, src / f)
    return src


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak-RSS reset")
@pytest.mark.parametrize(("to", "dtype"), [("hf", "bfloat16"), ("gguf", "bfloat16"), ("gguf", "Q4_K_M")])
def test_dequantizing_holds_one_tensor_not_the_model(to: str, dtype: str, source: Path, tmp_path: Path) -> None:
    """Also into llama-quantize's Q4_K_M (rows of 512 and 2048: the K types, encoded on the thread
    pool): warmed on the source itself, so that numba's compiled searches are loaded before."""
    out = tmp_path / ("out.gguf" if to == "gguf" else "out")
    warm = source if dtype == "Q4_K_M" else FIXTURES / "fp8" / "llama-overhang"
    args = [source, out, to, warm, tmp_path / "warm" if to == "hf" else tmp_path / "warm.gguf", dtype]
    script = Path(__file__).parents[1] / "peak_rss.py"  # a fresh process: no earlier test's heap
    done = subprocess.run([sys.executable, script, *map(str, args)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    grown = int(done.stdout.split()[-1])
    written = sum(p.stat().st_size for p in ([out] if to == "gguf" else out.glob("*.safetensors")))
    assert written > (14 if dtype == "Q4_K_M" else 50) * MiB  # the model, dequantized (Q4_K_M: ~4.6 bits)
    print(f"--to {to} --dtype {dtype}: peak grew {grown / MiB:.1f} MiB writing {written / MiB:.0f} MiB; "
          f"largest tensor {LARGEST * 4 / MiB:.0f} MiB in float32")  # fmt: skip
    # measured 6-12 MiB alone and up to 21.8 MiB in a loaded -n 2 worker; the model is 59 MiB in
    # bf16 and 118 MiB in float32 (a dequantizer keeping its outputs grew by 108 MiB)
    # Q4_K_M: measured 30.2 MiB (the float32 tensor, the encoders' chunks on 2 threads, the blocks)
    assert grown < (10 if dtype == "Q4_K_M" else 6) * LARGEST * 4  # a few copies of one tensor, not the model


@pytest.mark.parametrize(
    ("made_direct", "method"), [(1 << 20, "auto"), (None, "auto"), (1 << 20, "stream"), (None, "direct")]
)  # past a lowered threshold; the default (256 MiB); --copy-method stream; --copy-method direct
def test_a_dequantizing_write_goes_direct_from_where_its_pieces_lie(
    made_direct: int | None, method: str, source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past :data:`MADE_DIRECT` bytes of dequantized weights, ``auto`` writes the output
    direct, each piece's whole pages from the buffer it was made in (placed in memory as its
    pages lie in the file: no staging copy); under it (this 59 MiB model by default), or
    with ``--copy-method stream``, buffered; ``--copy-method direct`` whatever the size.
    The bytes are the same either way."""
    from ckptkit.convert import ConvertOptions, convert
    from ckptkit.io import direct as directio

    monkeypatch.setattr(directio, "dirty_limit", lambda: None)  # the output's size alone never decides
    opts = ConvertOptions("hf", dtype="bfloat16")
    convert(source, tmp_path / "buffered", opts)
    if made_direct is not None:
        monkeypatch.setattr(directio, "MADE_DIRECT", made_direct)
    in_place, staged = [], []
    write_direct = directio._write_direct

    def spy(direct: directio.DirectFd, data: memoryview, offset: int) -> int:
        (staged if data.obj is directio.staging().obj else in_place).append(len(data))
        return write_direct(direct, data, offset)

    monkeypatch.setattr(directio, "_write_direct", spy)
    convert(source, tmp_path / "out", ConvertOptions("hf", dtype="bfloat16", copy_method=method))
    for f in (tmp_path / "buffered").iterdir():
        assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes(), f.name
    dequantized = 2 * LAYERS * (2 * HIDDEN * HIDDEN + 2 * 128 * HIDDEN + 3 * INTER * HIDDEN)  # bf16 bytes
    if method == "stream" or (made_direct is None and method == "auto"):
        assert not in_place and not staged
    else:  # all but the partial pages at each tensor's ends; the bf16 embeddings are copies (read into place)
        assert sum(in_place) > 0.99 * dequantized, (sum(in_place), dequantized)


@pytest.mark.skipif(not float_bits.LIKE_TORCH, reason="numpy's casts are torch's on x86-64 with AVX2 only")
def test_a_dequantizing_write_never_imports_torch(source: Path, tmp_path: Path) -> None:
    """FP8 weights and their float32 scales read from the source, dequantized and written
    without torch (its import alone costs more CPU than dequantizing an 8B layer)."""
    code = (
        "import sys; from pathlib import Path; from ckptkit.convert import ConvertOptions, convert; "
        f"convert(Path({str(source)!r}), Path({str(tmp_path / 'out')!r}), ConvertOptions('hf', dtype='bfloat16')); "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "False"


def test_pieces_written_by_a_lagging_worker_keep_their_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A piece's buffer is made into again (two pieces later) only once its write is done,
    however late the write comes: the same files as dequantizing each tensor whole."""
    import time

    from ckptkit.convert import ConvertOptions, convert
    from ckptkit.io import OutputFile
    from ckptkit.quant import scaled

    src = FIXTURES / "fp8" / "llama-overhang"
    opts = ConvertOptions("hf", dtype="bfloat16")
    convert(src, tmp_path / "whole", opts)
    monkeypatch.setattr(scaled, "CHUNK_ELEMENTS", 40)  # a row of the fixture's 40 columns
    monkeypatch.setattr(scaled, "PIECE_ELEMENTS", 120)  # 3 rows
    monkeypatch.setattr(scaled, "ALIGN", 2)  # each piece where the one two before it lay (not placed by page)
    write = OutputFile.write

    def late(self: OutputFile, *args: object, **kwargs: object) -> None:
        time.sleep(0.002)  # the main thread makes the next pieces meanwhile
        write(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(OutputFile, "write", late)
    convert(src, tmp_path / "pieces", opts)
    for f in (tmp_path / "whole").iterdir():
        assert (tmp_path / "pieces" / f.name).read_bytes() == f.read_bytes(), f.name


def test_only_pieces_written_as_pieces_count_for_direct(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Meta output split over two ranks writes its dequantized weights whole (a rank's part
    of each): none of its bytes count as made a piece at a time, so ``auto`` is not told to go
    direct for them; the same weights into one HF file do count."""
    from ckptkit import writing
    from ckptkit.convert import ConvertOptions, convert

    asked: list[tuple[int, int]] = []
    pays = writing.direct_pays
    monkeypatch.setattr(
        writing, "direct_pays", lambda nbytes, made=0: asked.append((nbytes, made)) or pays(nbytes, made)
    )
    convert(source, tmp_path / "meta", ConvertOptions("meta", dtype="bfloat16", shards=2))
    convert(source, tmp_path / "hf", ConvertOptions("hf", dtype="bfloat16"))
    dequantized = 2 * LAYERS * (2 * HIDDEN * HIDDEN + 2 * 128 * HIDDEN + 3 * INTER * HIDDEN)
    assert [made for _, made in asked] == [0, dequantized]
