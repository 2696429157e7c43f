"""Mutation testing with mutmut: how many of the mutants made in the tensor transforms, the
container readers and writers, LoRA merge and the training step the fast tests kill.

Not part of CI (it runs for a long while on 2 cores) and needs mutmut (``pip install mutmut``;
chosen over cosmic-ray and pytest-gremlins because it forks one warm interpreter per mutant
and runs only the tests that reach the mutated function, fastest first, instead of
starting pytest and importing torch again for every mutant). It mutates a copy of this
tree's tracked files, so the work tree is never touched:

    python bench/mutation.py --compare REV --report docs/bench/mutation.md

(``--compare REV``: first the same mutants against REV's tests/, the score before them.)

A mutant is *killed* when a test fails (or times out), *survives* when every test that
reaches it passes, and has *no tests* when none of the selected tests reaches it. The score
counts killed over all mutants. Survivors are either killed by a new test or listed, with
why they cannot change behaviour, in docs/mutation.md; ``--survivors PATH`` writes each
survivor's diff for that review.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from importlib.metadata import version
from pathlib import Path

from report import ROOT, reporting

ROUND_TRIPS = [  # one of each writer and layout: .pth ranks, .bin with a tied alias, stacked experts, fused
    f"tests/convert/test_roundtrip.py::test_round_trip_gives_back_every_file_byte_for_byte[{case}]"
    for case in ("hf/llama2-meta", "hf/llama2-hf-bin", "meta/llama2-2rank-hf", "meta/llama2-2rank-meta",
                 "hf-bin/qwen2-hf", "hf/mixtral-stacked-hf-bin", "meta/mixtral-2rank-hf", "hf/phi3-hf")
]  # fmt: skip
FORMATS = [  # test_formats.py without its subprocess and whole-CLI tests (seconds each)
    f"tests/formats/test_formats.py::{name}"
    for name in ("test_safetensors_writer_is_byte_identical_to_the_library",
                 "test_torch_writer_loads_with_torch_and_passes_zip_crc", "test_pickle_index_matches_torch_load",
                 "test_max_shard_size_reshards_hf", "test_non_weight_files_are_carried", "test_inspect_single_files",
                 "test_inspect_reads_no_tensor_data")
]  # fmt: skip
# Tests marked slow in the files below that are left out (compiling takes tens of seconds; the
# zip64 test of test_torch_zip stays: sparse files, seconds).
DESELECT = ["--deselect", "tests/train/test_step.py::test_compiled_layers_give_the_same_gradients"]
# Each group: the modules mutated and the fast tests that prove their behaviour. mutmut runs, for
# each mutant, only those tests that reach the mutated function, fastest first, up to a failure.
GROUPS: dict[str, tuple[list[str], list[str]]] = {
    "transforms": (
        ["ckptkit/tensors/transforms.py"],
        ["tests/tensors/test_transforms.py", "tests/io/test_streamcopy.py", "tests/io/test_fastpath.py",
         "tests/models/test_meta_ffn.py", "tests/models/test_families.py", *ROUND_TRIPS],
    ),
    "readers/writers": (
        ["ckptkit/formats/safetensors_io.py", "ckptkit/formats/torch_io.py", "ckptkit/formats/torch_writer.py",
         "ckptkit/formats/torch_zip.py"],
        ["tests/formats/test_torch_zip.py", "tests/io/test_rawcopy.py", "tests/io/test_untrusted.py",
         "tests/io/test_streamcopy.py", "tests/formats/test_layouts.py",
         "tests/models/test_rope_freqs.py::test_writers_write_bytes_like_write", *FORMATS, *ROUND_TRIPS],
    ),
    "LoRA merge": (["ckptkit/train/lora.py"], ["tests/train/test_lora.py", "tests/train/test_peft.py"]),
    "training step": (["ckptkit/train/step.py"], ["tests/train/test_step.py", "tests/train/test_router_aux_loss.py"]),
}  # fmt: skip
STATUS = re.compile(r"^\s*(?P<name>\S+): (?P<status>.+)$")


def copy_tree(dst: Path, tests_from: str | None) -> None:
    """This work tree's tracked and unignored files; with ``tests_from``, tests/ from that revision."""
    names = (
        subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z"], capture_output=True, check=True
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, names):
        src = ROOT / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)
    if tests_from:
        shutil.rmtree(dst / "tests")
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", tests_from, "tests"], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(dst)], input=archive.stdout, check=True)


