"""What a run directory holds, and what dtrain may do there.

dtrain writes only the names in OUTPUTS (and its lock and temporary files), each of a kind it can
recognise again (a metrics file of JSON records, folders of event files or step-N checkpoints, weights
marked as dtrain's). Anything else in run.dir is someone else's: dtrain never writes over it or deletes
it, and by default refuses to write beside it (TensorBoard would show two runs as one, a report would
mix them). A fresh start over an earlier run's outputs is refused too, unless the user says to replace
them (run.overwrite), this is a later attempt of the same run (a torchrun restart, a SLURM requeue),
whose earlier attempt's outputs it replaces, or the earlier run is over and did no lasting work (no
sealed checkpoint, no final weights: killed or crashed before its first checkpoint). Only what is
recognisably dtrain's is ever deleted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

from dtrain.errors import DtrainError

LOCK = ".lock"
# The metadata dtrain writes into model.safetensors: how it knows the weights in a run.dir are its own.
WEIGHTS_MARK = {"format": "pt", "written_by": "dtrain"}

# The first line of every config.toml dtrain writes begins so: how it knows a run.dir's config.toml is its own.
WRITTEN_BY_DTRAIN = "# The resolved config of this run, written by dtrain."
# The rest of the line says how to rerun the run: `dtrain run` for a run its config describes (into a new
# folder: run.dir's own config.toml is never the config being read), its script for one whose model and
# data were given in code (`dtrain.Trainer(config, model=..., train_data=...)`): there [model] and [data]
# are defaults or settings nobody read, and `dtrain run` would train something else.
CONFIG_HEADER = f"{WRITTEN_BY_DTRAIN} Rerun it with: dtrain run <this file> run.dir=<a new folder>\n"
GIVEN_IN_CODE_HEADER = (
    f"{WRITTEN_BY_DTRAIN} Its model and data were given in code to dtrain.Trainer, not built from "
    f"[model] and [data]: rerun it with the script that trained it\n"
)


def config_header(given_in_code: bool) -> str:
    return GIVEN_IN_CODE_HEADER if given_in_code else CONFIG_HEADER


def given_in_code(config_file: str | Path) -> bool:
    """Whether `config_file` is the config.toml of a run whose model and data were given in code."""
    try:
        if not Path(config_file).is_file():  # a device (/dev/zero) would never end its first line
            return False
        with open(config_file, encoding="utf-8") as fh:
            return fh.readline(len(GIVEN_IN_CODE_HEADER) + 1) == GIVEN_IN_CODE_HEADER
    except (OSError, UnicodeDecodeError):
        return False


def refuse_given_in_code(config_file: str | Path) -> None:
    """`dtrain run` on the config.toml of a run whose model and data were given in code would train what
    [model] and [data] say, not that run's model: refused in one line."""
    if given_in_code(config_file):
        raise DtrainError(
            f"{config_file} is the config of a run whose model and data were given in code to dtrain.Trainer; "
            f"dtrain run would train [model] and [data] as written instead: rerun the script that trained it "
            f"(dtrain launch SCRIPT), or delete the file's first line to train what it says"
        )


def _entries(path: Path, pattern: str) -> str | None:
    """None when `path` is a folder whose entries all match `pattern`; else what is wrong."""
    if path.is_symlink() or not path.is_dir():
        return "is not a folder"
    strangers = sorted(p.name for p in path.iterdir() if not re.fullmatch(pattern, p.name))
    if strangers:
        return f"holds {', '.join(strangers[:3])}"
    links = sorted(p.name for p in path.iterdir() if p.is_symlink())  # writing there would write elsewhere
    return f"holds links: {', '.join(links[:3])}" if links else None


def _metrics_file(path: Path) -> str | None:
    if path.is_symlink() or not path.is_file():
        return "is not a file"
    try:
        with open(path, encoding="utf-8") as fh:
            first = fh.readline()
        if first and "step" not in json.loads(first):
            return "is not metrics dtrain wrote"
    except (OSError, UnicodeDecodeError, ValueError, TypeError):
        return "is not metrics dtrain wrote"
    return None


def _weights_file(path: Path) -> str | None:
    if path.is_symlink() or not path.is_file():
        return "is not a file"
    return None if _weights_metadata(path).get("written_by") == "dtrain" else "is weights dtrain did not write"


