"""A quantized release is a LoRA base: block FP8 (the Qwen3 fixture, transformers' quantizer)
and gpt-oss's MXFP4 experts train dequantized by the reference recipe, and the merged model
goes back quantized as the input is (a changed weight quantized afresh, ``amax / 448`` per
block; an unchanged one keeps its bytes), or in bf16 with ``lora.merge_dtype: bf16``.

References: transformers' dequantizing loaders (``FineGrainedFP8Config(dequantize=True)``)
and PEFT on the same dequantized base; the block quantization formula written out here."""

from __future__ import annotations

import functools
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptkit.train.checkpointer import Checkpointer
from ckptkit.train.config import load_config
from ckptkit.train.lora import apply_lora, base_state_dict
from ckptkit.train.peft_io import load_adapter
from ckptkit.train.recipes import recipe_entry
from ckptkit.train.schema import CheckpointerConfig
from ckptkit.train.transformer import build_model, load_model

from train_helpers import FIXTURES

FP8 = FIXTURES / "fp8" / "qwen3"
MXFP4 = FIXTURES / "mxfp4" / "gpt_oss"
BLOCK = 16  # the Qwen3 fixture's weight_block_size
TARGETS = "lora.targets=[q,v,down]"
TARGETED = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
COMMON = ["epochs=1", "max_steps_per_epoch=3", "quiet=true", "batch_size=4", "dataset.max_seq_len=48"]


def train(base: Path, out: Path, *overrides: str) -> Path:
    """The final checkpoint folder of a tiny LoRA run on ``base``."""
    more = [f"checkpointer.checkpoint_dir={base}", f"checkpointer.output_dir={out}", *overrides]
    recipe_entry("lora_finetune")(load_config("tiny_lora", [*COMMON, *more]))
    return out / "epoch_0"


def losses(run: Path) -> list[float]:
    lines = [json.loads(line) for line in (run.parent / "metrics.jsonl").read_text().splitlines()]
    return [line["loss"] for line in lines if "loss" in line]


