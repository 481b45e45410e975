"""01 · Data: from text to tokens to batches.

A language model eats integers: learn a byte-level BPE vocabulary (the most frequent adjacent pair
becomes a new token, again and again), encode the corpus once into a memory-mapped token file,
and cut (x, y) batches from it as a pure function of the step.

BPE (Sennrich et al. 2016; byte-level as in GPT-2, Radford et al. 2019) runs on the "words" of
GPT-2's pre-tokenization regex, so no merge crosses a word boundary or a special token:

    start:  every word is its UTF-8 bytes            "hug" -> [h, u, g]       vocab = 256 bytes
    repeat: (a, b) = the most frequent adjacent pair, counted over words x their frequency
            vocab[256 + i] = vocab[a] + vocab[b];  replace every (a, b) by the new id
    ties:   among equal counts, the lexicographically greatest (bytes(a), bytes(b)) wins
    encode: in each word, merge the adjacent pair whose concatenation has the lowest rank, repeat

Who holds what (nothing is distributed yet, except who reads which window):

    corpus.txt --encode (tiktoken, threads)--> train.bin = [hdr | t0 t1 t2 ... tN]  (np.memmap)
                                                            \\_window_/\\_window_/ ... (T+1 tokens)
    step s, epoch e = s // steps_per_epoch:  perm_e = permutation(windows, seed=(seed, e))
        dp_rank 0 -> perm_e[k*dp*B + 0*B : ... + B]     x = window[:-1], y = window[1:]
        dp_rank 1 -> perm_e[k*dp*B + 1*B : ... + B]     (disjoint from rank 0 in every step)

Launch: `python 01_data.py` (a 4,096-token BPE on the standard library's source, shards in data/;
timings: bench/bench_data.py). Left out on purpose: Unicode normalisation, regex-free fast
trainers and document packing masks.
"""

import argparse
import base64
import codecs
import glob
import hashlib
import heapq
import json
import os
import socket
import sysconfig
import time
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
SHARD_MAGIC, SHARD_VERSION, HEADER_INTS = 20240520, 1, 4  # header: magic, version, itemsize, count
ENCODE_BATCH_CHARS = 8_000_000  # text per tiktoken call: bounds the memory of encode_documents


# --- BPE training: the naive trainer, then the incremental one --------------------------------
def _special_splitter(specials):
    """Cuts text at special tokens, longest first (one never hides another); with none, never."""
    alternatives = "|".join(map(regex.escape, sorted(specials, key=len, reverse=True)))
    return regex.compile(f"({alternatives or '(?!)'})")  # (?!) never matches: no specials


def _pretokenize(text: str, specials) -> tuple[list[list[int]], list[int]]:
    """Each distinct pre-token once, as its bytes, with its frequency; specials are cut out."""
    pattern, counts = regex.compile(GPT2_SPLIT_PATTERN), Counter()
    for part in _special_splitter(specials).split(text):
        if part not in specials:  # never merged across, never merged into
            counts.update(pattern.findall(part))
    return [list(w.encode("utf-8")) for w in counts], list(counts.values())


def merge(ids: list[int], a: int, b: int, new_id: int) -> list[int]:
    """Replace each (a, b) in `ids` by `new_id`, left to right: "aaa" with (a, a) -> [aa, a]."""
    out, i = [], 0
    while i < len(ids):
        found = i + 1 < len(ids) and ids[i] == a and ids[i + 1] == b
        out.append(new_id if found else ids[i])
        i += 2 if found else 1
    return out


def train_bpe_naive(text: str, vocab_size: int, special_tokens=(EOT,)) -> "Tokenizer":
    """The simple version (minbpe's BasicTokenizer, on GPT-2's pre-tokens): after every merge,
    recount every pair of every word. Each merge costs a pass over the whole corpus."""
    specials = list(special_tokens)
    assert vocab_size >= 256 + len(specials), f"vocab_size {vocab_size} < 256 bytes + specials"
    words, freqs = _pretokenize(text, specials)
    vocab = {i: bytes([i]) for i in range(256)}
    merges: list[tuple[bytes, bytes]] = []
    for new_id in range(256, vocab_size - len(specials)):
        counts: Counter = Counter()
        for word, f in zip(words, freqs):
            for pair in zip(word, word[1:]):
                counts[pair] += f
        if not counts:
            break  # every word is one token: nothing left to merge
        a, b = max(counts, key=lambda p: (counts[p], vocab[p[0]], vocab[p[1]]))  # ties: greatest
        vocab[new_id] = vocab[a] + vocab[b]
        merges.append((vocab[a], vocab[b]))
        words = [merge(word, a, b, new_id) for word in words]
    return Tokenizer(vocab, merges, specials)  # 256 bytes, the merges in order, the specials


