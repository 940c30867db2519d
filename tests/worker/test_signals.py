"""SIGTERM at every moment of a run, as schedulers send it: the job exits 75 (requeue) and what it
trained is kept — a sealed checkpoint or the final weights — so the same command continues."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtrain.checkpoint import CheckpointStore
from dtrain.launch.signals import children
from helpers import ROOT, SMALL_JOB, TIMEOUT, WORKERS, dtrain, env, ok, weights

SLOW_JOB = [*SMALL_JOB, "training.epochs=50", "training.log_every=1", "model.name=faults:dying_mlp"]


def slow_job(run_dir: Path, *extra: str, step_sleep_s: float = 0.05) -> list[str]:
    """The slow job's arguments, as `dtrain run` and the config_trainer.py script take them."""
    return [
        *SLOW_JOB,
        f"model.options={{hidden_size = 16, step_sleep_s = {step_sleep_s}}}",
        f"run.dir={run_dir}",
        *extra,
    ]


def start(run_dir: Path, *extra: str, nproc: int = 2, step_sleep_s: float = 0.05, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dtrain", "run", *slow_job(run_dir, *extra, step_sleep_s=step_sleep_s)]
        + ["--nproc", str(nproc)],
        cwd=ROOT,
        env=popen.pop("env", None) or env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_sigterm_to_the_whole_process_group_piped_into_a_reader_leaves_a_checkpoint(tmp_path):
    """`dtrain run ... | tee log` stopped as a scheduler does, `kill -TERM -PGID`: the reader dies with
    the group at once, so the workers' next console line has nowhere to go. The run still writes its
    checkpoint, exits 75, and the same command resumes from it."""
    proc = start(tmp_path, start_new_session=True)  # its own process group, as a job's
    wait_for(lambda: logged_steps(tmp_path) >= 3 or proc.poll() is not None, "training to start")
    proc.stdout.close()  # the reader is gone (tee, killed by the same signal)
    proc.stderr.close()
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=TIMEOUT) == 75
    complete = CheckpointStore(tmp_path).complete()
    assert len(complete) == 1, sorted(p.name for p in tmp_path.iterdir())
    resumed = dtrain(
        "run", *SLOW_JOB, "model.options={hidden_size = 16}", "--nproc", "2", f"run.dir={tmp_path}", "training.epochs=2"
    )
    ok(resumed)
    assert f"resumed from {complete[0].path}" in resumed.stderr


# --- before training begins ------------------------------------------------------------------------

FAULTS = str(Path(__file__).resolve().parent.parent / "workers" / "process_faults")


def sigterm_at_import(module: str, run_dir: Path, nproc: int, *extra: str) -> subprocess.CompletedProcess:
    """The small job, with a SIGTERM landing in the middle of importing `module` (see sitecustomize.py)."""
    pythonpath = os.pathsep.join([FAULTS, env()["PYTHONPATH"]])
    return dtrain(
        "run",
        *SMALL_JOB,
        "--nproc",
        str(nproc),
        f"run.dir={run_dir}",
        *extra,
        extra_env={"SIGTERM_AT_IMPORT": module, "PYTHONPATH": pythonpath},
    )


BEFORE = "dtrain: stopped by SIGTERM before training began; nothing to save — rerun the same command to start"
INTERRUPTED_BEFORE = (
    "dtrain: interrupted (Ctrl-C) before training began; nothing to save — rerun the same command to start"
)


@pytest.mark.parametrize("nproc, where", [(1, ""), (2, "@launcher"), (2, "@worker")])
def test_sigterm_at_import_time_exits_75_with_one_line(tmp_path, nproc, where):
    """A scheduler's SIGTERM in the first second, while torch is importing — in the only process, in
    the launcher, or in every worker — ends the job with 75 (requeue), not 143, and dtrain's one line."""
    result = sigterm_at_import(f"torch{where}", tmp_path / "run", nproc)
    assert result.returncode == 75, result.stderr
    assert result.stderr.count(BEFORE) == 1, result.stderr
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_sigterm_to_the_launcher_while_its_workers_import_torch_says_dtrains_line(tmp_path):
    """The launcher's SIGTERM reaches the workers (torch's agent passes it on) while they import torch:
    not only torch's "Received 15 death signal", but dtrain's own line, once; exit 75."""
    pythonpath = os.pathsep.join([FAULTS, env()["PYTHONPATH"]])
    result = dtrain(
        "run",
        *SMALL_JOB,
        "--nproc",
        "2",
        f"run.dir={tmp_path / 'run'}",
        extra_env={"SIGTERM_AT_IMPORT": "torch@rank0", "SIGTERM_AT_IMPORT_TO": "parent", "PYTHONPATH": pythonpath},
    )
    assert result.returncode == 75, result.stderr
    assert result.stderr.count(BEFORE) == 1, result.stderr


