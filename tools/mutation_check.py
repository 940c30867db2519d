"""Break dtrain on purpose, one promise at a time, and check that the suite notices.

    python tools/mutation_check.py              # every breakage; a Markdown table at the end
    python tools/mutation_check.py resume_off   # one of them

Each breakage is a small edit to the source (a promise switched off) applied to a copy of the
repository in a temporary folder; the tests named for it run against that copy (PYTHONPATH points at
the copy's src/, so the installed dtrain is not touched). A breakage is caught when those tests fail.
The working tree is never modified. Slow (it starts real processes): minutes, not part of the
default test command. Exit status 1 if any breakage went unnoticed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name: (what it breaks, [(file, text, replacement), ...], tests that must fail)
BREAKAGES = {
    "resume_off": (
        "a Trainer finds the checkpoint but does not load it",
        [
            (
                "src/dtrain/train/trainer.py",
                "        if resume_from is not None:\n            position = self.plan.restore",
                "        if False:\n            position = self.plan.restore",
            )
        ],
        ["tests/checkpoint/test_checkpoint.py::test_stop_and_resume_is_bitwise_equal_in_every_situation"],
    ),
    "shm_sum_order": (
        "each rank sums the shared-memory slots starting from its own (ranks round differently)",
        [
            (
                "src/dtrain/parallel/ddp_comm.py",
                "            torch.add(slots[0], slots[1], out=chunk)\n"
                "            for r in range(2, self.world_size):\n",
                "            order = [(self.rank + k) % self.world_size for k in range(self.world_size)]\n"
                "            torch.add(slots[order[0]], slots[order[1]], out=chunk)\n"
                "            for r in order[2:]:\n",
            )
        ],
        [
            "tests/train/test_training.py::test_the_shared_memory_average_gives_every_rank_the_same_numbers_at_three_ranks"
        ],
    ),
    "bf16_ignored": (
        "training.precision = bf16 runs the forward pass in fp32",
        [
            (
                "src/dtrain/train/amp.py",
                "autocast = functools.partial(torch.autocast, device_type=device.type, dtype=dtype)",
                "autocast = contextlib.nullcontext",
            )
        ],
        ["tests/train/test_training.py::test_bf16_autocast_on_cpu_runs_and_learns"],
    ),
    "prune_skipped": (
        "checkpoint.keep is ignored: old checkpoints are never deleted",
        [
            (
                "src/dtrain/checkpoint/store.py",
                "        for checkpoint in doomed:\n            # Out of the way first",
                "        for checkpoint in []:\n            # Out of the way first",
            )
        ],
        ["tests/checkpoint/test_checkpoint.py::test_checkpoints_are_kept_k_and_sealed"],
    ),
    "eval_counts_padding": (
        "evaluation pads the ranks' shares as DistributedSampler does, counting duplicates",
        [
            (
                "src/dtrain/data/sampler.py",
                "return torch.arange(rank, n, world_size)",
                "return torch.arange(rank, n + (-n) % world_size, world_size) % n",
            )
        ],
        ["tests/train/test_training.py::test_eval_is_exact_when_the_world_size_does_not_divide_the_data"],
    ),
    "set_epoch_forgotten": (
        "every epoch reuses epoch 0's order (set_epoch never called)",
        [("src/dtrain/data/loaders.py", "self.sampler.set_epoch(epoch)", "self.sampler.set_epoch(0)")],
        ["tests/train/test_training.py::test_parity_with_a_plain_ddp_loop"],
    ),
    "sync_every_micro_batch": (
        "gradient accumulation all-reduces on every micro-batch (no no_sync)",
        [
            (
                "src/dtrain/parallel/ddp.py",
                "self.model.require_backward_grad_sync = enabled",
                "self.model.require_backward_grad_sync = True",
            )
        ],
        ["tests/train/test_training.py::test_accumulation_skips_the_allreduce_on_all_but_the_last_micro_batch"],
    ),
    "skips_stay_in_schedule": (
        "fp16 steps GradScaler skipped are never taken out of the LR schedule",
        [
            (
                "src/dtrain/train/trainer.py",
                '        if record.get("skipped_steps"):\n            resume.unschedule',
                "        if False:\n            resume.unschedule",
            )
        ],
        ["tests/test_gpu_paths.py::test_skipped_fp16_steps_are_counted_and_leave_norms_and_schedule_true"],
    ),
    "host_read_in_step": (
        "the step reads the loss back to the host every step",
        [
            (
                "src/dtrain/train/trainer.py",
                "forward_backward(micro_batches, shares, run.precision)\n",
                "forward_backward(micro_batches, shares, run.precision).item()\n",
            )
        ],
        ["tests/train/test_step_promises.py::test_the_training_step_never_reads_a_value_back_to_the_host"],
    ),
    "wait_unsaid": (
        "the waiting line: a node that waits (peers, endpoint, rank 0) says nothing until it gives up",
        [("src/dtrain/distributed/waiting.py", "            self._thread.start()\n", "            pass\n")],
        [
            "tests/launch/test_launchers.py::test_a_node_whose_peers_never_come_says_so_then_gives_up_in_one_line",
            "tests/launch/test_launchers.py::test_a_pod_whose_rank_0_never_answers_waits_visibly_then_gives_up_in_one_line",
            "tests/launch/test_launchers.py::test_rank_0_waiting_for_a_rank_that_never_joins_says_so_then_gives_up_in_one_line",
        ],
    ),
    "settle_at_exit_off": (
        "the settle fix: gloo's thread gets no moment with the GIL free before the interpreter tears down",
        [
            (
                "src/dtrain/distributed/group.py",
                "        atexit.register(time.sleep, 0.05)",
                "        pass",
            )
        ],
        ["tests/distributed/test_gloo_exit.py::test_a_script_whose_last_collective_ends_at_exit_exits_cleanly"],
    ),
    "weight_by_samples": (
        "micro-batches and ranks weighted by samples, not by their target tokens, for a token-mean loss",
        [
            (
                "src/dtrain/train/loss.py",
                "        if counts and all(c is not None for c in counts):\n",
                "        if False:\n",
            )
        ],
        ["tests/train/test_token_weights.py::test_one_step_equals_one_batch_of_all_samples_for_a_token_mean_loss"],
    ),
}


def copy_of_repository(into: Path) -> Path:
    for name in ("src", "tests", "examples", "pyproject.toml"):
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, into / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(source, into / name)
    return into


def apply(copy: Path, edits: list[tuple[str, str, str]]) -> None:
    for file, text, replacement in edits:
        path = copy / file
        source = path.read_text()
        if source.count(text) != 1:
            raise SystemExit(f"{file}: the text to break is not there exactly once: {text!r} (update {__file__})")
        path.write_text(source.replace(text, replacement))


def check(name: str) -> tuple[bool, float, str]:
    """(caught, seconds, the tests' last line) for breakage `name`."""
    _, edits, tests = BREAKAGES[name]
    with tempfile.TemporaryDirectory(prefix=f"dtrain-mutation-{name}-") as tmp:
        copy = copy_of_repository(Path(tmp))
        apply(copy, edits)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy / "src"), os.environ.get("PYTHONPATH", "")])}
        start = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
        )
        last = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
        return done.returncode == 1, time.monotonic() - start, last


def main(names: list[str]) -> int:
    unknown = [n for n in names if n not in BREAKAGES]
    if unknown:
        print(f"unknown breakage(s) {', '.join(unknown)}; known: {', '.join(BREAKAGES)}", file=sys.stderr)
        return 2
    rows = ["| breakage | what it breaks | caught by | result |", "| --- | --- | --- | --- |"]
    missed = 0
    for name in names or list(BREAKAGES):
        caught, seconds, last = check(name)
        missed += not caught
        what, _, tests = BREAKAGES[name]
        test_names = ", ".join(f"`{t.split('::')[-1]}`" for t in tests)
        verdict = f"caught ({last})" if caught else f"**missed** ({last})"
        rows.append(f"| {name} | {what} | {test_names} | {verdict} |")
        print(f"{name}: {'caught' if caught else 'MISSED'} in {seconds:.0f} s — {last}", file=sys.stderr, flush=True)
    print("\n".join(rows))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
