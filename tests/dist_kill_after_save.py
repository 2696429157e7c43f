"""Run a distributed recipe under torchrun and SIGKILL every rank right after checkpoint
``$CKPTKIT_KILL_AFTER`` (e.g. ``step_2``) is published: a run killed mid-epoch.

    torchrun --nproc-per-node 2 tests/dist_kill_after_save.py RECIPE --config ... [key=value ...]
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

from ckptkit.train import distributed

save_sharded = distributed.save_sharded


def save_then_die(checkpointer, name, *args, **kwargs):  # type: ignore[no-untyped-def]
    path = save_sharded(checkpointer, name, *args, **kwargs)
    if name == os.environ["CKPTKIT_KILL_AFTER"]:
        os.kill(os.getpid(), signal.SIGKILL)
    return path


distributed.save_sharded = save_then_die
recipe = sys.argv.pop(1)
runpy.run_module(f"ckptkit.train.recipes.{recipe}", run_name="__main__", alter_sys=True)
