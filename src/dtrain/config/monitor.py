"""[monitor] and [profile]: what a run logs, where, and which steps it profiles."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dtrain.config.section import Section
from dtrain.config.settings import setting
from dtrain.errors import ConfigError


@dataclass(slots=True)
class MonitorConfig(Section):
    breakdown: bool = setting(
        True,
        "Split every step into data wait, forward+backward, gradient "
        "communication and optimizer (no host sync: CUDA events on GPUs) and "
        "compare ranks at each log step.",
    )
    straggler_margin: float = setting(
        0.25, "Name a rank whose busy time per step exceeds the median by this share.", above=0
    )
    peak_tflops: float = setting(0.0, "Peak TFLOP/s of one device for MFU (0: known GPUs only).", min=0)
    flops: Literal["auto", "yes", "no"] = setting(
        "auto",
        "Count model FLOPs per sample once with torch's FLOP counter (about 2 s at start-up): "
        "auto does it where MFU can be reported (a known GPU, or monitor.peak_tflops set).",
    )
    trackers: list[str] = setting(
        ["tensorboard"],
        "Where metrics go besides metrics.jsonl: tensorboard, mlflow "
        "(run.dir/mlruns unless MLFLOW_TRACKING_URI), wandb (run.dir/wandb; honours "
        "WANDB_MODE=offline). Rank 0 only; [] for none.",
    )
    debug: bool = setting(
        False,
        "torch's distributed debug mode: TORCH_DISTRIBUTED_DEBUG=DETAIL on nccl "
        "(every collective's shapes checked across ranks; slower; for finding "
        "desyncs), INFO on gloo (DETAIL crashes DDP on gloo in torch 2.13).",
    )

    def check(self) -> None:
        unknown = [t for t in self.trackers if t not in ("tensorboard", "mlflow", "wandb")]
        if unknown or len(set(self.trackers)) != len(self.trackers):
            raise ConfigError(
                f"monitor.trackers = {self.trackers}: each of tensorboard, mlflow, wandb at most once"
                + (f"; '{unknown[0]}' is none of them" if unknown else "")
            )


@dataclass(slots=True)
class ProfileConfig(Section):
    steps: str = setting(
        "",
        'Optimizer steps to trace with torch.profiler, e.g. "20-25"; one trace '
        "per rank under run.dir/profile (Perfetto, TensorBoard). Empty: off.",
    )

    def check(self) -> None:
        if self.steps and profile_range(self.steps) is None:
            raise ConfigError(
                f"profile.steps = '{self.steps}' is not a step range; write it like "
                f'"20-25" (first and last optimizer step, from 1)'
            )


def profile_range(text: str) -> tuple[int, int] | None:
    """'20-25' -> (20, 25); '7' -> (7, 7); None when malformed."""
    first, _, last = text.strip().partition("-")
    last = last or first
    if not (first.strip().isdigit() and last.strip().isdigit()):
        return None
    a, b = int(first), int(last)
    return (a, b) if 1 <= a <= b < 2**63 else None
