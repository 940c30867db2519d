"""`dtrain generate RUN_DIR --prompt TEXT`: a sample from a trained language model, decoded with the
tokenizer of the data it trained on — people would rather read a sample than a loss."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from dtrain import models, objstore
from dtrain.checkpoint.manifest import MARKER
from dtrain.checkpoint.store import Checkpoint, CheckpointStore
from dtrain.config import read_config
from dtrain.data import tokens
from dtrain.errors import DtrainError
from dtrain.models import hf
from dtrain.rundir import given_in_code
from dtrain.rundir.lock import RunDirLock

MAX_TOKENS = 100_000  # a sample to read, not a corpus


def _newer_checkpoint(run_dir: Path, weights: Path) -> Checkpoint | None:
    """The run's newest complete checkpoint where it was sealed after the final weights were written (a
    run still training, or stopped before its end), else None: the weights are the newest state."""
    newest = CheckpointStore(run_dir).newest()
    if newest is None:
        return None
    if weights.is_file() and weights.stat().st_mtime_ns >= (newest.path / MARKER).stat().st_mtime_ns:
        return None
    return newest


def generate(
    run_dir: str | Path,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 50,
    seed: int = 0,
) -> str:
    """The prompt and its continuation, as text. A run.dir URL is read through a local copy of what
    sampling needs (see rundir.reading), without taking the run's lease."""
    if objstore.is_url(run_dir):
        from dtrain.rundir import reading

        with reading.fetched(str(run_dir), "newest") as copy:
            return _generate(copy.path, prompt, max_new_tokens, temperature, top_k, seed, copy.training, copy.url)
    return _generate(Path(run_dir), prompt, max_new_tokens, temperature, top_k, seed)


