"""`package.module:function` references in a config: import them and call them with what they accept."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from dtrain.errors import ConfigError


def resolve(key: str, ref: str, also: tuple[type, ...] = ()) -> Any:
    """Import `package.module:function` (or an object of one of the types `also` names), or say in one
    line why it cannot be imported."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{key} = '{ref}': cannot import module '{module_name}' ({exc}); check the "
            f"name and that it is on PYTHONPATH"
        ) from None
    fn = getattr(module, attr, None)
    if not (callable(fn) or isinstance(fn, also)):
        raise ConfigError(f"{key} = '{ref}': module '{module_name}' has no function '{attr}'")
    return fn


def call(
    fn: Callable[..., Any], offered: Mapping[str, Any], options: Mapping[str, Any], options_key: str = "model.options"
) -> Any:
    """Call `fn` with the `offered` arguments its signature names (all if it takes **kwargs) and
    every user option (which it must accept)."""
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [k for k in options if not takes_any and k not in params]
    if unknown:
        accepted = [k for k in params if k not in offered]
        raise ConfigError(
            f"{options_key} has {', '.join(unknown)}, which {fn.__name__}() does not "
            f"take; it takes {', '.join(accepted) or 'no options'}"
        )
    kwargs = {k: v for k, v in offered.items() if takes_any or k in params}
    kwargs.update(options)
    return fn(**kwargs)
