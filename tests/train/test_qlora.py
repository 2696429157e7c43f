"""QLoRA: NF4 bases (torchao's tensor, QLoRA's blocks), PEFT adapters, the merge rule."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptkit.errors import CkptkitError
from ckptkit.train import nf4
from ckptkit.train.config import load_config, parse_config
from ckptkit.train.loop import RECIPES
from ckptkit.train.lora import apply_lora, lora_modules
from ckptkit.train.recipes import recipe_entry

from train_helpers import TOL, hf_dir, one_layer_llama

pytest.importorskip("torchao")
from torchao.quantization import to_nf4  # noqa: E402  (the reference: torchao's own API)

LINEARS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.output_proj", "mlp.w1", "mlp.w2", "mlp.w3")
HF = {"attn.q_proj": "self_attn.q_proj", "attn.v_proj": "self_attn.v_proj", "attn.k_proj": "self_attn.k_proj"}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer bf16 Llama whose linears NF4 can block (128 x 128 and 256 x 128)."""
    return one_layer_llama(tmp_path_factory.mktemp("qlora_base"), hidden=128, head_dim=32)


def _train(base: Path, out: Path, *extra: str) -> None:
    overrides = [
        f"checkpointer.checkpoint_dir={base}", f"checkpointer.output_dir={out}", "epochs=1",
        "max_steps_per_epoch=1", "dtype=bf16", "lora.targets=[q,v]", "quiet=true", *extra,
    ]  # fmt: skip
    recipe_entry("lora_finetune")(load_config("tiny_lora", overrides))


def _expected_merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    return (w.float() + (b.float() @ a.float()) * scaling).to(w.dtype)


def test_nf4_base_trains_only_adapters_on_torchao_s_tensors(base: Path) -> None:
    from ckptkit import open_checkpoint
    from ckptkit.train.transformer import build_model

    with open_checkpoint(base) as ckpt:
        model = build_model(ckpt.config, dtype=torch.bfloat16)
        model.load_state_dict({k: t.get() for k, t in ckpt.tensors.items()})
    apply_lora(model, targets=["q", "v"], rank=4, alpha=8)
    original = {f"layers.0.{n}.weight": model.get_submodule(f"layers.0.{n}").weight.clone() for n in LINEARS}
    keys = nf4.quantize_base(model)
    assert sorted(keys) == sorted(original)  # every decoder linear, not the output projection or embeddings
    for key, w in original.items():
        q = model.get_parameter(key)
        ref = to_nf4(w, 64, 256)
        assert nf4.is_nf4(q) and (q.block_size, q.scaler_block_size) == (64, 256)
        assert torch.equal(q.quantized_data, ref.quantized_data) and torch.equal(
            q.quantized_scalers, ref.quantized_scalers
        )
        assert not q.requires_grad
    assert not nf4.is_nf4(model.output.weight)
    q_proj = lora_modules(model)["layers.0.attn.q_proj"]
    torch.nn.init.normal_(q_proj.lora_b)
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    deq = to_nf4(original["layers.0.attn.q_proj.weight"], 64, 256).get_original_weight()
    update = (x.float() @ q_proj.lora_a.T @ q_proj.lora_b.T) * q_proj.scaling
    assert torch.equal(q_proj(x), (torch.nn.functional.linear(x, deq).float() + update).to(torch.bfloat16))
    ids = torch.randint(0, 384, (2, 16))
    model(ids).float().sum().backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None} == {
        f"layers.0.{n}.lora_{ab}" for n in ("attn.q_proj", "attn.v_proj") for ab in "ab"
    }