def configure(dst: Path, modules: list[str], tests: list[str]) -> None:
    """mutmut's settings in the copy's pyproject.toml; pytest without xdist workers."""
    pyproject = dst / "pyproject.toml"
    text = re.sub(r'addopts = "[^"]*"', 'addopts = "-q"', pyproject.read_text())
    text += (
        "\n[tool.mutmut]\n"
        'source_paths = ["ckptkit/"]\n'
        'also_copy = ["fixtures/"]\n'
        f"only_mutate = {json.dumps(modules)}\n"
        f"pytest_add_cli_args = {json.dumps(['-p', 'no:xdist', '-p', 'no:cacheprovider', *DESELECT])}\n"
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}\n"
        # A mutant's time limit is (its tests' time + 60 s) * 4: mutmut times tests without their
        # fixtures, and test_untrusted's module fixture runs every CLI case at once (tens of
        # seconds on a loaded machine); one that only met a load spike is tried again alone.
        "timeout_multiplier = 4.0\ntimeout_constant = 60.0\n"
    )
    pyproject.write_text(text)


def mutmut_run(work: Path, env: dict[str, str], log_name: str, *args: str) -> int:
    """``mutmut run ARGS`` in ``work``, reaping what timed-out mutants leave behind meanwhile."""
    with (work / log_name).open("w") as log:
        run = subprocess.Popen(["mutmut", "run", *args], cwd=work, env=env, stdout=log, stderr=log)
        while run.poll() is None:
            time.sleep(5)
            reap_orphans(work)
    reap_orphans(work)
    return run.returncode


def listing(work: Path, env: dict[str, str]) -> dict[str, str]:
    """Each mutant's status in a finished mutmut run."""
    out = subprocess.run(
        ["mutmut", "results", "--all", "true"], cwd=work, env=env, capture_output=True, text=True, check=True
    ).stdout
    return {m["name"]: m["status"] for m in (STATUS.match(line) for line in out.splitlines()) if m}


def retry_timeouts(work: Path, env: dict[str, str]) -> dict[str, str]:
    """The statuses after trying each timed-out mutant once more, one at a time: on a shared
    machine a load spike times out mutants the tests would pass, which would count as kills."""
    results = listing(work, env)
    timeouts = sorted(n for n, s in results.items() if s == "timeout")
    if timeouts:
        mutmut_run(work, env, "mutmut-retry.log", "--max-children", "1", *timeouts)
        results = listing(work, env)
    return results


def reap_orphans(work: Path) -> None:
    """Kill what a timed-out mutant left behind: a test's helper process (the CLI driver of
    test_errors.py) outlives the test process mutmut kills and keeps its children running.
    Those are the processes inside ``work`` whose parent is gone (re-parented to init), and
    their descendants. Linux only (reads /proc); elsewhere nothing is reaped."""
    parent: dict[int, int] = {}
    inside: set[int] = set()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        pid = int(entry.name)
        parent[pid] = int(stat.rsplit(")", 1)[1].split()[1])
        if Path(cwd).is_relative_to(work):
            inside.add(pid)
    doomed = {pid for pid in inside if parent[pid] == 1}
    while more := {pid for pid in inside - doomed if parent[pid] in doomed}:
        doomed |= more
    for pid in doomed:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def module_of(mutant: str, modules: list[str]) -> str:
    """The module a mutant's name (``package.module.x_function__mutmut_3``) is in."""
    for path in modules:
        if mutant.startswith(path.removesuffix(".py").replace("/", ".") + "."):
            return path
    return "?"


def mutate(
    work: Path, modules: list[str], tests: list[str], tests_from: str | None, children: int, reuse: bool
) -> tuple[dict[str, str], float, str, float]:
    """One mutmut run over a fresh copy: each mutant's status, the minutes it took, the
    commit of the code it mutated and the load average when it ended. The outcome is kept
    in ``work/results.json`` for ``--reuse``."""
    saved = work / "results.json"
    if reuse and saved.is_file():
        kept = json.loads(saved.read_text())
        return kept["results"], kept["minutes"], kept["commit"], kept.get("load", float("nan"))
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--", "ckptkit", "tests"], capture_output=True
    ).stdout:
        commit += " with uncommitted changes"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    copy_tree(work, tests_from)
    configure(work, modules, tests)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    start = time.monotonic()
    code = mutmut_run(work, env, "mutmut.log", "--max-children", str(children))
    if code != 0:
        raise SystemExit(f"mutmut run failed (exit {code}); see {work / 'mutmut.log'}")
    results = retry_timeouts(work, env)
    minutes = (time.monotonic() - start) / 60
    load = os.getloadavg()[0]
    saved.write_text(json.dumps({"minutes": minutes, "results": results, "commit": commit, "load": load}))
    return results, minutes, commit, load


