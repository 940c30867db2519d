"""Each worker writes the intra-op thread count torch gave it."""

import os
import sys
from pathlib import Path

import torch

Path(sys.argv[1], f"threads-{os.environ['RANK']}").write_text(str(torch.get_num_threads()))
