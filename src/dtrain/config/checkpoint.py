"""[checkpoint]: when a run checkpoints, how many it keeps, what it resumes from, what it exports."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dtrain.config.section import Section, local_only
from dtrain.config.settings import A_YEAR, setting
from dtrain.errors import ConfigError


@dataclass(slots=True)
class CheckpointConfig(Section):
    every_steps: int = setting(
        0,
        "Write a checkpoint every this many optimizer steps (0: only at the end, see at_end, on SIGTERM or "
        "Ctrl-C, and at training.stop_at_step).",
        min=0,
    )
    at_end: bool = setting(
        True,
        "Write a checkpoint at the end of the run, so that the same command again says it is complete and more "
        "training.epochs (or a higher max_steps within them) train on from there. false: no end-of-run checkpoint "
        "unless every_steps, every_epochs or a resume asked for checkpoints; the rerun still says complete, and "
        "training on is refused (start from its weights with model.init_from).",
    )
    keep: int = setting(3, "Complete checkpoints kept; older ones are deleted (never the newest).", min=1)
    every_epochs: int = setting(
        0,
        "Also write a checkpoint at the end of every this many epochs (0: off), before that epoch's evaluation.",
        min=0,
    )
    keep_best: str = setting(
        "",
        'Keep the checkpoint with the best eval metric besides the newest checkpoint.keep: "eval_loss" (lowest; '
        'also "eval_loss:min") or "eval_accuracy:max" (highest), any eval_ metric; a checkpoint counts when an '
        "evaluation runs at its step. Empty: off.",
    )
    resume: Literal["auto", "yes", "no"] = setting(
        "auto",
        "auto: continue from the newest complete checkpoint in run.dir if there is one; yes: "
        "must (what --resume sets); no: start fresh, refusing a run.dir that holds checkpoints.",
    )
    resume_from: str = setting(
        "",
        "Start from this checkpoint (a step-N folder, or a run.dir: its newest) of this or another run, read where "
        "it is, never copied or changed (what --resume-from sets); run.dir's own newer checkpoints win on a rerun.",
    )
    # The TOML key `async` is a Python keyword: the field carries PEP 8's trailing underscore (key_name).
    async_: bool = setting(
        False,
        "Write checkpoints in the background: the state is copied to host memory (pinned on a GPU) "
        "within the step, then written while training goes on, and sealed once every rank's write "
        "completed. Holds one host copy of the state. Off by default until measured on a GPU.",
    )
    preempt_grace_s: float = setting(
        120.0,
        "Seconds workers get after SIGTERM to finish the step and write their checkpoint before torchrun kills them.",
        above=0,
        max=A_YEAR,
    )
    export: Literal["none", "hf"] = setting(
        "none",
        "hf: at the end of the run also write the final weights as a Hugging Face model folder, run.dir/hf "
        "(config.json, safetensors, tokenizer), as `dtrain export RUN_DIR --format hf` does.",
    )

    def check(self) -> None:
        local_only("checkpoint.resume_from", self.resume_from, "the checkpoint")
        if self.keep_best and best_rule(self.keep_best) is None:
            raise ConfigError(
                f"checkpoint.keep_best = '{self.keep_best}' is not a metric and a direction; write an eval metric "
                f'and min or max, like "eval_loss" (lowest) or "eval_accuracy:max" (highest)'
            )


def best_rule(spec: str) -> tuple[str, str] | None:
    """checkpoint.keep_best: 'eval_loss' -> ('eval_loss', 'min'); 'eval_accuracy:max' -> ('eval_accuracy',
    'max'); None when malformed."""
    name, _, mode = spec.strip().partition(":")
    mode = mode or "min"
    if not name.startswith("eval_") or mode not in ("min", "max"):
        return None
    return name, mode
