"""Run a recipe on N gloo ranks forked from the test process, as torchrun would start them.

A torchrun launch pays for three interpreters importing torch and ckptkit (the agent and two
workers: 10-30 s of CPU on the 2-core CI) before the first step. The test process has imported
them already: here each rank is a ``fork`` of it with torchrun's environment (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, one thread per rank), so the recipe joins its
process group exactly as under torchrun (a 1-rank fork runs single-threaded too). Like
torchrun's agent, the first rank that fails (an error, a signal) gets the others stopped.
Tests about the launcher itself (its lines, exit codes, signals) keep ``ckptkit run``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(rank: int, nproc: int, port: int, env: dict[str, str], log: Path, target: Callable[[], Any]) -> None:
    code = 1
    try:
        os.dup2(os.open(log.with_suffix(".out"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
        os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process ends here)
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        rank_env = {"RANK": rank, "LOCAL_RANK": rank, "GROUP_RANK": 0, "WORLD_SIZE": nproc,
                    "LOCAL_WORLD_SIZE": nproc, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                    "OMP_NUM_THREADS": 1}  # fmt: skip
        if nproc > 1:
            os.environ.update({k: str(v) for k, v in rank_env.items()})
        os.environ.update(env)
        torch = sys.modules.get("torch")
        if torch is not None:
            # torchrun's default for several workers on one node; and OpenMP (libgomp) hangs in a
            # fork of a process that ran a parallel region, unless the fork runs none
            torch.set_num_threads(1)
            if os.environ.get("TORCH_COMPILE_DISABLE") == "1":  # read by dynamo at import, maybe done
                import torch._dynamo

                torch._dynamo.config.disable = True
        target()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def fork_ranks(
    target: Callable[[], Any],
    log_dir: Path,
    nproc: int = 2,
    env: dict[str, str] | None = None,
    check: bool = True,
    timeout: float = 900,
) -> list[int]:
    """Run ``target()`` on ``nproc`` forked ranks (``nproc`` 1: a plain process, no ``MASTER_ADDR``);
    each rank's stderr goes to ``log_dir/rank_N.log``, its stdout to ``rank_N.out``. Returns the exit codes (negative:
    killed by that signal); with ``check``, any nonzero one fails with the logs' tails. Ranks still
    running after ``timeout`` seconds are stopped and fail the test."""
    import torch.distributed as dist

    assert not dist.is_initialized(), "a process group in the test process would be shared by the ranks"
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _child(rank, nproc, port, env or {}, log_dir / f"rank_{rank}.log", target)
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while len(codes) < nproc:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                _stop([p for p in pids if p not in codes], codes)
                raise AssertionError(f"ranks still running after {timeout} s (stopped)")
            time.sleep(0.01)
            continue
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0:  # as torchrun's agent: stop the others (they may wait in a collective)
            _stop([p for p in pids if p not in codes], codes)
    result = [codes[p] for p in pids]
    if check and any(result):
        logs = "\n".join(f"--- rank {r}:\n{logs_tail(log_dir, r)}" for r in range(nproc))
        raise AssertionError(f"ranks exited with {result}\n{logs}")
    return result


def _stop(pids: list[int], codes: dict[int, int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for pid in pids:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                break
            time.sleep(0.05)


def logs_tail(log_dir: Path, rank: int, chars: int = 3000) -> str:
    return (log_dir / f"rank_{rank}.log").read_text(errors="replace")[-chars:]


def recipe_on_ranks(
    recipe: str,
    config: str,
    *overrides: str,
    log_dir: Path,
    nproc: int = 2,
    before_run: Callable[[], None] | None = None,
    **kwargs: Any,
) -> list[int]:
    """Bundled ``recipe`` with ``config`` and KEY=VALUE ``overrides`` on ``nproc`` forked ranks
    (``before_run``: called first in each rank, e.g. to patch what the run calls)."""
    import torch.distributed.checkpoint  # noqa: F401  (imported once here, not by each rank)

    from ckptkit.train.config import load_config
    from ckptkit.train.recipes import recipe_entry

    entry = recipe_entry(recipe)

    def target() -> None:
        if before_run is not None:
            before_run()
        entry(load_config(config, list(overrides)))

    return fork_ranks(target, log_dir, nproc, **kwargs)


def killed_after_save(
    recipe: str, config: str, *overrides: str, log_dir: Path, after: str | None = None, before: str | None = None
) -> list[int]:
    """``recipe`` on 2 forked ranks with rank 0 SIGKILLed (the other then stopped) right after
    checkpoint ``after`` is put in place, or with ``before`` completely written in its temporary
    folder but not yet renamed into place (a kill during an asynchronous save), as
    tests/dist_kill_after_save.py does under torchrun. Returns the exit codes."""
    from ckptkit.train import distributed

    publish = distributed.publish

    def publish_then_die(name: str, stack: ExitStack, finish: Callable[[], None]) -> None:
        if name == before:
            finish()
            os.kill(os.getpid(), signal.SIGKILL)
        publish(name, stack, finish)
        if name == after:
            os.kill(os.getpid(), signal.SIGKILL)

    def patch() -> None:
        distributed.publish = publish_then_die  # in the forked rank only

    return recipe_on_ranks(recipe, config, *overrides, log_dir=log_dir, before_run=patch, check=False)


def cli_in_fork(
    args: list[str],
    log_dir: Path,
    env: dict[str, str] | None = None,
    before_run: Callable[[], None] | None = None,
) -> tuple[int, str]:
    """``ckptkit ARGS`` in a fork of the test process (its own stdout and stderr, not a terminal):
    what a ``ckptkit`` subprocess does, without importing torch again. Its exit code and stderr."""
    from ckptkit.cli import app

    def target() -> None:
        if before_run is not None:
            before_run()
        app(args, prog_name="ckptkit")  # as python -m ckptkit

    [code] = fork_ranks(target, log_dir, nproc=1, env=env, check=False)
    return code, (log_dir / "rank_0.log").read_text()


def ckptkit_forked(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m ckptkit ARGS`` as ``subprocess.run(..., capture_output=True, text=True)`` gives it,
    run by :func:`cli_in_fork`."""
    with tempfile.TemporaryDirectory() as logs:
        code, stderr = cli_in_fork([str(a) for a in args], Path(logs), env=env)
        stdout = (Path(logs) / "rank_0.out").read_text()
    return subprocess.CompletedProcess(["ckptkit", *map(str, args)], code, stdout, stderr)
