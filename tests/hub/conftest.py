"""The fake Hub of tests/hub/fake_hub.py, as huggingface_hub's endpoint, with an empty cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_hub import FakeHub


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    server = FakeHub()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.chdir(tmp_path)  # no local org/name here: names go to the Hub
    yield server
    server.close()
