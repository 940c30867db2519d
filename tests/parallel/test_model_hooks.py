"""The hooks a model may offer the strategies (parallel/model_hooks.py): declared once, read through
`offered`, offered in full by the built-in GPT and by nothing that does not declare them."""

import dataclasses

from torch import nn

from dtrain.models.gpt import GPT
from dtrain.parallel.model_hooks import ModelHooks, Offered, offered


def test_the_built_in_gpt_offers_every_hook_and_a_plain_module_none():
    gpt = GPT(64, block_size=16, n_layer=2, n_head=2, n_embd=16)
    hooks = offered(gpt)
    assert hooks.tp_plan is not None and hooks.tp_problem is not None
    assert hooks.tp_dropout_on_shards and hooks.sequence_positions
    plan, split = hooks.plan(loss_parallel=True)
    assert split and "lm_head" in plan and "h.*.attn" in plan
    assert hooks.plan(loss_parallel=False)[1] is False
    assert "must divide the GPT's heads" in hooks.tp_problem(3)
    assert offered(nn.Sequential(nn.Linear(2, 2))) == Offered(None, None, False, False)


def test_every_hook_the_protocol_declares_is_one_offered_reads():
    declared = {name for name in vars(ModelHooks) if not name.startswith("_")} | set(ModelHooks.__annotations__)
    assert declared == {field.name for field in dataclasses.fields(Offered)}