def stored(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def hf_fp8(folder: Path) -> torch.nn.Module:
    """transformers' model of an FP8 folder, dequantized to float32 by its own loader."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    config = FineGrainedFP8Config(weight_block_size=[BLOCK, BLOCK], dequantize=True)
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, dtype=torch.float32).eval()


@functools.cache
def fp8_source() -> dict[str, torch.Tensor]:
    """The Qwen3 FP8 fixture as transformers dequantizes it (float32)."""
    return {k: v.detach() for k, v in hf_fp8(FP8).state_dict().items()}


def block_fp8(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The published block-FP8 recipe: ``scale_inv = amax / 448`` per block, e4m3 of the quotient."""
    rows, cols = values.shape
    blocks = values.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.reshape(rows, cols), scale


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(FP8, tmp_path_factory.mktemp("fp8") / "run", TARGETS)


def test_lora_trains_on_an_fp8_base_and_its_merge_is_requantized_fp8(fp8_run: Path) -> None:
    """The loss moves; the merged model is block FP8 under the source's quantization_config:
    each targeted weight is the block recipe applied to (transformers' dequantized source +
    the adapter's delta), every other tensor keeps its bytes; transformers loads it."""
    assert len(set(losses(fp8_run))) == 3  # the loss moves, and the adapter with it
    source, merged = stored(FP8), stored(fp8_run)
    assert sorted(merged) == sorted(source)
    assert (
        json.loads((fp8_run / "config.json").read_text())["quantization_config"]
        == json.loads((FP8 / "config.json").read_text())["quantization_config"]
    )
    base = fp8_source()
    adapter = load_file(fp8_run / "adapter" / "adapter_model.safetensors")
    scaling = 32 / 16  # tiny_lora: alpha 32, rank 16
    changed = 0
    for name, tensor in source.items():
        module = name.removeprefix("model.").removesuffix(".weight")
        if name.endswith(".weight") and module.split(".", 2)[-1] in TARGETED:
            a = adapter[f"base_model.model.model.{module}.lora_A.weight"]
            b = adapter[f"base_model.model.model.{module}.lora_B.weight"]
            q, scale = block_fp8(base[name] + (b @ a) * scaling)
            assert torch.equal(merged[name].view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(merged[name + "_scale_inv"], scale), name
            changed += 1
        elif not name.endswith(tuple(f"{t}.weight_scale_inv" for t in TARGETED)):
            assert torch.equal(merged[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert changed == 6
    hf_fp8(fp8_run)  # loads


def test_the_adapter_loads_in_peft_on_the_dequantized_fp8_base_with_equal_outputs(fp8_run: Path) -> None:
    """PEFT on transformers' dequantized FP8 base gives the logits of the native model with the
    adapter on ckptkit's dequantization of the same base (float32)."""
    from peft import PeftModel

    ids = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(0))
    peft = PeftModel.from_pretrained(hf_fp8(FP8), fp8_run / "adapter").eval()
    native = load_adapter(load_model(str(FP8), dtype=torch.float32), fp8_run / "adapter").eval()
    with torch.no_grad():
        diff = (peft(ids).logits - native(ids)).abs().max().item()
    assert diff == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_zero_adapter_merges_into_the_fp8_source_bytes(dtype: torch.dtype, tmp_path: Path) -> None:
    """With B = 0 (a fresh adapter) the merged model written back is the source, byte for
    byte, whether the base was dequantized to float32 or bf16."""
    checkpointer = Checkpointer(
        CheckpointerConfig(checkpoint_dir=str(FP8), output_dir=str(tmp_path)), base_dtype=str(dtype).split(".")[1]
    )
    with checkpointer.open_base() as base:
        model = build_model(base.config, dtype=dtype)
        model.load_state_dict({k: v.get() for k, v in base.tensors.items()})
    apply_lora(model, ["q", "k", "v", "o", "gate", "up", "down"])
    (tmp_path / "out").mkdir()
    checkpointer.write_model(tmp_path / "out", base_state_dict(model, merged=True))
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (FP8 / "model.safetensors").read_bytes()


def test_merge_dtype_bf16_writes_the_merge_dequantized(fp8_run: Path, tmp_path: Path) -> None:
    """``lora.merge_dtype: bf16``: no quantization_config, every weight bf16: the targeted ones
    the float32 merge rounded once, the others the dequantized source."""
    run = train(FP8, tmp_path / "run", TARGETS, "lora.merge_dtype=bf16")
    assert "quantization_config" not in json.loads((run / "config.json").read_text())
    merged, quantized = stored(run), stored(fp8_run)
    assert not any(k.endswith("_scale_inv") for k in merged)
    base = fp8_source()
    adapter = load_file(run / "adapter" / "adapter_model.safetensors")
    for name, tensor in merged.items():
        assert tensor.dtype == torch.bfloat16, name
        module = name.removeprefix("model.").removesuffix(".weight")
        if module.split(".", 2)[-1] in TARGETED:
            a = adapter[f"base_model.model.model.{module}.lora_A.weight"]
            b = adapter[f"base_model.model.model.{module}.lora_B.weight"]
            want = (base[name] + (b @ a) * 2.0).to(torch.bfloat16)
        else:
            want = base[name].to(torch.bfloat16)
        assert torch.equal(tensor, want), name
    assert len(merged) == len([k for k in quantized if not k.endswith("_scale_inv")])


def test_lora_on_an_mxfp4_gpt_oss_base_keeps_its_experts_bytes(tmp_path: Path) -> None:
    """gpt-oss's MXFP4 experts are read dequantized (the native decoder runs them); LoRA on the
    attention trains, and the merged model keeps every expert block and scale as stored."""
    run = train(MXFP4, tmp_path / "run", "lora.targets=[q,v]", "max_steps_per_epoch=2")
    first, *_, last = losses(run)
    assert first != last
    source, merged = stored(MXFP4), stored(run)
    names = sorted(source)
    assert sorted(merged) == names
    experts = [n for n in names if n.endswith(("_blocks", "_scales"))]
    assert experts and all(torch.equal(merged[n], source[n]) for n in experts)
    changed = [n for n in names if not torch.equal(merged[n].view(torch.uint8), source[n].view(torch.uint8))]
    assert changed == [n for n in names if n.endswith(("q_proj.weight", "v_proj.weight"))]
    assert math.isfinite(last)


def test_a_ue8m0_fp8_base_merges_back_with_power_of_two_e8m0_scales(tmp_path: Path) -> None:
    """DeepSeek V3.1's ``scale_fmt: ue8m0`` (scales stored F8_E8M0): a changed weight's new
    scales are ``2 ** ceil(log2(amax / 448))`` per block (cropped 20 x 20 blocks), stored as
    the input stores them; the weights the merge leaves keep their bytes."""
    from test_fp8 import LLAMA, _edit_config, _with_tensors

    src = shutil.copytree(LLAMA, tmp_path / "src")
    _edit_config(src, scale_fmt="ue8m0")
    scales = {k: v for k, v in load_file(LLAMA / "model.safetensors").items() if k.endswith("_scale_inv")}
    _with_tensors(
        src,
        **{k.replace(".", "__"): torch.exp2(torch.log2(v).round()).to(torch.float8_e8m0fnu) for k, v in scales.items()},
    )
    checkpointer = Checkpointer(CheckpointerConfig(checkpoint_dir=str(src), output_dir=str(tmp_path)))
    with checkpointer.open_base() as base:
        model = build_model(base.config)
        model.load_state_dict({k: v.get() for k, v in base.tensors.items()})
    apply_lora(model, ["down"], rank=2)
    torch.nn.init.normal_(model.layers[0].mlp.w2.lora_b, std=0.05)
    state = base_state_dict(model, merged=True)
    (tmp_path / "out").mkdir()
    checkpointer.write_model(tmp_path / "out", state)
    source, merged = stored(src), stored(tmp_path / "out")
    name = "model.layers.0.mlp.down_proj.weight"
    want = state["layers.0.mlp.w2.weight"]
    amax = torch.zeros(math.ceil(want.shape[0] / 20), math.ceil(want.shape[1] / 20))
    for i in range(amax.shape[0]):
        for j in range(amax.shape[1]):
            amax[i, j] = want[i * 20 : (i + 1) * 20, j * 20 : (j + 1) * 20].abs().max()
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    assert merged[name + "_scale_inv"].dtype == torch.float8_e8m0fnu
    assert torch.equal(merged[name + "_scale_inv"].float(), scale)
    per_element = scale.repeat_interleave(20, 0).repeat_interleave(20, 1)[: want.shape[0], : want.shape[1]]
    assert torch.equal(merged[name].view(torch.uint8), (want / per_element).to(torch.float8_e4m3fn).view(torch.uint8))
    for key, tensor in source.items():
        if not key.startswith(name):
            assert torch.equal(merged[key].view(torch.uint8), tensor.view(torch.uint8)), key


def test_a_changed_weight_of_a_method_ckptkit_cannot_quantize_is_one_line(tmp_path: Path) -> None:
    """An NVFP4 base (modelopt) trains dequantized; writing a changed weight back in NVFP4 is
    refused in one line naming ``lora.merge_dtype: bf16``, which writes it."""
    from ckptkit.errors import CkptkitError

    nvfp4 = FIXTURES / "modelopt" / "nvfp4"
    checkpointer = Checkpointer(CheckpointerConfig(checkpoint_dir=str(nvfp4), output_dir=str(tmp_path)))
    with checkpointer.open_base() as base:
        model = build_model(base.config)
        model.load_state_dict({k: v.get() for k, v in base.tensors.items()})
    apply_lora(model, ["q"], rank=2)
    torch.nn.init.normal_(model.layers[0].attn.q_proj.lora_b, std=0.05)
    state = base_state_dict(model, merged=True)
    (tmp_path / "out").mkdir()
    with pytest.raises(
        CkptkitError, match=r"^modelopt weights cannot be quantized again by ckptkit; .*merge_dtype: bf16\)$"
    ):
        checkpointer.write_model(tmp_path / "out", state)
    checkpointer.merge_dtype = "bfloat16"
    checkpointer.write_model(tmp_path / "out", state)
    merged = stored(tmp_path / "out")
    assert torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"], state["layers.0.attn.q_proj.weight"].bfloat16()
    )


def test_merge_of_the_adapter_into_the_fp8_base_is_the_run_s_merged_model(fp8_run: Path, tmp_path: Path) -> None:
    """``ckptkit merge`` of the run's adapter into the FP8 base writes the run's merged model, byte for byte."""
    from train_helpers import ckptkit

    result = ckptkit("merge", str(FP8), str(fp8_run / "adapter"), str(tmp_path / "merged"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "merged" / "model.safetensors").read_bytes() == (fp8_run / "model.safetensors").read_bytes()
