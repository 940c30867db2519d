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
from helpers import ROOT, SMALL_JOB, TIMEOUT, env, ok
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


# --- bf16 on a CPU that is slow at it -------------------------------------------------------------


def test_bf16_many_times_slower_than_fp32_on_this_cpu_is_said_once_at_the_start(tmp_path):
    """The launcher measures both matmul rates briefly, as doctor does, and says one note where bf16 is
    SLOW_BF16 times slower or more: judged here from rates measured on this machine, then seen end to
    end (2 processes: the note comes from the launcher, never from a worker)."""
    from dtrain.train.speed import SLOW_BF16, matmul_tflops, slow_bf16_note

    fp32, bf16 = (matmul_tflops("cpu", name, 1, size=128, seconds=0.003) for name in ("fp32", "bf16"))
    note = slow_bf16_note(fp32, bf16)
    assert fp32 > 0 and bf16 > 0 and (note is None) == (fp32 / bf16 < SLOW_BF16)
    assert slow_bf16_note(1.0, 1.0) is None and slow_bf16_note(1.0, 2.0) is None  # bf16 units: nothing to say
    assert slow_bf16_note(1.0, 0.1) == (
        "training.precision = 'bf16' on this CPU: its bf16 matmuls ran 10 times slower than fp32 in a quick test "
        "(dtrain doctor measures both); training.precision=fp32 trains faster here"
    )
    run = [*SMALL_JOB, "training.epochs=1", f"run.dir={tmp_path}"]
    result = ok(dtrain_cli("run", *run, "training.precision=bf16", "--nproc", "2"))
    notes = [line for line in result.stderr.splitlines() if "bf16 matmuls ran" in line]
    assert len(notes) <= 1 and all(
        re.fullmatch(r"note: training\.precision = 'bf16' on this CPU: .*", n) for n in notes
    )
    if fp32 / bf16 > 3 * SLOW_BF16:  # far past the line here (a CPU without bf16 units): the launcher saw it too
        assert len(notes) == 1, result.stderr
