"""Files of token ids: shards written at any scale, and a BPE's rank and merge files.

Plumbing for 01_data.py, which keeps what a learner needs (the shard's header and its
memory map, the tokenizer): a writer that rolls over to a new shard at a size limit and
renames each into place only when whole, tiktoken's threaded batch encoder fed in bounded
memory, and the two files a trained BPE is saved in.
"""

import base64
import json
import os
import time
from pathlib import Path

import numpy as np
import tiktoken

from support.files import atomic_write

# Text per tiktoken call: this bounds the memory of encode_documents.
ENCODE_BATCH_CHARS = 8_000_000


def progress(
    what: str, done: float, total: float, start: float, unit: str = ""
) -> None:
    """Redraw one progress line in place, with the rate and ETA; done >= total ends it.

    `start` is the time.perf_counter() when the work began; `unit` follows each number
    (" MB" gives "12.0/40.0 MB, 6.0 MB/s").
    """
    elapsed = time.perf_counter() - start
    rate = done / max(elapsed, 1e-9)
    eta = elapsed / max(done, 1e-9) * (total - done)
    counts = f"{done:,.1f}/{total:,.1f}{unit}, {rate:,.1f}{unit}/s"
    status = f"{counts}, ETA {eta:.0f} s ({elapsed:.0f} s in)"
    print(f"\r  {what}: {status}", end="\n" if done >= total else "", flush=True)


class RollingWriter:
    """Chunks of ids in, files of at most `limit` ids out: FOLDER/{prefix}_000000.bin,
    _000001, ... Each file starts with `header(dtype, n)`; it is written to a temporary
    file as the ids come and renamed into place only when whole (header, fsync, rename).
    """

    def __init__(self, folder: Path, prefix: str, dtype, limit: int, header):
        self.folder = Path(folder)
        self.prefix = prefix
        self.dtype = dtype
        self.limit = limit
        self.header = header
        self.file = None  # The file being written, if any.
        self.path = None  # Its final name.
        self.n = 0  # Its ids so far.
        self.docs = 0  # The documents added so far (the caller counts them).
        self.shards = []  # The whole files: [{file, tokens}].

    def add(self, ids) -> None:
        while len(ids):
            if self.file is None:
                # A new file. Its header is rewritten once its count is known.
                self.path = self.folder / f"{self.prefix}_{len(self.shards):06d}.bin"
                self.file = open(self.path.with_suffix(".tmp"), "wb")
                self.n = 0
                self.file.write(self.header(self.dtype, 0))
            take = min(len(ids), self.limit - self.n)
            self.file.write(ids[:take].astype(self.dtype).tobytes())
            self.n += take
            ids = ids[take:]
            if self.n == self.limit:
                self.close()

    def close(self) -> None:
        """Finish the file in progress, if any: its header, fsync, rename."""
        if self.file is None:
            return
        self.file.seek(0)
        self.file.write(self.header(self.dtype, self.n))
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.file.name, self.path)
        self.shards.append({"file": self.path.name, "tokens": self.n})
        self.file = None  # The next add() opens the next file.


def writers(folder, splits, dtype, limit: int, header) -> dict:
    """A RollingWriter per split, of shards that start with `header(dtype, n)`."""
    return {
        split: RollingWriter(folder, split, dtype, limit, header) for split in splits
    }


def splits_meta(writers: dict, block_size: int, kept: int) -> dict:
    """meta.json's shard fields; or a one-line error when a split holds no block of
    block_size + 1 ids (a window of x and its shifted y)."""
    meta = {"shards": {split: w.shards for split, w in writers.items()}}
    for split, w in writers.items():
        n = sum(s["tokens"] for s in w.shards)
        meta[f"{split}_tokens"] = n
        if n < block_size + 1:
            few = f"{n} tokens, fewer than one block of {block_size}+1"
            fix = (
                "more text or --val-fraction, less cleaning, or a smaller --block-size"
            )
            raise ValueError(f"the {split} split has {few} ({kept:,} kept): {fix}")
    meta["dtype"] = np.dtype(next(iter(writers.values())).dtype).name
    meta["files"] = [s["file"] for w in writers.values() for s in w.shards]
    return meta


