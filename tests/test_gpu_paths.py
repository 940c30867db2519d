"""The CUDA and nccl paths, proven on the CPU wherever their logic stands apart from the device: GPU
binding with a faked device count, the launcher's checks, peak FLOP/s per exact GPU name, error
translation, fp16 step skipping with a real (CPU) GradScaler and fused AdamW, optimizer and RNG state
on resume, the debug level. What needs a real GPU (TF32, the CUDA RNG, where AdamW keeps its step,
nccl's flight recorder, the launcher holding no CUDA context) is run by benchmarks/gpu_check.sh."""

import functools
import os
import random
import socket

import numpy as np
import pytest
import tiny
import torch
import torch.distributed as dist

import dtrain
import dtrain.train.optim
import dtrain.train.trainer  # the module whose precision_for the fp16 fixture replaces
from dtrain import distributed
from dtrain.checkpoint import tensors as checkpoint_tensors
from dtrain.config import DistributedConfig
from dtrain.distributed import DistEnv
from dtrain.errors import ConfigError, DtrainError, EnvironmentProblem
from dtrain.launch import gpus as devices
from dtrain.launch.preflight import preflight
from dtrain.observe import perf
from dtrain.train.amp import Precision, precision_problem
from dtrain.train.optim import implementation_options
from helpers import train_lines


