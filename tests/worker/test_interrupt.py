"""Ctrl-C reaches every worker; the launcher says it once and the job ends with status 130."""

import signal
import subprocess
import sys

from helpers import ROOT, SMALL_JOB, TIMEOUT, env

# --- Ctrl-C ---------------------------------------------------------------------------------------


def test_ctrl_c_ends_the_job_with_status_130(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dtrain",
            "run",
            *SMALL_JOB,
            "training.epochs=50",
            "model.name=faults:dying_mlp",
            "model.options={step_sleep_s = 0.05}",
            "--nproc",
            "2",
            f"run.dir={tmp_path}",
        ],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = TIMEOUT
    while not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text():
        assert proc.poll() is None and deadline > 0, proc.communicate()
        deadline -= 0.05
        __import__("time").sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 130, err