def _tie_key(token: bytes) -> tuple:
    """Smaller for lexicographically greater bytes (heapq is a min-heap): byte x maps to 256 - x
    and 257 ends the string, so b"ab" > b"a" becomes (255, 254, 257) < (255, 257)."""
    return tuple(256 - x for x in token) + (257,)


def train_bpe(text: str, vocab_size: int, special_tokens=(EOT,)) -> "Tokenizer":
    """Learn `vocab_size - 256 - len(special_tokens)` merges: the same as `train_bpe_naive`, with
    pair counts updated incrementally. A merge of (a, b) touches only the words that contain it
    (kept in `where`), so it costs the size of those words, not of the corpus. The next pair
    comes from a lazy max-heap: entries whose count changed since they were pushed are skipped."""
    specials, n_merges = list(special_tokens), vocab_size - 256 - len(special_tokens)
    assert n_merges >= 0, f"vocab_size {vocab_size} < 256 bytes + {len(specials)} special tokens"
    words, freqs = _pretokenize(text, specials)
    vocab = {i: bytes([i]) for i in range(256)}
    keys = {i: _tie_key(vocab[i]) for i in range(256)}
    pair_counts: Counter = Counter()
    where: dict[tuple[int, int], set[int]] = {}  # pair -> the words that contain it
    for w, (word, f) in enumerate(zip(words, freqs)):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += f
            where.setdefault(pair, set()).add(w)
    heap = [(-c, keys[p[0]] + keys[p[1]], p) for p, c in pair_counts.items()]
    heapq.heapify(heap)
    merges: list[tuple[bytes, bytes]] = []
    while len(merges) < n_merges and heap:
        neg_count, _, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg_count:
            continue  # stale heap entry
        new_id = 256 + len(merges)
        vocab[new_id] = vocab[pair[0]] + vocab[pair[1]]
        keys[new_id] = _tie_key(vocab[new_id])
        merges.append((vocab[pair[0]], vocab[pair[1]]))
        for p in _apply_merge(pair, new_id, words, freqs, pair_counts, where):
            if pair_counts[p] > 0:
                heapq.heappush(heap, (-pair_counts[p], keys[p[0]] + keys[p[1]], p))
            else:
                del pair_counts[p]
    return Tokenizer(vocab, merges, specials)  # 256 bytes, the merges in order, the specials


def _apply_merge(pair, new_id, words, freqs, pair_counts, where) -> set:
    """Replace `pair` by `new_id` in every word that has it; return the pairs whose count moved."""
    changed = set()
    for w in where.pop(pair):
        word, merged = words[w], merge(words[w], *pair, new_id)
        if len(merged) == len(word):
            continue  # stale entry: an earlier merge already consumed this occurrence
        for p in zip(word, word[1:]):
            pair_counts[p] -= freqs[w]
            changed.add(p)
        for p in zip(merged, merged[1:]):
            pair_counts[p] += freqs[w]
            where.setdefault(p, set()).add(w)
            changed.add(p)
        words[w] = merged
    changed.discard(pair)
    pair_counts.pop(pair, None)  # every occurrence is gone
    return changed


def progress(what: str, done: float, total: float, start: float, unit: str = "") -> None:
    """Redraw one progress line in place, with the ETA; the call with done == total ends it."""
    elapsed = time.perf_counter() - start
    eta = elapsed / max(done, 1e-9) * (total - done)
    status = f"{done:,.1f}/{total:,.1f}{unit}, ETA {eta:.1f} s ({elapsed:.1f} s)"
    print(f"\r  {what}: {status}", end="\n" if done >= total else "", flush=True)


