"""Each test module's test count, time and process starts, from the JUnit XML of a pytest run; with two
runs, side by side.

    python -m pytest -q --junitxml=after.xml
    python tools/suite_table.py after.xml                 # one run: modules, slowest first
    python tools/suite_table.py before.xml after.xml      # before and after, and the change
    python tools/suite_table.py after.xml --waiting 20    # the 20 tests that left the cores idlest

Time is a test's setup, call and teardown together (pytest's junit_duration_report default), summed
per module; a module-scoped fixture's setup counts in its first test. Processes are those the tests
start themselves (tests/process_budget.py records them; "–" where the run did not). The last row is the
suite. `--waiting` ranks tests by their seconds times the share of the machine's cores left idle
(process_budget.py's cpu_busy): the tests that mostly wait, which could wait beside each other.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Module:
    tests: int = 0
    seconds: float = 0.0
    processes: int | None = None


def modules(junit: Path) -> dict[str, Module]:
    """Module path (tests/...py) → its tests, seconds and process starts, from one JUnit XML file."""
    found: dict[str, Module] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        # pytest writes "tests.data.test_tokens" (and ".TestClass" after it for a class's tests)
        parts = case.get("classname", "").split(".")
        while parts and not parts[-1].startswith("test_"):
            parts.pop()
        module = found.setdefault("/".join(parts) + ".py", Module())
        module.tests += 1
        module.seconds += float(case.get("time", 0) or 0)
        for prop in case.iter("property"):
            if prop.get("name") == "processes":
                module.processes = (module.processes or 0) + int(prop.get("value", 0))
    return found


def waiting(junit: Path, n: int) -> str:
    """The `n` tests with the most idle-core seconds (their time × the share of the cores left idle)."""
    idle = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        busy = next((float(p.get("value", 0)) for p in case.iter("property") if p.get("name") == "cpu_busy"), None)
        if busy is not None:
            seconds = float(case.get("time", 0) or 0)
            idle.append((seconds * (1 - busy), seconds, busy, f"{case.get('classname')}::{case.get('name')}"))
    rows = ["| idle seconds | seconds | cores busy | test |", "| ---: | ---: | ---: | --- |"]
    rows += [f"| {i:.0f} | {s:.0f} | {b:.0%} | {name} |" for i, s, b, name in sorted(idle, reverse=True)[:n]]
    return "\n".join(rows)


def _suite(run: dict[str, Module]) -> Module:
    counted = [m.processes for m in run.values() if m.processes is not None]
    return Module(
        sum(m.tests for m in run.values()), sum(m.seconds for m in run.values()), sum(counted) if counted else None
    )


def _n(processes: int | None) -> str:
    return "–" if processes is None else str(processes)


def table(runs: list[dict[str, Module]]) -> str:
    names = sorted({m for run in runs for m in run}, key=lambda m: -max(run.get(m, Module()).seconds for run in runs))
    if len(runs) == 1:
        rows = ["| module | tests | seconds | processes |", "| --- | ---: | ---: | ---: |"]
        for name, m in [*((n, runs[0][n]) for n in names), ("**suite**", _suite(runs[0]))]:
            rows.append(f"| {name} | {m.tests} | {m.seconds:.0f} | {_n(m.processes)} |")
        return "\n".join(rows)
    rows = [
        "| module | tests before | after | seconds before | after | × faster | processes before | after |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    pairs = [(n, runs[0].get(n, Module()), runs[1].get(n, Module())) for n in names]
    for name, b, a in [*pairs, ("**suite**", _suite(runs[0]), _suite(runs[1]))]:
        faster = f"{b.seconds / a.seconds:.1f}×" if a.seconds > 0 and b.seconds > 0 else "–"
        rows.append(
            f"| {name} | {b.tests} | {a.tests} | {b.seconds:.0f} | {a.seconds:.0f} | {faster} | "
            f"{_n(b.processes)} | {_n(a.processes)} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("junit", nargs="+", type=Path, help="one JUnit XML file, or two: before and after")
    parser.add_argument("--waiting", type=int, metavar="N", help="list the N tests that left the cores idlest")
    args = parser.parse_args(argv)
    if len(args.junit) > 2:
        parser.error("give one JUnit XML file, or two (before, after)")
    for path in args.junit:
        if not path.is_file():
            parser.error(f"{path} does not exist; write one with python -m pytest --junitxml={path}")
    print(waiting(args.junit[-1], args.waiting) if args.waiting else table([modules(path) for path in args.junit]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
