"""Hub sources against a hostile or unusual Hub: a server that ignores Range, 5xx answers,
a full cache of every format, a gated repo on inspect, DST refused before any download."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_hub import FakeHub
from test_hub_sources import FIXTURES, HF, ckptkit, everything, local_reference, same_files

pytest_plugins = ["fake_hub"]  # its `hub` fixture (a conftest.py here would shadow tests/conftest.py)


def fill_cache(hub: FakeHub, repo_id: str) -> None:
    """Every file of the repository into the Hub cache, as `hf download` (or transformers) leaves it."""
    from huggingface_hub import hf_hub_download

    from ckptkit.hub.listing import cache_dir

    for name in hub.repos[repo_id].files:
        hf_hub_download(repo_id, name, cache_dir=cache_dir(), endpoint=hub.url)


def test_a_server_that_ignores_range_still_serves_a_download(hub: FakeHub, tmp_path: Path) -> None:
    everything(hub)
    hub.ignore_range = True
    code, _, err = ckptkit("convert", "org/llama2", tmp_path / "out", "--to", "hf-bin", "--quiet")
    assert code == 0, err
    same_files(tmp_path / "out", local_reference(tmp_path))


def test_a_gated_repo_on_inspect_is_one_line(hub: FakeHub) -> None:
    everything(hub, gated=True)
    code, _, err = ckptkit("inspect", "org/llama2")
    assert code == 1 and "a gated repository: accept the license" in err and len(err.strip().splitlines()) == 1, err


def test_a_5xx_is_one_line(hub: FakeHub, tmp_path: Path) -> None:
    everything(hub)
    hub.fail_api = 503
    code, _, err = ckptkit("convert", "org/llama2", tmp_path / "out", "--to", "hf-bin")
    assert code == 1 and "answered 503" in err and len(err.strip().splitlines()) == 1, err


def test_an_existing_dst_is_refused_before_any_request(hub: FakeHub, tmp_path: Path) -> None:
    everything(hub)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    code, _, err = ckptkit("convert", "org/llama2", tmp_path / "out", "--to", "hf-bin")
    assert code != 0 and hub.log == [], err


def test_a_cache_holding_every_format_converts_the_one_set(hub: FakeHub, tmp_path: Path) -> None:
    everything(hub)
    fill_cache(hub, "org/llama2")
    code, _, err = ckptkit("convert", "org/llama2", tmp_path / "out", "--to", "hf-bin", "--quiet")
    assert code == 0, err
    same_files(tmp_path / "out", local_reference(tmp_path))


def test_gguf_streamed_cached_and_local_are_the_same_bytes(hub: FakeHub, tmp_path: Path) -> None:
    """general.name is the repository's name (as for a local folder named so), not a commit or a temp name."""
    everything(hub)
    for how in ("--stream", "--quiet"):
        code, _, err = ckptkit("convert", "org/llama2", tmp_path / f"{how}.gguf", "--to", "gguf", how, "--quiet")
        assert code == 0, err
    assert ckptkit("convert", HF, tmp_path / "ref.gguf", "--to", "gguf", "--quiet")[0] == 0  # a folder named llama2
    ref = (tmp_path / "ref.gguf").read_bytes()
    assert (tmp_path / "--stream.gguf").read_bytes() == ref and (tmp_path / "--quiet.gguf").read_bytes() == ref


def test_mistral_two_formats(hub: FakeHub, tmp_path: Path) -> None:
    files = {p.name: p.read_bytes() for p in HF.iterdir()}
    files["consolidated.safetensors"] = (HF / "model-00001-of-00004.safetensors").read_bytes()
    files["params.json"] = b"{}"
    hub.add("org/mistral", files)
    code, out, err = ckptkit("inspect", "org/mistral")
    assert code == 0, err
    assert "consolidated" not in "".join(hub.fetched())
    fill_cache(hub, "org/mistral")
    code, _, err = ckptkit("convert", "org/mistral", tmp_path / "out", "--to", "hf-bin", "--quiet")
    assert code == 0, err
    same_files(tmp_path / "out", local_reference(tmp_path))


