"""`dtrain export RUN_DIR --format hf [--step N] [--out DIR] [--max-shard-size SIZE]`: a run's weights in a
format other programs read. The work is checkpoint/hf_export.py's (also what `checkpoint.export = "hf"`
runs at the end of a run); here, what the command says."""

from __future__ import annotations

from pathlib import Path

from dtrain import objstore
from dtrain.errors import DtrainError
from dtrain.rundir.lock import RunDirLock

FORMATS = ("hf",)


def export(run_dir: str, format: str, out: str | None, step: int | None, max_shard_size: str) -> str:
    """Export; the line saying what was written."""
    from dtrain.checkpoint.hf_export import export_hf

    if format not in FORMATS:
        raise DtrainError(f"--format {format!r} is not one dtrain writes; use --format hf (a Hugging Face folder)")
    if step is not None and step < 0:
        raise DtrainError(f"--step must be a checkpoint's step (a whole number >= 0); got {step}")
    for what, path in (("RUN_DIR", run_dir), ("--out", out)):
        if path is not None and not path.strip():  # an unset shell variable: never "." by accident
            raise DtrainError(f"{what} is empty (an unset shell variable?); give the folder of a dtrain run")
        if objstore.is_url(path):  # pathlib would take "s3://b/p" for the local folder "s3:/b/p"
            raise DtrainError(
                f"{what} {objstore.without_credentials(str(path))} is a URL; export reads and writes local folders"
            )
    folder = Path(run_dir)
    target = Path(out) if out is not None else folder / "hf"
    if folder.is_dir() and _inside(target, folder) and RunDirLock(folder).held():
        raise DtrainError(
            f"{folder} is still training, and its own end may write {target}; export once it has ended, "
            f"or give --out a folder outside it"
        )
    written = export_hf(folder, target, step, max_shard_size)
    source = f"checkpoint step-{step}" if step is not None else "final weights"
    return (
        f"{written}: the {source} of {folder} as a Hugging Face model folder; load it with "
        f"transformers.AutoModelForCausalLM.from_pretrained('{written}')"
    )


def _inside(path: Path, folder: Path) -> bool:
    return path.absolute().resolve().is_relative_to(folder.absolute().resolve())
