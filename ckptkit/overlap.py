"""Run file-to-file copies on worker threads while the caller computes other tensors.

A copy holds no tensor in memory (bytes move through one small buffer per worker), and
at most ``depth`` copies are queued or running, so a conversion's memory stays at the one
tensor the caller is transforming plus the workers' buffers.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

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
        self._pending: deque[tuple[Future[str], int]] = deque()
        self._depth = max(1, depth)
        self._on_done = on_done
        self.bytes_by_label: Counter[str] = Counter()

    def submit(self, job: Callable[[], str], nbytes: int) -> None:
        """Queue ``job``; waits for the oldest job first when ``depth`` are pending."""
        while len(self._pending) >= self._depth:
            self._finish_oldest()
        self._pending.append((self._pool.submit(job), nbytes))

    def finish(self) -> None:
        """Wait for every queued job; re-raises the first failure."""
        while self._pending:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        future, nbytes = self._pending.popleft()
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
            for future, _ in self._pending:
                future.cancel()
            self._pending.clear()
            self._pool.shutdown(wait=True)
