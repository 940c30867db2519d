"""Dynamic padding: a batch of token rows of different lengths padded to its own longest row.

`pad_to_longest(pad_token_id=..., multiple_of=8)` (or `data.padding = "longest"`) collates rows such as a
tokenized `datasets.Dataset` gives them — dicts holding `input_ids` (a list or a 1-D tensor), perhaps
`attention_mask`, `labels` and other per-token or per-row fields — into one dict of tensors:

    input_ids       right-padded with the pad token to the longest row (rounded up to `multiple_of`: GPU
                    kernels like lengths that are multiples of 8 or 64)
    attention_mask  1 on real tokens, 0 on padding (the row's own mask, where it has one, padded with 0)
    labels          the row's `labels` padded with -100, or, where rows have none, the input ids with -100
                    on padding (a causal LM's labels: the model shifts them itself)

Other per-token fields (token_type_ids, ...) are padded with 0; per-row fields (an id, a class `label`)
are stacked. Padding goes on the right, so that with causal attention no real token ever sees a pad:
the loss (every model's cross-entropy leaves -100 out) and dtrain's tokens/s and MFU (which count the
attention mask's ones) are those of the real tokens alone.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dtrain.data.batch import IGNORE_INDEX
from dtrain.errors import ConfigError, DataError


class PadToLongest:
    """The collator (a plain class: DataLoader workers pickle it)."""

    def __init__(self, pad_token_id: int, multiple_of: int = 1):
        if not isinstance(pad_token_id, int) or isinstance(pad_token_id, bool) or pad_token_id < 0:
            raise ConfigError(f"pad_to_longest: pad_token_id must be a token id (an integer ≥ 0); got {pad_token_id!r}")
        if not isinstance(multiple_of, int) or multiple_of < 1:
            raise ConfigError(f"pad_to_longest: multiple_of must be an integer ≥ 1; got {multiple_of!r}")
        self.pad_token_id, self.multiple_of = pad_token_id, multiple_of

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not rows:
            raise DataError("pad_to_longest was given an empty batch: no rows to collate")
        if not all(isinstance(r, Mapping) and "input_ids" in r for r in rows):
            raise DataError(
                "pad_to_longest collates rows that are dicts holding 'input_ids' (a tokenized data set's rows)"
            )
        ids = [_as_1d(r["input_ids"], "input_ids") for r in rows]
        longest = max(len(i) for i in ids)
        width = -(-longest // self.multiple_of) * self.multiple_of  # rounded up to the multiple
        batch: dict[str, torch.Tensor] = {"input_ids": _pad(ids, width, self.pad_token_id)}
        real = torch.zeros(len(rows), width, dtype=torch.long)
        for row, i in enumerate(ids):
            real[row, : len(i)] = 1
        if "attention_mask" in rows[0]:  # the row's own mask (a left part may be masked too), padded with 0
            real = _pad(_aligned([r["attention_mask"] for r in rows], ids, "attention_mask"), width, 0)
        batch["attention_mask"] = real
        for key in rows[0]:
            if key in batch:
                continue
            values = [r[key] for r in rows]
            if key == "labels" and _per_token(values[0]):
                batch[key] = _pad(_aligned(values, ids, key), width, IGNORE_INDEX)
            elif _per_token(values[0]):
                batch[key] = _pad(_aligned(values, ids, key), width, 0)
            else:
                batch[key] = torch.as_tensor(values) if not isinstance(values[0], torch.Tensor) else torch.stack(values)
        if "labels" not in batch and "label" not in batch:  # a causal LM's: the input ids, padding left out
            batch["labels"] = batch["input_ids"].masked_fill(real.eq(0), IGNORE_INDEX)
        return batch

    def __repr__(self) -> str:
        return f"pad_to_longest(pad_token_id={self.pad_token_id}, multiple_of={self.multiple_of})"


def _aligned(values: Sequence[Any], ids: Sequence[torch.Tensor], key: str) -> list[torch.Tensor]:
    """A per-token field of each row, as long as the row's input_ids (a shorter one would be padded into
    labels that no longer line up with their tokens: refused)."""
    tensors = [_as_1d(v, key) for v in values]
    for row, (tensor, tokens) in enumerate(zip(tensors, ids)):
        if len(tensor) != len(tokens):
            raise DataError(
                f"pad_to_longest: row {row}'s '{key}' has {len(tensor)} entries for {len(tokens)} input_ids; "
                f"a per-token field must be as long as the row's input_ids"
            )
    return tensors


def pad_to_longest(pad_token_id: int | None = None, *, multiple_of: int = 1, tokenizer: Any = None) -> PadToLongest:
    """The dynamic-padding collator: `Trainer(collate_fn=dtrain.pad_to_longest(tokenizer=tok))`. The pad
    token id is `pad_token_id`, else the tokenizer's."""
    if pad_token_id is None and tokenizer is not None:
        pad_token_id = getattr(tokenizer, "pad_token_id", None)
    if pad_token_id is None:
        raise ConfigError(
            "pad_to_longest needs the pad token id: pass pad_token_id=N, or tokenizer= one with a pad token "
            "(GPT-2's has none: tokenizer.pad_token = tokenizer.eos_token)"
        )
    return PadToLongest(pad_token_id, multiple_of)


def from_config(data: Any, model: Any) -> PadToLongest:
    """`data.padding = "longest"`: the pad token id is data.pad_token_id, else the model config's (a Hugging
    Face model's `config.pad_token_id`); none known is one line."""
    forward = getattr(model, "forward", None)
    params = inspect.signature(forward).parameters if callable(forward) else {}
    if params and "attention_mask" not in params and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        raise ConfigError(
            f"data.padding = 'longest' makes dict batches (input_ids, attention_mask, labels) and "
            f"{type(model).__name__}.forward takes no attention_mask: use a model that does (a Hugging Face "
            f"model), or pad in your own collate_fn"
        )
    pad = data.pad_token_id if data.pad_token_id >= 0 else getattr(getattr(model, "config", None), "pad_token_id", None)
    if pad is None:
        raise ConfigError(
            "data.padding = 'longest' needs a pad token id and the model's config has none: set "
            "data.pad_token_id (e.g. the tokenizer's eos_token_id, as GPT-2 users do)"
        )
    return PadToLongest(int(pad), data.pad_to_multiple_of)


def _per_token(value: Any) -> bool:
    return (isinstance(value, torch.Tensor) and value.dim() == 1) or isinstance(value, (list, tuple))


def _as_1d(value: Any, key: str) -> torch.Tensor:
    tensor = torch.as_tensor(value, dtype=torch.long)
    if tensor.dim() != 1:
        raise DataError(f"pad_to_longest: each row's '{key}' must be one sequence; got shape {tuple(tensor.shape)}")
    return tensor


def _pad(rows: list[torch.Tensor], width: int, value: int) -> torch.Tensor:
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out