def _generate(
    run_dir: Path,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    seed: int,
    training: bool | None = None,
    shown: str = "",
) -> str:
    from dtrain.checkpoint.tensors import read_model_weights
    from dtrain.data.prepare import load_tokenizer
    from dtrain.export.weights import load_weights

    config_file, weights = run_dir / "config.toml", run_dir / "model.safetensors"
    training = RunDirLock(run_dir).held() if training is None else training
    run_dir_said = shown or str(run_dir)  # the notes name the URL, not the local copy
    if not config_file.is_file():
        if training:
            raise DtrainError(f"{run_dir} is still training and has no config.toml yet; generate once it has")
        raise DtrainError(f"{config_file} does not exist: RUN_DIR must be the run.dir of a dtrain run")
    if given_in_code(config_file):
        raise DtrainError(
            f"{run_dir} was trained by a script that gave dtrain.Trainer its model in code, which config.toml "
            f"cannot build; sample in that script: load the weights with "
            f"model.load_state_dict(dtrain.load_weights('{weights}')) and call the model's own generate"
        )
    checkpoint = _newer_checkpoint(run_dir, weights)
    if checkpoint is None and not weights.is_file():
        if training:
            raise DtrainError(
                f"{run_dir} is still training and has written neither a checkpoint nor {weights.name} yet; "
                f"generate once it has (checkpoint.every_steps sets how often it checkpoints)"
            )
        raise DtrainError(f"{weights} does not exist and {run_dir} holds no checkpoint: nothing trained to sample")
    config, _ = read_config(config_file)  # a renamed key in a config.toml dtrain wrote is not the user's to fix
    if config.training.lora:
        raise DtrainError(
            f"{run_dir_said} trained LoRA adapters (training.lora), which dtrain generate does not sample yet; "
            f"export them merged into the base (dtrain export {run_dir_said} --format hf --merged --out DIR) "
            f"and call generate on the model from_pretrained loads from DIR"
        )
    if config.data.name != "tokens":
        raise DtrainError(
            f"{config_file}: data.name = '{config.data.name}'; generate needs a language model "
            f"trained on token data (data.name=tokens)"
        )
    if not 0 <= temperature < float("inf") or not 1 <= max_new_tokens <= MAX_TOKENS or top_k < 0:
        raise DtrainError(
            f"--temperature must be a number from 0 (greedy), --tokens from 1 to {MAX_TOKENS:,} and --top-k at least 0"
        )
    if checkpoint is not None:  # said once the run is known to be one generate can sample
        why = "is still training" if training else "has no model.safetensors" if not weights.is_file() else None
        print(
            f"note: {run_dir_said} {why or 'has a checkpoint newer than its model.safetensors'}; this sample is "
            f"from its newest checkpoint, {checkpoint.name} (step {checkpoint.step})",
            file=sys.stderr,
        )
    elif training:  # a resumed run with no checkpoint of its own yet: the weights are its last finish's
        print(
            f"note: {run_dir_said} is still training; this sample is from the {weights.name} of its last finish",
            file=sys.stderr,
        )
    kept = tokens.read_kept_tokenizer_meta(run_dir)  # what the run trained with, kept beside its weights
    meta = kept if kept is not None else tokens.read_meta(config.data.path)
    tokenizer = load_tokenizer(run_dir / "tokenizer" if kept is not None else config.data.path, meta)
    model: Any = models.build(config.model, (config.data.block_size,), meta["vocab_size"])
    hugging_face = hf.is_transformers_model(model)
    if not (model.can_generate() if hugging_face else callable(getattr(model, "generate", None))):
        raise DtrainError(
            f"model.name = '{config.model.name}' builds a {type(model).__name__}, which cannot generate; "
            f"generate samples the built-in gpt and hf-causal-lm: models"
        )
    source = weights if checkpoint is None else checkpoint.path
    try:
        if checkpoint is None:
            model.load_state_dict(load_weights(weights))
        else:
            read_model_weights(checkpoint.path, model.state_dict())  # in place: the model's own tensors
    except Exception as exc:
        raise DtrainError(
            f"{source} does not fit model '{config.model.name}' as config.toml builds it ({exc})"
        ) from None
    model.eval()
    ids = tokenizer.encode(prompt)
    ids = ids if isinstance(ids, list) else ids.ids
    if not ids:
        ids = [meta["eot_token"]]  # an empty prompt: start as after a document
    if hugging_face:
        out = _hf_generate(model, ids, max_new_tokens, temperature, top_k, seed)
    else:
        generator = torch.Generator().manual_seed(seed)
        out = model.generate(
            torch.tensor([ids]), max_new_tokens, temperature=temperature, top_k=top_k or None, generator=generator
        )
    new = [i for i in out[0, len(ids) :].tolist()]
    return prompt + tokenizer.decode(new)


def _hf_generate(model: Any, ids: list[int], max_new_tokens: int, temperature: float, top_k: int, seed: int) -> Any:
    """A Hugging Face model continues `ids` with its own `generate`, dtrain's flags mapped to its options:
    temperature 0 is greedy (do_sample=False), else sampling at `temperature` from the `top_k` likeliest
    (0: all). Unlike the built-in gpt, which writes all `max_new_tokens`, it stops at its config's
    end-of-sequence token, as transformers does. It has no window to slide: a prompt and continuation
    longer than its positions are refused."""
    positions = getattr(model.config, "max_position_embeddings", None)
    if isinstance(positions, int) and len(ids) + max_new_tokens > positions:
        raise DtrainError(
            f"the prompt's {len(ids)} tokens and --tokens {max_new_tokens} exceed the model's {positions} "
            f"positions; ask for at most {max(positions - len(ids), 0)} tokens or give a shorter prompt"
        )
    torch.manual_seed(seed)  # transformers samples with torch's global generator
    sampling = {"do_sample": True, "temperature": temperature, "top_k": top_k} if temperature else {"do_sample": False}
    eos, pad = model.generation_config.eos_token_id, model.generation_config.pad_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    return model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        pad_token_id=pad if pad is not None else eos,  # one sequence: nothing is padded; said, so not warned
        **sampling,
    )