# --- Tokenizers: our BPE, bytes ("char"), and GPT-2 through tiktoken, all with one interface --
class Tokenizer:
    """Byte-level BPE whose pure-Python encoder gives exactly tiktoken's ids. `vocab`: id -> bytes,
    the 256 single bytes included (an id is also the merge rank); `merges`: the pairs, in order."""

    def __init__(self, vocab: dict[int, bytes], merges: list, special_tokens=None):
        self.vocab, self.merges = dict(vocab), list(merges)
        as_bytes = {s.encode("utf-8") for s in special_tokens or []}
        self.ranks = {b: i for i, b in self.vocab.items() if b not in as_bytes}
        missing = [x for x in range(256) if bytes([x]) not in self.ranks]
        assert not missing, f"vocab lacks single-byte tokens {missing[:5]}...: cannot encode"
        for a, b in self.merges:
            assert a + b in self.ranks, f"merge {a!r} + {b!r} has no token in the vocab"
        self.special_tokens = {}
        for s in special_tokens or []:  # specials keep their vocab id, or are appended after it
            i = next((j for j, b in self.vocab.items() if b == s.encode()), max(self.vocab) + 1)
            self.vocab[i], self.special_tokens[s] = s.encode(), i
        self.n_vocab = max(self.vocab) + 1
        self._pattern = regex.compile(GPT2_SPLIT_PATTERN)
        self._splitter = _special_splitter(self.special_tokens)
        self._cache: dict[bytes, list[int]] = {}

    @property
    def eot_token(self) -> int:
        assert EOT in self.special_tokens, f"this tokenizer has no {EOT} special token"
        return self.special_tokens[EOT]

    def _bpe(self, word: bytes) -> list[int]:
        """BPE on one pre-token, step by step: merge the lowest-ranked adjacent pair, repeat."""
        if word not in self._cache:
            parts = [bytes([x]) for x in word]
            while len(parts) > 1:
                # a pair that is no token gets rank n_vocab, above every token's
                ranks = [self.ranks.get(a + b, self.n_vocab) for a, b in zip(parts, parts[1:])]
                if min(ranks) == self.n_vocab:
                    break
                i = ranks.index(min(ranks))  # the leftmost of equal pairs ("aaa"), as tiktoken
                parts[i : i + 2] = [parts[i] + parts[i + 1]]
            if len(self._cache) > 100_000:  # bounded memory for encode_iterable on huge streams
                self._cache.clear()
            self._cache[word] = [self.ranks[p] for p in parts]
        return self._cache[word]

    def encode_ordinary(self, text: str) -> list[int]:
        """Encode, treating special-token text as ordinary text."""
        return [i for word in self._pattern.findall(text) for i in self._bpe(word.encode("utf-8"))]

    def encode(self, text: str) -> list[int]:
        """Encode; special tokens in the text become their ids (tiktoken's allowed_special="all")."""
        ids = []
        for part in self._splitter.split(text):
            special = self.special_tokens.get(part)
            ids.extend(self.encode_ordinary(part) if special is None else [special])
        return ids

    def encode_iterable(self, chunks):
        """Stream ids from an iterable of strings (an open file) in bounded memory, equal to
        `encode("".join(chunks))`: each round emits only what more text cannot change."""
        buf = ""
        for chunk in chunks:
            buf += chunk
            if len(buf) >= 1 << 16:
                ids, buf = self._encode_stable_prefix(buf)
                yield from ids
        yield from self.encode(buf)

    def _encode_stable_prefix(self, buf: str) -> tuple[list[int], str]:
        """(ids of what more text cannot change, the rest). Held back: a tail that may begin a
        special token, and the last pre-token (it may grow, or stop matching "\\s++$"); a
        pre-token depends on at most one character after it, so the others are final."""
        hold, longest = len(buf), max(map(len, self.special_tokens), default=1)
        for i in range(max(0, len(buf) - longest + 1), len(buf)):
            if any(s.startswith(buf[i:]) for s in self.special_tokens):
                hold = i
                break
        start = max((m.end() for m in self._splitter.finditer(buf, 0, hold)), default=0)
        ids = self.encode(buf[:start])
        # subtle: emit the pre-tokens of the *whole* buffer. As its own string, the prefix "a \n"
        # of "a \nb" would split as "a", " \n" (whitespace at the end), not as "a", " ", "\n".
        matches = list(self._pattern.finditer(buf, start, hold))
        for m in matches[:-1]:
            ids.extend(self._bpe(m.group().encode("utf-8")))
        return ids, buf[matches[-1].start() if matches else start :]

    def decode(self, ids) -> str:
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")

    def to_tiktoken(self, name: str = "bpe") -> tiktoken.Encoding:
        """The same ranks handed to tiktoken's Rust encoder (hundreds of times faster)."""
        specials = self.special_tokens
        return tiktoken.Encoding(
            name, pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=self.ranks, special_tokens=specials
        )

    def save(self, path) -> Path:
        """Write X.tiktoken (tiktoken's own rank format) and X.json (specials and merges)."""
        path = Path(path).with_suffix(".tiktoken")
        b64 = lambda b: base64.b64encode(b).decode("ascii")  # noqa: E731
        ranks = "".join(f"{b64(b)} {i}\n" for i, b in sorted((i, b) for b, i in self.ranks.items()))
        meta = {"pattern": GPT2_SPLIT_PATTERN, "special_tokens": self.special_tokens}
        meta["merges"] = [[b64(a), b64(b)] for a, b in self.merges]
        atomic_write(path, lambda tmp: tmp.write_text(ranks))
        atomic_write(path.with_suffix(".json"), lambda tmp: tmp.write_text(json.dumps(meta)))
        return path

    @classmethod
    def load(cls, path) -> "Tokenizer":
        path = Path(path).with_suffix(".tiktoken")
        for p in (path, path.with_suffix(".json")):
            if not p.is_file():
                raise FileNotFoundError(f"tokenizer file {p} not found (written by Tokenizer.save)")
        # Read the file ourselves: tiktoken's load_tiktoken_bpe caches by path string, so a
        # tokenizer retrained into the same path would load its old ranks.
        lines = path.read_text().splitlines()
        vocab = {int(i): base64.b64decode(b) for b, i in (line.split() for line in lines if line)}
        meta = json.loads(path.with_suffix(".json").read_text())
        merges = [(base64.b64decode(a), base64.b64decode(b)) for a, b in meta["merges"]]
        vocab.update({i: s.encode("utf-8") for s, i in meta["special_tokens"].items()})
        return cls(vocab, merges, list(meta["special_tokens"]))


