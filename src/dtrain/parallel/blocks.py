"""The model's blocks, and what is done to each before the strategy spreads it.

A block is the repeated unit of a model (a transformer layer): the classes named by
`model.blocks`, else the model's own `_no_split_modules` (every Hugging Face model and the
built-in GPT name their block class there), else the entries of the model's `nn.ModuleList`s. Each
block is an FSDP unit (fsdp.py), and, in torchtitan's order, first:

    activation checkpointing  `training.activation_checkpointing`: `full` keeps only a block's input
                              and recomputes the rest in backward; `selective` also keeps the outputs
                              of matrix multiplications and attention, recomputing only the cheap
                              element-wise work
    compile                   `training.compile`: `blocks` compiles each block's forward (regional:
                              identical blocks share their compiled code), `model` the whole forward

A Hugging Face model with checkpointing of its own (`gradient_checkpointing_enable`) is checkpointed
by it, with dtrain's options: its layers know which of their arguments are caches, and the model says
that it checkpoints. Otherwise both replace a module's `forward` in place: parameter names, state dicts
and checkpoints stay those of the plain model, and the strategy's hooks (FSDP's gathers, DDP's) stay
outside the compiled code.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from dtrain.errors import ConfigError
from dtrain.parallel.options import BlockOptions


def apply_block_options(
    module: nn.Module, options: BlockOptions, device: torch.device, *, sharded: bool, quiet: bool = False
) -> list[nn.Module]:
    """Checkpoint and compile `module`'s blocks as `options` say; returns the blocks (the units of a
    strategy that shards: `sharded`). `quiet`: a rank other than 0, which need not repeat torch's warnings."""
    needs_blocks = sharded or options.activation_checkpointing != "none" or options.compile == "blocks"
    # Named blocks are looked for even where nothing uses them, so that a misspelt name is refused, not ignored.
    blocks = find_blocks(module, list(options.names)) if needs_blocks or options.names else []
    wanted_blocks = options.activation_checkpointing != "none" or options.compile == "blocks"
    if wanted_blocks and not blocks:
        raise ConfigError(
            f"training.activation_checkpointing and training.compile=blocks work block by block, "
            f"and {type(module).__name__} has no blocks dtrain can find (no _no_split_modules, no "
            f"nn.ModuleList): name its block class in model.blocks"
            + ("" if options.compile != "blocks" else ", or use training.compile=model")
        )
    if options.activation_checkpointing != "none":
        _no_kv_cache(module)
        own = _use_own_checkpointing(module, options.activation_checkpointing)
        for block in blocks:
            if not any(_is_inside(block, model) for model in own):  # recomputed once, not twice
                block.forward = _checkpointed(block.forward, options.activation_checkpointing)
    if options.compile != "none":
        problem = compiler_problem(device)
        if problem:
            raise ConfigError(problem)
        if options.activation_checkpointing == "selective" and quiet:
            # torch warns, on every rank, that a selectively checkpointed region must not hold in-place
            # ops: once is enough.
            logging.getLogger("torch._higher_order_ops.wrap").setLevel(logging.ERROR)
        for target in blocks if options.compile == "blocks" else [module]:
            target.forward = torch.compile(target.forward)
    return blocks


def _no_kv_cache(module: nn.Module) -> None:
    """Turn off a Hugging Face model's key/value cache (training never reads it), as its own gradient
    checkpointing does: forward appends to the cache, so the recomputation in backward would see
    other inputs and fail ("encountered during backward but not found in storage")."""
    for sub in module.modules():
        hf_config = getattr(sub, "config", None)
        if getattr(hf_config, "use_cache", None) is True:
            hf_config.use_cache = False  # type: ignore[union-attr]


def _use_own_checkpointing(module: nn.Module, mode: str) -> list[nn.Module]:
    """Turn on the activation checkpointing of the Hugging Face models in `module` (itself, or the
    outermost ones it holds) that have their own; returns them. Their layers know which of their
    arguments are caches to drop when recomputed, and the model then says it checkpoints
    (`is_gradient_checkpointing`) to whoever asks, as its users expect of it."""
    own = [m for m in module.modules() if _has_own_checkpointing(m)]
    outermost = [m for m in own if not any(m is not other and _is_inside(m, other) for other in own)]
    for model in outermost:
        options = {"use_reentrant": False, **_checkpoint_options(mode)}
        # Newer transformers renamed the method (the old name warns); either hands `options` to torch.
        enable = getattr(model, "activation_checkpointing_enable", None)
        if callable(enable):
            enable(activation_checkpointing_kwargs=options)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)  # type: ignore[operator]
    return outermost


def _has_own_checkpointing(module: nn.Module) -> bool:
    """A Hugging Face model that can checkpoint its layers itself (`supports_gradient_checkpointing`)."""
    return getattr(module, "supports_gradient_checkpointing", False) is True and any(
        callable(getattr(module, name, None))
        for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable")
    )


def _is_inside(module: nn.Module, container: nn.Module) -> bool:
    return any(sub is module for sub in container.modules())