@pytest.fixture(scope="module")
def trained(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The last checkpoint folder of a QLoRA run (default merge)."""
    out = tmp_path_factory.mktemp("qlora_out")
    _train(base, out, "quantize_base=nf4")
    return sorted(out.glob("epoch_*"))[-1]


def test_merge_adds_the_adapter_to_the_dequantized_nf4_base_or_the_original(
    base: Path, trained: Path, tmp_path: Path
) -> None:
    _train(base, tmp_path / "orig", "lora.quantize_base=true", "lora.merge_base=original")
    final = trained
    adapter = load_file(final / "adapter" / "adapter_model.safetensors")
    cfg = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert sorted(cfg["target_modules"]) == ["q_proj", "v_proj"] and cfg["peft_type"] == "LORA"
    scaling = cfg["lora_alpha"] / cfg["r"]
    orig = load_file(base / "model.safetensors")
    merged_nf4 = load_file(next(final.glob("*.safetensors")))
    merged_orig = load_file(next(sorted((tmp_path / "orig").glob("epoch_*"))[-1].glob("*.safetensors")))
    other_adapter = load_file(sorted((tmp_path / "orig").glob("epoch_*"))[-1] / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(adapter[k], other_adapter[k]) for k in adapter)  # same training, same adapter
    for ours, hf in (("attn.q_proj", "self_attn.q_proj"), ("mlp.w1", "mlp.gate_proj")):
        key = f"model.layers.0.{hf}.weight"
        deq = to_nf4(orig[key], 64, 256).get_original_weight().to(torch.bfloat16)
        if ours in HF:
            prefix = f"base_model.model.model.layers.0.{hf}"
            a, b = adapter[f"{prefix}.lora_A.weight"], adapter[f"{prefix}.lora_B.weight"]
            assert b.abs().max() > 0  # the adapter trained
            assert torch.equal(merged_nf4[key], _expected_merge(deq, a, b, scaling))
            assert torch.equal(merged_orig[key], _expected_merge(orig[key], a, b, scaling))
        else:  # quantized, not adapted: the merges differ by exactly (dequantized NF4 - original)
            assert torch.equal(merged_nf4[key] - merged_orig[key], deq - orig[key])
            assert not torch.equal(deq, orig[key])
    assert torch.equal(merged_nf4["lm_head.weight"], orig["lm_head.weight"])


def test_qlora_config_spellings_and_mistakes() -> None:
    schema = RECIPES["lora_finetune"][0]
    for value in ("nf4", "true"):
        assert parse_config(load_config("tiny_lora", [f"quantize_base={value}"]), schema).lora.quantize_base == "nf4"
    cfg = parse_config(load_config("tiny_lora", ["lora.quantize_base=false"]), schema)
    assert (cfg.lora.quantize_base, cfg.lora.merge_base) == (None, "nf4")
    with pytest.raises(CkptkitError, match="quantize_base must be nf4, true or false, not 'int4'"):
        parse_config(load_config("tiny_lora", ["lora.quantize_base=int4"]), schema)
    distributed = load_config("tiny_lora_distributed", ["quantize_base=nf4"])
    assert parse_config(distributed, RECIPES["lora_finetune_distributed"][0]).lora.quantize_base == "nf4"


def test_fsdp2_refuses_nf4_shards_without_whole_blocks() -> None:
    with torch.device("meta"):
        model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([torch.nn.Linear(256, 256, bias=False)])})
    model.requires_grad_(False)
    assert nf4.quantize_base(model) == ["layers.0.weight"]
    nf4.check_shardable(model, 2)  # 65536 values: two shards of 2 x 16384
    with pytest.raises(CkptkitError, match=r"^layers.0.weight \(256, 256\) does not split into 8 NF4 shards of "):
        nf4.check_shardable(model, 8)
    with pytest.raises(CkptkitError, match="quantize_base under FSDP2 needs 2 or more processes; run lora_finetune"):
        nf4.check_shardable(model, 1)


def test_without_torchao_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao.quantization.quantize_.workflows.nf4", None)
    with pytest.raises(CkptkitError, match=r"^quantize_base=nf4 needs torchao: pip install 'ckptkit\[qlora\]'$"):
        nf4.to_nf4(torch.zeros(128, 128))


def test_a_weight_nf4_cannot_block_is_named() -> None:
    from train_helpers import native_model

    model = native_model("llama2")  # 64 x 64 projections: 4096 values, under one scaler block
    apply_lora(model)
    with pytest.raises(CkptkitError, match=r"layers.0.attn.q_proj.weight \(64, 64\) is not a multiple of 16384"):
        nf4.quantize_base(model)


def _peft_on_the_dequantized_base(base: Path, adapter: Path) -> torch.nn.Module:
    """transformers' model of ``base`` in float32, its decoder linears replaced by their
    dequantized NF4 weights (the base the adapter trained on), with PEFT's ``adapter`` loaded."""
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for module in model.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                deq = to_nf4(module.weight.to(torch.bfloat16), 64, 256).get_original_weight()
                module.weight.copy_(deq.float())
    return PeftModel.from_pretrained(model, adapter).eval()


def test_peft_loads_the_adapter_on_the_dequantized_base_like_the_merged_model(base: Path, trained: Path) -> None:
    import transformers

    merged = transformers.AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32)
    peft = _peft_on_the_dequantized_base(base, trained / "adapter")
    ids = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (peft(ids).logits - merged(ids).logits).abs().max().item()
    assert diff < 2e-3  # measured 8.4e-4: the merged weights are rounded to bf16 once, PEFT's are not


