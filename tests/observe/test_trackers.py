"""MLflow and Weights & Biases, for real and offline: rank 0 alone logs every record at its step and the
resolved config; a tracker that is not installed is refused in one line before anything starts."""

import contextlib
import http.server
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from dtrain.config import load_config
from dtrain.errors import ConfigError
from helpers import ROOT, TIMEOUT, WORKERS, dtrain, env, metrics, ok, run

JOB = [
    "examples/digits_mlp.toml",
    "data.name=synthetic",
    "data.num_samples=200",
    "data.input_shape=[12]",
    "data.batch_size=32",
    "training.epochs=2",
    "training.log_every=1",
    "model.hidden_size=16",
    "--nproc",
    "2",
]


def wandb_records(path):
    """The protobuf records of a W&B offline run file (a LevelDB-style log: 32 KiB blocks, each record
    a 7-byte header — CRC, length, kind — and its bytes, long ones split across blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw, pos, partial, records, block = path.read_bytes(), 7, b"", [], 32768
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        payload, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # whole, or the last piece
            records.append(partial + payload)
            partial = b""
        else:
            partial += payload
    parsed = []
    for data in records:
        record = pb.Record()
        record.ParseFromString(data)
        parsed.append(record)
    return parsed


OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
BOTH = 'monitor.trackers=["mlflow", "wandb"]'


def mlflow_runs(store, monkeypatch):
    """The client of an MLflow local store (a folder, or a file: URI) and its runs, oldest first."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading the local store, as dtrain wrote it
    client = MlflowClient(store.as_uri() if hasattr(store, "as_uri") else store)
    experiment = client.get_experiment_by_name("dtrain")
    return client, client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])


def wandb_parts(run_dir):
    """Each W&B offline run started in run_dir, oldest first (by when its file was last written: the
    folder names hold the time to the second only, and one job can follow another within it)."""
    parts = [next(part.glob("run-*.wandb")) for part in (run_dir / "wandb").glob("offline-run-*")]
    return sorted(parts, key=lambda part: part.stat().st_mtime_ns)


def wandb_id(part):
    """The W&B run id of an offline run's file (run-<id>.wandb; its folder's name may end in -1, -2 ... where
    two runs began within the same second)."""
    return part.stem.removeprefix("run-")


def wandb_exits(path):
    """The exit codes a W&B offline run file records (none where its service ended first)."""
    return [r.exit.exit_code for r in wandb_records(path) if r.WhichOneof("record_type") == "exit"]


def wandb_history(path, key="loss"):
    """{step: value} of one metric, as a W&B offline run file records it."""
    history = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            if key in items:
                history[record.history.step.num] = items[key]
    return history


def logged(run_dir, key="loss"):
    """{step: value} of one metric in metrics.jsonl."""
    return {r["step"]: r[key] for r in metrics(run_dir) if key in r}


@pytest.fixture(scope="module")
def tracked(warm, tmp_path_factory):
    pytest.importorskip("mlflow")  # the test extra installs both
    pytest.importorskip("wandb")
    run_dir = tmp_path_factory.mktemp("tracked")
    ok(
        warm(
            "run",
            *JOB,
            f"run.dir={run_dir}",
            'monitor.trackers=["tensorboard", "mlflow", "wandb"]',
            extra_env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
        )
    )
    return run_dir


