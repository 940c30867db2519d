"""`dtrain doctor`: what this machine offers for distributed training, what looks wrong, and — with
`--nproc` — how fast real collectives across the group are: the all-reduce DDP uses, the all-gather and
reduce-scatter FSDP and tensor parallel use.

    dtrain doctor                                  environment report (exit 1 when something is wrong)
    dtrain doctor --nproc 2                        bandwidth of each, 1 KiB to 256 MiB, and a verdict
    dtrain doctor --nproc 2 --max-mib 4            the same up to 4 MiB: a quick look
    dtrain doctor --nnodes 2 --nproc 8 --rdzv-endpoint node0:29500    the same across machines
"""

from __future__ import annotations

import os
import platform
import socket
import sys
import time

# What each variable a launcher or user sets means to a distributed job.
ENV_MEANINGS = {
    "MASTER_ADDR": "address of rank 0's rendezvous store (env://)",
    "MASTER_PORT": "port of rank 0's rendezvous store (env://)",
    "RANK": "this process's global rank",
    "WORLD_SIZE": "number of processes in the job",
    "LOCAL_RANK": "this process's rank on its machine (selects its GPU)",
    "LOCAL_WORLD_SIZE": "processes on this machine",
    "TORCHELASTIC_RUN_ID": "set by torchrun: this process is one of its workers",
    "TORCHELASTIC_RESTART_COUNT": "how often torchrun restarted the group",
    "SLURM_JOB_ID": "running inside a SLURM job",
    "SLURM_PROCID": "SLURM task rank (a worker when started by srun)",
    "SLURM_NTASKS": "SLURM tasks in the job step",
    "OMPI_COMM_WORLD_RANK": "Open MPI rank (started by mpirun)",
    "OMPI_COMM_WORLD_SIZE": "Open MPI world size",
    "CUDA_VISIBLE_DEVICES": "GPUs this process may use",
    "OMP_NUM_THREADS": "intra-op CPU threads per process",
    "GLOO_SOCKET_IFNAME": "network interface gloo binds",
    "NCCL_SOCKET_IFNAME": "network interface NCCL uses for its sockets",
    "NCCL_DEBUG": "NCCL log level (INFO shows the chosen transports)",
    "NCCL_IB_DISABLE": "1 turns InfiniBand off for NCCL (slow across nodes)",
    "NCCL_P2P_DISABLE": "1 turns GPU peer-to-peer off (slow within a node)",
    "TORCH_DISTRIBUTED_DEBUG": "collective checking (DETAIL checks shapes across ranks)",
    "TORCH_FR_BUFFER_SIZE": "flight recorder size: the last collectives kept (dtrain dumps them on a hang)",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "the flight recorder size under its old name (torch before 2.7)",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "what NCCL does with a failed collective",
}


