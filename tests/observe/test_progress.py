"""Rank 0's progress: a bar on a terminal (a real pty), plain lines through a pipe."""

import os
import re
import subprocess
import sys

from helpers import ROOT, SMALL_JOB, TIMEOUT, env, ok
from helpers import dtrain as dtrain_cli

# --- the progress bar on a terminal, plain lines elsewhere -----------------------------------------


def test_a_terminal_gets_a_progress_bar_and_a_pipe_gets_lines(tmp_path):
    import fcntl
    import pty
    import struct
    import termios

    piped = ok(dtrain_cli("run", *SMALL_JOB, f"run.dir={tmp_path / 'piped'}"))
    assert "\r" not in piped.stderr and re.search(r"^step 5 \| epoch 1 \| loss ", piped.stderr, re.M)
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a 120-column terminal
    proc = subprocess.Popen(
        [sys.executable, "-m", "dtrain", "run", *SMALL_JOB, f"run.dir={tmp_path / 'tty'}"],
        cwd=ROOT,
        env=env(),
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
    )
    os.close(secondary)
    screen = b""
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        screen += chunk
    assert proc.wait(timeout=TIMEOUT) == 0, screen.decode(errors="replace")
    text = screen.decode(errors="replace")
    assert "\r" in text and re.search(r"\d+/30 \[", text)  # tqdm redrawing "n/total [elapsed<left"
    assert not re.search(r"^step 5 \| epoch 1", text, re.M)  # train lines go into the bar, not the screen
