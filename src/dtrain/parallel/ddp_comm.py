"""What goes in DDP's comm-hook slot: gradient averaging through shared memory between processes on
one machine (CPU, gloo), DDP's all-reduce timed per bucket, or torch's own compression hooks.

DDP averages gradients with the backend's all-reduce. On one machine without GPUs that is gloo over
loopback TCP: for the guide's MLP (3.3 MB of gradients) it costs about as much as the step's compute on
a small machine. Ranks that share a machine can instead each copy their gradient bucket into a shared
buffer, meet at a barrier and add the buffers up — one pass over memory instead of a network round trip.

The result is what DDP's default hook computes (each bucket divided by the world size, then summed),
added in rank order so that every rank gets bitwise the same numbers; with two ranks it is bitwise
identical to gloo's. Used only when every rank is on this machine and trains on the CPU; anything else
keeps DDP's own all-reduce.
"""

# No `from __future__ import annotations` here: DDP inspects the hook's annotations at run time.
import os
import platform
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from dtrain.errors import ConfigError
from dtrain.parallel.observer import CommObserver

SHM_DIR = "/dev/shm"
# Each rank's slot holds at most this much of a bucket at a time; larger buckets go through in chunks.
MAX_SLOT_BYTES = 64 << 20
FLAG_STRIDE = 64  # bytes between ranks' arrival counters: one cache line each; the pid sits beside
# Ranks meet by watching each other's counters in shared memory. That is safe without explicit
# fences only where stores are seen in program order (x86-64); elsewhere they meet at a gloo barrier.
SPIN_OK = platform.machine().lower() in ("x86_64", "amd64")


