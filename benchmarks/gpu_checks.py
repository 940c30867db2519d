"""The in-process GPU checks of benchmarks/gpu_check.sh, one per command, each printing one line:
"ok <detail>" or "FAIL <detail>".

    python benchmarks/gpu_checks.py tf32|fp16_skips|resume|nccl_flight_recorder WORK_DIR
"""

from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import dtrain
import dtrain.train.optim
import dtrain.train.trainer
from dtrain.observe import perf
from dtrain.train.amp import Precision, precision_for

# The GPU; the CPU only to smoke-test this file where there is none (the expectations are a GPU's).
DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def data(n: int = 512) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    return TensorDataset(x, x[:, :3].argmax(1))


def trainer(run_dir: Path, optimizer: str, dropout: float = 0.0, **training) -> dtrain.Trainer:
    from faults import dying_mlp  # tests/workers: an MLP with dropout

    torch.manual_seed(0)
    config = dtrain.Config.from_dict(
        {
            "run": {"dir": str(run_dir)},
            "data": {"batch_size": 32},
            "optimizer": {"name": optimizer, "lr": 1e-3 if optimizer == "adamw" else 0.05},
            "scheduler": {"name": "linear", "warmup_steps": 8},
            "training": {
                "epochs": 2,
                "precision": "fp16" if DEVICE.type == "cuda" else "bf16",
                "log_every": 4,
                "max_grad_norm": 1.0,
                **training,
            },
        }
    )
    return dtrain.Trainer(config, model=dying_mlp((32,), 3, dropout=dropout), train_data=data())


def tf32(work: Path) -> str:
    precision_for("fp32", DEVICE, tf32=True)
    on = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    precision_for("fp32", DEVICE, tf32=False)
    off = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    peak = perf.peak_tflops_of(torch.cuda.get_device_name(0), "fp32", True)
    good = on == ("high", True) and off == ("highest", False)
    return f"{'ok' if good else 'FAIL'} tf32 on {on}, off {off}; fp32 (TF32) peak {peak} TFLOP/s"


def fp16_skips(work: Path) -> str:
    """A loss scale of 2^30 overflows the first steps, as 2^16 does on large models: every one is
    counted, left out of the norm, taken out of the schedule, and fused AdamW / plain SGD stay sane."""
    dtrain.train.trainer.precision_for = lambda name, device, tf32=True: Precision(
        "fp16",
        functools.partial(torch.autocast, device_type=DEVICE.type, dtype=torch.float16),
        torch.amp.GradScaler(DEVICE.type, init_scale=2.0**30),
    )
    parts, good = [], True
    for optimizer in ("adamw", "sgd"):
        t = trainer(work / f"skips-{optimizer}", optimizer)
        t.fit()
        records = map(json.loads, (work / f"skips-{optimizer}" / "metrics.jsonl").read_text().splitlines())
        lines = [m for m in records if "loss" in m]
        skipped = sum(m["skipped_steps"] for m in lines)
        finite = all(math.isfinite(m["grad_norm"]) for m in lines if "grad_norm" in m)
        params = all(torch.isfinite(p).all() for p in t.module.parameters())
        schedule = t.scheduler.last_epoch == t.total_steps - skipped
        fused = t.optimizer.defaults.get("fused")
        good &= skipped >= 3 and finite and params and schedule and lines[-1]["loss"] < lines[0]["loss"]
        parts.append(
            f"{optimizer} (fused {fused}): {skipped} skipped, norms finite {finite}, weights "
            f"finite {params}, schedule at applied steps {schedule}"
        )
    return f"{'ok' if good else 'FAIL'} " + "; ".join(parts)


def resume(work: Path) -> str:
    """Bitwise resume with dropout (the CUDA RNG of the bound device), fused and unfused AdamW; the
    optimizer's step stays where torch keeps it (on the GPU for fused, on the CPU otherwise)."""
    parts, good = [], True
    fused_options = dtrain.train.optim.implementation_options
    for fused in (True, False):
        dtrain.train.optim.implementation_options = fused_options if fused else (lambda name, device: {})
        whole = trainer(work / f"whole-{fused}", "adamw", dropout=0.3)
        whole.fit()
        trainer(work / f"split-{fused}", "adamw", dropout=0.3, stop_at_step=9).fit()
        resumed = trainer(work / f"split-{fused}", "adamw", dropout=0.3)
        resumed.fit()
        same = all(torch.equal(a, b) for a, b in zip(whole.module.parameters(), resumed.module.parameters()))
        where = {s["step"].device.type for s in resumed.optimizer.state.values()}
        expected = {"cuda"} if fused else {"cpu"}
        good &= same and where == expected
        parts.append(f"fused {fused}: bitwise {same}, step on {sorted(where)}")
    dtrain.train.optim.implementation_options = fused_options
    return f"{'ok' if good else 'FAIL'} " + "; ".join(parts)


def nccl_flight_recorder(work: Path) -> str:
    """A one-process nccl group: what dtrain's hang dump writes holds nccl's own collectives."""
    import pickle

    import torch.distributed as dist

    from dtrain.distributed import enable_flight_recorder
    from dtrain.observe.watchdog import dump_flight_recorder

    enable_flight_recorder(None)
    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=DEVICE)
    t = torch.ones(1024, device=DEVICE)
    for _ in range(3):
        dist.all_reduce(t)
    torch.cuda.synchronize()
    path = work / "flight-recorder-nccl"
    written = dump_flight_recorder(path, dist.get_backend())
    dist.destroy_process_group()
    if not written:
        return "FAIL nothing dumped"
    names = [entry["profiling_name"] for entry in pickle.loads(path.read_bytes())["entries"]]
    good = any(name.startswith("nccl:all_reduce") for name in names)
    return f"{'ok' if good else 'FAIL'} {len(names)} entries: {sorted(set(names))}"


if __name__ == "__main__":
    name, work = sys.argv[1], Path(sys.argv[2])
    work.mkdir(parents=True, exist_ok=True)
    print(globals()[name](work))
