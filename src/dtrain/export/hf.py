"""A run's weights as a Hugging Face model folder — `dtrain export RUN_DIR --format hf`, and
`checkpoint.export = "hf"` at the end of a run — that `AutoModelForCausalLM.from_pretrained` loads:

    config.json                      the model's config (the built-in GPT's as GPT-2's)
    model.safetensors                the weights, or past --max-shard-size model-0000i-of-0000n.safetensors
                                     and model.safetensors.index.json naming the file of each tensor
    generation_config.json           its token ids (greedy by default, as `dtrain generate --temperature 0`)
    tokenizer.json, tokenizer_config.json    the run's tokenizer (token data) as PreTrainedTokenizerFast

From the final weights (model.safetensors) or a checkpoint (step-N), whatever world size and strategy
wrote it: the tensors are read a shard's worth at a time in this one process (DCP reshards), never the
whole model at once. The folder is written beside its destination and renamed into place: it is whole
or absent.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dtrain import rundir
from dtrain.checkpoint import hf_layout
from dtrain.checkpoint.hf_layout import Entry, Specs
from dtrain.checkpoint.store import Checkpoint, CheckpointStore
from dtrain.errors import DtrainError
from dtrain.export.lora import merged_state, write_adapter
from dtrain.files import fsync_dir, fsync_file, user_file_mode
from dtrain.models import described

DEFAULT_MAX_SHARD_SIZE = "50GB"  # transformers' own default for save_pretrained
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str | int) -> int:
    """'5GB' → 5·10⁹ bytes, '500MiB' → 500·2²⁰, 1000 → 1000: as transformers reads max_shard_size."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text).upper())
    if not match or match.group(2) not in _UNITS or float(match.group(1)) * _UNITS[match.group(2)] < 1:
        raise DtrainError(f"--max-shard-size {text!r} is not a size: give bytes or a size such as 500MB or 5GB")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


class _Weights:
    """A run's model tensors, by name: `specs` (shape and type of each, read without reading the
    tensors) and `read` (some of them)."""

    specs: Specs
    read: Callable[[list[str]], dict[str, torch.Tensor]]
    where: str


def _final_weights(path: Path) -> _Weights:
    from safetensors import SafetensorError, safe_open

    weights = _Weights()
    try:
        with safe_open(str(path), framework="pt") as file:
            stored = {name: file.get_slice(name) for name in file.keys()}  # noqa: SIM118 — not a dict
            specs: Specs = {
                name: (torch.Size(part.get_shape()), _SAFETENSORS_DTYPES[part.get_dtype()])
                for name, part in stored.items()
            }
            metadata = file.metadata() or {}
    except (OSError, SafetensorError, KeyError) as exc:
        raise DtrainError(f"{path} cannot be read as safetensors weights ({exc})") from None
    # A tensor tied under several names is stored once, its other names in the metadata (save_final_weights).
    aliases = {name: stored_as for name, stored_as in metadata.items() if stored_as in specs and name not in specs}
    weights.specs = {**specs, **{name: specs[stored_as] for name, stored_as in aliases.items()}}

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        with safe_open(str(path), framework="pt") as file:
            return {name: file.get_tensor(aliases.get(name, name)) for name in names}

    weights.read, weights.where = read, str(path)
    return weights


def _in_memory(state: dict[str, torch.Tensor], where: str) -> _Weights:
    """Weights already in memory (a LoRA run's merged model) as export reads them."""
    weights = _Weights()
    weights.specs = {name: (tensor.shape, tensor.dtype) for name, tensor in state.items()}
    weights.read, weights.where = (lambda names: {name: state[name] for name in names}), where
    return weights


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


_SAFETENSORS_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}


def _complete_checkpoint(run_dir: Path, step: int) -> Checkpoint:
    store = CheckpointStore(run_dir)
    found = {c.step: c for c in store.complete()}
    if step not in found:
        have = ", ".join(c.name for c in found.values()) or "none"
        raise DtrainError(f"{store.root} holds no complete checkpoint step-{step} (complete ones: {have})")
    return found[step]


def _checkpoint_weights(run_dir: Path, checkpoint: Checkpoint) -> _Weights:
    from dtrain.checkpoint.tensors import model_tensor_specs, read_model_weights

    CheckpointStore(run_dir).check_intact(
        checkpoint
    )  # every file against its size and CRC: a damaged one is not exported
    weights = _Weights()
    weights.specs = model_tensor_specs(checkpoint.path)

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        state = {name: torch.empty(weights.specs[name][0], dtype=weights.specs[name][1]) for name in names}
        read_model_weights(checkpoint.path, state)  # DCP reads these from whatever shards hold them
        return state

    weights.read, weights.where = read, str(checkpoint.path)
    return weights


