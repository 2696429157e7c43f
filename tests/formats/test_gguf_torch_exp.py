"""Qwen3.5's and Qwen3-Next's ``ssm_a`` (``-exp(A_log)``) without torch: numpy's value equals
the one llama.cpp's converter computes with torch at every bfloat16 input, and a conversion of
these families to GGUF does not import torch at all."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from ckptkit.convert import ConvertOptions, convert
from ckptkit.formats.gguf.torch_exp import neg_exp_bf16
from ckptkit.formats.gguf.torch_exp_table import EXCEPTIONS, TORCH

from conftest import FIXTURES


def test_neg_exp_is_torchs_at_every_bfloat16_input() -> None:
    bits = np.arange(1 << 16, dtype=np.uint16)
    x = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)
    theirs = (-torch.exp(x.float())).numpy().view(np.uint32)  # as llama.cpp's converter: widened, then exp
    ours = neg_exp_bf16(bits).view(np.uint32)
    differ = np.nonzero(ours != theirs)[0]
    assert differ.size == 0, (
        f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}) differs at bfloat16 inputs "
        f"{[hex(i) for i in differ[:8]]} from the table made with torch {TORCH}: "
        "run fixtures/make_torch_exp_table.py"
    )
    assert len(EXCEPTIONS) == 45  # torch's exp is not correctly rounded there (measured)


def test_hybrid_qwen_to_gguf_does_not_import_torch(tmp_path: str) -> None:
    code = (
        "import sys\n"
        "from ckptkit.convert import ConvertOptions, convert\n"
        "for name in ('qwen3_5', 'qwen3_5_moe'):\n"
        f"    convert({str(FIXTURES / 'hf')!r} + '/' + name, {str(tmp_path)!r} + f'/{{name}}.gguf',"
        " ConvertOptions('gguf', gguf_pre='qwen2'))\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"


def test_a_float32_a_log_is_torchs_exp_of_it(tmp_path: Path) -> None:
    """Qwen3.5's releases store ``A_log`` in float32 (Qwen3.6's in bfloat16): its ``-exp`` is
    torch's, in float32, as llama.cpp's converter computes it (value heads tiled: 2 key heads,
    4 value heads)."""
    from gguf import GGUFReader
    from safetensors.torch import load_file, save_file

    src = tmp_path / "qwen3_5"
    shutil.copytree(FIXTURES / "hf" / "qwen3_5", src)
    a_log = {}
    for shard in src.glob("*.safetensors"):
        tensors = load_file(shard)
        wide = {k: v.float() for k, v in tensors.items() if k.endswith(".A_log")}
        a_log |= wide
        save_file(tensors | wide, shard, metadata={"format": "pt"})
    convert(src, tmp_path / "m.gguf", ConvertOptions("gguf", gguf_pre="qwen2"))
    got = {t.name: torch.from_numpy(t.data.copy()) for t in GGUFReader(tmp_path / "m.gguf").tensors}
    assert sorted(a_log) == [f"model.layers.{i}.linear_attn.A_log" for i in (0, 2)]
    for i in (0, 2):
        want = -torch.exp(a_log[f"model.layers.{i}.linear_attn.A_log"])[[0, 2, 1, 3]]
        assert got[f"blk.{i}.ssm_a"].dtype == torch.float32 and torch.equal(got[f"blk.{i}.ssm_a"], want)