def _weights_metadata(path: Path) -> dict[str, str]:
    """The metadata of a safetensors file, read from its JSON header alone (no tensor, no torch); {} for
    anything else."""
    try:
        with open(path, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size)) if 0 < size < 1 << 24 else {}
    except (OSError, ValueError):
        header = {}
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


# The metadata key of model.safetensors that records the end of the run that wrote it (see weights_end).
END_OF_RUN = "dtrain.end"


def weights_end(run_dir: Path) -> dict | None:
    """What run.dir's final weights say of the run that wrote them — its last `step`, `plan`, `identity` and
    `data_ranks`, as a checkpoint's marker says them — or None (no weights, or written before they said it).
    The only record of a finished run that kept no checkpoint (checkpoint.at_end = false)."""
    weights = run_dir / "model.safetensors"
    if weights.is_symlink() or not weights.is_file():
        return None
    meta = _weights_metadata(weights)
    if meta.get("written_by") != "dtrain":
        return None
    try:
        end = json.loads(meta.get(END_OF_RUN, ""))
    except ValueError:
        return None
    return end if isinstance(end, dict) and isinstance(end.get("step"), int) else None


def _config_file(path: Path) -> str | None:
    if path.is_symlink() or not path.is_file() or not _written_by_dtrain(path):
        return "is not a config dtrain wrote"
    return None


def _model_file(path: Path) -> str | None:
    try:
        described = json.loads(path.read_text(encoding="utf-8")) if path.is_file() and not path.is_symlink() else None
    except (OSError, UnicodeDecodeError, ValueError):
        described = None
    return None if isinstance(described, dict) and described.get("written_by") == "dtrain" else "is not dtrain's"


# A Hugging Face folder `dtrain export` writes: the names transformers reads, its weights marked as dtrain's.
HF_EXPORT_NAMES = (
    r"config\.json|generation_config\.json|model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json"
    r"|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|chat_template\.jinja"
    r"|adapter_config\.json|adapter_model\.safetensors"  # a LoRA run's PEFT adapter folder
)


def hf_export_folder(path: Path) -> str | None:
    """None when `path` is a Hugging Face folder dtrain exported (see `dtrain export`); else what it is."""
    problem = _entries(path, HF_EXPORT_NAMES)
    if problem:
        return problem
    weights = sorted(path.glob("model*.safetensors")) or sorted(path.glob("adapter_model.safetensors"))
    if not weights or any(_weights_file(w) for w in weights[:1]):
        return "is not a Hugging Face export dtrain wrote"
    return None


def _lock_file(path: Path) -> str | None:
    return "is not dtrain's lock file" if path.is_symlink() or not path.is_file() else None


# Every name dtrain writes at the top of run.dir, and how it recognises its own (None: it is dtrain's).
# `dtrain report` writes report/; the trackers write mlruns/ (MLflow's local store) and wandb/.
OUTPUTS: Mapping[str, Callable[[Path], str | None]] = {
    "config.toml": _config_file,
    "metrics.jsonl": _metrics_file,
    "model.safetensors": _weights_file,
    "model.json": _model_file,  # what model trained: what `dtrain export` needs to write it in another layout
    "hf": hf_export_folder,  # the weights as a Hugging Face model folder (checkpoint.export = "hf")
    "tensorboard": lambda p: _entries(p, r"events\.out\.tfevents\..+"),
    # best.json: which checkpoint checkpoint.keep_best keeps (and its atomic write's temporary file)
    "checkpoints": lambda p: _entries(p, r"(\.partial-(replaced-)?)?step-\d+|(\.)?best\.json(\.\w+\.tmp)?"),
    "diagnostics": lambda p: _entries(p, r"(flight-recorder-)?rank-\d+.*"),
    "profile": lambda p: _entries(p, r"rank-\d+\..+"),
    "report": lambda p: _entries(p, r"[\w-]+\.png|summary\.txt"),
    "tokenizer": lambda p: _entries(p, r"meta\.json|tokenizer\.json"),  # token data: what `generate` decodes with
    "mlruns": lambda p: None if p.is_dir() and not p.is_symlink() else "is not a folder",
    "wandb": lambda p: None if p.is_dir() and not p.is_symlink() else "is not a folder",
}
KEPT = ("config.toml", "model.json", "tokenizer", LOCK)  # rewritten by every run, never "an earlier run's output"
# An earlier run's hang stacks and flight records: what its rerun (after a hang, 124, or a restart after
# one) is for finding out; kept unless the user says to replace the earlier run (run.overwrite).
EVIDENCE = ("diagnostics",)


