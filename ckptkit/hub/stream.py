"""Read a Hub file by HTTP range requests, keeping no copy: a :class:`~ckptkit.io.SourceFile`
the format readers and the copy engine read like a local one (``--stream``)."""

from __future__ import annotations

import threading
from pathlib import Path

from ckptkit.hub.listing import HubError, Listing, RemoteFile, endpoint, hub_errors, transient

READ_AHEAD = 32 << 20  # bytes fetched per request when reads go forward (one tensor is read in 1 MiB calls)
RETRIES = 5


class RangeFile:
    """One file of a Hub repository at a commit, read by ``Range`` requests with read-ahead."""

    def __init__(self, listing: Listing, remote: RemoteFile, path: Path) -> None:
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers

        self.path = path
        self.listing, self.remote = listing, remote
        self._url = hf_hub_url(listing.ref.repo_id, remote.name, revision=listing.commit, endpoint=endpoint())
        self._headers = build_hf_headers()
        self._buf, self._start = b"", 0
        self._lock = threading.Lock()
        self.requests = 0

    def size(self) -> int:
        return self.remote.size

    def fileno(self) -> int | None:
        return None

    def close(self) -> None:
        self._buf = b""

    def readinto(self, view: memoryview, offset: int) -> int:
        """Up to ``len(view)`` bytes at ``offset`` (0 at the end), from the read-ahead buffer or a new request."""
        n = max(0, min(len(view), self.remote.size - offset))
        if n == 0:
            return 0
        with self._lock:
            if not (self._start <= offset and offset + n <= self._start + len(self._buf)):
                want = min(max(n, READ_AHEAD), self.remote.size - offset)
                self._buf, self._start = self._get(offset, want), offset
            at = offset - self._start
            view[:n] = self._buf[at : at + n]
        return n

    def _get(self, offset: int, length: int) -> bytes:
        """Bytes ``offset .. offset + length`` by range requests, resuming after a dropped connection."""
        got = bytearray()
        failures = 0
        while len(got) < length:
            before = len(got)
            try:
                self._request(got, offset, length)
            except Exception as e:
                if not transient(e):
                    with hub_errors(self.listing.ref, self.remote.name):
                        raise
                    raise
                failures = 0 if len(got) > before else failures + 1
                if failures > RETRIES:
                    raise HubError(
                        f"{self.listing.ref}: {self.remote.name}: the connection failed {failures} times at byte "
                        f"{offset + len(got)}; retry"
                    ) from None
        return bytes(got)

    def _request(self, got: bytearray, offset: int, length: int) -> None:
        """One range request for the bytes still missing, appended to ``got`` as they arrive."""
        from huggingface_hub.utils import get_session, hf_raise_for_status

        first = offset + len(got)
        headers = {**self._headers, "Range": f"bytes={first}-{offset + length - 1}", "Accept-Encoding": "identity"}
        self.requests += 1
        with get_session().stream("GET", self._url, headers=headers, follow_redirects=True) as r:
            hf_raise_for_status(r)
            if r.status_code != 206 and first > 0:  # a 200 from the start is the whole file: its head will do
                raise HubError(
                    f"{self.listing.ref}: {self.remote.name}: the server does not answer range requests; "
                    "drop --stream to download it instead"
                )
            for chunk in r.iter_bytes():  # as it arrives: a dropped connection loses nothing
                got += chunk[: length - len(got)]
                if len(got) >= length:
                    break
