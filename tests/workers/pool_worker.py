"""Warm workers for the tests (tests/pool.py): each runs jobs in turn, as the processes of a fresh command
would, without paying a Python start, `import torch`, torch._dynamo's import and a rendezvous per job
(seconds each on 2 cores).

    python -m dtrain launch --nproc N tests/workers/pool_worker.py CONTROL_DIR    # jobs of --nproc N
    python tests/workers/pool_worker.py CONTROL_DIR                               # jobs of --nproc 1

Each process polls CONTROL_DIR for job-N.json ({"argv", "cwd", "env", "script"}) and writes
result-N-rankR.json with its exit status; a job's stdout and stderr go to files of its own.

A `dtrain run` or `dtrain launch` job of N processes runs as the command would: rank 0 first does the
launcher's part (`dtrain.cli.main` with the launch itself left out: the config read, the notes,
preflight's checks and refusals, "already complete"), and if it would launch, every rank runs what the
launcher would start in its workers (`python -m dtrain run ...`: cmd_run → worker_main → as_worker;
`python -m dtrain.worker.script SCRIPT ...`) in the group formed here once — dtrain's workers join a
group that exists (distributed.start) and leave it as they found it. A `torchrun SCRIPT` job runs the
script as `python SCRIPT ARGS` would, its init_process_group and destroy_process_group standing on the
pool's group. The end of a worker process (`end_worker_process`) ends the job instead. A job that fails
in the workers' part may leave the group broken: the pool then ends, and tests/pool.py starts a new one
for the next job.
"""

import datetime
import gc
import json
import multiprocessing
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import dtrain.distributed
import dtrain.launch
from dtrain.cli import main
from dtrain.worker import script as worker_script

_real_init, _real_destroy, _real_exit = dist.init_process_group, dist.destroy_process_group, os._exit
FRESH_RNG = torch.get_rng_state()


class JobEnded(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


def end_job(code: int):
    raise JobEnded(code)


def run_job(job: dict, out: Path, err: Path) -> tuple[int, bool]:
    """`dtrain ARGV` here, its output in `out` and `err`, the process put back as it was after; its exit
    status, and whether the workers' part ran (and may have left the group broken if it failed)."""
    saved_env, saved_cwd, saved_argv, saved_path = dict(os.environ), os.getcwd(), sys.argv[:], sys.path[:]
    torch.set_rng_state(FRESH_RNG)  # as a new process starts it, for a script that seeds nothing
    saved_fds = [os.dup(1), os.dup(2)]
    sys.stdout.flush(), sys.stderr.flush()
    with open(out, "w") as o, open(err, "w") as e:
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
    try:
        os.environ.update(job["env"])
        os.chdir(job["cwd"])
        with warnings.catch_warnings():  # each job shows the warnings a fresh process would (once each)
            if job.get("script"):  # its os._exit ends the job, not the worker
                dist.init_process_group, dist.destroy_process_group, os._exit = (
                    _init_once,
                    _keep_the_pools_group,
                    end_job,
                )
            return run_command(job)
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in saved_fds:
            os.close(fd)
        os.chdir(saved_cwd)
        sys.argv[:], sys.path[:] = saved_argv, saved_path
        dist.init_process_group, dist.destroy_process_group, os._exit = _real_init, _real_destroy, _real_exit
        os.environ.clear()
        os.environ.update(saved_env)
        torch._dynamo.reset()  # a compiled job's graphs are no later job's
        if "s3fs" in sys.modules:  # a new process would connect anew, with the credentials the next job gives
            sys.modules["s3fs"].S3FileSystem.clear_instance_cache()
        # Its daemonic children (DataLoader workers) end with it, as multiprocessing ends them when a
        # process exits. Killed first: an iterator collected later waits seconds for each worker to
        # finish its own teardown.
        for child in multiprocessing.active_children():
            if child.daemon:
                child.kill()
                child.join()
        gc.collect()


def run_command(job: dict) -> tuple[int, bool]:
    """The job's exit status here, and whether the workers' part ran."""
    if job.get("script"):  # `torchrun SCRIPT ARGS`: the script as each of its processes would run it
        return command(lambda: worker_script.run_script(job["argv"])), True
    argv = job["argv"]
    if not dist.is_initialized():  # one process: the command as it is, launcher and worker in one
        return command(lambda: main(argv)), True
    rank = dist.get_rank()
    launching = [launcher_part(argv) if rank == 0 else None]
    dist.broadcast_object_list(launching, src=0)
    said, entry = launching[0]
    if entry is None:
        return (said if rank == 0 else 0), False
    # What the launcher would start in each worker: `python -m dtrain ...` or `python -m dtrain.worker.script ...`
    module, *args = entry[1:]
    return command(lambda: (main if module == "dtrain" else worker_script.main)(args)), True


def command(call) -> int:
    try:
        return call() or 0
    except JobEnded as ended:
        return ended.code
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception:  # a script's own failure: what its process would print before exiting 1
        traceback.print_exc()
        return 1


def launcher_part(argv: list[str]) -> tuple[int, list[str] | None]:
    """What `dtrain ARGV --nproc N`'s launcher does before it launches: its status, and the command it
    would start in each worker (None: it would start none)."""
    launched = []

    def launch(spec, entry):
        launched.append(entry)
        return 0

    real, dtrain.launch.launch = dtrain.launch.launch, launch
    run_id = os.environ.pop("TORCHELASTIC_RUN_ID", None)  # not a worker: the launcher
    world = str(dist.get_world_size() if dist.is_initialized() else 1)
    try:
        return command(lambda: main([argv[0], "--nproc", world, *argv[1:]])), (launched[0] if launched else None)
    finally:
        dtrain.launch.launch = real
        if run_id is not None:
            os.environ["TORCHELASTIC_RUN_ID"] = run_id


def _init_once(*args, **kwargs) -> None:
    """A script's own init_process_group: the pool's group stands in for the one it would form."""
    if not dist.is_initialized():
        _real_init(*args, **kwargs)


def _keep_the_pools_group(group=None) -> None:
    if group is not None and group is not dist.GroupMember.WORLD:
        _real_destroy(group)


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
