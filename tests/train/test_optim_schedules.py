"""Optimizers by name, parameter groups and schedules: parity with transformers.get_scheduler (the learning
rate of every step) and with nanoGPT's configure_optimizers (which tensors decay)."""

import pytest
import torch
from transformers import get_scheduler

from dtrain.config import Config, OptimizerConfig
from dtrain.models.gpt import GPT
from dtrain.train.optim import build, build_optimizer
from dtrain.train.param_groups import decayed_names

PEAK, TOTAL = 0.5, 40


def dtrain_lrs(steps, groups=(), lr=PEAK, **scheduler):
    """The learning rate of optimizer steps 0..steps, as the trainer steps dtrain's schedule."""
    config = Config.from_dict({"optimizer": {"lr": lr, "groups": list(groups)}, "scheduler": scheduler})
    optimizer, schedule = build(config, torch.nn.Linear(2, 2), (None, None), torch.device("cpu"), TOTAL)
    seen = []
    for _ in range(steps + 1):
        seen.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        schedule.step()
    return seen


def hf_lrs(name, steps, warmup, total=TOTAL, lr=PEAK, **kwargs):
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=lr)
    scheduler = get_scheduler(
        name, optimizer, num_warmup_steps=warmup, num_training_steps=total, scheduler_specific_kwargs=kwargs
    )
    seen = []
    for _ in range(steps + 1):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


# (dtrain's scheduler settings, transformers' name and scheduler_specific_kwargs)
CASES = [
    ({"name": "constant"}, "constant", {}),
    ({"name": "constant_with_warmup"}, "constant_with_warmup", {}),
    ({"name": "linear"}, "linear", {}),
    ({"name": "cosine"}, "cosine", {}),
    ({"name": "cosine", "kwargs": {"num_cycles": 0.3}}, "cosine", {"num_cycles": 0.3}),
    ({"name": "cosine", "min_lr_ratio": 0.1}, "cosine_with_min_lr", {"min_lr_rate": 0.1}),
    ({"name": "cosine_with_restarts"}, "cosine_with_restarts", {}),
    ({"name": "cosine_with_restarts", "kwargs": {"num_cycles": 3}}, "cosine_with_restarts", {"num_cycles": 3}),
    ({"name": "polynomial", "min_lr": 1e-7}, "polynomial", {}),
    ({"name": "polynomial", "min_lr": 0.05, "kwargs": {"power": 2.0}}, "polynomial", {"lr_end": 0.05, "power": 2.0}),
    ({"name": "inverse_sqrt"}, "inverse_sqrt", {}),
    ({"name": "inverse_sqrt", "kwargs": {"timescale": 7}}, "inverse_sqrt", {"timescale": 7}),
    (
        {"name": "warmup_stable_decay", "kwargs": {"num_decay_steps": 10}},
        "warmup_stable_decay",
        {"num_decay_steps": 10},
    ),
    (
        {
            "name": "warmup_stable_decay",
            "min_lr_ratio": 0.2,
            "kwargs": {"num_decay_steps": 12, "warmup_type": "cosine", "decay_type": "1-sqrt"},
        },
        "warmup_stable_decay",
        {"num_decay_steps": 12, "warmup_type": "cosine", "decay_type": "1-sqrt", "min_lr_ratio": 0.2},
    ),
    (
        {
            "name": "warmup_stable_decay",
            "kwargs": {"num_decay_steps": 9, "warmup_type": "1-sqrt", "decay_type": "linear"},
        },
        "warmup_stable_decay",
        {"num_decay_steps": 9, "warmup_type": "1-sqrt", "decay_type": "linear"},
    ),
]


