"""[training]: the step — epochs or steps, batch and accumulation, precision, compile, clipping, LoRA."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from dtrain.config.section import Section
from dtrain.config.settings import setting
from dtrain.errors import ConfigError


@dataclass(slots=True)
class TrainingConfig(Section):
    epochs: int = setting(10, "Passes over the training set.", min=1)
    max_steps: int = setting(
        0, "Stop after this many optimizer steps (0: no limit; an iterable data set's run length, required).", min=0
    )
    grad_accum_steps: int = setting(
        1, "Micro-batches per optimizer step; all but the last skip the gradient all-reduce.", min=1
    )
    device: Literal["auto", "cpu", "cuda"] = setting(
        "auto",
        "auto: one GPU per process where CUDA sees GPUs, else the CPU; cpu: the CPU even on a GPU "
        "machine (gloo, GPUs hidden from the workers); cuda: refuse to start without GPUs.",
    )
    global_batch_size: int = setting(
        0,
        "Samples per optimizer step over all processes, as nanoGPT states its batch (0: off): "
        "training.grad_accum_steps becomes global_batch_size / (data.batch_size × processes).",
        min=0,
    )
    precision: Literal["fp32", "bf16", "fp16"] = setting(
        "fp32", "fp32, bf16 autocast (CPU or CUDA) or fp16 autocast with GradScaler (CUDA)."
    )
    tf32: bool = setting(
        True,
        "On GPUs with TF32 tensor cores (Ampere and newer), run fp32 matmuls "
        "in TF32 (torch.set_float32_matmul_precision('high')); false: full FP32.",
    )
    max_grad_norm: float = setting(0.0, "Clip gradients to this global norm and log the norm (0: no clipping).", min=0)
    log_every: int = setting(
        10, "Optimizer steps between logged lines; losses are read from the device only then.", min=1
    )
    eval_every: int = setting(1, "Epochs between evaluations (the last epoch always evaluates; 0: only then).", min=0)
    eval_every_steps: int = setting(
        0, "Also evaluate every this many optimizer steps (0: off); the end of the run always evaluates.", min=0
    )
    eval_batches: int = setting(
        0,
        "Evaluate at most eval_batches × data.eval_batch_size samples in all (0: the whole split), shared by the "
        "processes: the same samples every time (drawn once with run.seed) whatever the number of processes.",
        min=0,
    )
    eval_metrics: str = setting(
        "",
        "More eval metrics, named 'package.module:name' (for a run described by its config; in code, "
        "Trainer(eval_metrics=...)): a function fn(output, batch) returning per-batch means, or "
        "dtrain.whole_split(fn) for fn(predictions, targets) of the whole split (F1, AUC). Empty: loss, "
        "accuracy and perplexity only.",
    )
    activation_checkpointing: Literal["none", "full", "selective"] = setting(
        "none",
        "Recompute activations in backward instead of keeping them, block by block: full keeps only "
        "each block's input; selective also keeps matmul and attention outputs (less memory than none, less "
        "recomputation than full).",
    )
    compile: Literal["none", "blocks", "model"] = setting(
        "none",
        "torch.compile: blocks compiles each block (fast to compile; true means this), model the "
        "whole forward. The first step, which compiles, is reported on its own line and left out of "
        "throughput.",
        booleans=("none", "blocks"),
    )
    stop_at_step: int = setting(
        0,
        "End this run after this optimizer step with a checkpoint, keeping "
        "the schedule of the whole run; a later resume continues (0: off).",
        min=0,
    )
    lora: dict = setting(
        {},
        "LoRA fine-tuning through Hugging Face peft: {r, alpha, dropout, target_modules}; the base model's "
        "parameters frozen (sharded under fsdp), only the adapters trained, optimized and checkpointed "
        "(empty: off). Defaults: alpha = 2 r, dropout 0, target_modules per model (gpt: attention and MLP "
        "projections; a transformers model: peft's own for its type, else every nn.Linear but the output head).",
    )

    def check(self) -> None:
        check_lora(self.lora)


LORA_KEYS: dict[str, Any] = {"r": int, "alpha": (int, float), "dropout": (int, float), "target_modules": list}


def check_lora(lora: dict) -> None:
    """training.lora's own keys and values (whether its target_modules match the model, a worker sees)."""
    if not lora:
        return
    unknown = sorted(set(lora) - set(LORA_KEYS))
    if unknown:
        raise ConfigError(
            f"training.lora.{unknown[0]} is not a LoRA setting; give r, alpha, dropout, target_modules, "
            f"e.g. training.lora={{r = 8, alpha = 16}}"
        )
    if "r" not in lora:
        raise ConfigError("training.lora needs r, the adapters' rank (a whole number > 0), e.g. training.lora={r = 8}")
    for key, kind in LORA_KEYS.items():
        value = lora.get(key)
        if key in lora and (isinstance(value, bool) or not isinstance(value, kind)):
            raise ConfigError(f"training.lora.{key} = {value!r} is not {_LORA_WHAT[key]}")
    if lora["r"] <= 0:
        raise ConfigError(f"training.lora.r = {lora['r']} must be a whole number > 0 (the adapters' rank), e.g. 8")
    if "alpha" in lora and not (math.isfinite(lora["alpha"]) and lora["alpha"] > 0):
        raise ConfigError(f"training.lora.alpha = {lora['alpha']} must be a number > 0 (scaling alpha / r), e.g. 16")
    if "dropout" in lora and not 0 <= lora["dropout"] < 1:
        raise ConfigError(f"training.lora.dropout = {lora['dropout']} must be at least 0 and below 1, e.g. 0.05")
    modules = lora.get("target_modules", ["x"])
    if not modules or not all(isinstance(m, str) and m for m in modules):
        raise ConfigError(
            f'training.lora.target_modules = {modules!r} must be a list of module names, e.g. ["c_attn", "c_proj"]'
        )


_LORA_WHAT = {
    "r": "a whole number > 0",
    "alpha": "a number > 0",
    "dropout": "a number in [0, 1)",
    "target_modules": "a list of module names",
}
