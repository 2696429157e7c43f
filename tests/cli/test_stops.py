"""Every way a user stops ckptkit ends in one line: Ctrl-C, SIGTERM and SIGHUP sent to a
real ``ckptkit`` process in the middle of a write leave no temporary folder, no lock and no
half-written checkpoint, print one line, and exit 128 + the signal's number (a save stopped
by a signal is also checked in this process, with the ckptkit app under CliRunner)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import FIXTURES
from train_helpers import ckptkit

REPO = Path(__file__).resolve().parents[2]
STOPS = [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "stopped by SIGTERM"), (signal.SIGHUP, "stopped by SIGHUP")]


def big_checkpoint(folder: Path, vocab: int = 1 << 20) -> Path:
    """The tiny HF llama2 fixture with a ``vocab`` x 64 embedding and output (256 MiB in
    bfloat16 for 2**20): big enough that writing it takes a while."""
    sd: dict[str, torch.Tensor] = {}
    for f in sorted((FIXTURES / "hf/llama2").glob("*.safetensors")):
        sd |= load_file(f)
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        sd[key] = torch.zeros(vocab, sd[key].shape[1], dtype=sd[key].dtype)
    config = json.loads((FIXTURES / "hf/llama2/config.json").read_text()) | {"vocab_size": vocab}
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def beside(dst: Path) -> list[str]:
    """What a writer of ``dst`` has beside it: temporary folders and the lock."""
    if not dst.parent.is_dir():
        return []
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}."))


def stop_mid_write(args: list[str], dst: Path, signum: int) -> subprocess.CompletedProcess[str]:
    """Run ``ckptkit ARGS``; once a weight file is being written into the temporary folder
    beside ``dst``, freeze the process (SIGSTOP), check that it is mid-write, send it
    ``signum`` and let it go on (SIGCONT)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptkit", *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            tmps = [dst.parent / n for n in beside(dst) if n.endswith(".ckptkit-tmp")]
            if any(f.stat().st_size > 0 for t in tmps for f in t.glob("*.bin") if f.exists()):
                break
            time.sleep(0.002)
        proc.send_signal(signal.SIGSTOP)
        assert proc.poll() is None and not dst.exists(), "the write ended before it could be stopped"
        assert any(n.endswith(".ckptkit-tmp") for n in beside(dst))
        proc.send_signal(signum)
        proc.send_signal(signal.SIGCONT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "said"), STOPS, ids=[s.name for s, _ in STOPS])
def test_convert_stopped_mid_write_leaves_nothing(tmp_path: Path, signum: int, said: str) -> None:
    src = big_checkpoint(tmp_path / "big")
    dst = tmp_path / "out" / "dst"
    res = stop_mid_write(["convert", str(src), str(dst), "--to", "hf-bin", "--quiet"], dst, signum)
    assert res.returncode == 128 + signum, res.stderr
    assert res.stderr == f"{said}; nothing was written to the destination\n"
    assert not (tmp_path / "out").exists()  # no DST, no temporary folder, no lock, no parent made for it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big"]


STOP_IN_SAVE: dict[str, int | str] = {}  # signum, name: the signal this process sends itself in that save


def _stop_in_save(event: str, hook_args: tuple) -> None:
    """An audit hook: SIGNUM to this process once checkpoint NAME is written, before it is put in place."""
    if STOP_IN_SAVE and event == "ckptkit.publish" and hook_args[0] == "fsync":
        if f".{STOP_IN_SAVE['name']}." in hook_args[1]:
            os.kill(os.getpid(), int(STOP_IN_SAVE.pop("signum")))
            STOP_IN_SAVE.clear()


@pytest.fixture(scope="module")
def stop_in_save() -> Iterator[dict[str, int | str]]:
    """Arm with ``signum`` and ``name``; disarmed after each use (an audit hook stays for the process)."""
    sys.addaudithook(_stop_in_save)
    yield STOP_IN_SAVE
    STOP_IN_SAVE.clear()


@pytest.mark.parametrize(("signum", "said"), STOPS, ids=[s.name for s, _ in STOPS])
def test_training_stopped_in_a_save_says_the_last_complete_checkpoint(
    tmp_path: Path, signum: int, said: str, stop_in_save: dict[str, int | str]
) -> None:
    """Ctrl-C / SIGTERM / SIGHUP while step_2 is being saved: step_2 is not kept, step_1 is
    the one to resume from, and the run says so; exit 130 / 143 / 129. The ckptkit command
    runs in this process (CliRunner), which sends itself the signal."""
    out = tmp_path / "out"
    args = ["run", "lora_finetune", "--config", "tiny_lora", "epochs=1", "max_steps_per_epoch=4",
            "save_every_n_steps=1", "quiet=false", f"checkpointer.output_dir={out}"]  # fmt: skip
    stop_in_save.update(signum=int(signum), name="step_2")
    try:
        res = ckptkit(*args)
    finally:
        stop_in_save.clear()
    assert res.exit_code == 128 + signum, res.output
    lines = res.stderr.strip().splitlines()
    assert "Traceback" not in res.output and isinstance(res.exception, SystemExit)
    assert lines[-4].endswith("stopped at step 2/4 after " + lines[-4].split(" after ")[1])
    assert lines[-3].endswith(f"checkpoints: {out / 'step_1'}")
    resume = f"resume_from_checkpoint=true checkpointer.recipe_checkpoint={out / 'step_1'}"
    assert lines[-2].endswith(f"resume with the same command plus: {resume}")
    assert lines[-1] == f"{said}; no checkpoint was left half-written"
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "step_1"]


def assert_told_the_stop(stderr: str, said: str, out: Path) -> None:
    """Rank 0's summary (where it got to, the complete checkpoints, how to resume), then the
    launcher's one line; nothing from the other rank, torchrun or the process group."""
    assert "Traceback" not in stderr and "Error" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert lines[-1] == f"{said}; no checkpoint was left half-written", stderr
    assert " stopped at step " in lines[-4], stderr
    saved = [p for p in sorted(out.iterdir()) if p.name != "metrics.jsonl"]
    assert saved and all(p.name.startswith("step_") for p in saved), saved  # nothing beside: no temporary folder
    assert lines[-3].endswith("checkpoints: " + ", ".join(map(str, saved)))
    resume = f"resume_from_checkpoint=true checkpointer.recipe_checkpoint={saved[-1]}"
    assert lines[-2].endswith(f"resume with the same command plus: {resume}")
    assert not [line for line in lines if line.startswith(("W1", "E1", "[rank"))][4:], stderr  # torchrun's banner only


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "said", "group"),
    [(signal.SIGINT, "interrupted", True), (signal.SIGTERM, "stopped by SIGTERM", False)],
    ids=["ctrl-c", "SIGTERM"],
)
def test_multiprocess_run_stops_in_one_line(tmp_path: Path, signum: int, said: str, group: bool) -> None:
    """``ckptkit run --nproc-per-node 2``, once a checkpoint is saved: Ctrl-C (SIGINT to the
    terminal's process group: the launcher and both ranks) or SIGTERM to the launcher alone
    (as a job scheduler sends it): every rank stops, exit 130 / 143."""
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptkit", "run", "full_finetune_distributed", "--nproc-per-node", "2",
         "--config", "tiny_full_distributed", "epochs=3", "save_every_n_steps=2", "quiet=false",
         f"checkpointer.output_dir={out}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if out.is_dir() and any(p.name.startswith("step_") for p in out.iterdir()):
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1]
        os.killpg(proc.pid, signum) if group else proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signum, stderr
    assert_told_the_stop(stderr, said, out)