def test_mlflow_gets_every_metric_at_its_step_and_the_config(tracked, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading the local store, as dtrain wrote it
    client = MlflowClient((tracked / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("dtrain")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1  # rank 0 only
    logged = {m.step: m.value for m in client.get_metric_history(runs[0].info.run_id, "loss")}
    expected = {r["step"]: r["loss"] for r in metrics(tracked) if "loss" in r}
    assert logged == pytest.approx(expected) and len(expected) == 6
    evals = client.get_metric_history(runs[0].info.run_id, "eval_accuracy")
    assert [m.step for m in evals] == [3, 6]
    params = runs[0].data.params
    assert params["optimizer.lr"] == "0.2" and params["model.hidden_size"] == "16"


def test_wandb_offline_gets_every_metric_at_its_step_and_the_config(tracked):
    runs = list((tracked / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1  # rank 0 only, offline as WANDB_MODE asks
    records = wandb_records(runs[0])
    history = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            if "loss" in items:
                history[record.history.step.num] = items["loss"]
    expected = {r["step"]: r["loss"] for r in metrics(tracked) if "loss" in r}
    assert history == pytest.approx(expected)
    config = {
        u.key: json.loads(u.value_json)
        for record in records
        if record.WhichOneof("record_type") == "run"
        for u in record.run.config.update
    }
    assert config["optimizer"]["lr"] == 0.2 and config["training"]["epochs"] == 2


def test_a_tracker_that_is_not_installed_is_refused_before_anything_starts(tmp_path):
    hide = "import sys; sys.modules['wandb'] = None; from dtrain.cli import main; sys.exit(main(sys.argv[1:]))"
    result = run([sys.executable, "-c", hide, "run", *JOB, f"run.dir={tmp_path / 'run'}", 'monitor.trackers=["wandb"]'])
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "dtrain: error: monitor.trackers names wandb, which is not installed here; pip "
        "install wandb (or pip install 'dtrain[trackers]'), or drop it from "
        "monitor.trackers"
    )
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="'comet' is none of them"):
        load_config(None, ['monitor.trackers=["comet"]'])


def test_a_resumed_run_continues_its_tracker_runs(warm, tmp_path, monkeypatch):
    """Stopped at a checkpoint it had logged last (training.stop_at_step, as a SIGTERM stop is), the run
    goes on in the same MLflow and W&B runs, each step once."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    ok(warm("run", *JOB, f"run.dir={tmp_path}", BOTH, "training.stop_at_step=3", extra_env=OFFLINE))
    resumed = ok(warm("run", *JOB, f"run.dir={tmp_path}", BOTH, extra_env=OFFLINE))
    assert "resumed_from_step" not in resumed.stderr, resumed.stderr
    expected = logged(tmp_path)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]
    client, runs = mlflow_runs(tmp_path / "mlruns", monkeypatch)
    assert len(runs) == 1  # one MLflow run, continued
    history = client.get_metric_history(runs[0].info.run_id, "loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5, 6]  # each step once
    assert {m.step: m.value for m in history} == pytest.approx(expected)
    parts = wandb_parts(tmp_path)
    assert len(parts) == 2 and len({wandb_id(p) for p in parts}) == 1  # one W&B run id, twice
    assert {**wandb_history(parts[0]), **wandb_history(parts[1])} == pytest.approx(expected)


def test_a_run_resumed_behind_what_it_logged_logs_into_new_tracker_runs(warm, tmp_path, monkeypatch):
    """Rank 1 is killed at its 6th step: the run had logged steps 1-5, its checkpoint is step 3. MLflow's
    run reads FAILED and W&B's exit code is 1, rather than both saying the run finished. The rerun resumes
    from step 3; neither tracker can take steps 4-5 back, so it logs into new runs tagged
    resumed_from_step=3 (and says so in one line). Its rank 0 is killed (kill -9) at step 6, before it can
    end its MLflow run: the next rerun, resuming from step 3 again, ends that one FAILED. Each run's
    history holds each step once."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    job = [*JOB, f"run.dir={tmp_path}", BOTH, "checkpoint.every_steps=3", "model.name=faults:dying_mlp"]
    failed = dtrain("run", *job, "model.options={die_at_forward = 6, die_rank = 1}", extra_env=OFFLINE)
    # (The launcher names the first failure it sees: rank 1's SIGKILL or, under load, rank 0's error.)
    assert failed.returncode == 1, failed.stderr
    assert sorted(logged(tmp_path)) == [1, 2, 3, 4, 5]
    client, (crashed,) = mlflow_runs(tmp_path / "mlruns", monkeypatch)
    assert crashed.info.status == "FAILED"
    (first,) = wandb_parts(tmp_path)
    # W&B writes its exit record from its own service; a rank stopped by the agent may end before it
    # comes (seen under load). What must never be there is an exit record saying the run succeeded.
    assert all(code == 1 for code in wandb_exits(first)), wandb_exits(first)
    line = (
        "the interrupted run logged past step 3 and MLflow and W&B cannot take those points back: this run "
        "logs from step 4 into new MLflow and W&B runs tagged resumed_from_step=3"
    )

    killed = dtrain("run", *job, "model.options={die_at_forward = 3, die_rank = 0}", extra_env=OFFLINE)
    assert killed.returncode == 1, killed.stderr
    assert killed.stderr.count(line) == 1, killed.stderr
    _, (_, unended) = mlflow_runs(tmp_path / "mlruns", monkeypatch)
    assert unended.info.status == "RUNNING"  # nobody left to end it

    resumed = ok(warm("run", *job, extra_env=OFFLINE))
    assert resumed.stderr.count(line) == 1, resumed.stderr
    expected = logged(tmp_path)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]
    _, (crashed, killed_run, new) = mlflow_runs(tmp_path / "mlruns", monkeypatch)
    assert [r.info.status for r in (crashed, killed_run, new)] == ["FAILED", "FAILED", "FINISHED"]
    assert new.data.tags["dtrain.resumed_from_step"] == "3" and new.data.params["optimizer.lr"] == "0.2"
    for run_ in (killed_run, new):
        steps = [m.step for m in client.get_metric_history(run_.info.run_id, "loss")]
        assert sorted(steps) == ([4, 5] if run_ is killed_run else [4, 5, 6])  # each step once
    history = client.get_metric_history(new.info.run_id, "loss")
    assert {m.step: m.value for m in history} == pytest.approx({s: expected[s] for s in (4, 5, 6)})
    ids = {wandb_id(part) for part in wandb_parts(tmp_path)}
    assert len(ids) == 3  # a new W&B run each time
    last = wandb_parts(tmp_path)[-1]
    tags = [t for r in wandb_records(last) if r.WhichOneof("record_type") == "run" for t in r.run.tags]
    assert "resumed_from_step=3" in tags
    assert wandb_history(last) == pytest.approx({s: expected[s] for s in (4, 5, 6)})
    assert wandb_exits(last) == [0]


def test_a_diverged_run_is_failed_with_exit_code_2_in_its_trackers(tmp_path, monkeypatch):
    """optimizer.lr=1e30: the loss is nan at step 1 and the run stops with exit status 2 (a run the config
    cannot train): MLflow's run reads FAILED and W&B's exit code is 2, not a finished run."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    result = dtrain("run", *JOB, f"run.dir={tmp_path}", BOTH, "optimizer.lr=1e30", extra_env=OFFLINE)
    assert result.returncode == 2 and "training diverged" in result.stderr, result.stderr
    _, (only,) = mlflow_runs(tmp_path / "mlruns", monkeypatch)
    assert only.info.status == "FAILED"
    (part,) = wandb_parts(tmp_path)
    assert wandb_exits(part) == [2]


def slow_tracked_run(run_dir, **popen):
    """A 2-process run of slow steps (about 150 of 0.05 s) logging to MLflow and W&B offline."""
    return subprocess.Popen(
        [sys.executable, "-m", "dtrain", "run", *JOB, f"run.dir={run_dir}", BOTH, "training.epochs=50"]
        + ["model.name=faults:dying_mlp", "model.options={hidden_size = 16, step_sleep_s = 0.05}"],
        cwd=ROOT,
        env=env(**OFFLINE),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def wait_for_steps(proc, run_dir, steps):
    deadline = time.monotonic() + TIMEOUT
    path = run_dir / "metrics.jsonl"
    while not (path.exists() and len(path.read_text().splitlines()) >= steps):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)


def test_a_preempted_run_is_killed_with_exit_code_75_and_its_resume_continues_it(warm, tmp_path, monkeypatch):
    """SIGTERM (a scheduler's preemption): MLflow's run reads KILLED, W&B's exit code is 75 (the requeue
    status). The checkpoint is at the last logged step, so the rerun continues the same tracker runs and
    ends them FINISHED, each step once."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    proc = slow_tracked_run(tmp_path)
    wait_for_steps(proc, tmp_path, 3)
    proc.send_signal(signal.SIGTERM)  # to the launcher, as SLURM or Kubernetes would
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 75, err
    client, (only,) = mlflow_runs(tmp_path / "mlruns", monkeypatch)
    assert only.info.status == "KILLED"
    (part,) = wandb_parts(tmp_path)
    assert wandb_exits(part) == [75]
    stopped_at = max(logged(tmp_path))

    again = [f"run.dir={tmp_path}", BOTH, "training.epochs=4", "model.name=faults:dying_mlp"]
    again.append("model.options={hidden_size = 16}")
    resumed = ok(warm("run", *JOB, *again, extra_env=OFFLINE))
    assert f"resumed from {tmp_path / 'checkpoints'}/step-{stopped_at}" in resumed.stderr, resumed.stderr
    assert "resumed_from_step" not in resumed.stderr, resumed.stderr
    _, (only,) = mlflow_runs(tmp_path / "mlruns", monkeypatch)
    assert only.info.status == "FINISHED"
    history = client.get_metric_history(only.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 13))  # each step once
    first, second = wandb_parts(tmp_path)
    assert wandb_id(first) == wandb_id(second)  # one W&B run, continued
    before, after = wandb_history(first), wandb_history(second)
    assert sorted(before) == list(range(1, stopped_at + 1)) and sorted(after) == list(range(stopped_at + 1, 13))
    assert wandb_exits(second) == [0]


def test_a_run_ended_by_ctrl_c_is_killed_with_exit_code_130_in_its_trackers(tmp_path, monkeypatch):
    """Ctrl-C reaches the launcher and its workers (a terminal signals its foreground process group)."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    proc = slow_tracked_run(tmp_path, start_new_session=True)
    wait_for_steps(proc, tmp_path, 3)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 130, err
    _, (only,) = mlflow_runs(tmp_path / "mlruns", monkeypatch)
    assert only.info.status == "KILLED"
    (part,) = wandb_parts(tmp_path)
    # W&B's own service gets the Ctrl-C too: it may end before the exit record (then none is there).
    assert wandb_exits(part) in ([130], [])


def test_an_mlflow_file_store_named_by_its_uri_is_logged_to(tmp_path, monkeypatch):
    """MLFLOW_TRACKING_URI=file:... is a local store as run.dir/mlruns is: MLflow's opt-in for it is
    given, not left to end rank 0 in a traceback."""
    pytest.importorskip("mlflow")
    store = (tmp_path / "store").as_uri()
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # as a user's shell has it
    tracking = {"MLFLOW_TRACKING_URI": store}
    ok(dtrain("run", *JOB, f"run.dir={tmp_path / 'run'}", 'monitor.trackers=["mlflow"]', extra_env=tracking))
    _, (only,) = mlflow_runs(store, monkeypatch)
    assert only.info.status == "FINISHED"
    assert not (tmp_path / "run" / "mlruns").exists()


def test_a_sigterm_before_the_first_step_ends_the_tracker_run_killed(tmp_path, monkeypatch):
    """SIGTERM on rank 0 as MLflow starts, before the first step: the new run's outputs go (the same
    command starts afresh), and the MLflow run it had begun, on a store outside run.dir, reads KILLED."""
    pytest.importorskip("mlflow")
    store = (tmp_path / "store").as_uri()
    pythonpath = os.pathsep.join([str(WORKERS / "process_faults"), env()["PYTHONPATH"]])
    sigterm = {"SIGTERM_AT_IMPORT": "mlflow@rank0", "PYTHONPATH": pythonpath}
    tracking = {"MLFLOW_TRACKING_URI": store, "MLFLOW_ALLOW_FILE_STORE": "true"}
    result = dtrain(
        "run", *JOB, f"run.dir={tmp_path / 'run'}", 'monitor.trackers=["mlflow"]', extra_env={**sigterm, **tracking}
    )
    assert result.returncode == 75 and "before training began" in result.stderr, result.stderr
    assert [p.name for p in (tmp_path / "run").iterdir() if not p.name.startswith(".")] == []
    _, (only,) = mlflow_runs(store, monkeypatch)
    assert only.info.status == "KILLED"


def test_a_sigterm_while_a_failed_run_ends_its_tracker_runs_does_not_cut_them_short(tmp_path, monkeypatch):
    """torchrun's agent stops a failed job's other ranks with SIGTERM, maybe while rank 0 is ending its
    tracker runs: that SIGTERM only sets the stop flag then, so MLflow's run is ended (FAILED), not left
    RUNNING or half-written by a process killed mid-write, and the run exits with its own status."""
    pytest.importorskip("mlflow")
    result = run([sys.executable, str(WORKERS / "sigterm_at_close.py"), str(tmp_path)])
    assert result.returncode == 2 and "training diverged" in result.stderr, result.stderr
    _, (only,) = mlflow_runs(tmp_path / "mlruns", monkeypatch)
    assert only.info.status == "FAILED"


# --- tracker servers, checked before anything starts ---------------------------------------------------


@contextlib.contextmanager
def local_server(status):
    """An HTTP server on 127.0.0.1 answering every request with `status`; yields its URL."""

    class Answer(http.server.BaseHTTPRequestHandler):
        def answer(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_POST = answer

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def unused_port():
    """A loopback port nobody listens on (bound, then closed again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


WANDB_ONLINE = {"WANDB_MODE": "online", "WANDB_API_KEY": "k" * 40, "WANDB_SILENT": "true"}


def refused(tmp_path, trackers, extra_env):
    """The one line a job logging to `trackers` is refused with, before run.dir is even made."""
    result = dtrain("run", *JOB, f"run.dir={tmp_path / 'run'}", f"monitor.trackers={trackers}", extra_env=extra_env)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "run").exists()
    return result.stderr.strip()