@pytest.mark.parametrize("warmup", [0, 6])
@pytest.mark.parametrize(("ours", "name", "kwargs"), CASES, ids=[f"{c[0]['name']}-{i}" for i, c in enumerate(CASES)])
def test_every_step_has_transformers_learning_rate(ours, name, kwargs, warmup):
    """Each of transformers' schedules, with and without warm-up (step 0 at lr 0, as transformers): the
    learning rate of every step of the run, and the one after it, within 1e-9."""
    if name == "constant" and warmup:
        ours, name = {**ours, "name": "constant_with_warmup"}, "constant_with_warmup"
    ours_seen = [lrs[0] for lrs in dtrain_lrs(TOTAL, warmup_steps=warmup, **ours)]
    theirs = hf_lrs(name, TOTAL, warmup, **kwargs)
    assert len(ours_seen) == len(theirs) == TOTAL + 1
    for step, (a, b) in enumerate(zip(ours_seen, theirs)):
        assert abs(a - b) <= 1e-9, f"step {step}: dtrain {a}, transformers {b}"
    if warmup and "min_lr_ratio" not in ours:  # (warmup_stable_decay warms up from its floor)
        assert ours_seen[0] == 0.0  # transformers' convention: the first step's learning rate is 0


def test_constant_with_warmup_steps_warms_up_as_constant_with_warmup():
    """dtrain's `constant` with scheduler.warmup_steps warms up (as it always did); transformers' constant
    ignores num_warmup_steps, its constant_with_warmup does not."""
    assert dtrain_lrs(TOTAL, name="constant", warmup_steps=4) == dtrain_lrs(
        TOTAL, name="constant_with_warmup", warmup_steps=4
    )


@pytest.mark.parametrize("name", ["linear", "cosine", "polynomial"])
def test_decay_steps_ends_the_decay_early_then_holds_min_lr(name):
    """scheduler.decay_steps = 25 of a 40-step run: transformers' schedule of a 25-step run up to step 25
    (its floor = min_lr), then min_lr until the end (nanoGPT's lr_decay_iters)."""
    ours = [lrs[0] for lrs in dtrain_lrs(TOTAL, name=name, warmup_steps=5, decay_steps=25, min_lr=0.05)]
    hf_name, kwargs = {"linear": ("linear", {}), "cosine": ("cosine_with_min_lr", {"min_lr": 0.05})}.get(
        name, ("polynomial", {"lr_end": 0.05})
    )
    if name == "linear":  # transformers' linear has no floor: the same line, lifted
        theirs = [
            0.05 + (PEAK - 0.05) * lr / PEAK if step >= 5 else lr
            for step, lr in enumerate(hf_lrs(hf_name, 25, 5, total=25))
        ]
    else:
        theirs = hf_lrs(hf_name, 25, 5, total=25, **kwargs)
    assert max(abs(a - b) for a, b in zip(ours[:26], theirs)) <= 1e-9
    assert ours[25:] == [pytest.approx(0.05, abs=1e-12)] * (TOTAL + 1 - 25)


def test_a_group_lr_follows_the_schedule_in_proportion():
    seen = dtrain_lrs(TOTAL, groups=[{"params": "bias", "lr": 0.05}], name="cosine", warmup_steps=4)
    assert all(abs(g[1] * PEAK / 0.05 - g[0]) < 1e-12 for g in seen)  # [weight's, bias's (the group)]
    assert seen[10][1] == pytest.approx(0.05 * hf_lrs("cosine", 10, 4)[10] / PEAK, abs=1e-12)


def test_a_torch_scheduler_by_name_with_its_kwargs():
    seen = dtrain_lrs(10, name="StepLR", kwargs={"step_size": 3, "gamma": 0.5})
    assert [lrs[0] for lrs in seen] == [PEAK * 0.5 ** (step // 3) for step in range(11)]
    # CosineAnnealingLR's T_max is the run's steps unless given
    seen = dtrain_lrs(TOTAL, name="cosineannealinglr")
    assert seen[TOTAL][0] == pytest.approx(0.0, abs=1e-12) and seen[TOTAL // 2][0] == pytest.approx(PEAK / 2)


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("AdamW", torch.optim.AdamW),
        ("adamw", torch.optim.AdamW),
        ("SGD", torch.optim.SGD),
        ("Adagrad", torch.optim.Adagrad),
        ("rmsprop", torch.optim.RMSprop),
        ("NAdam", torch.optim.NAdam),
        ("Adafactor", torch.optim.Adafactor),
    ],
)
def test_every_torch_optimizer_by_name(name, cls):
    optimizer = build_optimizer(OptimizerConfig(name=name, lr=0.1), torch.nn.Linear(2, 2))
    assert type(optimizer) is cls and optimizer.defaults["lr"] == 0.1


def test_optimizer_kwargs_and_the_adam_familys_betas():
    config = Config.from_dict(
        {
            "optimizer": {
                "name": "Adam",
                "lr": 1e-3,
                "betas": [0.9, 0.95],
                "weight_decay": 0.1,
                "kwargs": {"amsgrad": True},
            }
        }
    ).optimizer
    optimizer = build_optimizer(config, torch.nn.Linear(2, 2))
    assert optimizer.defaults["betas"] == (0.9, 0.95) and optimizer.defaults["amsgrad"] is True
    rms = build_optimizer(
        Config.from_dict({"optimizer": {"name": "RMSprop", "kwargs": {"alpha": 0.9, "momentum": 0.5}}}).optimizer,
        torch.nn.Linear(2, 2),
    )
    assert rms.defaults["alpha"] == 0.9 and rms.defaults["momentum"] == 0.5


def gpt():
    torch.manual_seed(0)
    return GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.0, bias=True)


