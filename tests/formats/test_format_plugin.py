"""A format is one module: a format defined here, outside ckptkit, and registered at run
time is detected, inspected and converted to and from like a built-in one, bitwise."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ckptkit.checkpoint import open_checkpoint
from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError
from ckptkit.formats import REGISTRY, detect_format, is_checkpoint_file, register, unregister
from ckptkit.formats.base import FilePlan, OpenedCheckpoint, Options, Plan, RawCheckpoint, read_json
from ckptkit.formats.format import CheckpointFormat, FormatInfo
from ckptkit.formats.planning import FolderPlanner
from ckptkit.formats.safetensors_io import SafetensorsReader, SafetensorsWriter
from ckptkit.formats.writers import TensorWriter
from ckptkit.inspection import inspect_path
from ckptkit.models import Family, ModelConfig, canonical_shapes, get_family
from ckptkit.models.spec import Layout, Rule
from ckptkit.tensors.lazy import Lazy

from conftest import FIXTURES, assert_same_files, assert_same_layout

CONFIG = "flat.json"
WEIGHTS = "tensors.flat"  # a safetensors container under a suffix no built-in code knows


class FlatPlanner(FolderPlanner):
    """The flat folder: every tensor in one file, the model type and config in ``flat.json``."""

    def default_files(
        self, ckpt: OpenedCheckpoint, targets: dict[str, Lazy], opts: Options
    ) -> tuple[list[FilePlan], dict[str, int | None]]:
        return [FilePlan(WEIGHTS, list(targets))], {}

    def metadata_files(self, ckpt: OpenedCheckpoint, plan: Plan, cast: str | None) -> dict[str, str]:
        doc = {"model_type": ckpt.family.name, "config": ckpt.config.to_dict()}
        return {CONFIG: json.dumps(doc, indent=1) + "\n"}

    def writer(self, path: Path, plan: Plan, file: FilePlan, direct: bool) -> TensorWriter:
        # a safetensors container under a suffix the default writer (chosen by name) does not know
        return SafetensorsWriter(path, plan.entries(file), None, direct=direct)


class FlatFormat(CheckpointFormat):
    """Canonical tensor names in one ``tensors.flat`` + ``flat.json`` (model type, config):
    found by those two files (``info``), opened, read as a model, laid out (``planner``)."""

    name = "flat-test"
    info = FormatInfo(
        expects=f"{CONFIG} + {WEIGHTS}",
        weight_file=re.compile(re.escape(WEIGHTS)),
        detect_order=40,
        config_file=CONFIG,
        metadata_names=(CONFIG,),
    )
    planner = FlatPlanner

    def open(self, root: Path, config: Path | None = None) -> RawCheckpoint:
        text, doc = read_json(root / CONFIG)
        reader = SafetensorsReader(root / WEIGHTS)
        return RawCheckpoint(
            format=self.name,
            root=root,
            files={WEIGHTS: list(reader.infos)},
            infos=dict(reader.infos),
            readers={WEIGHTS: reader},
            config_name=CONFIG,
            config_text=text,
            config=doc,
        )

    def model(self, raw: RawCheckpoint, family: Family | None = None) -> tuple[Family, ModelConfig]:
        family = family or get_family(raw.config["model_type"])
        return family, ModelConfig.from_dict(raw.config["config"], family.fields)

    def layout(self, family: Family, cfg: ModelConfig) -> Layout:
        return Layout(head=tuple(Rule(name, (name,)) for name in canonical_shapes(cfg)), layer=())


@pytest.fixture
def flat() -> Iterator[FlatFormat]:
    fmt = FlatFormat()
    register(fmt)
    try:
        yield fmt
    finally:
        unregister(fmt.name)


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_registered_format_round_trips_hf_bitwise(flat: FlatFormat, tmp_path: Path) -> None:
    src = FIXTURES / "hf" / "llama2"
    convert(src, tmp_path / "flat", ConvertOptions(flat.name))
    assert sorted(p.name for p in (tmp_path / "flat").iterdir() if is_checkpoint_file(p.name)) == [
        "ckptkit-origin.json",
        CONFIG,
        WEIGHTS,
    ]
    assert detect_format(tmp_path / "flat") is flat
    assert inspect_path(tmp_path / "flat")["format"] == flat.name

    # Read independently: the flat file holds HF's tensors, bit for bit, under canonical names.
    hf: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("model-*.safetensors")):
        hf |= _safetensors(shard)
    mine = _safetensors(tmp_path / "flat" / WEIGHTS)
    with open_checkpoint(src) as ckpt:
        assert sorted(mine) == sorted(ckpt.tensors)
    pairs = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "layers.0.attn.q_proj.weight": "model.layers.0.self_attn.q_proj.weight",
        "layers.1.mlp.w2.weight": "model.layers.1.mlp.down_proj.weight",
        "norm.scale": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    for canonical, native in pairs.items():
        assert _bitwise_equal(mine[canonical], hf[native]), canonical

    convert(tmp_path / "flat", tmp_path / "back", ConvertOptions("hf"))
    assert_same_files(src, tmp_path / "back")


def test_a_registered_format_round_trips_meta_bitwise(flat: FlatFormat, tmp_path: Path) -> None:
    src = FIXTURES / "meta" / "llama2"
    convert(src, tmp_path / "flat", ConvertOptions(flat.name))
    with open_checkpoint(tmp_path / "flat") as ckpt:
        assert ckpt.format == flat.name and ckpt.origin["format"] == "meta"
    original = torch.load(src / "consolidated.00.pth", weights_only=True)
    mine = _safetensors(tmp_path / "flat" / WEIGHTS)
    assert _bitwise_equal(mine["layers.0.mlp.w1.weight"], original["layers.0.feed_forward.w1.weight"])

    convert(tmp_path / "flat", tmp_path / "back", ConvertOptions("meta"))
    # Pickles come back with the same tensors and size (as every round trip through .pth
    # does, test_roundtrip.py); the other files byte for byte.
    assert_same_layout(src, tmp_path / "back")
    assert sorted(p.name for p in src.iterdir()) == sorted(p.name for p in (tmp_path / "back").iterdir())
    for p in src.iterdir():
        written = tmp_path / "back" / p.name
        if p.suffix == ".pth":
            assert written.stat().st_size == p.stat().st_size, p.name
        else:
            assert written.read_bytes() == p.read_bytes(), p.name
    back = torch.load(tmp_path / "back" / "consolidated.00.pth", weights_only=True)
    assert list(back) == list(original)
    assert all(_bitwise_equal(back[k], original[k]) for k in original)


def test_unregistering_removes_the_format(tmp_path: Path) -> None:
    fmt = register(FlatFormat())
    unregister(fmt.name)
    assert fmt.name not in REGISTRY
    with pytest.raises(Exception, match="unknown target format 'flat-test'"):
        convert(FIXTURES / "hf" / "llama2", tmp_path / "out", ConvertOptions("flat-test"))


def test_a_name_is_registered_once(flat: FlatFormat) -> None:
    with pytest.raises(ValueError, match="already registered"):
        register(FlatFormat())


def test_the_cli_offers_a_format_registered_at_run_time(flat: FlatFormat, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ckptkit.cli import app

    help_text = " ".join(CliRunner().invoke(app, ["convert", "--help"]).output.split())
    assert f"gguf, {flat.name}." in help_text
    args = ["convert", str(FIXTURES / "hf" / "llama2"), str(tmp_path / "f"), "--to", flat.name]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert detect_format(tmp_path / "f") is flat


def test_an_installed_plugin_is_a_format_of_the_cli(tmp_path: Path) -> None:
    """A package that declares a ``ckptkit.formats`` entry point (here: a dist-info on
    the path, as pip installs one) gives ``ckptkit convert --to`` a new choice, with no
    code of the plugin's run by the test process itself."""
    import os
    import subprocess
    import sys

    dist = tmp_path / "site" / "flatplugin-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: flatplugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[ckptkit.formats]\nflat = test_format_plugin:FlatFormat\n")
    here = Path(__file__).resolve().parent  # this module, and conftest's folder above it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(here), str(here.parent)])}
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "ckptkit", "convert", str(FIXTURES / "hf" / "llama2"), str(out), "--to", "flat-test"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert (out / WEIGHTS).is_file() and (out / CONFIG).is_file()
    listed = subprocess.run([*cmd[:4], "--help"], env=env, capture_output=True, text=True, check=False)
    assert "flat-test" in listed.stdout

    (dist / "entry_points.txt").write_text("[ckptkit.formats]\nbroken = no_such_module:Format\n")
    failed = subprocess.run(
        [*cmd[:5], str(tmp_path / "o2"), "--to", "hf"], env=env, capture_output=True, text=True, check=False
    )
    # A broken plugin costs one warning line, never the built-in formats.
    assert failed.returncode == 0, failed.stderr
    warning = failed.stderr.splitlines()[0]
    assert warning.startswith("warning: format plugin broken (no_such_module:Format) cannot be loaded"), warning
    assert "Traceback" not in failed.stderr and (tmp_path / "o2" / "config.json").is_file()