def test_only_bin(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_folder("org/bin", {"": FIXTURES / "hf-bin/llama2"})
    code, _, err = ckptkit("convert", "org/bin", tmp_path / "out", "--to", "hf-bin", "--quiet")
    assert code == 0, err


def test_offline_with_revision(hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    everything(hub)
    hub.repos["org/llama2"].branches["v1"] = hub.repos["org/llama2"].commit
    assert ckptkit("convert", "org/llama2@v1", tmp_path / "online", "--to", "hf-bin", "--quiet")[0] == 0
    hub.close()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = ckptkit("convert", "org/llama2@v1", tmp_path / "offline", "--to", "hf-bin", "--quiet")
    assert code == 0, err


@pytest.mark.parametrize(
    ("index", "line"),
    [
        (b"not json", "model.safetensors.index.json is not a weight index"),
        (b'{"weight_map": {"a": "model-00009-of-00009.safetensors"}}', "names shards the repository lacks"),
        (b'{"weight_map": {"a": 3}}', "model.safetensors.index.json"),
        (b"[]", "model.safetensors.index.json is not a weight index"),
    ],
)
def test_a_bad_index_is_one_line_before_any_weights(hub: FakeHub, tmp_path: Path, index: bytes, line: str) -> None:
    files = {p.name: p.read_bytes() for p in HF.iterdir()}
    files["model.safetensors.index.json"] = index
    hub.add("org/bad", files)
    for cmd in (["inspect", "org/bad"], ["convert", "org/bad", tmp_path / "out", "--to", "hf-bin", "--stream"]):
        code, _, err = ckptkit(*cmd)
        assert code == 1 and line in err and len(err.strip().splitlines()) == 1, err
    assert not [f for f in hub.fetched("GET") if f.endswith(".safetensors")]


@pytest.mark.parametrize("stream", [False, True])
def test_a_5xx_on_a_weight_file_is_one_line(hub: FakeHub, tmp_path: Path, stream: bool) -> None:
    everything(hub)
    hub.fail_files[sorted(p.name for p in HF.glob("*.safetensors"))[1]] = 502
    extra = ["--stream"] if stream else []
    code, _, err = ckptkit("convert", "org/llama2", tmp_path / "out", "--to", "hf-bin", *extra)
    last = err.strip().splitlines()[-1]  # after huggingface_hub's own retry warnings
    assert code == 1 and last.endswith("the Hub answered 502; retry later (a download resumes)"), err
    assert not (tmp_path / "out").exists()


def test_config_not_json(hub: FakeHub, tmp_path: Path) -> None:
    files = {p.name: p.read_bytes() for p in HF.iterdir()}
    files["config.json"] = b"{oops"
    hub.add("org/cfg", files)
    code, _, err = ckptkit("convert", "org/cfg", tmp_path / "out", "--to", "hf-bin")
    assert code == 1 and "config.json is not JSON" in err and len(err.strip().splitlines()) == 1, err


def test_merge_into_an_existing_dst_fetches_nothing(hub: FakeHub, tmp_path: Path) -> None:
    everything(hub)
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "x").write_text("x")
    (tmp_path / "adapter").mkdir()
    code, _, err = ckptkit("merge", "org/llama2", tmp_path / "adapter", tmp_path / "dst")
    assert code != 0, err
    assert not [f for f in hub.fetched("GET") if f.endswith(".safetensors")], err


def test_a_config_that_lies_is_named_by_the_repository_streamed(hub: FakeHub, tmp_path: Path) -> None:
    files = {p.name: p.read_bytes() for p in HF.iterdir()}
    files["config.json"] = files["config.json"].replace(b'"hidden_size": ', b'"hidden_size": 1')
    hub.add("org/lie", files)
    code, _, err = ckptkit("inspect", "org/lie")
    assert code == 1 and err.startswith("error: org/lie/model-00001-of-00004.safetensors: the config contradicts"), err
    assert "ckptkit-hub-" not in err and len(err.strip().splitlines()) == 1