def test_sigterm_after_run_dir_is_claimed_leaves_nothing_and_the_rerun_starts(warm, tmp_path):
    """SIGTERM on rank 0 once run.dir is taken and its outputs begun (TensorBoard importing), before the
    first step: both ranks stop (75, the one line), and the new run's outputs are removed, so the same
    command starts afresh instead of being refused as an earlier run."""
    result = sigterm_at_import("torch.utils.tensorboard@rank0", tmp_path, 2)
    assert result.returncode == 75, result.stderr
    assert result.stderr.count(BEFORE) == 1, result.stderr
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == []
    ok(warm("run", *SMALL_JOB, "--nproc", "2", f"run.dir={tmp_path}"))


# --- while writing -------------------------------------------------------------------------------


def slow_disk(for_files: str, note: Path, seconds: float = 1.0) -> dict[str, str]:
    """The environment for a job whose fsyncs of files with `for_files` in their path take `seconds`."""
    return env(
        PYTHONPATH=os.pathsep.join([FAULTS, env()["PYTHONPATH"]]),
        SLOW_FSYNC=f"{for_files}:{seconds}",
        SLOW_FSYNC_NOTE=str(note),
    )


def test_a_second_sigterm_during_the_checkpoint_write_still_leaves_a_sealed_checkpoint(tmp_path):
    """SIGTERM, and while the checkpoint it asked for is being written (a slow disk), SIGTERM again and
    again — a scheduler repeating itself, an impatient user: the launcher keeps waiting for the workers
    instead of leaving (which would take them down mid-write), the checkpoint is sealed, the job exits
    75. (torch's agent survives one repeat by accident, starting its wait over; not a second.)"""
    run_dir, note = tmp_path / "run", tmp_path / "fsyncs"
    proc = start(run_dir, env=slow_disk(".partial-step-", note))
    wait_for(lambda: logged_steps(run_dir) >= 3 or proc.poll() is not None, "training to start")
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: note.exists() or proc.poll() is not None, "the checkpoint write")
    for _ in range(3):
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 75, err
    complete = CheckpointStore(run_dir).complete()
    assert len(complete) == 1, err
    assert f"stopped by SIGTERM at step {complete[0].step}" in err


def test_sigterm_during_the_final_weights_write_leaves_weights_and_a_run_the_requeue_finds_complete(warm, tmp_path):
    """SIGTERM while model.safetensors is being written (a slow disk): the weights are finished, the
    trained state is also sealed as a checkpoint of the last step, and the job exits 75 — so the rerun a
    scheduler makes on 75 finds the run complete (exit 0) instead of refusing an earlier run's run.dir."""
    run_dir, note = tmp_path / "run", tmp_path / "fsyncs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dtrain", "run", *SMALL_JOB, "--nproc", "2", f"run.dir={run_dir}"],
        cwd=ROOT,
        env=slow_disk("model.safetensors", note, seconds=2.0),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: note.exists() or proc.poll() is not None, "the final weights' write")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 75, err
    assert weights(run_dir).keys() == {"1.weight", "1.bias", "3.weight", "3.bias"}  # whole, loadable
    complete = CheckpointStore(run_dir).complete()
    assert [c.step for c in complete] == [16], err  # the last step (2 epochs of 8)
    ok(warm("run", *SMALL_JOB, "--nproc", "2", f"run.dir={run_dir}"))


