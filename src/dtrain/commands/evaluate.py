"""`dtrain eval RUN_DIR [--step N] [--out FILE] [section.key=value ...]`: a checkpoint's eval metrics, without
training.

The run is rebuilt from its own config.toml (with the overrides given: another data.path, a
training.eval_batches cap), its model built as the worker builds it, spread by the same strategy over
however many processes this command runs on, and the chosen checkpoint's model part read into it (DCP
reshards: a checkpoint written by FSDP at 2 processes loads at 1 or 3). The evaluation is the run's own
(train.evaluation.Evaluator): the same batches, precision and reductions, so at the run's world size it
gives the numbers the run logged for that step to the last bit.

Only reads: the run's lease is never taken and nothing is written into run.dir (the metrics are printed,
and written as JSON only to an `--out` file outside it), so a run still training goes on undisturbed and
a run.dir URL is read through a local copy (rundir.reading), as `dtrain generate` reads one.

Only runs a config describes can be rebuilt: a run whose model and data were given in code to
dtrain.Trainer (its config.toml says so) is refused in one line.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.config import Config
from dtrain.errors import DtrainError
from dtrain.parallel.options import StrategyOptions
from dtrain.rundir import given_in_code

FINAL = "final"  # the run's final weights (model.safetensors), where it holds no complete checkpoint


@dataclass(frozen=True)
class Choice:
    """The weights to evaluate: checkpoint step-N (`step`), or the final weights (step None)."""

    step: int | None
    path: Path  # the step-N folder, or model.safetensors

    def said(self) -> str:
        return f"checkpoint step-{self.step}" if self.step is not None else "final weights"


def config_of(run_dir: Path, shown: str) -> Path:
    """run.dir's config.toml, or a one-line refusal: not a run.dir, or a run whose model was given in code."""
    config_file = run_dir / "config.toml"
    if not config_file.is_file():
        raise DtrainError(f"{shown} holds no config.toml: RUN_DIR must be the run.dir of a dtrain run")
    if given_in_code(config_file):
        raise DtrainError(
            f"{shown} was trained by a script that gave dtrain.Trainer its model and data in code, which "
            f"config.toml cannot rebuild; dtrain eval evaluates runs of `dtrain run CONFIG` only — in that "
            f"script, load the checkpoint's weights and call trainer.evaluate()"
        )
    from dtrain.config import read_config

    if read_config(str(config_file))[0].training.lora:
        raise DtrainError(
            f"{shown} trained LoRA adapters (training.lora), which dtrain eval does not evaluate yet; export "
            f"them merged into the base (dtrain export {shown} --format hf --merged --out DIR) and load DIR "
            f"with from_pretrained"
        )
    return config_file


def choose(run_dir: Path, step: int | None, shown: str) -> Choice:
    """Checkpoint step-`step`, else the newest complete one, else the final weights; a one-line refusal
    naming the complete steps where `step` is not one of them."""
    from dtrain.checkpoint.store import CheckpointStore

    complete = CheckpointStore(run_dir).complete()
    if step is not None:
        found = [c for c in complete if c.step == step]
        if not found:
            have = ", ".join(str(c.step) for c in complete) or "none"
            raise DtrainError(f"{shown} holds no complete checkpoint step-{step}; complete steps: {have}")
        return Choice(step, found[0].path)
    if complete:
        return Choice(complete[-1].step, complete[-1].path)
    if (run_dir / "model.safetensors").is_file():
        return Choice(None, run_dir / "model.safetensors")
    raise DtrainError(f"{shown} holds no complete checkpoint and no final weights: nothing to evaluate yet")


def unsplit(config: Config, shown: str) -> list[str]:
    """The overrides that evaluate a run trained split (tensor or pipeline parallel) on one process, each
    said in one note: the checkpoint reads into the whole model (DCP reshards), the loss is the same."""
    split = [key for key in ("tp_size", "pp_size") if getattr(config.parallel, key) > 1]
    for key in split:
        was = getattr(config.parallel, key)
        print(f"note: evaluating on 1 process: parallel.{key}=1 instead of the run's {was}", file=sys.stderr)
    return [f"parallel.{key}=1" for key in split]


def check_intact(run_dir: Path, choice: Choice) -> None:
    """A chosen checkpoint's files against its marker's sizes and CRCs: a truncated or altered one is one
    line naming it (as a resume and `dtrain export` say), not a reader's traceback. Once, in the launcher."""
    from dtrain.checkpoint.store import CheckpointStore

    if choice.step is None:
        return
    store = CheckpointStore(run_dir)
    store.check_intact(next(c for c in store.complete() if c.step == choice.step))


