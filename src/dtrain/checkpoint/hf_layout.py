"""Where each tensor of a dtrain run goes in a Hugging Face model folder: the built-in GPT as GPT-2
(`GPT2LMHeadModel`), a Hugging Face model under its own config and names. A layout is a config and a list
of entries — the folder's tensor names in order, each with the run's tensor it is made of (transposed for
GPT-2's Conv1D, zeros for a bias the run's model does not have) — checked against the model class built
on the meta device (no memory), so that what is written is what `from_pretrained` loads, or refused in
one line before anything is written."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dtrain.errors import DtrainError
from dtrain.models import described

Specs = dict[str, tuple[torch.Size, torch.dtype]]  # a run's model tensors: name → (shape, type)


@dataclass(frozen=True)
class Entry:
    name: str  # in the Hugging Face folder
    source: str | None  # the run's tensor it is made of; None: zeros (a bias the run's model has not)
    shape: tuple[int, ...]
    dtype: torch.dtype
    transpose: bool = False  # GPT-2's Conv1D keeps its weight as [in, out], nn.Linear as [out, in]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class Layout:
    config: Any  # a transformers PretrainedConfig
    entries: list[Entry]


# The built-in GPT's Linear layers that GPT-2 keeps as Conv1D ([in, out] weights).
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
_GPT2_PREFIX = "transformer."  # GPT2LMHeadModel's body; its head (lm_head) is tied to transformer.wte


def _is_conv1d(ours: str) -> bool:
    return ours.endswith(".weight") and ours.removesuffix(".weight").endswith(_CONV1D)


def gpt2_as_gpt(stored: list[str]) -> dict[str, tuple[str, bool]] | None:
    """The way back from `gpt2`: each tensor of a GPT-2 folder (GPT2LMHeadModel's names) → the built-in
    GPT's name it is read as, and whether it is transposed (a Conv1D weight); None when the names are not
    GPT-2's. The head is not stored (tied to wte, read through the built-in GPT's own tie); biases are
    named as the built-in GPT with bias = true has them (zeros, when `gpt2` exported one without)."""
    if _GPT2_PREFIX + "wte.weight" not in stored:
        return None
    return {name.removeprefix(_GPT2_PREFIX): (name, _is_conv1d(name.removeprefix(_GPT2_PREFIX))) for name in stored}


def gpt2(options: dict[str, Any], specs: Specs, eot: int | None) -> Layout:
    """The built-in GPT (its `options` as model.json says them) as `GPT2LMHeadModel`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    dropout = float(options.get("dropout", 0.0))
    config = GPT2Config(
        vocab_size=options["vocab_size"],
        n_positions=options["block_size"],
        n_embd=options["n_embd"],
        n_layer=options["n_layer"],
        n_head=options["n_head"],
        n_inner=None,  # 4 × n_embd, as the built-in GPT's MLP
        activation_function="gelu",  # the exact GELU (nn.GELU), not GPT-2's tanh approximation
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        layer_norm_epsilon=1e-5,  # nn.LayerNorm's
        bos_token_id=eot,
        eos_token_id=eot,
        tie_word_embeddings=True,
    )
    config.architectures = ["GPT2LMHeadModel"]
    expected, kept = _meta_state(GPT2LMHeadModel, config)
    entries, used = [], set()
    for name in kept:
        shape = tuple(expected[name].shape)
        ours = name.removeprefix(_GPT2_PREFIX)
        transpose = _is_conv1d(ours)
        if ours in specs:
            have = tuple(specs[ours][0])
            if (have[::-1] if transpose else have) != shape:
                raise DtrainError(
                    f"the run's {ours} is shaped {list(have)}, and GPT-2's {name} {list(shape)}: the built-in "
                    f"gpt with these options has no GPT-2 equivalent"
                )
            entries.append(Entry(name, ours, shape, specs[ours][1], transpose))
            used.add(ours)
        elif ours.endswith(".bias") and ours.removesuffix(".bias") + ".weight" in specs:  # bias = false
            entries.append(Entry(name, None, shape, specs[ours.removesuffix(".bias") + ".weight"][1]))
        else:
            raise DtrainError(f"the run's model has no {ours}, which GPT-2's {name} needs: it cannot be exported")
    extra = sorted(set(specs) - used - {"lm_head.weight"})  # the head is GPT-2's too: tied to wte
    if extra:
        raise DtrainError(f"the run's {', '.join(extra[:3])} have no GPT-2 equivalent: it cannot be exported as GPT-2")
    config.dtype = _dtype_name(entries)
    return Layout(config, entries)


def transformers_model(model: dict[str, Any], specs: Specs) -> Layout:
    """A Hugging Face model (model.json: its class and config) under its own config and names, tied
    tensors once, as its `save_pretrained` writes them."""
    import transformers
    from transformers import AutoConfig

    architecture, settings = model.get("architecture"), dict(model.get("config") or {})
    cls = getattr(transformers, str(architecture), None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise DtrainError(
            f"the run trained a {architecture}, which this transformers ({transformers.__version__}) does not "
            f"have; export with the transformers it trained with"
        )
    settings.pop("transformers_version", None)
    model_type = settings.pop("model_type", None)
    try:
        config = AutoConfig.for_model(model_type, **settings)
    except (ValueError, KeyError, TypeError) as exc:
        raise DtrainError(f"the run's {architecture} config cannot be rebuilt by this transformers ({exc})") from None
    config.architectures = [str(architecture)]
    expected, kept = _meta_state(cls, config)
    missing = [name for name in kept if name not in specs]
    extra = sorted(set(specs) - set(expected))
    if missing or extra:
        said = f"lacks {', '.join(missing[:3])}" if missing else f"has {', '.join(extra[:3])}, which it has not"
        raise DtrainError(f"the run's weights do not fit {architecture} as its config builds it: the run {said}")
    entries = []
    for name in kept:
        shape, dtype = specs[name]
        if tuple(shape) != tuple(expected[name].shape):
            raise DtrainError(
                f"the run's {name} is shaped {list(shape)} and {architecture}'s {list(expected[name].shape)}"
            )
        entries.append(Entry(name, name, tuple(shape), dtype))
    config.dtype = _dtype_name(entries)
    return Layout(config, entries)


def of(model: dict[str, Any], specs: Specs, eot: int | None) -> Layout:
    """The layout for a model as model.json describes it."""
    problem = described.not_exportable(model)
    if problem:
        raise DtrainError(problem)
    if model["kind"] == described.GPT:
        return gpt2(model["options"], specs, eot)
    return transformers_model(model, specs)


def _meta_state(cls: type, config: Any) -> tuple[dict[str, Any], list[str]]:
    """The state dict the class builds from `config` (its parameters themselves, on the meta device: no
    memory, no initialisation) and the names a folder stores: of a tensor tied under several names, the
    one the model keeps when it saves — not a key of a `_tied_weights_keys`, which are tied to another
    on loading (what transformers' `save_pretrained` drops)."""
    with torch.device("meta"):
        model = cls(config)
    state = model.state_dict(keep_vars=True)  # a tied parameter is the same object under each name
    tied = {
        f"{prefix}.{key}" if prefix else key
        for prefix, module in model.named_modules()
        for key in getattr(module, "_tied_weights_keys", None) or ()
    }
    names: dict[int, list[str]] = {}
    for name, tensor in state.items():
        names.setdefault(id(tensor), []).append(name)
    kept = {next((n for n in group if n not in tied), group[0]) for group in names.values()}
    return state, [name for name in state if name in kept]


def _dtype_name(entries: list[Entry]) -> str:
    return str(entries[0].dtype).removeprefix("torch.") if entries else "float32"