def test_an_mlflow_server_that_does_not_answer_is_refused_in_one_line(tmp_path):
    pytest.importorskip("mlflow")
    uri = f"http://127.0.0.1:{unused_port()}"
    assert refused(tmp_path, '["mlflow"]', {"MLFLOW_TRACKING_URI": uri}) == (
        f"dtrain: error: no MLflow server answers at MLFLOW_TRACKING_URI={uri} (Connection refused); start it, "
        "point MLFLOW_TRACKING_URI at one that runs, or unset it to log under run.dir/mlruns"
    )
    with local_server(503) as uri:
        assert f"no MLflow server answers at MLFLOW_TRACKING_URI={uri} (HTTP 503)" in refused(
            tmp_path, '["mlflow"]', {"MLFLOW_TRACKING_URI": uri}
        )


def test_wandb_online_with_a_refused_key_or_none_is_refused_in_one_line(tmp_path):
    pytest.importorskip("wandb")
    with local_server(401) as url:
        assert refused(tmp_path, '["wandb"]', {**WANDB_ONLINE, "WANDB_BASE_URL": url}) == (
            f"dtrain: error: W&B at {url} refuses the API key from WANDB_API_KEY (HTTP 401); run wandb login "
            "--relogin with a valid key, or set WANDB_MODE=offline (wandb sync uploads the run later)"
        )
    url = f"http://127.0.0.1:{unused_port()}"
    assert f"W&B at {url} does not answer (Connection refused)" in refused(
        tmp_path, '["wandb"]', {**WANDB_ONLINE, "WANDB_BASE_URL": url}
    )
    no_key = {**WANDB_ONLINE, "WANDB_API_KEY": "", "NETRC": str(tmp_path / "no-netrc"), "WANDB_BASE_URL": url}
    assert f"W&B logs online and finds no API key for {url}: run wandb login" in refused(tmp_path, '["wandb"]', no_key)


def test_a_tracker_server_that_accepts_but_never_answers_is_given_up_on(monkeypatch):
    """A server that takes the connection and says nothing (a hung proxy): given up after its timeout, not
    waited on for minutes; one that answers 200 passes."""
    from dtrain.observe import tracker_servers

    monkeypatch.setattr(tracker_servers, "TIMEOUT_S", 1.0)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        with pytest.raises(ConfigError, match=f"no MLflow server answers at MLFLOW_TRACKING_URI={uri} \\(timed out\\)"):
            tracker_servers.check_servers(["mlflow"])
    with local_server(200) as uri:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        monkeypatch.setenv("WANDB_BASE_URL", uri)
        for name, value in WANDB_ONLINE.items():
            monkeypatch.setenv(name, value)
        tracker_servers.check_servers(["mlflow", "wandb"])