def gpt2_tokenizer() -> Tokenizer:
    """GPT-2's own 50,000 merges, from the vocab.bpe tiktoken caches. It writes byte b as chr(b)
    if printable, else chr(256 + n) for the n-th other byte; GPT-2's ids 0..255 follow suit."""
    text = tiktoken.load.read_file_cached(GPT2_VOCAB_BPE, GPT2_VOCAB_BPE_SHA256).decode("utf-8")
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    char_to_byte = {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}
    lines = [line.split() for line in text.split("\n")[1:] if line]
    merges = [tuple(bytes(char_to_byte[c] for c in part) for part in pair) for pair in lines]
    vocab = {i: bytes([b]) for i, b in enumerate(printable + others)}
    vocab.update({256 + i: a + b for i, (a, b) in enumerate(merges)})
    return Tokenizer(vocab, merges, [EOT])


class CharTokenizer(Tokenizer):
    """The smallest tokenizer is a BPE with no merges: one token per UTF-8 byte (one per character
    for ASCII text), plus <|endoftext|> as id 256. It needs no training."""

    n_vocab = 257  # on the class too: 03_ddp.py reads CharTokenizer.n_vocab

    def __init__(self):
        super().__init__({i: bytes([i]) for i in range(256)}, [], [EOT])


def get_tokenizer(name: str):
    """ "gpt2" (tiktoken), "char", or the path of a tokenizer saved by `Tokenizer.save`."""
    if name == "char":
        return CharTokenizer()
    if name != "gpt2":
        if Path(name).with_suffix(".tiktoken").is_file():
            return Tokenizer.load(name)
        raise ValueError(f"unknown tokenizer {name!r}: use 'gpt2', 'char' or a saved BPE's path")
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # noqa: BLE001 - network or cache failure; say what to do
        raise RuntimeError(
            f"cannot load GPT-2's tokenizer ({type(e).__name__}: {e}). It is downloaded once; "
            "offline, set TIKTOKEN_CACHE_DIR to a folder holding its files, or use --tokenizer char"
        ) from e