class FlatCheckpointerFormat(FlatFormat):
    """The flat format, saying which torchtune-style checkpointer component reads it."""

    info = dataclasses.replace(FlatFormat.info, torchtune_checkpointers=("acme.training.FlatCheckpointer",))


def test_a_format_tells_training_which_torchtune_checkpointer_reads_it(tmp_path: Path) -> None:
    """``checkpointer._component_`` is accepted and checked against the formats' own declarations:
    a registered format brings its component; unregistered, the component is refused."""
    from ckptkit.train.checkpointer import Checkpointer
    from ckptkit.train.config import parse_config
    from ckptkit.train.schema import FullFinetuneConfig

    def checkpointer(source: Path) -> Checkpointer:
        raw = {"checkpointer": {"_component_": "acme.training.FlatCheckpointer", "checkpoint_dir": str(source),
                                "output_dir": str(tmp_path / "out")}}  # fmt: skip
        return Checkpointer(parse_config(raw, FullFinetuneConfig).checkpointer)

    fmt = register(FlatCheckpointerFormat())
    try:
        convert(FIXTURES / "hf" / "llama2", tmp_path / "flat", ConvertOptions(fmt.name))
        assert checkpointer(tmp_path / "flat").model_config().num_layers == 2
        with pytest.raises(CkptkitError, match="is a hf checkpoint but checkpointer._component_ names torchtune's "
                                               "checkpointer for flat-test; ckptkit's reads any format"):  # fmt: skip
            checkpointer(FIXTURES / "hf" / "llama2").model_config()
    finally:
        unregister(fmt.name)
    with pytest.raises(CkptkitError, match="_component_ 'acme.training.FlatCheckpointer' is not a ckptkit component"):
        checkpointer(tmp_path / "flat")