def environment_report() -> tuple[list[str], list[str]]:
    """(lines describing this machine, problems found)."""
    import torch
    import torch.distributed as dist

    from dtrain import __version__
    from dtrain.distributed import available_cores, netaddr
    from dtrain.train.amp import precision_problem

    lines, problems = [], []
    lines.append(
        f"dtrain {__version__}, torch {torch.__version__}, python {platform.python_version()}, "
        f"{platform.system()} {platform.machine()}"
    )
    backends = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(), "mpi": dist.is_mpi_available()}
    lines.append("backends: " + ", ".join(f"{name} {'yes' if ok else 'no'}" for name, ok in backends.items()))
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if backends["nccl"] else "none"
        lines.append(f"CUDA {torch.version.cuda}, NCCL {nccl}, {torch.cuda.device_count()} GPU(s):")
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            # Per device, and native only: torch.cuda.is_bf16_supported() asks about the current
            # device and counts emulation (V100, T4) as support.
            native = (
                precision_problem(
                    "bf16", "cuda", props.name, (props.major, props.minor), rocm=torch.version.hip is not None
                )
                is None
            )
            lines.append(
                f"  cuda:{i} {props.name}, sm_{props.major}{props.minor}, "
                f"{props.total_memory / 2**30:.0f} GiB, bf16 {'yes' if native else 'emulated only'}"
            )
    else:
        lines.append(
            f"CUDA: none visible ({'CPU build of torch' if torch.version.cuda is None else 'no GPU'}): "
            f"dtrain uses gloo on the CPU"
        )
    lines.append(f"CPU: {available_cores()} core(s) for this process, intra-op threads {torch.get_num_threads()}")
    try:
        stats = os.statvfs("/dev/shm")
        free = stats.f_bavail * stats.f_frsize
        lines.append(f"/dev/shm: {free / 2**30:.1f} GiB free")
        if free < 512 * 2**20:
            problems.append(
                f"/dev/shm has only {free / 2**20:.0f} MiB free: DataLoader workers and dtrain's "
                f"shared-memory all-reduce need room (docker: --shm-size=8g)"
            )
    except OSError:
        lines.append("/dev/shm: none (shared-memory all-reduce and DataLoader workers fall back)")
    interfaces = netaddr.interface_addresses()
    lines.append("network interfaces: " + ", ".join(f"{name} {addr}" for name, addr in interfaces.items()))
    host = socket.gethostname()
    try:
        resolved = socket.gethostbyname(host)
    except OSError:
        resolved = "nothing"
    note = (
        (" (loopback: fine on one machine; across machines dtrain takes the address on the route to --rdzv-endpoint)")
        if resolved.startswith("127.")
        else ""
    )
    lines.append(f"hostname {host} resolves to {resolved}{note}")

    set_vars = [(k, os.environ[k]) for k in ENV_MEANINGS if k in os.environ]
    lines.append("distributed environment variables:" + ("" if set_vars else " none set"))
    lines += [f"  {k}={v}  — {ENV_MEANINGS[k]}" for k, v in set_vars]
    problems += _env_problems(interfaces, available_cores(), backends)
    return lines, problems


def _env_problems(interfaces: dict[str, str], cores: int, backends: dict[str, bool]) -> list[str]:
    import torch

    from dtrain.distributed import detect_env
    from dtrain.errors import EnvironmentProblem

    env, problems = os.environ, []
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if var in env:
            wanted = [name.strip() for name in env[var].split(",") if name.strip()]
            # NCCL accepts prefixes and ^exclusions; gloo wants exact names.
            missing = [
                n
                for n in wanted
                if not n.startswith(("^", "="))
                and not any(i == n or (var.startswith("NCCL") and i.startswith(n)) for i in interfaces)
            ]
            if missing:
                problems.append(
                    f"{var}={env[var]} names no interface here ({', '.join(missing)}); this machine "
                    f"has {', '.join(interfaces)}"
                )
    if "MASTER_PORT" in env and not (env["MASTER_PORT"].isdigit() and 0 < int(env["MASTER_PORT"]) < 65536):
        problems.append(f"MASTER_PORT={env['MASTER_PORT']} is not a TCP port (1-65535)")
    if ("RANK" in env) != ("WORLD_SIZE" in env):
        problems.append("only one of RANK and WORLD_SIZE is set: a worker needs both (or neither)")
    try:  # what a worker started here would refuse: the launcher's own reading of these variables
        detect_env(env)
    except EnvironmentProblem as exc:
        if not str(exc).startswith("MASTER_PORT"):  # said above
            problems.append(f"{exc}: a worker would refuse to start")
    if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) > cores:
        problems.append(
            f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} exceeds the {cores} core(s) this process "
            f"may use: processes will fight over cores"
        )
    if env.get("CUDA_VISIBLE_DEVICES") == "" and torch.version.cuda is not None:
        problems.append("CUDA_VISIBLE_DEVICES is empty: no GPU is visible to this process")
    if env.get("NCCL_IB_DISABLE") == "1" and backends["nccl"]:
        problems.append("NCCL_IB_DISABLE=1: NCCL will not use InfiniBand; multi-node training falls back to TCP")
    return problems


# --- the collectives test (runs in every worker) ---------------------------------------------------

SIZES = [2**k for k in range(10, 29, 2)]  # 1 KiB, 4 KiB, ... 256 MiB

