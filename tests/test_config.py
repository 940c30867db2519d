"""Config: TOML + overrides, typed, validated with one-line answers."""

import re

import pytest

from dtrain.config import Config, all_keys, load_config, reference_rows
from dtrain.errors import ConfigError
from helpers import ROOT


def test_defaults_and_required_keys_exist():
    keys = set(all_keys())
    for key in (
        "run.dir",
        "run.seed",
        "data.batch_size",
        "training.epochs",
        "training.grad_accum_steps",
        "training.precision",
        "training.max_grad_norm",
        "distributed.backend",
        "distributed.init_method",
        "ddp.bucket_cap_mb",
        "ddp.gradient_as_bucket_view",
        "ddp.static_graph",
        "ddp.find_unused_parameters",
        "data.num_workers",
        "data.pin_memory",
        "data.persistent_workers",
        "data.prefetch_factor",
        "training.log_every",
    ):
        assert key in keys
    c = Config()
    assert (c.distributed.backend, c.training.precision, c.data.name, c.model.name) == ("auto", "fp32", "digits", "mlp")


def test_file_then_overrides_with_toml_typed_values(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[training]\nepochs = 7\n[optimizer]\nlr = 0.5\n")
    c = load_config(
        path,
        [
            "training.epochs=3",
            "optimizer.lr=0.05",
            "run.dir=runs/x y",
            "data.input_shape=[3, 8, 8]",
            "training.precision=bf16",
            "ddp.static_graph=true",
            "optimizer.momentum=0",
        ],
    )
    assert c.training.epochs == 3
    assert c.optimizer.lr == 0.05
    assert c.run.dir == "runs/x y"
    assert c.data.input_shape == [3, 8, 8]
    assert c.training.precision == "bf16"
    assert c.ddp.static_graph is True
    assert c.optimizer.momentum == 0.0 and isinstance(c.optimizer.momentum, float)


def test_a_number_typed_into_a_text_key_stays_text():
    assert load_config(None, ["run.dir=123"]).run.dir == "123"


def test_a_toml_string_override_is_its_value():
    """Quotes that reach dtrain (quoted twice in the shell, or from Python) make a TOML string, whose value
    is the text between them: not a folder or data set whose name begins with a quote."""
    for override in ['run.dir="/x y"', "run.dir='/x y'", 'run.dir = "/x y" ']:
        assert load_config(None, [override]).run.dir == "/x y"
    assert load_config(None, ['data.name="tokens"']).data.name == "tokens"
    assert load_config(None, ["run.dir=runs/bob's", "data.name=tokens"]).run.dir == "runs/bob's"
    assert load_config(None, ['model.options.note="[a"']).model.options == {"note": "[a"}


def test_resolved_config_round_trips(tmp_path):
    c = load_config(ROOT / "examples" / "digits_mlp.toml", ["training.epochs=2", "model.options.unused=1"])
    out = tmp_path / "config.toml"
    out.write_text(c.to_toml())
    assert load_config(out) == c


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainig.epochs=3", "unknown key 'trainig.epochs' on the command line; did you mean 'training.epochs'?"),
        ("training.epoch=3", "did you mean 'training.epochs'?"),
        ("optimizer.learning_rate=0.1", "unknown key 'optimizer.learning_rate'"),
        ("training.epochs=three", "training.epochs must be an integer; got 'three' (string)"),
        ("training.epochs=2.5", "training.epochs must be an integer; got 2.5 (number)"),
        ("training.epochs=0", "training.epochs must be >= 1; got 0"),
        ("optimizer.lr=0", "optimizer.lr must be > 0; got 0"),
        ("optimizer.momentum=1.5", "optimizer.momentum must be <= 1; got 1.5"),
        ("training.precision=fp8", "training.precision must be one of fp32, bf16, fp16; got 'fp8'"),
        ("distributed.backend=ncl", "did you mean 'nccl'?"),
        ("ddp.static_graph=yes", "ddp.static_graph must be true or false"),
        ("data.input_shape=7", "data.input_shape must be a list"),
        ("distributed.init_method=udp://x:1", "distributed.init_method = 'udp://x:1' is not supported"),
        ("distributed.init_method=tcp://host", "needs a port"),
        ("model.name=mpl", "did you mean 'mlp'?"),
        ("data.name=my.module", "nor a factory 'package.module:function'"),
        ("optimizer.betas=[0.9]", "optimizer.betas = [0.9] must be two numbers"),
        ("epochs", "override 'epochs' is not key=value"),
        ("training=3", "names a section, not a key"),
        ("optimizer.lr=1e39", "optimizer.lr = 1e+39 is beyond what a 32-bit float holds (about 3.4e38)"),
        ("ddp.bucket_cap_mb=1e300", "ddp.bucket_cap_mb = 1e+300 is beyond what a 32-bit float holds"),
        ("distributed.timeout_s=1e30", "distributed.timeout_s must be <= 31536000; got 1e+30"),
        ("data.num_workers=99999", "data.num_workers must be <= 1024; got 99999"),
        ("distributed.timeout_s=0.01", "distributed.timeout_s must be >= 5; got 0.01"),
        ("distributed.hang_timeout_s=0.0001", "distributed.hang_timeout_s = 0.0001 would call every step a hang"),
        ("checkpoint.keep_best=loss", "checkpoint.keep_best = 'loss' is not a metric and a direction"),
        ("checkpoint.keep_best=eval_loss:lowest", "checkpoint.keep_best = 'eval_loss:lowest' is not a metric"),
        ("distributed.init_method=tcp://:29500", "needs a host: tcp://host:port"),
        ("distributed.init_method=tcp://h:0", "needs a port: tcp://host:port (1-65535)"),
        ("distributed.init_method=file://", "needs an absolute file path"),
        ("distributed.init_method=file:///no/such/dir/x", "names a file in /no/such/dir, which is not a folder here"),
        ("run.dir=runs/v\udcff", "run.dir = 'runs/v\\udcff' holds bytes that are not UTF-8 text"),
        ("training.compile=yes", "training.compile must be one of none, blocks, model (or true, false); got 'yes'"),
        ("parallel.strategy=FSDP", "did you mean 'fsdp'?"),
        (
            'run.dir="abc',
            'run.dir = "abc on the command line: its quotes do not pair up into one string; write run.dir=abc',
        ),
        ("run.dir=abc'", "its quotes do not pair up into one string; write run.dir=abc"),
        ('data.name=my"data', "its quotes do not pair up into one string; write data.name=mydata"),
        ('run.dir="', 'run.dir = " on the command line: a lone quote is no value; write run.dir=VALUE'),
        (
            "data.input_shape=[1, 2",
            "data.input_shape = [1, 2 on the command line: its '[' is never closed; quote the whole override for "
            "the shell, e.g. 'data.input_shape=[1, 2]'",
        ),
        ("data.input_shape=[1,", "its '[' is never closed: the shell split it at a space; quote the whole override"),
        ("run.dir=x]", "run.dir = x] on the command line: its ']' closes nothing; leave it out, or write a whole"),
        ("model.options={a = 1", "its '{' is never closed; quote the whole override for the shell, e.g. 'model.op"),
        # optimizers and schedules (any of torch's by name, their own keyword arguments)
        (
            "optimizer.name=adamx",
            "optimizer.name = 'adamx' is not an optimizer dtrain can step; use one of torch.optim's",
        ),
        ("optimizer.name=adamx", "did you mean 'Adamax'?"),
        ("optimizer.name=LBFGS", "(LBFGS needs a closure that re-evaluates the loss)"),
        (
            "optimizer.kwargs={amsgrad = true}",
            "optimizer.kwargs has 'amsgrad', which SGD does not take; it takes dampening",
        ),
        ("optimizer.kwargs={lr = 1}", "optimizer.kwargs has 'lr': set optimizer.lr instead"),
        ("optimizer.betas=[0.9, 0.95]", "optimizer.betas is set and SGD does not use it; leave it out"),
        ("optimizer.groups=[{lr = 1e-4}]", "optimizer.groups[0] needs params, a name pattern or a list of them"),
        ("optimizer.groups=[{params = 'a', lr = -1}]", "optimizer.groups[0].lr must be a number >= 0; got -1"),
        ('optimizer.groups=[{params = "a", alpha = 1}]', "optimizer.groups[0] has 'alpha', which SGD does not take"),
        ('optimizer.no_decay=[""]', "optimizer.no_decay holds an empty pattern"),
        ("scheduler.name=cosin", "scheduler.name = 'cosin' is no schedule; use one of constant, constant_with_warmup"),
        ("scheduler.name=cosin", "did you mean 'cosine'?"),
        ("scheduler.name=steplr", "scheduler.name = StepLR needs step_size: scheduler.kwargs = {step_size = ...}"),
        (
            "scheduler.kwargs={num_cycles = 2}",
            "scheduler.kwargs has 'num_cycles', which scheduler.name = constant does",
        ),
        (
            "scheduler.name=warmup_stable_decay",
            "needs the length of its decay: scheduler.kwargs = {num_decay_steps = N}",
        ),
    ],
)
def test_bad_overrides_get_one_clear_line(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    text = str(info.value)
    assert message in text
    assert "\n" not in text


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.options.n_layer=0"], "model.options.n_layer must be >= 1; got 0"),
        (["model.options.n_head=0"], "model.options.n_head must be >= 1; got 0"),
        (["model.options.n_embd=-8"], "model.options.n_embd must be >= 1; got -8"),
        (["model.options.block_size=0"], "model.options.block_size must be >= 1; got 0"),
        (["model.options.dropout=1.5"], "model.options.dropout must be <= 1; got 1.5"),
        (["model.options.n_layer=two"], "model.options.n_layer must be an integer; got 'two' (string)"),
        (["model.options.bias=1"], "model.options.bias must be true or false; got 1 (integer)"),
    ],
)
def test_built_in_gpt_options_that_cannot_build_are_refused(overrides, message):
    """The built-in models' options have types and bounds as keys do: refused where the config is read
    (dtrain config, the launcher, load_config), not by torch in every worker."""
    with pytest.raises(ConfigError) as info:
        load_config(ROOT / "examples" / "gpt_stdlib.toml", overrides)
    assert str(info.value) == message
    for model, key in (("mlp", "hidden_size"), ("cnn", "channels")):
        with pytest.raises(ConfigError, match=rf"^model.options.{key} must be >= 1; got 0$"):
            load_config(None, [f"model.name={model}", f"model.options.{key}=0"])
    gpt = load_config(ROOT / "examples" / "gpt_stdlib.toml", ["model.options.dropout=0"]).model.options
    assert gpt["dropout"] == 0.0 and isinstance(gpt["dropout"], float)


