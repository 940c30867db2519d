"""Warm workers for the tests (tests/pool.py): each runs `dtrain run ...` jobs in turn, as the processes of a
fresh command would, without paying a Python start, `import torch`, torch._dynamo's import and a
rendezvous per job (seconds each on 2 cores).

    python -m dtrain launch --nproc 2 tests/workers/pool_worker.py CONTROL_DIR    # jobs of --nproc 2
    python tests/workers/pool_worker.py CONTROL_DIR                               # jobs of --nproc 1

Each process polls CONTROL_DIR for job-N.json ({"argv", "cwd", "env"}) and writes result-N-rankR.json
with its exit status; a job's stdout and stderr go to files of its own. A job of 2 processes runs as
`dtrain run` would: rank 0 first does the launcher's part (`dtrain.cli.main` with the launch itself
left out: the config read, the notes, preflight's checks and refusals, "already complete"), and if it
would launch, both ranks run the workers' part (`dtrain.cli.main` as torchrun's workers do: cmd_run →
worker_main → as_worker) in the group formed here once — dtrain's workers join a group that exists
(distributed.start) and leave it as they found it. The end of a worker process (`end_worker_process`)
ends the job instead. A job that fails in the workers' part may leave the group broken: the pool then
ends, and tests/pool.py starts a new one for the next job.
"""

import datetime
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import dtrain.distributed
import dtrain.launch
from dtrain.cli import main


class JobEnded(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


def end_job(code: int):
    raise JobEnded(code)


def run_job(job: dict, out: Path, err: Path) -> tuple[int, bool]:
    """`dtrain ARGV` here, its output in `out` and `err`, the process put back as it was after; its exit
    status, and whether the workers' part ran (and may have left the group broken if it failed)."""
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    saved_fds = [os.dup(1), os.dup(2)]
    sys.stdout.flush(), sys.stderr.flush()
    with open(out, "w") as o, open(err, "w") as e:
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
    try:
        os.environ.update(job["env"])
        os.chdir(job["cwd"])
        with warnings.catch_warnings():  # each job shows the warnings a fresh process would (once each)
            return run_command(job["argv"])
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in saved_fds:
            os.close(fd)
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        torch._dynamo.reset()  # a compiled job's graphs are no later job's


def run_command(argv: list[str]) -> tuple[int, bool]:
    """The job's exit status here, and whether the workers' part ran."""
    if not dist.is_initialized():  # one process: the command as it is, launcher and worker in one
        return command(argv), True
    launching = [launcher_part(argv) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(launching, src=0)
    said, launched = launching[0]
    if not launched:
        return (said if dist.get_rank() == 0 else 0), False
    return command(argv), True


def command(argv: list[str]) -> int:
    try:
        return main(argv)
    except JobEnded as ended:
        return ended.code
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1


def launcher_part(argv: list[str]) -> tuple[int, bool]:
    """What `dtrain run ... --nproc 2`'s launcher does before it launches: its status, and whether it
    would launch the workers."""
    launched = []

    def launch(spec, args):
        launched.append(args)
        return 0

    real, dtrain.launch.launch = dtrain.launch.launch, launch
    run_id = os.environ.pop("TORCHELASTIC_RUN_ID")  # not a worker: the launcher
    try:
        return command([*argv, "--nproc", str(dist.get_world_size())]), bool(launched)
    finally:
        dtrain.launch.launch = real
        os.environ["TORCHELASTIC_RUN_ID"] = run_id


def serve(control: Path) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    n = 0
    while True:
        job_file = control / f"job-{n}.json"
        while not job_file.exists():
            time.sleep(0.005)
        job = json.loads(job_file.read_text())
        if job.get("stop"):
            return
        err = control / f"err-{n}-rank{rank}.txt"
        code, ran = run_job(job, control / f"out-{n}-rank{rank}.txt", err)
        said = Path(os.environ.get("TORCHELASTIC_ERROR_FILE", "/nonexistent"))
        if code != 0 and said.is_file():  # what a launched worker leaves for the launcher to print
            message = json.loads(said.read_text()).get("message", "")
            with open(err, "a") as fh:
                fh.write((message if isinstance(message, str) else json.dumps(message)) + "\n")
            said.unlink()
        broken = ran and code != 0 and dist.is_initialized()
        result = control / f"result-{n}-rank{rank}.json"
        result.with_suffix(".tmp").write_text(json.dumps({"code": code, "broken": broken}))
        result.with_suffix(".tmp").rename(result)
        if broken:  # a peer may have left mid-collective: a new pool takes over
            return
        n += 1


if __name__ == "__main__":
    dtrain.distributed.end_worker_process = end_job  # the job ends, not this process
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # A collective a failed job left waiting gives up within a minute, not torch's half hour.
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        serve(Path(sys.argv[1]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
