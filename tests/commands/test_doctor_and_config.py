"""The commands that do not train, through the real command line: `dtrain config` prints the resolved
config and the reference; `dtrain doctor` warns about too many threads and a small /dev/shm and
measures the peak for MFU."""

import os
import re
import shutil
import subprocess
import sys

import pytest
import tomllib

from dtrain.config import all_keys
from helpers import ROOT, TIMEOUT, env, ok
from helpers import dtrain as dtrain_cli

# --- dtrain config through the command line ------------------------------------------------------


def test_dtrain_config_prints_the_resolved_config_and_the_reference():
    resolved = tomllib.loads(ok(dtrain_cli("config", "examples/digits_mlp.toml", "training.epochs=3")).stdout)
    assert resolved["training"]["epochs"] == 3 and resolved["optimizer"]["lr"] == 0.2  # file, then override
    assert resolved["data"]["batch_size"] == 64
    reference = ok(dtrain_cli("config", "--reference")).stdout.splitlines()
    keys = [line.split("`")[1] for line in reference[2:]]
    assert reference[0] == "| key | default | meaning |" and keys == all_keys()


# --- doctor's warnings ----------------------------------------------------------------------------


def test_doctor_warns_about_too_many_threads_and_measures_the_peak_for_mfu():
    result = dtrain_cli("doctor", extra_env={"OMP_NUM_THREADS": "512"})
    assert result.returncode == 1
    assert re.search(r"OMP_NUM_THREADS=512 exceeds the \d+ core\(s\) this process may use", result.stdout)
    measured = re.search(
        r"^matmul \(cpu, \d+ thread\(s\) per process for 1 process\(es\)\): fp32 ([\d.e+-]+) "
        r"TFLOP/s, bf16 ([\d.e+-]+) TFLOP/s per process; for an MFU on this CPU pass "
        r"monitor.peak_tflops=([\d.e+-]+)",
        result.stdout,
        re.M,
    )
    assert measured and float(measured.group(1)) > 0 and float(measured.group(2)) > 0
    assert measured.group(3) == measured.group(1)


def test_doctor_warns_about_a_small_dev_shm():
    """/dev/shm replaced by a 64 MiB tmpfs, in a mount namespace of the doctor's own."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare (util-linux) for a private mount namespace")
    command = f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} -m dtrain doctor"
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c", command], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=TIMEOUT
    )
    assert result.returncode == 1, result.stderr
    assert "/dev/shm has only 64 MiB free" in result.stdout and "--shm-size=8g" in result.stdout
