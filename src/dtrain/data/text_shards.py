"""Text files → token shards, streamed: how `dtrain prepare text` reads, tokenizes and writes.

Nothing here holds the corpus. A file is read in pieces, pieces are encoded a batch at a time and
written straight into the open shard file, so memory is one batch (and the tokenizer) whatever the
corpus's size: token data bigger than RAM can be prepared on the machine that trains on it.

No process is started: `tokenizers` encodes a batch on all cores in its own threads, and a pool of
forked processes would copy this process in whatever state its other threads left it (torch's,
tokenizers' own: a lock one of them held at that moment stays held in the copy) — fork after threads
is a known cause of deadlocks.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dtrain.errors import DtrainError

EOT = "<|endoftext|>"
SHARD_TOKENS = 100_000_000  # a .bin file is closed after the document that brings it to this many
# Characters per piece a long text is cut into. Encoding: a document up to ENCODE_PIECE is encoded
# whole, a longer one in pieces (one 21 MB line took 5 GB in a tokenizer's Encoding), several to a batch
# so that the batch's threads share even one long document. Training: every text is fed in pieces of
# TRAIN_PIECE (the trainer buffers a few hundred texts at a time).
ENCODE_PIECE = 1 << 18
TRAIN_PIECE = 1 << 16
BATCH_CHARS = 1 << 21  # characters encoded in one call: the batch is what memory holds

# The last place in a window where a space or newline comes right before a printable ASCII character.
# Byte-level BPE (GPT-2's pre-tokenizer, which the "bpe" tokenizer uses) always starts a new word there:
# no word runs over the last whitespace before a non-space, and the word that follows begins with it.
# So the pieces' tokens, put together, are the whole text's tokens: the same for bytes and "bpe" (a
# given tokenizer.json with other rules may differ a little at a cut; only texts over ENCODE_PIECE are
# cut for it). Half a piece without such a place (a line of 100 K letters) is cut where the piece
# ends: there, and only there, the tokens may differ a little from the whole text's.
_LAST_CUT = re.compile(r".*[ \n](?=[!-~])", re.DOTALL)


def _cut(text: str, size: int) -> int:
    """Where to end the first piece of `text` (longer than `size`): at most `size` characters in."""
    found = _LAST_CUT.match(text, size // 2, size + 2)  # the space itself at `size` at most
    return found.end() - 1 if found else size


def read_pieces(path: Path, size: int) -> Iterator[str]:
    """The text of `path` — whole when it has at most `size` characters, else in pieces of at most
    `size` cut as _LAST_CUT says. Newlines come as Path.read_text gives them (universal newlines)."""
    with open(path, encoding="utf-8") as fh:
        rest = ""
        while chunk := fh.read(size):
            rest += chunk
            while len(rest) > size:
                cut = _cut(rest, size)
                yield rest[:cut]
                rest = rest[cut:]
        if rest:
            yield rest


def is_document(path: Path) -> bool:
    """Whether a file is a document: UTF-8 text with more than whitespace in it (read a piece at a time,
    to its end: a byte that is not UTF-8 may come last)."""
    blank = True
    try:
        with open(path, encoding="utf-8") as fh:
            while chunk := fh.read(1 << 20):
                blank = blank and chunk.isspace()
    except (UnicodeDecodeError, OSError):
        return False
    return not blank


def _pieces(files: Iterable[Path], size: int) -> Iterator[tuple[str, bool]]:
    """(piece, whether it ends its document) of every file, in order."""
    for path in files:
        last = None
        try:
            for piece in read_pieces(path, size):
                if last is not None:
                    yield last, False
                last = piece
        except (UnicodeDecodeError, OSError) as exc:
            raise DtrainError(f"{path} changed while it was being prepared ({exc}); prepare again") from None
        if last is None:
            raise DtrainError(f"{path} became empty while it was being prepared; prepare again")
        yield last, True


def train_bpe(files: Sequence[Path], vocab_size: int) -> Any:
    """A byte-level BPE trained on the texts of `files`, streamed into the trainer (never a list of them)."""
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
    # Cut where words begin (_LAST_CUT): the trainer counts the same words as from whole files.
    tokenizer.train_from_iterator((piece for piece, _ in _pieces(files, TRAIN_PIECE)), trainer=trainer)
    return tokenizer


Encoder = Callable[[list[str]], list[np.ndarray]]


def encode_bytes(texts: list[str]) -> list[np.ndarray]:
    """The tokens of "bytes": a token per UTF-8 byte."""
    return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]


def tokenizer_encoder(tokenizer: Any) -> Encoder:
    """A `tokenizers.Tokenizer`'s encoding of a batch, in its threads (the same ids as `encode` one by one)."""
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # _fast (≥ 0.21): no offsets

    def run(texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(encoding.ids, dtype=np.int64) for encoding in encode(texts)]

    return run


def write_split(folder: Path, name: str, files: Sequence[Path], encode: Encoder, eot: int, dtype: np.dtype) -> dict:
    """Encode `files` in order into folder/NAME-00000.bin, ...: each document's tokens, then `eot`."""
    from tqdm import tqdm

    shards = _Shards(folder, name, dtype)
    bar = tqdm(total=len(files), desc=f"tokenizing {name}", unit="doc", disable=None, file=sys.stderr)
    try:
        for batch in _batches(_pieces(files, ENCODE_PIECE), BATCH_CHARS):
            for (_, ends), ids in zip(batch, encode([text for text, _ in batch])):
                shards.write(ids)
                if ends:
                    shards.end_document(eot)
                    bar.update()
    finally:
        shards.close()
        bar.close()
    return {"files": shards.files, "tokens": shards.tokens, "documents": len(files)}


def _batches(pieces: Iterator[tuple[str, bool]], chars: int) -> Iterator[list[tuple[str, bool]]]:
    batch: list[tuple[str, bool]] = []
    size = 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece[0])
        if size >= chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class _Shards:
    """A split's .bin files, written as tokens come. A file ends after the document that brings it to
    SHARD_TOKENS: a document is never cut between files."""

    def __init__(self, folder: Path, name: str, dtype: np.dtype):
        self.folder, self.name, self.dtype = folder, name, dtype
        self.files: list[str] = []
        self.tokens = 0
        self._file: Any = None
        self._in_file = 0

    def write(self, ids: np.ndarray) -> None:
        if self._file is None:
            self.files.append(f"{self.name}-{len(self.files):05d}.bin")
            self._file = open(self.folder / self.files[-1], "wb")  # noqa: SIM115 (closed by close())
        ids.astype(self.dtype, copy=False).tofile(self._file)
        self._in_file += len(ids)
        self.tokens += len(ids)

    def end_document(self, eot: int) -> None:
        self.write(np.array([eot]))
        if self._in_file >= SHARD_TOKENS:
            self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file, self._in_file = None, 0
