"""Run a distributed recipe under torchrun and SIGKILL rank 0 (torchrun then stops the
others) around the publishing of a checkpoint, once every rank's shards are written:

- ``CKPTKIT_KILL_AFTER=step_2``: right after ``step_2`` is put in place (a run killed mid-epoch);
- ``CKPTKIT_KILL_BEFORE=step_4``: with ``step_4`` completely written in its temporary folder
  but not yet renamed into place (a kill during an asynchronous save).

    torchrun --nproc-per-node 2 tests/dist_kill_after_save.py RECIPE --config ... [key=value ...]
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from collections.abc import Callable
from contextlib import ExitStack

from ckptkit.train import distributed

publish = distributed.publish


def publish_then_die(name: str, stack: ExitStack, finish: Callable[[], None]) -> None:
    if name == os.environ.get("CKPTKIT_KILL_BEFORE"):
        finish()
        os.kill(os.getpid(), signal.SIGKILL)
    publish(name, stack, finish)
    if name == os.environ.get("CKPTKIT_KILL_AFTER"):
        os.kill(os.getpid(), signal.SIGKILL)


distributed.publish = publish_then_die
recipe = sys.argv.pop(1)
runpy.run_module(f"ckptkit.train.recipes.{recipe}", run_name="__main__", alter_sys=True)
