"""The house rule that no module of the package grows past 450 lines: a module that long holds more than
one job, and is split by what it does (docs/architecture.md lists each module's one job).

    python tools/module_sizes.py [FOLDER] [--max N]     # default: src/dtrain, 450

Lists every module over the limit, longest first, and exits 1 if there is any; CI runs it (.ci/run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def over(folder: Path, limit: int) -> list[tuple[int, Path]]:
    """The modules under `folder` longer than `limit` lines, longest first."""
    sizes = [(len(path.read_text(encoding="utf-8").splitlines()), path) for path in sorted(folder.rglob("*.py"))]
    return sorted(((n, path) for n, path in sizes if n > limit), key=lambda item: (-item[0], str(item[1])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Modules longer than the house allows.")
    parser.add_argument("folder", nargs="?", type=Path, default=ROOT / "src" / "dtrain")
    parser.add_argument("--max", type=int, default=450, help="the most lines a module may have (default 450)")
    args = parser.parse_args(argv)
    found = over(args.folder, args.max)
    for n, path in found:
        print(f"{path}: {n} lines, past {args.max}: split it by what it does", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
