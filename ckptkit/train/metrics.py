"""What the recipes report: metrics as JSON lines (and TensorBoard, W&B), progress on stderr
(a bar on a terminal, timestamped lines otherwise) and an end summary."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ckptkit.errors import CkptkitError

if TYPE_CHECKING:
    from ckptkit.train.schema import WandbConfig

METRICS_FILE = "metrics.jsonl"


class MetricLogger:
    """Metrics as JSON lines in ``output_dir/metrics.jsonl``; TensorBoard when installed; W&B
    when ``wandb.project`` is set (``wandb`` must then be installed: checked here, in setup)."""

    def __init__(
        self, output_dir: Path, resume: bool, wandb: WandbConfig | None = None, run_config: dict | None = None
    ) -> None:
        self.wandb = None
        if wandb is not None and wandb.project:
            try:
                import wandb as wandb_lib
            except ImportError:
                raise CkptkitError("wandb.project is set but wandb is not installed (pip install wandb)") from None
            settings = {k: v for k, v in vars(wandb).items() if v is not None}
            self.wandb = wandb_lib.init(dir=str(output_dir), config=run_config, resume="allow", **settings)
        output_dir.mkdir(parents=True, exist_ok=True)
        # a resumed run appends; a fresh one starts it (Checkpointer.check_fresh refused a folder holding one)
        self.file = (output_dir / METRICS_FILE).open("a" if resume else "w", encoding="utf-8")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb: Any = SummaryWriter(str(output_dir / "tensorboard"))
        except ImportError:
            self.tb = None

    def log(self, step: int, **values: float) -> None:
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def event(self, **values: Any) -> None:
        self.file.write(json.dumps(values) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def peak_memory(device: torch.device) -> int:
    """Peak bytes: CUDA memory allocated on a GPU, the process's peak RSS on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class Progress:
    """Progress on stderr: a rich bar on a terminal; timestamped plain lines otherwise (a log
    file, nohup, a scheduler), one every ``log_every`` steps. ``quiet`` silences both."""

    def __init__(self, total: int, done: int, quiet: bool, log_every: int = 1, device: str = "cpu") -> None:
        self.total, self.log_every, self.quiet = total, log_every, quiet
        self.device = torch.device(device)
        self.bar = None
        self.started = time.perf_counter()
        self.tokens = 0
        if not quiet and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"), TimeRemainingColumn(),
            )  # fmt: skip
            self.task = self.bar.add_task("train", total=total, completed=done, stats="")

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def update(self, step: int, epoch: int, loss: float, lr: float, rate: float, tokens: int) -> None:
        """After optimizer step ``step`` (1-based) of epoch ``epoch`` (0-based, as in ``metrics.jsonl``
        and the ``epoch_N`` folders)."""
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(self.task, completed=step, stats=f"loss {loss:.4f}  {rate:.0f} tok/s")
        elif not self.quiet and (step % self.log_every == 0 or step == self.total):
            memory = human_bytes(peak_memory(self.device))
            self.note(
                f"step {step}/{self.total} epoch {epoch} loss {loss:.4f} lr {lr:.3e} "
                f"tokens/s {rate:.0f} peak_mem {memory}"
            )

    def note(self, text: str, always: bool = False) -> None:
        """One line: above the bar on a terminal, timestamped otherwise (``quiet`` silences it
        unless ``always``)."""
        if self.quiet and not always:
            return
        if self.bar is not None:
            self.bar.console.print(text, highlight=False, markup=False)
        else:
            print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}", file=sys.stderr, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def summary(self, step: int, checkpointer: Any, finished: bool) -> None:
        """The end-of-run report: how far it got, the checkpoints written, how to resume."""
        seconds = time.perf_counter() - self.started
        rate = f", {self.tokens / seconds:.0f} tokens/s" if seconds > 0 and self.tokens else ""
        self.note(f"{'finished' if finished else 'stopped'} at step {step}/{self.total} after {seconds:.1f}s{rate}")
        if checkpointer.saved:
            self.note("checkpoints: " + ", ".join(str(p) for p in checkpointer.saved))
        resume_from = None if finished else checkpointer.latest_resumable()
        if resume_from is not None:  # said even when quiet: a stopped run must say how to go on
            self.note(
                "resume with the same command plus: resume_from_checkpoint=true "
                f"checkpointer.recipe_checkpoint={resume_from}",
                always=True,
            )
