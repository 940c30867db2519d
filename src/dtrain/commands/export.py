"""`dtrain export RUN_DIR --format hf [--step N] [--out DIR] [--max-shard-size SIZE]`: a run's weights in a
format other programs read. The work is export/hf.py's (also what `checkpoint.export = "hf"`
runs at the end of a run); here, what the command says."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from dtrain import objstore
from dtrain.commands import store_export
from dtrain.errors import DtrainError
from dtrain.rundir.lock import RunDirLock

FORMATS = ("hf",)


def export(
    run_dir: str, format: str, out: str | None, step: int | None, max_shard_size: str, merged: bool = False
) -> str:
    """Export; the line saying what was written. RUN_DIR and --out may be URLs of an object store."""
    from dtrain.export.hf import export_hf

    if format not in FORMATS:
        raise DtrainError(f"--format {format!r} is not one dtrain writes; use --format hf (a Hugging Face folder)")
    if step is not None and step < 0:
        raise DtrainError(f"--step must be a checkpoint's step (a whole number >= 0); got {step}")
    for what, path in (("RUN_DIR", run_dir), ("--out", out)):
        if path is not None and not path.strip():  # an unset shell variable: never "." by accident
            raise DtrainError(f"{what} is empty (an unset shell variable?); give the folder of a dtrain run")
        if path is not None and objstore.credentials_in(path):
            raise DtrainError(
                f"{what} {objstore.without_credentials(str(path))} carries a password in the URL; give the store's "
                f"credentials through AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or a profile) instead"
            )
    if objstore.is_url(run_dir) or objstore.is_url(out):
        return _export_through_store(run_dir, out, step, max_shard_size, merged)
    folder = Path(run_dir)
    target = Path(out) if out is not None else folder / "hf"
    if folder.is_dir() and _inside(target, folder) and RunDirLock(folder).held():
        raise _still_training(str(folder), str(target))
    written = export_hf(folder, target, step, max_shard_size, merged)
    return _said(str(written), str(folder), step)


def _export_through_store(run_dir: str, out: str | None, step: int | None, max_shard_size: str, merged: bool) -> str:
    """RUN_DIR or --out on an object store: the run read through a local copy (rundir.reading, no lease
    taken), the export written to a local folder, and for an --out URL then sent up (store_export)."""
    from dtrain.export.hf import export_hf
    from dtrain.rundir import reading

    target = out if out is not None else objstore.join(run_dir, "hf") if objstore.is_url(run_dir) else f"{run_dir}/hf"
    with contextlib.ExitStack() as held:
        if objstore.is_url(run_dir):
            copy = held.enter_context(reading.fetched(run_dir, "final", step))
            folder, training = copy.path, copy.training
            inside = objstore.is_url(target) and target.rstrip("/").startswith(run_dir.rstrip("/") + "/")
        else:
            folder = Path(run_dir)
            training = folder.is_dir() and RunDirLock(folder).held()
            inside = not objstore.is_url(target) and _inside(Path(target), folder)
        if inside and training:
            raise _still_training(run_dir, target)
        if not objstore.is_url(target):
            written = export_hf(folder, Path(target), step, max_shard_size, merged)
            return _said(str(written), run_dir, step)
        store_export.check_free(target)
        reading.reads_base().mkdir(parents=True, exist_ok=True)
        local = Path(held.enter_context(tempfile.TemporaryDirectory(dir=reading.reads_base(), prefix="export-")))
        export_hf(folder, local / "hf", step, max_shard_size, merged)
        store_export.upload(local / "hf", target)
    return _said(target, run_dir, step, stored=True)


def _still_training(run_dir: str, target: str) -> DtrainError:
    return DtrainError(
        f"{run_dir} is still training, and its own end may write {target}; export once it has ended, "
        f"or give --out a folder outside it"
    )


def _said(written: str, run_dir: str, step: int | None, stored: bool = False) -> str:
    source = f"checkpoint step-{step}" if step is not None else "final weights"
    where = "copy it down (all of it) and load the folder" if stored else "load it"
    loaded = "FOLDER" if stored else written
    if not stored and (Path(written) / "adapter_config.json").is_file():
        return (
            f"{written}: the LoRA adapters ({source}) of {run_dir} as a PEFT adapter folder; load it with "
            f"peft.PeftModel.from_pretrained(base, '{loaded}'), or export with --merged for the whole model"
        )
    return (
        f"{written}: the {source} of {run_dir} as a Hugging Face model folder; {where} with "
        f"transformers.AutoModelForCausalLM.from_pretrained('{loaded}')"
    )


def _inside(path: Path, folder: Path) -> bool:
    return path.absolute().resolve().is_relative_to(folder.absolute().resolve())
