"""Hub repositories as sources: wherever a command takes a source path it also takes
``org/name``, ``org/name@revision`` or ``hf://org/name[@revision][/subfolder]``.

:func:`hub_source` turns one into a local folder: the repository is listed first (files,
sizes, checksums), one weight set is chosen (:mod:`~ckptkit.formats.hub_files`), an unsupported
model is refused from its ``config.json`` before a byte of weights is fetched, and the files
come through huggingface_hub's cache (checked) or, with ``stream``, by HTTP range reads
mounted in place of local files (no copy kept). A local path that exists always wins.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ckptkit.errors import CkptkitError
from ckptkit.formats.hub_files import Selection, choose, choose_file, has_hf_config, is_single_file, single_file_format
from ckptkit.hub.download import fetch
from ckptkit.hub.listing import HubError, Listing, list_cached, list_repo, offline
from ckptkit.hub.refs import HubRef, parse_ref
from ckptkit.hub.stream import RangeFile
from ckptkit.io import mounted

__all__ = ["HubError", "HubRef", "Resolved", "hub_source", "parse_ref"]


@dataclass(frozen=True)
class Resolved:
    """A source as a local path, and what the Hub gave for it (None for a local path)."""

    path: Path
    from_format: str | None
    ref: HubRef | None = None
    commit: str = ""
    selection: Selection | None = None
    nbytes: int = 0
    streamed: bool = False

    def describe(self) -> str:
        """One line: which weight set of which commit, and its size (empty for a local path)."""
        if self.ref is None or self.selection is None:
            return ""
        from ckptkit.progress import human

        sel = self.selection
        where = f"{sel.folder}/" if sel.folder else ""
        how = "read by HTTP range, no copy" if self.streamed else "through the Hub cache"
        return (
            f"{self.ref.repo_id}@{self.commit[:12]}: {sel.format} in {where or './'}, "
            f"{len(sel.weights)} weight file{'s' * (len(sel.weights) != 1)}, {human(self.nbytes)} ({how})"
        )

    def to_json(self) -> dict[str, object]:
        sel = self.selection
        assert self.ref is not None and sel is not None
        return {
            "repo": self.ref.repo_id,
            "revision": self.ref.revision,
            "commit": self.commit,
            "format": sel.format,
            "folder": sel.folder,
            "files": list(sel.files),
            "weight_bytes": self.nbytes,
            "streamed": self.streamed,
        }


@contextmanager
def hub_source(
    src: Path | str,
    *,
    from_format: str | None = None,
    model_type: str | None = None,
    stream: bool = False,
    quiet: bool = False,
) -> Iterator[Resolved]:
    """``src`` as a local path for the block: itself when it exists here or is no repository
    name, else the repository's one weight set (downloaded and checked, or ``stream``-ed)."""
    ref = parse_ref(src)
    if ref is None:
        yield Resolved(Path(src), from_format)
        return
    if offline():
        yield _cached(ref, from_format)
        return
    listing = list_repo(ref)
    sizes = {name: f.size for name, f in listing.files.items()}
    where = str(ref)
    if is_single_file(ref.subfolder):
        selection = choose_file(sizes, ref.subfolder, where)
    else:
        selection = choose(sizes, ref.subfolder, from_format, lambda name: _read_small(listing, name), where)
    _refuse_unsupported(listing, selection, model_type, where)
    prefix = f"{selection.folder}/" if selection.folder else ""
    nbytes = sum(sizes[prefix + n] for n in selection.weights)
    done = Resolved(Path(), selection.format, ref, listing.commit, selection, nbytes, stream)
    if not stream:
        root = fetch(listing, selection, quiet)
        yield _with_path(done, root, selection)
        return
    with tempfile.TemporaryDirectory(prefix="ckptkit-hub-") as tmp:
        root = Path(tmp) / f"models--{ref.repo_id.replace('/', '--')}" / "snapshots" / listing.commit  # as cached
        root.mkdir(parents=True)
        for name in selection.side:
            (root / name).write_bytes(_read_small(listing, prefix + name))
        openers: dict[Path, Callable[[], RangeFile]] = {
            root / name: _opener(listing, prefix + name, root / name) for name in selection.weights
        }
        with mounted(openers):
            try:
                yield _with_path(done, root, selection)
            except CkptkitError as e:  # named by the repository, not this temporary folder
                e.args = (str(e).replace(str(root), str(ref)), *e.args[1:])
                raise


def _with_path(done: Resolved, root: Path, selection: Selection) -> Resolved:
    path = root / selection.weights[0] if single_file_format(selection.format) else root
    return Resolved(path, done.from_format, done.ref, done.commit, done.selection, done.nbytes, done.streamed)


def _opener(listing: Listing, name: str, path: Path) -> Callable[[], RangeFile]:
    return lambda: RangeFile(listing, listing.files[name], path)


def _read_small(listing: Listing, name: str) -> bytes:
    """A small file of the repository (an index, a config), read by one range request."""
    remote = listing.files[name]
    if remote.size > 64 << 20:
        raise HubError(f"{listing.ref}: {name} is {remote.size} bytes; too large for a side file")
    src = RangeFile(listing, remote, Path(name))
    buf = bytearray(remote.size)
    view = memoryview(buf)
    done = 0
    while done < remote.size:
        got = src.readinto(view[done:], done)
        if got == 0:
            break
        done += got
    return bytes(buf)


def _refuse_unsupported(listing: Listing, selection: Selection, model_type: str | None, where: str) -> None:
    """Read ``config.json`` before any weights: an unsupported model is refused here."""
    if model_type is not None or not has_hf_config(selection.format) or "config.json" not in selection.side:
        return
    from ckptkit.models.registry import detect_from_hf

    prefix = f"{selection.folder}/" if selection.folder else ""
    try:
        cfg = json.loads(_read_small(listing, prefix + "config.json"))
    except ValueError:
        raise CkptkitError(f"{where}: {prefix}config.json is not JSON") from None
    if not isinstance(cfg, dict):
        raise CkptkitError(f"{where}: {prefix}config.json is not a JSON object")
    detect_from_hf(cfg, where)


def _cached(ref: HubRef, from_format: str | None) -> Resolved:
    """Offline (``HF_HUB_OFFLINE=1``): the weight set of the cached snapshot, unchecked."""
    folder, commit = list_cached(ref)
    base = folder / ref.subfolder if ref.subfolder else folder
    sizes = {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*") if p.is_file()}
    if is_single_file(ref.subfolder):
        selection = choose_file(sizes, ref.subfolder, str(ref))
    else:
        selection = choose(sizes, ref.subfolder, from_format, lambda n: (folder / n).read_bytes(), str(ref))
    prefix = f"{selection.folder}/" if selection.folder else ""
    nbytes = sum(sizes[prefix + n] for n in selection.weights)
    done = Resolved(Path(), selection.format, ref, commit, selection, nbytes, False)
    del base
    return _with_path(done, folder / selection.folder if selection.folder else folder, selection)
