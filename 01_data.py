"""01 · Data: from text to tokens to batches.

The idea in one sentence: a language model eats integers, so we learn a byte-level BPE vocabulary
(the most frequent adjacent pair becomes a new token, again and again), encode the corpus once into
a memory-mapped token file, and cut (x, y) batches from it as a pure function of the step.

The math of BPE training (Sennrich et al. 2016; GPT-2's byte-level variant, Radford et al. 2019):

    start:  every word is its UTF-8 bytes            "hug" -> [h, u, g]       vocab = 256 bytes
    repeat: (a, b) = the most frequent adjacent pair, counted over words x their frequency
            vocab[256 + i] = vocab[a] + vocab[b];  replace every (a, b) by the new id
    ties:   among equal counts, the lexicographically greatest (bytes(a), bytes(b)) wins

"Words" come from GPT-2's pre-tokenization regex, so a merge never crosses a space-word or
letter/digit/punctuation boundary, and special tokens such as <|endoftext|> are cut out before
that, so nothing is ever merged across them. Encoding replays the merges: inside each word,
repeatedly merge the adjacent pair whose concatenation has the lowest rank (= token id).

Who holds what (nothing is distributed yet, except who reads which window):

    corpus.txt --encode (tiktoken, threads)--> train.bin = [hdr | t0 t1 t2 ... tN]  (np.memmap)
                                                            \\_window_/\\_window_/ ... (T+1 tokens)
    step s, epoch e = s // steps_per_epoch:  perm_e = permutation(windows, seed=(seed, e))
        dp_rank 0 -> perm_e[k*dp*B + 0*B : ... + B]     x = window[:-1], y = window[1:]
        dp_rank 1 -> perm_e[k*dp*B + 1*B : ... + B]     (disjoint from rank 0 in every step)

Launch: `python 01_data.py` (trains a 4,096-token BPE on the Python standard library's source and
writes shards to data/). `python 01_data.py --help` lists the options.

This is the first file: it has no previous file to change. It leaves out, on purpose: Unicode
normalisation, the regex-free fast trainers (tokenizers/sentencepiece) and document packing masks.
"""

from __future__ import annotations

import argparse
import base64
import codecs
import glob
import hashlib
import heapq
import json
import os
import sysconfig
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import regex
import tiktoken
import tiktoken.load
import torch

# GPT-2's pre-tokenization pattern, exactly as tiktoken's "gpt2"/"r50k" encodings use it:
# 's 't 're 've 'm 'll 'd | optional space + letters | optional space + digits |
# optional space + other symbols | trailing whitespace | whitespace not followed by a non-space.
GPT2_SPLIT_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)
EOT = "<|endoftext|>"
GPT2_VOCAB_BPE = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe"
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
SHARD_MAGIC, SHARD_VERSION, HEADER_INTS = 20240520, 1, 4  # header: magic, version, itemsize, count


def _special_splitter(specials):
    """A regex that cuts text at special tokens (longest first, so one never hides another)."""
    alternatives = sorted(specials, key=len, reverse=True)
    return regex.compile("(" + "|".join(regex.escape(s) for s in alternatives) + ")")


# ---------------------------------------------------------------------------------------------
# BPE training
# ---------------------------------------------------------------------------------------------
def _pretokenize(text: str, specials) -> Counter:
    """Count each distinct pre-token (as bytes) once, with its frequency; specials are cut out."""
    pattern = regex.compile(GPT2_SPLIT_PATTERN)
    parts = _special_splitter(specials).split(text) if specials else [text]
    counts: Counter = Counter()
    for part in parts:
        if part in specials:
            continue  # never merged across, never merged into
        counts.update(pattern.findall(part))
    return Counter({w.encode("utf-8"): c for w, c in counts.items()})


def _tie_key(token: bytes) -> tuple:
    """Sort key that is *smaller* for lexicographically *greater* bytes (heapq is a min-heap).

    Each byte x maps to 256 - x, and 257 ends the string, so a string sorts before its own
    prefixes: b"ab" > b"a" becomes (255, 254, 257) < (255, 257).
    """
    return tuple(256 - x for x in token) + (257,)


