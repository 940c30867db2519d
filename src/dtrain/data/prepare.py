"""`dtrain prepare text`: text files → token shards a run reads memory-mapped (format: data/tokens.py).

    dtrain prepare text SRC... --out DIR [--tokenizer bpe|bytes|FILE.json] [--vocab-size N]
                               [--val-fraction F] [--workers N]
    dtrain prepare text --python-stdlib --out DIR      the running Python's standard library as text

Every file is one document; documents are separated by an end-of-text token. A document goes to the
held-out split by a hash of its name (stable, whatever else the corpus holds). The tokenizer is Hugging
Face `tokenizers`: a byte-level BPE trained on the training documents only (the held-out ones stay
unseen), a given tokenizer.json, or raw bytes. Encoding runs in several processes; the same input gives
the same bytes. The output folder appears whole or not at all.
"""

from __future__ import annotations

import glob
import json
import multiprocessing
import os
import shutil
import sys
import sysconfig
import tempfile
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dtrain.data.tokens import FORMAT
from dtrain.errors import DtrainError

EOT = "<|endoftext|>"
SHARD_TOKENS = 100_000_000  # tokens per .bin file (200 MB of uint16)
# Folders of the standard library that are not its own source: tests (much of it generated data),
# installed packages, caches, demos.
STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idlelib", "lib2to3", "turtledemo"}