def _temporary(name: str) -> bool:
    """An atomic write's temporary file: ".<output>.<random>.tmp"."""
    return name.endswith(".tmp") and name.startswith(tuple(f".{output}." for output in OUTPUTS))


def yours(path: Path) -> str:
    """What a thing dtrain did not write probably is, for a refusal."""
    if path.is_symlink():
        return "a link of yours?"
    return "a file of yours?" if path.is_file() else "a folder of yours?"


def check_contents(run_dir: Path, allow_other_files: bool) -> None:
    """Refuse a run.dir holding, at one of dtrain's names, something dtrain did not write (always), or
    files of other programs (unless `allow_other_files`)."""
    if not run_dir.is_dir():
        return
    names = sorted(p.name for p in run_dir.iterdir())
    for name in names:
        path = run_dir / name
        check = OUTPUTS.get(name, _lock_file if name == LOCK else None)
        problem = check(path) if check else None
        if problem:
            raise DtrainError(
                f"run.dir {run_dir}: {name} is where dtrain writes its {name}, and it {problem} "
                f"({yours(path)}); move it, or choose another run.dir"
            )
    others = [n for n in names if n not in OUTPUTS and n != LOCK and not _temporary(n)]
    if others and not allow_other_files:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise DtrainError(
            f"run.dir {run_dir} holds files dtrain did not write ({shown}); choose an empty or "
            f"new run.dir, or set run.allow_other_files=true to write beside them"
        )


def earlier_outputs(run_dir: Path, *, resuming: bool, overwrite: bool, again: bool) -> list[Path]:
    """An earlier run's outputs that must go before this run starts in `run_dir` (checked by
    `check_contents` first), or a refusal. `resuming`: the run continues from a checkpoint there, and
    its outputs are its own. `again`: a later attempt of the same run. An earlier run that did no
    lasting work (see `did_lasting_work`) is replaced too: killed or crashed before its first checkpoint,
    it reruns with the same command. Its diagnostics (a hang's stacks) stay, unless `overwrite`. The
    caller holds run.dir's lock, or found it free: the earlier run is over. Nothing is deleted here: see
    `remove`, which rank 0 calls once the run has started."""
    if resuming or not run_dir.is_dir():
        return []
    kept = KEPT if overwrite else KEPT + EVIDENCE
    earlier = [p for p in sorted(run_dir.iterdir()) if p.name in OUTPUTS and p.name not in kept and _holds_something(p)]
    if earlier and not (overwrite or again) and did_lasting_work(run_dir):
        ended = weights_end(run_dir)
        if ended is not None:  # finished, with checkpoint.at_end = false (or its checkpoints deleted)
            raise DtrainError(
                f"run.dir {run_dir} holds a run that finished at step {ended['step']} and kept no checkpoint to "
                f"train on from ({why_no_checkpoint(run_dir)}); start a new run.dir from its weights "
                f"(model.init_from={run_dir} run.dir=<a new folder>), or set run.overwrite=true to replace it"
            )
        raise DtrainError(
            f"run.dir {run_dir} holds an earlier run's outputs ({', '.join(p.name for p in earlier)}) "
            f"and no checkpoint to continue from; choose a new run.dir, or set run.overwrite=true "
            f"to replace them"
        )
    return earlier


def why_no_checkpoint(run_dir: Path) -> str:
    """Why a finished run holds no checkpoint: its config.toml said checkpoint.at_end = false, or they were
    deleted since."""
    from dtrain.config import tomllib

    try:
        said = tomllib.loads((run_dir / "config.toml").read_text()).get("checkpoint", {}).get("at_end")
    except (OSError, ValueError, AttributeError):
        said = None
    return "checkpoint.at_end = false" if said is False else "its checkpoints were deleted"


