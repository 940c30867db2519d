"""DistributedDataParallel: every process holds the whole model; gradients are averaged in backward.

What goes in DDP's one comm-hook slot is decided here (see comm.py): the user's compression, else on
CPU with every rank on one machine the shared-memory average, else (CPU across machines) DDP's own
all-reduce timed per bucket. On GPUs the slot stays free and DDP's C++ all-reduce untouched.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dtrain.config import DDPConfig
from dtrain.distributed import Session
from dtrain.errors import DtrainError
from dtrain.parallel.base import Strategy
from dtrain.parallel.ddp_comm import (
    SharedMemoryAllReduce,
    TimedAllReduce,
    ddp_exposed_comm,
    register_compression_hook,
    shared_memory_hook,
    timed_allreduce_hook,
)
from dtrain.parallel.dims import ParallelDims
from dtrain.parallel.observer import CommObserver

# How DDP says that ranks disagree about the parameters: their number, a shape, a layout.
_MODEL_MISMATCH = (
    "expects same model across all ranks",
    "appears not to match sizes of the same param",
    "appears not to match strides of the same param",
)


class DDP(Strategy):
    model: DistributedDataParallel

    def __init__(
        self,
        module: nn.Module,
        session: Session,
        dims: ParallelDims,
        options: DDPConfig,
        timeout_s: float,
        observer: CommObserver,
        breakdown: bool,
    ):
        if dims.dp_shard != 1:  # the factory's promise: DDP replicates, nothing else
            raise ValueError(f"DDP replicates over every process; got {dims}")
        super().__init__(module, dims)
        self.session, self.options, self.observer = session, options, observer
        self.timeout_s = timeout_s  # the group's collective timeout: the shared-memory average waits as long
        self.shared_memory: SharedMemoryAllReduce | None = None
        self.model = self._wrap()
        self._attach_comm_hook(breakdown)

    def sync_gradients(self, enabled: bool) -> None:
        # DDP's no_sync, as a flag: the all-reduce runs only when it is set.
        self.model.require_backward_grad_sync = enabled

    def after_first_backward(self) -> None:
        """A parameter the forward pass never used leaves DDP waiting for its gradient forever (or
        failing a step later with a message about reductions). Say what to do."""
        if self.options.find_unused_parameters:
            return
        unused = [name for name, p in self.module.named_parameters() if p.requires_grad and p.grad is None]
        if unused:
            shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
            raise DtrainError(
                f"the forward pass did not use these parameters: {shown}; DDP needs a gradient "
                f"for every parameter: set ddp.find_unused_parameters=true, or drop "
                f"them from the model (or set requires_grad=False)"
            )

    def _wrap(self) -> DistributedDataParallel:
        dc, device = self.options, self.session.device
        try:
            return DistributedDataParallel(
                self.module,
                device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=dc.bucket_cap_mb,
                gradient_as_bucket_view=dc.gradient_as_bucket_view,
                static_graph=dc.static_graph,
                find_unused_parameters=dc.find_unused_parameters,
            )
        except RuntimeError as exc:
            # DDP compares every parameter's shape across ranks before it starts. Only that failure is
            # about the model: an out-of-memory or a broken transport is a RuntimeError too.
            if not any(sign in str(exc) for sign in _MODEL_MISMATCH):
                raise
            first_line = str(exc).strip().splitlines()[0]
            raise DtrainError(
                f"the model differs between ranks ({first_line}); build the same model on "
                f"every rank: seed before building it and keep its shape independent of "
                f"the rank"
            ) from None

    def _attach_comm_hook(self, breakdown: bool) -> None:
        dc, device = self.options, self.session.device
        if dc.comm_hook != "none":
            register_compression_hook(self.model, dc.comm_hook, self.session.backend)
        else:
            self.shared_memory = self._share_gradients_in_memory()
            if self.shared_memory is not None:
                self.shared_memory.observer = self.observer
                return
            if device.type == "cpu" and breakdown:
                self.model.register_comm_hook(TimedAllReduce(self.observer), timed_allreduce_hook)
                return
        self.observer.sample_comm_from(ddp_exposed_comm(self.model))
        self._mark_gradient_wait()

    def _mark_gradient_wait(self) -> None:
        """Tell the hang watchdog when backward is done and DDP waits for the gradient all-reduce, where
        no hook of dtrain's reports it: the first parameter's gradient is, in the usual layer order,
        the last to arrive. Without this, a rank waiting for a stalled peer would look stalled too."""
        first = next((p for p in self.module.parameters() if p.requires_grad), None)
        if first is None:
            return
        model, awaiting_gradients = self.model, self.observer.awaiting_gradients

        def backward_over(_: torch.Tensor) -> None:
            if model.require_backward_grad_sync:  # not on accumulation micro-batches: no all-reduce
                awaiting_gradients()

        first.register_post_accumulate_grad_hook(backward_over)

    def _share_gradients_in_memory(self) -> SharedMemoryAllReduce | None:
        """On CPU with every rank on this machine, average gradients through shared memory."""
        session = self.session
        if not (
            self.options.shared_memory_allreduce
            and session.device.type == "cpu"
            and session.backend == "gloo"
            and session.env.local_world_size == session.world_size
        ):
            return None
        state = SharedMemoryAllReduce.create(
            self.module, session.rank, session.world_size, session.env.local_world_size, self.timeout_s
        )
        if state is not None:
            self.model.register_comm_hook(state, shared_memory_hook)
        return state
