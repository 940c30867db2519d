"""Seeing inside a run: stragglers, hangs, misuse, OOM, profiles, doctor and report — real processes."""

import json
import math
import pickle
import re
import shutil
import struct
import time

import pytest

from helpers import dtrain, ok, train_lines

JOB = [
    "examples/digits_mlp.toml",
    "data.name=synthetic",
    "data.num_samples=500",
    "data.input_shape=[12]",
    "data.num_classes=3",
    "data.batch_size=16",
    "model.name=faults:dying_mlp",
    "training.epochs=3",
    "training.log_every=5",
]


def refused(result, *fragments):
    """The whole output is the one error line: no traceback, no warning, no second copy."""
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("dtrain: error:"), result.stdout + result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def slow_rank_run(tmp_path_factory):
    """Rank 1 sleeps 20 ms in every forward pass; steps 3-4 are profiled."""
    run_dir = tmp_path_factory.mktemp("slow_rank")
    result = ok(
        dtrain(
            "run",
            *JOB,
            "model.options={hidden_size = 32, step_sleep_s = 0.02, slow_rank = 1}",
            "--nproc",
            "2",
            "profile.steps=3-4",
            f"run.dir={run_dir}",
        )
    )
    return run_dir, result


def test_a_slow_rank_is_named_as_a_straggler(slow_rank_run):
    run_dir, result = slow_rank_run
    named = [line for line in result.stderr.splitlines() if line.startswith("straggler:")]
    assert named and all(line.startswith("straggler: rank 1 on ") for line in named), result.stderr
    later = train_lines(run_dir)[1:]  # the first window is warm-up and not judged
    assert all(m["rank_busy_ms"][1] > m["rank_busy_ms"][0] + 15 for m in later)
    assert all([s["rank"] for s in m["stragglers"]] == [1] for m in later)
    # The fast rank spends the difference waiting at the all-reduce: it shows up as communication.
    assert all(m["comm_ms"] > 5 for m in later)


def test_profile_steps_write_one_trace_per_rank(slow_rank_run):
    run_dir, _ = slow_rank_run
    for rank in range(2):
        trace = json.loads((run_dir / "profile" / f"rank-{rank}.pt.trace.json").read_text())
        names = {event.get("name") for event in trace["traceEvents"]}
        assert "aten::addmm" in names and "aten::mm" in names  # the MLP's forward and backward
        # Exactly the steps asked for (profile.steps=3-4), each labelled.
        assert {n for n in names if n and n.startswith("dtrain step ")} == {"dtrain step 3", "dtrain step 4"}


