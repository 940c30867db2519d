"""A job described in TOML: typed sections, `key=value` overrides, validation with one-line answers.

Every setting is declared once, below, with its type, default, bounds and a sentence of help; loading,
overriding, validating, writing `config.toml` and the README's reference table all come from that one
declaration.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

import tomli_w

from dtrain.errors import ConfigError

_MISSING = dataclasses.MISSING


def setting(
    default: Any,
    help: str,
    *,
    min: float | None = None,
    max: float | None = None,
    above: float | None = None,
    booleans: tuple[str, str] | None = None,
) -> Any:
    """Declare one config key: `min`/`max` are inclusive bounds, `above` an exclusive lower bound;
    `booleans` the choices that false and true stand for."""
    meta = {"help": help, "min": min, "max": max, "above": above, "booleans": booleans}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


_FLOAT32_MAX = 3.4028234663852886e38
_A_YEAR = 365 * 24 * 3600  # seconds: no wait a job sets needs more, and clocks overflow far beyond


@dataclass
class RunConfig:
    dir: str = setting(
        "runs/dtrain", "Where the run writes config.toml, metrics.jsonl, TensorBoard events and model.safetensors."
    )
    seed: int = setting(
        0, "Seeds model init, the data order (as DistributedSampler(seed=...)) and synthetic data.", min=0
    )
    overwrite: bool = setting(
        False,
        "Start afresh even when run.dir holds an earlier run: its outputs "
        "(checkpoints included) are deleted first. Off: such a run.dir is resumed "
        "from its newest checkpoint, or refused when it has none.",
    )
    allow_other_files: bool = setting(
        False,
        "Write into a run.dir that holds files dtrain did not write "
        "(they are left alone). Off: such a run.dir is refused.",
    )


@dataclass
class DistributedConfig:
    strategy: Literal["ddp", "fsdp", "hsdp"] = setting(
        "ddp",
        "ddp: every process holds the whole model. fsdp: parameters, gradients and optimizer state "
        "sharded over the processes (FSDP2). hsdp: sharded within a node, replicated across nodes.",
    )
    fsdp_units: list[str] = setting(
        [],
        "Module class names of the model's blocks: FSDP's units, and what "
        "activation checkpointing and compile=blocks work on (default: the model's "
        "_no_split_modules — its transformer blocks — else its ModuleList entries).",
    )
    reshard_after_forward: bool = setting(
        True, "FSDP: free each unit's gathered parameters after its forward (less memory; gathered again for backward)."
    )
    fsdp_cpu_offload: bool = setting(
        False, "FSDP on GPUs: keep parameters, gradients and optimizer state on the CPU between uses."
    )
    hsdp_shard_size: int = setting(
        0, "hsdp: processes per shard group (0: the processes of one node).", min=0, max=2**20
    )
    backend: Literal["auto", "nccl", "gloo"] = setting(
        "auto", "auto picks nccl when CUDA GPUs are visible, gloo otherwise."
    )
    init_method: str = setting(
        "env://", "env:// (torchrun, SLURM, Open MPI set it up), tcp://host:port or file:///shared/path."
    )
    timeout_s: float = setting(
        1800.0,
        "Seconds a collective may wait before the backend gives up (at least 5: "
        "setting up the group alone takes a moment).",
        min=5,
        max=_A_YEAR,
    )
    hang_timeout_s: float = setting(
        300.0,
        "Seconds without any rank finishing a step before every rank "
        "writes its Python stacks to run.dir/diagnostics and the job ends "
        "naming the ranks behind (0: off). Keep it below timeout_s.",
        min=0,
        max=_A_YEAR,
    )
    bucket_cap_mb: float = setting(25.0, "DDP gradient bucket size in MiB.", above=0, max=2**20)
    gradient_as_bucket_view: bool = setting(True, "Let gradients alias DDP's buckets (saves a copy and memory).")
    static_graph: bool = setting(False, "Tell DDP the graph is the same every step (enables optimisations).")
    find_unused_parameters: bool = setting(
        False, "Let DDP handle parameters the forward pass does not use (costs a graph walk per step)."
    )
    shared_memory_allreduce: bool = setting(
        True,
        "On CPU, average the gradients of processes on one "
        "machine through shared memory instead of gloo's loopback "
        "TCP (same numbers, less time).",
    )
    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = setting(
        "none",
        "Compress gradients before DDP's all-reduce with torch's own comm hook: fp16, bf16 "
        "(nccl only) — half the bytes — or powersgd (low-rank; its error-feedback state is not "
        "checkpointed). none: DDP's plain all-reduce (on CPU, the shared-memory average).",
    )


@dataclass
class ModelConfig:
    name: str = setting(
        "mlp",
        "mlp (the guide's Linear-ReLU-Linear), cnn, gpt (a decoder-only transformer for "
        "data.name=tokens), or a factory 'package.module:function'.",
    )
    hidden_size: int = setting(1024, "Hidden width of the built-in mlp.", min=1, max=2**20)
    options: dict = setting(
        {}, "Keyword arguments passed to a model factory (gpt: n_layer, n_head, n_embd, block_size, dropout, bias)."
    )


@dataclass
class DataConfig:
    name: str = setting(
        "digits",
        "digits (ships with scikit-learn), mnist (IDX files), synthetic, tokens "
        "(shards made by `dtrain prepare`), or a factory 'package.module:function'.",
    )
    path: str = setting(
        "data/mnist",
        "Folder holding the four MNIST IDX files (plain or .gz), or the token shards and meta.json (data.name=tokens).",
    )
    block_size: int = setting(
        256,
        "Tokens per training window (data.name=tokens): each sample is block_size inputs and their next tokens.",
        min=1,
        max=2**20,
    )
    download: bool = setting(False, "Download MNIST into data.path when the files are missing.")
    batch_size: int = setting(64, "Samples per micro-batch, per process.", min=1, max=2**24)
    eval_batch_size: int = setting(512, "Samples per evaluation batch, per process.", min=1, max=2**24)
    eval_fraction: float = setting(0.2, "Share held out for evaluation (digits, synthetic).", above=0, max=0.9)
    drop_last: bool = setting(False, "Drop each epoch's last, partial batch.")
    num_samples: int = setting(60000, "Size of the synthetic data set.", min=1, max=2**31)
    input_shape: list[int] = setting([1, 28, 28], "Sample shape of the synthetic data set.")
    num_classes: int = setting(
        10, "Classes of the synthetic data set (and of factory data sets that cannot say).", min=2
    )
    on_device: bool = setting(True, "Hold tensor data sets on the GPU and gather batches there.")
    num_workers: int = setting(0, "DataLoader worker processes (map-style data sets only).", min=0, max=1024)
    pin_memory: bool = setting(True, "Pin host batches for faster copies to the GPU (DataLoader, CUDA only).")
    persistent_workers: bool = setting(True, "Keep DataLoader workers alive between epochs.")
    prefetch_factor: int = setting(2, "Batches each DataLoader worker loads ahead.", min=1, max=2**16)


@dataclass
class OptimizerConfig:
    name: Literal["sgd", "adamw"] = setting("sgd", "sgd (with momentum) or adamw.")
    lr: float = setting(0.01, "Peak learning rate.", above=0)
    momentum: float = setting(0.9, "SGD momentum.", min=0, max=1)
    nesterov: bool = setting(False, "Nesterov momentum for SGD.")
    weight_decay: float = setting(0.0, "Weight decay (decoupled for adamw).", min=0)
    betas: list[float] = setting([0.9, 0.999], "AdamW betas.")
    eps: float = setting(1e-8, "AdamW epsilon.", above=0)


@dataclass
class SchedulerConfig:
    name: Literal["constant", "cosine", "linear"] = setting(
        "constant", "Learning-rate shape after warm-up: constant, cosine or linear decay."
    )
    warmup_steps: int = setting(0, "Optimizer steps of linear warm-up from 0 to optimizer.lr.", min=0)
    min_lr_ratio: float = setting(0.0, "Where cosine and linear decay end, as a share of optimizer.lr.", min=0, max=1)


@dataclass
class TrainingConfig:
    epochs: int = setting(10, "Passes over the training set.", min=1)
    max_steps: int = setting(0, "Stop after this many optimizer steps (0: no limit).", min=0)
    grad_accum_steps: int = setting(
        1, "Micro-batches per optimizer step; all but the last skip the gradient all-reduce.", min=1
    )
    precision: Literal["fp32", "bf16", "fp16"] = setting(
        "fp32", "fp32, bf16 autocast (CPU or CUDA) or fp16 autocast with GradScaler (CUDA)."
    )
    tf32: bool = setting(
        True,
        "On GPUs with TF32 tensor cores (Ampere and newer), run fp32 matmuls "
        "in TF32 (torch.set_float32_matmul_precision('high')); false: full FP32.",
    )
    max_grad_norm: float = setting(0.0, "Clip gradients to this global norm and log the norm (0: no clipping).", min=0)
    log_every: int = setting(
        10, "Optimizer steps between logged lines; losses are read from the device only then.", min=1
    )
    eval_every: int = setting(1, "Epochs between evaluations (the last epoch always evaluates; 0: only then).", min=0)
    activation_checkpointing: Literal["none", "full", "selective"] = setting(
        "none",
        "Recompute activations in backward instead of keeping them, block by block: full keeps only "
        "each block's input; selective also keeps matmul and attention outputs (less memory than none, less "
        "recomputation than full).",
    )
    compile: Literal["none", "blocks", "model"] = setting(
        "none",
        "torch.compile: blocks compiles each block (fast to compile; true means this), model the "
        "whole forward. The first step, which compiles, is reported on its own line and left out of "
        "throughput.",
        booleans=("none", "blocks"),
    )
    stop_at_step: int = setting(
        0,
        "End this run after this optimizer step with a checkpoint, keeping "
        "the schedule of the whole run; a later resume continues (0: off).",
        min=0,
    )


@dataclass
class MonitorConfig:
    breakdown: bool = setting(
        True,
        "Split every step into data wait, forward+backward, gradient "
        "communication and optimizer (no host sync: CUDA events on GPUs) and "
        "compare ranks at each log step.",
    )
    straggler_margin: float = setting(
        0.25, "Name a rank whose busy time per step exceeds the median by this share.", above=0
    )
    peak_tflops: float = setting(0.0, "Peak TFLOP/s of one device for MFU (0: known GPUs only).", min=0)
    flops: Literal["auto", "yes", "no"] = setting(
        "auto",
        "Count model FLOPs per sample once with torch's FLOP counter (about 2 s at start-up): "
        "auto does it where MFU can be reported (a known GPU, or monitor.peak_tflops set).",
    )
    trackers: list[str] = setting(
        ["tensorboard"],
        "Where metrics go besides metrics.jsonl: tensorboard, mlflow "
        "(run.dir/mlruns unless MLFLOW_TRACKING_URI), wandb (run.dir/wandb; honours "
        "WANDB_MODE=offline). Rank 0 only; [] for none.",
    )
    debug: bool = setting(
        False,
        "torch's distributed debug mode: TORCH_DISTRIBUTED_DEBUG=DETAIL on nccl "
        "(every collective's shapes checked across ranks; slower; for finding "
        "desyncs), INFO on gloo (DETAIL crashes DDP on gloo in torch 2.13).",
    )


@dataclass
class ProfileConfig:
    steps: str = setting(
        "",
        'Optimizer steps to trace with torch.profiler, e.g. "20-25"; one trace '
        "per rank under run.dir/profile (Perfetto, TensorBoard). Empty: off.",
    )


@dataclass
class CheckpointConfig:
    every_steps: int = setting(
        0,
        "Write a checkpoint every this many optimizer steps and at the end "
        "(0: only on SIGTERM or training.stop_at_step, and at the end of a run "
        "that resumed from one, so that a rerun finds it complete).",
        min=0,
    )
    keep: int = setting(3, "Complete checkpoints kept; older ones are deleted (never the newest).", min=1)
    resume: Literal["auto", "yes", "no"] = setting(
        "auto",
        "auto: continue from the newest complete checkpoint in run.dir if there is one; yes: "
        "must (what --resume sets); no: start fresh, refusing a run.dir that holds checkpoints.",
    )
    preempt_grace_s: float = setting(
        120.0,
        "Seconds workers get after SIGTERM to finish the step and write their checkpoint before torchrun kills them.",
        above=0,
        max=_A_YEAR,
    )


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config") -> Config:
        """Build and validate a config from nested dicts (as TOML gives them)."""
        config = cls()
        for section_name, table in raw.items():
            section = _section(config, section_name, source)
            if not isinstance(table, Mapping):
                raise ConfigError(
                    f"'{section_name}' {where(source)} must be a table of keys "
                    f"([{section_name}]), got {_describe(table)}"
                )
            for key, value in table.items():
                _assign(section, f"{section_name}.{key}", value, source)
        validate(config)
        return config

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())

    def with_overrides(self, overrides: Sequence[str]) -> Config:
        """A copy with `section.key=value` overrides applied (values parse as TOML, else as text)."""
        config = Config.from_dict(self.to_dict())
        for item in overrides:
            key, sep, text = item.partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"override '{item}' is not key=value; e.g. training.epochs=3")
            key = key.strip()
            section_name, _, name = key.partition(".")
            section = _section(config, section_name, "on the command line", full_key=key)
            if not name:
                raise ConfigError(
                    f"override '{item}' names a section, not a key; e.g. {section_name}.{_field_names(section)[0]}=..."
                )
            _assign(section, key, _parse_value(text), "on the command line", raw_text=text)
        validate(config)
        return config


SECTIONS = [f.name for f in dataclasses.fields(Config)]


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read a TOML job description (or start from defaults) and apply command-line overrides."""
    if path is None:
        return Config().with_overrides(overrides)
    path = Path(path)
    if path.exists() and not path.is_dir() and not path.is_file():  # a device, a FIFO: endless or blocking
        raise ConfigError(f"config file {path} is not a regular file; pass a TOML file")
    try:
        with path.open("rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(
            f"config file {path} does not exist; pass a TOML file such as examples/digits_mlp.toml"
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory; pass a TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start}); TOML files are UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read ({exc.strerror or exc})") from None
    return Config.from_dict(raw, source=str(path)).with_overrides(overrides)