def train_bpe(text: str, vocab_size: int, special_tokens=(EOT,), verbose: bool = False):
    """Learn `vocab_size - 256 - len(special_tokens)` merges on `text`; return a `Tokenizer`.

    Pair counts are updated incrementally: a merge of (a, b) touches only the words that contain
    (a, b) (kept in `where`), so the cost per merge is the size of those words, not the corpus.
    The next pair comes from a lazy max-heap: stale entries (count changed since they were pushed)
    are skipped when popped.
    """
    specials = list(special_tokens)
    n_merges = vocab_size - 256 - len(specials)
    assert n_merges >= 0, f"vocab_size {vocab_size} < 256 bytes + {len(specials)} special tokens"
    word_counts = _pretokenize(text, specials)
    words = [list(w) for w in word_counts]  # each word as a list of token ids (bytes at first)
    freqs = list(word_counts.values())
    vocab = {i: bytes([i]) for i in range(256)}
    keys = {i: _tie_key(vocab[i]) for i in range(256)}

    pair_counts: Counter = Counter()
    where: dict[tuple[int, int], set[int]] = {}
    for w, (word, f) in enumerate(zip(words, freqs)):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += f
            where.setdefault(pair, set()).add(w)
    heap = [(-c, keys[p[0]] + keys[p[1]], p) for p, c in pair_counts.items()]
    heapq.heapify(heap)

    merges: list[tuple[bytes, bytes]] = []
    progress = Progress("merges", n_merges) if verbose else None
    while len(merges) < n_merges and heap:
        neg_count, _, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg_count:
            continue  # stale heap entry
        new_id = 256 + len(merges)
        vocab[new_id] = vocab[pair[0]] + vocab[pair[1]]
        keys[new_id] = _tie_key(vocab[new_id])
        merges.append((vocab[pair[0]], vocab[pair[1]]))
        changed = _apply_merge(pair, new_id, words, freqs, pair_counts, where)
        for p in changed:
            if pair_counts[p] > 0:
                heapq.heappush(heap, (-pair_counts[p], keys[p[0]] + keys[p[1]], p))
            else:
                del pair_counts[p]
        if progress:
            progress.update(len(merges), extra=repr(vocab[new_id])[:24])
    if progress:
        progress.close()
    return Tokenizer.from_merges(merges, specials)


def _apply_merge(pair, new_id, words, freqs, pair_counts, where) -> set:
    """Replace `pair` by `new_id` in every word that has it; return the pairs whose count moved."""
    a, b = pair
    changed = set()
    for w in where.pop(pair):
        word = words[w]
        merged, i = [], 0
        while i < len(word):
            if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                merged.append(new_id)
                i += 2
            else:
                merged.append(word[i])
                i += 1
        if len(merged) == len(word):
            continue  # stale entry: an earlier merge already consumed this occurrence
        f = freqs[w]
        for p in zip(word, word[1:]):
            pair_counts[p] -= f
            changed.add(p)
        for p in zip(merged, merged[1:]):
            pair_counts[p] += f
            where.setdefault(p, set()).add(w)
            changed.add(p)
        words[w] = merged
    changed.discard(pair)
    pair_counts.pop(pair, None)  # every occurrence is gone
    return changed


class Progress:
    """A self-overwriting progress line with rate and ETA, redrawn at most every 0.2 s."""

    def __init__(self, what: str, total: float, unit: str = ""):
        self.what, self.total, self.unit = what, total, unit
        self.start = self.last = time.perf_counter()

    def update(self, done: float, extra: str = "") -> None:
        now = time.perf_counter()
        if now - self.last < 0.2 and done < self.total:
            return
        self.last, elapsed = now, now - self.start
        eta = elapsed / max(done, 1e-9) * (self.total - done)
        rate = f" {done / max(elapsed, 1e-9):,.1f} {self.unit}/s" if self.unit else ""
        fmt = ",.0f" if float(self.total).is_integer() else ",.1f"
        print(
            f"\r  {self.what}: {done:{fmt}}/{self.total:{fmt}}{rate} ETA {eta:4.1f}s {extra:<24}",
            end="",
            flush=True,
        )

    def close(self) -> None:
        print(f"  ({time.perf_counter() - self.start:.1f}s)")