@pytest.mark.parametrize("comm_hook", ["none", "fp16"])
def test_a_hang_is_explained_and_ended_before_the_backend_timeout(tmp_path, comm_hook):
    """With dtrain's shared-memory average, and with torch's own hook in DDP's slot (as on GPUs,
    where dtrain leaves the slot free): either way the waiting rank is told from the stalled one."""
    start = time.monotonic()
    result = dtrain(
        "run",
        *JOB,
        "model.options={hidden_size = 32, stall_at_forward = 5, stall_rank = 1}",
        "--nproc",
        "2",
        "distributed.hang_timeout_s=3",
        f"ddp.comm_hook={comm_hook}",
        f"run.dir={tmp_path}",
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 124, result.stderr
    assert elapsed < 60  # the backend's own timeout is 1800 s
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("dtrain: error:"), result.stderr  # the whole output
    assert "hang: no rank finished a step for 3 s" in errors[0]
    assert "rank 1 (" in errors[0] and "at step 5, forward/backward is behind" in errors[0]
    assert "rank(s) 0 wait at step 5, gradient all-reduce" in errors[0]
    stalled = (tmp_path / "diagnostics" / "rank-1.txt").read_text()
    assert "in stall_here_forever" in stalled and "in forward" in stalled  # where it stalled
    waiting = (tmp_path / "diagnostics" / "rank-0.txt").read_text()
    if comm_hook == "none":
        assert "_meet" in waiting  # rank 0 was waiting for rank 1's gradients
    # The flight recorder's record of the last collectives, dumped by dtrain (not at the backend's
    # timeout), in the format torch's fr_trace analyser reads.
    assert "flight-recorder-rank-<N>" in errors[0]
    for rank in range(2):
        record = pickle.loads((tmp_path / "diagnostics" / f"flight-recorder-rank-{rank}").read_bytes())
        collectives = [entry["profiling_name"] for entry in record["entries"]]
        assert collectives and all(name.startswith("gloo:") for name in collectives), collectives


def test_a_parameter_the_forward_pass_skips_gets_a_clear_message(tmp_path):
    refused(
        dtrain(
            "run", *JOB, "model.name=faults:with_unused", "monitor.debug=true", "--nproc", "2", f"run.dir={tmp_path}"
        ),
        "the forward pass did not use these parameters: extra.weight, extra.bias",
        "set ddp.find_unused_parameters=true",
    )


def test_a_model_that_differs_between_ranks_gets_a_clear_message(tmp_path):
    refused(
        dtrain("run", *JOB, "model.name=faults:shape_by_rank", "--nproc", "2", f"run.dir={tmp_path}"),
        "the model differs between ranks",
        "build the same model on every rank",
    )


def test_out_of_memory_names_the_step_the_batch_and_the_levers(solo, tmp_path):
    refused(
        solo.run("run", *JOB, "model.options={oom_at_forward = 3}", "--nproc", "1", f"run.dir={tmp_path}"),
        "out of GPU memory at step 3 on rank 0 with data.batch_size=16 per process",
        "try data.batch_size=8 training.grad_accum_steps=2 (the same effective batch) or training.precision=bf16",
    )


def test_a_cpu_out_of_memory_gets_the_same_advice(solo, tmp_path):
    """A real allocation the CPU cannot serve (100 000 GiB in the third forward pass)."""
    refused(
        solo.run(
            "run", *JOB, "model.options={oom_at_forward = 3, oom_gib = 100000}", "--nproc", "1", f"run.dir={tmp_path}"
        ),
        "out of memory at step 3 on rank 0 with data.batch_size=16 per process",
        "try data.batch_size=8 training.grad_accum_steps=2 (the same effective batch) or training.precision=bf16",
    )


def test_a_model_without_parameters_is_refused(solo, tmp_path):
    refused(
        solo.run("run", *JOB, "model.name=torch.nn:Flatten", "--nproc", "1", f"run.dir={tmp_path / 'run'}"),
        "the model (Flatten) has no trainable parameters: there is nothing to train",
    )
    assert not (tmp_path / "run").exists()


# --- doctor -------------------------------------------------------------------------------------


def test_doctor_reports_the_environment_and_what_looks_wrong(cli):
    """The report of this machine and its environment, in this process (the `cli` fixture); the next test
    runs the real command, launching its workers."""
    healthy = ok(cli("doctor"))
    assert "torch " in healthy.stdout and "backends: gloo yes" in healthy.stdout
    assert "network interfaces: lo 127.0.0.1" in healthy.stdout
    assert "problems: none found" in healthy.stdout
    broken = cli("doctor", extra_env={"GLOO_SOCKET_IFNAME": "nosuchif0", "RANK": "3", "WORLD_SIZE": "2"})
    assert broken.returncode == 1
    assert "GLOO_SOCKET_IFNAME=nosuchif0 names no interface here (nosuchif0)" in broken.stdout
    assert "RANK=3 with WORLD_SIZE=2 is impossible" in broken.stdout
    assert "RANK=3  — this process's global rank" in broken.stdout
    malformed = cli("doctor", extra_env={"RANK": "x", "WORLD_SIZE": "2"})
    assert malformed.returncode == 1 and "environment variable RANK='x' is not an integer" in malformed.stdout
    for variables, problem in (
        (
            {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},
            "OMPI_COMM_WORLD_RANK=3 with OMPI_COMM_WORLD_SIZE=2 is impossible",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "99999999999999999999999"},
            "WORLD_SIZE=99999999999999999999999 is beyond any job's numbers",
        ),
    ):
        found = cli("doctor", extra_env=variables)
        assert found.returncode == 1 and problem in found.stdout, found.stdout


