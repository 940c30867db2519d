"""Eval metrics for any model, summed over one rank's batches and reduced across ranks exactly.

`eval_loss` always: the mean over samples, or over target tokens for a language model (its
`eval_perplexity` is exp of that). `eval_accuracy` only where outputs are class scores against integer
classes. `Trainer(eval_metrics=fn)`: `fn(output, batch)` returns per-batch means, averaged over every
eval sample; `eval_metrics=dtrain.whole_split(fn)`: `fn(predictions, targets)` of the whole split
(whole_split.py). Sums stay on the device in float64 until the end: one host sync per evaluation.
`Evaluator` answers when to evaluate (`training.eval_every` epochs, `training.eval_every_steps` steps, and
after the last step) and runs it, over `training.eval_batches` batches' worth of the split when capped.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch.utils.data import Subset, TensorDataset

from dtrain import distributed, factory, parallel
from dtrain.config import Config
from dtrain.data import EvalBatches, TensorDict
from dtrain.data.batch import IGNORE_INDEX, num_samples, split
from dtrain.data.stream_eval import StreamEvalBatches
from dtrain.data.streams import is_stream
from dtrain.errors import ConfigError, DtrainError
from dtrain.observe.steptime import Progress, StepTimer
from dtrain.parallel.dims import ParallelDims
from dtrain.parallel.dtensors import is_dtensor
from dtrain.train.amp import Precision
from dtrain.train.loss import LossOf, forward, logits_of
from dtrain.train.whole_split import SplitOutputs, WholeSplit

EvalMetrics = Callable[[Any, Any], Mapping[str, Any]] | WholeSplit


def configured_metrics(ref: str) -> EvalMetrics | None:
    """`training.eval_metrics = "package.module:name"`: the eval_metrics a config names, a function
    fn(output, batch) or a `dtrain.whole_split(fn)` (a run described by its config has no other way)."""
    if not ref:
        return None
    module_name, _, name = ref.partition(":")
    if not module_name.strip() or not name.strip():
        raise ConfigError(f"training.eval_metrics = '{ref}': write it as 'package.module:name'")
    return cast(EvalMetrics, factory.resolve("training.eval_metrics", ref, also=(WholeSplit,)))


class Evaluator:
    """The eval set's metrics (see EvalSums) over every rank's share, and when to take them."""

    def __init__(
        self,
        batches: EvalBatches | StreamEvalBatches,
        loss_of: LossOf,
        user_metrics: EvalMetrics | None,
        eval_every: int,
        precision: Precision,
        progress: Progress,
        eval_every_steps: int = 0,
        counts: bool = True,
    ):
        self.batches, self.loss_of, self.user_metrics = batches, loss_of, user_metrics
        self.eval_every, self.precision, self.progress = eval_every, precision, progress
        self.eval_every_steps = eval_every_steps
        # Whether this rank's batches count: of a replica's tensor- and context-parallel peers, which run
        # the same samples together, one counts them (the others' sums would count each sample again).
        self.counts = counts

    @classmethod
    def of(
        cls,
        eval_data: Any,
        session: distributed.Session,
        dims: ParallelDims,
        config: Config,
        collate_fn: Callable[[list[Any]], Any] | None,
        loss_of: LossOf,
        user_metrics: EvalMetrics | None,
        precision: Precision,
        timer: StepTimer,
    ) -> Evaluator | None:
        """The evaluator of `eval_data`, this rank's share batched as `data` says (None without one); it
        tells `timer`'s progress (the hang watch) that it evaluates. Shared by data-parallel coordinate: a
        replica's tensor and pipeline peers evaluate the same samples (`dims`: the run's layout)."""
        rank, world, at = dims.dp_rank(session.rank), dims.dp, dims.coordinate(session.rank)
        counts = at["tp"] == 0 and at["cp"] == 0
        if eval_data is None:
            return None
        every_steps, progress = config.training.eval_every_steps, timer.progress
        metrics = user_metrics or configured_metrics(config.training.eval_metrics)
        if is_stream(eval_data):  # each rank's share read whole (or capped) every evaluation: stream_eval.py
            stream = StreamEvalBatches(
                eval_data, rank, world, config.data, session.device, collate_fn, config.training.eval_batches
            )
            return cls(stream, loss_of, metrics, config.training.eval_every, precision, progress, every_steps, counts)
        if len(eval_data) == 0:  # nothing to evaluate: said, rather than eval lines with no metric on them
            if session.is_main:
                print("note: eval_data holds no samples: this run does not evaluate", file=sys.stderr, flush=True)
            return None
        cap = config.training.eval_batches * config.data.eval_batch_size
        eval_data = capped(eval_data, cap, config.run.seed) if cap else eval_data
        batches = EvalBatches(eval_data, rank, world, config.data, session.device, collate_fn)
        return cls(batches, loss_of, metrics, config.training.eval_every, precision, progress, every_steps, counts)

    def should_evaluate(self, step: int, total_steps: int, epoch: int, epoch_done: bool) -> bool:
        """After the last step, at the end of every `training.eval_every`-th epoch, and every
        `training.eval_every_steps` steps (again at a resume from such a step: its checkpoint came first)."""
        every_steps = self.eval_every_steps
        if step == total_steps or (every_steps > 0 and step > 0 and step % every_steps == 0):
            return True
        return epoch_done and self.eval_every > 0 and epoch % self.eval_every == 0

    @torch.no_grad()
    def evaluate(self, spread: parallel.Strategy, device: torch.device) -> dict[str, float]:
        """Run the strategy's eval module (the user's own, not DDP's wrapper: no gradients, nothing to
        all-reduce) over this rank's eval batches; the metrics reduced over every rank (a collective).
        Under FSDP the forward pass gathers parameters, a collective: every rank runs as many batches, the
        extra ones uncounted. A pipeline stage before the last (not `computes_loss`) only runs its forward,
        for the next stage. Logits split over tensor-parallel ranks get their loss inside its loss context."""
        module = spread.eval_module
        batches = self.batches.evened() if spread.forward_is_collective else ((batch, True) for batch in self.batches)
        was_training = module.training
        module.eval()
        sums = EvalSums(device, self.user_metrics, self.batches.interleaved)
        for batch, counted in batches:
            self.progress.at("evaluation")
            if not spread.computes_loss:
                with self.precision.autocast():
                    forward(module, split(batch)[0])
                continue
            with self.precision.autocast(), spread.loss_context():
                loss, output, target = self.loss_of(module, batch)
            if is_dtensor(output) and (self.user_metrics is not None or output.dim() == 2):
                # Logits split over the classes (loss parallel), gathered whole for metrics over predictions
                # (the user's, accuracy) by every tensor-parallel peer (a collective), counted or not.
                output = output.full_tensor()
            if counted and self.counts:
                sums.add(loss, output, target, batch, num_samples(batch), self.loss_of.items(module, batch))
        module.train(was_training)
        return sums.result()


def capped(eval_data: Any, cap: int, seed: int) -> Any:
    """`cap` samples of `eval_data` (all of it if it holds no more), drawn once with `seed` and kept in the
    split's order: the same samples at every evaluation and at any world size (the shards come after), and
    spread over the split rather than its first rows, which a split sorted by label would make unrepresentative."""
    n = len(eval_data)
    if cap >= n:
        return eval_data
    chosen = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:cap].sort().values
    if isinstance(eval_data, TensorDict):
        return TensorDict({name: t[chosen] for name, t in eval_data.tensors.items()})
    if isinstance(eval_data, TensorDataset):
        return TensorDataset(*(t[chosen] for t in eval_data.tensors))
    return Subset(eval_data, chosen.tolist())


class EvalSums:
    def __init__(self, device: torch.device, user_metrics: EvalMetrics | None = None, interleaved: bool = True):
        self.device = device
        self.split = SplitOutputs(user_metrics, interleaved) if isinstance(user_metrics, WholeSplit) else None
        self.user_metrics = None if isinstance(user_metrics, WholeSplit) else user_metrics
        self.sums: dict[str, torch.Tensor] = {}

    def _add(self, name: str, value: Any) -> None:
        value = torch.as_tensor(value, device=self.device).detach().double()
        self.sums[name] = self.sums[name] + value if name in self.sums else value

    def add(
        self, loss: torch.Tensor, output: Any, target: Any, batch: Any, samples: int, tokens: torch.Tensor | None
    ) -> None:
        """One batch's sums; `tokens`: the target tokens its loss is a mean over (`LossOf.items`), if known."""
        self._add("samples", samples)
        self._add("loss", loss * samples)
        logits = logits_of(output) if output is not None else None
        integer_target = isinstance(target, torch.Tensor) and not target.is_floating_point()
        if logits is not None and integer_target and target.dim() >= 2 and logits.dim() == target.dim() + 1:
            # A language model: its loss is a mean over the target tokens that count (not -100; for a
            # causal LM those after its own shift). A batch with none adds nothing (its mean is nan).
            if tokens is None:
                tokens = (target != IGNORE_INDEX).sum()
            self._add("lm_samples", samples)
            self._add("lm_tokens", tokens)
            self._add("lm_loss", torch.where(tokens > 0, loss * tokens, 0.0))
        elif logits is not None and integer_target and logits.dim() == 2 and target.dim() == 1:
            self._add("classified", samples)
            self._add("correct", (logits.argmax(dim=1) == target).sum())
        if self.split is not None:
            self.split.add(output, target)
        if self.user_metrics is not None:
            returned = self.user_metrics(output, batch)
            if not isinstance(returned, Mapping):
                raise DtrainError(
                    f"eval_metrics returned {type(returned).__name__}; return a dict of names to "
                    f'numbers (each the batch\'s mean), e.g. {{"top5": 0.93}}'
                )
            for name, value in returned.items():
                if not isinstance(value, (int, float, torch.Tensor)) or torch.as_tensor(value).numel() != 1:
                    raise DtrainError(
                        f"eval_metrics returned {name}={type(value).__name__}; return one number "
                        f"per name (the batch's mean)"
                    )
                self._add(f"user:{name}", torch.as_tensor(value) * samples)

    def result(self) -> dict[str, float]:
        """The metrics over every rank's batches (a collective: every rank calls it)."""
        names = sorted(self.sums)
        local = dict(zip(names, torch.stack([self.sums[n] for n in names]).tolist())) if names else {}
        totals: dict[str, float] = {}
        for sums in distributed.gather_objects(local):  # rank order: every rank adds the same way
            for name, value in sums.items():
                totals[name] = totals.get(name, 0.0) + value
        samples = totals.get("samples", 0.0)
        whole_split = self.split.result() if self.split is not None else {}  # a collective: before any return
        if not samples:
            return {}
        result: dict[str, float] = {"eval_loss": totals["loss"] / samples, "eval_samples": int(samples)}
        if totals.get("lm_samples") == samples and totals.get("lm_tokens"):
            result["eval_loss"] = totals["lm_loss"] / totals["lm_tokens"]
            result["eval_perplexity"] = math.exp(min(result["eval_loss"], 700.0))
        if totals.get("classified") == samples:
            result["eval_accuracy"] = totals["correct"] / samples
        for name, value in totals.items():
            if name.startswith("user:"):
                key = name[len("user:") :]
                result[key if key.startswith("eval_") else f"eval_{key}"] = value / samples
        return {**result, **whole_split}
