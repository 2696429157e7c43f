"""The native decoder on DeepSeek V3 (latent attention, shared experts, the grouped sigmoid
router with its choice bias) and GLM-4.5 (partial rotary, q/k norms, the same experts): logits
as transformers' eager float32 ones, every token routed to the experts transformers routes it
to (ties, the choice bias and the group limit included), YaRN rope and its attention scale."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from train_helpers import FIXTURES

NAMES = ["glm4_moe", "deepseek_v3", "deepseek_v3-qproj", "gpt_oss"]
# Max |logits difference| measured against transformers' eager attention (float32): 4.2e-7 in
# a fresh process, 5.4e-7 for deepseek_v3 after other tests ran (SDPA's sums against eager's
# matmul-softmax-matmul, experts' gate and up as two matmuls against one fused); gpt_oss 3.0e-7.
PARITY = 6e-7


def _models(src: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    import transformers

    from ckptkit.train.transformer import load_model

    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager")
    return load_model(str(src), dtype=torch.float32), ref.eval()


def _ids(seed: int = 0, length: int = 11) -> torch.Tensor:
    return torch.randint(0, 384, (2, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", NAMES)
def test_native_logits_match_transformers(name: str) -> None:
    ours, theirs = _models(FIXTURES / "hf" / name)
    with torch.no_grad():
        diff = (ours(_ids()) - theirs(_ids()).logits).abs().max().item()
    assert diff <= PARITY


@pytest.mark.parametrize("name", ["glm4_moe", "deepseek_v3"])
def test_routing_is_transformers_with_ties_bias_and_groups(name: str) -> None:
    """Routers set up so that every rule decides: in the first MoE layer the router is zero and
    the choice bias alone orders the experts (the weights stay the unbiased scores, all equal);
    in the second, experts 1 and 2 score as expert 0 (ties inside and across the two groups, of
    which one competes). Each token goes to transformers' experts, in its order."""
    from ckptkit.train.experts import SparseMoE

    ours, theirs = _models(FIXTURES / "hf" / name)
    moe = [layer.mlp for layer in ours.layers if isinstance(layer.mlp, SparseMoE)]
    gates = [layer.mlp.gate for layer in theirs.model.layers if hasattr(layer.mlp, "gate")]
    assert len(moe) == len(gates) == 2
    assert [(g.num_group, g.topk_group, g.top_k) for g in gates] == [(2, 1, 2)] * 2
    routed: list[torch.Tensor] = []
    with torch.no_grad():
        for n, (mine, gate) in enumerate(zip(moe, gates, strict=True)):
            router = mine.router.weight
            if n == 0:
                router.zero_()
                mine.router.expert_bias.copy_(torch.tensor([0.0, 0.1, 0.3, 0.2]))
            else:
                router[1:3] = router[0]
                mine.router.expert_bias.zero_()
            gate.weight.copy_(router)
            gate.e_score_correction_bias.copy_(mine.router.expert_bias)
            gate.register_forward_hook(lambda _m, _a, out: routed.append(out[2]))  # (logits, weights, indices)
        want = theirs(_ids()).logits
        got = ours(_ids())
    assert (got - want).abs().max().item() <= PARITY
    first, second = (m.chosen for m in moe)
    assert first is not None and second is not None
    assert (first.sort(dim=-1).values == torch.tensor([2, 3])).all()  # the bias's best group, its best two
    assert torch.equal(first, routed[0]) and torch.equal(second, routed[1])


def test_gpt_oss_routes_as_transformers_with_ties() -> None:
    """gpt-oss's router (a bias, top k of the logits, softmax over those k): in layer 0 the
    router's weight is zero and its bias ties experts 1 and 2 for the second place; layer 1
    routes by its trained weights. Each token goes to transformers' experts in its order, and
    its sliding (window 8) and full layers see 24 tokens."""
    from ckptkit.train.experts import StackedMoE

    ours, theirs = _models(FIXTURES / "hf" / "gpt_oss")
    moe = [layer.mlp for layer in ours.layers]
    assert all(isinstance(m, StackedMoE) for m in moe)
    routed: list[torch.Tensor] = []
    with torch.no_grad():
        moe[0].router.weight.zero_()
        moe[0].router.bias.copy_(torch.tensor([0.5, 0.2, 0.2, 0.1]))
        for mine, layer in zip(moe, theirs.model.layers, strict=True):
            layer.mlp.router.weight.copy_(mine.router.weight)
            layer.mlp.router.bias.copy_(mine.router.bias)
            layer.mlp.router.register_forward_hook(lambda _m, _a, out: routed.append(out[2]))  # (logits, scores, idx)
        ids = _ids(2, 24)
        want = theirs(ids).logits
        got = ours(ids)
    assert (got - want).abs().max().item() <= PARITY
    first, second = (m.chosen for m in moe)
    assert first is not None and second is not None
    assert (first[:, 0] == 0).all() and set(first[:, 1].tolist()) <= {1, 2}
    assert torch.equal(first, routed[0]) and torch.equal(second, routed[1])
    assert len(set(second.flatten().tolist())) == 4  # trained weights: every expert chosen somewhere


def test_deepseek_yarn_rope_and_attention_scale_match_transformers(tmp_path: Path) -> None:
    """DeepSeek V3's own rope: YaRN (factor 40, mscale_all_dim 1), which scales the frequencies,
    cos and sin, and the attention scale (by mscale**2); positions past the original length."""
    src = shutil.copytree(FIXTURES / "hf" / "deepseek_v3", tmp_path / "m")
    doc = json.loads((src / "config.json").read_text())
    doc["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 8,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    (src / "config.json").write_text(json.dumps(doc))
    ours, theirs = _models(src)
    ids = _ids(1, 24)
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() <= PARITY


def test_gpt_oss_with_mxfp4_experts_runs_them_dequantized(tmp_path: Path) -> None:
    """The release's MXFP4 experts are read dequantized (the reference recipe, in the
    embeddings' bf16): the native model of the release is that of its ``--dtype bfloat16``
    conversion, which runs as transformers runs it. Measured: 5.1e-5 apart, as this
    fixture's scales (up to 2^20, every code) make expert outputs of 2.5e8, whose float32 sums
    differ by 3.9e3 between the two (gpt_oss itself: 3.0e-7)."""
    from ckptkit.convert import ConvertOptions, convert
    from ckptkit.train.transformer import load_model

    src = FIXTURES / "mxfp4" / "gpt_oss"
    convert(src, tmp_path / "bf16", ConvertOptions("hf", dtype="bfloat16"))
    release, converted = load_model(str(src)).state_dict(), load_model(str(tmp_path / "bf16")).state_dict()
    assert release.keys() == converted.keys()
    assert all(torch.equal(release[k], converted[k]) for k in release)
    ours, theirs = _models(tmp_path / "bf16")
    with torch.no_grad():
        assert (ours(_ids()) - theirs(_ids()).logits).abs().max().item() <= 6e-5
