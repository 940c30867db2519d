"""The README's front door as a newcomer meets it, in one fresh folder and in order: the quick start's job
(run as written by the `quick_start` fixture, which the front door's tests share), the Usage commands,
the Python API snippet, the `dtrain launch` example and the Checkpoints section's commands, each run as
written — none may be refused by what came before — and then the quick start once more (the run is
complete: one line, exit 0) and with more epochs (it trains on from its end)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sys

from helpers import QUICK_START, ROOT, fake_mnist, ok, run


def _bash_blocks_after(readme: str, heading: str, language: str = "bash") -> list[list[str]]:
    """The ```bash blocks between `heading` and the next heading of any level, as lists of lines."""
    start = readme.index(f"\n{heading}\n")
    end = re.search(r"\n#{1,4} ", readme[start + len(heading) + 2 :])
    section = readme[start : start + len(heading) + 2 + end.start()] if end else readme[start:]
    return [block.strip().splitlines() for block in re.findall(rf"```{language}\n(.*?)```", section, re.S)]


def _command(line: str) -> list[str]:
    """A README line as argv: the `dtrain ...` part after an install's `&&`, its comment dropped."""
    words = shlex.split(line.split("&&")[-1], comments=True)
    assert words[0] == "dtrain", line
    return [sys.executable, "-m", "dtrain", *words[1:]]


# The names the Python API snippet leaves to the reader: a model and tensors of the quick start's shape.
SNIPPET_NEEDS = """\
import torch
from torch import nn

torch.manual_seed(0)
my_model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
x, y = torch.rand(256, 64), torch.randint(0, 10, (256,))
x_test, y_test = torch.rand(64, 64), torch.randint(0, 10, (64,))
"""


def _train_steps(run_dir) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if "loss" in r]


def test_every_readme_example_runs_as_written_in_order_then_the_quick_start_is_complete_and_trains_on(
    quick_start, tmp_path
):
    readme = (ROOT / "README.md").read_text()
    first = [line for line in _bash_blocks_after(readme, "## Quick start")[0] if "dtrain run" in line]
    # "A job from a config" opens with the synopsis, then a blank line, then the commands to type.
    block = _bash_blocks_after(readme, "### A job from a config")[0]
    usage = block[block.index("") + 1 :]
    api_section = "### Your own model and data: the Python API"
    [snippet] = _bash_blocks_after(readme, api_section, "python")[:1]
    launch = _bash_blocks_after(readme, api_section)[0]
    checkpoints = _bash_blocks_after(readme, "## Checkpoints, resume and failures")[0]
    assert len(first) == 1 and len(usage) >= 4 and len(launch) == 1 and len(checkpoints) == 4
    # The first command (the quick start's job, run as written in a clean clone's files) is the shared
    # fixture's: the rest go on from its folder.
    assert _command(first[0]) == QUICK_START, first
    shutil.copytree(quick_start, tmp_path, dirs_exist_ok=True)
    fake_mnist(tmp_path / "data" / "mnist")  # the launch example's data, in MNIST's own format
    (tmp_path / "snippet.py").write_text(SNIPPET_NEEDS + "\n".join(snippet) + "\n")
    said = {}
    for line in usage + ["python snippet.py"] + launch + checkpoints:
        argv = [sys.executable, "snippet.py"] if line == "python snippet.py" else _command(line)
        result = ok(run(argv, cwd=tmp_path))
        assert "error" not in result.stderr.lower(), f"{line}\n{result.stderr}"
        said[line] = result.stderr
    # Each run is where its command put it, whole: nothing refused, no run.dir shared.
    runs = {p.name for p in (tmp_path / "runs").iterdir()}
    assert runs == {"digits_mlp", "digits_lr05", "api", "mnist_ddp", "ckpt", "branch", "robust"}, runs
    assert all((tmp_path / "runs" / name / "model.safetensors").is_file() for name in runs)
    assert (tmp_path / "runs" / "digits_mlp" / "report" / "summary.txt").is_file()
    assert "resumed from runs/ckpt/checkpoints/step-100 (step 100 of 240" in said[checkpoints[1]]
    assert "resumed from runs/ckpt/checkpoints/step-240 (step 240 of 360" in said[checkpoints[2]]
    assert _train_steps(tmp_path / "runs" / "ckpt")[-1] == 360

    # The quick start again: complete, said once by the launcher (no worker started, nothing written).
    quick = _command(first[0])
    run_dir = tmp_path / "runs" / "digits_mlp"
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    again = ok(run(quick, cwd=tmp_path))
    assert again.stderr.splitlines() == [
        "dtrain: run.dir runs/digits_mlp is already complete (step 240 of 240, epoch 20 of 20); nothing to train "
        "— raise training.epochs or training.max_steps to train on"
    ], again.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    # ... and with more epochs: on from step 240, each step logged once.
    longer = ok(run([*quick, "training.epochs=25"], cwd=tmp_path))
    assert "resumed from runs/digits_mlp/checkpoints/step-240 (step 240 of 300, epoch 20 of 25)" in longer.stderr
    assert _train_steps(run_dir) == list(range(10, 301, 10)), _train_steps(run_dir)
