"""A user's script whose own last collective finishes as the process exits, run ROUNDS times:
`exit_race.py ROUNDS DIR`. Prints one line per round with both ranks' exit statuses; exit status 1
if any rank of any round did not exit with 0.

Each round forks two ranks from this process (torch is imported once, so a round costs a fraction of
a second). Rank 0 leaves an all-reduce to gloo's thread (async, its handle dropped: that thread holds
the last reference to the work and its tensor) and exits; rank 1 joins the all-reduce only once rank 0
has begun to exit. gloo's thread then has to take the GIL to drop the tensor Python made. The rest of
the race is made likely instead of left to load: rank 0 keeps the GIL while it exits (a long switch
interval stands for a busy interpreter) and Python's teardown lets go of it (a slow `__del__`), which
is when a thread that takes the GIL after finalisation has begun is ended mid-C++: SIGABRT.
"""

import atexit
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dtrain import distributed
from dtrain.config import DistributedConfig


class SlowTeardown:
    """Python's teardown, made long enough for gloo's thread to come for the GIL (and get it)."""

    def __del__(self):
        time.sleep(0.2)


def rank_main(rank: int, init_file: Path) -> None:
    """One rank of a round; it returns into the interpreter's normal exit."""
    global keep
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    distributed.start(DistributedConfig())  # what a Trainer does in a group the script made
    store = dist.distributed_c10d._get_default_store()
    tensor = torch.ones(1000)
    if rank == 1:
        store.wait(["exiting"])
        dist.all_reduce(tensor)
        return
    keep = SlowTeardown()
    dist.all_reduce(tensor, async_op=True)

    def exiting():
        # The first exit handler to run: let rank 1 in, and wait (holding the GIL) until the
        # all-reduce is over and gloo's thread has let go of the tensor's C++ reference: its
        # Python one, which needs the GIL, is next.
        sys.setswitchinterval(100)
        store.set("exiting", "1")
        deadline = time.monotonic() + 30  # a rank 1 that never came fails the round, not the suite
        while tensor._use_count() > 1 and time.monotonic() < deadline:
            pass

    atexit.register(exiting)


def main(rounds: int, out: Path) -> int:
    failed = 0
    for round in range(rounds):
        init_file = out / f"init-{round}"
        pids = []
        for rank in (0, 1):
            pid = os.fork()
            if pid == 0:
                rank_main(rank, init_file)
                sys.exit(0)  # the interpreter's own exit, teardown and all
            pids.append(pid)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        print(f"round {round}: exit statuses {codes}", flush=True)
        failed += any(codes)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), Path(sys.argv[2])))