def table(results: dict[str, str], modules: list[str]) -> None:
    counts: dict[str, Counter[str]] = {m: Counter() for m in modules}
    for name, status in results.items():
        counts.setdefault(module_of(name, modules), Counter())[status] += 1
    print("| module | mutants | killed | timeout | survived | no tests | other | score |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    total: Counter[str] = Counter()
    for module, c in counts.items():
        total.update(c)
        _row(module, c)
    _row("all", total)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, help="where to copy the tree (default: a temporary folder)")
    parser.add_argument("--compare", metavar="REV", help="first the same mutants against REV's tests/")
    parser.add_argument("--max-children", type=int, default=1, help="mutants tested at once (default 1)")
    parser.add_argument("--only", choices=list(GROUPS), action="append", help="one group (repeatable)")
    parser.add_argument(
        "--reuse", action="store_true", help="take a group's results from a finished run in --workdir, if there is one"
    )
    parser.add_argument("--survivors", type=Path, help="write every mutant this tree's tests leave alive here")
    args = parser.parse_args()
    if shutil.which("mutmut") is None:
        print("mutmut is not installed: pip install mutmut", file=sys.stderr)
        return 1
    groups = {g: GROUPS[g] for g in args.only or GROUPS}
    modules = [m for mods, _ in groups.values() for m in mods]
    root = args.workdir or Path(tempfile.mkdtemp(prefix="ckptkit-mutation-"))
    at_once = "" if args.reuse else f", {args.max_children} mutant(s) at a time"
    print(f"mutmut {version('mutmut')} over {len(modules)} modules in {len(groups)} groups, each with its fast tests"
          f"{at_once}")  # fmt: skip
    suites = ([(f"tests/ from {args.compare}", args.compare)] if args.compare else []) + [("this tree's tests/", None)]
    checked: list[tuple[str, dict[str, str]]] = []
    for label, rev in suites:
        results: dict[str, str] = {}
        where: dict[str, Path] = {}
        minutes = 0.0
        commits = set()
        loads = []
        for group, (mods, tests) in groups.items():
            work = root / ("tests-from-" + re.sub(r"\W", "_", rev) if rev else "tree") / re.sub(r"\W", "_", group)
            found, took, commit, load = mutate(work, mods, tests, rev, args.max_children, args.reuse)
            results.update(found)
            where.update(dict.fromkeys(found, work))
            minutes += took
            commits.add(commit)
            loads.append(load)
        print()
        print(
            f"{label}: {minutes:.0f} min, load average at the end of each group {', '.join(f'{x:.1f}' for x in loads)};"
            f" code at {', '.join(sorted(commits))}"
        )
        print()
        table(results, modules)
        unchecked = sum(s == "not checked" for s in results.values())
        if unchecked:
            print(f"\n{unchecked} mutants not checked (in 'other'): the run was stopped before it reached them")
        checked.append((label, results))
    both = set.intersection(*({n for n, s in r.items() if s != "not checked"} for _, r in checked))
    if len(checked) > 1 and any(len(both) < len(r) for _, r in checked):
        print(f"\nOn the {len(both)} mutants both runs checked:")
        for label, r in checked:
            print(f"\n{label}:\n")
            table({n: r[n] for n in both}, modules)
    alive = sorted(n for n, s in results.items() if s in ("survived", "no tests", "suspicious"))
    print()
    print(f"not killed by this tree's tests ({len(alive)}):")
    for name in alive:
        print(f"  {results[name]:9s} {name}")
    if args.survivors:
        with args.survivors.open("w") as f:
            for name in alive:
                diff = subprocess.run(["mutmut", "show", name], cwd=where[name], capture_output=True, text=True)
                f.write(f"## {name} ({results[name]})\n{diff.stdout}\n")
    return 0


def _row(module: str, c: Counter[str]) -> None:
    n = sum(c.values())
    killed = c["killed"] + c["timeout"]
    other = n - killed - c["survived"] - c["no tests"]
    score = f"{100 * killed / n:.1f}%" if n else "-"
    print(
        f"| {module} | {n} | {c['killed']} | {c['timeout']} | {c['survived']} | {c['no tests']} | {other} | {score} |"
    )


if __name__ == "__main__":
    with reporting("mutation.py"):
        sys.exit(main())
