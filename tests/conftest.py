import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# helpers.py, and the user-style modules under workers/ that configs reference as 'module:function'.
sys.path[:0] = [str(HERE), str(HERE / "workers")]
