"""bench/train.py at its smallest: every case, one step, ckptkit's recipe and the transformers
(+ PEFT) peer in this process; their first-step losses must agree, as the bench demands."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _bench_train(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))  # its own imports (report)
    spec = importlib.util.spec_from_file_location("bench_train", BENCH / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_case_first_loss_agrees_with_transformers_peft(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    train = _bench_train(monkeypatch)
    args = train.parse(["--layers", "1", "--seq", "192", "--batch", "2", "--steps", "3"])
    args.steps = 1
    train.prepare(tmp_path, args)
    model = tmp_path / "model"
    results = {
        (peer, case): [train.run_worker(peer, case, model, tmp_path / f"out-{peer}-{case}", args)]
        for case in train.CASES
        for peer in ("ckptkit", "transformers")
    }
    assert train.disagreements(results, "fp32") == []
    losses = {case: results["ckptkit", case][0]["loss"] for case in train.CASES}
    # the check can tell the batches apart: text chunks, padded documents and packed rows lose differently
    assert min(
        abs(losses[a] - losses[b]) for a, b in [("lora", "padded"), ("padded", "packed"), ("lora", "packed")]
    ) > (100 * train.TOLERANCE["fp32"])
    qlora_peer = results["transformers", "qlora"][0]
    if "bitsandbytes" not in sys.modules and importlib.util.find_spec("bitsandbytes") is None:
        assert qlora_peer == {"na": "bitsandbytes not installed: pip install bitsandbytes"}
    else:
        assert "loss" in qlora_peer
    for (peer, case), (got,) in results.items():
        if "na" not in got:
            assert len(got["wall"]) == len(got["cpu"]) == 1 and got["cuda_allocated"] is None, (peer, case)