def test_doctor_measures_real_all_reduce_all_gather_and_reduce_scatter_across_the_group():
    """3 processes: each collective's bus bandwidth factor differs from 1 (all-reduce 4/3, all-gather and
    reduce-scatter 2/3; at 2 the all-reduce's would equal its algbw, proving nothing). Up to 16 MiB, to be quick."""
    result = ok(dtrain("doctor", "--nproc", "3", "--iters", "1", "--max-mib", "16"))
    out = result.stdout
    tables = {}
    for name, calls, factor in (
        ("all-reduce", "all_reduce", 4 / 3),
        ("all-gather", "all_gather_single|all_gather_into_tensor", 2 / 3),
        ("reduce-scatter", "reduce_scatter_single|reduce_scatter_tensor", 2 / 3),
    ):
        header = re.search(rf"^{name} \(({calls})\), 3 processes, gloo:\n.*\n((?:\s+\d+ [KM]iB .*\n)+)", out, re.M)
        assert header, out
        rows = [line.split() for line in header.group(2).splitlines()]
        assert [f"{r[0]} {r[1]}" for r in rows] == [
            "1 KiB",
            "4 KiB",
            "16 KiB",
            "64 KiB",
            "256 KiB",
            "1 MiB",
            "4 MiB",
            "16 MiB",
        ]
        for row in rows:
            seconds = float(row[2]) * {"us": 1e-6, "ms": 1e-3}[row[3]]
            algbw, busbw = float(row[-2]), float(row[-1])
            assert 0 < seconds < math.inf and math.isfinite(algbw) and math.isfinite(busbw)
            # nccl-tests' bus bandwidth; both printed to 3 decimals, so each carries up to 0.0005 of rounding
            assert busbw == pytest.approx(algbw * factor, abs=0.0005 * factor + 0.0005 + 1e-9)
        assert all(float(r[-1]) > 0 for r in rows[3:])  # 64 KiB and up: enough bytes to show
        tables[name] = max(float(r[-1]) for r in rows)
    verdict = re.search(
        r"^verdict: OK — results correct; peak bus bandwidth ([\d.]+) GB/s \(.*; all-gather ([\d.]+), "
        r"reduce-scatter ([\d.]+) GB/s\); small-message latency",
        out,
        re.M,
    )
    assert verdict, out
    for name, peak in zip(tables, verdict.groups()):
        assert float(peak) == pytest.approx(tables[name], abs=0.006)
    assert "deprecated" not in result.stderr  # torch's newest names for the calls


# --- report -------------------------------------------------------------------------------------


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_report_plots_what_the_run_logged(slow_rank_run, tmp_path):
    from dtrain.commands.report import build_figures, load_records, write_report

    run_dir, _ = slow_rank_run
    records = load_records(run_dir)
    figures = build_figures(records)
    train = [r for r in records if "loss" in r]
    loss_line = figures["loss"].axes[0].lines[0]
    assert list(loss_line.get_ydata()) == [r["loss"] for r in train]
    assert list(figures["throughput"].axes[0].lines[0].get_ydata()) == [r["samples_per_s"] for r in train]
    ranks = figures["ranks"].axes[0].lines
    assert [list(line.get_ydata()) for line in ranks] == [[r["rank_busy_ms"][k] for r in train] for k in range(2)]
    stacked = figures["step_time"].axes[0].collections  # data, compute, comm, optimizer
    assert len(stacked) == 4
    measured = [r for r in train if "param_bytes" in r]  # what each rank holds, once
    assert len(measured) == 1 and len(measured[0]["param_bytes"]) == 2
    held = measured[0]
    assert held["param_bytes"][0] == held["param_bytes"][1] > 0  # DDP: a whole replica on each rank
    assert held["grad_bytes"] == held["param_bytes"] == held["optimizer_bytes"]  # SGD: one momentum buffer each
    assert all(peak > params for peak, params in zip(held["peak_bytes"], held["param_bytes"]))
    bars = figures["memory"].axes[0].patches  # parameters of rank 0 and 1 first
    assert [b.get_height() for b in bars[:2]] == pytest.approx([b / 2**20 for b in held["param_bytes"]])

    out = write_report(run_dir)
    for name in ("loss", "throughput", "step_time", "ranks", "memory"):
        assert png_size(out / f"{name}.png")[0] > 200
    summary = (out / "summary.txt").read_text()
    assert "stragglers seen: rank 1 on" in summary and "communication share:" in summary
    assert "memory per rank (dp 2; the most any of 2 holds): parameters " in summary  # with the layout

    # Different data, different pictures.
    other = tmp_path / "other"
    other.mkdir()
    changed = [dict(r, loss=r["loss"] * 3) if "loss" in r else r for r in records]
    (other / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in changed))
    write_report(other)
    assert (other / "report" / "loss.png").read_bytes() != (out / "loss.png").read_bytes()
    assert (other / "report" / "ranks.png").read_bytes() == (out / "ranks.png").read_bytes()