# ---------------------------------------------------------------------------------------------
# Tokenizers: our BPE, bytes ("char"), and GPT-2 through tiktoken, all with one interface
# ---------------------------------------------------------------------------------------------
class Tokenizer:
    """Byte-level BPE with a pure-Python encoder that gives exactly tiktoken's ids.

    `vocab` maps id -> bytes and must contain the 256 single bytes; an id is also the token's
    merge rank. `merges` lists the learned pairs in order. Encoding follows tiktoken's rule: in a
    word, merge the leftmost adjacent pair whose concatenation has the lowest rank, until none is
    in the vocabulary.
    """

    def __init__(
        self,
        vocab: dict[int, bytes],
        merges: list[tuple[bytes, bytes]],
        special_tokens: list[str] | None = None,
    ):
        self.vocab, self.merges = dict(vocab), list(merges)
        special_tokens = list(special_tokens or [])
        as_bytes = {s.encode("utf-8") for s in special_tokens}
        self.ranks = {b: i for i, b in self.vocab.items() if b not in as_bytes}
        missing = [x for x in range(256) if bytes([x]) not in self.ranks]
        assert not missing, f"vocab lacks single-byte tokens {missing[:5]}...: cannot encode"
        for a, b in self.merges:
            assert a + b in self.ranks, f"merge {a!r} + {b!r} has no token in the vocab"
        next_id = max(self.vocab) + 1
        by_bytes = {b: i for i, b in self.vocab.items()}
        self.special_tokens = {}
        for s in special_tokens:  # specials keep their vocab id, or are appended after it
            if s.encode("utf-8") not in by_bytes:
                self.vocab[next_id], next_id = s.encode("utf-8"), next_id + 1
            self.special_tokens[s] = by_bytes.get(s.encode("utf-8"), next_id - 1)
        self._pattern = regex.compile(GPT2_SPLIT_PATTERN)
        self._splitter = _special_splitter(self.special_tokens) if self.special_tokens else None
        self._cache: dict[bytes, list[int]] = {}

    @classmethod
    def from_merges(cls, merges, special_tokens=(EOT,)) -> Tokenizer:
        """The layout train_bpe produces: 256 bytes, then the merges in order, then specials."""
        vocab = {i: bytes([i]) for i in range(256)}
        for i, (a, b) in enumerate(merges):
            vocab[256 + i] = a + b
        return cls(vocab, merges, list(special_tokens))

    @property
    def n_vocab(self) -> int:
        return max(self.vocab) + 1

    @property
    def eot_token(self) -> int:
        assert EOT in self.special_tokens, f"this tokenizer has no {EOT} special token"
        return self.special_tokens[EOT]

    def _bpe(self, word: bytes) -> list[int]:
        """BPE on one pre-token, step by step: merge the lowest-ranked adjacent pair, repeat."""
        if word in self._cache:
            return self._cache[word]
        parts = [bytes([x]) for x in word]
        while len(parts) > 1:
            best_rank, best_i = None, -1
            for i in range(len(parts) - 1):
                rank = self.ranks.get(parts[i] + parts[i + 1])
                if rank is not None and (best_rank is None or rank < best_rank):
                    best_rank, best_i = rank, i  # strict <: the leftmost wins ties, as tiktoken
            if best_rank is None:
                break
            parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
        ids = [self.ranks[p] for p in parts]
        if len(self._cache) > 100_000:  # bounded memory for encode_iterable on huge streams
            self._cache.clear()
        self._cache[word] = ids
        return ids

    def encode_ordinary(self, text: str) -> list[int]:
        """Encode, treating special-token text as ordinary text."""
        ids = []
        for word in self._pattern.findall(text):
            ids.extend(self._bpe(word.encode("utf-8")))
        return ids

    def encode(self, text: str) -> list[int]:
        """Encode; special tokens in the text become their ids (tiktoken's allowed_special="all")."""
        if self._splitter is None:
            return self.encode_ordinary(text)
        ids = []
        for part in self._splitter.split(text):
            ids.extend(
                [self.special_tokens[part]]
                if part in self.special_tokens
                else self.encode_ordinary(part)
            )
        return ids

    def encode_iterable(self, chunks):
        """Stream ids from an iterable of strings (e.g. an open file) in bounded memory.

        A chunk boundary can fall inside a pre-token or a special token, so each round emits only
        what more text cannot change, and keeps the rest in the buffer. The ids equal
        `encode("".join(chunks))`.
        """
        buf = ""
        for chunk in chunks:
            buf += chunk
            if len(buf) >= 1 << 16:
                ids, buf = self._encode_stable_prefix(buf)
                yield from ids
        yield from self.encode(buf)

    def _encode_stable_prefix(self, buf: str) -> tuple[list[int], str]:
        """Encode the part of `buf` that more text cannot change; return (ids, the rest).

        - A tail that could be the start of a special token is held back.
        - Text up to the last complete special token is final: encode it as usual.
        - After it, every pre-token but the last is final (a pre-token depends on at most one
          character after it). The last may grow, and whether it touches the end of the string
          matters (the pattern's "whitespace at the end" branch), so it stays in the buffer.
        """
        hold = len(buf)
        longest = max((len(s) for s in self.special_tokens), default=1)
        for i in range(max(0, len(buf) - longest + 1), len(buf)):
            if any(s.startswith(buf[i:]) for s in self.special_tokens):
                hold = i
                break
        start = 0
        if self._splitter is not None:
            ends = [m.end() for m in self._splitter.finditer(buf, 0, hold)]
            start = ends[-1] if ends else 0
        ids = self.encode(buf[:start])
        # subtle: emit the pre-tokens found in the *whole* buffer. Re-encoding the prefix as its
        # own string would let "whitespace at the end" match at the artificial end: the buffer
        # "a \nb" splits as "a", " ", "\n", "b", but the prefix "a \n" as "a", " \n".
        matches = list(self._pattern.finditer(buf, start, hold))
        for m in matches[:-1]:
            ids.extend(self._bpe(m.group().encode("utf-8")))
        return ids, buf[matches[-1].start() if matches else start :]

    def decode(self, ids) -> str:
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")

    def to_tiktoken(self, name: str = "bpe") -> tiktoken.Encoding:
        """The same ranks handed to tiktoken's Rust encoder (hundreds of times faster)."""
        return tiktoken.Encoding(
            name,
            pat_str=GPT2_SPLIT_PATTERN,
            mergeable_ranks=self.ranks,
            special_tokens=self.special_tokens,
        )

    def save(self, path, **extra) -> Path:
        """Write `X.tiktoken` (tiktoken's own rank format) and `X.json` (specials, merges and
        any `extra` notes, such as what it was trained on)."""
        path = Path(path).with_suffix(".tiktoken")
        path.parent.mkdir(parents=True, exist_ok=True)
        b64 = lambda b: base64.b64encode(b).decode("ascii")  # noqa: E731
        ranks = "".join(
            f"{b64(b)} {i}\n" for b, i in sorted(self.ranks.items(), key=lambda t: t[1])
        )
        meta = {
            "format": "llm-course-bpe/1",
            "pattern": GPT2_SPLIT_PATTERN,
            "special_tokens": self.special_tokens,
            "merges": [[b64(a), b64(b)] for a, b in self.merges],
            **extra,
        }
        _atomic_write(path, ranks.encode())
        _atomic_write(path.with_suffix(".json"), json.dumps(meta, indent=1).encode())
        return path

    @classmethod
    def load(cls, path) -> Tokenizer:
        path = Path(path).with_suffix(".tiktoken")
        for p in (path, path.with_suffix(".json")):
            if not p.is_file():
                raise FileNotFoundError(f"tokenizer file {p} not found (written by Tokenizer.save)")
        ranks = tiktoken.load.load_tiktoken_bpe(str(path))
        meta = json.loads(path.with_suffix(".json").read_text())
        merges = [(base64.b64decode(a), base64.b64decode(b)) for a, b in meta["merges"]]
        vocab = {i: b for b, i in ranks.items()}
        vocab.update({i: s.encode("utf-8") for s, i in meta["special_tokens"].items()})
        return cls(vocab, merges, list(meta["special_tokens"]))


