"""The suite's own accounting (tests/process_budget.py, tools/suite_table.py), on a small suite of its
own run by a real pytest: process starts counted per test and written to the JUnit report with how busy
the cores were, a whole run over its budget failed with one line, and the table read back from the report."""

import importlib.util
import subprocess
import sys
import xml.etree.ElementTree as ET

from helpers import ROOT

SUITE = """
import subprocess, sys, time

def test_starts_two():
    for _ in range(2):
        subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_waits():
    time.sleep(0.5)
"""


def pytest_run(folder, *args):
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "process_budget", "-p", "no:cacheprovider", *args],
        cwd=folder,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "tests")},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_whole_run_over_its_process_budget_fails_and_the_report_holds_each_tests_count(tmp_path, capsys):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_small.py").write_text(SUITE)
    for budget, code in (("1", 1), ("2", 0)):
        (tmp_path / "pytest.ini").write_text(f"[pytest]\ntestpaths = tests\nprocess_budget = {budget}\n")
        result = pytest_run(tmp_path, f"--junitxml={tmp_path / 'junit.xml'}")
        assert result.returncode == code, result.stdout + result.stderr
        over = [line for line in result.stdout.splitlines() if "over its budget" in line]
        assert over == (
            [
                f"FAILED: the suite started 2 processes, over its budget of {budget} (process_budget in "
                "pyproject.toml): share a run, answer in-process, or raise the budget with a reason"
            ]
            if code
            else []
        ), result.stdout
    # A run of some tests only (-k) is no whole suite: its count is said, never failed.
    (tmp_path / "pytest.ini").write_text("[pytest]\ntestpaths = tests\nprocess_budget = 1\n")
    assert pytest_run(tmp_path, "-k", "starts").returncode == 0

    props = {
        case.get("name"): {p.get("name"): p.get("value") for p in case.iter("property")}
        for case in ET.parse(tmp_path / "junit.xml").getroot().iter("testcase")
    }
    assert props["test_starts_two"]["processes"] == "2" and props["test_waits"]["processes"] == "0"
    # The machine's share of busy cores during each test: what else runs on it moves it, so only its range.
    assert all(0 <= float(props[name]["cpu_busy"]) <= 1 for name in props)

    # The table, read back from the report (in this process: the tool's main, its printed output).
    sys.path.insert(0, str(ROOT / "tools"))
    import suite_table

    assert suite_table.main([str(tmp_path / "junit.xml")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[2].startswith("| tests/test_small.py | 2 | ") and table[2].endswith(" | 2 |"), table
    assert suite_table.main([str(tmp_path / "junit.xml"), "--waiting", "1"]) == 0
    waiting = capsys.readouterr().out.splitlines()
    assert len(waiting) == 3 and waiting[2].endswith("| tests.test_small::test_waits |"), waiting


def test_module_sizes_names_each_module_past_the_limit_and_fails(tmp_path, capsys):
    """tools/module_sizes.py, which CI runs on src/dtrain: every module past the limit named, longest
    first, exit 1; none past it, exit 0 (the package itself passes). Run in this process: its main()."""
    spec = importlib.util.spec_from_file_location("module_sizes", ROOT / "tools" / "module_sizes.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "short.py").write_text("x = 1\n" * 450)
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * 451)
    (tmp_path / "pkg" / "longer.py").write_text("x = 1\n" * 600)
    assert tool.main([str(tmp_path / "pkg")]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"{tmp_path / 'pkg' / 'longer.py'}: 600 lines, past 450: split it by what it does",
        f"{tmp_path / 'pkg' / 'long.py'}: 451 lines, past 450: split it by what it does",
    ]
    assert tool.main([]) == 0 and capsys.readouterr().err == ""