def _members(cls: type) -> set[str]:
    """A class's own public methods and attributes, annotated-only attributes included."""
    return {n for n in vars(cls) if not n.startswith("_")} | set(vars(cls).get("__annotations__", {}))


# Counted, so that the interface cannot grow back (issue 35): 42 members before the one
# write engine, 43 since (plan, plan_adapter and record_origin in; write_file and
# write_adapter out; writes_file became file_suffix); 29 since the fifteen attributes that
# describe a format's files and options became one FormatInfo (info); 21 since the nine
# folder-planning hooks (targets, write_layout, required, split_dim, default_files,
# metadata_files, extra_tensors, keeps_hf_files, tokenizer) moved to a FolderPlanner the
# format names (planner); 20 since owns_file became FormatInfo.lone_file; 14 since
# family + read_config became model, supports + tokenizer_support became support (a
# Support), open_with_config became open's config (FormatInfo.takes_config), read_origin,
# own_layout and record_origin became one LayoutRecord (records), and the writer of each
# file became the planner's, carried by the plan (Plan.writer). A plugin overrode 11-14
# members at first, 9 at 20 members, 6 now (detect defaults to FormatInfo's config_file and
# weight_file). Lower these bounds as members go, never raise them.
INTERFACE_MEMBERS = 14
PLUGIN_OVERRIDES = 6


def test_the_format_interface_does_not_grow() -> None:
    members = _members(CheckpointFormat)
    assert len(members) <= INTERFACE_MEMBERS, sorted(members)
    overridden = _members(FlatFormat)
    assert overridden <= members, sorted(overridden - members)  # a plugin adds nothing the engine ignores
    assert len(overridden) <= PLUGIN_OVERRIDES, sorted(overridden)
    planned = _members(FlatPlanner)
    assert planned <= _members(FolderPlanner), sorted(planned - _members(FolderPlanner))