def gpt2_tokenizer() -> Tokenizer:
    """GPT-2's own 50,000 merges, read from the vocab.bpe file tiktoken caches, as a Tokenizer.

    vocab.bpe writes bytes as printable stand-ins: byte b is chr(b) when printable, else
    chr(256 + n) for the n-th unprintable one. GPT-2's ids 0..255 follow the same order
    (printable bytes first), so the ids come out equal to tiktoken's "gpt2".
    """
    text = tiktoken.load.read_file_cached(GPT2_VOCAB_BPE, GPT2_VOCAB_BPE_SHA256).decode("utf-8")
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    char_to_byte = {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}
    merges = [
        tuple(bytes(char_to_byte[c] for c in part) for part in line.split())
        for line in text.split("\n")[1:]
        if line
    ]
    vocab = {i: bytes([b]) for i, b in enumerate(printable + others)}
    vocab.update({256 + i: a + b for i, (a, b) in enumerate(merges)})
    return Tokenizer(vocab, merges, [EOT])


class CharTokenizer:
    """The smallest tokenizer: one token per UTF-8 byte (one per character for ASCII text), plus
    <|endoftext|> as id 256. It needs no training, so every text can be encoded."""

    n_vocab, eot_token, name = 257, 256, "char"

    def encode_ordinary(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode(self, text: str) -> list[int]:
        ids = []
        for i, part in enumerate(text.split(EOT)):
            ids.extend(([self.eot_token] if i else []) + self.encode_ordinary(part))
        return ids

    def encode_ordinary_batch(self, texts, num_threads: int = 1) -> list[list[int]]:
        return [np.frombuffer(t.encode("utf-8"), np.uint8).tolist() for t in texts]

    def decode(self, ids) -> str:
        out = bytearray()
        for i in ids:
            out.extend(EOT.encode() if i == self.eot_token else bytes([i]))
        return out.decode("utf-8", errors="replace")


def get_tokenizer(name: str):
    """ "gpt2" (tiktoken), "char", or the path of a tokenizer saved by `Tokenizer.save`."""
    if name == "gpt2":
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception as e:  # noqa: BLE001 - network or cache failure; say what to do
            raise RuntimeError(
                f"cannot load GPT-2's tokenizer ({type(e).__name__}: {e}). It is "
                "downloaded once; offline, set TIKTOKEN_CACHE_DIR to a folder "
                "holding its files, or use --tokenizer char"
            ) from e
    if name == "char":
        return CharTokenizer()
    path = Path(name).with_suffix(".tiktoken")
    if path.is_file():
        return Tokenizer.load(path)
    raise ValueError(
        f"unknown tokenizer {name!r}: use 'gpt2', 'char', or the path of a saved "
        "BPE tokenizer (the .tiktoken file written by 01_data.py)"
    )


def fast_encoder(tok):
    """Something with tiktoken's `encode_ordinary_batch`: our BPE is handed to tiktoken."""
    return tok.to_tiktoken() if isinstance(tok, Tokenizer) else tok


# ---------------------------------------------------------------------------------------------
# Sources: the standard library (default, offline), a path/dir/glob, or tiny-shakespeare
# ---------------------------------------------------------------------------------------------
def stdlib_files() -> list[Path]:
    """The Python standard library's .py files, in sorted order (tests and site-packages out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    return [f for f in sorted(root.rglob("*.py")) if not skip & set(f.relative_to(root).parts)]


def download_shakespeare(cache_dir="data/downloads") -> Path:
    """Fetch tiny-shakespeare once into a cache (only when the user asks for it)."""
    path = Path(cache_dir) / "tinyshakespeare.txt"
    if path.is_file():
        return path
    try:
        with urllib.request.urlopen(SHAKESPEARE_URL, timeout=20) as r:
            _atomic_write(path, r.read())
    except (urllib.error.URLError, OSError) as e:
        raise RuntimeError(
            f"could not download tiny-shakespeare from {SHAKESPEARE_URL} ({e}); "
            "if you are offline, pass a local text file: --source path/to/file.txt"
        ) from e
    return path


def is_binary(raw: bytes) -> bool:
    """Binary = a NUL byte, or bytes that are not UTF-8, in the first 8 KB (git sniffs 8,000):
    text has no NUL and our BPE reads UTF-8, while a PNG opens with 0x89 (no UTF-8 lead byte),
    an ELF header holds NULs and random bytes are not UTF-8. Only the head is judged, so a stray
    bad byte deep in a text file becomes U+FFFD instead of losing the file."""
    try:  # subtle: the 8 KB cut can split a character; unless the file ends there, wait for it
        codecs.getincrementaldecoder("utf-8")().decode(raw[:8192], final=len(raw) <= 8192)
    except UnicodeDecodeError:
        return True
    return b"\0" in raw[:8192]


def source_files(source: str) -> list[Path]:
    """Resolve --source to a sorted list of files, or fail with a message that says how."""
    if source == "stdlib":
        return stdlib_files()
    if source == "shakespeare":
        return [download_shakespeare()]
    p = Path(source)
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
    else:
        files = sorted(Path(f) for f in glob.glob(source, recursive=True) if Path(f).is_file())
    if not files:
        raise FileNotFoundError(
            f"source {source!r} is not a file, a directory with files or a "
            "glob that matches any; use --source stdlib, shakespeare or PATH"
        )
    return files


def read_documents(files, source=None) -> list[str]:
    """Each file is one document; binary files (see `is_binary`) are skipped and counted. With
    `source` named, a corpus left with no text (a binary or empty file named alone, a folder of
    binaries) is a one-line ValueError."""
    docs, n_binary = [], 0
    for f in files:
        raw = Path(f).read_bytes()
        if is_binary(raw):
            n_binary += 1
        else:
            docs.append(raw.decode("utf-8", errors="replace"))
    if source is not None and not any(d.strip() for d in docs):
        why = f"{n_binary} of {len(files)} files binary (NUL or not UTF-8)"
        why = why if n_binary else "empty or whitespace only"
        raise ValueError(f"source {source!r} holds no text: {why}; nothing to tokenize")
    if source is not None and n_binary:
        print(f"source {source!r}: skipped {n_binary} of {len(files)} files as binary")
    return docs


# ---------------------------------------------------------------------------------------------
# Prepare: documents -> token shards on disk
# ---------------------------------------------------------------------------------------------
def _atomic_write(path, data: bytes) -> None:
    """Write to a temporary file in the same folder, fsync, then rename: never a half file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def shard_dtype(n_vocab: int):
    """uint16 while every id fits (n_vocab <= 65,536), else uint32."""
    return np.uint16 if n_vocab - 1 <= np.iinfo(np.uint16).max else np.uint32


def write_shard(path, tokens: np.ndarray) -> None:
    header = np.array([SHARD_MAGIC, SHARD_VERSION, tokens.itemsize, len(tokens)], np.int64)
    _atomic_write(path, header.tobytes() + tokens.tobytes())


def read_shard(path) -> np.ndarray:
    """Memory-map a shard: the tokens are paged in from disk only when a batch touches them."""
    header = np.fromfile(path, np.int64, count=HEADER_INTS)
    assert len(header) == HEADER_INTS and header[0] == SHARD_MAGIC, f"{path} is not a token shard"
    assert header[1] == SHARD_VERSION, f"{path} has shard version {header[1]}, want {SHARD_VERSION}"
    dtype = {2: np.uint16, 4: np.uint32}[int(header[2])]
    return np.memmap(path, dtype, mode="r", offset=HEADER_INTS * 8, shape=(int(header[3]),))


def _split_val(docs: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """The last `val_fraction` of the characters is validation; the document there is cut at a
    newline. Deterministic, and it works for one big document as well as for many."""
    total = sum(map(len, docs))
    cut, seen = int(total * (1 - val_fraction)), 0
    for i, d in enumerate(docs):
        if seen + len(d) > cut:
            # subtle: not at the final newline, which leaves val empty for a one-line file
            at = d.find("\n", cut - seen, len(d) - 1)
            at = cut - seen if at < 0 else at + 1
            return docs[:i] + [d[:at]], [d[at:]] + docs[i + 1 :]
        seen += len(d)
    return docs, []


def _encode_documents(enc, docs, eot: int, label: str) -> np.ndarray:
    """tiktoken's batch encoder with threads, ~8 MB at a time, EOT between documents."""
    threads, pieces, done = os.cpu_count() or 1, [], 0.0
    progress = Progress(f"encode {label}", sum(map(len, docs)) / 1e6, unit="MB")
    batch: list[str] = []
    for i, doc in enumerate(docs):
        batch.append(doc)
        if sum(map(len, batch)) >= 8_000_000 or i == len(docs) - 1:
            for ids in enc.encode_ordinary_batch(batch, num_threads=threads):
                if pieces:  # between documents: not before the first, not after the last
                    pieces.append(np.array([eot], np.int64))
                pieces.append(np.asarray(ids, np.int64))
            done += sum(map(len, batch)) / 1e6
            progress.update(done)
            batch = []
    progress.close()
    return np.concatenate(pieces) if pieces else np.zeros(0, np.int64)


def prepare(
    source="stdlib",
    tokenizer="gpt2",
    out_dir="data/stdlib-gpt2",
    val_fraction=0.05,
    block_size=1024,
    tokenizer_name=None,
    before_write=None,
) -> dict:
    """Encode `source` with `tokenizer` into OUT/train.bin, OUT/val.bin and OUT/meta.json.

    Idempotent: when meta.json already describes the same inputs, nothing is done. Atomic: the
    shards are renamed into place only when whole, and meta.json (the "done" marker) comes last.
    Bad input (missing, empty, binary, too short) raises ValueError or FileNotFoundError with a
    one-line message before anything is written; `before_write()` runs once every check passed.
    """
    before_write = before_write or (lambda: None)
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    name = tokenizer_name or (tokenizer if isinstance(tokenizer, str) else type(tok).__name__)
    files = source_files(source)
    fingerprint = hashlib.sha256(
        json.dumps(
            [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
            + [name, tok.n_vocab, val_fraction, block_size]
        ).encode()
    ).hexdigest()
    out = Path(out_dir)
    meta_path = out / "meta.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("fingerprint") == fingerprint and all(
            (out / s).is_file() for s in meta["files"]
        ):
            print(f"{out}: already prepared from the same inputs, nothing to do")
            before_write()  # the inputs passed before; e.g. a tokenizer deleted by hand comes back
            return meta
    docs = read_documents(files, source)
    enc, dtype = fast_encoder(tok), shard_dtype(tok.n_vocab)
    train_docs, val_docs = _split_val(docs, val_fraction)
    splits = {
        "train": _encode_documents(enc, train_docs, tok.eot_token, "train"),
        "val": _encode_documents(enc, val_docs, tok.eot_token, "val"),
    }
    for split, ids in splits.items():
        if len(ids) < block_size + 1:
            raise ValueError(
                f"the {split} split has {len(ids)} tokens, fewer than one block of "
                f"{block_size}+1: use a bigger corpus or a smaller --block-size"
            )
    before_write()  # every check passed: the first write (main saves its new tokenizer here)
    for split, ids in splits.items():
        write_shard(out / f"{split}.bin", ids.astype(dtype))
    meta = {
        "tokenizer": name,
        "vocab_size": tok.n_vocab,
        "eot_token": tok.eot_token,
        "dtype": np.dtype(dtype).name,
        "source": source,
        "n_documents": len(docs),
        "n_bytes": sum(len(d.encode("utf-8")) for d in docs),
        "val_fraction": val_fraction,
        "train_tokens": len(splits["train"]),
        "val_tokens": len(splits["val"]),
        "files": ["train.bin", "val.bin"],
        "fingerprint": fingerprint,
    }
    _atomic_write(meta_path, json.dumps(meta, indent=1).encode())
    return meta


# ---------------------------------------------------------------------------------------------
# The loader: (x, y) = f(seed, step, dp_rank, dp_size), nothing else
# ---------------------------------------------------------------------------------------------
class DataLoader:
    """Batches of B windows of T+1 tokens from a memory-mapped shard.

    The shard is cut into non-overlapping windows. Each epoch has its own permutation of them,
    seeded by (seed, epoch); step s takes the next dp_size*B windows of that permutation and rank
    r takes its own B of them. So a batch is a pure function of (seed, step, dp_rank, dp_size):
    a resumed run sees exactly the same batches, and ranks never share a window within a step.
    """

    def __init__(
        self,
        data_dir,
        split: str,
        batch_size: int,
        block_size: int,
        seed: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
        device="cpu",
    ):
        path = Path(data_dir) / f"{split}.bin"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: prepare the data first (python 01_data.py --out {data_dir})"
            )
        assert 0 <= dp_rank < dp_size, f"dp_rank {dp_rank} outside dp_size {dp_size}"
        self.tokens, self.B, self.T = read_shard(path), batch_size, block_size
        self.seed, self.dp_rank, self.dp_size, self.device = seed, dp_rank, dp_size, device
        self.n_windows = (len(self.tokens) - 1) // block_size
        self.steps_per_epoch = self.n_windows // (dp_size * batch_size)
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"{path} holds {self.n_windows} windows of {block_size}+1 tokens, but "
                f"one step needs dp_size*batch_size = {dp_size * batch_size}"
            )
        self._perm_epoch, self._perm = -1, None

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, step within the epoch): the data position a checkpoint records."""
        return divmod(step, self.steps_per_epoch)

    def window_ids(self, step: int) -> np.ndarray:
        epoch, k = self.position(step)
        if epoch != self._perm_epoch:  # one permutation per epoch, cached
            rng = np.random.default_rng([self.seed, epoch])
            self._perm, self._perm_epoch = rng.permutation(self.n_windows), epoch
        first = (k * self.dp_size + self.dp_rank) * self.B
        return self._perm[first : first + self.B]

    def get_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.window_ids(step) * self.T
        rows = np.stack([self.tokens[s : s + self.T + 1] for s in starts]).astype(np.int64)
        x, y = torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])  # (B, T) each
        if torch.device(self.device).type == "cuda":  # pinned host memory -> async copy
            return (
                x.pin_memory().to(self.device, non_blocking=True),
                y.pin_memory().to(self.device, non_blocking=True),
            )
        return x.to(self.device), y.to(self.device)


# ---------------------------------------------------------------------------------------------
# The demo
# ---------------------------------------------------------------------------------------------
def train_or_load_bpe(text: str, vocab_size: int, path: Path):
    """Training is deterministic, so a tokenizer saved from the same text and size is reused.
    Returns (tokenizer, save): a new tokenizer is not on disk yet, `save()` writes it (None when
    reused), so that `prepare` can write it only once the corpus passed every check."""
    digest = hashlib.sha256(f"{vocab_size}:{text}".encode()).hexdigest()
    json_path = path.with_suffix(".json")
    if json_path.is_file() and json.loads(json_path.read_text()).get("trained_on") == digest:
        print(f"reusing {path}: trained on this same text at vocab {vocab_size}")
        return Tokenizer.load(path), None
    print(f"training a {vocab_size}-token byte-level BPE (incremental pair counts):")
    start = time.perf_counter()
    tok = train_bpe(text, vocab_size, verbose=True)
    print(f"  trained in {time.perf_counter() - start:.1f}s (saved with the shards to {path})")
    return tok, lambda: tok.save(path, trained_on=digest)


def _bytes_per_token(enc, text: str) -> float:
    return len(text.encode("utf-8")) / max(1, len(enc.encode_ordinary(text)))


def _show_split(tok, sentence: str) -> None:
    ids = tok.encode(sentence)
    pieces = [tok.decode([i]) for i in ids]
    print(f"  {sentence!r} -> {len(ids)} tokens\n  " + " | ".join(repr(p)[1:-1] for p in pieces))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument(
        "--source",
        default="stdlib",
        help="'stdlib' (Python's own source, offline), 'shakespeare' (downloads "
        "tiny-shakespeare once) or a text file, directory or glob",
    )
    ap.add_argument(
        "--tokenizer",
        default="bpe",
        help="'bpe' (train our own on the source), 'gpt2', 'char', or a saved .tiktoken",
    )
    ap.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size to train")
    ap.add_argument(
        "--block-size",
        type=int,
        default=1024,
        help="each split must hold at least one block of this many tokens + 1",
    )
    ap.add_argument("--val-fraction", type=float, default=0.05, help="tail of the text for val")
    ap.add_argument("--out", default=None, help="output folder (default data/SOURCE-TOKENIZER)")
    args = ap.parse_args(argv)
    small_vocab = args.tokenizer == "bpe" and args.vocab_size < 257  # 256 bytes + <|endoftext|>
    if small_vocab or args.block_size < 1 or not 0 < args.val_fraction < 1:
        ap.error("need --vocab-size >= 257 for bpe, --block-size >= 1 and 0 < --val-fraction < 1")
    try:
        _prepare_and_show(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # bad input: one line, no traceback
        raise SystemExit(f"01_data.py: error: {' '.join(str(e).splitlines())}") from None


def _prepare_and_show(args) -> None:
    """Check the corpus, train (or load) a tokenizer, show what it does, write the shards.
    Nothing reaches --out before `prepare` has checked everything (see its `before_write`)."""
    label = Path(args.source).stem if args.source not in ("stdlib", "shakespeare") else args.source
    tok_label = f"bpe{args.vocab_size}" if args.tokenizer == "bpe" else Path(args.tokenizer).stem
    out = Path(args.out or f"data/{label}-{tok_label}")

    docs = read_documents(source_files(args.source), args.source)  # bad input fails here, first
    text = EOT.join(docs)
    print(f"source {args.source!r}: {len(docs)} documents, {len(text.encode()) / 1e6:.1f} MB")
    tok_name, save_tok = str(out / "tokenizer.tiktoken"), None
    if args.tokenizer == "bpe":
        tok, save_tok = train_or_load_bpe(text, args.vocab_size, Path(tok_name))
    else:
        tok, tok_name = get_tokenizer(args.tokenizer), args.tokenizer
    _show_split(tok, "def hello_world(self):\n    return 'Hello, world!'")

    sample = text[-1_000_000:]  # bytes per token on the last MB (compression: higher is better)
    print("compression on the last MB of the corpus (bytes per token, higher = fewer tokens):")
    candidates = {"ours (this run)": fast_encoder(tok), "char": CharTokenizer()}
    try:
        candidates["gpt2"] = get_tokenizer("gpt2")
    except RuntimeError as e:
        print(f"  gpt2: unavailable ({str(e)[:60]}...)")
    for name, enc in candidates.items():
        print(
            f"  {name:16s} {_bytes_per_token(enc, sample):5.2f} bytes/token  "
            f"(vocab {enc.n_vocab:,})"
        )
    meta = prepare(args.source, tok, out, args.val_fraction, args.block_size, tok_name, save_tok)
    for split in ("train", "val"):
        f = out / f"{split}.bin"
        print(
            f"  {f}: {meta[split + '_tokens']:,} tokens as {meta['dtype']}, "
            f"{f.stat().st_size / 1e6:.1f} MB"
        )


if __name__ == "__main__":
    main()
