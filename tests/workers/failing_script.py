"""A user's script that fails on every rank, the way scripts fail: `failing_script.py crash|refuse`;
or ends with its own `sys.exit(CODE)` after registering an exit handler and writing a file it never
closes: `failing_script.py exit CODE DIR`
(CODE may be one per rank: `3,4`)."""

import atexit
import sys
from pathlib import Path

import torch.distributed as dist

from dtrain.errors import DtrainError

dist.init_process_group("gloo")
rank = dist.get_rank()
dist.barrier()
if sys.argv[1] == "exit":
    atexit.register(lambda: (Path(sys.argv[3]) / f"atexit-rank{rank}").write_text("ran"))
    # Written and never closed, as a script's log file often is: a normal exit's teardown flushes it
    # (less than one buffer, so nothing reaches the file before that). A function of the script's
    # keeps the script's globals alive (a reference cycle), as any script with a function does.
    unclosed = open(Path(sys.argv[3]) / f"unclosed-rank{rank}", "w")  # noqa: SIM115

    def log(text):
        unclosed.write(text)

    log("x" * 1000)
    print(f"rank {rank} is done")  # stdout is a pipe here: buffered, flushed only by a proper exit
    codes = sys.argv[2].split(",")
    sys.exit(int(codes[rank % len(codes)]))
if sys.argv[1] == "crash":
    raise RuntimeError(f"boom on rank {rank}")
raise DtrainError("data.path = 'nowhere' does not exist; give the folder of the shards")
