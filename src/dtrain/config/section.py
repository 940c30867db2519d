"""What every section of the config shares: the `Section` base (its own check), and the checks several
sections make of their keys (a path that must be local, a built-in name or a factory's)."""

from __future__ import annotations

import difflib

from dtrain import objstore
from dtrain.errors import ConfigError


class Section:
    """What every section offers besides its keys."""

    __slots__ = ()  # the sections keep slots: a misspelt attribute raises instead of adding itself

    def check(self) -> None:
        """This section's own rules beyond each key's type and bounds (validate() runs it)."""


def local_only(key: str, value: str, what: str, given: str = "") -> None:
    """Object storage is read for data.path and run.dir only: a URL elsewhere would be taken as a local path
    (pathlib turns "s3://b/p" into the folder "s3:/b/p" under the current one) and silently read there."""
    if objstore.is_url(value):
        shown = (given or value).replace(value, objstore.without_credentials(value))
        raise ConfigError(
            f"{key} = '{shown}' holds a URL, and dtrain reads object storage only "
            f"for data.path and run.dir; give {what} as a local path (or a mounted store's)"
        )


def check_builtin_or_factory(key: str, value: str, builtins: tuple[str, ...]) -> None:
    if value not in builtins and not is_factory_ref(value):
        close = difflib.get_close_matches(value, builtins, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ConfigError(
            f"{key} = '{value}' is neither a built-in ({', '.join(builtins)}) nor "
            f"a factory 'package.module:function'; {hint}".rstrip("; ")
        )


def is_factory_ref(value: str) -> bool:
    module, sep, func = value.partition(":")
    return bool(sep and module and func and all(p.isidentifier() for p in module.split(".")) and func.isidentifier())
