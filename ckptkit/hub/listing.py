"""What a Hub repository holds at a revision: its commit and each file's size and checksum,
read from the Hub's API before any file is fetched; the Hub's refusals as one line each."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ckptkit.errors import CkptkitError
from ckptkit.hub.refs import HubRef


class HubError(CkptkitError):
    """The Hub refused or could not be reached; the line says what to do."""


@dataclass(frozen=True)
class RemoteFile:
    """One file of a repository: its size and the checksum the Hub keeps for it (the sha256 of
    an LFS file, else the git blob id)."""

    name: str
    size: int
    sha256: str | None = None
    blob_id: str | None = None


@dataclass(frozen=True)
class Listing:
    """A repository at one commit: its files by path (relative to the repository root)."""

    ref: HubRef
    commit: str
    files: dict[str, RemoteFile]


def endpoint() -> str:
    """The Hub's address: ``HF_ENDPOINT`` as set now, else huggingface_hub's default."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def cache_dir() -> Path:
    """huggingface_hub's cache folder, from the environment as set now (``HF_HUB_CACHE``,
    ``HF_HOME``), shared with transformers."""
    from huggingface_hub import constants

    if hub_cache := os.environ.get("HF_HUB_CACHE"):
        return Path(hub_cache).expanduser()
    if home := os.environ.get("HF_HOME"):
        return Path(home).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    """Whether huggingface_hub's offline mode is on (``HF_HUB_OFFLINE``)."""
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().lower()
    return flag in ("1", "on", "yes", "true") or bool(constants.HF_HUB_OFFLINE)


@contextmanager
def hub_errors(ref: HubRef, what: str = "") -> Iterator[None]:
    """Turn huggingface_hub's and the network's errors into one line about ``ref``."""
    from huggingface_hub import errors

    where = f"{ref}{f' ({what})' if what else ''}"
    page = f"{endpoint()}/{ref.repo_id}"
    try:
        yield
    except errors.GatedRepoError:
        raise HubError(
            f"{where}: a gated repository: accept the license at {page} and log in: `hf auth login` or HF_TOKEN"
        ) from None
    except errors.RevisionNotFoundError:
        raise HubError(
            f"{where}: the Hub has no revision {ref.revision!r} of {ref.repo_id} (a branch, tag or commit)"
        ) from None
    except errors.RemoteEntryNotFoundError:
        raise HubError(f"{where}: not in {ref.repo_id} at this revision") from None
    except errors.RepositoryNotFoundError:
        raise HubError(
            f"{ref}: no such local path, and no Hub repository {ref.repo_id} "
            "(if it is private: log in with `hf auth login` or set HF_TOKEN)"
        ) from None
    except errors.LocalEntryNotFoundError as e:  # online: the Hub failed and the cache lacks the file
        if offline():
            raise HubError(f"{where}: HF_HUB_OFFLINE is set and the Hub cache does not hold it") from None
        cause = e.__cause__
        status = cause.response.status_code if isinstance(cause, errors.HfHubHTTPError) else "no answer"
        raise HubError(f"{where}: the Hub answered {status}; retry later (a download resumes)") from None
    except errors.OfflineModeIsEnabled:
        raise HubError(f"{where}: HF_HUB_OFFLINE is set and the Hub cache does not hold it") from None
    except errors.HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "no answer"
        raise HubError(f"{where}: the Hub answered {status}; retry later (a download resumes)") from None
    except (ConnectionError, TimeoutError) as e:
        raise HubError(f"{where}: cannot reach {endpoint()}: {_first_line(e)}; retry (a download resumes)") from None
    except OSError as e:
        if isinstance(e, CkptkitError):
            raise
        if "Consistency check failed" in str(e):  # huggingface_hub: fewer bytes came than the Hub listed
            raise HubError(f"{where}: the download ended early ({_first_line(e)}); retry (it resumes)") from None
        raise HubError(f"{where}: {e.strerror or _first_line(e)} (the Hub cache: {cache_dir()})") from None
    except Exception as e:  # httpx's transport errors are not OSErrors
        if transient(e):
            raise HubError(f"{where}: cannot reach {endpoint()}: {_first_line(e)}; retry (it resumes)") from None
        raise


def transient(e: BaseException) -> bool:
    """Whether ``e`` is a dropped or refused connection (worth a retry), not an answer."""
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    try:
        import httpx2
    except ImportError:  # huggingface_hub before its own httpx fork
        import httpx as httpx2  # type: ignore[no-redef]
    return isinstance(e, httpx2.TransportError)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def list_repo(ref: HubRef) -> Listing:
    """The files of ``ref`` at its revision, with sizes and checksums (one API call)."""
    from huggingface_hub import HfApi

    with hub_errors(ref):
        info = HfApi(endpoint=endpoint()).model_info(ref.repo_id, revision=ref.revision, files_metadata=True)
    if not info.sha or not info.siblings:
        raise HubError(f"{ref}: the Hub listed no commit or no files for it")
    files = {}
    for s in info.siblings:
        if s.size is None:
            raise HubError(f"{ref}: the Hub gave no size for {s.rfilename}")
        files[s.rfilename] = RemoteFile(s.rfilename, int(s.size), s.lfs.sha256 if s.lfs else None, s.blob_id)
    return Listing(ref, info.sha, files)


def list_cached(ref: HubRef) -> tuple[Path, str]:
    """Offline: the cached snapshot folder of ``ref`` and its commit, as huggingface_hub resolves
    the revision from its cache (no checksums are known offline)."""
    from huggingface_hub import snapshot_download

    with hub_errors(ref, "offline"):
        try:
            folder = Path(
                snapshot_download(
                    ref.repo_id,
                    revision=ref.revision,
                    cache_dir=cache_dir(),
                    local_files_only=True,
                    endpoint=endpoint(),
                )
            )
        except FileNotFoundError:
            raise HubError(f"{ref}: HF_HUB_OFFLINE is set and the Hub cache ({cache_dir()}) does not hold it") from None
    return folder, folder.name
