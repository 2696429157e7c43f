"""Qwen3.5's and Qwen3-Next's ``ssm_a`` (``-exp(A_log)``) without torch: numpy's value equals
the one llama.cpp's converter computes with torch at every bfloat16 input, and a conversion of
these families to GGUF does not import torch at all."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import torch

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