def _model(run_dir: Path) -> dict[str, Any]:
    """What model the run trained: its model.json, or for a run older than model.json its config.toml
    (the built-in gpt's options, sized for its data as the run built it)."""
    model = described.read(run_dir)
    if model is not None:
        return model
    from dtrain.config import read_config
    from dtrain.models import build

    config_file = run_dir / "config.toml"
    if not config_file.is_file():
        raise DtrainError(f"{run_dir} holds neither model.json nor config.toml: RUN_DIR must be a dtrain run's run.dir")
    if rundir.given_in_code(config_file):
        raise DtrainError(
            f"{run_dir} was trained by a script that gave its model in code and has no model.json (it was trained "
            f"by an older dtrain): rerun it with this one to export it"
        )
    config, _ = read_config(config_file)
    if config.model.name != "gpt":
        return {"kind": described.OTHER, "class": f"model.name = '{config.model.name}'"}
    meta = _tokens_meta(run_dir, config.data.path)
    with torch.device("meta"):
        return described.describe(build(config.model, (config.data.block_size,), meta["vocab_size"]))


def _tokens_meta(run_dir: Path, data_path: str | None = None) -> dict[str, Any]:
    from dtrain.data import tokens

    kept = tokens.read_kept_tokenizer_meta(run_dir)
    if kept is not None or data_path is None:
        return kept or {}
    return tokens.read_meta(data_path)


def export_hf(
    run_dir: str | Path,
    out: str | Path | None = None,
    step: int | None = None,
    max_shard_size: str | int = "",
    merged: bool = False,
) -> Path:
    """Write run `run_dir`'s final weights (or checkpoint `step`) as a Hugging Face folder at `out`
    (default run_dir/hf); returns it. Refuses in one line, before writing anything, what would not load.
    A LoRA run's: its PEFT adapter folder, or with `merged` the base with the adapters merged (export/lora.py)."""
    run_dir = Path(run_dir)
    out = Path(out) if out is not None else run_dir / "hf"
    max_bytes = parse_size(max_shard_size or DEFAULT_MAX_SHARD_SIZE)
    if not run_dir.is_dir():
        raise DtrainError(f"{run_dir} is not a folder: RUN_DIR must be a dtrain run's run.dir")
    _check_out(out)
    model = _model(run_dir)
    lora = model.get("lora")
    if merged and lora is None:
        raise DtrainError(f"{run_dir} trained no LoRA adapters (training.lora): --merged is for a LoRA run; drop it")
    problem = described.not_exportable(model) if lora is None or merged else None
    if problem:
        raise DtrainError(f"{run_dir}: {problem}")
    final = run_dir / "model.safetensors"
    if step is None and not final.is_file():
        have = ", ".join(c.name for c in CheckpointStore(run_dir).complete())
        hint = f"; export a checkpoint with --step N ({have})" if have else ""
        raise DtrainError(f"{final} does not exist: the run has no final weights{hint}")
    checkpoint = _complete_checkpoint(run_dir, step) if step is not None else None
    try:
        weights = _final_weights(final) if checkpoint is None else _checkpoint_weights(run_dir, checkpoint)
        if lora is not None:  # what the run saved is its adapters
            adapters = weights.read(list(weights.specs))
            if not merged:
                with _staged(out) as staging:
                    write_adapter(staging, lora, adapters)
                return out
            weights = _in_memory(merged_state(model, adapters, run_dir), str(run_dir))
            model = {key: value for key, value in model.items() if key != "lora"}
        meta = _tokens_meta(run_dir)
        eot = meta.get("eot_token") if isinstance(meta.get("eot_token"), int) else None
        layout = hf_layout.of(model, weights.specs, eot)
        with _staged(out) as staging:
            layout.config.save_pretrained(staging)
            _write_generation_config(staging, layout.config)
            _write_weights(staging, weights, layout.entries, max_bytes)
            _write_tokenizer(staging, run_dir, meta, layout.config)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        raise _failed(exc, out, checkpoint) from None
    return out


def _failed(exc: BaseException, out: Path, checkpoint: Checkpoint | None) -> BaseException:
    """What a failure half-way says. The staging folder is gone by now and `out` is as it was; what remains
    to say is why: a checkpoint that a run still training pruned while it was read (DCP's reader then fails
    on a missing shard, or the manifest check on a missing file — not damage), or a disk that filled up."""
    if checkpoint is not None and not checkpoint.path.exists():
        return DtrainError(
            f"{checkpoint.path} was deleted while it was exported (a run still training keeps only its "
            f"checkpoint.keep newest); {out} is as it was: export a newer step, or this one from a copy"
        )
    if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
        return DtrainError(
            f"could not write the export to {out} ({exc.strerror or exc}); {out} is as it was: make room on its "
            f"disk, or give --out a folder on another"
        )
    return exc


