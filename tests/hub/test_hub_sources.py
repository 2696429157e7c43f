"""Hub repositories as sources, against a local server that answers huggingface_hub's calls
(tests/hub/fake_hub.py): one weight set fetched, refusals before any weights, checked
files, resumed downloads, ``--stream`` by range requests, offline from the cache."""

from __future__ import annotations

import filecmp
import shutil
from pathlib import Path

import pytest
from fake_hub import FakeHub
from typer.testing import CliRunner

from ckptkit.cli import app

pytest_plugins = ["fake_hub"]  # its `hub` fixture (a conftest.py here would shadow tests/conftest.py)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
HF = FIXTURES / "hf/llama2"
HF_SHARDS = sorted(p.name for p in HF.glob("*.safetensors"))
HF_FILES = sorted(p.name for p in HF.iterdir())


def everything(hub: FakeHub, repo_id: str = "org/llama2", **kw: object) -> None:
    """A repository as releases ship them: HF safetensors, the same weights as .bin, Meta's
    original/, and folders and files of other runtimes."""
    files = {p.name: p.read_bytes() for p in HF.iterdir()}
    files |= {p.name: p.read_bytes() for p in (FIXTURES / "hf-bin/llama2").glob("pytorch_model*")}
    files |= {f"original/{p.name}": p.read_bytes() for p in (FIXTURES / "meta/llama2").iterdir()}
    files |= {"metal/model.bin": b"m" * 4096, "onnx/model.onnx": b"o" * 4096, "llama2.Q4_0.gguf": b"GGUF" * 1024}
    hub.add("org/llama2" if repo_id == "org/llama2" else repo_id, files, **kw)  # type: ignore[arg-type]


def ckptkit(*args: object) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, r.stdout, r.stderr


def local_reference(tmp_path: Path, to: str = "hf-bin") -> Path:
    out = tmp_path / f"reference-{to}"
    if out.exists():
        return out
    assert ckptkit("convert", HF, out, "--to", to, "--quiet")[0] == 0
    return out


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert filecmp.cmpfiles(a, b, names, shallow=False)[0] == names


def test_only_the_hf_weight_set_is_fetched_and_converts_as_the_local_folder(hub: FakeHub, tmp_path: Path) -> None:
    everything(hub)
    code, _, err = ckptkit("convert", "org/llama2", tmp_path / "out", "--to", "hf-bin")
    assert code == 0, err
    assert sorted(set(hub.fetched("GET"))) == HF_FILES  # not the .bin copy, original/, metal/, onnx/ or the GGUF
    assert "from the Hub: org/llama2@" in err and "hf in ./, 4 weight files" in err
    same_files(tmp_path / "out", local_reference(tmp_path))


def test_from_meta_takes_original_only(hub: FakeHub, tmp_path: Path) -> None:
    everything(hub)
    code, _, err = ckptkit("convert", "org/llama2", tmp_path / "out", "--to", "hf", "--from", "meta", "--quiet")
    assert code == 0, err
    assert sorted(set(hub.fetched("GET"))) == [
        f"original/{p.name}" for p in sorted((FIXTURES / "meta/llama2").iterdir())
    ]


def test_stream_reads_by_range_keeps_no_copy_and_gives_the_same_bytes(hub: FakeHub, tmp_path: Path) -> None:
    everything(hub)
    code, _, err = ckptkit("convert", "org/llama2", tmp_path / "out", "--to", "hf-bin", "--stream", "--quiet")
    assert code == 0, err
    assert not (tmp_path / "hf-cache").exists()  # nothing went into the cache
    weights = [r for r in hub.log if r.method == "GET" and r.path.endswith(".safetensors")]
    assert weights and all(r.range is not None for r in weights)
    assert {r.path.rsplit("/", 1)[-1] for r in weights} == set(HF_SHARDS)
    same_files(tmp_path / "out", local_reference(tmp_path))


def test_inspect_reads_headers_only_and_says_which_set_and_size(hub: FakeHub) -> None:
    everything(hub)
    code, out, err = ckptkit("inspect", "org/llama2")
    assert code == 0, err
    weights = sum(p.stat().st_size for p in HF.glob("*.safetensors"))
    assert "hub         org/llama2@" in out and "hf in ./, 4 weight files" in out
    from ckptkit.progress import human

    assert human(weights) in out
    assert not (Path.cwd() / "hf-cache").exists()
    ranges = [r.range for r in hub.log if r.path.endswith(".safetensors")]
    assert ranges and all(r is not None for r in ranges)


@pytest.mark.parametrize(
    ("source", "repo", "line"),
    [
        ("org/gated", {"gated": True}, "a gated repository: accept the license at http"),
        ("org/llama2@nope", {}, "the Hub has no revision 'nope' of org/llama2"),
        ("org/missing", None, "no such local path, and no Hub repository org/missing"),
    ],
)
def test_refusals_are_one_line_before_any_weights(
    hub: FakeHub, tmp_path: Path, source: str, repo: dict[str, object] | None, line: str
) -> None:
    if repo is not None:
        everything(hub, source.split("@")[0], **repo)
    code, _, err = ckptkit("convert", source, tmp_path / "out", "--to", "hf-bin")
    assert code == 1
    assert line in err and len(err.strip().splitlines()) == 1, err
    assert "hf auth login" in err if repo and repo.get("gated") else True
    assert not [f for f in hub.fetched("GET") if f.endswith((".safetensors", ".bin", ".pth"))]
    assert not (tmp_path / "out").exists()


