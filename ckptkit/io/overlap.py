"""Run file-to-file copies on worker threads while the caller computes other tensors.

A copy holds no tensor in memory (bytes move through one small buffer per worker), and
at most ``depth`` copies are queued or running, so a conversion's memory stays at the one
tensor the caller is transforming plus the workers' buffers. A full queue waits for
whichever copy finishes first, not the oldest: tensors differ in size 100-fold, and
waiting on one large copy would leave the other worker idle once the small copies queued
behind it were done.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

WORKERS = 2
DEPTH = 4


class Overlap:
    """A bounded queue of copy jobs; each job returns a label (the copy method it used).

    ``bytes_by_label`` counts the bytes of finished jobs by label; ``on_done(nbytes)`` is
    called in the caller's thread as jobs finish (for a progress bar).
    """

    def __init__(
        self, workers: int = WORKERS, depth: int = DEPTH, on_done: Callable[[int], None] | None = None
    ) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptkit-copy")
        self._pending: dict[Future[str], int] = {}  # in submission order
        self._depth = max(1, depth)
        self._on_done = on_done
        self.bytes_by_label: Counter[str] = Counter()

    def submit(self, job: Callable[[], str], nbytes: int) -> Future[str]:
        """Queue ``job``; when ``depth`` are pending, first waits until one of them is done."""
        while len(self._pending) >= self._depth:
            self._collect()
        future = self._pool.submit(job)
        self._pending[future] = nbytes
        return future

    def finish(self) -> None:
        """Wait for every queued job; re-raises the first failure."""
        while self._pending:
            self._collect()

    def _collect(self) -> None:
        """Wait until a job is done, then account for every finished one (oldest first); the
        first failure among them raises."""
        done, _ = wait(self._pending, return_when=FIRST_COMPLETED)
        for future in [f for f in self._pending if f in done]:
            nbytes = self._pending.pop(future)
            self.bytes_by_label[future.result()] += nbytes
            if self._on_done is not None:
                self._on_done(nbytes)

    def __enter__(self) -> Overlap:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        try:
            if exc_type is None:
                self.finish()
        finally:  # after a failure: drop what has not started, wait for what has
            for future in self._pending:
                future.cancel()
            self._pending.clear()
            self._pool.shutdown(wait=True)
