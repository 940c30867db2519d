"""The config's sections, one dataclass each: every key declared once with `setting()` (settings.py),
and each section's check of its own keys (a value's format, keys that go together)."""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass
from typing import Any, Literal

from dtrain import objstore
from dtrain.config import torch_names
from dtrain.config.settings import A_YEAR, coerce, setting
from dtrain.errors import ConfigError


class Section:
    """What every section offers besides its keys."""

    __slots__ = ()  # the sections keep slots: a misspelt attribute raises instead of adding itself

    def check(self) -> None:
        """This section's own rules beyond each key's type and bounds (validate() runs it)."""


@dataclass(slots=True)
class RunConfig(Section):
    dir: str = setting(
        "runs/dtrain",
        "Where the run writes config.toml, metrics.jsonl, TensorBoard events, checkpoints and model.safetensors: "
        "a folder, or s3://bucket/prefix (staged in a local cache folder and kept equal to the store; "
        "credentials from boto's environment).",
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

    def check(self) -> None:
        if not self.dir.strip():
            raise ConfigError(
                "run.dir is empty (an unset shell variable?); give the folder the run writes to, "
                "e.g. run.dir=runs/first"
            )
        if "\0" in self.dir:
            # An escape in a quoted override ("\u0000") reaches no file system call: refuse it here, where
            # it would otherwise end the launcher in a traceback.
            raise ConfigError(
                f"run.dir = {self.dir!r} holds a NUL character, which no path can; e.g. run.dir=runs/first"
            )
        if objstore.credentials_in(self.dir):  # it would be written into config.toml and the logs
            raise ConfigError(
                f"run.dir = '{objstore.without_credentials(self.dir)}' carries a password in the URL; give "
                f"credentials through the store's environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a "
                f"profile) and only the URL here"
            )
        if objstore.is_url(self.dir) and objstore.protocol(self.dir) not in ("s3", "s3a"):
            # Its lock is a lease object taken with a conditional write, which only S3's protocol offers.
            raise ConfigError(
                f"run.dir = '{self.dir}': a run.dir on object storage must be on an S3-compatible store "
                f"(s3://bucket/prefix); use a local folder for {objstore.protocol(self.dir)}://"
            )
        # A path the shell did not expand (run.dir=~/runs/x is one argument, not an assignment): expand it,
        # rather than make a folder called "~" in the current one.
        self.dir = os.path.expanduser(self.dir)


def _local_only(key: str, value: str, what: str, given: str = "") -> None:
    """Object storage is read for data.path and run.dir only: a URL elsewhere would be taken as a local path
    (pathlib turns "s3://b/p" into the folder "s3:/b/p" under the current one) and silently read there."""
    if objstore.is_url(value):
        shown = (given or value).replace(value, objstore.without_credentials(value))
        raise ConfigError(
            f"{key} = '{shown}' holds a URL, and dtrain reads object storage only "
            f"for data.path and run.dir; give {what} as a local path (or a mounted store's)"
        )


@dataclass(slots=True)
class DistributedConfig(Section):
    strategy: Literal["ddp", "fsdp", "hsdp"] = setting(
        "ddp",
        "ddp: every process holds the whole model. fsdp: parameters, gradients and optimizer state "
        "sharded over the processes (FSDP2). hsdp: sharded within a node, replicated across nodes.",
    )
    reshard_after_forward: bool = setting(
        True, "FSDP: free each unit's gathered parameters after its forward (less memory; gathered again for backward)."
    )
    fsdp_cpu_offload: bool = setting(
        False, "FSDP on GPUs: keep parameters, gradients and optimizer state on the CPU between uses."
    )
    hsdp_shard_size: int = setting(
        0,
        "hsdp: processes per shard group (0: the data-parallel processes of one node, of one pipeline stage).",
        min=0,
        max=2**20,
    )
    tp_size: int = setting(
        1,
        "Tensor parallel: processes each layer's weights are split over (inside one node; 1: off). "
        "The data-parallel processes are the world divided by tp_size × pp_size × cp_size.",
        min=1,
        max=2**20,
    )
    pp_size: int = setting(
        1,
        "Pipeline parallel: stages the model's blocks are split into, one group of processes each (1: off).",
        min=1,
        max=2**20,
    )
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = setting(
        "1f1b",
        "Pipeline schedule over the step's micro-batches (training.grad_accum_steps, at least pp_size): "
        "gpipe, 1f1b, or interleaved_1f1b (pp_stages_per_rank stages per process).",
    )
    pp_stages_per_rank: int = setting(
        0, "Pipeline stages each process holds (0: 2 under interleaved_1f1b, else 1).", min=0, max=2**10
    )
    pp_split: Literal["cost", "count"] = setting(
        "cost",
        "How the blocks are cut into pipeline stages: cost (about equal multiply-adds a stage: the head's "
        "stage takes fewer blocks) or count (equal numbers of blocks: closer in memory where the embedding is big).",
    )
    cp_size: int = setting(
        1,
        "Context parallel on CUDA GPUs: processes each sequence is split over (torch's context_parallel; 1: off).",
        min=1,
        max=2**20,
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
        max=A_YEAR,
    )
    hang_timeout_s: float = setting(
        300.0,
        "Seconds without any rank finishing a step before every rank "
        "writes its Python stacks to run.dir/diagnostics and the job ends "
        "naming the ranks behind (0: off). Keep it below timeout_s.",
        min=0,
        max=A_YEAR,
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

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each process holds: pp_stages_per_rank, or its default for the schedule."""
        return self.pp_stages_per_rank or (2 if self.pp_schedule == "interleaved_1f1b" else 1)

    def check(self) -> None:
        scheme = self.init_method.split("://", 1)[0]
        if "://" not in self.init_method or scheme not in ("env", "tcp", "file"):
            raise ConfigError(
                f"distributed.init_method = '{self.init_method}' is not "
                f"supported; use env://, tcp://host:port or file:///path"
            )
        problem = _init_method_problem(self.init_method)
        if problem:
            raise ConfigError(f"distributed.init_method = '{self.init_method}' {problem}")
        if self.pp_stages_per_rank == 1 and self.pp_schedule == "interleaved_1f1b":
            raise ConfigError(
                "distributed.pp_schedule = 'interleaved_1f1b' interleaves several stages per process; "
                "set distributed.pp_stages_per_rank to 2 or more (or 0: 2)"
            )
        if self.pp_stages_per_rank > 1 and self.pp_schedule != "interleaved_1f1b":
            raise ConfigError(
                f"distributed.pp_stages_per_rank = {self.pp_stages_per_rank} needs distributed.pp_schedule = "
                f"'interleaved_1f1b' ('{self.pp_schedule}' runs one stage per process); set it to 1"
            )
        hang, timeout = self.hang_timeout_s, self.timeout_s
        if 0 < hang < 1:
            raise ConfigError(
                f"distributed.hang_timeout_s = {hang:g} would call every step a hang; use 0 (off) or at least 1 second"
            )
        if hang and hang >= timeout:
            raise ConfigError(
                f"distributed.hang_timeout_s = {hang:g} must be below distributed.timeout_s = "
                f"{timeout:g}, or the backend gives up first and the hang goes unexplained"
            )


# What the built-in models take and the built-in data sets give: token ids (integers) or features
# (floating-point values, any shape: a model's shape rules are its builder's). And the built-in models'
# options, with types and bounds checked as keys' are: a size below 1 or a fraction outside [0, 1]
# builds nothing that trains.
# Hugging Face model folders as model.name: the class config.json names, or AutoModelForCausalLM.
HF_PREFIXES = ("hf:", "hf-causal-lm:")
MODEL_TAKES = {"mlp": "features", "cnn": "features", "gpt": "tokens"}
DATA_GIVES = {"digits": "features", "mnist": "features", "synthetic": "features", "tokens": "tokens"}
_SIZE = {"min": 1, "max": 2**20}
MODEL_OPTIONS: dict[str, dict[str, tuple[type, dict]]] = {
    "mlp": {"hidden_size": (int, _SIZE)},
    "cnn": {"channels": (int, _SIZE)},
    "gpt": {
        "n_layer": (int, _SIZE),
        "n_head": (int, _SIZE),
        "n_embd": (int, _SIZE),
        "block_size": (int, _SIZE),
        "vocab_size": (int, {"min": 1, "max": 2**31}),
        "dropout": (float, {"min": 0, "max": 1}),
        "bias": (bool, {}),
    },
}
_KINDS = {
    "tokens": ("token ids", "integers: data.name=tokens"),
    "features": ("features", "floating-point values: digits, mnist, synthetic"),
}


def kind_problem(model: str, data: str, kind: str | None) -> str | None:
    """Why built-in `model` cannot train on data `data` whose samples are of `kind` (None: not known), or
    None: it would build, then fail in its first forward pass, in every worker."""
    takes = MODEL_TAKES.get(model)
    if takes is None or kind is None or takes == kind:
        return None
    fits = next(name for name, its in MODEL_TAKES.items() if its == kind)
    return (
        f"model.name = '{model}' takes {_KINDS[takes][0]} ({_KINDS[takes][1]}); data.name = '{data}' gives "
        f"{_KINDS[kind][0]}; use model.name={fits}"
    )


@dataclass(slots=True)
class ModelConfig(Section):
    name: str = setting(
        "mlp",
        "mlp (the guide's Linear-ReLU-Linear), cnn, gpt (a decoder-only transformer for "
        "data.name=tokens), a factory 'package.module:function', or a local Hugging Face model "
        "folder: 'hf:PATH' (the class its config.json names in architectures) or 'hf-causal-lm:PATH' "
        "(AutoModelForCausalLM), built from its config.json and started from its weights.",
    )
    init_from: str = setting(
        "",
        "Weights a new run starts from: a .safetensors file, a Hugging Face model folder, a dtrain "
        "run.dir (its model.safetensors, else its newest checkpoint) or a checkpoints/step-N folder. "
        "Names and shapes must match the model (a GPT-2 folder dtrain export wrote also starts the built-in "
        "gpt). A resumed run continues from its checkpoint instead. "
        "Under FSDP each process builds and reads only its shard.",
    )
    hidden_size: int = setting(1024, "Hidden width of the built-in mlp.", min=1, max=2**20)
    options: dict = setting(
        {},
        "Keyword arguments passed to a model factory (gpt: n_layer, n_head, n_embd, block_size, dropout, bias); "
        "for an hf: model, config.json values to override (as from_pretrained(PATH, **options)).",
    )
    blocks: list[str] = setting(
        [],
        "Module class names of the model's blocks: FSDP's units, and what "
        "activation checkpointing and compile=blocks work on (default: the model's "
        "_no_split_modules — its transformer blocks — else its ModuleList entries). "
        "Formerly distributed.fsdp_units.",
    )

    def check(self) -> None:
        _local_only("model.init_from", self.init_from, "the weights")
        self.init_from = os.path.expanduser(self.init_from)
        if self.hf_folder is not None:
            _local_only("model.name", self.hf_folder, "the Hugging Face model folder", self.name)
            if not self.hf_folder:
                raise ConfigError(f"model.name = '{self.name}' names no folder; give 'hf:PATH' or 'hf-causal-lm:PATH'")
            return
        _check_builtin_or_factory("model.name", self.name, tuple(MODEL_TAKES))
        for key, (type_, bounds) in MODEL_OPTIONS.get(self.name, {}).items():
            if key in self.options:  # the others are the builder's to refuse (the launcher builds it first)
                self.options[key] = coerce(f"model.options.{key}", self.options[key], type_, bounds, None)

    @property
    def hf_folder(self) -> str | None:
        """The folder of a Hugging Face model (`hf:PATH`, `hf-causal-lm:PATH`), else None."""
        prefix = next((p for p in HF_PREFIXES if self.name.startswith(p)), None)
        return None if prefix is None else os.path.expanduser(self.name[len(prefix) :])

    @property
    def weights(self) -> tuple[str, str] | None:
        """The weights a new run starts from, as (the key that names them, the path): model.init_from,
        else a Hugging Face model's own folder; None for the model's own initialisation."""
        if self.init_from:
            return "model.init_from", self.init_from
        return ("model.name", self.hf_folder) if self.hf_folder else None


@dataclass(slots=True)
class DataConfig(Section):
    name: str = setting(
        "digits",
        "digits (ships with scikit-learn), mnist (IDX files), synthetic, tokens "
        "(shards made by `dtrain prepare`), or a factory 'package.module:function'.",
    )
    path: str = setting(
        "data/mnist",
        "Folder holding the four MNIST IDX files (plain or .gz), or the token shards and meta.json (data.name=tokens; "
        "also a URL such as s3://bucket/prefix, read in ranges; credentials from boto's environment, never the URL).",
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
    shuffle: bool = setting(
        True,
        "Shuffle the training set every epoch (by run.seed and the epoch); false: the data set's own order, "
        "rank r taking samples r, r + processes, ... (an iterable data set is always read in its own order).",
    )
    sampling: Literal["windows", "random"] = setting(
        "windows",
        "Token data (data.name=tokens): windows — the split cut into windows, every one once an epoch, in the "
        "epoch's order; random — nanoGPT's windows at random offsets, drawn per process from run.seed and "
        "resumed exactly, an epoch as many steps as with windows (evaluation keeps fixed windows).",
    )
    num_samples: int = setting(60000, "Size of the synthetic data set.", min=1, max=2**31)
    input_shape: list[int] = setting([1, 28, 28], "Sample shape of the synthetic data set.")
    num_classes: int = setting(
        10, "Classes of the synthetic data set (and of factory data sets that cannot say).", min=2
    )
    padding: str = setting(
        "none",
        "longest: pad each batch of token rows (dicts holding input_ids of different lengths) to its longest "
        "row, with attention_mask and -100 labels on the padding (dtrain.pad_to_longest); none: collate as given.",
    )
    pad_to_multiple_of: int = setting(1, "data.padding = longest: pad to a multiple of this (8 suits GPUs).", min=1)
    pad_token_id: int = setting(
        -1, "data.padding = longest: the pad token id; -1: the model config's pad_token_id.", min=-1
    )
    packing: bool = setting(
        False,
        "data.name = tokens: mark the documents in each window (position ids restart after every end-of-text "
        "token), attend within a document only, and leave out the loss of a document's first token.",
    )
    on_device: bool = setting(True, "Hold tensor data sets on the GPU and gather batches there.")
    num_workers: int = setting(
        0,
        "DataLoader worker processes (an iterable data set's are given every W-th sample of the rank's share).",
        min=0,
        max=1024,
    )
    pin_memory: bool = setting(True, "Pin host batches for faster copies to the GPU (DataLoader, CUDA only).")
    persistent_workers: bool = setting(True, "Keep DataLoader workers alive between epochs.")
    prefetch_factor: int = setting(2, "Batches each DataLoader worker loads ahead.", min=1, max=2**16)

    def check(self) -> None:
        self.path = os.path.expanduser(self.path)  # as run.dir
        if objstore.credentials_in(self.path):  # it would be written into config.toml and the logs
            raise ConfigError(
                f"data.path = '{objstore.without_credentials(self.path)}' carries a password in the URL; give "
                f"credentials through the store's environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a "
                f"profile) and only the URL here"
            )
        _check_builtin_or_factory("data.name", self.name, tuple(DATA_GIVES))
        if self.padding not in ("none", "longest"):
            raise ConfigError(f"data.padding = {self.padding!r} must be 'none' or 'longest'")
        if self.packing and self.name != "tokens":
            raise ConfigError(f"data.packing = true packs token data (data.name = 'tokens'), not {self.name!r}")
        if not self.input_shape or any(d < 1 for d in self.input_shape):
            raise ConfigError(
                f"data.input_shape = {self.input_shape} must be a list of positive sizes, e.g. [1, 28, 28]"
            )
        if self.name == "synthetic" and math.prod(self.input_shape) * self.num_samples > 2**34:
            raise ConfigError(
                f"data.input_shape = {self.input_shape} × data.num_samples = "
                f"{self.num_samples} is over 2^34 values (64 GiB of float32) for the synthetic "
                f"data set; use fewer samples or smaller inputs"
            )


@dataclass(slots=True)
class OptimizerConfig(Section):
    name: str = setting(
        "sgd",
        "Any optimizer of torch.optim by its class name, any case (sgd, adamw, Adam, Adagrad, RMSprop, NAdam, "
        "RAdam, Adamax, Adadelta, ASGD, Rprop, Adafactor, Muon), or a factory 'package.module:Class' called "
        "with the parameter groups, lr and weight_decay (where it names them) and optimizer.kwargs.",
    )
    lr: float = setting(0.01, "Peak learning rate.", above=0)
    momentum: float = setting(0.9, "SGD momentum (another optimizer's through optimizer.kwargs).", min=0, max=1)
    nesterov: bool = setting(False, "Nesterov momentum for SGD.")
    weight_decay: float = setting(
        0.0, "Weight decay (decoupled for adamw), of every parameter but optimizer.no_decay's.", min=0
    )
    betas: list[float] = setting([0.9, 0.999], "betas of the Adam family (adamw, Adam, NAdam, RAdam, Adamax).")
    eps: float = setting(1e-8, "epsilon of the Adam family.", above=0)
    kwargs: dict = setting(
        {},
        "More keyword arguments of the optimizer, as its class names them, e.g. {amsgrad = true} or, for "
        "RMSprop, {alpha = 0.9, momentum = 0.5}; a key it does not take is refused.",
    )
    no_decay: list[str] = setting(
        ["ndim<2"],
        "Parameters trained with weight_decay 0: ndim<2 (every parameter of fewer than two dimensions: biases, "
        "norm weights; nanoGPT's and Hugging Face Trainer's rule, which decay embeddings), embeddings (the "
        "weights of nn.Embedding modules), or name patterns such as '*.bias'; [] decays every parameter.",
    )
    groups: list[dict] = setting(
        [],
        "Parameter groups with their own settings: tables of params (a name pattern, or a list of them, "
        "matched against the model's own parameter names; first group wins) and optimizer settings, e.g. "
        "[{params = 'lm_head.*', lr = 1e-4}]. Their lr follows the schedule like optimizer.lr.",
    )

    def check(self) -> None:
        if self.nesterov and self.momentum == 0:
            raise ConfigError(
                "optimizer.nesterov = true needs momentum: set optimizer.momentum above 0 (0.9 is usual), "
                "or optimizer.nesterov=false"
            )
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optimizer.betas = {self.betas} must be two numbers in [0, 1), e.g. [0.9, 0.999]")
        if any(not item.strip() for item in self.no_decay):
            raise ConfigError('optimizer.no_decay holds an empty pattern; e.g. optimizer.no_decay=["ndim<2"]')
        for i, group in enumerate(self.groups):
            _check_group(f"optimizer.groups[{i}]", group)
        if _is_factory_ref(self.name):
            return  # the factory's own arguments are checked when it is called
        plain = not self.kwargs and all(set(group) <= {"params", "lr", "weight_decay"} for group in self.groups)
        if plain and self.name.lower() in torch_names.FAMILIAR:  # known without importing torch
            class_name, own, takes = *torch_names.FAMILIAR[self.name.lower()], []
        else:
            cls = torch_names.optimizer_class(self.name)
            class_name, own = cls.__name__, tuple(torch_names.config_keys(cls))
            takes = torch_names.keywords(cls, skip=("params",))
        for key, default in (("momentum", 0.9), ("nesterov", False), ("betas", [0.9, 0.999]), ("eps", 1e-8)):
            if key not in own and getattr(self, key) != default:
                raise ConfigError(
                    f"optimizer.{key} is set and {class_name} does not use it; leave it out"
                    + (f", or give {class_name}'s own as optimizer.kwargs" if key in takes else "")
                )
        if "weight_decay" not in own and self.weight_decay:
            raise ConfigError(f"optimizer.weight_decay is set and {class_name} takes no weight decay; leave it out")
        own_here = [key for key in self.kwargs if key in own or key == "params"]
        if own_here:
            raise ConfigError(f"optimizer.kwargs has '{own_here[0]}': set optimizer.{own_here[0]} instead")
        if not plain:
            torch_names.refuse_unknown("optimizer.kwargs", self.kwargs, [k for k in takes if k not in own], class_name)
            for i, group in enumerate(self.groups):
                torch_names.refuse_unknown(f"optimizer.groups[{i}]", group, ["params", *takes], class_name)

    @property
    def key(self) -> str:
        """The optimizer as a checkpoint records it: a torch class by its lower-case name (sgd, adamw)."""
        return self.name if _is_factory_ref(self.name) else self.name.lower()


def _check_group(key: str, group: dict) -> None:
    patterns = group.get("params")
    if isinstance(patterns, str):
        patterns = [patterns]
    if not (isinstance(patterns, list) and patterns and all(isinstance(p, str) and p.strip() for p in patterns)):
        raise ConfigError(
            f"{key} needs params, a name pattern or a list of them, e.g. {{params = 'lm_head.*', lr = 1e-4}}"
        )
    for name, value in group.items():
        if name in ("lr", "weight_decay", "eps", "momentum") and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
        ):
            raise ConfigError(f"{key}.{name} must be a number >= 0; got {value!r}")


@dataclass(slots=True)
class SchedulerConfig(Section):
    name: str = setting(
        "constant",
        "The learning rate over the run: constant, constant_with_warmup, linear, cosine, cosine_with_restarts, "
        "polynomial, inverse_sqrt, warmup_stable_decay (transformers.get_scheduler's, computed by dtrain), nanogpt "
        "(nanoGPT's get_lr: cosine, warm-up (k + 1) / (warmup_steps + 1) at step k), or a torch.optim.lr_scheduler "
        "class by name (StepLR, OneCycleLR, ...; any case) with scheduler.kwargs.",
    )
    warmup_steps: int = setting(
        0,
        "Optimizer steps of linear warm-up from 0 to optimizer.lr, as transformers': the first step's "
        "learning rate is 0 (warmup_stable_decay: from the floor; nanogpt: optimizer.lr / (warmup_steps + 1)).",
        min=0,
    )
    decay_steps: int = setting(
        0,
        "The step at which the decay reaches its floor, after which the learning rate stays there "
        "(nanoGPT's lr_decay_iters; 0: the run's last step).",
        min=0,
    )
    min_lr: float = setting(
        0.0, "Where linear, cosine, polynomial and warmup_stable_decay end (polynomial's lr_end).", min=0
    )
    min_lr_ratio: float = setting(0.0, "The same floor as a share of optimizer.lr (set one of the two).", min=0, max=1)
    kwargs: dict = setting(
        {},
        "The schedule's own options: cosine {num_cycles}, cosine_with_restarts {num_cycles}, polynomial "
        "{power}, inverse_sqrt {timescale}, warmup_stable_decay {num_decay_steps, warmup_type, decay_type, "
        "num_cycles} (transformers' names and defaults); a torch class's arguments (e.g. StepLR "
        "{step_size = 100, gamma = 0.5}; OneCycleLR's total_steps and CosineAnnealingLR's T_max default to "
        "the run's steps).",
    )

    def check(self) -> None:
        cls = torch_names.scheduler_class(self.name)
        if cls is not None:
            shaped = [k for k in ("warmup_steps", "decay_steps", "min_lr", "min_lr_ratio") if getattr(self, k)]
            if shaped:
                raise ConfigError(
                    f"scheduler.{shaped[0]} shapes dtrain's own schedules, not {cls.__name__}; give its "
                    f"arguments as scheduler.kwargs, e.g. scheduler.kwargs={{gamma = 0.9}}"
                )
            torch_names.refuse_unknown(
                "scheduler.kwargs", self.kwargs, torch_names.keywords(cls, skip=("optimizer",)), cls.__name__
            )
            missing = [key for key in torch_names.required(cls) if key not in self.kwargs]
            if missing:
                raise ConfigError(
                    f"scheduler.name = {cls.__name__} needs {', '.join(missing)}: "
                    f"scheduler.kwargs = {{{', '.join(f'{key} = ...' for key in missing)}}}"
                )
            return
        options = torch_names.SCHEDULE_OPTIONS.get(self.name, {})
        torch_names.refuse_unknown("scheduler.kwargs", self.kwargs, list(options), f"scheduler.name = {self.name}")
        if self.min_lr and self.min_lr_ratio:
            raise ConfigError("scheduler.min_lr and scheduler.min_lr_ratio both set the floor; set one of them")
        ends = self.name not in ("constant", "constant_with_warmup", "inverse_sqrt")
        for key in ("decay_steps", "min_lr"):
            if getattr(self, key) and not ends:
                raise ConfigError(f"scheduler.{key} is set and {self.name} never decays to a floor; leave it out")
        if self.decay_steps and self.decay_steps <= self.warmup_steps:
            raise ConfigError(
                f"scheduler.decay_steps = {self.decay_steps} ends the decay before warm-up ends "
                f"(scheduler.warmup_steps = {self.warmup_steps}); make it larger"
            )
        if self.name == "warmup_stable_decay" and not isinstance(self.kwargs.get("num_decay_steps"), int):
            raise ConfigError(
                "scheduler.name = warmup_stable_decay needs the length of its decay: scheduler.kwargs = "
                "{num_decay_steps = N} (steps)"
            )
        for key in ("warmup_type", "decay_type"):
            if key in self.kwargs and self.kwargs[key] not in ("linear", "cosine", "1-sqrt"):
                raise ConfigError(f"scheduler.kwargs.{key} = {self.kwargs[key]!r}: use linear, cosine or 1-sqrt")


@dataclass(slots=True)
class TrainingConfig(Section):
    epochs: int = setting(10, "Passes over the training set.", min=1)
    max_steps: int = setting(
        0, "Stop after this many optimizer steps (0: no limit; an iterable data set's run length, required).", min=0
    )
    grad_accum_steps: int = setting(
        1, "Micro-batches per optimizer step; all but the last skip the gradient all-reduce.", min=1
    )
    device: Literal["auto", "cpu", "cuda"] = setting(
        "auto",
        "auto: one GPU per process where CUDA sees GPUs, else the CPU; cpu: the CPU even on a GPU "
        "machine (gloo, GPUs hidden from the workers); cuda: refuse to start without GPUs.",
    )
    global_batch_size: int = setting(
        0,
        "Samples per optimizer step over all processes, as nanoGPT states its batch (0: off): "
        "training.grad_accum_steps becomes global_batch_size / (data.batch_size × processes).",
        min=0,
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
    eval_every_steps: int = setting(
        0, "Also evaluate every this many optimizer steps (0: off); the end of the run always evaluates.", min=0
    )
    eval_batches: int = setting(
        0,
        "Evaluate at most eval_batches × data.eval_batch_size samples in all (0: the whole split), shared by the "
        "processes: the same samples every time (drawn once with run.seed) whatever the number of processes.",
        min=0,
    )
    eval_metrics: str = setting(
        "",
        "More eval metrics, named 'package.module:name' (for a run described by its config; in code, "
        "Trainer(eval_metrics=...)): a function fn(output, batch) returning per-batch means, or "
        "dtrain.whole_split(fn) for fn(predictions, targets) of the whole split (F1, AUC). Empty: loss, "
        "accuracy and perplexity only.",
    )
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
    lora: dict = setting(
        {},
        "LoRA fine-tuning through Hugging Face peft: {r, alpha, dropout, target_modules}; the base model's "
        "parameters frozen (sharded under fsdp), only the adapters trained, optimized and checkpointed "
        "(empty: off). Defaults: alpha = 2 r, dropout 0, target_modules per model (gpt: attention and MLP "
        "projections; a transformers model: peft's own for its type, else every nn.Linear but the output head).",
    )

    def check(self) -> None:
        check_lora(self.lora)


LORA_KEYS: dict[str, Any] = {"r": int, "alpha": (int, float), "dropout": (int, float), "target_modules": list}


def check_lora(lora: dict) -> None:
    """training.lora's own keys and values (whether its target_modules match the model, a worker sees)."""
    if not lora:
        return
    unknown = sorted(set(lora) - set(LORA_KEYS))
    if unknown:
        raise ConfigError(
            f"training.lora.{unknown[0]} is not a LoRA setting; give r, alpha, dropout, target_modules, "
            f"e.g. training.lora={{r = 8, alpha = 16}}"
        )
    if "r" not in lora:
        raise ConfigError("training.lora needs r, the adapters' rank (a whole number > 0), e.g. training.lora={r = 8}")
    for key, kind in LORA_KEYS.items():
        value = lora.get(key)
        if key in lora and (isinstance(value, bool) or not isinstance(value, kind)):
            raise ConfigError(f"training.lora.{key} = {value!r} is not {_LORA_WHAT[key]}")
    if lora["r"] <= 0:
        raise ConfigError(f"training.lora.r = {lora['r']} must be a whole number > 0 (the adapters' rank), e.g. 8")
    if "alpha" in lora and not (math.isfinite(lora["alpha"]) and lora["alpha"] > 0):
        raise ConfigError(f"training.lora.alpha = {lora['alpha']} must be a number > 0 (scaling alpha / r), e.g. 16")
    if "dropout" in lora and not 0 <= lora["dropout"] < 1:
        raise ConfigError(f"training.lora.dropout = {lora['dropout']} must be at least 0 and below 1, e.g. 0.05")
    modules = lora.get("target_modules", ["x"])
    if not modules or not all(isinstance(m, str) and m for m in modules):
        raise ConfigError(
            f'training.lora.target_modules = {modules!r} must be a list of module names, e.g. ["c_attn", "c_proj"]'
        )


_LORA_WHAT = {
    "r": "a whole number > 0",
    "alpha": "a number > 0",
    "dropout": "a number in [0, 1)",
    "target_modules": "a list of module names",
}


@dataclass(slots=True)
class MonitorConfig(Section):
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

    def check(self) -> None:
        unknown = [t for t in self.trackers if t not in ("tensorboard", "mlflow", "wandb")]
        if unknown or len(set(self.trackers)) != len(self.trackers):
            raise ConfigError(
                f"monitor.trackers = {self.trackers}: each of tensorboard, mlflow, wandb at most once"
                + (f"; '{unknown[0]}' is none of them" if unknown else "")
            )


@dataclass(slots=True)
class ProfileConfig(Section):
    steps: str = setting(
        "",
        'Optimizer steps to trace with torch.profiler, e.g. "20-25"; one trace '
        "per rank under run.dir/profile (Perfetto, TensorBoard). Empty: off.",
    )

    def check(self) -> None:
        if self.steps and profile_range(self.steps) is None:
            raise ConfigError(
                f"profile.steps = '{self.steps}' is not a step range; write it like "
                f'"20-25" (first and last optimizer step, from 1)'
            )


@dataclass(slots=True)
class CheckpointConfig(Section):
    every_steps: int = setting(
        0,
        "Write a checkpoint every this many optimizer steps (0: only at the end, see at_end, on SIGTERM or "
        "Ctrl-C, and at training.stop_at_step).",
        min=0,
    )
    at_end: bool = setting(
        True,
        "Write a checkpoint at the end of the run, so that the same command again says it is complete and more "
        "training.epochs (or a higher max_steps within them) train on from there. false: no end-of-run checkpoint "
        "unless every_steps, every_epochs or a resume asked for checkpoints; the rerun still says complete, and "
        "training on is refused (start from its weights with model.init_from).",
    )
    keep: int = setting(3, "Complete checkpoints kept; older ones are deleted (never the newest).", min=1)
    every_epochs: int = setting(
        0,
        "Also write a checkpoint at the end of every this many epochs (0: off), before that epoch's evaluation.",
        min=0,
    )
    keep_best: str = setting(
        "",
        'Keep the checkpoint with the best eval metric besides the newest checkpoint.keep: "eval_loss" (lowest; '
        'also "eval_loss:min") or "eval_accuracy:max" (highest), any eval_ metric; a checkpoint counts when an '
        "evaluation runs at its step. Empty: off.",
    )
    resume: Literal["auto", "yes", "no"] = setting(
        "auto",
        "auto: continue from the newest complete checkpoint in run.dir if there is one; yes: "
        "must (what --resume sets); no: start fresh, refusing a run.dir that holds checkpoints.",
    )
    resume_from: str = setting(
        "",
        "Start from this checkpoint (a step-N folder, or a run.dir: its newest) of this or another run, read where "
        "it is, never copied or changed (what --resume-from sets); run.dir's own newer checkpoints win on a rerun.",
    )
    # The TOML key `async` is a Python keyword: the field carries PEP 8's trailing underscore (key_name).
    async_: bool = setting(
        False,
        "Write checkpoints in the background: the state is copied to host memory (pinned on a GPU) "
        "within the step, then written while training goes on, and sealed once every rank's write "
        "completed. Holds one host copy of the state. Off by default until measured on a GPU.",
    )
    preempt_grace_s: float = setting(
        120.0,
        "Seconds workers get after SIGTERM to finish the step and write their checkpoint before torchrun kills them.",
        above=0,
        max=A_YEAR,
    )
    export: Literal["none", "hf"] = setting(
        "none",
        "hf: at the end of the run also write the final weights as a Hugging Face model folder, run.dir/hf "
        "(config.json, safetensors, tokenizer), as `dtrain export RUN_DIR --format hf` does.",
    )

    def check(self) -> None:
        _local_only("checkpoint.resume_from", self.resume_from, "the checkpoint")
        if self.keep_best and best_rule(self.keep_best) is None:
            raise ConfigError(
                f"checkpoint.keep_best = '{self.keep_best}' is not a metric and a direction; write an eval metric "
                f'and min or max, like "eval_loss" (lowest) or "eval_accuracy:max" (highest)'
            )


def best_rule(spec: str) -> tuple[str, str] | None:
    """checkpoint.keep_best: 'eval_loss' -> ('eval_loss', 'min'); 'eval_accuracy:max' -> ('eval_accuracy',
    'max'); None when malformed."""
    name, _, mode = spec.strip().partition(":")
    mode = mode or "min"
    if not name.startswith("eval_") or mode not in ("min", "max"):
        return None
    return name, mode


def profile_range(text: str) -> tuple[int, int] | None:
    """'20-25' -> (20, 25); '7' -> (7, 7); None when malformed."""
    first, _, last = text.strip().partition("-")
    last = last or first
    if not (first.strip().isdigit() and last.strip().isdigit()):
        return None
    a, b = int(first), int(last)
    return (a, b) if 1 <= a <= b < 2**63 else None


def _check_builtin_or_factory(key: str, value: str, builtins: tuple[str, ...]) -> None:
    if value not in builtins and not _is_factory_ref(value):
        close = difflib.get_close_matches(value, builtins, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ConfigError(
            f"{key} = '{value}' is neither a built-in ({', '.join(builtins)}) nor "
            f"a factory 'package.module:function'; {hint}".rstrip("; ")
        )


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
