"""Fetch a selection's files through huggingface_hub's cache (shared with transformers,
resumable), one progress bar for all of them, each file checked against the Hub's size and
checksum before it is used. ckptkit never writes into the cache itself."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from ckptkit.formats.hub_files import Selection
from ckptkit.hub.listing import HubError, Listing, RemoteFile, cache_dir, endpoint, hub_errors
from ckptkit.progress import Bar, byte_progress

CHECKED_DIR = "hub-checked"  # under ckptkit's own cache: blobs whose checksum already matched


def _bar_class(bar: Bar) -> type[Any]:
    """A tqdm class for huggingface_hub that shows nothing itself and adds its bytes to ``bar``."""
    from huggingface_hub.utils import tqdm

    class Forward(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            if kwargs.get("initial"):
                bar.advance(int(kwargs["initial"]))

        def update(self, n: float | None = 1) -> bool | None:
            bar.advance(int(n or 0))
            return None

    return Forward


def fetch(listing: Listing, selection: Selection, quiet: bool) -> Path:
    """Download (or find in the cache) every file of ``selection``; the snapshot folder holding them."""
    from huggingface_hub import hf_hub_download

    prefix = f"{selection.folder}/" if selection.folder else ""
    remote = [listing.files[prefix + name] for name in selection.files]
    snapshot: Path | None = None
    with byte_progress(f"download {listing.ref}", sum(f.size for f in remote), quiet) as bar:
        tqdm_class = _bar_class(bar)
        for f in remote:
            with hub_errors(listing.ref, f.name):
                local = Path(
                    hf_hub_download(
                        listing.ref.repo_id,
                        f.name,
                        revision=listing.ref.revision or "main",  # so the cache maps it to the commit (offline use)
                        cache_dir=cache_dir(),
                        endpoint=endpoint(),
                        tqdm_class=tqdm_class,
                    )
                )
            if listing.commit not in local.parts:
                raise HubError(f"{listing.ref}: the repository changed while it was downloaded; retry")
            check(listing, f, local)
            snapshot = Path(str(local)[: -len(f.name)].rstrip("/"))
    assert snapshot is not None
    return snapshot / selection.folder if selection.folder else snapshot


def check(listing: Listing, remote: RemoteFile, local: Path) -> None:
    """A one-line error unless the cached ``local`` file has the Hub's size and checksum."""
    size = local.stat().st_size
    fix = (
        f"fetch it again: `hf download {listing.ref.repo_id} {remote.name} --revision {listing.commit} "
        "--force-download`"
    )
    if size != remote.size:
        raise HubError(
            f"{listing.ref}: {remote.name} in the Hub cache has {size} bytes, the Hub says {remote.size}; {fix}"
        )
    if remote.sha256 is None and remote.blob_id is None:
        return
    blob = local.resolve()
    stamp = _checked_stamp(blob)
    marker = _checked_dir() / (remote.sha256 or remote.blob_id or "")
    if stamp and marker.is_file() and marker.read_text(errors="replace") == stamp:
        return
    got = file_digest(blob, git_blob=remote.sha256 is None)
    want = remote.sha256 or remote.blob_id
    if got != want:
        kind = "sha256" if remote.sha256 else "git blob id"
        raise HubError(f"{listing.ref}: {remote.name} in the Hub cache has {kind} {got}, the Hub says {want}; {fix}")
    if stamp:
        _remember(marker, stamp)


def file_digest(path: Path, git_blob: bool = False) -> str:
    """The sha256 of the file, or its git blob id (sha1 of ``blob SIZE\\0`` and the bytes)."""
    digest = hashlib.sha1() if git_blob else hashlib.sha256()
    if git_blob:
        digest.update(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _checked_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ckptkit" / CHECKED_DIR


def _checked_stamp(blob: Path) -> str:
    """What identifies the blob file as checked: its inode, size and change time."""
    try:
        st = blob.stat()
    except OSError:
        return ""
    return f"{st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}"


def _remember(marker: Path, stamp: str) -> None:
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(stamp)
        os.replace(tmp, marker)
    except OSError:
        pass  # only a speed-up: the next run checks the file again