def encode_documents(enc, pieces, writers: dict, total_bytes: int) -> None:
    """tiktoken's threaded batch encoder over (split, text, source bytes read so far),
    into each split's writer, `enc.eot_token` between documents.

    A call takes documents until ENCODE_BATCH_CHARS, at least one: memory holds one
    batch of text and its ids, not the corpus. A progress line shows MB/s.
    """
    start = time.perf_counter()
    batch = []
    size = 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece[1])
        if size >= ENCODE_BATCH_CHARS:
            _encode_batch(enc, batch, writers)
            progress("encode", piece[2] / 1e6, total_bytes / 1e6, start, unit=" MB")
            batch = []
            size = 0
    _encode_batch(enc, batch, writers)
    progress("encode", total_bytes / 1e6, total_bytes / 1e6, start, unit=" MB")
    for w in writers.values():
        w.close()


def _encode_batch(enc, batch, writers: dict) -> None:
    """One call of tiktoken's batch encoder; its ids go to the writers, in order."""
    if not batch:
        return
    texts = [text for _, text, _ in batch]
    encoded = enc.encode_ordinary_batch(texts, num_threads=os.cpu_count() or 1)
    for (split, _, _), ids in zip(batch, encoded):
        if writers[split].docs:  # EOT between documents, none before a split's first.
            writers[split].add(np.array([enc.eot_token]))
        writers[split].add(np.asarray(ids))
        writers[split].docs += 1


def listed_shards(data_dir, split: str) -> list[Path]:
    """A split's shards, in order: meta.json's list, or {split}.bin without one."""
    data_dir = Path(data_dir)
    meta_path = data_dir / "meta.json"
    shards = None
    if meta_path.is_file():
        shards = json.loads(meta_path.read_text()).get("shards")
    if shards:
        paths = [data_dir / s["file"] for s in shards[split]]
    else:
        paths = [data_dir / f"{split}.bin"]
    for p in paths:
        if not p.is_file():
            fix = f"prepare the data first (python 01_data.py --out {data_dir})"
            raise FileNotFoundError(f"{p} not found: {fix}")
    return paths


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def save_bpe(path, ranks: dict, merges: list, special_tokens: dict, pattern: str):
    """Write X.tiktoken (tiktoken's own format: base64 bytes, then the rank, a line
    each) and X.json (the pattern, the specials and the merges in order)."""
    path = Path(path).with_suffix(".tiktoken")
    by_rank = sorted((i, b) for b, i in ranks.items())
    lines = "".join(f"{_b64(b)} {i}\n" for i, b in by_rank)
    meta = {"pattern": pattern, "special_tokens": special_tokens}
    meta["merges"] = [[_b64(a), _b64(b)] for a, b in merges]
    text = json.dumps(meta)
    atomic_write(path, lambda tmp: tmp.write_text(lines))
    atomic_write(path.with_suffix(".json"), lambda tmp: tmp.write_text(text))
    return path


def load_bpe(path) -> tuple[dict, list, list]:
    """(vocab, merges, special tokens) from the files save_bpe wrote.

    Read here, not by tiktoken's loader: it caches by path, so a tokenizer retrained
    and saved to the same path would load its old ranks.
    """
    path = Path(path).with_suffix(".tiktoken")
    vocab = {}
    for line in path.read_text().splitlines():
        if line:
            token, i = line.split()
            vocab[int(i)] = base64.b64decode(token)
    meta = json.loads(path.with_suffix(".json").read_text())
    merges = [(base64.b64decode(a), base64.b64decode(b)) for a, b in meta["merges"]]
    for s, i in meta["special_tokens"].items():
        vocab[i] = s.encode("utf-8")
    return vocab, merges, list(meta["special_tokens"])


def gpt2_encoding():
    """tiktoken's GPT-2 encoding, or a one-line error that says what to do offline."""
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # noqa: BLE001 - a network or cache failure: say what to do.
        fix = "offline: TIKTOKEN_CACHE_DIR=a folder with its files, or --tokenizer char"
        why = f"{type(e).__name__}: {e}"
        raise RuntimeError(f"cannot load GPT-2's tokenizer ({why}); {fix}") from e
