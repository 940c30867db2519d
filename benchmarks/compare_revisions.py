"""W1 and W2 throughput of dtrain at two revisions of this repository, side by side.

    python benchmarks/compare_revisions.py --base ca75383            # 5 rounds, W1 and W2
    python benchmarks/compare_revisions.py --base v0.1.0 --rounds 7 --only W1

For a change that must not move speed (a refactor, a moved module), this is the proof: each revision's
own `benchmarks/throughput.py` (W1, the guide's MLP) and `benchmarks/gpt_tokens.py` (W2, the built-in
GPT on tokens) run their `dtrain` variant under torchrun with that revision's `src/` first on the
path, interleaved from this one parent process, the order swapped every round (base, head, head,
base, ...), so a noisy neighbour slows both alike and neither always runs first. The base revision is
unpacked with `git archive` into a temporary folder; the head is this working tree. The table gives
medians and head/base ratios; on a shared CPU machine read anything within a few per cent as noise.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

from harness import run_workers

HERE = Path(__file__).resolve().parent.parent
WORKLOADS = {
    "W1 samples/s": ("benchmarks/throughput.py", "samples_per_s", ["--steps", "300"]),
    "W2 tokens/s": ("benchmarks/gpt_tokens.py", "tokens_per_s", ["--steps", "20"]),
}


def unpack(rev: str, into: Path) -> Path:
    """The tree of `rev`, as committed, under `into`."""
    archive = subprocess.run(["git", "-C", str(HERE), "archive", rev], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the revision to compare against (a commit, tag or branch)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--data", type=Path, default=Path("data/stdlib"), help="a `dtrain prepare` folder (W2)")
    parser.add_argument("--only", choices=[w.split()[0] for w in WORKLOADS], help="measure one workload")
    args = parser.parse_args()
    workloads = {w: spec for w, spec in WORKLOADS.items() if args.only in (None, w.split()[0])}
    if "W2 tokens/s" in workloads and not (args.data / "meta.json").exists():
        subprocess.run(
            [sys.executable, "-m", "dtrain", "prepare", "text", "--python-stdlib", "--out", str(args.data)], check=True
        )
    with tempfile.TemporaryDirectory(prefix="dtrain-base-") as tmp:
        trees = {"base": unpack(args.base, Path(tmp)), "head": HERE}
        results: dict[str, dict[str, list[float]]] = {w: {t: [] for t in trees} for w in workloads}
        for round_ in range(args.rounds):
            for workload, (script, key, extra) in workloads.items():
                order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
                for name in order:
                    tree = trees[name]
                    flags = ["--worker", "dtrain", *extra]
                    if "gpt_tokens" in script:
                        flags += ["--data", str(args.data.absolute())]
                    value = run_workers(
                        str(tree / script), *flags, nproc=args.nproc, env={"PYTHONPATH": str(tree / "src")}
                    )[key]
                    results[workload][name].append(value)
                    print(f"round {round_ + 1}/{args.rounds} {workload} {name}: {value:,.0f}", file=sys.stderr)
    print(f"| workload | base ({args.base}) median | head median | runs | head / base |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for workload, by_tree in results.items():
        base, head = statistics.median(by_tree["base"]), statistics.median(by_tree["head"])
        print(f"| {workload} | {base:,.0f} | {head:,.0f} | {len(by_tree['head'])} | {head / base:.3f}× |")


if __name__ == "__main__":
    main()