def test_an_unsupported_model_is_refused_from_its_config(hub: FakeHub, tmp_path: Path) -> None:
    files = {p.name: p.read_bytes() for p in HF.iterdir()}
    files["config.json"] = files["config.json"].replace(b'"llama"', b'"not_a_model"')
    hub.add("org/odd", files)
    code, _, err = ckptkit("convert", "org/odd", tmp_path / "out", "--to", "hf-bin")
    assert code == 1 and "unsupported model_type 'not_a_model'" in err, err
    assert not [r for r in hub.log if r.path.endswith(".safetensors")]  # config.json and the index only


def test_a_truncated_file_is_refused_and_a_retry_completes(hub: FakeHub, tmp_path: Path) -> None:
    everything(hub)
    hub.repos["org/llama2"].short[HF_SHARDS[1]] = 100
    code, _, err = ckptkit("convert", "org/llama2", tmp_path / "out", "--to", "hf-bin")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "retry" in err, err
    assert not (tmp_path / "out").exists()
    hub.repos["org/llama2"].short.clear()
    assert ckptkit("convert", "org/llama2", tmp_path / "out", "--to", "hf-bin", "--quiet")[0] == 0
    same_files(tmp_path / "out", local_reference(tmp_path))


def test_a_wrong_sha256_names_the_file_and_the_fix(hub: FakeHub, tmp_path: Path) -> None:
    everything(hub, lies={HF_SHARDS[2]: "0" * 64})
    code, _, err = ckptkit("convert", "org/llama2", tmp_path / "out", "--to", "hf-bin")
    assert code == 1, err
    assert f"{HF_SHARDS[2]} in the Hub cache has sha256 " in err and "the Hub says " + "0" * 64 in err
    assert "--force-download" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stream", [False, True])
def test_a_dropped_connection_resumes_where_it_stopped(
    hub: FakeHub, tmp_path: Path, stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(
        constants, "DOWNLOAD_CHUNK_SIZE", 500
    )  # huggingface_hub writes 10 MB chunks: our files are small
    everything(hub, drop_after={HF_SHARDS[0]: 1000})
    extra = ["--stream"] if stream else []
    code, _, err = ckptkit("convert", "org/llama2", tmp_path / "out", "--to", "hf-bin", "--quiet", *extra)
    assert code == 0, err
    gets = [r for r in hub.log if r.method == "GET" and r.path.endswith(HF_SHARDS[0])]
    assert len(gets) >= 2 and gets[1].range is not None and gets[1].range.startswith("bytes=1000-")
    same_files(tmp_path / "out", local_reference(tmp_path))


def test_revisions_and_subfolders(hub: FakeHub, tmp_path: Path) -> None:
    everything(hub)
    commit = hub.repos["org/llama2"].commit
    hub.repos["org/llama2"].branches["v1"] = commit
    hub.add_folder("org/nested", {"text": HF})
    for i, src in enumerate(
        [f"org/llama2@{commit}", "org/llama2@v1", "hf://org/nested/text", "hf://org/nested@main/text"]
    ):
        code, _, err = ckptkit("convert", src, tmp_path / f"out{i}", "--to", "hf-bin", "--quiet")
        assert code == 0, (src, err)
        same_files(tmp_path / f"out{i}", local_reference(tmp_path))


def test_a_local_path_that_exists_wins(hub: FakeHub, tmp_path: Path) -> None:
    everything(hub)
    shutil.copytree(FIXTURES / "hf/qwen2", tmp_path / "org/llama2")
    code, out, _ = ckptkit("inspect", "org/llama2", "--json")
    assert code == 0 and '"model_type": "qwen2"' in out
    assert hub.log == []


def test_offline_uses_the_filled_cache(hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    everything(hub)
    assert ckptkit("convert", "org/llama2", tmp_path / "online", "--to", "hf-bin", "--quiet")[0] == 0
    hub.close()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = ckptkit("convert", "org/llama2", tmp_path / "offline", "--to", "hf-bin", "--quiet")
    assert code == 0, err
    same_files(tmp_path / "offline", tmp_path / "online")
    code, _, err = ckptkit("convert", "org/other", tmp_path / "none", "--to", "hf-bin")
    assert code == 1 and "HF_HUB_OFFLINE is set and the Hub cache" in err, err


def test_the_trainer_takes_a_hub_base_by_name(hub: FakeHub) -> None:
    from ckptkit.train.checkpointer import Checkpointer

    everything(hub)
    folder, repo_id = Checkpointer._local("org/llama2", None)
    assert repo_id == "org/llama2"  # what PEFT's base_model_name_or_path will say
    assert folder.parent.name == "snapshots" and sorted(p.name for p in folder.iterdir()) == HF_FILES
    assert Checkpointer._local(str(HF), None) == (HF, "")


def test_verify_takes_hub_sources_streamed(hub: FakeHub) -> None:
    everything(hub)
    code, out, err = ckptkit("verify", "org/llama2", HF, "--stream")
    assert code == 0 and out.startswith("IDENTICAL"), (out, err)
    assert not (Path.cwd() / "hf-cache").exists()