def nanogpt_decay_split(model):
    """nanoGPT's configure_optimizers (model.py, karpathy/nanoGPT), its selection of what decays, verbatim:

    param_dict = {pn: p for pn, p in self.named_parameters()}
    param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
    decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
    nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
    """
    param_dict = {pn: p for pn, p in model.named_parameters()}
    param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
    decay = {n for n, p in param_dict.items() if p.dim() >= 2}
    nodecay = {n for n, p in param_dict.items() if p.dim() < 2}
    return decay, nodecay


def test_default_no_decay_is_nanogpts_configure_optimizers():
    """optimizer.no_decay's default (ndim<2) decays exactly what nanoGPT decays on the built-in GPT: every
    matrix, embeddings included (and the tied lm_head once); biases and LayerNorm weights do not decay."""
    model = gpt()
    optimizer = build_optimizer(OptimizerConfig(name="AdamW", lr=1e-3, weight_decay=0.1), model)
    decay, nodecay = nanogpt_decay_split(model)
    assert decayed_names(model, optimizer.param_groups) == decay
    assert {"wte.weight", "wpe.weight"} <= decay and any(n.endswith("bias") for n in nodecay)
    # Hugging Face Trainer's rule (no LayerNorm, no name with bias or norm) selects the same on this model
    # (it names the tied lm_head.weight too: the same tensor as wte.weight).
    from transformers import Trainer

    assert set(Trainer.get_decay_parameter_names(None, model)) - {"lm_head.weight"} == decay
    held = [p for g in optimizer.param_groups for p in g["params"]]
    assert len(held) == len({id(p) for p in held}) == len(decay) + len(nodecay)  # every parameter once
    # "embeddings" exempts them too (the wording); [] decays everything (dtrain before).
    with_embeddings = OptimizerConfig(name="AdamW", weight_decay=0.1, no_decay=["ndim<2", "embeddings"])
    assert decayed_names(model, build_optimizer(with_embeddings, model).param_groups) == decay - {
        "wte.weight",
        "wpe.weight",
    }
    everything = OptimizerConfig(name="AdamW", weight_decay=0.1, no_decay=[])
    assert decayed_names(model, build_optimizer(everything, model).param_groups) == decay | nodecay


def test_groups_by_pattern_take_their_own_settings():
    model = gpt()
    config = OptimizerConfig(
        name="AdamW", lr=1e-3, weight_decay=0.1, groups=[{"params": ["h.0.*"], "lr": 1e-4, "betas": [0.8, 0.9]}]
    )
    optimizer = build_optimizer(config, model)
    by_id = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    named = dict(model.named_parameters())
    first_block = [n for n in named if n.startswith("h.0.")]
    assert first_block and all(by_id[id(named[n])]["lr"] == 1e-4 for n in first_block)
    assert all(by_id[id(named[n])]["betas"] == (0.8, 0.9) for n in first_block)
    assert all(by_id[id(p)]["lr"] == 1e-3 for n, p in named.items() if n not in first_block)
    assert by_id[id(named["h.0.ln_1.weight"])]["weight_decay"] == 0.0  # no_decay holds inside a group
