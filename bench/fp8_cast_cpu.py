"""Run DeepSeek's ``inference/fp8_cast_bf16.py`` unmodified on a CPU, for ``bench/quant.py``.

The script imports ``weight_dequant`` from its Triton ``kernel.py`` and loads every file with
``device="cuda"``; neither runs without a GPU. This runner puts a stand-in ``kernel`` module in
``sys.modules`` whose ``weight_dequant`` is a plain torch CPU version of the same recipe (the
FP8 values widened to float32, times the float32 scale of their 128 x 128 block, one cast to
the default dtype the script sets, bfloat16), makes ``safetensors.torch.load_file`` load to
the CPU, and runs the script as ``__main__``. Run::

    python bench/fp8_cast_cpu.py PATH/TO/fp8_cast_bf16.py --input-fp8-hf-path SRC --output-bf16-hf-path OUT
"""

from __future__ import annotations

import runpy
import sys
import types

import safetensors.torch
import torch


def weight_dequant(x: torch.Tensor, s: torch.Tensor, block_size: int = 128) -> torch.Tensor:
    """``x`` (M x N, FP8) times its blocks' scales ``s`` in float32, cast once to the default dtype;
    one row of blocks at a time, blocks overhanging the tensor cropped."""
    assert x.dim() == 2 and s.dim() == 2, "Input tensors must have 2 dimensions"
    rows, cols = x.shape
    y = torch.empty(rows, cols, dtype=torch.get_default_dtype())
    for i in range(0, rows, block_size):
        scale = s[i // block_size].repeat_interleave(block_size)[:cols]
        y[i : i + block_size] = x[i : i + block_size].to(torch.float32) * scale
    return y


def main() -> None:
    script, *argv = sys.argv[1:]
    kernel = types.ModuleType("kernel")
    kernel.weight_dequant = weight_dequant  # type: ignore[attr-defined]
    sys.modules["kernel"] = kernel
    load_file = safetensors.torch.load_file
    safetensors.torch.load_file = lambda path, device="cpu": load_file(path, device="cpu")
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
