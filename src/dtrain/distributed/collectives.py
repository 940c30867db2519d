"""Small collectives over Python objects, and the pattern built on them: rank 0 decides, every rank
raises the same error. Each is a no-op on one process."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from dtrain.errors import DtrainError

T = TypeVar("T")


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj`, by rank (a collective, on `group`: the default group unless given)."""
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    _let_gloo_release_python_objects(group)
    return gathered


def first_error(error: str | None, group: Any = None) -> str | None:
    """Every rank learns the lowest rank's error message, if any rank has one (a collective)."""
    return next((e for e in gather_objects(error, group) if e is not None), None)


def hostnames() -> list[str]:
    """Every rank's host name, by rank (a collective)."""
    me = socket.gethostname()
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [me]
    names: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(names, me)
    _let_gloo_release_python_objects()
    return names


def from_rank0(value, group: Any = None):
    """Rank 0's `value` on every rank (a collective, on `group`: one of every rank, rank 0 its first)."""
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    _let_gloo_release_python_objects(group)
    return box[0]


def _let_gloo_release_python_objects(group: Any = None) -> None:
    # gloo's worker threads drop the Python-owned tensors of an object collective after it completes,
    # and need the GIL for that. If the process group were destroyed right then (the main thread
    # joins those threads holding the GIL) both would wait forever. A barrier lets them finish first.
    dist.barrier(group=group)


def rank0_decides(decide: Callable[[], T], *, is_main: bool | None = None, group: Any = None) -> T | None:
    """Run `decide` on rank 0 alone and return its answer on every rank (None elsewhere when it has
    none); a `DtrainError` it raises is raised on every rank, with rank 0's message (a collective).

    The pattern behind every check only rank 0 may make (the file system of run.dir, a checkpoint's
    marker): the other ranks must not go on while rank 0 refuses, nor wait for an answer that never comes.
    """
    main = (not dist.is_initialized() or dist.get_rank() == 0) if is_main is None else is_main
    answer: tuple[Any, str | None] = (None, None)
    if main:
        try:
            answer = (decide(), None)
        except DtrainError as exc:
            answer = (None, str(exc))
    value, error = from_rank0(answer, group)
    if error is not None:
        raise DtrainError(error)
    return value


def every_rank_raises(error: str | None, group: Any = None) -> None:
    """Raise on every rank the lowest rank's error message, if any rank has one (a collective)."""
    error = first_error(error, group)
    if error is not None:
        raise DtrainError(error)
