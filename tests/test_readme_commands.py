"""The README's front door as a newcomer meets it: the quick start's job, then the Usage commands, run
as written and in order in a fresh folder — each must work, none may be refused by what came before."""

from __future__ import annotations

import re
import shlex
import shutil
import sys

from helpers import ROOT, ok, run


def _bash_blocks_after(readme: str, heading: str) -> list[list[str]]:
    """The ```bash blocks between `heading` and the next heading of any level, as lists of lines."""
    start = readme.index(f"\n{heading}\n")
    end = re.search(r"\n#{1,4} ", readme[start + len(heading) + 2 :])
    section = readme[start : start + len(heading) + 2 + end.start()] if end else readme[start:]
    return [block.strip().splitlines() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def _command(line: str) -> list[str]:
    """A README line as argv: the `dtrain ...` part after an install's `&&`, its comment dropped."""
    words = shlex.split(line.split("&&")[-1], comments=True)
    assert words[0] == "dtrain", line
    return [sys.executable, "-m", "dtrain", *words[1:]]


def test_the_quick_start_then_the_usage_commands_run_as_written_in_order(tmp_path):
    readme = (ROOT / "README.md").read_text()
    quick_start = [line for line in _bash_blocks_after(readme, "## Quick start")[0] if "dtrain run" in line]
    # "A job from a config" opens with the synopsis, then a blank line, then the commands to type.
    block = _bash_blocks_after(readme, "### A job from a config")[0]
    usage = block[block.index("") + 1 :]
    assert len(quick_start) == 1 and len(usage) >= 4, (quick_start, usage)

    shutil.copytree(ROOT / "examples", tmp_path / "examples")  # a clean clone's files, nothing else
    for line in quick_start + usage:
        result = ok(run(_command(line), cwd=tmp_path))
        assert "error" not in result.stderr.lower(), f"{line}\n{result.stderr}"
    # The runs are where the commands put them, each whole: two runs, two run.dirs, nothing refused.
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(runs) == 2 and all((tmp_path / "runs" / name / "model.safetensors").is_file() for name in runs), runs
    assert (tmp_path / "runs" / "digits_mlp" / "report" / "summary.txt").is_file()
