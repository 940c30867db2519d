"""docs/architecture.md keeps a row per module of the package and the layers of the import contract: a
module added, moved or removed without its row, or a layer changed in one place only, fails here."""

import re

import tomllib

from helpers import ROOT

DOC = (ROOT / "docs" / "architecture.md").read_text()
PACKAGE = ROOT / "src" / "dtrain"


def test_every_module_has_one_row_and_every_row_is_a_module():
    rows = re.findall(r"^\| `([\w/]+\.py)` \| .+ \|$", DOC, re.M)
    modules = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")}
    summaries = {"export/__init__.py", "observe/__init__.py", "train/__init__.py", "commands/__init__.py"}
    assert len(rows) == len(set(rows))
    assert set(rows) <= modules, sorted(set(rows) - modules)
    assert modules - set(rows) <= summaries, sorted(modules - set(rows) - summaries)


def test_the_layer_diagram_is_the_import_contract():
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    diagram = DOC.split("## Layers", 1)[1].split("```")[1]
    drawn = [line.split("  ")[0].strip() for line in diagram.strip().splitlines()]
    assert drawn == contract["layers"]