# Qwen3.5-27B's QLoRA config on a tiny qwen3_5 whose decoder linears are whole NF4 blocks
# (fixtures/hf/qwen3_5-nf4: Gated DeltaNet in layer 0, gated full attention in layer 1).
QWEN_NF4 = hf_dir("qwen3_5-nf4")
ON_THE_FIXTURE = ["device=cpu", "dataset.source=tiny_alpaca", "dataset.max_seq_len=64", "batch_size=2",
                  "gradient_accumulation_steps=1", "max_steps_per_epoch=2", "quiet=true",
                  "optimizer.lr=1e-2", "lr_scheduler.warmup_steps=0"]  # fmt: skip  # adapters that move the logits


@pytest.fixture(scope="module")
def qwen27(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The last checkpoint of ``qwen3_5_27B_qlora`` (its bf16, targets and NF4) run on the fixture."""
    cfg = parse_config(load_config("qwen3_5_27B_qlora"), RECIPES["lora_finetune"][0])
    assert (cfg.device, cfg.dtype, cfg.checkpointer.model_type) == ("cuda", "bf16", "qwen3_5")
    assert (cfg.lora.quantize_base, cfg.lora.merge_base) == ("nf4", "nf4")
    out = tmp_path_factory.mktemp("qwen27")
    overrides = [*ON_THE_FIXTURE, f"checkpointer.checkpoint_dir={QWEN_NF4}", f"checkpointer.output_dir={out}"]
    recipe_entry("lora_finetune")(load_config("qwen3_5_27B_qlora", overrides))
    return out / "epoch_0"


def test_qwen3_5_27B_qlora_merges_into_the_input_layout_on_the_dequantized_base(qwen27: Path) -> None:
    from conftest import raw_layout

    def layout(root: Path) -> dict[str, list[tuple[str, torch.dtype, tuple[int, ...]]]]:
        return {f: [(k, t.dtype, tuple(t.shape)) for k, t in tensors] for f, tensors in raw_layout(root).items()}

    assert layout(qwen27) == layout(QWEN_NF4)  # files, names in order, dtypes, shapes
    cfg = json.loads((qwen27 / "adapter" / "adapter_config.json").read_text())
    assert sorted(cfg["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj",
         "gate_proj", "up_proj", "down_proj"]
    )  # fmt: skip
    adapter = load_file(qwen27 / "adapter" / "adapter_model.safetensors")
    scaling = cfg["lora_alpha"] / cfg["r"]
    orig = {k: v for f in sorted(QWEN_NF4.glob("*.safetensors")) for k, v in load_file(f).items()}
    merged = {k: v for f in sorted(qwen27.glob("*.safetensors")) for k, v in load_file(f).items()}
    kinds = {"adapted": 0, "quantized": 0, "as read": 0}
    for key, w in orig.items():
        stem = key.removesuffix(".weight")
        if ".layers." in key and w.dim() == 2:  # every decoder linear: NF4 whole blocks
            deq = to_nf4(w, 64, 256).get_original_weight()
            a = adapter.get(f"base_model.model.{stem}.lora_A.weight")
            if a is None:  # in_proj_a / in_proj_b: quantized, not adapted
                assert torch.equal(merged[key], deq), key
                kinds["quantized"] += 1
            else:
                b = adapter[f"base_model.model.{stem}.lora_B.weight"]
                assert b.abs().max() > 0 and torch.equal(merged[key], _expected_merge(deq, a, b, scaling)), key
                kinds["adapted"] += 1
        else:  # embeddings, norms, conv1d, A_log, dt_bias, the output projection: as read
            assert torch.equal(merged[key], w), key
            kinds["as read"] += 1
    assert kinds == {"adapted": 2 * 3 + 3 + 4, "quantized": 2, "as read": len(orig) - 15}


def test_qwen3_5_27B_qlora_adapter_loads_in_peft_and_merges_as_peft_does(qwen27: Path) -> None:
    from ckptkit.train.peft_io import load_adapter
    from ckptkit.train.transformer import load_model

    peft = _peft_on_the_dequantized_base(QWEN_NF4, qwen27 / "adapter")
    ours = load_model(str(QWEN_NF4), dtype=torch.float32)
    with torch.no_grad():
        for name in nf4.quantized_linears(ours):  # the same dequantized base, in ckptkit's model
            weight = ours.get_submodule(name).weight
            weight.copy_(to_nf4(weight.to(torch.bfloat16), 64, 256).get_original_weight().float())
    ids = torch.randint(3, 384, (2, 70), generator=torch.Generator().manual_seed(1))  # two delta-rule chunks
    with torch.no_grad():
        plain = ours.eval()(ids)
        ours = load_adapter(ours, qwen27 / "adapter").eval()
        want = peft(ids).logits
        same = (ours(ids) - want).abs().max().item()
        moved = (plain - want).abs().max().item()
    theirs = {f"model.{k}": v for k, v in peft.merge_and_unload().model.state_dict().items()}
    merged = {k: v for f in sorted(qwen27.glob("*.safetensors")) for k, v in load_file(f).items()}
    off = {k: int((merged[k] != theirs[k].to(torch.bfloat16)).sum()) for k in merged if k.startswith("model.")}
    assert same <= TOL and moved > 1e-2  # measured 1.1e-6 and 2.1
    assert not any(off.values()), off  # PEFT's merge on the dequantized base, rounded to bf16 once


def test_weights_that_are_not_whole_nf4_blocks_are_one_line(tmp_path: Path) -> None:
    from train_helpers import ckptkit

    old = hf_dir("qwen3_5")  # the 40-wide fixture
    result = ckptkit("run", "lora_finetune", "--config", "qwen3_5_27B_qlora", *ON_THE_FIXTURE,
                     f"checkpointer.checkpoint_dir={old}", f"checkpointer.output_dir={tmp_path / 'out'}")  # fmt: skip
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "error: layers.0.linear_attn.in_proj_qkv.weight (64, 40) is not a multiple of 16384 values; "
        "NF4 cannot quantize it"
    ]
    assert list(tmp_path.iterdir()) == []


def test_one_device_quantizes_each_weight_as_it_is_placed() -> None:
    """The 16-bit decoder is never on the device whole: each weight is NF4 once placed."""
    from ckptkit import open_checkpoint
    from ckptkit.train.placement import SingleDevice
    from ckptkit.train.transformer import build_model

    cfg = parse_config(load_config("qwen3_5_27B_qlora", ON_THE_FIXTURE), RECIPES["lora_finetune"][0])
    with open_checkpoint(QWEN_NF4) as ckpt:
        model = build_model(ckpt.config, device="meta", dtype=torch.bfloat16).requires_grad_(False)
        keys = nf4.quantize_base(model)  # the NF4 layout, on the meta device
        SingleDevice(cfg).place(model, lambda k: ckpt.tensors[k].get())
        for key in keys:
            q, ref = model.get_parameter(key), to_nf4(ckpt.tensors[key].get(), 64, 256)
            assert nf4.is_nf4(q) and torch.equal(q.quantized_data, ref.quantized_data), key
            assert torch.equal(q.quantized_scalers, ref.quantized_scalers), key
    assert not nf4.is_nf4(model.output.weight) and len(keys) == 15
