"""`python -m dtrain ...` (what torchrun starts in every worker) is the `dtrain` command."""

import sys

from dtrain.cli import main

sys.exit(main())