class SharedMemoryAllReduce:
    """State of the DDP comm hook `shared_memory_hook`: one mapped file, two slots per rank."""

    def __init__(self, rank: int, world_size: int, slot_bytes: int, path: str, timeout_s: float, spin: bool):
        self.rank = rank
        self.world_size = world_size
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self.spin = spin
        self.calls = 0  # buckets averaged (skipped micro-batches make none)
        self.observer: CommObserver | None = None  # told of each bucket, when the trainer measures steps
        self._parity = 0
        self._generation = 0
        header = world_size * FLAG_STRIDE
        mapped = torch.from_file(path, shared=True, size=_file_bytes(world_size, slot_bytes), dtype=torch.uint8)
        words = mapped[:header].view(torch.int64).numpy()
        self._flags = words[:: FLAG_STRIDE // 8]
        self._pids = words[1 :: FLAG_STRIDE // 8]
        self._pids[rank] = os.getpid()
        self._slots = mapped[header:].view(2, world_size, slot_bytes)

    @classmethod
    def create(
        cls, model: torch.nn.Module, rank: int, world_size: int, local_world_size: int, timeout_s: float
    ) -> "SharedMemoryAllReduce | None":
        """Set up the shared buffer on every rank (a collective call); None where it cannot work."""
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        slot_bytes = min(grad_bytes, MAX_SLOT_BYTES)
        slot_bytes += -slot_bytes % 64  # every slot 64-byte aligned, for any dtype
        path = _create_file(_file_bytes(world_size, slot_bytes)) if rank == 0 else None
        shared = [path]
        dist.broadcast_object_list(shared, src=0)
        path = shared[0]
        if path is None:
            return None
        # Spinning while waiting is only sensible when every process has a core of its own.
        spin = SPIN_OK and local_world_size <= len(os.sched_getaffinity(0))
        # Only ranks that see rank 0's file share its memory: agree on it before anyone relies on it.
        state = cls(rank, world_size, slot_bytes, path, timeout_s, spin) if os.path.exists(path) else None
        everyone = torch.tensor([1 if state is not None else 0])
        dist.all_reduce(everyone, op=dist.ReduceOp.MIN)
        if rank == 0:
            os.unlink(path)  # every rank has it mapped: the name can go, the memory stays until exit
        return state if everyone.item() == 1 else None

    def average(self, flat: torch.Tensor) -> torch.Tensor:
        """Replace the contiguous `flat` by the mean of every rank's `flat`, in place."""
        self.calls += 1
        step = self.slot_bytes // flat.element_size()
        for start in range(0, flat.numel(), step):
            chunk = flat[start : start + step]
            slots = self._slots[self._parity, :, : chunk.numel() * chunk.element_size()].view(chunk.dtype)
            torch.div(chunk, self.world_size, out=slots[self.rank])
            # Two alternating slot sets: a rank may write the next chunk while another still reads
            # this one, because it cannot get past the next meeting before that reader arrives there.
            self._meet()
            torch.add(slots[0], slots[1], out=chunk)
            for r in range(2, self.world_size):
                chunk.add_(slots[r])
            self._parity ^= 1
        return flat

    def _meet(self) -> None:
        """Wait until every rank has written its slot."""
        if not self.spin:
            dist.barrier()
            return
        self._generation += 1
        generation = self._generation
        self._flags[self.rank] = generation
        spins = 0
        deadline = None
        while self._flags.min() < generation:
            spins += 1
            if spins % 1024 == 0:
                os.sched_yield()
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                behind = [r for r in range(self.world_size) if self._flags[r] < generation]
                dead = [r for r in behind if not _alive(int(self._pids[r]))]
                if dead:  # no point waiting: let the launcher restart the group now
                    raise RuntimeError(f"rank {self.rank}: rank(s) {dead} died before the gradient all-reduce")
                if now > deadline:
                    raise TimeoutError(
                        f"rank {self.rank} waited {self.timeout_s:g} s for rank(s) {behind} at the gradient all-reduce"
                    )


def shared_memory_hook(state: SharedMemoryAllReduce, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket through shared memory (synchronously) and hand it back."""
    observer = state.observer
    if observer is not None:
        observer.awaiting_gradients()
    start = time.perf_counter()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(state.average(bucket.buffer()))
    if observer is not None:
        observer.comm_blocked(time.perf_counter() - start)
    return future


class TimedAllReduce:
    """State of `timed_allreduce_hook`: DDP's own all-reduce, with each bucket's launch noted."""

    def __init__(self, observer: CommObserver):
        self.observer = observer


def timed_allreduce_hook(state: TimedAllReduce, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default all-reduce (average over the default group), noting when each bucket is
    launched so the step timer can tell how long backward then waited for communication."""
    state.observer.comm_launched()
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]  # None: the default group


def _alive(pid: int) -> bool:
    """Whether process `pid` (on this machine) still runs; a zombie counts as dead."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _file_bytes(world_size: int, slot_bytes: int) -> int:
    return world_size * FLAG_STRIDE + 2 * world_size * slot_bytes


def _create_file(nbytes: int) -> str | None:
    """A file in /dev/shm with all its pages reserved, or None when there is no room for it."""
    if not os.path.isdir(SHM_DIR):
        return None
    stats = os.statvfs(SHM_DIR)
    if stats.f_bavail * stats.f_frsize < 2 * nbytes:  # leave at least as much to everyone else
        return None
    fd, path = tempfile.mkstemp(dir=SHM_DIR, prefix="dtrain-allreduce-")
    try:
        # Reserving the pages now turns "no room" into an error here instead of a SIGBUS when a
        # later write finds the tmpfs full.
        os.posix_fallocate(fd, 0, nbytes)
        return path
    except OSError:
        os.unlink(path)
        return None
    finally:
        os.close(fd)


# --- torch's own compression hooks, and communication time without a hook -------------------------


def check_comm_hook(name: str, backend: str) -> None:
    """torch's bf16 hook runs only on nccl; the others on any backend."""
    if name == "bf16" and backend != "nccl":
        raise ConfigError(
            f"ddp.comm_hook = 'bf16' needs nccl (CUDA GPUs) and this job runs on "
            f"{backend}; use ddp.comm_hook=fp16 or powersgd"
        )


def register_compression_hook(model: DistributedDataParallel, name: str, backend: str) -> None:
    """Put torch's `name` hook (fp16, bf16, powersgd) in DDP's comm-hook slot."""
    check_comm_hook(name, backend)
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    if name == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif name == "powersgd":
        # Rank-1 approximation after 10 plain all-reduces (torch's recommended warm start), with
        # error feedback so that what compression drops is carried into the next step.
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        raise ValueError(f"unknown comm hook {name!r}")


def ddp_exposed_comm(model: DistributedDataParallel) -> Callable[[], float | None]:
    """A reader of the gradient communication DDP's own reducer measured on its latest sampled step
    (it samples the first ten steps, then one in a hundred), in seconds the backward pass waited
    for it: the all-reduce's duration less its overlap with backward compute. None before any sample.

    This needs no comm hook, so DDP's C++ all-reduce keeps the fast path and its hook slot stays free.
    """

    def exposed_seconds() -> float | None:
        data = model._get_ddp_logging_data()
        comm = data.get("backward_comm_time")
        if not comm:
            return None
        return max(0, comm - data.get("backward_compute_comm_overlap_time", 0)) / 1e9

    return exposed_seconds