def all_keys() -> list[str]:
    """Every `section.key` a config accepts."""
    config = Config()
    return [f"{s}.{f.name}" for s in SECTIONS for f in dataclasses.fields(getattr(config, s))]


def reference_rows() -> list[tuple[str, str, str]]:
    """(key, default, help) for every setting: the README's config reference comes from here."""
    config = Config()
    rows = []
    for s in SECTIONS:
        section = getattr(config, s)
        for f in dataclasses.fields(section):
            rows.append((f"{s}.{f.name}", _inline(getattr(section, f.name)), f.metadata["help"]))
    return rows


# --- validation ---------------------------------------------------------------------------------


def validate(config: Config) -> None:
    """Checks that involve more than one key or a value's format."""
    if not config.run.dir.strip():
        raise ConfigError(
            "run.dir is empty (an unset shell variable?); give the folder the run writes to, e.g. run.dir=runs/first"
        )
    # A path the shell did not expand (run.dir=~/runs/x is one argument, not an assignment): expand it,
    # rather than make a folder called "~" in the current one.
    config.run.dir = os.path.expanduser(config.run.dir)
    config.data.path = os.path.expanduser(config.data.path)
    trackers = config.monitor.trackers
    unknown = [t for t in trackers if t not in ("tensorboard", "mlflow", "wandb")]
    if unknown or len(set(trackers)) != len(trackers):
        raise ConfigError(
            f"monitor.trackers = {trackers}: each of tensorboard, mlflow, wandb at most once"
            + (f"; '{unknown[0]}' is none of them" if unknown else "")
        )
    if config.run.overwrite and config.checkpoint.resume == "yes":
        raise ConfigError(
            "run.overwrite=true starts afresh and --resume (checkpoint.resume=yes) continues "
            "from a checkpoint: choose one"
        )
    scheme = config.distributed.init_method.split("://", 1)[0]
    if "://" not in config.distributed.init_method or scheme not in ("env", "tcp", "file"):
        raise ConfigError(
            f"distributed.init_method = '{config.distributed.init_method}' is not "
            f"supported; use env://, tcp://host:port or file:///path"
        )
    problem = _init_method_problem(config.distributed.init_method)
    if problem:
        raise ConfigError(f"distributed.init_method = '{config.distributed.init_method}' {problem}")
    for key, value, builtins in (
        ("model.name", config.model.name, ("mlp", "cnn", "gpt")),
        ("data.name", config.data.name, ("digits", "mnist", "synthetic", "tokens")),
    ):
        if value not in builtins and not _is_factory_ref(value):
            close = difflib.get_close_matches(value, builtins, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(
                f"{key} = '{value}' is neither a built-in ({', '.join(builtins)}) nor "
                f"a factory 'package.module:function'; {hint}".rstrip("; ")
            )
    if config.optimizer.name == "sgd" and config.optimizer.nesterov and config.optimizer.momentum == 0:
        raise ConfigError(
            "optimizer.nesterov = true needs momentum: set optimizer.momentum above 0 (0.9 is usual), "
            "or optimizer.nesterov=false"
        )
    if len(config.optimizer.betas) != 2 or not all(0 <= b < 1 for b in config.optimizer.betas):
        raise ConfigError(
            f"optimizer.betas = {config.optimizer.betas} must be two numbers in [0, 1), e.g. [0.9, 0.999]"
        )
    hang, timeout = config.distributed.hang_timeout_s, config.distributed.timeout_s
    if 0 < hang < 1:
        raise ConfigError(
            f"distributed.hang_timeout_s = {hang:g} would call every step a hang; use 0 (off) or at least 1 second"
        )
    if hang and hang >= timeout:
        raise ConfigError(
            f"distributed.hang_timeout_s = {hang:g} must be below distributed.timeout_s = "
            f"{timeout:g}, or the backend gives up first and the hang goes unexplained"
        )
    if config.profile.steps and profile_range(config.profile.steps) is None:
        raise ConfigError(
            f"profile.steps = '{config.profile.steps}' is not a step range; write it like "
            f'"20-25" (first and last optimizer step, from 1)'
        )
    if not config.data.input_shape or any(d < 1 for d in config.data.input_shape):
        raise ConfigError(
            f"data.input_shape = {config.data.input_shape} must be a list of positive sizes, e.g. [1, 28, 28]"
        )
    if config.data.name == "synthetic" and math.prod(config.data.input_shape) * config.data.num_samples > 2**34:
        raise ConfigError(
            f"data.input_shape = {config.data.input_shape} × data.num_samples = "
            f"{config.data.num_samples} is over 2^34 values (64 GiB of float32) for the synthetic "
            f"data set; use fewer samples or smaller inputs"
        )


def profile_range(text: str) -> tuple[int, int] | None:
    """'20-25' -> (20, 25); '7' -> (7, 7); None when malformed."""
    first, _, last = text.strip().partition("-")
    last = last or first
    if not (first.strip().isdigit() and last.strip().isdigit()):
        return None
    a, b = int(first), int(last)
    return (a, b) if 1 <= a <= b < 2**63 else None


def _is_factory_ref(value: str) -> bool:
    module, sep, func = value.partition(":")
    return bool(sep and module and func and all(p.isidentifier() for p in module.split(".")) and func.isidentifier())


def _init_method_problem(url: str) -> str | None:
    """What torch could not use in a tcp:// or file:// init method (it would fail in every worker, or
    wait for a file that can never be made), or None."""
    scheme, rest = url.split("://", 1)
    if scheme == "tcp":
        host, _, port = rest.split("/", 1)[0].rpartition(":")
        if not port.isdigit() or not 0 < int(port) < 65536:
            return "needs a port: tcp://host:port (1-65535)"
        if not host.strip("[]"):
            return "needs a host: tcp://host:port (rank 0's address)"
    if scheme == "file":
        path = rest.split("?", 1)[0]
        if not path.startswith("/") or path == "/":
            return "needs an absolute file path on a shared file system: file:///shared/path/rendezvous"
        if not os.path.isdir(os.path.dirname(path)):
            return (
                f"names a file in {os.path.dirname(path)}, which is not a folder here; use a folder every node shares"
            )
    return None


def _section(config: Config, name: str, source: str, full_key: str | None = None):
    if name in SECTIONS:
        return getattr(config, name)
    wanted = full_key or name
    candidates = all_keys() if "." in wanted else SECTIONS
    close = difflib.get_close_matches(wanted, candidates, n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else f"; sections are {', '.join(SECTIONS)}"
    raise ConfigError(f"unknown {'key' if '.' in wanted else 'section'} '{wanted}' {where(source)}{hint}")


def _field_names(section) -> list[str]:
    return [f.name for f in dataclasses.fields(section)]


def _assign(section, key: str, value: Any, source: str, raw_text: str | None = None) -> None:
    section_name, _, name = key.partition(".")
    name, _, subkey = name.partition(".")
    fields_by_name = {f.name: f for f in dataclasses.fields(section)}
    if name not in fields_by_name:
        close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else f"; [{section_name}] has {', '.join(fields_by_name)}"
        raise ConfigError(f"unknown key '{key}' {where(source)}{hint}")
    f = fields_by_name[name]
    type_ = typing.get_type_hints(type(section))[name]
    if subkey:  # a key inside a free table, e.g. model.options.depth=3
        if type_ is not dict:
            raise ConfigError(f"'{key}' {where(source)}: {section_name}.{name} is not a table")
        getattr(section, name)[subkey] = value
        return
    setattr(section, name, _coerce(f"{section_name}.{name}", value, type_, f.metadata, raw_text))


def _coerce(key: str, value: Any, type_: Any, meta: Mapping[str, Any], raw_text: str | None) -> Any:
    origin = typing.get_origin(type_)
    if origin is Literal:
        choices = typing.get_args(type_)
        if isinstance(value, bool) and meta.get("booleans"):
            return meta["booleans"][value]
        if value not in choices:
            lowered = {c.lower(): c for c in choices}
            close = difflib.get_close_matches(str(value).lower(), list(lowered), n=1)
            hint = f"; did you mean '{lowered[close[0]]}'?" if close else ""
            also = " (or true, false)" if meta.get("booleans") else ""
            raise ConfigError(f"{key} must be one of {', '.join(choices)}{also}; got {_show(value)}{hint}")
        return value
    if origin is list:
        (item_type,) = typing.get_args(type_)
        if not isinstance(value, list):
            example = '["a", "b"]' if item_type is str else "[1, 2]"
            raise ConfigError(f"{key} must be a list, e.g. {key}={example}; got {_describe(value)}")
        return [_coerce(f"{key}[{i}]", v, item_type, meta, None) for i, v in enumerate(value)]
    if type_ is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table of keyword arguments; got {_describe(value)}")
        return dict(value)
    if type_ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false; got {_describe(value)}")
        return value
    if type_ is str:
        if raw_text is not None:  # from the command line: keep exactly what was typed
            value = raw_text.strip()
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string; got {_describe(value)}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # bytes from the command line that are not UTF-8 (surrogate escapes)
            raise ConfigError(
                f"{key} = {value!a} holds bytes that are not UTF-8 text; config.toml and "
                f"the logs are UTF-8: use UTF-8 names"
            ) from None
        return value
    if type_ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer; got {_describe(value)}")
        if not -(2**63) <= value < 2**63:  # TOML's integers are 64-bit; Python's parser is not
            raise ConfigError(f"{key} = {value} does not fit in 64 bits; use a smaller value")
    elif type_ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number; got {_describe(value)}")
        value = float(value)
        if not math.isfinite(value):  # TOML has nan and inf literals; nothing here can use them
            raise ConfigError(f"{key} must be a finite number; got {value}")
        if abs(value) > _FLOAT32_MAX:  # learning rates and the like end up in float32 tensors
            raise ConfigError(
                f"{key} = {value:g} is beyond what a 32-bit float holds (about 3.4e38); use a smaller value"
            )
    _check_bounds(key, value, meta)
    return value


def _check_bounds(key: str, value: float, meta: Mapping[str, Any]) -> None:
    lo, hi, above = meta.get("min"), meta.get("max"), meta.get("above")
    if lo is not None and value < lo:
        raise ConfigError(f"{key} must be >= {_num(lo)}; got {_num(value)}")
    if above is not None and value <= above:
        raise ConfigError(f"{key} must be > {_num(above)}; got {_num(value)}")
    if hi is not None and value > hi:
        raise ConfigError(f"{key} must be <= {_num(hi)}; got {_num(value)}")


def where(source: str) -> str:
    """'in examples/x.toml' or 'on the command line'."""
    return source if source.startswith("on ") else f"in {source}"


def _parse_value(text: str) -> Any:
    """A command-line value: a TOML literal when it is one (3, 0.05, true, [1, 2]), else text."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text.strip()


def _inline(value: Any) -> str:
    """A value as one line of TOML: 0.2, "digits", [1, 28, 28], {}."""
    if isinstance(value, list):
        return "[" + ", ".join(_inline(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_inline(v)}" for k, v in value.items()) + "}"
    return tomli_w.dumps({"v": value}).strip()[4:]


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _show(value: Any) -> str:
    return f"'{value}'" if isinstance(value, str) else repr(value)


def _describe(value: Any) -> str:
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "table"}.get(
        type(value), type(value).__name__
    )
    return f"{_show(value)} ({kind})"