def test_report_of_a_run_resumed_under_another_strategy_shares_each_phase_over_its_own_windows():
    """DDP windows carry comm_ms, FSDP windows do not: communication's share is taken over the windows that
    measured it and says how many; the other phases over all."""
    from dtrain.commands.report import summary

    def window(step, comm):
        record = {
            "step": step,
            "epoch": 0,
            "loss": 1.0,
            "samples_per_s": 100.0,
            "step_ms": 10.0,
            "data_ms": 1.0,
            "compute_ms": 7.0 - comm,
            "optimizer_ms": 2.0,
            "rank_busy_ms": [8.0, 8.0],
        }
        return {**record, "comm_ms": comm} if comm else record

    text = summary([window(5, 3.0), window(10, 2.0), window(15, 2.0), window(20, 0), window(25, 0)])
    assert "communication share: 20% of step time (in the 2 of 4 logged windows that measured it" in text
    assert "mean step: 10.00 ms — data 10%, compute 60%, comm 20%, optimizer 20%" in text
    assert "communication share: not measured" in summary([window(5, 0), window(10, 0)])


def test_report_says_a_pipeline_s_bubble(tmp_path):
    """pp_bubble, logged on every step line of a pipeline run, is said in the summary; a damaged value is
    left out, as any field of the wrong kind is."""
    from dtrain.commands.report import load_records, summary

    lines = [
        {"step": s, "epoch": 0, "loss": 1.0, "samples_per_s": 100.0, "pp_bubble": bubble}
        for s, bubble in ((1, 0.2), (2, 0.2), (3, "lots"))
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    text = summary(load_records(tmp_path))
    assert "pipeline bubble: 20% of each step (the schedule's idle share)" in text
    assert "pipeline bubble" not in summary(load_records(tmp_path)[2:])


def test_report_from_the_command_line(cli, slow_rank_run):
    run_dir, _ = slow_rank_run
    result = ok(cli("report", str(run_dir)))
    assert "final training loss" in result.stdout and "plots: loss.png, memory.png, ranks.png" in result.stdout
    missing = cli("report", str(run_dir / "nope"))
    assert missing.returncode == 2 and "metrics.jsonl does not exist" in missing.stderr


@pytest.mark.parametrize(
    "kind, problem",
    [
        ("file", "is not a folder (a file of yours?)"),
        ("link", "is not a folder (a link of yours?)"),
        ("link inside", "holds links: summary.txt (a folder of yours?)"),
    ],
)
def test_a_report_path_that_is_not_dtrains_folder_is_refused(cli, slow_rank_run, tmp_path, kind, problem):
    """Nothing is written through a link: not report/ itself, not a file in it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(slow_rank_run[0] / "metrics.jsonl", run_dir)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "victim.txt").write_text("mine")
    if kind == "file":
        (run_dir / "report").write_text("my notes")
    elif kind == "link":
        (run_dir / "report").symlink_to(elsewhere)
    else:
        (run_dir / "report").mkdir()
        (run_dir / "report" / "summary.txt").symlink_to(elsewhere / "victim.txt")
    result = cli("report", str(run_dir))
    assert result.returncode == 2 and [line for line in result.stderr.splitlines() if line.strip()] == [
        f"dtrain: error: {run_dir / 'report'} is where dtrain writes its report, and it {problem}; move it and "
        f"run dtrain report again"
    ], result.stderr
    assert [p.name for p in elsewhere.iterdir()] == ["victim.txt"] and (elsewhere / "victim.txt").read_text() == "mine"
    assert kind != "file" or (run_dir / "report").read_text() == "my notes"