def test_a_script_with_its_own_model_may_leave_model_name_as_it_is():
    """load_config does not compare model.name with the data: a script that hands Trainer its own model
    (examples/hf_causal_lm.py: token data, model.name left at mlp) never uses it. dtrain run and dtrain
    config, which build model.name, refuse a model that cannot train on the data (test_cli_errors)."""
    assert load_config(None, ["data.name=tokens"]).model.name == "mlp"


def test_optimizer_and_schedule_settings_that_cannot_work_are_refused_in_one_line():
    refusals = [
        (["optimizer.name=Rprop", "optimizer.weight_decay=0.1"], "optimizer.weight_decay is set and Rprop takes no"),
        (
            ["optimizer.name=Adagrad", "optimizer.kwargs={betas = [0.9, 0.9]}"],
            "optimizer.kwargs has 'betas', which Adagrad does not take; it takes lr_decay, initial_accumulator_value",
        ),
        (["scheduler.name=StepLR", "scheduler.warmup_steps=5"], "scheduler.warmup_steps shapes dtrain's own schedules"),
        (
            ["scheduler.name=StepLR", "scheduler.kwargs={size = 3}"],
            "scheduler.kwargs has 'size', which StepLR does not",
        ),
        (["scheduler.name=cosine", "scheduler.min_lr=1e-4", "scheduler.min_lr_ratio=0.1"], "set one of them"),
        (["scheduler.name=constant", "scheduler.decay_steps=10"], "constant never decays to a floor; leave it out"),
        (["scheduler.name=cosine", "scheduler.warmup_steps=10", "scheduler.decay_steps=10"], "ends the decay before"),
        (
            ["scheduler.name=warmup_stable_decay", "scheduler.kwargs={num_decay_steps = 5, decay_type = 'cube'}"],
            "scheduler.kwargs.decay_type = 'cube': use linear, cosine or 1-sqrt",
        ),
    ]
    for overrides, message in refusals:
        with pytest.raises(ConfigError) as info:
            load_config(None, overrides)
        assert message in str(info.value) and "\n" not in str(info.value), overrides
    assert load_config(None, ["optimizer.name=AdamW", "optimizer.betas=[0.9, 0.95]"]).optimizer.key == "adamw"
    assert load_config(None, ["optimizer.name=my.pkg:Opt", "optimizer.kwargs={anything = 1}"]).optimizer.kwargs


