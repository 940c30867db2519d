"""kill -9 at random moments of background checkpoint writes, many times, in one process tree.

    python async_kills.py RUN_DIR ROUNDS OUT.json

Each round forks a child that resumes from RUN_DIR's newest checkpoint (the Checkpointer's own start:
partial folders removed, the newest verified, restored) and then trains and checkpoints with
checkpoint.async on every step — a write always in flight — until this process SIGKILLs it at a random
moment. After each kill every sealed checkpoint is checked against its manifest. Forking from this
process, which has imported torch but computed nothing, spares each round the start of a Python.
"""

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint  # imported here once, not in every child
import torch.distributed.checkpoint.staging

import dtrain.checkpoint.background
import dtrain.checkpoint.tensors  # noqa: F401
from dtrain.checkpoint import CheckpointError, CheckpointStore, Parts, Position
from dtrain.checkpoint.checkpointer import Checkpointer
from dtrain.config import CheckpointConfig
from dtrain.rundir.resume_point import chooser

BAD_RESUME = 3


def build(run_dir: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer, Checkpointer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))  # 6 MB a checkpoint
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    parts = Parts(model, optimizer, scheduler, torch.amp.GradScaler("cpu", enabled=False), 0, 1, 8)
    config = CheckpointConfig(keep=2)
    config.async_ = True
    return model, optimizer, Checkpointer(config, run_dir, parts)


def child(run_dir: Path, started: Path) -> None:
    model, optimizer, checkpointer = build(run_dir)
    resume_from = checkpointer.find_resume_point(chooser(checkpointer.config))
    step = checkpointer.restore(resume_from).step if resume_from else 0
    # The state restored is the one written at that step: AdamW counted exactly that many updates.
    counted = {int(s["step"]) for s in optimizer.state.values()} or {0}
    if counted != {step}:
        print(f"resumed at step {step} with AdamW at {counted}", file=sys.stderr, flush=True)
        os._exit(BAD_RESUME)
    started.write_text(str(step))
    while True:
        step += 1
        model(torch.randn(8, 512)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        checkpointer.checkpoint(Position(step, 0))  # the previous one finished first: one always in flight


def main() -> None:
    run_dir, rounds, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    store = CheckpointStore(run_dir)
    rng = random.Random(0)
    torch.set_num_threads(1)  # no thread pool for the children to inherit half-alive
    build(run_dir)  # the first AdamW imports much (seconds): once, here
    resumed, mid_write, damaged, failures = [], 0, [], []
    for round_ in range(rounds):
        started = run_dir.parent / f"started-{round_}"
        pid = os.fork()
        if pid == 0:
            try:
                child(run_dir, started)
            finally:
                os._exit(1)
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.5))  # a random moment of its writes
        os.kill(pid, signal.SIGKILL)  # a child that ended by itself is a zombie until waited for: no error
        _, status = os.waitpid(pid, 0)
        if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
            failures.append(f"round {round_}: the child ended by itself ({status})")
        if started.exists():
            resumed.append(int(started.read_text()))
        mid_write += any(store.root.glob(".partial-*"))
        for checkpoint in store.complete():
            try:
                store.check_intact(checkpoint)
            except CheckpointError as exc:
                damaged.append(str(exc))
    # What a kill leaves besides sealed checkpoints: partial folders only (the next start removes them).
    unsealed = [p.name for p in store.root.iterdir() if not p.name.startswith(".partial-")]
    unsealed = sorted(set(unsealed) - {c.name for c in store.complete()})
    report = {"resumed": resumed, "mid_write": mid_write, "damaged": damaged, "unsealed": unsealed}
    out.write_text(json.dumps({**report, "failures": failures}))


if __name__ == "__main__":
    main()