@pytest.fixture
def own_environ():
    """What distributed.start sets in the environment does not leak out of the test."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def gpus(monkeypatch):
    """A machine that reports `n` CUDA GPUs (torch's device queries faked; nothing else is)."""
    bound = []

    def fake(n: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", bound.append)
        return bound

    return fake


# --- 1: capacity in the launcher only; a worker binds the GPU it sees -----------------------------


def test_a_worker_given_one_gpu_binds_it_whatever_its_local_rank(gpus, own_environ, monkeypatch):
    """srun --gpus-per-task=1: local rank 3 of 4 sees one GPU. It must train on it, not refuse."""
    bound = gpus(1)
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(kw))
    with socket.socket() as rank0_store:  # what start waits for first: something listening for rank 0
        rank0_store.bind(("127.0.0.1", 0))
        rank0_store.listen()
        environ = {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "3",
            "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(rank0_store.getsockname()[1]),
        }
        session = distributed.start(DistributedConfig(), environ)
    assert (session.backend, session.device) == ("nccl", torch.device("cuda", 0))
    assert bound == [torch.device("cuda", 0)]
    assert calls[0]["backend"] == "nccl" and calls[0]["device_id"] == torch.device("cuda", 0)


def test_a_worker_that_sees_every_gpu_binds_its_own(gpus):
    bound = gpus(4)
    assert distributed.bind_device(DistEnv(rank=2, world_size=4, local_rank=2, local_world_size=4)) == torch.device(
        "cuda", 2
    )
    assert bound == [torch.device("cuda", 2)]
    assert distributed.device_index(5, 4) == 1  # 8 processes on a 4-GPU node share them in turn
    with pytest.raises(EnvironmentProblem, match="sees no GPU"):
        distributed.device_index(0, 0)


def test_the_launcher_refuses_more_nccl_processes_than_gpus(gpus, monkeypatch, tmp_path):
    gpus(1)
    monkeypatch.setattr(devices, "visible_gpus", lambda: [devices.Gpu("NVIDIA A100-SXM4-80GB", (8, 0))])
    config = dtrain.Config.from_dict({"run": {"dir": str(tmp_path / "run")}})
    with pytest.raises(ConfigError, match=r"--nproc 2 asks for more nccl processes than this machine's 1 GPU"):
        preflight(config, world_size=2, local_world_size=2)
    preflight(config, world_size=1, local_world_size=1)  # one process per GPU is fine
    gloo = dtrain.Config.from_dict({"run": {"dir": str(tmp_path / "run")}, "distributed": {"backend": "gloo"}})
    preflight(gloo, world_size=2, local_world_size=2)  # gloo may share a GPU


def test_the_launcher_asks_a_child_process_about_gpus(monkeypatch):
    """The GPU names come from a child process (a real one: here it finds no GPU and says so)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert devices.visible_gpus() == []
    monkeypatch.setattr(devices, "_PROBE", "import sys; sys.exit('no CUDA driver found')")
    with pytest.raises(EnvironmentProblem, match=r"a process could not use it \(no CUDA driver found\)"):
        devices.visible_gpus()


# --- 7: bf16 only where it is native ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name, capability, refused",
    [
        ("Tesla V100-SXM2-16GB", (7, 0), True),
        ("Tesla T4", (7, 5), True),
        ("NVIDIA A100-SXM4-80GB", (8, 0), False),
        ("NVIDIA H200", (9, 0), False),
    ],
)
def test_bf16_is_refused_where_the_gpu_only_emulates_it(name, capability, refused):
    problem = precision_problem("bf16", "cuda", name, capability)
    if refused:
        assert problem.startswith(f"training.precision = 'bf16' is only emulated on {name}")
        assert "use training.precision=fp16 or fp32" in problem
    else:
        assert problem is None
    assert precision_problem("bf16", "cuda", name, capability, rocm=True) is None  # ROCm GPUs have it
    assert precision_problem("fp16", "cuda", name, capability) is None


def test_the_launcher_refuses_bf16_on_an_emulating_gpu_before_starting_workers(gpus, monkeypatch, tmp_path):
    gpus(2)
    monkeypatch.setattr(devices, "visible_gpus", lambda: [devices.Gpu("Tesla T4", (7, 5))] * 2)
    config = dtrain.Config.from_dict({"run": {"dir": str(tmp_path)}, "training": {"precision": "bf16"}})
    with pytest.raises(ConfigError, match="'bf16' is only emulated on Tesla T4"):
        preflight(config, world_size=2, local_world_size=2)


# --- 4: peak FLOP/s per exact device name, and for the math fp32 really uses ----------------------


@pytest.mark.parametrize(
    "name, precision, tf32, tflops",
    [
        ("NVIDIA L40", "bf16", True, 181.0),  # not the L4's 121 (a substring match gave that)
        ("NVIDIA L4", "bf16", True, 121.0),
        ("NVIDIA L40S", "bf16", True, 362.1),
        ("NVIDIA H100 PCIe", "bf16", True, 756.5),  # not the SXM's 989
        ("NVIDIA H100 NVL", "bf16", True, 835.5),
        ("NVIDIA H100 80GB HBM3", "bf16", True, 989.4),
        ("NVIDIA H100 80GB HBM3", "fp32", True, 494.7),  # TF32 tensor cores
        ("NVIDIA H100 80GB HBM3", "fp32", False, 66.9),  # true FP32
        ("NVIDIA A100-SXM4-40GB", "fp32", True, 156.0),
        ("Tesla V100-SXM2-16GB", "fp32", True, 15.7),  # no TF32 on Volta: FP32 either way
        ("Tesla T4", "fp16", True, 65.0),
        ("NVIDIA GeForce RTX 4090", "fp16", True, 165.2),
    ],
)
def test_peak_flops_match_the_exact_gpu_variant_and_math(name, precision, tf32, tflops):
    assert perf.peak_tflops_of(name, precision, tf32) == tflops


def test_an_unknown_gpu_gets_no_peak_unless_the_user_gives_one():
    assert perf.peak_tflops_of("NVIDIA H1000 Experimental", "bf16", True) is None
    assert perf.peak_tflops_of("H100", "bf16", True) is None  # a fragment is not a device name
    assert perf.peak_flops(torch.device("cpu"), "fp32", 2.5) == 2.5e12


# --- 6: fused AdamW on CUDA; the optimizer's implementation is the run's, not the checkpoint's -----


def test_adamw_is_fused_on_cuda_and_sgd_never():
    assert implementation_options(torch.optim.AdamW, torch.device("cuda", 0)) == {"fused": True}
    # torch's fused SGD fills momentum with uninitialised memory on a step GradScaler skips
    assert implementation_options(torch.optim.SGD, torch.device("cuda", 0)) == {}
    assert implementation_options(torch.optim.AdamW, torch.device("cpu")) == {}


FP16_JOB = {
    "data": {"batch_size": 8},
    "optimizer": {"name": "adamw", "lr": 0.01},
    "scheduler": {"name": "linear", "warmup_steps": 6},
    "training": {"epochs": 2, "log_every": 4, "max_grad_norm": 1.0},
}


def data(n=96, seed=0):
    return tiny.points(n, 8, seed, lambda x: (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def model(seed=0):
    return tiny.seeded(
        lambda: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)), seed
    )


def config(run_dir, **training):
    return tiny.job_config(run_dir, FP16_JOB, **training)


@pytest.fixture
def fused(monkeypatch):
    """AdamW fused as on CUDA (torch 2.13 has the fused kernel on the CPU too)."""

    def use(on: bool):
        monkeypatch.setattr(dtrain.train.optim, "implementation_options", lambda cls, device: {"fused": on})

    return use


# --- 5: fp16 — skipped steps are counted, norms stay finite, the schedule follows the optimizer ----


@pytest.fixture
def fp16_on_cpu(monkeypatch):
    """fp16 autocast and a real GradScaler on the CPU, starting at a loss scale so large that the
    first steps overflow and are skipped, as they are on GPUs at the default 2^16."""

    def cpu_fp16(name, device, tf32=True):
        return Precision(
            "fp16",
            functools.partial(torch.autocast, device_type="cpu", dtype=torch.float16),
            torch.amp.GradScaler("cpu", init_scale=2.0**30),
        )

    monkeypatch.setattr(dtrain.train.trainer, "precision_for", cpu_fp16)


@pytest.mark.parametrize("fused_adamw", [False, True], ids=["skipped on the host", "skipped in the kernel"])
def test_skipped_fp16_steps_are_counted_and_leave_norms_and_schedule_true(fp16_on_cpu, fused, tmp_path, fused_adamw):
    fused(fused_adamw)
    trainer = dtrain.Trainer(config(tmp_path), model=model(), train_data=data())
    trainer.fit()
    assert trainer.optimizer.defaults["fused"] is fused_adamw
    lines = train_lines(tmp_path)
    skipped = sum(m["skipped_steps"] for m in lines)
    assert skipped >= 3  # 2^30 overflows fp16 gradients; the scaler halves until they fit
    for m in lines:  # a norm from applied steps only; none at all for a window of skips only
        assert np.isfinite(m["grad_norm"]) if m["skipped_steps"] < 4 else "grad_norm" not in m
    applied = trainer.total_steps - skipped
    optimizer_steps = {int(s["step"].item()) for s in trainer.optimizer.state.values()}
    assert optimizer_steps == {applied}  # what the optimizer really did...
    assert trainer.scheduler.last_epoch == applied  # ...is where the schedule stands
    assert all(torch.isfinite(p).all() for p in trainer.module.parameters())


@pytest.mark.parametrize("fused_adamw", [False, True], ids=["skipped on the host", "skipped in the kernel"])
def test_a_resume_between_log_steps_takes_skips_back_as_the_unbroken_run_does(
    fp16_on_cpu, fused, tmp_path, fused_adamw
):
    fused(fused_adamw)
    whole = dtrain.Trainer(config(tmp_path / "whole"), model=model(), train_data=data())
    whole.fit()
    # Stop at step 3: skips of steps 1-3 are not yet taken out of the schedule (that happens at step 4).
    # Every step so far was skipped: the optimizer has no state yet, and saving must not give it one.
    dtrain.Trainer(config(tmp_path / "split", stop_at_step=3), model=model(), train_data=data()).fit()
    resumed = dtrain.Trainer(config(tmp_path / "split"), model=model(5), train_data=data())
    resumed.fit()
    assert resumed.scheduler.last_epoch == whole.scheduler.last_epoch
    for a, b in zip(whole.module.parameters(), resumed.module.parameters()):
        assert torch.equal(a, b)


def test_a_checkpoint_from_an_unfused_optimizer_resumes_into_a_fused_one(fp16_on_cpu, fused, tmp_path):
    """A checkpoint written on a CPU (or before AdamW was fused) resumed on a GPU: the run's fused
    AdamW stays fused, and GradScaler's hand-off to it works."""
    fused(False)
    dtrain.Trainer(config(tmp_path, stop_at_step=18), model=model(), train_data=data()).fit()
    fused(True)
    resumed = dtrain.Trainer(config(tmp_path), model=model(1), train_data=data())
    resumed.fit()
    assert resumed.step == resumed.total_steps == 24
    assert all(group["fused"] for group in resumed.optimizer.param_groups)


# --- 3: only DDP's own "different model" failure is translated -------------------------------------


def wrap_with(monkeypatch, tmp_path, error):
    """parallel.ddp's wrap, with torch's DistributedDataParallel failing as `error`."""
    from dtrain.config import DDPConfig
    from dtrain.parallel import ddp

    def failing_ddp(*args, **kwargs):
        raise error

    monkeypatch.setattr(ddp, "DistributedDataParallel", failing_ddp)
    strategy = ddp.DDP.__new__(ddp.DDP)  # only what _wrap reads: no process group needed
    strategy.module, strategy.options = model(), DDPConfig()
    strategy.session = distributed.Session(DistEnv(), "gloo", torch.device("cpu"), owns_group=False)
    return strategy._wrap


def test_ddp_wrap_translates_only_a_model_mismatch(monkeypatch, tmp_path):
    mismatch = RuntimeError(
        "DDP expects same model across all ranks, but Rank 0 has 4 params, while rank 1 has inconsistent 6 params."
    )
    with pytest.raises(DtrainError, match="the model differs between ranks"):
        wrap_with(monkeypatch, tmp_path, mismatch)()
    transport = dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp, unhandled system error")
    with pytest.raises(dist.DistBackendError):
        wrap_with(monkeypatch, tmp_path, transport)()
    oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(torch.cuda.OutOfMemoryError):
        wrap_with(monkeypatch, tmp_path, oom)()


class OutOfMemoryOnTheDevice(torch.nn.Linear):
    """A model whose copy to the training device runs out of memory, as a too-large one does."""

    def _apply(self, fn, *args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


def test_out_of_memory_while_setting_up_gets_the_same_advice(tmp_path):
    trainer = dtrain.Trainer(config(tmp_path / "run"), model=OutOfMemoryOnTheDevice(8, 3), train_data=data())
    with pytest.raises(DtrainError) as caught:
        trainer.fit()
    message = str(caught.value)
    assert message.startswith("out of GPU memory while setting up")
    assert "try data.batch_size=4 training.grad_accum_steps=2 (the same effective batch)" in message
    assert not (tmp_path / "run").exists()  # nothing half-written


SPLITS = [  # the GPT has a tensor-parallel plan and blocks to stage
    "parallel.tp_size=2 (each layer's weights split over 2 processes of a node)",
    "parallel.pp_size=2 (the model's blocks split into 2 pipeline stages)",
]


@pytest.mark.parametrize(
    "strategy, offload, levers",
    [
        (
            "ddp",
            False,
            [
                "parallel.strategy=fsdp (parameters, gradients and optimizer state sharded)",
                "training.activation_checkpointing=full",
                *SPLITS,
            ],
        ),
        ("fsdp", False, ["training.activation_checkpointing=full", "parallel.fsdp_cpu_offload=true", *SPLITS]),
        ("fsdp", True, ["training.activation_checkpointing=full", *SPLITS]),
    ],
)
def test_a_gpu_out_of_memory_names_the_memory_levers_that_are_off(tmp_path, strategy, offload, levers):
    """On 2 GPUs with a model of blocks: sharding, activation checkpointing and offload, each only when off."""
    from types import SimpleNamespace

    from dtrain.models.gpt import GPT
    from dtrain.train import advice

    cfg = dtrain.Config.from_dict(
        {
            "run": {"dir": str(tmp_path)},
            "training": {"precision": "bf16"},
            "parallel": {"strategy": strategy, "fsdp_cpu_offload": offload},
        }
    )
    module = GPT(16, block_size=8, n_layer=2, n_head=2, n_embd=8)
    gpus = SimpleNamespace(world_size=2, rank=1, device=torch.device("cuda", 1))
    oom = torch.cuda.OutOfMemoryError("CUDA out of memory")
    message = str(advice.out_of_memory("at step 3", oom, cfg, module, gpus, cfg.training.grad_accum_steps))
    assert message.startswith("out of GPU memory at step 3 on rank 1 with data.batch_size=64 per process")
    offered = message.split("; try ", 1)[1].split(" or ")
    assert offered == [
        "data.batch_size=32 training.grad_accum_steps=2 (the same effective batch)",
        "data.on_device=false",
        *levers,
    ]


# --- 8: RNG states ---------------------------------------------------------------------------------


def test_torch_numpy_and_python_rng_states_round_trip(tmp_path):
    path = tmp_path / "rng.safetensors"
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    checkpoint_tensors._save_rng(path, torch.device("cpu"))
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    checkpoint_tensors._load_rng(path, torch.device("cpu"))
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1])
    assert expected[2] == again[2]
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        assert set(fh.keys()) == {"torch", "numpy_keys", "python_state"}  # no GPU here: no CUDA state


