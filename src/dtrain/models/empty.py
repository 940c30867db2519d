"""A model built with its parameters on the meta device: their shapes and dtypes, no memory, no values.

A run under FSDP that starts from weights in a file (`model.init_from`, an `hf:` folder) builds its model
so: the strategy shards the empty parameters, each rank then gives memory to its own shards only
(parallel/deferred.py) and the file's rows fill them. Built for real, every rank would first hold the
whole model, initialised for nothing.

Buffers stay real, as Accelerate's `init_empty_weights(include_buffers=False)` keeps them: a buffer the
model computes when built and does not save (a rotary embedding's `inv_freq`, a causal mask) is in no
file, and must keep its value. The initialisation the model runs on the empty parameters computes and
draws nothing (torch's random generator is not advanced).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn


@contextlib.contextmanager
def parameters_on_meta(enabled: bool = True) -> Iterator[None]:
    """Within it (when `enabled`), every parameter a module registers is replaced by one on the meta
    device (of its class, with its attributes). A parameter registered again (a head tied to the
    embedding: `lm_head.weight = wte.weight`) is its meta one already, and stays one object."""
    if not enabled:
        yield
        return
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: Any) -> None:
        if param is not None and not param.is_meta:
            # The same real parameter given twice before (two modules sharing it) gets one meta parameter.
            meta = getattr(param, _META, None)
            if meta is None:
                meta = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
                meta.__dict__.update(param.__dict__)
                setattr(param, _META, meta)
            param = meta
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


_META = "_dtrain_on_meta"  # a real parameter's meta stand-in, noted on it while the model is built
