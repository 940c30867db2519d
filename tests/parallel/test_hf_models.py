"""Hugging Face models as their users run them: `dtrain launch script.py`, 2 gloo processes."""

from __future__ import annotations

import json
import math

import pytest

from helpers import WORKERS, ok, train_lines

pytest.importorskip("transformers")  # the test extra installs it

SCRIPT = str(WORKERS / "hf_gpt2.py")


def launch_gpt2(warm, out, *overrides: str) -> dict:
    """`dtrain launch --nproc 2 SCRIPT` on the warm workers (tests/pool.py); the facts the script wrote."""
    ok(warm("launch", "--nproc", "2", SCRIPT, str(out), *overrides))
    return json.loads((out / "facts.json").read_text())


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_activation_checkpointing_of_a_hugging_face_model_is_its_own(warm, strategy, tmp_path):
    """training.activation_checkpointing on a model with its own (GPT-2's gradient_checkpointing_enable)
    turns that on, cache off, rather than wrapping its blocks a second way; it takes the plain steps."""
    plain = launch_gpt2(warm, tmp_path / "plain", f"parallel.strategy={strategy}")
    assert not plain["checkpointing"]
    for mode in ("full", "selective"):
        facts = launch_gpt2(
            warm, tmp_path / mode, f"parallel.strategy={strategy}", f"training.activation_checkpointing={mode}"
        )
        assert facts["checkpointing"] and all(facts["blocks_checkpointing"]), facts
        assert not any(facts["forward_replaced"]) and facts["use_cache"] is False, facts
        losses = [m["loss"] for m in train_lines(tmp_path / mode / "run")]
        assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
        assert losses == pytest.approx([m["loss"] for m in train_lines(tmp_path / "plain" / "run")], abs=1e-5)
