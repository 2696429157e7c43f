"""The copy queue of a conversion: bounded, every job accounted once, failures raised,
and a full queue waiting for whichever copy finishes first."""

from __future__ import annotations

import threading
import time

import pytest

from ckptkit.io import Overlap


def test_a_long_copy_does_not_hold_up_the_queue() -> None:
    """With one large copy running, the other worker keeps taking the small ones: the
    caller may submit more than ``depth`` jobs before the large one finishes."""
    release = threading.Event()
    done: list[str] = []

    def large() -> str:
        assert release.wait(30)
        done.append("large")
        return "stream"

    def small(i: int) -> str:
        done.append(f"small{i}")
        return "stream"

    submitted = threading.Event()
    with Overlap(workers=2, depth=2) as copies:

        def caller() -> None:
            copies.submit(large, 100)
            for i in range(6):  # each waits for a free slot, which only the small copies free
                copies.submit(lambda i=i: small(i), 1)
            submitted.set()

        t = threading.Thread(target=caller)
        t.start()
        assert submitted.wait(10), "the queue waited on the oldest (large) copy"
        release.set()
        t.join()
    assert done.index("large") >= 5 and sorted(done) == ["large", *(f"small{i}" for i in range(6))]
    assert copies.bytes_by_label == {"stream": 106}


def test_pending_jobs_never_exceed_depth() -> None:
    running = 0
    most = 0
    lock = threading.Lock()

    def job() -> str:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.002)
        with lock:
            running -= 1
        return "x"

    seen: list[int] = []
    with Overlap(workers=4, depth=3, on_done=seen.append) as copies:
        for i in range(40):
            copies.submit(job, i)
            assert len(copies._pending) <= 3
    assert most <= 3 and sorted(seen) == list(range(40)) and copies.bytes_by_label["x"] == sum(range(40))


def test_a_failed_copy_raises_and_stops_the_rest() -> None:
    ran: list[int] = []

    def job(i: int) -> str:
        if i == 3:
            raise OSError(28, "No space left on device")
        ran.append(i)
        time.sleep(0.001)
        return "x"

    with pytest.raises(OSError, match="No space"), Overlap(workers=2, depth=2) as copies:
        for i in range(50):
            copies.submit(lambda i=i: job(i), 1)
    assert len(ran) < 49  # not every job ran after the failure surfaced
