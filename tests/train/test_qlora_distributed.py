"""QLoRA (an NF4 base sharded by FSDP2) and DoRA on 2 gloo processes, against one device.

One tiny base serves both: one decoder layer whose linears NF4 can shard in two (every
weight a multiple of 2 x 64 x 256 values, torchao's block sizes per rank). float32 runs:
losses as test_distributed.py bounds them, adapters within its ADAPTER_ATOL; each run's
merged weights are its own adapter merged into the base the rule names (QLoRA: the
dequantized NF4 weight), so the two runs' merged weights differ only by what their adapters
do. Under FSDP2 the recipe state (the sharded DCP save) holds the adapters alone.
Measured: per-step losses 8e-8 (QLoRA) and 1.7e-7 (DoRA) relative, adapters 1.2e-5 and
3.0e-5 apart; QLoRA merges bitwise the rule's, DoRA merges within one bf16 step (0 or 1).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_distributed import ADAPTER_ATOL, assert_close_losses, bf16_ulps, losses, run_single, torchrun

from ckptkit.formats.dcp import state_keys

from train_helpers import one_layer_llama

pytest.importorskip("torchao")
from torchao.quantization import to_nf4  # noqa: E402  (the reference: torchao's own API)

COMMON = ["epochs=1", "max_steps_per_epoch=3", "dtype=fp32", "quiet=true", "save_every_n_steps=2",
          "dataset.max_seq_len=64", "lora.targets=[q,v,down]"]  # fmt: skip


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer bf16 Llama, hidden size 256, 4 heads of 64."""
    return one_layer_llama(tmp_path_factory.mktemp("fsdp_qlora_base"), hidden=256, head_dim=64)


def one_and_two(base: Path, out: Path, *extra: str) -> tuple[Path, Path]:
    """The same run on one device (global batch 8) and on 2 processes (4 each); their epoch_0."""
    common = [*COMMON, f"checkpointer.checkpoint_dir={base}", *extra]
    run_single("lora_finetune", "tiny_lora", *common, f"checkpointer.output_dir={out / 'one'}")
    target = ["-m", "ckptkit.train.recipes.lora_finetune_distributed"]
    torchrun(target, "--config", "tiny_lora_distributed", *common, f"checkpointer.output_dir={out / 'two'}")
    assert_close_losses(losses(out / "one"), losses(out / "two"))
    # the sharded save of a frozen base: the adapters' shards only, no base weight
    saved = {k for k in state_keys(out / "two" / "step_2" / "recipe_state") if k.startswith("model.")}
    assert saved and all(k.endswith((".lora_a", ".lora_b", ".lora_magnitude")) for k in saved), saved
    return out / "one" / "epoch_0", out / "two" / "epoch_0"


def adapters_and_merges(one: Path, two: Path) -> tuple[dict, dict, dict, dict]:
    a, b = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (one, two))
    assert list(a) == list(b) and max((a[k] - b[k]).abs().max().item() for k in a) < ADAPTER_ATOL
    m1, m2 = (load_file(d / "model.safetensors") for d in (one, two))
    assert list(m1) == list(m2) and all(m1[k].dtype == m2[k].dtype == torch.bfloat16 for k in m1)
    return a, b, m1, m2


def lora_merge(w: torch.Tensor, adapter: dict, key: str) -> torch.Tensor:
    """PEFT's LoRA merge (alpha 32 / rank 16 of tiny_lora) into ``w``, rounded to bf16."""
    prefix = "base_model.model." + key.removesuffix(".weight")
    a, b = adapter[f"{prefix}.lora_A.weight"], adapter[f"{prefix}.lora_B.weight"]
    return (w.float() + 2.0 * (b.float() @ a.float())).to(torch.bfloat16)


@pytest.mark.slow
def test_qlora_on_two_processes_matches_one_device_and_merges_into_the_nf4_base(base: Path, tmp_path: Path) -> None:
    one, two = one_and_two(base, tmp_path, "quantize_base=nf4")
    adapters = adapters_and_merges(one, two)
    orig = load_file(base / "model.safetensors")
    for run, adapter, merged in ((one, adapters[0], adapters[2]), (two, adapters[1], adapters[3])):
        for key, w in orig.items():
            if ".layers." not in key or key.endswith("layernorm.weight"):
                assert torch.equal(merged[key], w), (run, key)
                continue
            deq = to_nf4(w.float(), 64, 256).get_original_weight()  # the base the adapter trained on
            adapted = any(f".{n}." in key for n in ("q_proj", "v_proj", "down_proj"))
            expected = lora_merge(deq, adapter, key) if adapted else deq.to(torch.bfloat16)
            assert torch.equal(merged[key], expected), (run, key)


@pytest.mark.slow
def test_dora_on_two_processes_matches_one_device(base: Path, tmp_path: Path) -> None:
    one, two = one_and_two(base, tmp_path, "lora.use_dora=true")
    a, b, m1, m2 = adapters_and_merges(one, two)
    assert any(k.endswith("lora_magnitude_vector") for k in a)
    orig = load_file(base / "model.safetensors")
    for adapter, merged in ((a, m1), (b, m2)):  # each run's merge is DoRA's of its own adapter
        for key, w in orig.items():
            prefix = "base_model.model." + key.removesuffix(".weight")
            if f"{prefix}.lora_magnitude_vector" not in adapter:
                assert torch.equal(merged[key], w), key
                continue
            v = w.float() + 2.0 * (adapter[f"{prefix}.lora_B.weight"] @ adapter[f"{prefix}.lora_A.weight"])
            expected = adapter[f"{prefix}.lora_magnitude_vector"][:, None] * v / v.norm(dim=1, keepdim=True)
            assert bf16_ulps(merged[key], expected.to(torch.bfloat16)) <= 1, key  # float32 sums in another order
