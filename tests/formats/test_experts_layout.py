"""Mixture-of-experts layouts on the way out: ``--experts per-expert|stacked`` chooses, a round
trip keeps the source's, and the two classic converter traps (stacked keys skipped, stacked
``down_proj`` transposed) fail loudly or not at all. The references are transformers' own
``save_pretrained`` outputs of one model in both layouts (fixtures/hf/*-stacked are
``save_original_format=False``) and transformers' logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ckptkit.checkpoint import open_checkpoint
from ckptkit.cli import app
from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "hf"
MOE = ["qwen3_moe", "mixtral"]  # qwen3_moe: moe_intermediate_size == hidden_size


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for p in sorted(d.glob("*.safetensors")):
        out.update(load_file(p))
    return out


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, [*args, "--quiet"])
    return result.exit_code, result.output


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("src_layout", ["per-expert", "stacked"])
def test_experts_option_writes_what_transformers_saves_in_that_layout(
    family: str, src_layout: str, tmp_path: Path
) -> None:
    names = {"per-expert": family, "stacked": f"{family}-stacked"}
    want = "stacked" if src_layout == "per-expert" else "per-expert"
    code, output = _cli(
        "convert", str(FIXTURES / names[src_layout]), str(tmp_path / "out"), "--to", "hf", "--experts", want
    )
    assert code == 0, output
    assert _equal(_tensors(tmp_path / "out"), _tensors(FIXTURES / names[want]))
    with open_checkpoint(tmp_path / "out") as ckpt:
        assert ckpt.config.extra.experts_layout == want


@pytest.mark.parametrize("family", MOE)
def test_experts_option_that_names_the_source_layout_restores_it_bitwise(family: str, tmp_path: Path) -> None:
    src = FIXTURES / f"{family}-stacked"
    convert(src, tmp_path / "out", ConvertOptions("hf", experts="stacked"))
    for p in src.glob("*.safetensors"):
        assert (tmp_path / "out" / p.name).read_bytes() == p.read_bytes()


@pytest.mark.parametrize("family", MOE)
def test_round_trip_through_the_other_layout_comes_back_in_the_source_layout(family: str, tmp_path: Path) -> None:
    # hf (per-expert) -> hf-bin stacked -> internal -> hf: the recorded hf layout is restored,
    # file names, partition and bytes.
    src = FIXTURES / family
    convert(src, tmp_path / "bin", ConvertOptions("hf-bin", experts="stacked"))
    with open_checkpoint(tmp_path / "bin") as ckpt:
        assert ckpt.config.extra.experts_layout == "stacked"
    convert(tmp_path / "bin", tmp_path / "int", ConvertOptions("internal"))
    convert(tmp_path / "int", tmp_path / "hf", ConvertOptions("hf"))
    for p in [*src.glob("*.safetensors"), src / "model.safetensors.index.json"]:
        assert (tmp_path / "hf" / p.name).read_bytes() == p.read_bytes(), p.name
    # Asked for on the way back, the other layout wins over the recorded one.
    convert(tmp_path / "int", tmp_path / "hf2", ConvertOptions("hf", experts="stacked"))
    assert _equal(_tensors(tmp_path / "hf2"), _tensors(FIXTURES / f"{family}-stacked"))


def test_stacked_output_with_equal_dims_gives_transformers_the_same_logits(tmp_path: Path) -> None:
    # hidden_size == moe_intermediate_size: a down_proj transposed on the way out would have
    # the right shape and load without complaint; only the logits would tell.
    import transformers

    src = FIXTURES / "qwen3_moe"
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["moe_intermediate_size"] == cfg["hidden_size"]
    convert(src, tmp_path / "stacked", ConvertOptions("hf-bin", experts="stacked"))
    ids = torch.randint(0, 384, (2, 13), generator=torch.Generator().manual_seed(3))
    logits = []
    for d in (src, tmp_path / "stacked"):
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert torch.equal(logits[0], logits[1])


def _edit_stacked(src: Path, dst: Path, key: str, edit: str) -> None:
    shutil.copytree(src, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"][key]
    tensors = load_file(dst / shard)
    if edit == "transpose":
        tensors[key] = tensors[key].transpose(1, 2).contiguous()
    else:
        del tensors[key], index["weight_map"][key]
        index_path.write_text(json.dumps(index))
    save_file(tensors, dst / shard, metadata={"format": "pt"})


def test_stacked_down_proj_in_the_other_orientation_is_refused(tmp_path: Path) -> None:
    # [E, I, H] where transformers writes [E, H, I]: the config decides, the shapes disagree.
    _edit_stacked(FIXTURES / "mixtral-stacked", tmp_path / "m", "model.layers.1.mlp.experts.down_proj", "transpose")
    code, output = _cli("convert", str(tmp_path / "m"), str(tmp_path / "out"), "--to", "hf", "--experts", "per-expert")
    assert code == 1
    assert "down_proj has shape [4, 56, 40] but the config implies [4, 40, 56]" in output
    assert not (tmp_path / "out").exists()


def test_missing_stacked_tensor_is_refused_not_left_out(tmp_path: Path) -> None:
    _edit_stacked(FIXTURES / "qwen3_moe-stacked", tmp_path / "m", "model.layers.2.mlp.experts.gate_up_proj", "drop")
    code, output = _cli("convert", str(tmp_path / "m"), str(tmp_path / "out"), "--to", "hf")
    assert code == 1
    assert "'model.layers.2.mlp.experts.gate_up_proj' is missing" in output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("src", "to", "message", "exit_code"),
    [
        ("qwen3", "hf", "--experts applies to mixture-of-experts models;", 1),  # the files say so: input error
        (
            "mixtral",
            "internal",
            "--to internal stores mixtral experts one way only; --experts applies to --to hf or hf-bin",
            2,  # the options contradict: bad usage
        ),
        ("mixtral", "meta", "--to meta stores mixtral experts one way only", 2),
    ],
)
def test_experts_option_where_it_means_nothing_is_refused(
    src: str, to: str, message: str, exit_code: int, tmp_path: Path
) -> None:
    code, output = _cli("convert", str(FIXTURES / src), str(tmp_path / "out"), "--to", to, "--experts", "stacked")
    assert code == exit_code
    assert message in output and len(output.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_unknown_experts_layout_is_refused(tmp_path: Path) -> None:
    code, output = _cli("convert", str(FIXTURES / "mixtral"), str(tmp_path / "out"), "--to", "hf", "--experts", "stack")
    assert code == 2
    assert "--experts stack: not one of per-expert, stacked; did you mean 'stacked'?" in output
    with pytest.raises(CkptkitError, match="--experts must be one of per-expert, stacked, not 'fused'"):
        convert(FIXTURES / "mixtral", tmp_path / "out", ConvertOptions("hf", experts="fused"))
    assert not (tmp_path / "out").exists()


def test_a_stack_is_split_into_its_experts_spans_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each expert's bytes in a stacked tensor come from one split of the whole stack (not one
    per expert: quadratic in the experts, minutes of planning for 256 of them)."""
    from ckptkit.tensors.transforms import Stacked

    splits: list[int] = []
    real = Stacked.forward_spans

    def counted(self: Stacked, *args: object) -> object:
        splits.append(1)
        return real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Stacked, "forward_spans", counted)
    src = FIXTURES / "qwen3_moe-stacked"
    with open_checkpoint(src) as ckpt:
        experts = [lazy for name, lazy in ckpt.tensors.items() if ".experts." in name]
        assert all(lazy.spans() is not None for lazy in experts)
    stacks = [k for k in _tensors(src) if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(experts) == 24 and len(splits) == len(stacks) == 4  # 4 experts x 3 in 2 layers