def test_settings_that_contradict_each_other_are_refused():
    with pytest.raises(ConfigError, match="optimizer.nesterov = true needs momentum"):
        load_config(None, ["optimizer.momentum=0", "optimizer.nesterov=true"])
    with pytest.raises(ConfigError, match="profile.steps = '1-99999999999999999999' is not a step range"):
        load_config(None, ["profile.steps=1-99999999999999999999"])


def test_compile_takes_true_and_false_for_its_usual_choices():
    assert load_config(None, ["training.compile=true"]).training.compile == "blocks"
    assert load_config(None, ["training.compile=false"]).training.compile == "none"
    assert load_config(None, ["training.compile=model"]).training.compile == "model"


def test_bad_files_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*missing\.toml does not exist"):
        load_config(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[training\nepochs = 3\n")
    with pytest.raises(ConfigError, match=r"broken\.toml is not valid TOML"):
        load_config(broken)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[trainer]\nepochs = 3\n")
    with pytest.raises(ConfigError, match=r"unknown section 'trainer' in .*unknown\.toml; did you mean 'training'\?"):
        load_config(unknown)
    flat = tmp_path / "flat.toml"
    flat.write_text("training = 3\n")
    with pytest.raises(ConfigError, match="'training' in .*flat.toml must be a table"):
        load_config(flat)


def test_readme_config_reference_lists_every_key_with_its_default():
    readme = (ROOT / "README.md").read_text()
    for key, default, _ in reference_rows():
        row = re.search(rf"^\| `{re.escape(key)}` \| `(.*?)` \|", readme, flags=re.M)
        assert row, f"README's config reference lacks {key}"
        assert row.group(1) == default, f"README says {key} defaults to {row.group(1)}, the code {default}"


def test_examples_are_valid():
    for path in sorted((ROOT / "examples").glob("*.toml")):
        load_config(path)


def test_a_misspelt_attribute_raises_instead_of_adding_itself():
    """The sections keep slots: a typo in code that sets a key is an error, not a silent new attribute."""
    config = Config()
    with pytest.raises(AttributeError, match="grad_acum_steps"):
        config.training.grad_acum_steps = 2
    with pytest.raises(AttributeError, match="trainig"):
        config.trainig = config.training
    config.training.grad_accum_steps = 2
    assert config.training.grad_accum_steps == 2


def test_the_built_in_models_declared_options_are_their_builders():
    """What the config checks of model.options (sections.MODEL_OPTIONS) is what each builder takes, and
    each built-in model and data set says what kind of samples it takes or gives."""
    import inspect

    from dtrain import models
    from dtrain.config.model import DATA_GIVES, MODEL_OPTIONS, MODEL_TAKES

    for name, builder in models.BUILT_IN.items():
        params = set(inspect.signature(builder).parameters) - {"input_shape", "num_classes"}
        assert set(MODEL_OPTIONS[name]) == params, name
    assert set(MODEL_TAKES) == set(models.BUILT_IN)
    assert set(MODEL_TAKES.values()) == set(DATA_GIVES.values()) == {"tokens", "features"}


def test_a_key_in_another_frameworks_vocabulary_is_answered_with_the_dtrain_key_it_means(tmp_path):
    """Every name of the table, where a user puts it (under a section, or bare at the top of the file), is
    refused in one line naming dtrain's key — as the table says, or as the nearest spelling where that is the
    same key; never another key that is merely spelt alike (`learning_rate` is closest to `optimizer.name`)."""
    from dtrain.config.foreign import FOREIGN
    from dtrain.config.job import SECTIONS

    keys = set(all_keys())
    for name, (meaning, _) in FOREIGN.items():
        section = next(s for s in SECTIONS if f"{s}.{name}" not in keys)
        bare = [] if name in SECTIONS else [f"{name} = 1\n"]  # `optimizer = 1` is a section that is no table
        for text in (f"[{section}]\n{name} = 1\n", *bare):
            job = tmp_path / "job.toml"
            job.write_text(text)
            with pytest.raises(ConfigError) as refused:
                load_config(str(job))
            message = str(refused.value)
            assert meaning in message and "\n" not in message, (text, message)
    with pytest.raises(ConfigError) as refused:
        load_config(str(ROOT / "examples" / "digits_mlp.toml"), ["optimizer.learning_rate=0.2"])
    assert str(refused.value) == (
        "unknown key 'optimizer.learning_rate' on the command line; 'learning_rate' (Hugging Face, Accelerate, "
        "torchtitan) is optimizer.lr in dtrain"
    )