def check_out(out: str | None, run_dir: Path) -> None:
    """--out must be a file outside run.dir: the run's folder holds only what the run writes."""
    if out is None:
        return
    target = Path(out).absolute().resolve()
    if target.is_relative_to(run_dir.absolute().resolve()):
        raise DtrainError(
            f"--out {out} is inside the run.dir, which holds only what the run writes; give a file outside it"
        )
    if target.is_dir():
        raise DtrainError(f"--out {out} is a folder; give a file name, e.g. eval.json")
    if not target.parent.is_dir():
        raise DtrainError(f"--out {out}: folder {target.parent} does not exist; create it or give another file")


def evaluate(run_dir: Path, choice: Choice, overrides: list[str]) -> dict[str, Any]:
    """The eval metrics of `choice`'s weights, in every process of the job (a collective); {} when the
    run's data has no eval split."""
    import torch

    from dtrain import data, distributed, models, parallel
    from dtrain.checkpoint import init_from
    from dtrain.config import read_config
    from dtrain.models.empty import parameters_on_meta
    from dtrain.observe.steptime import StepTimer
    from dtrain.train.amp import precision_for
    from dtrain.train.evaluation import Evaluator
    from dtrain.train.loss import LossOf

    config, _ = read_config(str(run_dir / "config.toml"), overrides)
    # No diagnostics folder: the run.dir is only read (a hang report would write into it).
    with distributed.session(config.distributed, debug=config.monitor.debug, device=config.training.device) as s:
        splits = data.build(config)
        # As the worker builds the run's model (worker.build_trainer) and the Trainer its evaluator.
        torch.manual_seed(config.run.seed)
        models.check_kind(config, data.kind_of(config, splits.train))
        with parameters_on_meta(parallel.builds_on_meta(config, s.world_size)):
            module = models.build(config.model, splits.input_shape, splits.num_classes)
        config, _, eval_data, collate_fn = data.as_given(config, splits.train, splits.eval, None)
        parallel.to_device(module, s.device)
        timer = StepTimer(s.device, enabled=False)
        options, dims = StrategyOptions.of(config), parallel.layout(config, s)
        strategy = parallel.build(options, s, module, timer, dims, default_loss=True)  # loss parallel under tp
        # A pipeline keeps its stages' part of the model only: read into that, under the whole model's names.
        module = strategy.module
        # Into the spread model: each rank reads its own shards (init_from.load_into).
        source = init_from.Source("RUN_DIR", choice.path, **_source_of(choice))
        try:
            init_from.load_into(module, source, s.is_main, strategy.stage)
        except BaseException:  # DCP's CheckpointException is a BaseException
            if choice.path.exists():
                raise
            raise DtrainError(
                f"{choice.path} was deleted while it was read (a run still training keeps only its "
                f"checkpoint.keep newest); evaluate a newer step"
            ) from None
        precision = precision_for(config.training.precision, s.device, config.training.tf32)
        loss_of = LossOf(None, None)
        evaluator = Evaluator.of(eval_data, s, dims, config, collate_fn, loss_of, None, precision, timer)
        if evaluator is None:
            return {}
        # As Trainer.evaluate: a pipeline's stages each run every batch, only the last one scoring it.
        return evaluator.evaluate(strategy, s.device)


def _source_of(choice: Choice) -> dict[str, Any]:
    return {"checkpoint": choice.path} if choice.step is not None else {"files": (choice.path,)}


def line(shown: str, choice: Choice, metrics: dict[str, Any]) -> str:
    """One line, as the run's eval line reads, then every other eval metric."""
    from dtrain.observe.monitor import CONSOLE_FORMATS

    parts = [f"{shown} {choice.said()}"]
    formats = dict(CONSOLE_FORMATS)
    for key in ("eval_loss", "eval_accuracy", "eval_perplexity"):
        if key in metrics:
            parts.append(formats[key].format(metrics[key]))
    parts += [f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items() if k not in formats]
    return " | ".join(parts)


def main(run_dir: Path, choice: Choice, overrides: list[str], shown: str, out: str | None) -> None:
    """Every process: evaluate; rank 0 says the line and writes --out."""
    from dtrain import distributed
    from dtrain.distributed import detect_env

    metrics = evaluate(run_dir, choice, overrides)
    if detect_env().rank != 0:
        return
    if not metrics:
        raise DtrainError(f"{shown}: the run's data has no eval split, so there is nothing to evaluate")
    print(line(shown, choice, metrics), flush=True)
    if out is not None:
        world = distributed.detect_env().world_size
        record = {"run_dir": shown, "step": choice.step, "world_size": world, **metrics}
        Path(out).write_text(json.dumps(record, indent=2) + "\n")
        print(f"metrics written to {out}", file=sys.stderr, flush=True)
