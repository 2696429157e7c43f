"""How long the full test suite takes, as CI's own run measured it.

``.ci/run`` runs the README's test command with pytest writing a JUnit XML report, then
this script: it reads the test count and pytest's seconds from that report (and, with
``--since``, the whole CI run's seconds), prints one line, which ``--report`` writes into
docs/bench/suite.md under bench/report.py's header, and ``--readme`` quotes that line in
README.md between the ``suite-time`` markers (tests/cli/test_docs.py checks the two agree).
"""

from __future__ import annotations

import argparse
import os
import re
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from report import reporting

MARKED = re.compile(r"(<!-- suite-time -->`)[^`]*(`<!-- /suite-time -->)")


def figure(junit: Path, since: float | None) -> str:
    """``N tests in S s (M min) on C CPUs``, and the whole CI run's seconds when known."""
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tests = sum(int(s.get("tests", 0)) for s in suites)
    seconds = sum(float(s.get("time", 0)) for s in suites)
    line = f"{tests} tests in {seconds:.0f} s ({seconds / 60:.1f} min) on {os.cpu_count()} CPUs"
    if since is not None:
        line += f"; .ci/run in all {time.time() - since:.0f} s"
    return line


def quote_in_readme(readme: Path, line: str) -> None:
    text = readme.read_text(encoding="utf-8")
    if not MARKED.search(text):
        raise SystemExit(f"{readme}: no <!-- suite-time -->`...`<!-- /suite-time --> to put the figure in")
    readme.write_text(MARKED.sub(lambda m: m.group(1) + line + m.group(2), text), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--junit", type=Path, required=True, help="pytest's --junitxml report of the full suite")
    parser.add_argument("--since", type=float, help="when the CI run started (seconds since the epoch)")
    parser.add_argument("--readme", type=Path, help="README.md whose suite-time span quotes the figure")
    args = parser.parse_args()
    line = figure(args.junit, args.since)
    print(line)
    if args.readme is not None:
        quote_in_readme(args.readme, line)


if __name__ == "__main__":
    with reporting("suite.py"):
        main()
