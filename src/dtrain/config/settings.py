"""How one config key is declared — `setting()`: type (the annotation), default, bounds, a sentence of
help — and how a value from TOML or the command line becomes that type, or a one-line answer why not."""

from __future__ import annotations

import difflib
import math
import sys
import typing
from collections.abc import Mapping
from dataclasses import field
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

import tomli_w

from dtrain.errors import ConfigError


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


def key_name(field_name: str) -> str:
    """The config key of a section's field: its name, less the trailing underscore PEP 8 gives a
    name that is a Python keyword (`checkpoint.async` is the field `async_`)."""
    return field_name.rstrip("_")


_FLOAT32_MAX = 3.4028234663852886e38
A_YEAR = 365 * 24 * 3600  # seconds: no wait a job sets needs more, and clocks overflow far beyond


def coerce(key: str, value: Any, type_: Any, meta: Mapping[str, Any], raw_text: str | None) -> Any:
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
            raise ConfigError(f"{key} must be a list, e.g. {key}={example}; got {describe(value)}")
        return [coerce(f"{key}[{i}]", v, item_type, meta, None) for i, v in enumerate(value)]
    if type_ is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table of keyword arguments; got {describe(value)}")
        return dict(value)
    if type_ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false; got {describe(value)}")
        return value
    if type_ is str:
        if raw_text is not None and not isinstance(value, str):  # run.dir=123: keep the text typed
            value = raw_text.strip()
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string; got {describe(value)}")
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
            raise ConfigError(f"{key} must be an integer; got {describe(value)}")
        if not -(2**63) <= value < 2**63:  # TOML's integers are 64-bit; Python's parser is not
            raise ConfigError(f"{key} = {value} does not fit in 64 bits; use a smaller value")
    elif type_ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number; got {describe(value)}")
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


def parse_value(key: str, text: str) -> Any:
    """A command-line value: a TOML literal when it is one (3, 0.05, true, [1, 2], "a b", 'a b'), else the
    text as typed. Text with a quote or bracket that does not pair up cannot be what was meant (quoting that
    arrived in half, a list the shell split at its spaces): it is refused, not kept as a name, quotes and all."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    text = text.strip()
    problem = _quoting_problem(key, text) or _bracket_problem(key, text)
    if problem:
        raise ConfigError(f"{key} = {text} on the command line: {problem}")
    return text


# A double quote anywhere, or a quote at either end, of text that is not a TOML string is quoting gone
# wrong; an apostrophe inside a name (runs/bob's) is not.
_QUOTES = ('"', "'")
_PAIRS = {"[": "]", "{": "}"}


def _quoting_problem(key: str, text: str) -> str | None:
    if '"' not in text and not (text.startswith(_QUOTES) or text.endswith(_QUOTES)):
        return None
    bare = text.replace('"', "") if '"' in text else text.strip("'")
    return (
        f"its quotes do not pair up into one string; write {key}={bare}"
        if bare.strip()
        else f"a lone quote is no value; write {key}=VALUE"
    )


def _bracket_problem(key: str, text: str) -> str | None:
    unclosed: list[str] = []
    for char in text:
        if char in _PAIRS:
            unclosed.append(char)
        elif char in _PAIRS.values() and (not unclosed or _PAIRS[unclosed.pop()] != char):
            return f"its '{char}' closes nothing; leave it out, or write a whole TOML list such as [1, 2]"
    if not unclosed:
        return None
    closers = "".join(_PAIRS[c] for c in reversed(unclosed))
    if text.endswith(","):  # the shell split the list at a space: the rest arrived as other arguments
        return (
            f"its '{unclosed[-1]}' is never closed: the shell split it at a space; quote the whole override, "
            f"rest and all, e.g. '{key}={text} ...{closers}'"
        )
    return f"its '{unclosed[-1]}' is never closed; quote the whole override for the shell, e.g. '{key}={text}{closers}'"


def inline(value: Any) -> str:
    """A value as one line of TOML: 0.2, "digits", [1, 28, 28], {}."""
    if isinstance(value, list):
        return "[" + ", ".join(inline(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {inline(v)}" for k, v in value.items()) + "}"
    return tomli_w.dumps({"v": value}).strip()[4:]


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _show(value: Any) -> str:
    return f"'{value}'" if isinstance(value, str) else repr(value)


def describe(value: Any) -> str:
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "table"}.get(
        type(value), type(value).__name__
    )
    return f"{_show(value)} ({kind})"
