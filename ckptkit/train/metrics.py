"""What the recipes report: metrics as JSON lines (and TensorBoard), and a progress bar."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


class MetricLogger:
    """Metrics as JSON lines in ``output_dir/metrics.jsonl``, and TensorBoard when installed."""

    def __init__(self, output_dir: Path, resume: bool) -> None:
        output_dir.mkdir(parents=True, exist_ok=True)
        self.file = (output_dir / "metrics.jsonl").open("a" if resume else "w", encoding="utf-8")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(output_dir / "tensorboard"))
        except ImportError:
            self.tb = None

    def log(self, step: int, **values: float) -> None:
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)

    def event(self, **values: Any) -> None:
        self.file.write(json.dumps(values) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


class Progress:
    """A rich bar with loss, tokens/s and ETA on stderr; silent when not a terminal."""

    def __init__(self, total: int, done: int, quiet: bool) -> None:
        self.bar = None
        if not quiet and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.4f}  {task.fields[rate]:.0f} tok/s"), TimeRemainingColumn(),
            )  # fmt: skip
            self.task = self.bar.add_task("train", total=total, completed=done, loss=float("nan"), rate=0.0)

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def update(self, step: int, loss: float, rate: float) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step, loss=loss, rate=rate)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()
