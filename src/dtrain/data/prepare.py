"""`dtrain prepare text`: text files → token shards a run reads memory-mapped (format: data/tokens.py).

    dtrain prepare text SRC... --out DIR [--tokenizer bpe|bytes|FILE.json] [--vocab-size N]
                               [--val-fraction F] [--workers N]
    dtrain prepare text --python-stdlib --out DIR      the running Python's standard library as text

Every file is one document; documents are separated by an end-of-text token. A document goes to the
held-out split by a hash of its name (stable, whatever else the corpus holds). The tokenizer is Hugging
Face `tokenizers`: a byte-level BPE trained on the training documents only (the held-out ones stay
unseen), a given tokenizer.json, or raw bytes. The text is streamed (data/text_shards.py): memory does
not grow with the corpus. The same input gives the same bytes. The output folder appears whole or not
at all.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sysconfig
import tempfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dtrain.data.text_shards import EOT, Encoder, encode_bytes, is_document, tokenizer_encoder, train_bpe, write_split
from dtrain.data.tokens import FORMAT
from dtrain.errors import DtrainError

# Folders of the standard library that are not its own source: tests (much of it generated data),
# installed packages, caches, demos.
STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idlelib", "lib2to3", "turtledemo"}


def stdlib_files() -> list[Path]:
    """The running Python's standard-library source: real text nobody here wrote, on every machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        # Pruned on the way down: site-packages alone can hold a hundred times the stdlib's files.
        subfolders[:] = [d for d in subfolders if d not in STDLIB_SKIP]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted(files)


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

    def as_tokenizers(self) -> Any:
        """The same tokenizer as a `tokenizers.Tokenizer` (what a Hugging Face folder holds): byte-level,
        each byte its own token under GPT-2's printable spelling of it, no merges, end-of-text 256."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        spelled, extra = {}, 0
        for byte in range(256):  # GPT-2's bytes_to_unicode: a byte that is not printable spelled as 256 + n
            spelled[byte] = chr(byte) if byte in printable else chr(256 + extra)
            extra += byte not in printable
        tokenizer = Tokenizer(models.BPE({spelled[b]: b for b in range(256)}, []))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens([EOT])  # id 256, the next one
        return tokenizer


def load_tokenizer(folder: str | Path, meta: dict):
    """The tokenizer a token folder was made with: Bytes, or a `tokenizers.Tokenizer`."""
    if meta.get("tokenizer", "bytes") == "bytes":
        return Bytes()
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(folder) / meta["tokenizer"]))


def prepare_text(
    sources: Sequence[str],
    out: str,
    tokenizer: str = "bpe",
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    python_stdlib: bool = False,
    dtype: str = "auto",
) -> dict:
    """Tokenize `sources` into `out`; returns the meta.json written. `tokenizers` encodes on as many
    threads as RAYON_NUM_THREADS says (all cores when unset)."""
    out_dir = Path(out)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise DtrainError(
            f"--out {out_dir} already exists and is not an empty folder; choose a new one (or "
            f"delete it to prepare again)"
        )
    if not 0 <= val_fraction < 1:
        raise DtrainError(f"--val-fraction must be in [0, 1); got {val_fraction:g}")
    if tokenizer == "bpe" and not 257 <= vocab_size <= 2**31:
        raise DtrainError(f"--vocab-size must be from 257 (the 256 bytes and end-of-text) to 2^31; got {vocab_size}")
    files = stdlib_files() if python_stdlib else find_files(sources)
    if python_stdlib and sources:
        files = sorted(set(files) | set(find_files(sources)))
    documents = [path for path in files if is_document(path)]  # read once here, a piece at a time
    if not documents:
        raise DtrainError(
            f"no text in {', '.join(sources) or 'the standard library'} ({len(files)} files, none of "
            f"them non-empty UTF-8 text); give files or folders of text"
        )
    val = [d for d in documents if held_out(str(d), val_fraction)]
    train = [d for d in documents if not held_out(str(d), val_fraction)]
    if val_fraction > 0 and not val and len(documents) > 1:
        val, train = train[-1:], train[:-1]  # a corpus too small for the hash to pick one: the last
    if not train:  # the hash held out every document (one alone, whose name it happened to pick): train on it
        train, val = val[:1], val[1:]

    tok: Any  # a tokenizers.Tokenizer
    encode: Encoder
    if tokenizer == "bytes":
        encode, spec, vocab, eot, tokenizer_file = encode_bytes, "bytes", Bytes.vocab_size, Bytes.eot, "bytes"
    else:
        if tokenizer == "bpe":
            tok = train_bpe(train, vocab_size)
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
        encode = tokenizer_encoder(tok)
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
        splits = {
            name: write_split(staging, name, docs, encode, eot, np.dtype(chosen))
            for name, docs in (("train", train), ("val", val))
        }
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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