def stdlib_files() -> list[Path]:
    """The running Python's standard-library source: real text nobody here wrote, on every machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not STDLIB_SKIP.intersection(p.relative_to(root).parts[:-1]))


def find_files(sources: Sequence[str]) -> list[Path]:
    """Files named, found under folders (recursively, hidden ones left out) or matched by globs; sorted,
    each once — a file reached under two names (a symlink to it) too, or it could be both a training and
    a held-out document."""
    found: dict[Path, Path] = {}  # the file itself (symlinks resolved) → the first of its names
    for source in sources:
        if glob.has_magic(source):
            matches = [m for m in _glob(source) if m.exists()]  # a dangling symlink is no match
            if not matches:
                raise DtrainError(f"{source}: matches no file or folder")
        else:
            matches = [Path(source)]
            if not matches[0].exists():
                raise DtrainError(f"{source}: no such file or folder")
        for match in matches:
            if match.is_dir():
                # Token folders an earlier prepare wrote (maybe into this very tree) are output, not text.
                prepared = [m.parent for m in match.rglob("meta.json") if _is_token_meta(m)]
                files = [
                    p
                    for p in match.rglob("*")  # never through a symlinked folder: a loop would not end
                    if p.is_file()
                    and not any(part.startswith(".") for part in p.relative_to(match).parts)
                    and not any(p.is_relative_to(folder) for folder in prepared)
                ]
            elif match.is_file() and not _is_token_meta(match.parent / "meta.json"):
                files = [match]
            else:
                files = []
            for path in files:
                real = path.resolve()
                found[real] = min(found.get(real, path), path)  # the same name whatever the order found
    return sorted(found.values())


def _glob(pattern: str) -> list[Path]:
    """What glob.glob(pattern, recursive=True) matches (names starting with a dot only where the pattern
    has one), but never through a symlinked folder: glob follows those, so a link to `..` makes `**`
    list the same files under ever longer names, and two such links make it run for hours."""
    parts = Path(pattern).parts
    first = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    root, rest = Path(*parts[:first]), Path(*parts[first:])
    hidden = any(part.startswith(".") for part in rest.parts)
    return [m for m in root.glob(str(rest)) if hidden or not any(p.startswith(".") for p in m.relative_to(root).parts)]


def _is_token_meta(path: Path) -> bool:
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("format") == FORMAT
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return False


def read_documents(files: Iterable[Path]) -> Iterator[tuple[str, str]]:
    """(name, text) of every file that is UTF-8 text with something in it; binary files are skipped."""
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            yield str(path), text


def held_out(name: str, fraction: float) -> bool:
    return fraction > 0 and zlib.crc32(name.encode("utf-8", "surrogateescape")) % 10_000 < fraction * 10_000


class Bytes:
    """The tokenizer of "bytes": a token per UTF-8 byte, and 256 for end-of-text."""

    vocab_size = 257
    eot = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def load_tokenizer(folder: str | Path, meta: dict):
    """The tokenizer a token folder was made with: Bytes, or a `tokenizers.Tokenizer`."""
    if meta.get("tokenizer", "bytes") == "bytes":
        return Bytes()
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(folder) / meta["tokenizer"]))


def _train_bpe(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


_worker_tokenizer: Any = None  # Bytes, or a tokenizers.Tokenizer


def _init_worker(spec: str) -> None:
    global _worker_tokenizer
    if spec == "bytes":
        _worker_tokenizer = Bytes()
    else:
        from tokenizers import Tokenizer

        _worker_tokenizer = Tokenizer.from_str(spec)


def _encode(text: str) -> np.ndarray:
    ids = _worker_tokenizer.encode(text)
    return np.asarray(ids if isinstance(ids, list) else ids.ids, dtype=np.int64)


def prepare_text(
    sources: Sequence[str],
    out: str,
    tokenizer: str = "bpe",
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    workers: int = 0,
    python_stdlib: bool = False,
    dtype: str = "auto",
) -> dict:
    """Tokenize `sources` into `out`; returns the meta.json written."""
    out_dir = Path(out)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise DtrainError(
            f"--out {out_dir} already exists and is not an empty folder; choose a new one (or "
            f"delete it to prepare again)"
        )
    if not 0 <= val_fraction < 1:
        raise DtrainError(f"--val-fraction must be in [0, 1); got {val_fraction:g}")
    if workers < 0:
        raise DtrainError(f"--workers must be 0 (automatic) or more; got {workers}")
    files = stdlib_files() if python_stdlib else find_files(sources)
    if python_stdlib and sources:
        files = sorted(set(files) | set(find_files(sources)))
    documents = list(read_documents(files))
    if not documents:
        raise DtrainError(
            f"no text in {', '.join(sources) or 'the standard library'} ({len(files)} files, none of "
            f"them non-empty UTF-8 text); give files or folders of text"
        )
    val = [d for d in documents if held_out(d[0], val_fraction)]
    train = [d for d in documents if not held_out(d[0], val_fraction)]
    if val_fraction > 0 and not val and len(documents) > 1:
        val, train = train[-1:], train[:-1]  # a corpus too small for the hash to pick one: the last
    if not train:
        raise DtrainError("every document went to the held-out split; lower --val-fraction")

    tok: Any  # Bytes, or a tokenizers.Tokenizer
    if tokenizer == "bytes":
        tok, spec, vocab, eot, tokenizer_file = Bytes(), "bytes", Bytes.vocab_size, Bytes.eot, "bytes"
    else:
        if tokenizer == "bpe":
            if vocab_size < 257 or vocab_size > 2**31:
                raise DtrainError(
                    f"--vocab-size must be from 257 (the 256 bytes and end-of-text) to 2^31; got {vocab_size}"
                )
            tok = _train_bpe([text for _, text in train], vocab_size)
        else:
            from tokenizers import Tokenizer

            try:
                tok = Tokenizer.from_file(tokenizer)
            except Exception as exc:
                raise DtrainError(
                    f"--tokenizer {tokenizer}: not a tokenizer.json ({exc}); give a Hugging Face "
                    f"tokenizers file, bpe or bytes"
                ) from None
        eot = tok.token_to_id(EOT)
        if eot is None:
            tok.add_special_tokens([EOT])
            eot = tok.token_to_id(EOT)
        spec, vocab, tokenizer_file = tok.to_str(), tok.get_vocab_size(with_added_tokens=True), "tokenizer.json"
    chosen = ("uint16" if vocab <= 2**16 else "uint32") if dtype == "auto" else dtype
    limit = {"uint16": 2**16, "uint32": 2**32}.get(chosen)
    if limit is None:
        raise DtrainError(f"--dtype must be auto, uint16 or uint32; got {dtype}")
    if vocab > limit:
        raise DtrainError(
            f"a vocabulary of {vocab} tokens does not fit in {chosen} (at most {limit}); use "
            f"--dtype uint32 or a smaller --vocab-size"
        )

    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    except OSError as exc:
        raise DtrainError(f"--out {out_dir} cannot be made ({exc.strerror}: {exc.filename}); choose another") from None
    staging.chmod(0o777 & ~_umask())  # mkdtemp's 0700: the folder gets the user's normal mode
    try:
        splits = {}
        workers = workers or min(4, os.cpu_count() or 1)
        for name, docs in (("train", train), ("val", val)):
            splits[name] = _write_split(staging, name, docs, spec, eot, np.dtype(chosen), workers)
        meta = {
            "format": FORMAT,
            "version": 1,
            "dtype": chosen,
            "vocab_size": vocab,
            "eot_token": eot,
            "tokenizer": tokenizer_file,
            "splits": splits,
            "source": {
                "python_stdlib": python_stdlib,
                "paths": list(sources),
                "files": len(files),
                "documents": len(documents),
                "skipped": len(files) - len(documents),
            },
        }
        if tokenizer_file != "bytes":
            (staging / tokenizer_file).write_text(spec, encoding="utf-8")
        (staging / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        try:
            if out_dir.exists():
                out_dir.rmdir()  # empty (checked above)
            os.replace(staging, out_dir)
        except OSError:  # another prepare filled --out meanwhile: its output stays, this one goes
            raise DtrainError(
                f"--out {out_dir} was filled by another process while this one prepared; its output is left as it is"
            ) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return meta


def _write_split(
    folder: Path, name: str, docs: list[tuple[str, str]], spec: str, eot: int, dtype: np.dtype, workers: int
) -> dict:
    from tqdm import tqdm

    files: list[str] = []
    tokens = 0
    shard: list[np.ndarray] = []
    in_shard = 0

    def flush() -> None:
        nonlocal shard, in_shard
        if not shard:
            return
        path = folder / f"{name}-{len(files):05d}.bin"
        np.concatenate(shard).astype(dtype).tofile(path)
        files.append(path.name)
        shard, in_shard = [], 0

    texts = [text for _, text in docs]
    context = multiprocessing.get_context("spawn" if sys.platform == "darwin" else "fork")
    with (
        context.Pool(workers, initializer=_init_worker, initargs=(spec,))
        if workers > 1 and len(texts) > 1
        else _InProcess(spec) as pool
    ):
        encoded = pool.imap(_encode, texts, chunksize=8)  # imap keeps the order: the same input, the same bytes
        for ids in tqdm(
            encoded, total=len(texts), desc=f"tokenizing {name}", unit="doc", disable=None, file=sys.stderr
        ):
            piece = np.append(ids, eot)
            shard.append(piece)
            in_shard += len(piece)
            tokens += len(piece)
            if in_shard >= SHARD_TOKENS:
                flush()
    flush()
    return {"files": files, "tokens": tokens, "documents": len(docs)}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class _InProcess:
    """The Pool interface, in this process (one worker, or one document)."""

    def __init__(self, spec: str):
        _init_worker(spec)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def imap(self, fn, items, chunksize: int = 1):
        return map(fn, items)