# --- while the nodes join ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    """Whether something on this machine listens on TCP `port` (read from /proc: nothing connects)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    return True
    return False


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 75)])
def test_ctrl_c_or_sigterm_while_the_first_node_waits_for_the_others_ends_it_at_once(tmp_path, signum, code):
    """The first node of a static rendezvous (--node-rank 0) waits for the others inside one C++ call:
    Ctrl-C there did nothing until the rendezvous timed out (minutes). Now the node ends within seconds,
    with dtrain's line, 130 on Ctrl-C and 75 on SIGTERM — never a C++ frame or a traceback."""
    port = free_port()
    # The node starts as a terminal starts it, Ctrl-C live: a child inherits an ignored SIGINT, and
    # something earlier in a long suite may have left this process's SIGINT ignored.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dtrain", "run", *SMALL_JOB, f"run.dir={tmp_path}"]
            + ["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{port}"],
            cwd=ROOT,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        signal.signal(signal.SIGINT, inherited)
    wait_for(lambda: listening(port) or proc.poll() is not None, "the rendezvous store")
    time.sleep(0.5)  # inside the wait for the other node
    proc.send_signal(signum)
    try:
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        said = proc.communicate()[1]
        raise AssertionError(f"still waiting 10 s after the signal (SIGINT here: {inherited}):\n{said}") from None
    assert proc.returncode == code, err
    assert "frame #" not in err and "Traceback" not in err, err
    interrupted = (
        "dtrain: interrupted (Ctrl-C) before training began; nothing to save — rerun the same command to start"
    )
    assert err.count(BEFORE if signum == signal.SIGTERM else interrupted) == 1, err


# --- to one worker ---------------------------------------------------------------------------------


def start_as(how: str, run_dir: Path, *extra: str) -> list[subprocess.Popen]:
    """The slow job started `how`: by `dtrain run --nproc 2`, by `dtrain launch --nproc 2` running a
    user's script that trains it, or as two pods (RANK, WORLD_SIZE and MASTER_* set, no launcher): the
    job's processes as its scheduler sees them (one launcher, or one process per pod)."""
    job = slow_job(run_dir, *extra)
    if how == "pods":
        pod = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        commands = [(["run", *job], env(RANK=str(rank), **pod)) for rank in range(2)]
    elif how == "launch":
        commands = [(["launch", "--nproc", "2", str(WORKERS / "config_trainer.py"), *job], env())]
    else:
        commands = [(["run", *job, "--nproc", "2"], env())]
    return [
        subprocess.Popen(
            [sys.executable, "-m", "dtrain", *args],
            cwd=ROOT,
            env=e,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args, e in commands
    ]


def worker_of_rank(procs: list[subprocess.Popen], rank: int) -> int:
    """The pid of the job's worker of `rank`: a pod itself, or the launcher's child with RANK=rank."""
    if len(procs) == 2:
        return procs[rank].pid
    launcher = procs[0].pid
    for pid, environ in children(launcher):
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no worker of rank {rank} under the launcher {launcher}")


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("how", ["run", "launch", "pods"])
def test_sigterm_to_one_worker_ends_the_job_with_75_and_a_checkpoint(tmp_path, how, rank):
    """A scheduler or a pod's container runtime signals one worker, not the launcher: rank 0 or rank 1,
    under `dtrain run --nproc 2`, `dtrain launch --nproc 2 script.py`, or one of two pods. The ranks agree
    on the stop, every process of the job exits 75 with one sealed checkpoint, and the same commands
    resume from it (tried once per way of starting: which rank got the signal does not change what the
    checkpoint is)."""
    procs = start_as(how, tmp_path, "training.epochs=4")
    wait_for(lambda: logged_steps(tmp_path) >= 3 or any(p.poll() is not None for p in procs), "training to start")
    os.kill(worker_of_rank(procs, rank), signal.SIGTERM)
    errs = [p.communicate(timeout=TIMEOUT)[1] for p in procs]
    assert [p.returncode for p in procs] == [75] * len(procs), errs
    complete = CheckpointStore(tmp_path).complete()
    assert len(complete) == 1, errs
    assert errs[0].count(f"stopped by SIGTERM at step {complete[0].step}") == 1, errs[0]
    assert (tmp_path / "checkpoints" / f"step-{complete[0].step}" / "COMPLETE.json").is_file()
    if rank == 0:
        return
    procs = start_as(how, tmp_path, "training.epochs=4")
    errs = [p.communicate(timeout=TIMEOUT)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), errs
    assert f"resumed from {complete[0].path}" in errs[0], errs[0]