def holds_outputs(run_dir: Path) -> bool:
    """Whether run.dir holds anything a run writes there (a run has started in it)."""
    return run_dir.is_dir() and any(p.name in OUTPUTS and _holds_something(p) for p in run_dir.iterdir())


def did_lasting_work(run_dir: Path) -> bool:
    """Whether the run that wrote run.dir's outputs left something that outlives it: its final weights, or
    a sealed checkpoint — under any name in checkpoints/, also one interrupted while replacing another.
    Its metrics, events and traces alone only describe a run nothing can continue."""
    from dtrain.checkpoint.manifest import MARKER

    checkpoints = run_dir / "checkpoints"
    sealed = checkpoints.is_dir() and any((folder / MARKER).exists() for folder in checkpoints.iterdir())
    return sealed or (run_dir / "model.safetensors").exists()


def _holds_something(path: Path) -> bool:
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


def remove(paths: list[Path]) -> None:
    """Delete outputs `earlier_outputs` recognised as dtrain's (a symlink: only the link)."""
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def check_room(run_dir: Path, needed: int, what: str) -> None:
    """Refuse to start a run whose `what` (e.g. its final weights, `needed` bytes) cannot fit in run.dir:
    finding out at the end wastes the whole run."""
    try:
        stats = os.statvfs(next(p for p in (run_dir, *run_dir.absolute().parents) if p.exists()))
    except (OSError, StopIteration):
        return
    free = stats.f_bavail * stats.f_frsize
    if free < needed:
        raise DtrainError(
            f"run.dir {run_dir} has {free:,} bytes free and {what} needs {needed:,}; make room or "
            f"choose a run.dir on a bigger disk"
        )


def check_config_file_is_ours(run_dir: Path, reading: Path | None = None) -> None:
    """Refuse to write `<run_dir>/config.toml` over the config file being read or over any file that
    dtrain did not write (a user's own config beside `run.dir = .`)."""
    target = Path(run_dir) / "config.toml"
    if not target.exists():
        return
    if reading is not None and Path(reading).exists() and os.path.samefile(target, reading):
        raise DtrainError(
            f"run.dir = '{run_dir}' would write the run's config.toml over {reading}, the config "
            f"being read; choose another run.dir (e.g. run.dir=runs/{Path(reading).stem})"
        )
    if not _written_by_dtrain(target):
        raise DtrainError(
            f"{target} is not a config dtrain wrote (a file of yours?) and a run writes its "
            f"config.toml there; choose another run.dir, or move the file"
        )


def _written_by_dtrain(path: Path) -> bool:
    from dtrain.config import SECTIONS, tomllib

    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return False
    if text.startswith(WRITTEN_BY_DTRAIN):
        return True
    try:  # written before the header existed: every section, as the resolved config has them
        return set(tomllib.loads(text)) == set(SECTIONS)
    except tomllib.TOMLDecodeError:
        return False


def check_usable(run_dir: Path) -> None:
    """What the launcher can see before any worker starts: run.dir is (or can become) a writable
    folder, and the name of the final weights is free for a file."""
    try:
        run_dir.resolve(strict=False)
        if run_dir.exists() and not run_dir.is_dir():
            raise DtrainError(f"run.dir {run_dir} is a file, not a folder; choose another run.dir")
        existing = next(p for p in (run_dir, *run_dir.absolute().parents) if p.exists())
    except (OSError, RuntimeError) as exc:  # a symlink loop, a path too long
        raise DtrainError(
            f"run.dir {run_dir} cannot be used ({getattr(exc, 'strerror', None) or exc}); choose another run.dir"
        ) from None
    resolved = run_dir.absolute().resolve()
    if resolved == Path("/") or resolved == Path.home().resolve():
        raise DtrainError(
            f"run.dir {run_dir} is {'the root folder' if resolved == Path('/') else 'your home folder'}; "
            f"give the run a folder of its own, e.g. run.dir=runs/first"
        )
    # os.access, not the mode bits: it also answers for root and for read-only mounts.
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise DtrainError(
            f"run.dir {run_dir} cannot be written ({existing} is not a writable folder); choose another run.dir"
        )
    weights = run_dir / "model.safetensors"
    if weights.exists() and not weights.is_file():
        raise DtrainError(
            f"{weights} is not a file (a folder?), and the run writes its final weights there; "
            f"move it or choose another run.dir"
        )
