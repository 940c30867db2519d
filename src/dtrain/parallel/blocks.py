"""The model's blocks, and what is done to each before the strategy spreads it.

A block is the repeated unit of a model (a transformer layer): the classes named by
`distributed.fsdp_units`, else the model's own `_no_split_modules` (every Hugging Face model and the
built-in GPT name their block class there), else the entries of the model's `nn.ModuleList`s. Each
block is an FSDP unit (fsdp.py), and, in torchtitan's order, first:

    activation checkpointing  `training.activation_checkpointing`: `full` keeps only a block's input
                              and recomputes the rest in backward; `selective` also keeps the outputs
                              of matrix multiplications and attention, recomputing only the cheap
                              element-wise work
    compile                   `training.compile`: `blocks` compiles each block's forward (regional:
                              identical blocks share their compiled code), `model` the whole forward

Both replace a module's `forward` in place: parameter names, state dicts and checkpoints stay those of
the plain model, and the strategy's hooks (FSDP's gathers, DDP's) stay outside the compiled code.
"""

from __future__ import annotations

import functools
import os
import shutil
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..config import Config
from ..errors import ConfigError


def prepare(module: nn.Module, config: Config, device: torch.device) -> list[nn.Module]:
    """Checkpoint and compile `module`'s blocks as the config says; returns the blocks (FSDP's units)."""
    tc = config.training
    needs_blocks = (config.distributed.strategy in ("fsdp", "hsdp") or tc.activation_checkpointing != "none"
                    or tc.compile == "blocks")
    blocks = find_blocks(module, config.distributed.fsdp_units) if needs_blocks else []
    wanted_blocks = tc.activation_checkpointing != "none" or tc.compile == "blocks"
    if wanted_blocks and not blocks:
        raise ConfigError(f"training.activation_checkpointing and training.compile=blocks work block by block, "
                          f"and {type(module).__name__} has no blocks dtrain can find (no _no_split_modules, no "
                          f"nn.ModuleList): name its block class in distributed.fsdp_units"
                          + ("" if tc.compile != "blocks" else ", or use training.compile=model"))
    if tc.activation_checkpointing != "none":
        for block in blocks:
            block.forward = _checkpointed(block.forward, tc.activation_checkpointing)
    if tc.compile != "none":
        problem = compiler_problem(device)
        if problem:
            raise ConfigError(problem)
        for target in (blocks if tc.compile == "blocks" else [module]):
            target.forward = torch.compile(target.forward)
    return blocks


def compiler_problem(device: torch.device | str) -> str | None:
    """Why torch.compile's default backend (inductor) cannot build code here, or None. On CPUs it writes
    C++ and needs a compiler (g++, or the one CXX names); on GPUs it writes Triton kernels."""
    if torch.device(device).type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return ("training.compile needs Triton to build GPU kernels and it is not installed: "
                    "pip install triton, or set training.compile=none")
        return None
    cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        return (f"training.compile needs a C++ compiler to build CPU code and '{cxx}' "
                f"{'(from CXX) ' if os.environ.get('CXX') else ''}is not on PATH: install g++ (or point CXX at "
                f"one), or set training.compile=none")
    return None


def find_blocks(module: nn.Module, names: list[str]) -> list[nn.Module]:
    """The model's blocks, outermost first (never the root itself)."""
    wanted = set(names or getattr(module, "_no_split_modules", None) or ())
    if wanted:
        blocks = [m for m in module.modules() if m is not module and type(m).__name__ in wanted]
        if not blocks and names:
            classes = sorted({type(m).__name__ for m in module.modules() if m is not module})
            raise ConfigError(f"distributed.fsdp_units = {names} names no module of this model; its module "
                              f"classes are {', '.join(classes[:12])}{' …' if len(classes) > 12 else ''}")
        if blocks:
            return _outermost(blocks)
    return [m for lists in module.modules() if isinstance(lists, nn.ModuleList) for m in lists
            if any(True for _ in m.parameters())]


def _outermost(blocks: list[nn.Module]) -> list[nn.Module]:
    inside = {id(sub) for block in blocks for sub in block.modules() if sub is not block}
    return [block for block in blocks if id(block) not in inside]


def _checkpointed(forward: Callable[..., Any], mode: str) -> Callable[..., Any]:
    """`forward` whose activations are recomputed in backward (all of them, or the cheap ones). The RNG
    state is replayed, so dropout draws the same masks: the result equals the plain forward's."""
    context_fn = (functools.partial(create_selective_checkpoint_contexts, _keep_expensive_outputs)
                  if mode == "selective" else None)
    options = {"context_fn": context_fn} if context_fn else {}

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **options, **kwargs)

    return run


_aten = torch.ops.aten
# Outputs worth keeping: recomputing them costs a matrix multiplication or an attention.
_EXPENSIVE = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
              _aten._scaled_dot_product_flash_attention.default,
              _aten._scaled_dot_product_efficient_attention.default,
              _aten._scaled_dot_product_cudnn_attention.default,
              _aten._scaled_dot_product_flash_attention_for_cpu.default}


def _keep_expensive_outputs(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _EXPENSIVE else CheckpointPolicy.PREFER_RECOMPUTE