# --- 9: monitor.debug really sets torch's debug level ----------------------------------------------


def test_monitor_debug_sets_the_distributed_debug_level(own_environ):
    before = dist.get_debug_level()
    try:
        distributed.start(DistributedConfig(backend="gloo"), {}, debug=True)
        assert dist.get_debug_level() == dist.DebugLevel.INFO  # DETAIL kills DDP on gloo (torch 2.13)
        assert distributed.set_debug_level(True, "nccl") == "DETAIL"
        assert dist.get_debug_level() == dist.DebugLevel.DETAIL
    finally:
        dist.set_debug_level(before)


# --- 2: the flight recorder's variables ------------------------------------------------------------


def test_the_flight_recorder_is_on_and_the_users_own_setting_wins(own_environ, tmp_path):
    names = (
        "TORCH_FR_BUFFER_SIZE",
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "TORCH_FR_DUMP_TEMP_FILE",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    )
    for name in names:
        os.environ.pop(name, None)
    distributed.enable_flight_recorder(tmp_path / "diagnostics")
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "2000"  # torch 2.13 names; the old ones warn
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "diagnostics" / "flight-recorder-rank-")
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ
    assert (tmp_path / "diagnostics").is_dir()
    for name in names:
        os.environ.pop(name, None)
    os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] = "500"  # the user's own, under the old name
    distributed.enable_flight_recorder(None)
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ and os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "500"
