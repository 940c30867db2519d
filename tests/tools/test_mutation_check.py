"""tools/mutation_check.py still describes the code: every breakage edits text that is there exactly once,
and every test it names exists. (Running the breakages is slow and lives in the tool itself.)"""

from __future__ import annotations

import ast
import importlib.util

import pytest

from helpers import ROOT


def _breakages() -> dict:
    spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "tools" / "mutation_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BREAKAGES


BREAKAGES = _breakages()


@pytest.mark.parametrize("name", sorted(BREAKAGES))
def test_every_breakage_edits_text_that_is_there_exactly_once(name):
    _, edits, _ = BREAKAGES[name]
    for file, text, replacement in edits:
        source = (ROOT / file).read_text()
        assert source.count(text) == 1, f"{name}: {file} holds {source.count(text)} copies of {text!r}"
        assert replacement != text


@pytest.mark.parametrize("name", sorted(BREAKAGES))
def test_every_breakage_names_tests_that_exist(name):
    _, _, tests = BREAKAGES[name]
    assert tests
    for test in tests:
        file, _, function = test.partition("::")
        tree = ast.parse((ROOT / file).read_text())
        defined = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        assert function in defined, f"{name}: {file} has no test {function}"