def fast_encoder(tok):
    """Something with tiktoken's `encode_ordinary_batch`: our BPE is handed to tiktoken."""
    return tok.to_tiktoken() if isinstance(tok, Tokenizer) else tok


# --- Sources: the standard library (the default, offline), or a file, folder or glob -----------
def is_table(text: str) -> bool:
    """Generated data, not code: over 60% of the code lines open with a string or number literal
    (charmap codecs, pydoc_data/topics.py, Unicode and locale tables); Python scores under 30%."""
    lines = [s for s in text.splitlines() if s.strip() and not s.lstrip().startswith("#")]
    literal = regex.compile(r"""\s*(?:[rbuRBU]?['"]|[-+]?\d)""")
    return sum(bool(literal.match(s)) for s in lines) > 0.6 * len(lines)


def stdlib_files() -> list[Path]:
    """The standard library's .py files, sorted, without tests, site-packages and generated
    tables (`is_table`: ~20% of the bytes), so a model trained on it writes Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    files = [f for f in sorted(root.rglob("*.py")) if not skip & set(f.relative_to(root).parts)]
    return [f for f in files if not is_table(f.read_text("utf-8", errors="replace"))]


def is_binary(raw: bytes) -> bool:
    """A NUL, or bytes that are not UTF-8, in the first 8 KB (git sniffs 8,000): PNG, ELF, random
    bytes. Only the head is judged: a stray bad byte deep in a text file becomes U+FFFD."""
    try:  # subtle: the 8 KB cut can split a character; unless the file ends there, wait for it
        codecs.getincrementaldecoder("utf-8")().decode(raw[:8192], final=len(raw) <= 8192)
    except UnicodeDecodeError:
        return True
    return b"\0" in raw[:8192]


def source_files(source: str) -> list[Path]:
    """Resolve --source to a sorted list of files, or fail with a message that says how."""
    if source == "stdlib":
        return stdlib_files()
    p = Path(source)
    if p.is_file():
        return [p]
    found = p.rglob("*") if p.is_dir() else map(Path, glob.glob(source, recursive=True))
    files = sorted(f for f in found if f.is_file())
    if not files:
        what = "a file, a directory with files or a matching glob"
        raise FileNotFoundError(f"source {source!r} is not {what}")
    return files


def read_documents(files: list, source=None) -> list[str]:
    """Each file is one document; binary files (`is_binary`) are skipped and counted. With
    `source` named, a corpus left with no text is a one-line ValueError."""
    raws = (Path(f).read_bytes() for f in files)
    docs = [raw.decode("utf-8", errors="replace") for raw in raws if not is_binary(raw)]
    n_binary = len(files) - len(docs)
    if source is not None and not any(d.strip() for d in docs):
        why = f"{n_binary} of {len(files)} files binary (NUL or not UTF-8)"
        why = why if n_binary else "empty or whitespace only"
        raise ValueError(f"source {source!r} holds no text: {why}; nothing to tokenize")
    if source is not None and n_binary:
        print(f"source {source!r}: skipped {n_binary} of {len(files)} files as binary")
    return docs


# --- Prepare: documents -> token shards on disk -----------------------------------------------
def atomic_write(path, write) -> None:
    """`write(tmp)` fills a temporary file in the same folder; it is fsynced, renamed over `path`,
    and the folder fsynced: readers see the old file or the new, never half, even after a crash."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # same folder: rename is atomic. Host and pid: nodes sharing a filesystem reuse pids
    tmp = path.with_name(f".{path.name}.tmp.{socket.gethostname()}.{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # a write that failed leaves no litter
    fsync_dir(path.parent)


def fsync_dir(path) -> None:
    """A folder's entries (new names, renames) reach the disk only when the folder is fsynced."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_shard(path, tokens: np.ndarray) -> None:
    header = np.array([SHARD_MAGIC, SHARD_VERSION, tokens.itemsize, len(tokens)], np.int64)
    atomic_write(path, lambda tmp: tmp.write_bytes(header.tobytes() + tokens.tobytes()))


def read_shard(path) -> np.ndarray:
    """Memory-map a shard: the tokens are paged in from disk only when a batch touches them."""
    header = np.fromfile(path, np.int64, count=HEADER_INTS)
    assert len(header) == HEADER_INTS and header[0] == SHARD_MAGIC, f"{path} is not a token shard"
    assert header[1] == SHARD_VERSION, f"{path} has shard version {header[1]}, want {SHARD_VERSION}"
    dtype = {2: np.uint16, 4: np.uint32}[int(header[2])]
    return np.memmap(path, dtype, mode="r", offset=HEADER_INTS * 8, shape=(int(header[3]),))


def split_val(docs: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """The last `val_fraction` of the characters is validation; the document there is cut at a
    newline. Deterministic, and it works for one big document as well as for many."""
    cut, seen = int(sum(map(len, docs)) * (1 - val_fraction)), 0
    for i, d in enumerate(docs):
        if seen + len(d) > cut:
            # subtle: not at the final newline, which leaves val empty for a one-line file
            at = d.find("\n", cut - seen, len(d) - 1)
            at = cut - seen if at < 0 else at + 1
            return docs[:i] + [d[:at]], [d[at:]] + docs[i + 1 :]
        seen += len(d)
    return docs, []


def encode_documents(enc, docs, eot: int, label: str) -> np.ndarray:
    """tiktoken's batch encoder with threads, EOT between documents. A call takes ~8 MB of text
    (one document at least; a document is a whole file), so its ids in memory are the batch's."""
    pieces, start, total, done, batch, size = [], time.perf_counter(), sum(map(len, docs)), 0, [], 0
    for i, doc in enumerate(docs):
        batch.append(doc)
        size += len(doc)
        if size >= ENCODE_BATCH_CHARS or i == len(docs) - 1:
            for ids in enc.encode_ordinary_batch(batch, num_threads=os.cpu_count() or 1):
                pieces += [np.array([eot], np.int64), np.asarray(ids, np.int64)]  # EOT, doc
            done, batch, size = done + size, [], 0
            progress(f"encode {label}", done / 1e6, total / 1e6, start, unit=" MB")
    return np.concatenate(pieces[1:]) if pieces else np.zeros(0, np.int64)  # no EOT before doc 0


def prepare(source, tokenizer, out_dir, val_fraction=0.05, block_size=1024, tokenizer_name=None,
            before_write=None) -> dict:  # fmt: skip
    """Encode `source` with `tokenizer` into OUT/train.bin, OUT/val.bin and OUT/meta.json.
    Idempotent: nothing is done when meta.json describes the same inputs. Atomic: shards are
    renamed into place only when whole, meta.json (the "done" marker) last. Bad input raises a
    one-line ValueError or FileNotFoundError before any write; then `before_write()` runs."""
    before_write = before_write or (lambda: None)
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    name = tokenizer_name or (tokenizer if isinstance(tokenizer, str) else type(tok).__name__)
    files = source_files(source)
    stats = [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    inputs = json.dumps(stats + [name, tok.n_vocab, val_fraction, block_size]).encode()
    fingerprint = hashlib.sha256(inputs).hexdigest()
    out, meta_path = Path(out_dir), Path(out_dir) / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if meta.get("fingerprint") == fingerprint and all((out / s).is_file() for s in meta["files"]):
        print(f"{out}: already prepared from the same inputs, nothing to do")
        before_write()  # the inputs passed before; e.g. a tokenizer deleted by hand comes back
        return meta
    docs = read_documents(files, source)
    enc, dtype = fast_encoder(tok), np.uint16 if tok.n_vocab <= 1 << 16 else np.uint32
    parts = zip(("train", "val"), split_val(docs, val_fraction))
    splits = {split: encode_documents(enc, part, tok.eot_token, split) for split, part in parts}
    for split, ids in splits.items():
        if len(ids) < block_size + 1:
            few = f"the {split} split has {len(ids)} tokens, fewer than one block of {block_size}+1"
            raise ValueError(f"{few}: use a bigger corpus or a smaller --block-size")
    before_write()  # every check passed: the first write (main saves its new tokenizer here)
    for split, ids in splits.items():
        write_shard(out / f"{split}.bin", ids.astype(dtype))
    meta = dict(tokenizer=name, vocab_size=tok.n_vocab, eot_token=tok.eot_token, source=source)
    meta.update(dtype=np.dtype(dtype).name, n_documents=len(docs), val_fraction=val_fraction)
    meta.update(n_bytes=sum(len(d.encode("utf-8")) for d in docs), files=["train.bin", "val.bin"])
    meta.update(fingerprint=fingerprint, **{f"{s}_tokens": len(ids) for s, ids in splits.items()})
    atomic_write(meta_path, lambda tmp: tmp.write_text(json.dumps(meta, indent=1)))
    return meta


# --- The loader: (x, y) = f(seed, step, dp_rank, dp_size), nothing else -----------------------
class DataLoader:
    """B windows of T+1 tokens per rank and step, from a memory-mapped shard. Epoch e permutes the
    non-overlapping windows with seed (seed, e); step s takes the next dp_size*B, rank r its own B:
    a pure function of (seed, step, dp_rank, dp_size), so a resumed run sees the same batches."""

    def __init__(
        self, data_dir, split, batch_size, block_size, seed=0, dp_rank=0, dp_size=1, device="cpu"
    ):
        path = Path(data_dir) / f"{split}.bin"
        if not path.is_file():
            fix = f"prepare the data first (python 01_data.py --out {data_dir})"
            raise FileNotFoundError(f"{path} not found: {fix}")
        assert 0 <= dp_rank < dp_size, f"dp_rank {dp_rank} outside dp_size {dp_size}"
        self.tokens, self.B, self.T = read_shard(path), batch_size, block_size
        self.seed, self.dp_rank, self.dp_size, self.device = seed, dp_rank, dp_size, device
        self.n_windows = (len(self.tokens) - 1) // block_size
        self.steps_per_epoch = self.n_windows // (dp_size * batch_size)
        if self.steps_per_epoch < 1:
            have = f"{path} holds {self.n_windows} windows of {block_size}+1 tokens"
            need = f"one step needs dp_size*batch_size = {dp_size * batch_size}"
            raise ValueError(f"{have}, but {need}")
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
        cuda = torch.device(self.device).type == "cuda"
        if cuda:  # pinned host memory -> an asynchronous copy
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(self.device, non_blocking=cuda), y.to(self.device, non_blocking=cuda)


# --- The demo: each lesson printed with its check ---------------------------------------------
def show_naive_vs_incremental(text: str, vocab_size: int) -> None:
    """Simple first: both trainers on the same text, timed, and their merges compared."""
    start = time.perf_counter()
    naive = train_bpe_naive(text, vocab_size)
    mid = time.perf_counter()
    same = train_bpe(text, vocab_size).merges == naive.merges
    took = f"naive {mid - start:.2f} s, incremental {time.perf_counter() - mid:.2f} s"
    print(f"BPE on {len(text) / 1e3:.0f} KB, vocab {vocab_size}: {took}, same merges: {same}")


def show_tokenizers(name: str, tok, text: str) -> None:
    """Our encoder with GPT-2's own merges against tiktoken's GPT-2 (Rust); then bytes per token
    (higher = fewer tokens) on the validation text, which no tokenizer was trained on."""
    encoders = {name: fast_encoder(tok), "char": fast_encoder(CharTokenizer())}
    try:
        ref, ours, sample = get_tokenizer("gpt2"), gpt2_tokenizer(), text[:200_000]
    except Exception as e:  # noqa: BLE001 - offline without TIKTOKEN_CACHE_DIR: say so, go on
        print(f"ours == tiktoken: skipped: GPT-2's files cannot be loaded ({e!r:.80})")
    else:
        encoders["gpt2"] = ref
        same = ours.encode(sample) == ref.encode(sample, allowed_special="all")
        print(f"ours == tiktoken: {same} (GPT-2's merges, {len(sample) / 1e3:.0f} KB of val text)")
    n = len(text.encode("utf-8"))
    scores = [f"{k} {n / max(1, len(e.encode_ordinary(text))):.2f}" for k, e in encoders.items()]
    print(f"bytes per token on the val split, which no tokenizer trained on: {', '.join(scores)}")


def show_loader(out: Path, tok) -> None:
    """Step 0 for dp_rank 0 and 1 of dp_size 2: disjoint windows, and y is x shifted by one."""
    B, T = 2, 8  # small, to print; training uses --block-size
    try:
        loaders = [DataLoader(out, "train", B, T, seed=0, dp_rank=r, dp_size=2) for r in (0, 1)]
    except ValueError as e:  # a corpus of fewer than 4 windows of 8 tokens
        print(f"loader: skipped: {e}")
        return
    ids = [set(ld.window_ids(0).tolist()) for ld in loaders]
    disjoint = not ids[0] & ids[1]
    print(f"loader, step 0, B={B}, T={T}: windows {ids[0]} and {ids[1]}, disjoint: {disjoint}")
    for r, ld in enumerate(loaders):
        x, y = ld.get_batch(0)  # (B, T) each
        text = " | ".join(f"{tok.decode(row[:6].tolist())!r}" for row in (x[0], y[0]))
        print(f"  dp_rank {r}: x, y = {text}; y is x shifted by one: {y[:, :-1].equal(x[:, 1:])}")


def main(argv=None) -> None:
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=formatter)
    arg = parser.add_argument
    arg("--source", default="stdlib", help="stdlib (Python's own source), a file, folder or glob")
    arg("--tokenizer", default="bpe", help="bpe (trained here), gpt2, char or a .tiktoken")
    arg("--vocab-size", type=int, default=4096, help="BPE vocabulary; 4,096 trains in seconds")
    arg("--block-size", type=int, default=1024, help="GPT-2's context; each split needs one + 1")
    arg("--val-fraction", type=float, default=0.05, help="tail held out for validation")
    arg("--out", help="output folder; data/SOURCE-TOKENIZER when not given")
    args = parser.parse_args(argv)
    small_vocab = args.tokenizer == "bpe" and args.vocab_size < 257  # 256 bytes + <|endoftext|>
    if small_vocab or args.block_size < 1 or not 0 < args.val_fraction < 1:
        parser.error("need --vocab-size >= 257 for bpe, --block-size >= 1, 0 < --val-fraction < 1")
    try:
        demo(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # bad input: one line, no traceback
        raise SystemExit(f"01_data.py: error: {' '.join(str(e).splitlines())}") from None


def demo(args) -> None:
    """Check the corpus, train a tokenizer on the train split, show what it does, write the
    shards. Nothing reaches --out before `prepare` has checked everything (`before_write`)."""
    tok_label = f"bpe{args.vocab_size}" if args.tokenizer == "bpe" else Path(args.tokenizer).stem
    out = Path(args.out or f"data/{Path(args.source).stem}-{tok_label}")
    docs = read_documents(source_files(args.source), args.source)  # bad input fails here, first
    train_text, val_text = (EOT.join(part) for part in split_val(docs, args.val_fraction))
    print(f"source {args.source!r}: {len(docs)} documents, {len(train_text) / 1e6:.1f} MB train")
    tok_name, save_tok = str(out / "tokenizer.tiktoken"), None
    if args.tokenizer == "bpe":
        show_naive_vs_incremental(train_text[:80_000], min(args.vocab_size, 512))
        print(f"training a {args.vocab_size}-token BPE on the train split ...", end=" ", flush=True)
        t0 = time.perf_counter()
        tok = train_bpe(train_text, args.vocab_size)
        print(f"{time.perf_counter() - t0:.1f} s")
        save_tok = lambda: tok.save(tok_name)  # noqa: E731 - by prepare, once the input passed
    else:
        tok, tok_name = get_tokenizer(args.tokenizer), args.tokenizer
    show_tokenizers(args.tokenizer, tok, val_text)
    meta = prepare(args.source, tok, out, args.val_fraction, args.block_size, tok_name, save_tok)
    for split in ("train", "val"):  # also when prepare found them done: what the shards hold
        path, n = out / f"{split}.bin", meta[f"{split}_tokens"]
        print(f"  {path}: {n:,} tokens, {meta['dtype']}, {path.stat().st_size / 1e6:.1f} MB")
    show_loader(out, tok)


if __name__ == "__main__":
    main()