def compiler_problem(device: torch.device | str) -> str | None:
    """Why torch.compile's default backend (inductor) cannot build code here, or None. On CPUs it writes
    C++ and needs a compiler (g++, or the one CXX names); on GPUs it writes Triton kernels."""
    if torch.device(device).type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return (
                "training.compile needs Triton to build GPU kernels and it is not installed: "
                "pip install triton, or set training.compile=none"
            )
        return None
    cxx = os.environ.get("CXX", "g++")  # what inductor will run
    named = "(from CXX) " if "CXX" in os.environ else ""
    if not cxx.strip():
        return "training.compile needs a C++ compiler and CXX is set but empty: unset it or point it at g++"
    if shutil.which(cxx) is None:
        return (
            f"training.compile needs a C++ compiler to build CPU code and '{cxx}' {named}is not on PATH: "
            f"install g++ (or point CXX at one), or set training.compile=none"
        )
    try:
        works = subprocess.run([cxx, "--version"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        works = False
    if not works:
        return (
            f"training.compile needs a C++ compiler and '{cxx}' {named}does not run as one ({cxx} --version "
            f"failed): point CXX at a working g++, or set training.compile=none"
        )
    return None


def find_blocks(module: nn.Module, names: list[str]) -> list[nn.Module]:
    """The model's blocks, outermost first (never the root itself)."""
    wanted = set(names or getattr(module, "_no_split_modules", None) or ())
    if wanted:
        blocks = [m for m in module.modules() if m is not module and type(m).__name__ in wanted]
        classes = sorted({type(m).__name__ for m in module.modules() if m is not module})
        unmatched = [name for name in names if name not in classes]
        if unmatched:  # every name given must find a module: one misspelt among others would be ignored
            matched = [name for name in names if name in classes]
            found = f" ({', '.join(matched)} matched {len(blocks)} modules)" if matched else ""
            raise ConfigError(
                f"model.blocks = {names}: {', '.join(unmatched)} names no module of this model{found}; its module "
                f"classes are {', '.join(classes[:12])}{' …' if len(classes) > 12 else ''}"
            )
        containers = sorted({type(b).__name__ for b in blocks if type(b).forward is nn.Module.forward})
        if containers:  # a ModuleList's forward is never called: there is nothing to wrap
            inner = sorted({type(m).__name__ for b in blocks for m in b.children()})
            raise ConfigError(
                f"model.blocks names {', '.join(containers)}, a container whose forward is "
                f"never called; name the block class inside it ({', '.join(inner[:3]) or 'none'})"
            )
        if blocks:
            return _outermost(blocks)
    return [
        m
        for lists in module.modules()
        if isinstance(lists, nn.ModuleList)
        for m in lists
        if any(True for _ in m.parameters())
    ]


def check_unshared(module: nn.Module, blocks: list[nn.Module]) -> None:
    """FSDP shards each block's parameters on their own: a parameter a block shares with a module outside
    it (tied embeddings) cannot be a block's. Refused in one line, naming both places."""
    names = {id(m): name for name, m in module.named_modules()}
    owners: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    for block in blocks:
        prefix = names[id(block)] + "."
        for param in block.parameters():
            outside = [n for n in owners[id(param)] if not n.startswith(prefix)]
            if outside:
                inside = next(n for n in owners[id(param)] if n.startswith(prefix))
                raise ConfigError(
                    f"model.blocks makes {names[id(block)]} ({type(block).__name__}) a unit, and "
                    f"its {inside} is shared with {outside[0]} outside it (tied weights); name a "
                    f"block class that holds both, or leave model.blocks empty"
                )


def _outermost(blocks: list[nn.Module]) -> list[nn.Module]:
    inside = {id(sub) for block in blocks for sub in block.modules() if sub is not block}
    return [block for block in blocks if id(block) not in inside]


def _checkpointed(forward: Callable[..., Any], mode: str) -> Callable[..., Any]:
    """`forward` whose activations are recomputed in backward (all of them, or the cheap ones). The RNG
    state is replayed, so dropout draws the same masks: the result equals the plain forward's."""
    options = _checkpoint_options(mode)

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **options, **kwargs)

    return run


def _checkpoint_options(mode: str) -> dict[str, Any]:
    """What `torch.utils.checkpoint.checkpoint` is given besides `use_reentrant=False` for `mode`."""
    # `full` passes no context_fn at all: torch.compile cannot trace checkpoint's default one handed in
    # as an argument ("checkpoint not implemented for ... context_fn"), so compile=blocks would fail.
    if mode == "selective":
        return {"context_fn": functools.partial(create_selective_checkpoint_contexts, _keep_expensive_outputs)}
    return {}


_aten = torch.ops.aten
# Outputs worth keeping: recomputing them costs a matrix multiplication or an attention.
_EXPENSIVE = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _keep_expensive_outputs(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _EXPENSIVE else CheckpointPolicy.PREFER_RECOMPUTE
