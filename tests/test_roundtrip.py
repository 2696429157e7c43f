"""X -> Y -> X reproduces X exactly, for every fixture and every format its family has."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptkit.convert import convert

from conftest import META_FAMILIES, assert_same_layout, fixture_dirs, fixture_family, tree_hashes


def _cases() -> list[tuple[Path, str]]:
    cases = []
    for src in fixture_dirs():
        targets = ["hf", "hf-bin", "internal"]
        if fixture_family(src) in META_FAMILIES:
            targets.append("meta")
        cases += [(src, to) for to in targets]
    return cases


@pytest.mark.parametrize(
    ("src", "to"), _cases(), ids=lambda v: v if isinstance(v, str) else f"{v.parent.name}/{v.name}"
)
def test_round_trip_is_exact(src: Path, to: str, tmp_path: Path) -> None:
    before = tree_hashes(src)
    mid, back = tmp_path / "mid", tmp_path / "back"
    convert(src, mid, to, verify=True)
    convert(mid, back, src.parent.name, verify=True)
    assert_same_layout(src, back)
    # Beyond the tensors: metadata, index and tokenizer files come back byte for byte,
    # and so do the safetensors files themselves.
    # Pickles (.pth/.bin) come back the same size (tied aliases share storage again); their
    # tensors are compared above.
    after = tree_hashes(back)
    for name, digest in before.items():
        if name.endswith((".pth", ".bin")):
            assert (back / name).stat().st_size == (src / name).stat().st_size, name
        else:
            assert after.get(name) == digest, name
    assert tree_hashes(src) == before, "the source was modified"
