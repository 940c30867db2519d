"""`dtrain generate RUN_DIR --prompt TEXT`: a sample from a trained language model, decoded with the
tokenizer of the data it trained on — people would rather read a sample than a loss."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from dtrain import models
from dtrain.config import read_config
from dtrain.data import tokens
from dtrain.errors import DtrainError
from dtrain.rundir.lock import RunDirLock

MAX_TOKENS = 100_000  # a sample to read, not a corpus


def _still_training(run_dir: Path) -> bool:
    """Whether a live run holds the run.dir's lock."""
    try:
        RunDirLock(run_dir).check_free()
    except DtrainError:
        return True
    return False


def generate(
    run_dir: str | Path,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 50,
    seed: int = 0,
) -> str:
    """The prompt and its continuation, as text."""
    from dtrain.checkpoint.export import load_weights
    from dtrain.data.prepare import load_tokenizer

    run_dir = Path(run_dir)
    config_file, weights = run_dir / "config.toml", run_dir / "model.safetensors"
    training = _still_training(run_dir)
    for path in (config_file, weights):
        if not path.is_file():
            if training:
                raise DtrainError(
                    f"{run_dir} is still training and has no {path.name} yet; generate once it has finished"
                )
            raise DtrainError(f"{path} does not exist: RUN_DIR must be the run.dir of a finished run")
    if training:  # a resumed run: the weights are its last finish's, not what it is training now
        print(
            f"note: {run_dir} is still training; this sample is from the {weights.name} of its last finish",
            file=sys.stderr,
        )
    config, _ = read_config(config_file)  # a renamed key in a config.toml dtrain wrote is not the user's to fix
    if config.data.name != "tokens":
        raise DtrainError(
            f"{config_file}: data.name = '{config.data.name}'; generate needs a language model "
            f"trained on token data (data.name=tokens)"
        )
    if not 0 <= temperature < float("inf") or not 1 <= max_new_tokens <= MAX_TOKENS or top_k < 0:
        raise DtrainError(
            f"--temperature must be a number from 0 (greedy), --tokens from 1 to {MAX_TOKENS:,} and --top-k at least 0"
        )
    kept = tokens.read_kept_tokenizer_meta(run_dir)  # what the run trained with, kept beside its weights
    meta = kept if kept is not None else tokens.read_meta(config.data.path)
    tokenizer = load_tokenizer(run_dir / "tokenizer" if kept is not None else config.data.path, meta)
    model: Any = models.build(config.model, (config.data.block_size,), meta["vocab_size"])  # has generate()
    if not callable(getattr(model, "generate", None)):
        raise DtrainError(f"model.name = '{config.model.name}' has no generate(); the built-in gpt has")
    try:
        model.load_state_dict(load_weights(weights))
    except Exception as exc:
        raise DtrainError(
            f"{weights} does not fit model '{config.model.name}' as config.toml builds it ({exc})"
        ) from None
    model.eval()
    ids = tokenizer.encode(prompt)
    ids = ids if isinstance(ids, list) else ids.ids
    if not ids:
        ids = [meta["eot_token"]]  # an empty prompt: start as after a document
    generator = torch.Generator().manual_seed(seed)
    out = model.generate(
        torch.tensor([ids]), max_new_tokens, temperature=temperature, top_k=top_k or None, generator=generator
    )
    new = [i for i in out[0, len(ids) :].tolist()]
    return prompt + tokenizer.decode(new)
