"""The suite's cost in the unit that does not drift with machine noise: processes started.

Each process a test starts (a `dtrain ...` or `torchrun ...` command, a multiprocessing worker) costs
a Python start, `import torch` and often a gloo rendezvous: seconds each on 2 cores, and the bulk of
the suite's time. This plugin counts them per test (what the test itself starts; a launcher's workers
are not counted separately), records the count in the test's JUnit properties (tools/suite_table.py
sums it per module), and when the whole suite ran, fails it if the total exceeds `process_budget`
(pyproject.toml): a change that adds process starts must earn them, by raising the budget in the same
commit. `--process-report` lists the tests that start the most.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess
from collections import Counter

import pytest

_starts: Counter[str] = Counter()
_current = {"test": "(collection)"}
_cpu_at_start: dict[str, tuple[int, int]] = {}
_over: list[str] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("process_budget", "the most processes the whole suite may start", default="0")
    parser.addoption("--process-report", action="store_true", help="list the tests that start the most processes")


def pytest_configure(config: pytest.Config) -> None:
    popen_init = subprocess.Popen.__init__
    process_start = multiprocessing.process.BaseProcess.start

    def counted_popen(self, *args, **kwargs):
        _starts[_current["test"]] += 1
        popen_init(self, *args, **kwargs)

    def counted_start(self):
        _starts[_current["test"]] += 1
        process_start(self)

    subprocess.Popen.__init__ = counted_popen  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start = counted_start  # type: ignore[method-assign]


def _cpu_ticks() -> tuple[int, int]:
    """(busy, all) clock ticks of every core of the machine so far (Linux), or (0, 0)."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(t) for t in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # idle and iowait are not busy


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    _current["test"] = item.nodeid
    _cpu_at_start[item.nodeid] = _cpu_ticks()
    yield
    _current["test"] = "(between tests)"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    if call.when == "teardown":  # before the report is made: it takes the properties with it
        item.user_properties.append(("processes", _starts[item.nodeid]))
        # How busy the machine's cores were during the test: a low share marks a test that mostly waits
        # (timeouts, grace periods, a peer that never comes), which could wait beside another.
        (busy0, all0), (busy1, all1) = _cpu_at_start.pop(item.nodeid), _cpu_ticks()
        item.user_properties.append(("cpu_busy", round((busy1 - busy0) / (all1 - all0), 2) if all1 > all0 else 0))
    yield


def _whole_suite(session: pytest.Session) -> bool:
    config = session.config
    option = config.option
    selected = any(getattr(option, name, None) for name in ("keyword", "markexpr", "deselect", "lf", "ff"))
    return config.args_source == pytest.Config.ArgsSource.TESTPATHS and not selected and not session.shouldfail


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    total = sum(_starts.values())
    budget = int(config.getini("process_budget") or 0)
    terminalreporter.write_line(f"processes started by the tests: {total} (budget for the whole suite: {budget})")
    for line in _over:
        terminalreporter.write_line(line, red=True)
    if config.getoption("--process-report"):
        for test, n in _starts.most_common(30):
            terminalreporter.write_line(f"{n:5d}  {test}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    total = sum(_starts.values())
    budget = int(session.config.getini("process_budget") or 0)
    if budget and _whole_suite(session) and total > budget and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        _over.append(  # said by the terminal summary, which comes after this hook
            f"FAILED: the suite started {total} processes, over its budget of {budget} (process_budget in "
            "pyproject.toml): share a run, answer in-process, or raise the budget with a reason"
        )
