"""DataLoader worker processes ended when their batches are no longer wanted, not when collected."""

from __future__ import annotations

from typing import Any


def end_workers(batches: Any) -> None:
    """End the worker processes behind a DataLoader iterator now (another iterator has none: nothing to do).

    Left to the garbage collector (a loader with persistent workers keeps its iterator; a pass read only
    part-way leaves its own behind), they outlive their use in a long-lived process (a notebook, a script
    that fits twice, the tests), and when the iterator is collected each worker is given 5 s to notice
    before it is killed: a pause at some later, unrelated moment. Lightning ends them the same way when a
    loop ends; torch offers no public call for it.
    """
    shutdown = getattr(batches, "_shutdown_workers", None)  # torch's _MultiProcessingDataLoaderIter
    if callable(shutdown):
        shutdown()