# The collectives measured, with nccl-tests' bus-bandwidth factor: what each rank sends over the
# slowest link per byte of the buffer. DDP all-reduces gradients; FSDP and tensor parallel all-gather
# parameters (or activations) and reduce-scatter gradients. The size is the whole buffer: the gathered
# tensor for all-gather, the tensor reduced for reduce-scatter (nccl-tests' convention). Torch's calls
# by their newest names (torch 2.13 renamed the `_into_tensor`/`_tensor` pair), else the older ones.
COLLECTIVES = {  # name: (torch calls, newest first; bus factor of n)
    "all-reduce": (("all_reduce",), lambda n: 2 * (n - 1) / n),
    "all-gather": (("all_gather_single", "all_gather_into_tensor"), lambda n: (n - 1) / n),
    "reduce-scatter": (("reduce_scatter_single", "reduce_scatter_tensor"), lambda n: (n - 1) / n),
}


def torch_call(name: str):
    """The function of torch.distributed that does collective `name` in this torch."""
    import torch.distributed as dist

    return next(getattr(dist, call) for call in COLLECTIVES[name][0] if hasattr(dist, call))


class Collective:
    """One collective on one buffer size: `run()` once, `correct()` after it (rank r contributes r + 1)."""

    def __init__(self, name: str, size: int, world: int, rank: int, device, fallback: bool = False) -> None:
        import torch

        self.name, self.world, self.fallback = name, world, fallback
        count = -(-size // 4 // world) * world  # whole float32 elements, a multiple of the world size
        self.bytes = count * 4
        self.full = torch.full((count,), float(rank + 1), device=device)
        self.part = torch.full((count // world,), float(rank + 1), device=device)

    def run(self) -> None:
        if self.name == "all-reduce" or self.fallback:  # the fallback: the whole sum, each rank keeping its part
            torch_call("all-reduce")(self.full)
        elif self.name == "all-gather":
            torch_call("all-gather")(self.full, self.part)
        else:
            torch_call("reduce-scatter")(self.part, self.full)

    def correct(self) -> bool:
        import torch

        total = self.world * (self.world + 1) / 2
        if self.name == "all-gather":  # chunk k came from rank k
            ranks = torch.arange(1, self.world + 1, dtype=self.full.dtype, device=self.full.device)
            return bool(torch.all(self.full.view(self.world, -1) == ranks[:, None]))
        if self.name == "all-reduce" or self.fallback:
            return bool(torch.all(self.full == total))
        return bool(torch.all(self.part == total))


def reduce_scatter_supported(world: int, rank: int, device) -> bool:
    """Whether this backend has a reduce-scatter into one tensor (gloo gained it late): tried once, on
    every rank."""
    import torch
    import torch.distributed as dist

    try:
        probe = Collective("reduce-scatter", 4 * world, world, rank, device)
        probe.run()
        works = 1
    except (RuntimeError, NotImplementedError, ValueError):
        works = 0
    agreed = torch.tensor([works], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # all ranks take the same op, or the next one hangs
    return bool(agreed.item())


def bandwidth_worker(iters: int, max_mib: int = 256) -> int:
    """In each worker: time each collective at every size up to `max_mib` MiB, check their results, rank 0
    prints the tables."""
    import torch
    import torch.distributed as dist

    from dtrain import distributed
    from dtrain.config import DistributedConfig

    session = distributed.start(DistributedConfig())
    try:
        world, device = session.world_size, session.device
        fallback = not reduce_scatter_supported(world, session.rank, device)
        tables, correct = {}, []
        for name in COLLECTIVES:
            rows, ok = [], True
            for size in [s for s in SIZES if s <= max_mib * 2**20] or SIZES[:1]:
                op = Collective(name, size, world, session.rank, device, fallback=fallback)
                op.run()  # warms the connections up, and is checked
                ok = ok and op.correct()
                # Back-to-back rounds, timed together, as nccl-tests does: one rank arriving late is
                # amortised instead of counted as latency. Small messages get more rounds.
                rounds = iters * (10 if size < 2**20 else 1)
                distributed.barrier()
                _sync(device)
                start = time.perf_counter()
                for _ in range(rounds):
                    op.run()
                _sync(device)
                elapsed = (time.perf_counter() - start) / rounds
                slowest = torch.tensor([elapsed], dtype=torch.float64, device=device)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a collective is as slow as its slowest rank
                rows.append((size, op.bytes, slowest.item()))
                del op  # the 256 MiB buffers of one size go before the next
            tables[name] = rows
            correct.append(1 if ok else 0)
        agreed = torch.tensor(correct, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        wrong = [name for name, good in zip(COLLECTIVES, agreed.tolist()) if not good]
        if session.is_main:
            print(bandwidth_report(tables, world, session.backend, wrong, fallback), flush=True)
        return 1 if wrong else 0
    finally:
        distributed.stop(session)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth_table(name: str, rows: list[tuple[int, int, float]], world: int, backend: str, note: str = "") -> str:
    """One collective in nccl-tests' columns: algbw = bytes / time, busbw = algbw × its factor."""
    factor = COLLECTIVES[name][1](world)
    lines = [
        f"{name} ({note or torch_call(name).__name__}), {world} processes, {backend}:",
        f"{'size':>10} {'time':>11} {'algbw GB/s':>11} {'busbw GB/s':>11}",
    ]
    for size, nbytes, seconds in rows:
        algbw = nbytes / seconds / 1e9
        lines.append(f"{_human(size):>10} {_duration(seconds):>11} {algbw:>11.3f} {algbw * factor:>11.3f}")
    return "\n".join(lines)


def peak_busbw(name: str, rows: list[tuple[int, int, float]], world: int) -> float:
    return max(nbytes / seconds / 1e9 for _, nbytes, seconds in rows) * COLLECTIVES[name][1](world)


def bandwidth_report(
    tables: dict[str, list[tuple[int, int, float]]], world: int, backend: str, wrong: list[str], fallback: bool
) -> str:
    """The three tables, then one verdict: the kind of link from the all-reduce, every peak beside it."""
    notes = {"reduce-scatter": "no reduce-scatter on this backend: all_reduce timed instead"} if fallback else {}
    parts = [bandwidth_table(name, rows, world, backend, notes.get(name, "")) for name, rows in tables.items()]
    peaks = {name: peak_busbw(name, rows, world) for name, rows in tables.items()}
    parts.append(verdict(peaks, tables["all-reduce"][0][2], backend, wrong))
    return "\n".join(parts)


def verdict(peaks: dict[str, float], latency_s: float, backend: str, wrong: list[str]) -> str:
    if wrong:
        return f"verdict: BROKEN — {', '.join(wrong)} results were wrong on some rank; check the network and drivers"
    busbw = peaks["all-reduce"]
    if backend == "nccl":
        kind = (
            "NVLink-class"
            if busbw > 100
            else "PCIe or InfiniBand-class"
            if busbw > 10
            else "TCP-class (slow for GPUs: check NCCL_SOCKET_IFNAME, NCCL_IB_DISABLE, NCCL_DEBUG=INFO)"
        )
    else:
        kind = "shared-memory/loopback-class" if busbw > 2 else "TCP-class"
    others = ", ".join(f"{name} {peak:.2f}" for name, peak in peaks.items() if name != "all-reduce")
    return (
        f"verdict: OK — results correct; peak bus bandwidth {busbw:.2f} GB/s ({kind}; {others} GB/s); "
        f"small-message latency {_duration(latency_s)}"
    )


def _human(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size} {unit}"
        size //= 1024
    return f"{size} TiB"


def _duration(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def compute_report(nproc: int = 1) -> list[str]:
    """What one process computes per second here: the peak for MFU on a CPU (monitor.peak_tflops)."""
    import torch

    from dtrain.distributed import available_cores
    from dtrain.train.speed import matmul_tflops

    threads = max(1, available_cores() // max(1, nproc))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    measured = {d: matmul_tflops(device, d, threads) for d in ("fp32", "bf16")}
    where = f"{device}, {threads} thread(s) per process for {nproc} process(es)" if device == "cpu" else device
    line = f"matmul ({where}): fp32 {measured['fp32']:.3g} TFLOP/s, bf16 {measured['bf16']:.3g} TFLOP/s per process"
    if device == "cpu":
        line += (
            f"; for an MFU on this CPU pass monitor.peak_tflops={measured['fp32']:.3g} "
            f"(training.precision=bf16: {measured['bf16']:.3g})"
        )
    return [line]


def main_report(nproc: int = 1) -> int:
    lines, problems = environment_report()
    lines += compute_report(nproc)
    print("\n".join(lines))
    if problems:
        print(f"problems ({len(problems)}):")
        print("\n".join(f"  - {p}" for p in problems))
        return 1
    print("problems: none found")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main_report())
