"""A user's script that says it started, then works a while without a word: `slow_start.py SECONDS`.
Whatever the launcher prints after the first line, it printed while its workers ran."""

import sys
import time

print("worker started", flush=True)
time.sleep(float(sys.argv[1]))
