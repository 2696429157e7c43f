"""Publishing survives SIGKILL anywhere; one writer per DST; no leftovers; umask; OS errors.

The kill trials run in one driver process that imports ckptkit, and every module a clean
run of the job loads, once and forks a child per trial. A child either installs an audit
hook that sends itself SIGKILL at its N-th filesystem step (``ckptkit.publish`` steps,
renames, unlinks, rmdirs, rmtrees, opens for writing: deterministic, covering the replace
step), or is killed by the driver after a delay spread over the duration of a clean run
(real ``kill -9``). After each trial DST must be the complete old or the complete new
checkpoint, and the next run must succeed and leave nothing beside DST.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError

from conftest import FIXTURES, tree_hashes

DRIVER = r"""
import hashlib, importlib, json, os, re, shutil, signal, sys, time
import torch
from ckptkit.cli import app

WATCH = {"ckptkit.publish", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree"}
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT
spec = json.load(open(sys.argv[1]))
dst, watch = spec["dst"], os.path.dirname(spec["dst"])

def trainer(src, out, scale):
    from ckptkit.train.checkpointer import Checkpointer
    from ckptkit.train.schema import CheckpointerConfig
    ck = Checkpointer(CheckpointerConfig(checkpoint_dir=src, output_dir=out))
    _, sd = ck.load_base()
    ck.save("epoch_0", {k: v * scale for k, v in sd.items()}, recipe_state={"step": torch.tensor([scale])})

def child(job, kill_at, report):
    seen = [0]
    def hook(event, args):
        if event == "open":
            if not (isinstance(args[0], str) and args[0].startswith(watch) and (args[2] or 0) & WRITE):
                return
        elif event not in WATCH:
            return
        seen[0] += 1
        if seen[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    sys.addaudithook(hook)
    code = 0
    try:
        if job["kind"] == "cli":
            app(job["args"], standalone_mode=False)
        else:
            trainer(*job["args"])
    except BaseException as e:
        code = getattr(e, "exit_code", getattr(e, "code", 1))
        code = code if isinstance(code, int) else 1
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
    with open(report, "w") as f:
        json.dump({"code": code, "steps": seen[0], "modules": list(sys.modules)}, f)
    os._exit(0)

def run(job, kill_at=None, kill_after=None, modules=None):
    report = os.path.join(spec["work"], "report.json")
    if os.path.exists(report):
        os.remove(report)
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        child(job, kill_at, report)
    if kill_after is not None:
        time.sleep(kill_after)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, status = os.waitpid(pid, 0)
    try:  # none, or cut short, where a timed kill lands after the job, as the child writes it
        out = json.load(open(report))
    except (OSError, ValueError):
        out = {"code": None, "steps": None, "modules": []}
    (modules if modules is not None else []).extend(out.pop("modules"))
    out["killed"] = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    out["seconds"] = time.perf_counter() - start
    return out

def tree():
    if not os.path.isdir(dst):
        return None
    return {os.path.relpath(os.path.join(d, n), dst): hashlib.sha256(open(os.path.join(d, n), "rb").read()).hexdigest()
            for d, _, files in os.walk(dst) for n in files if n != "recipe_state.pt"}

def beside():
    name = os.path.basename(dst)
    return sorted(n for n in os.listdir(watch) if n.startswith("." + name + "."))

def reset():
    if os.path.isdir(dst):
        shutil.rmtree(dst)
    if spec["old"]:
        shutil.copytree(spec["old"], dst)

def preload(job):
    # Import here, in the order a clean run of job imports them, the modules it loads
    # lazily: each forked trial then spends its time on the job, not on importing again.
    reset()
    modules = []
    run(job, kill_at=-1, modules=modules)
    for name in modules:
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except Exception:
                pass

result = {}
preload(spec["job"])
reset()
result["old"] = tree()
probe = run(spec["job"], kill_at=-1)
result["new"], result["probe"] = tree(), probe
trials = []
n = probe["steps"]
k = spec["step_kills"]
picks = sorted({1 + round(i * (n - 1) / (k - 1)) for i in range(k)} | set(range(n - 6, n + 1)))
plan = [("step", k) for k in picks if k >= 1]
plan += [("time", probe["seconds"] * (i + 0.5) / spec["timed_kills"]) for i in range(spec["timed_kills"])]
for how, at in plan:
    reset()
    r = run(spec["job"], **({"kill_at": at} if how == "step" else {"kill_after": at}))
    r.update(how=how, at=at, after_kill=tree())
    again = run(spec["next"])
    r.update(next_code=again["code"], after_next=tree(), beside=beside())
    trials.append(r)
result["trials"] = trials
print(json.dumps(result))
"""

STEP_KILLS = 12  # deterministic kill points per scenario (plus every step of the replace)
TIMED_KILLS = 4  # real kill -9 after delays spread over a clean run


def kill_trials(work: Path, dst: Path, job: dict, next_job: dict, old: Path | None) -> dict:
    """Run the DRIVER: ``job`` killed at spread steps and times, each followed by ``next_job``."""
    work.mkdir(parents=True, exist_ok=True)
    spec = {
        "dst": str(dst), "work": str(work), "job": job, "next": next_job, "old": str(old) if old else None,
        "step_kills": STEP_KILLS, "timed_kills": TIMED_KILLS,
    }  # fmt: skip
    (work / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(work / "spec.json")], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def check_trials(result: dict, absent_ok: bool) -> dict[str, int]:
    """DST old or new after every kill; the next run completes, leaving nothing beside DST."""
    old, new = result["old"], result["new"]
    assert result["probe"]["code"] == 0 and new is not None and new != old
    seen = {"killed": 0, "old": 0, "new": 0, "absent": 0}
    for t in result["trials"]:
        seen["killed"] += t["killed"]
        state = t["after_kill"]
        if state is None or state == {}:
            assert absent_ok, t
            seen["absent"] += 1
        elif state == old:
            seen["old"] += 1
        else:
            assert state == new, f"neither old nor new after {t['how']} kill at {t['at']}"
            seen["new"] += 1
        assert t["next_code"] == 0 and t["after_next"] == new, t
        assert t["beside"] == [], t
    assert seen["killed"] >= STEP_KILLS, seen
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("force", [False, True])
def test_convert_survives_sigkill(tmp_path: Path, force: bool) -> None:
    dst = tmp_path / "out" / "dst"
    args = ["convert", str(FIXTURES / "meta/llama2"), str(dst), "--to", "hf", "--quiet"]
    old = None
    if force:  # a complete DST in another format, replaced with --force
        old = tmp_path / "old"
        convert(FIXTURES / "meta/llama2", old, ConvertOptions("hf-bin"))
    job = {"kind": "cli", "args": args + (["--force"] if force else [])}
    result = kill_trials(tmp_path / "work", dst, job, {"kind": "cli", "args": [*args, "--force"]}, old)
    seen = check_trials(result, absent_ok=not force)
    assert seen["old" if force else "absent"] and seen["new"], seen


@pytest.mark.slow
def test_trainer_save_survives_sigkill(tmp_path: Path) -> None:
    """A re-save of an existing checkpoint name, killed anywhere: old or new, never less."""
    out = tmp_path / "run"
    src = str(FIXTURES / "hf/llama2")
    old = tmp_path / "old"
    from ckptkit.train.checkpointer import Checkpointer
    from ckptkit.train.schema import CheckpointerConfig

    ck = Checkpointer(CheckpointerConfig(checkpoint_dir=src, output_dir=str(tmp_path)))
    _, sd = ck.load_base()
    ck.save("old", sd, recipe_state={"step": torch.tensor([1])})
    job = {"kind": "trainer", "args": [src, str(out), 2]}
    result = kill_trials(tmp_path / "work", out / "epoch_0", job, job, old)
    seen = check_trials(result, absent_ok=False)
    assert seen["old"] and seen["new"], seen


# --- concurrency, leftovers, permissions, errors ---------------------------------------------


def test_second_writer_fails_with_one_line(tmp_path: Path) -> None:
    from ckptkit.io.publish import leftovers, lock_path, publishing

    dst = tmp_path / "dst"
    with publishing(dst) as tmp:
        (tmp / "a").write_text("first")
        with pytest.raises(CkptkitError, match=r"another ckptkit process is writing it \(pid \d+\)") as e:
            convert(FIXTURES / "hf/llama2", dst, ConvertOptions("meta"))
        assert "\n" not in str(e.value)
    assert (dst / "a").read_text() == "first"
    assert not leftovers(tmp_path) and not lock_path(dst).exists()


def test_later_writer_never_deletes_finished_output(tmp_path: Path) -> None:
    """Two converts to one DST, one after the other: the later refuses without --force."""
    dst = tmp_path / "dst"
    convert(FIXTURES / "hf/llama2", dst, ConvertOptions("meta"))
    before = tree_hashes(dst)
    with pytest.raises(CkptkitError, match="not empty"):
        convert(FIXTURES / "hf/llama3", dst, ConvertOptions("meta"))
    assert tree_hashes(dst) == before


def test_stale_leftovers_of_killed_writers_are_removed(tmp_path: Path) -> None:
    from ckptkit.io.publish import sweep

    dst = tmp_path / "dst"
    stale = [
        tmp_path / ".dst.12345-abcd1234.ckptkit-tmp",
        tmp_path / ".dst.k3j4h5g6.ckptkit-tmp",  # the names mkdtemp gave before
        tmp_path / ".other.999-ffff.ckptkit-tmp",
    ]
    for p in stale:
        p.mkdir()
        (p / "model.safetensors").write_bytes(b"x" * 100)
    convert(FIXTURES / "hf/llama2", dst, ConvertOptions("meta"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.999-ffff.ckptkit-tmp", "dst"]
    assert sweep(tmp_path) == [stale[2]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


def test_set_aside_old_checkpoint_is_restored(tmp_path: Path) -> None:
    """A writer killed between 'old aside' and 'new in' (filesystems without an atomic
    exchange): the next run puts the old checkpoint back before anything else."""
    from ckptkit.io.publish import leftovers

    dst = tmp_path / "dst"
    convert(FIXTURES / "hf/llama2", dst, ConvertOptions("meta"))
    before = tree_hashes(dst)
    aside = tmp_path / ".dst.4242-00ff00ff.ckptkit-old"
    os.rename(dst, aside)
    (tmp_path / ".dst.4242-00ff00ff.ckptkit-tmp").mkdir()
    with pytest.raises(CkptkitError, match="not empty"):
        convert(FIXTURES / "hf/llama3", dst, ConvertOptions("meta"))
    assert tree_hashes(dst) == before and not leftovers(tmp_path)


def test_replace_without_atomic_exchange(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptkit.io.publish as publish
    from ckptkit.io.publish import leftovers

    monkeypatch.setattr(publish, "_EXCHANGE", None)
    dst = tmp_path / "dst"
    convert(FIXTURES / "hf/llama2", dst, ConvertOptions("meta"))
    convert(FIXTURES / "hf/llama2", dst, ConvertOptions("hf", force=True))
    assert (dst / "config.json").is_file() and not (dst / "params.json").exists()
    assert not leftovers(tmp_path)


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_output_permissions_follow_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        dst = tmp_path / "dst"
        convert(FIXTURES / "meta/llama2", dst, ConvertOptions("hf"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(dst.stat().st_mode) == 0o777 & ~umask
    for p in dst.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask, p


def _limited(limit: int):
    def pre() -> None:
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return pre


@pytest.mark.parametrize("to", ["meta", "hf"])
def test_write_failure_is_one_line_naming_dst(tmp_path: Path, to: str) -> None:
    """A write that fails (file size limit: the same failed write(2) as a full disk) ends
    in one line naming DST and the cause, and leaves nothing behind."""
    dst = tmp_path / "dst"
    src = FIXTURES / ("hf/llama2" if to == "meta" else "meta/llama2")
    proc = subprocess.run(
        [sys.executable, "-m", "ckptkit", "convert", str(src), str(dst), "--to", to],
        capture_output=True,
        text=True,
        preexec_fn=_limited(20_000),
        timeout=120,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    [line] = proc.stderr.splitlines()
    assert f"{dst}: cannot write" in line and "File too large" in line, line
    assert sorted(tmp_path.iterdir()) == []


def _mode_bits_apply() -> None:
    """As root, drop the capabilities that ignore file mode bits (kept off across exec)."""
    if os.geteuid() == 0:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
        for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
            if prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_permission_denied_is_one_line(tmp_path: Path) -> None:
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    dst = parent / "dst"
    proc = subprocess.run(
        [sys.executable, "-m", "ckptkit", "convert", str(FIXTURES / "hf/llama2"), str(dst), "--to", "meta"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_mode_bits_apply,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    [line] = proc.stderr.splitlines()
    assert f"{dst}: cannot write: Permission denied" in line, line
    assert sorted(parent.iterdir()) == []


def test_every_file_and_folder_is_fsynced_before_it_is_put_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckptkit.io.publish as publish

    events: list[tuple[str, str]] = []
    real = publish._fsync

    def recording(path: Path, flags: int) -> None:
        events.append(("fsync", str(path)))
        real(path, flags)

    monkeypatch.setattr(publish, "_fsync", recording)
    monkeypatch.setattr(publish, "_audit", lambda step, path: events.append((step, str(path))))
    dst = tmp_path / "dst"
    convert(FIXTURES / "meta/llama2", dst, ConvertOptions("hf"))
    [(tmp, _)] = [(p, i) for i, (step, p) in enumerate(events) if step == "mkdir"]
    put = next(i for i, (step, _) in enumerate(events) if step in ("rename", "exchange"))
    synced = {Path(p).relative_to(tmp) for step, p in events[:put] if step == "fsync" and p.startswith(tmp)}
    assert synced == {p.relative_to(dst) for p in dst.rglob("*")} | {Path(".")}
    assert events[-1] == ("fsync", str(tmp_path))  # the parent, after the rename


PRUNE_CHILD = r"""
import os, signal, sys
from ckptkit.train.checkpointer import Checkpointer
from ckptkit.train.schema import CheckpointerConfig
src, out = sys.argv[1], sys.argv[2]
ck = Checkpointer(CheckpointerConfig(checkpoint_dir=src, output_dir=out, keep_last_n_checkpoints=1))
removed = [0]
def hook(event, args):
    if event == "os.remove":
        removed[0] += 1
        if removed[0] == 2:  # in the middle of deleting the old checkpoint's files
            os.kill(os.getpid(), signal.SIGKILL)
sys.addaudithook(hook)
ck.prune(steps_per_epoch=10)
"""


def test_a_pruned_checkpoint_is_never_left_half_deleted(tmp_path: Path) -> None:
    """keep_last_n pruning killed midway: the old checkpoint's name is gone at once (no
    partial step_1 a resume could pick up); the next sweep removes what is left."""
    from ckptkit.io.publish import leftovers, sweep

    out = tmp_path / "out"
    for name in ("step_1", "step_2"):
        convert(FIXTURES / "meta/llama2", out / name, ConvertOptions("hf"))
    assert len(list((out / "step_1").iterdir())) > 2
    proc = subprocess.run([sys.executable, "-c", PRUNE_CHILD, str(FIXTURES / "meta/llama2"), str(out)])
    assert proc.returncode == -9
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["step_2"]
    (left,) = leftovers(out, "step_1")
    assert left.is_dir()
    assert sweep(out) == [left] and sorted(p.name for p in out.iterdir()) == ["step_2"]
