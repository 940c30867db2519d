"""What a strategy tells whoever measures the step: the narrow view of the step timer DDP and its comm
hooks need (`observe.steptime.StepTimer` is the one dtrain passes), so that parallel/ knows nothing of
how steps are timed or watched."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class CommObserver(Protocol):
    def comm_launched(self) -> None:
        """A gradient bucket was handed to an asynchronous all-reduce."""

    def comm_blocked(self, seconds: float) -> None:
        """A synchronous hook held the training thread for `seconds` (then compute goes on)."""

    def awaiting_gradients(self) -> None:
        """Backward is done here and the rank waits for the gradient all-reduce (for the hang
        watchdog: a rank waiting for a stalled peer must not look stalled itself)."""

    def sample_comm_from(self, source: Callable[[], float | None]) -> None:
        """Where no hook of dtrain's times the communication: `source` reads the seconds per step
        the backward pass waited for it (None before any sample)."""

    def pipeline_bubble(self, fraction: float) -> None:
        """A pipeline's schedule leaves its stages idle for `fraction` of a step, in theory."""
