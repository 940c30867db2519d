"""Jobs of `dtrain run|eval ... --nproc N`, `dtrain launch --nproc N SCRIPT` and `torchrun SCRIPT` on warm
workers (tests/workers/pool_worker.py), for the tests that read what a run wrote (its metrics, weights,
checkpoints, a resume's result) rather than prove the launcher: the same worker code path on an
N-process gloo group under dtrain's launcher, without a launcher, N Pythons and `import torch` per
job. Tests of the launcher itself, of failures, of signals and of what is said once per job keep
`helpers.dtrain` and `helpers.torchrun`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from helpers import ROOT, TIMEOUT, WORKERS, env


def without_nproc(args) -> tuple[list[str], int]:
    """`args` without their --nproc flags (the launcher's part is given it back), and the number of
    processes they ask for (the last --nproc wins, as on the command line; 1 without one)."""
    argv, nproc, flags = [], 1, iter(args)
    for arg in flags:
        if arg == "--nproc":
            nproc = int(next(flags))
        else:
            argv.append(arg)
    return argv, nproc


class Pool:
    """`pool.run("run", CONFIG, *overrides, "--nproc", "2")`: what `helpers.dtrain` returns for that job
    (exit status, then each rank's output one after the other), run on the warm workers. A pool of 1
    (`Pool(1)`) takes the `dtrain run` and `dtrain eval` jobs of one process: no launcher, no group."""

    def __init__(self, nproc: int = 2) -> None:
        self.nproc = nproc
        self.proc: subprocess.Popen | None = None
        self.control: Path | None = None
        self.n = 0

    def _start(self) -> None:
        self.stop()  # what a pool that ended left behind
        self.control = Path(tempfile.mkdtemp(prefix="dtrain-pool-"))
        self.n = 0
        self.log = open(self.control / "pool.log", "w")  # noqa: SIM115 — open while the pool lives
        launch = [sys.executable, *(["-m", "dtrain", "launch", "--nproc", str(self.nproc)] if self.nproc > 1 else [])]
        self.proc = subprocess.Popen(
            [*launch, str(WORKERS / "pool_worker.py"), str(self.control)],
            cwd=ROOT,
            env=env(),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def run(self, *args: str, cwd: Path | None = None, extra_env: dict[str, str] | None = None):
        argv, nproc = without_nproc(args)
        commands = ("run", "eval", "launch") if nproc > 1 else ("run", "eval")  # a script of 1: torchrun's group
        assert nproc == self.nproc and argv[0] in commands, args
        return self._job({"argv": argv}, ["dtrain", *args], cwd, extra_env)

    def torchrun(self, script: str | Path, *args: str, cwd: Path | None = None):
        """What `helpers.torchrun(script, *args, nproc=N)` returns, the script run by each warm worker as
        `python SCRIPT ARGS` (its own init_process_group and destroy_process_group use the pool's group)."""
        assert self.nproc > 1, "a script of one process runs under torchrun: its group is its own"
        return self._job({"argv": [str(script), *map(str, args)], "script": True}, ["torchrun", script, *args], cwd)

    def _job(self, job: dict, shown: list, cwd: Path | None, extra_env: dict[str, str] | None = None):
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.control is not None
        argv = job["argv"]
        n, self.n = self.n, self.n + 1
        job = {**job, "cwd": str(cwd or ROOT), "env": extra_env or {}}
        staged = self.control / f"job-{n}.tmp"
        staged.write_text(json.dumps(job))
        staged.rename(self.control / f"job-{n}.json")
        ranks = range(self.nproc)
        results = [self.control / f"result-{n}-rank{r}.json" for r in ranks]
        deadline = time.monotonic() + TIMEOUT
        while not all(r.exists() for r in results):
            if self.proc.poll() is not None and not all(r.exists() for r in results):
                raise AssertionError(f"the pool ended during job {argv}:\n{self._said()}")
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"job {argv} did not end within {TIMEOUT} s on the pool")
            time.sleep(0.01)
        said = [json.loads(r.read_text()) for r in results]
        out = "".join((self.control / f"out-{n}-rank{r}.txt").read_text() for r in ranks)
        err = "".join((self.control / f"err-{n}-rank{r}.txt").read_text() for r in ranks)
        if any(s["broken"] for s in said):  # the workers leave after such a failure; the next job starts a pool
            self._wait_or_kill()
        code = next((s["code"] for s in said if s["code"]), 0)
        return subprocess.CompletedProcess(shown, code, out, err)

    def _said(self) -> str:
        self.log.flush()
        return (self.control / "pool.log").read_text() if self.control else ""

    def _wait_or_kill(self) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        """End the workers (they leave at the next job file, a stop) and remove their files."""
        if self.proc is not None and self.proc.poll() is None and self.control is not None:
            (self.control / f"job-{self.n}.json").write_text(json.dumps({"stop": True}))
            self._wait_or_kill()
        if self.control is not None:
            self.log.close()
            shutil.rmtree(self.control, ignore_errors=True)
            self.control = None
