"""X -> Y -> X reproduces X exactly, for every fixture and every format its family has."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptkit.convert import ConvertOptions, convert

from conftest import META_FAMILIES, assert_same_layout, fixture_dirs, fixture_family, tree_hashes


def _cases() -> list[tuple[Path, str]]:
    cases = []
    for src in fixture_dirs():
        targets = ["hf", "hf-bin", "internal"]
        if fixture_family(src) in (*META_FAMILIES, "mixtral"):  # stacked experts included
            targets.append("meta")
        cases += [(src, to) for to in targets]
    return cases


@pytest.mark.parametrize(
    ("src", "to"), _cases(), ids=lambda v: v if isinstance(v, str) else f"{v.parent.name}/{v.name}"
)
def test_round_trip_gives_back_every_file_byte_for_byte(src: Path, to: str, tmp_path: Path) -> None:
    before = tree_hashes(src)
    mid, back = tmp_path / "mid", tmp_path / "back"
    convert(src, mid, ConvertOptions(to, verify=True))
    convert(mid, back, ConvertOptions(src.parent.name, verify=True))
    assert_same_layout(src, back)
    # Beyond the tensors: every file comes back byte for byte (sha256), pickles included:
    # their zip records, CRC-32s, archive folder name and serialization id; nothing is added.
    assert tree_hashes(back) == before
    assert tree_hashes(src) == before, "the source was modified"
