"""Newer families (qwen3, qwen3_moe, mixtral, gemma2, gemma3_text, olmo2): detection,
bitwise round trips in both expert layouts, the expert-layout traps, and logits of the
native model equal to transformers' (routing ties included)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ckptkit.checkpoint import open_checkpoint
from ckptkit.errors import CkptkitError

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
HF = ["qwen3", "qwen3_moe", "qwen3_moe-stacked", "mixtral", "mixtral-stacked", "gemma2", "gemma3_text", "olmo2"]
TYPES = {"qwen3_moe-stacked": "qwen3_moe", "mixtral-stacked": "mixtral"}
# Max |logits difference| from transformers' eager attention in float32, as measured: 0 where
# both run the same eager attention (Gemma 2 soft-caps its scores: no SDPA on either side); at
# most 8.1e-7 elsewhere (olmo2; qwen3 4.2e-7, mixtral 3.6e-7, gemma3_text 6.9e-7), SDPA's sums.
PARITY = {"gemma2": 0.0}
PARITY_SDPA = 1e-6


def _convert(src: Path, dst: Path, to: str) -> None:
    from typer.testing import CliRunner

    from ckptkit.cli import app

    result = CliRunner().invoke(app, ["convert", str(src), str(dst), "--to", to, "--force", "--quiet"])
    assert result.exit_code == 0, result.output


def _weights(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.suffix in (".safetensors", ".json", ".pth")}


@pytest.mark.parametrize("name", HF)
def test_family_is_detected_from_config_json(name: str) -> None:
    with open_checkpoint(FIXTURES / "hf" / name) as ckpt:
        assert ckpt.family.name == TYPES.get(name, name)


@pytest.mark.parametrize("name", HF)
def test_fixture_has_every_parameter_random(name: str) -> None:
    # transformers' save_pretrained of a seeded random model: no tensor left at its init
    # (norms at 1 or Gemma's at 0, biases at 0), so a dropped or swapped tensor cannot go unnoticed
    with open_checkpoint(FIXTURES / "hf" / name) as ckpt:
        for key, lazy in ckpt.tensors.items():
            t = lazy.get()
            assert t.unique().numel() > min(t.numel() // 2, 64), key  # (bfloat16 has few values near 0)


@pytest.mark.parametrize("name", HF)
def test_hf_to_bin_to_internal_to_hf_is_byte_identical(name: str, tmp_path: Path) -> None:
    src = FIXTURES / "hf" / name
    _convert(src, tmp_path / "bin", "hf-bin")
    _convert(tmp_path / "bin", tmp_path / "int", "internal")
    _convert(tmp_path / "int", tmp_path / "hf", "hf")
    want, got = _weights(src), _weights(tmp_path / "hf")
    assert {k: v for k, v in got.items() if k in want} == want


@pytest.mark.parametrize("meta", ["mixtral", "mixtral-2rank"])
def test_mixtral_meta_round_trip_keeps_every_tensor(meta: str, tmp_path: Path) -> None:
    src = FIXTURES / "meta" / meta
    _convert(src, tmp_path / "hf", "hf")
    _convert(tmp_path / "hf", tmp_path / "meta", "meta")
    with open_checkpoint(src) as a, open_checkpoint(tmp_path / "meta") as b:
        assert a.family.name == "mixtral" and a.config.extra.num_experts == 4
        assert list(a.tensors) == list(b.tensors)
        for k in a.tensors:
            assert torch.equal(a.tensors[k].get(), b.tensors[k].get()), k
    assert json.loads((tmp_path / "meta" / "params.json").read_text()) == json.loads((src / "params.json").read_text())


def test_mixtral_is_recognised_in_meta_layout_from_params_or_its_tensors(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ckptkit.cli import app

    for name in ("mixtral", "mixtral-2rank"):  # params.json's moe section
        result = CliRunner().invoke(app, ["inspect", str(FIXTURES / "meta" / name)])
        assert result.exit_code == 0 and "model type  mixtral" in result.output, result.output
    # experts among the tensors but no moe section: Mixtral, whose top-k only params.json can say
    src = tmp_path / "m"
    shutil.copytree(FIXTURES / "meta" / "mixtral", src)
    params = json.loads((src / "params.json").read_text())
    del params["moe"]
    (src / "params.json").write_text(json.dumps(params))
    for args in (["inspect", str(src)], ["convert", str(src), str(tmp_path / "out"), "--to", "hf"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 1 and not (tmp_path / "out").exists()
        assert result.output.strip().splitlines() == [
            f"error: {src / 'params.json'}: no 'moe' section, yet its tensors hold 4 experts per layer: add "
            '"moe": {"num_experts": 4, "num_experts_per_tok": K} (Mixtral routes each token to 2)'
        ]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_stacked_and_per_expert_layouts_hold_the_same_canonical_tensors(family: str) -> None:
    with open_checkpoint(FIXTURES / "hf" / family) as a, open_checkpoint(FIXTURES / "hf" / f"{family}-stacked") as b:
        assert (a.config.extra.experts_layout, b.config.extra.experts_layout) == ("per-expert", "stacked")
        assert list(a.tensors) == list(b.tensors)
        for k in a.tensors:
            assert torch.equal(a.tensors[k].get(), b.tensors[k].get()), k


def test_down_proj_with_equal_dims_is_never_transposed() -> None:
    # qwen3_moe's fixture has moe_intermediate_size == hidden_size: [E, H, I] and [E, I, H]
    # have the same shape; the stacked down_proj must be read as transformers wrote it.
    from safetensors import safe_open

    src = FIXTURES / "hf" / "qwen3_moe-stacked"
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    key = "model.layers.0.mlp.experts.down_proj"
    with safe_open(str(src / index[key]), "pt") as f:
        stacked = f.get_tensor(key)
    assert stacked.shape[1] == stacked.shape[2]
    with open_checkpoint(src) as ckpt:
        for e in range(stacked.shape[0]):
            assert torch.equal(ckpt.tensors[f"layers.0.mlp.experts.{e}.w2.weight"].get(), stacked[e])


def test_stacked_tensor_that_maps_nowhere_is_an_error(tmp_path: Path) -> None:
    # A stacked key left in a per-expert checkpoint must not be skipped silently.
    from safetensors.torch import load_file, save_file

    src = FIXTURES / "hf" / "qwen3_moe"
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"]["model.layers.0.mlp.gate.weight"]
    tensors = load_file(dst / shard)
    tensors["model.layers.2.mlp.experts.extra_proj"] = torch.zeros(4, 2, 2, dtype=torch.bfloat16)
    save_file(tensors, dst / shard, metadata={"format": "pt"})
    index["weight_map"]["model.layers.2.mlp.experts.extra_proj"] = shard
    index_path.write_text(json.dumps(index))
    with pytest.raises(CkptkitError, match="unknown tensor"):
        open_checkpoint(dst)


def test_mixed_expert_layouts_are_an_error(tmp_path: Path) -> None:
    dst = tmp_path / "m"
    shutil.copytree(FIXTURES / "hf" / "qwen3_moe", dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.experts.gate_up_proj"] = next(iter(index["weight_map"].values()))
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CkptkitError):
        open_checkpoint(dst)


@pytest.mark.parametrize("name", HF)
def test_native_logits_match_transformers(name: str) -> None:
    import transformers

    from ckptkit.train.transformer import load_model

    src = FIXTURES / "hf" / name
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager")
    ref.eval()
    model = load_model(str(src), dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 384, (2, 11), generator=gen)
    with torch.no_grad():
        want = ref(ids).logits
        got = model(ids)
    assert (got - want).abs().max().item() <= PARITY.get(name, PARITY_SDPA)


def test_gemma2_soft_capped_attention_matches_transformers_where_it_caps() -> None:
    """Queries scaled 100x in both models, so that attention scores reach the cap (50): without
    soft-capping the logits move by 0.15 (by 1.9e-6 at the fixture's own scale)."""
    import transformers

    from ckptkit.train.transformer import load_model

    src = FIXTURES / "hf" / "gemma2"
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager")
    model = load_model(str(src), dtype=torch.float32)
    ids = torch.randint(0, 384, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for ours, theirs in zip(model.layers, ref.model.layers, strict=True):
            theirs.self_attn.q_proj.weight.mul_(100)
            ours.attn.q_proj.weight.copy_(theirs.self_attn.q_proj.weight)
        assert torch.equal(model(ids), ref.eval()(ids).logits)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_aux_loss_matches_transformers(name: str) -> None:
    import transformers

    from ckptkit.train.transformer import load_model

    src = FIXTURES / "hf" / name
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model = load_model(str(src), dtype=torch.float32)
    ids = torch.randint(0, 384, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids, output_router_logits=True).aux_loss
        model(ids)
    aux = model.aux_loss()
    assert aux is not None
    assert abs(aux.item() - want.item()) <= 1e-6


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_routing_ties_are_broken_as_transformers_breaks_them(name: str) -> None:
    """Routers whose experts score alike: the first MoE layer's router is zero (every expert
    ties for every token), the others score experts 0, 1 and 2 alike (with 4 experts and top 2,
    the second and third place tie for every token). Each token goes to the experts
    transformers sends it to, and the logits agree as they do without ties."""
    import transformers

    from ckptkit.train.transformer import SparseMoE, load_model

    src = FIXTURES / "hf" / name
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager")
    model = load_model(str(src), dtype=torch.float32)
    moe = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
    gates = [layer.mlp.gate for layer in ref.model.layers if hasattr(layer.mlp, "gate")]
    assert len(moe) == len(gates) > 1 and all(m.top_k == 2 and len(m.experts) == 4 for m in moe)
    theirs: list[torch.Tensor] = []
    with torch.no_grad():
        for n, (ours, gate) in enumerate(zip(moe, gates, strict=True)):
            router = ours.router.weight
            if n == 0:
                router.zero_()
            else:
                router[1:3] = router[0]
            gate.weight.copy_(router)
            gate.register_forward_hook(lambda _m, _a, out: theirs.append(out[2]))  # (logits, scores, indices)
        ids = torch.randint(0, 384, (2, 11), generator=torch.Generator().manual_seed(0))
        want = ref.eval()(ids).logits
        got = model(ids)
    assert (got - want).abs().max().item() <= 1e-5
    for m, indices in zip(moe, theirs, strict=True):
        assert m.router_logits is not None
        probs = torch.softmax(m.router_logits, -1, dtype=torch.float)
        values = torch.sort(probs, descending=True).values
        assert torch.equal(values[:, 1], values[:, 2])  # a tie at the edge of the top 2, every token
        assert torch.equal(torch.topk(probs, m.top_k).indices, indices)  # transformers' experts, also in order


def test_gemma3_config_written_keeps_the_sliding_layers_rope_base(tmp_path: Path) -> None:
    """The config.json ckptkit writes for Gemma 3 (what GGUF -> HF writes) is, to transformers,
    the model it read: the sliding layers' rope base (set here to 20000, neither the global 1e6
    nor the default 1e4) included, and the same logits, bit for bit."""
    import transformers

    src = shutil.copytree(FIXTURES / "hf" / "gemma3_text", tmp_path / "src")
    doc = json.loads((src / "config.json").read_text())
    doc["rope_parameters"]["sliding_attention"]["rope_theta"] = 20000.0
    (src / "config.json").write_text(json.dumps(doc))
    with open_checkpoint(src) as ckpt:
        written = ckpt.family.config_to_hf(ckpt.config, "bfloat16")
    out = shutil.copytree(src, tmp_path / "out")
    (out / "config.json").write_text(json.dumps(written))
    theirs, ours = (transformers.AutoConfig.from_pretrained(p) for p in (src, out))
    assert ours.rope_parameters == theirs.rope_parameters == doc["rope_parameters"]
    ids = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(0))  # past the window of 5
    with torch.no_grad():
        want, got = (
            transformers.AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()(ids).logits
            for p in (src, out)
        )
    assert torch.equal(got, want)