def _check_out(out: Path) -> None:
    """--out must be free, empty, or an earlier export of dtrain's (replaced): never someone's folder."""
    if not out.exists() and not out.is_symlink():
        return
    if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        return
    problem = rundir.hf_export_folder(out)
    if problem:
        raise DtrainError(
            f"--out {out} {problem} ({rundir.yours(out)}); export writes a folder there only over one it exported: "
            f"choose another --out, or move it"
        )


class _staged:
    """A folder beside `out` to write into, renamed into place once whole; removed if anything fails.
    An earlier export at `out` is replaced only then."""

    def __init__(self, out: Path):
        self.out = out

    def __enter__(self) -> Path:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        # ".<name>.<random>.tmp": what run.dir recognises as a write in progress (rundir._temporary).
        self.staging = Path(tempfile.mkdtemp(dir=self.out.parent, prefix=f".{self.out.name}.", suffix=".tmp"))
        os.chmod(self.staging, user_file_mode(folder=True))
        return self.staging

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        if kind is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            return
        for path in self.staging.iterdir():
            fsync_file(path)
        fsync_dir(self.staging)
        earlier = None
        if self.out.exists():
            earlier = Path(tempfile.mkdtemp(dir=self.out.parent, prefix=f".{self.out.name}.", suffix=".tmp"))
            os.replace(self.out, earlier)  # over the empty folder mkdtemp made
        os.replace(self.staging, self.out)
        fsync_dir(self.out.parent)
        if earlier is not None:
            shutil.rmtree(earlier, ignore_errors=True)


def _write_weights(folder: Path, weights: _Weights, entries: list[Entry], max_bytes: int) -> None:
    """The tensors in order: one file (model.safetensors) when they fit in `max_bytes`, else shards and
    the index transformers reads."""
    shards = _groups(entries, max_bytes)  # a tensor larger than the limit: a shard of its own
    names = (
        [WEIGHTS]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    for name, shard in zip(names, shards):
        _write_safetensors(folder / name, shard, weights)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(e.nbytes for e in entries)},
            "weight_map": {e.name: name for name, shard in zip(names, shards) for e in shard},
        }
        (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


READ_BYTES = 1 << 30  # tensors read at a time: memory stays bounded whatever the shard size


def _groups(entries: list[Entry], limit: int) -> list[list[Entry]]:
    """`entries` in order, cut into runs of at most `limit` bytes (a larger tensor alone)."""
    groups: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if groups[-1] and size + entry.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += entry.nbytes
    return groups


def _write_safetensors(path: Path, entries: list[Entry], weights: _Weights) -> None:
    """A safetensors file streamed: its header first (every shape and offset is known before reading a
    tensor), then the tensors' bytes, read about READ_BYTES at a time and let go once written — never
    the whole file (up to --max-shard-size) in memory, as safetensors' own `save_file` would hold it."""
    header: dict[str, Any] = {}
    offset = 0
    for entry in entries:
        dtype = _SAFETENSORS_NAMES[entry.dtype]
        header[entry.name] = {
            "dtype": dtype,
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    header["__metadata__"] = dict(rundir.WEIGHTS_MARK)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format's alignment of the tensors' bytes
    with open(path, "wb") as file:
        file.write(len(text).to_bytes(8, "little") + text)
        for group in _groups(entries, READ_BYTES):
            read = weights.read([e.source for e in group if e.source is not None])
            for entry in group:
                if entry.source is None:
                    tensor = torch.zeros(entry.shape, dtype=entry.dtype)
                else:
                    tensor = read.pop(entry.source)
                    tensor = tensor.t() if entry.transpose else tensor
                file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            del read


def _write_generation_config(folder: Path, config: Any) -> None:
    from transformers import GenerationConfig

    GenerationConfig.from_model_config(config).save_pretrained(folder)


def _write_tokenizer(folder: Path, run_dir: Path, meta: dict[str, Any], config: Any) -> None:
    """The tokenizer the run kept (token data) as a PreTrainedTokenizerFast; a run on other data has none."""
    if not meta:
        return
    from transformers import PreTrainedTokenizerFast

    from dtrain.data.prepare import load_tokenizer
    from dtrain.data.text_shards import EOT

    tokenizer = load_tokenizer(run_dir / "tokenizer", meta)
    tokenizer = getattr(tokenizer, "as_tokenizers", lambda: tokenizer)()  # "bytes": as a tokenizers' Tokenizer
    length = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOT,
        eos_token=EOT,
        clean_up_tokenization_spaces=False,  # decode as the run's tokenizer decodes
        **({"model_max_length": length} if length else {}),
    )
    wrapped.save_pretrained(folder)
    # transformers 5 names the class TokenizersBackend, which earlier ones (and the servers built on them)
    # do not know; PreTrainedTokenizerFast is the name every version loads.
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
