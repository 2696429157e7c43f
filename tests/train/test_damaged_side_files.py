"""A damaged file beside the weights or a config that is not UTF-8 is one line naming the
file, never a traceback (issue 41's review: JSONDecodeError / UnicodeDecodeError)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ckptkit.errors import CkptkitError
from ckptkit.train.chat_template import load_chat_template
from ckptkit.train.config import load_config
from ckptkit.train.tokenizer import load_tokenizer

from conftest import FIXTURES


def test_a_config_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"seed: 42\n# caf\xe9\n")
    with pytest.raises(CkptkitError, match=r"bad\.yaml: not UTF-8 text \(byte offset 14\)"):
        load_config(str(bad))


@pytest.mark.parametrize("name", ["generation_config.json", "tokenizer_config.json"])
def test_a_damaged_side_json_names_the_file(name: str, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(FIXTURES / "hf" / "llama3", folder)
    (folder / name).write_text("{")
    with pytest.raises(CkptkitError, match=rf"{name}: "):
        load_tokenizer(folder)
    if name == "tokenizer_config.json":
        with pytest.raises(CkptkitError, match=rf"{name}: "):
            load_chat_template(folder)
