"""Sequence packing with document boundaries (`data.packing = true`, token data).

A token folder is documents one after another, each ended by meta.json's `eot_token`, and a window of
block_size tokens holds parts of several. Packed, a window keeps every token (no padding) and says where
each document begins, so that the model treats it as several sequences side by side:

    input_ids     the window's tokens, as without packing
    position_ids  restarting at 0 on the first token after every end-of-text token (and at the window's
                  start): a document's positions are those it has alone. The built-in GPT reads the
                  documents from them and attends within each only (a block-diagonal causal mask);
                  Hugging Face models read them as their padding-free collator's (DataCollatorWithFlattening)
    target        the next tokens, with -100 where the next token begins another document: a document's
                  first token is not predicted from the one before (its end-of-text token is: a document
                  learns to end)

A sample is then ({"input_ids", "position_ids"}, target): the model is called with the dict and scored
against the target (train/loss.py). Every position is a real token: tokens/s and MFU count them all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dtrain.data.batch import IGNORE_INDEX
from dtrain.data.tokens import TokenWindows
from dtrain.errors import DataError


def mark_documents(
    inputs: torch.Tensor, target: torch.Tensor, eot: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(inputs as {"input_ids", "position_ids"}, target with -100 across each boundary) of windows
    (batch, positions) whose documents end with `eot`."""
    t = inputs.shape[-1]
    starts = torch.zeros_like(inputs, dtype=torch.bool)
    starts[..., 0] = True
    starts[..., 1:] = inputs[..., :-1] == eot  # the token after an end-of-text begins a document
    index = torch.arange(t, device=inputs.device).expand_as(inputs)
    begun = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values  # where each one began
    target = target.masked_fill(inputs == eot, IGNORE_INDEX)  # the next document's first token
    return {"input_ids": inputs, "position_ids": index - begun}, target


class PackedWindows(TokenWindows):
    """TokenWindows whose documents are marked (module docstring)."""

    def __init__(self, folder: str | Path, split: str, block_size: int, meta: dict[str, Any] | None = None):
        super().__init__(folder, split, block_size, meta)
        eot = self.meta.get("eot_token")
        if not isinstance(eot, int) or isinstance(eot, bool):
            raise DataError(
                f"data.packing = true needs the end-of-text token that separates documents, and {folder}'s "
                f"meta.json names none (eot_token); prepare the data with `dtrain prepare text`, or set "
                f"data.packing = false"
            )
        self.eot = eot

    def __getitem__(self, index: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:  # type: ignore[override]
        inputs, target = self.take(torch.tensor([index]))
        return {k: v[0] for k, v in inputs.items()}, target[0]

    def take(self, indices: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:  # type: ignore[override]
        return mark_documents(*super().take(indices), self.eot)
