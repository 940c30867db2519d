"""A job started from a file's weights under FSDP, its model built as `dtrain run` builds it
(worker.build_trainer: parameters on the meta device, each rank giving memory to its own shards only).

    torchrun --nproc-per-node 2 meta_init.py peak TOKENS OUT WEIGHTS OPTIONS
    torchrun --nproc-per-node 2 meta_init.py losses TOKENS OUT GPT_WEIGHTS HF_FOLDER OPTIONS

peak: each rank writes OUT/rank<R>.json: how far its peak resident memory (the kernel's VmHWM, reset
just before) rose while the job's model was built, sharded and filled with WEIGHTS (`Trainer.setup`);
the same for the model built whole, as every rank built it before; and the bytes of its shards.

losses: the built-in GPT from GPT_WEIGHTS and a Hugging Face model from HF_FOLDER (`hf:`), each trained
3 steps twice: built as the job builds it, and as before (the whole model built, then sharded, then
read into), in OUT/<model>_meta and OUT/<model>_whole; the GPT's first run stopped after step 2 and
resumed. Rank 0 writes OUT/facts.json: for each run, whether its model was built on the meta device and
whether its head stayed tied to its embedding.
"""

import ctypes
import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

import dtrain
from dtrain import data, distributed, models
from dtrain.models.empty import parameters_on_meta
from dtrain.worker import build_trainer


def status_kib(key: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(key + ":"))
    return int(line.split()[1])


def peak_growth(work) -> tuple[int, object]:
    """How far `work()` raised the peak RSS (the kernel's high-water mark, reset just before), and its result.
    Memory freed earlier is given back first: malloc keeps what it freed for reuse, unseen by the count."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from the current RSS
    before = status_kib("VmHWM")
    result = work()
    return (status_kib("VmHWM") - before) * 1024, result


def job(tokens: str, run_dir: Path, *overrides: str) -> dtrain.Config:
    return dtrain.load_config(
        "examples/gpt_stdlib.toml",
        [
            f"data.path={tokens}",
            "data.block_size=32",
            "data.batch_size=4",
            "training.log_every=1",
            "training.eval_every=0",
            "scheduler.warmup_steps=2",
            "parallel.strategy=fsdp",
            f"run.dir={run_dir}",
            *overrides,
        ],
    )


def peak(tokens: str, out: Path, weights: str, options: str) -> None:
    config = job(tokens, out / "run", options, f"model.init_from={weights}", "training.max_steps=1")
    with distributed.session(config.distributed) as session:
        splits = data.build(config)

        def set_up() -> dtrain.Trainer:
            trainer = build_trainer(config, session, splits)
            trainer.setup()  # sharded, then filled from the file
            return trainer

        # torch loads its meta-device kernels the first time they run (some 35 MB, whatever the model):
        # loaded before the measure, which is of what the model costs.
        with parameters_on_meta():
            models.build(config.model, splits.input_shape, splits.num_classes)
        grew, trainer = peak_growth(set_up)
        held = sum(p.to_local().nbytes if isinstance(p, DTensor) else p.nbytes for p in trainer.module.parameters())
        whole, _ = peak_growth(lambda: models.build(config.model, splits.input_shape, splits.num_classes))
        facts = {"built": grew, "whole": whole, "held": held}
        (out / f"rank{session.rank}.json").write_text(json.dumps(facts))


def losses(tokens: str, out: Path, gpt_weights: str, hf_folder: str, options: str) -> None:
    jobs = {
        "gpt": [options, f"model.init_from={gpt_weights}"],
        "hf": [f"model.name=hf:{hf_folder}", "model.options={}"],
    }
    facts = {}
    with distributed.session(job(tokens, out).distributed) as session:
        for name, overrides in jobs.items():
            # The GPT's run built on the meta device stops after step 2 and resumes: its checkpoint, not the
            # file, fills its shards then.
            runs = [("meta", ["training.stop_at_step=2"]), ("meta", []), ("whole", [])]
            for how, stop in runs if name == "gpt" else [("meta", []), ("whole", [])]:
                config = job(tokens, out / f"{name}_{how}", *overrides, "training.max_steps=3", *stop)
                splits = data.build(config)
                if how == "meta":
                    trainer = build_trainer(config, session, splits)
                else:  # as every rank built it before: whole, from the same seed
                    torch.manual_seed(config.run.seed)
                    model = models.build(config.model, splits.input_shape, splits.num_classes)
                    trainer = dtrain.Trainer(config, model=model, train_data=splits.train, eval_data=splits.eval)
                on_meta = any(p.is_meta for p in trainer.module.parameters())
                trainer.fit()
                module = trainer.module
                embedding = module.wte if name == "gpt" else module.get_input_embeddings()
                tied = module.lm_head.weight is embedding.weight
                facts.setdefault(f"{name}_{how}", []).append({"on_meta": on_meta, "tied": tied})
        if session.is_main:
            (out / "facts.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    mode, tokens, out, *rest = sys.argv[1:]
    {"peak": peak, "losses": losses}[mode](tokens, Path(out), *rest)
