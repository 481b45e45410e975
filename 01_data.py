"""01 · Data: from text to tokens to batches.

A language model eats integers: learn a byte-level BPE vocabulary (the most frequent adjacent pair
becomes a new token, again and again), clean the documents, encode them once into memory-mapped
token shards, and cut (x, y) batches from them as a pure function of the step.

BPE (Sennrich et al. 2016; byte-level as in GPT-2, Radford et al. 2019) runs on the "words" of
GPT-2's pre-tokenization regex, so no merge crosses a word boundary or a special token:

    start:  every word is its UTF-8 bytes            "hug" -> [h, u, g]       vocab = 256 bytes
    repeat: (a, b) = the most frequent adjacent pair, counted over words x their frequency
            vocab[256 + i] = vocab[a] + vocab[b];  replace every (a, b) by the new id
    ties:   among equal counts, the lexicographically greatest (bytes(a), bytes(b)) wins
    encode: in each word, merge the adjacent pair whose concatenation has the lowest rank, repeat

Clean data (as FineWeb, Penedo et al. 2024): --quality gopher keeps prose by Gopher's rules (Rae
et al. 2021); --dedup drops a document seen before: exact (same text up to case and spacing), or
minhash (Broder 1997), near copies too: J(A, B) = |A∩B|/|A∪B| of word 5-gram sets; the least of a
hash over A is the least over B iff the least of A∪B is in A∩B: P = J. 112 hashes in 14 bands of 8
(LSH: a key a band, a shared key a match, found by set lookup): P = 1 - (1 - J^8)^14, 92% at J =
0.8, 5% at 0.5. The first of a cluster stays; 15 keys of ~75 B a document: 17 GB for 10B tokens.

Who holds what (nothing is distributed yet, except who reads which window):

    files, .jsonl --stream, clean, encode (tiktoken)--> OUT/train_000000.bin ..., val_*, meta.json
    each [hdr | t0 ... t(n-1)] (np.memmap, n <= --shard-tokens), cut into windows of T+1 tokens at
    stride T that never cross a shard, W of them across the shards:  \\_window_/\\_window_/ ...
    step s, epoch e = s // steps_per_epoch:  perm_e = permutation(W windows, seed=(seed, e))
        dp_rank 0 -> perm_e[k*dp*B + 0*B : ... + B]     x = window[:-1], y = window[1:]
        dp_rank 1 -> perm_e[k*dp*B + 1*B : ... + B]     (disjoint from rank 0 in every step)

Launch: `python 01_data.py` (a 4,096-token BPE on the standard library's source, shards in data/;
--source FILES.jsonl for a real corpus; timings: bench/bench_data.py). Left out on purpose:
Unicode normalisation, fast trainers, packing masks, language ID, URL and repetition filters.
"""

import argparse
import base64
import codecs
import contextlib
import fcntl
import glob
import hashlib
import heapq
import json
import os
import shutil
import socket
import sysconfig
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import regex
import tiktoken
import torch

# GPT-2's pre-tokenization, as tiktoken's "gpt2" uses it: 's 't 're 've 'm 'll 'd | ?letters |
# ?digits | ?other symbols | trailing whitespace | whitespace not followed by a non-space | \s.
GPT2_SPLIT_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)
EOT = "<|endoftext|>"
SHARD_MAGIC, SHARD_VERSION, HEADER_INTS = 20240520, 1, 4  # header: magic, version, itemsize, count
SPLITS = ("train", "val")
ENCODE_BATCH_CHARS = 8_000_000  # text per tiktoken call: bounds the memory of encode_documents
MAX_DOCUMENT_BYTES = 32_000_000  # a bigger file would be a bigger batch: refused, split it
SHARD_TOKENS = 100_000_000  # ids per shard at most, as llm.c and build-nanogpt: 200 MB in uint16


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
    (words, freqs), merges = _pretokenize(text, specials), []
    vocab = {i: bytes([i]) for i in range(256)}
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


def train_bpe(text: str, vocab_size: int, special_tokens=(EOT,)) -> "Tokenizer":
    """`train_bpe_naive`'s merges, with pair counts updated incrementally: a merge touches only the
    words that contain its pair (`where`); the next pair comes from a lazy max-heap."""
    specials, n_merges = list(special_tokens), vocab_size - 256 - len(special_tokens)
    assert n_merges >= 0, f"vocab_size {vocab_size} < 256 bytes + {len(specials)} special tokens"
    (words, freqs), vocab = _pretokenize(text, specials), {i: bytes([i]) for i in range(256)}
    tie_key = lambda t: tuple(256 - x for x in t) + (257,)  # noqa: E731 - min-heap: greater first
    keys = {i: tie_key(vocab[i]) for i in range(256)}
    pair_counts, where = Counter(), {}  # where: pair -> the ids of the words that contain it
    for w, (word, f) in enumerate(zip(words, freqs)):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += f
            where.setdefault(pair, set()).add(w)
    heap = [(-c, keys[p[0]] + keys[p[1]], p) for p, c in pair_counts.items()]
    heapq.heapify(heap)
    merges = []  # (bytes of a, bytes of b), in order
    while len(merges) < n_merges and heap:
        neg_count, _, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg_count:
            continue  # stale heap entry
        new_id = 256 + len(merges)
        vocab[new_id] = vocab[pair[0]] + vocab[pair[1]]
        keys[new_id] = tie_key(vocab[new_id])
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
    """Redraw one progress line in place, with the rate and ETA; done == total ends it."""
    t = time.perf_counter() - start
    eta, rate = t / max(done, 1e-9) * (total - done), done / max(t, 1e-9)
    status = f"{done:,.1f}/{total:,.1f}{unit}, {rate:,.1f}{unit}/s, ETA {eta:.0f} s ({t:.0f} s in)"
    print(f"\r  {what}: {status}", end="\n" if done >= total else "", flush=True)


# --- Tokenizers: our BPE, bytes ("char"), and GPT-2 through tiktoken, all with one interface --
class Tokenizer:
    """Byte-level BPE whose pure-Python encoder gives exactly tiktoken's ids. `vocab`: id -> bytes,
    the 256 single bytes included (an id is also the merge rank); `merges`: the pairs, in order."""

    def __init__(self, vocab: dict[int, bytes], merges: list, special_tokens=None):
        self.vocab, self.merges = dict(vocab), list(merges)
        as_bytes = {s.encode("utf-8") for s in special_tokens or []}
        self.ranks = {b: i for i, b in self.vocab.items() if b not in as_bytes}
        assert all(bytes([x]) in self.ranks for x in range(256)), "a byte has no token"
        for a, b in self.merges:
            assert a + b in self.ranks, f"merge {a!r} + {b!r} has no token in the vocab"
        self.special_tokens = {}
        for s in special_tokens or []:  # specials keep their vocab id, or are appended after it
            i = next((j for j, b in self.vocab.items() if b == s.encode()), max(self.vocab) + 1)
            self.vocab[i], self.special_tokens[s] = s.encode(), i
        self.n_vocab = max(self.vocab) + 1
        self._pattern = regex.compile(GPT2_SPLIT_PATTERN)
        self._splitter = _special_splitter(self.special_tokens)
        self._cut = regex.compile(r"(?r)(?<=\S)\s(?=\S)")  # (?r): the last match first
        assert not any(regex.search(r"\s", t) for t in self.special_tokens), "a special's space"
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
                ranks = [self.ranks.get(a + b, self.n_vocab) for a, b in zip(parts, parts[1:])]
                if min(ranks) == self.n_vocab:  # (n_vocab: a pair that is no token)
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
        """Encode; special tokens in the text become their ids (tiktoken's allowed_special="all")"""
        ids = []
        for part in self._splitter.split(text):
            special = self.special_tokens.get(part)
            ids.extend(self.encode_ordinary(part) if special is None else [special])
        return ids

    def encode_iterable(self, chunks):
        """`encode("".join(chunks))`, streamed: cut before a lone whitespace between non-spaces
        (" x", "\\nx"), which no pre-token crosses or looks past (specials hold none). Memory: 64K
        characters and the text since such a place (long only without them: base64, CJK)."""
        buf = ""
        for chunk in chunks:
            new, buf = max(0, len(buf) - 1), buf + chunk  # searched from there: linear time
            if len(buf) >= 1 << 16 and (cut := self._cut.search(buf, new)):  # the last such place
                yield from self.encode(buf[: cut.start()])
                buf = buf[cut.start() :]
        yield from self.encode(buf)

    def decode(self, ids) -> str:
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")

    def to_tiktoken(self, name: str = "bpe") -> tiktoken.Encoding:
        """The same ranks handed to tiktoken's Rust encoder (hundreds of times faster)."""
        kw = dict(pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=self.ranks)
        return tiktoken.Encoding(name, **kw, special_tokens=self.special_tokens)

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
        path = Path(path).with_suffix(".tiktoken")  # and X.json, written by Tokenizer.save
        # read here: tiktoken's loader caches by path, so a retrained one would load its old ranks
        lines = path.read_text().splitlines()
        vocab = {int(i): base64.b64decode(b) for b, i in (line.split() for line in lines if line)}
        meta = json.loads(path.with_suffix(".json").read_text())
        merges = [(base64.b64decode(a), base64.b64decode(b)) for a, b in meta["merges"]]
        vocab.update({i: s.encode("utf-8") for s, i in meta["special_tokens"].items()})
        return cls(vocab, merges, list(meta["special_tokens"]))


class CharTokenizer(Tokenizer):
    """A BPE with no merges: one token per UTF-8 byte, plus <|endoftext|> as id 256; no training."""

    def __init__(self):
        super().__init__({i: bytes([i]) for i in range(256)}, [], [EOT])


def get_tokenizer(name: str):
    """ "gpt2" (tiktoken), "char", or the path of a tokenizer saved by `Tokenizer.save`."""
    if name == "char":
        return CharTokenizer()
    if name != "gpt2" and Path(name).with_suffix(".tiktoken").is_file():
        return Tokenizer.load(name)
    if name != "gpt2":
        raise ValueError(f"unknown tokenizer {name!r}: use 'gpt2', 'char' or a saved BPE's path")
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # noqa: BLE001 - network or cache failure; say what to do
        fix = "offline: TIKTOKEN_CACHE_DIR=a folder with its files (or --tokenizer char)"
        raise RuntimeError(f"cannot load GPT-2's tokenizer ({type(e).__name__}: {e}); {fix}") from e


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
    p, pattern = Path(source), glob.glob(source, recursive=True)
    found = p.rglob("*") if p.is_dir() else [p] if p.is_file() else map(Path, pattern)
    files = stdlib_files() if source == "stdlib" else sorted(f for f in found if f.is_file())
    if not files:
        raise FileNotFoundError(f"source {source!r} is not a file, a folder with files or a glob")
    return files


def iter_documents(files, skipped: list, text_field="text"):
    """(start, end, text, whole) per document, in order: a file, or a .jsonl line's `text_field`
    (whole: never split); start, end: its bytes in the source. Binary files go to `skipped`."""
    offset = 0
    for f in map(Path, files):
        if f.suffix != ".jsonl" and f.stat().st_size > MAX_DOCUMENT_BYTES:  # ~20x it in memory
            raise ValueError(f"{f}: over 32 MB, one document: split it in files or .jsonl lines")
        with open(f, "rb") as file:
            jsonl = f.suffix == ".jsonl"
            for n, raw in enumerate(file if jsonl else [file.read()], 1):  # a line, or the file
                if not jsonl and is_binary(raw):  # skipped: its bytes are no part of the source
                    skipped.append(f)
                    continue
                if not jsonl:
                    yield offset, offset + len(raw), raw.decode("utf-8", errors="replace"), False
                elif raw.strip():
                    yield offset, offset + len(raw), json_text(raw, text_field, f"{f}:{n}"), True
                offset += len(raw)


def json_text(line: bytes, field: str, where: str) -> str:  # bad surrogates: U+FFFD, as tiktoken
    with contextlib.suppress(ValueError, KeyError, TypeError, IndexError):
        if isinstance(text := json.loads(line)[field], str):
            return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    raise ValueError(f"{where}: not a JSON object with a string field {field!r}")


def split_document(doc, cut: int) -> list:
    """[(split, text)]: val is the source from byte `cut` on; a file across the cut is cut at the
    next newline (a JSON line stays whole, in train), so one big file gets a val split too."""
    start, end, text, whole = doc
    if start >= cut or end <= cut or whole:
        return [("val" if start >= cut else "train", text)]
    at = len(text.encode()[: cut - start].decode("utf-8", errors="ignore"))  # in characters
    newline = text.find("\n", at, len(text) - 1)  # subtle: not the last (a one-line file's val)
    at = at if newline < 0 else newline + 1
    return [("train", text[:at]), ("val", text[at:])]


def val_cut(files, val_fraction: float) -> int:
    """Where val starts: the last `val_fraction` of the text files' bytes (heads only are read)."""
    heads = (open(f, "rb").read(8193) for f in files)  # 8,193: is_binary sees 8 KB, and more
    sizes = [Path(f).stat().st_size for f, head in zip(files, heads) if not is_binary(head)]
    return int(sum(sizes) * (1 - val_fraction))


# --- Clean data: quality rules, then duplicates (exact, then near: MinHash with LSH bands) --------
STOP_WORDS = "the|be|to|of|and|that|have|with"  # Gopher's eight: English prose has them
WORD, SYMBOLS = regex.compile(r"\w+"), regex.compile(r"[^\w\s]+")  # a word tokenizer's cuts
LETTERED, STOP = regex.compile(r"\w*\p{L}\w*"), regex.compile(rf"\b(?:{STOP_WORDS})\b", regex.I)
QUALITY, DEDUP = ("none", "gopher"), ("none", "exact", "minhash")  # --quality, --dedup


def gopher_rule_broken(text: str) -> str | None:
    """The first Gopher rule (Rae et al. 2021; FineWeb's thresholds) `text` breaks, or None."""
    words, lines = WORD.findall(text), text.splitlines() or [""]  # (C-speed regexes, no loops)
    n_words = max(1, len(words) + len(SYMBOLS.findall(text)))  # symbol runs count, as FineWeb's
    mean = len("".join(words)) / max(1, len(words))
    share = lambda test: sum(map(test, lines)) / len(lines)  # noqa: E731 - of the lines
    rules = {  # reason: broken?                           what it removes (too few; too many)
        "words not 50 to 100,000": not 50 <= len(words) <= 100_000,  # fragments; dumps, logs
        "mean word not 3 to 10 characters": not 3 <= mean <= 10,  # number lists; URLs, base64
        "'#' over 0.1 a word": text.count("#") / n_words > 0.1,  # hashtag spam
        "'...' over 0.1 a word": (text.count("...") + text.count("…")) / n_words > 0.1,  # teasers
        "bullet lines over 90%": share(lambda s: s.lstrip().startswith(("•", "-"))) > 0.9,  # lists
        "'...' line ends over 30%": share(lambda s: s.rstrip().endswith(("...", "…"))) > 0.3,
        "alphabetic words under 80%": len(LETTERED.findall(text)) / n_words < 0.8,  # tables, code
        "under 2 stop words": len(STOP.findall(text)) < 2,  # not English prose (occurrences)
    }
    return next((why for why, broken in rules.items() if broken), None)


class Deduplicator:
    """Every text's keys, in a set (~75 B a key; packed and sorted: 8 B, 1.8 GB for 10B tokens)."""

    def __init__(self, mode: str, hashes: int = 112, bands: int = 14):
        rng = np.random.default_rng(SHARD_MAGIC)  # any fixed seed: the same removals every run
        self.a, self.b = rng.integers(0, 2**64, (2, hashes, 1), np.uint64) | 1  # (hashes, 1) each
        self.mode, self.bands, self.seen = mode, bands, set()  # (a odd: a·s mod 2^64 is 1-to-1)

    def minhash(self, text: str, n: int = 5) -> np.ndarray | None:
        """(hashes,): entry i = min over the text's lowercase word n-grams s of (a_i·s + b_i) >> 32
        (multiply-shift mod 2^64; crc32 a word: hash() varies by process). None: under n words."""
        words = np.array([zlib.crc32(w.encode()) for w in WORD.findall(text.lower())], np.uint64)
        if (k := len(words) - n + 1) < 1:  # no n-gram: the exact key alone (else every such
            return None  # text, the empty one too, would meet every other)
        shingles = words[:k].copy()  # (k,) a polynomial hash of each n-gram, base 2^64/φ (odd)
        for i in range(1, n):
            shingles = shingles * np.uint64(0x9E3779B97F4A7C15) + words[i : i + k]
        sig = np.full(len(self.a), np.iinfo(np.uint64).max, np.uint64)
        for c in range(0, k, 4096):  # (hashes, 4,096) at a time: bounded memory for a long text
            sig = np.minimum(sig, (self.a * shingles[c : c + 4096] + self.b).min(1))
        return sig >> 32  # the top 32 bits, the well-mixed ones (min(x >> 32) = min(x) >> 32)

    def why_duplicate(self, text: str) -> str | None:
        """What duplicate `text` is, or None; its keys are kept either way (a chain goes too)."""
        digest = lambda b: hashlib.blake2b(b, digest_size=8).digest()  # noqa: E731
        keys = [("exact duplicate", digest(" ".join(text.lower().split()).encode()))]
        if self.mode == "minhash" and (sig := self.minhash(text)) is not None:  # a key a band: its
            bands = enumerate(
                sig.reshape(self.bands, -1)
            )  # index (band 2 never meets band 5), rows
            keys += [("near duplicate", digest(bytes([i]) + b.tobytes())) for i, b in bands]
        why = next((why for why, key in keys if key in self.seen), None)
        self.seen.update(key for _, key in keys)
        return why


# --- Prepare: documents -> token shards on disk -----------------------------------------------
def atomic_write(path, write) -> None:
    """`write(tmp)` fills a temporary file in the same folder; it is fsynced, renamed over `path`,
    and the folder fsynced: readers see the old file or the new, never half, even after a crash."""
    path = Path(path)  # the same folder: the rename is atomic; host and pid: nodes share folders
    path.parent.mkdir(parents=True, exist_ok=True)
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


def shard_header(dtype, n: int) -> bytes:
    return np.array([SHARD_MAGIC, SHARD_VERSION, np.dtype(dtype).itemsize, n], np.int64).tobytes()


def split_shards(data_dir, split: str) -> list[Path]:
    """A split's shards, in order: meta.json's list, or the {split}.bin of a folder without it."""
    meta_path, data_dir = Path(data_dir) / "meta.json", Path(data_dir)
    shards = json.loads(meta_path.read_text()).get("shards") if meta_path.is_file() else None
    paths = [data_dir / s["file"] for s in shards[split]] if shards else [data_dir / f"{split}.bin"]
    if missing := [p for p in paths if not p.is_file()]:
        fix = f"prepare the data first (python 01_data.py --out {data_dir})"
        raise FileNotFoundError(f"{missing[0]} not found: {fix}")
    return paths


def read_shard(path) -> np.ndarray:
    """Memory-map a shard: the tokens are paged in from disk only when a batch touches them."""
    header = np.fromfile(path, np.int64, count=HEADER_INTS)
    magic = len(header) == HEADER_INTS and (header[0], header[1]) == (SHARD_MAGIC, SHARD_VERSION)
    assert magic, f"{path} is not a token shard of version {SHARD_VERSION}"
    dtype = {2: np.uint16, 4: np.uint32}[int(header[2])]
    return np.memmap(path, dtype, mode="r", offset=HEADER_INTS * 8, shape=(int(header[3]),))


class ShardWriter:
    """Ids in, shards of at most `limit` ids out (OUT/{split}_000000.bin, _000001, ...), each
    written to a temporary file as the ids come and renamed into place only when whole."""

    def __init__(self, out: Path, split: str, dtype, limit: int):
        self.out, self.split, self.dtype, self.limit = out, split, dtype, limit
        self.file, self.n, self.docs, self.shards = None, 0, 0, []  # shards: [{file, tokens}]

    def add(self, ids: np.ndarray) -> None:
        while len(ids):
            if self.file is None:  # a new shard; its header is rewritten when its count is known
                self.path = self.out / f"{self.split}_{len(self.shards):06d}.bin"
                self.file, self.n = open(self.path.with_suffix(".tmp"), "wb"), 0
                self.file.write(shard_header(self.dtype, 0))
            take = min(len(ids), self.limit - self.n)
            self.file.write(ids[:take].astype(self.dtype).tobytes())
            self.n, ids = self.n + take, ids[take:]
            if self.n == self.limit:
                self.close()

    def close(self) -> None:  # the shard in progress, if any: its header, fsync, rename
        if self.file is not None:
            self.file.seek(0)
            self.file.write(shard_header(self.dtype, self.n))
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.file.name, self.path)
            self.shards.append({"file": self.path.name, "tokens": self.n})
            self.file = None  # (the next add() opens the next shard)


def encode_documents(enc, pieces, writers: dict, total_bytes: int) -> None:
    """tiktoken's threaded batch encoder over (split, text, source bytes read), into each split's
    ShardWriter, EOT between documents; ~ENCODE_BATCH_CHARS a call: memory holds one batch."""
    batch, size, start = [], 0, time.perf_counter()
    for piece in (p for ps in (pieces, [None]) for p in ps):  # None: the end, the last batch
        batch += [piece] if piece else []
        size += len(piece[1]) if piece else 0
        if piece and size < ENCODE_BATCH_CHARS:
            continue
        texts, threads = [text for _, text, _ in batch], os.cpu_count() or 1
        encoded = enc.encode_ordinary_batch(texts, num_threads=threads) if batch else []
        for (split, _, _), ids in zip(batch, encoded):
            if writers[split].docs:  # EOT between documents, none before a split's first
                writers[split].add(np.array([enc.eot_token]))
            writers[split].add(np.asarray(ids))
            writers[split].docs += 1
        done, batch, size = piece[2] if piece else total_bytes, [], 0
        progress("encode", done / 1e6, total_bytes / 1e6, start, unit=" MB")
    for w in writers.values():
        w.close()


def prepare(source, tokenizer, out_dir, val_fraction=0.05, block_size=1024, tokenizer_name=None,
            before_write=None, shard_tokens=SHARD_TOKENS, text_field="text", quality="none",
            dedup="exact") -> dict:  # fmt: skip
    """Stream `source` (files, a folder, a glob; .jsonl lines), cleaned, by `tokenizer` into shards
    of <= `shard_tokens` ids a split, in OUT/meta.json. Idempotent; atomic: shards are written
    beside OUT, its meta.json goes, they are renamed in, meta.json last. Bad input: one line."""
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    name = tokenizer_name or (tokenizer if isinstance(tokenizer, str) else type(tok).__name__)
    files, settings = source_files(source), dict(val_fraction=val_fraction, block_size=block_size)
    settings.update(shard_tokens=shard_tokens, text_field=text_field, quality=quality, dedup=dedup)
    stats = [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    merges = repr(getattr(tok, "merges", ""))  # the same name, other merges: other ids
    inputs = [stats, name, tok.n_vocab, merges, settings]
    fingerprint = hashlib.sha256(json.dumps(inputs).encode()).hexdigest()
    out, meta_path = Path(os.path.abspath(out_dir)), Path(out_dir) / "meta.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(f".{out.name}.lock"), "w") as lock:  # one preparation of OUT at a time
        fcntl.flock(lock, fcntl.LOCK_EX)  # (the second then finds the first's work done)
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        done = meta.get("fingerprint") == fingerprint  # and every shard still there:
        if done and all((out / f).exists() for f in meta["files"]):
            print(f"{out}: already prepared from the same inputs, nothing to do")
            (before_write or (lambda: None))()  # the inputs passed before (a tokenizer deleted?)
            return meta
        staging = out.with_name(f".{out.name}.partial")  # beside OUT: renames into it are atomic
        shutil.rmtree(staging, ignore_errors=True)  # an interrupted run's: redone from the start
        staging.mkdir()
        try:
            meta = write_shards(source, tok, files, staging, **settings)
            meta.update(tokenizer=name, fingerprint=fingerprint, **settings)
            (before_write or (lambda: None))()  # every check passed: the first write to OUT
            out.mkdir(exist_ok=True)
            meta_path.unlink(missing_ok=True)  # from here until the new one, OUT is "not prepared"
            for f in meta["files"]:
                os.replace(staging / f, out / f)
            fsync_dir(out)  # the renames reach the disk before meta.json says "done"
            atomic_write(meta_path, lambda tmp: tmp.write_text(json.dumps(meta, indent=1)))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    for old in (f for f in out.glob("*.bin") if f.name not in meta["files"]):
        old.unlink()  # a shard of an earlier preparation, no longer listed
    return meta


def write_shards(source, tok, files, staging, val_fraction, block_size, shard_tokens, text_field,
                 quality, dedup) -> dict:  # fmt: skip
    """Every document cleaned and encoded into shards in `staging`, then the checks of the text."""
    assert quality in QUALITY and dedup in DEDUP, f"quality {quality!r} or dedup {dedup!r} unknown"
    cut, skipped, seen, removed = val_cut(files, val_fraction), [], Counter(), Counter()
    dtype, deduper = np.uint16 if tok.n_vocab <= 1 << 16 else np.uint32, Deduplicator(dedup)
    writers = {split: ShardWriter(staging, split, dtype, shard_tokens) for split in SPLITS}

    def pieces():  # (split, text, source bytes read so far), counting documents on the way
        for doc in iter_documents(files, skipped, text_field):
            seen.update(documents=1, bytes=len(doc[2].encode()), text=bool(doc[2].strip()))
            broken = quality == "gopher" and gopher_rule_broken(doc[2])  # first: adds no keys
            if why := broken or (dedup != "none" and deduper.why_duplicate(doc[2])):
                removed[why] += 1  # (its bytes still count towards the val cut)
            else:
                yield from ((split, text, doc[1]) for split, text in split_document(doc, cut))

    enc = tok.to_tiktoken() if isinstance(tok, Tokenizer) else tok  # tiktoken's fast encoder
    encode_documents(enc, pieces(), writers, val_cut(files, 0.0))
    kept, lost = seen["documents"] - removed.total(), [f"{r} ({n:,})" for r, n in removed.items()]
    binary = f"; skipped {len(skipped)} of {len(files)} files as binary" if skipped else ""
    print(f"cleaning (--quality {quality}, --dedup {dedup}): kept {kept:,} of {seen['documents']:,}"
          f" documents; removed: {', '.join(lost) or 'none'}{binary}")  # fmt: skip
    if not seen["text"]:
        why = f"{len(skipped)} of {len(files)} files binary (NUL or not UTF-8)"
        why = why if skipped else "empty or whitespace only"
        raise ValueError(f"source {source!r} holds no text: {why}; nothing to tokenize")
    counts = {split: sum(s["tokens"] for s in w.shards) for split, w in writers.items()}
    for split, n in counts.items():
        if n < block_size + 1:
            few = f"{n} tokens, fewer than one block of {block_size}+1 ({kept:,} documents kept)"
            fix = "more text or --val-fraction, less cleaning, or a smaller --block-size"
            raise ValueError(f"the {split} split has {few}: {fix}")
    shards = {split: w.shards for split, w in writers.items()}
    meta = dict(vocab_size=tok.n_vocab, eot_token=tok.eot_token, source=source, shards=shards)
    meta.update(dtype=np.dtype(dtype).name, documents_in=seen["documents"], n_bytes=seen["bytes"])
    meta.update(documents_kept=kept, removed=dict(removed), train_tokens=counts["train"])
    meta.update(val_tokens=counts["val"])
    return meta | dict(files=[s["file"] for split in shards.values() for s in split])


# --- The loader: (x, y) = f(seed, step, dp_rank, dp_size), nothing else -----------------------
class DataLoader:
    """B windows of T+1 tokens per rank and step, from a split's memory-mapped shards (windows never
    cross one). Epoch e permutes all windows with seed (seed, e); step s takes the next dp_size*B,
    rank r its own B: a pure function of (seed, step, dp_rank, dp_size), resumable exactly."""

    def __init__(self, data_dir, split, batch_size, block_size, seed=0, dp_rank=0, dp_size=1,
                 device="cpu"):  # fmt: skip
        paths = split_shards(data_dir, split)
        assert 0 <= dp_rank < dp_size, f"dp_rank {dp_rank} outside dp_size {dp_size}"
        self.shards, self.B, self.T = [read_shard(p) for p in paths], batch_size, block_size
        self.seed, self.dp_rank, self.dp_size, self.device = seed, dp_rank, dp_size, device
        windows = [(len(shard) - 1) // block_size for shard in self.shards]
        self.first = np.cumsum([0, *windows])  # the first window of each shard, then the total
        self.n_windows, self._perm_epoch, self._perm = int(self.first[-1]), -1, None
        self.steps_per_epoch = self.n_windows // (dp_size * batch_size)
        if self.steps_per_epoch < 1:
            have = f"{paths[0].parent}/{split}: {len(paths)} shard(s) hold {self.n_windows} windows"
            need = f"one step needs dp_size*batch_size = {dp_size * batch_size}"
            raise ValueError(f"{have} of {block_size}+1 tokens, but {need}")

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
        windows = self.window_ids(step)
        shards = np.searchsorted(self.first, windows, side="right") - 1  # which shard holds each
        starts = (windows - self.first[shards]) * self.T  # and where, inside it
        rows = np.stack([self.shards[k][s : s + self.T + 1] for k, s in zip(shards, starts)])
        rows = rows.astype(np.int64)  # (B, T+1)
        x, y = torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])  # (B, T) each
        if cuda := torch.device(self.device).type == "cuda":  # pinned memory: an async copy
            x, y = x.pin_memory(), y.pin_memory()  # (B, T) each
        return x.to(self.device, non_blocking=cuda), y.to(self.device, non_blocking=cuda)


# --- The demo: each lesson printed with its check ---------------------------------------------
def main(argv=None) -> None:
    """Train a BPE (naive == incremental, ours == tiktoken), clean and write the shards, show two DP
    ranks' batches. Bad input: one line, --out untouched. Tokenizers compared: bench_data.py."""
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=formatter)
    arg = parser.add_argument
    arg("--source", default="stdlib", help="stdlib (Python's source), a file, folder or glob; "
        "a .jsonl file holds a document a line (--text-field)")  # fmt: skip
    arg("--tokenizer", default="bpe", help="bpe (trained here), gpt2, char or a .tiktoken")
    arg("--vocab-size", type=int, default=4096, help="BPE vocabulary; 4,096 trains in seconds")
    arg("--block-size", type=int, default=1024, help="GPT-2's context; each split needs one + 1")
    arg("--val-fraction", type=float, default=0.05, help="tail held out for validation")
    arg("--text-field", default="text", help="the field of each .jsonl line that holds the text")
    arg("--shard-tokens", type=int, default=SHARD_TOKENS, help="ids per shard file at most")
    arg("--bpe-sample-mb", type=float, default=16, help="train split's first MB the BPE learns on")
    arg("--quality", default="none", choices=QUALITY, help="gopher: web prose by Gopher's rules")
    arg("--dedup", default="exact", choices=DEDUP, help="exact copies; minhash: near ones too")
    arg("--out", help="output folder; data/SOURCE-TOKENIZER when not given")
    args = parser.parse_args(argv)
    small_vocab = args.tokenizer == "bpe" and args.vocab_size < 257  # 256 bytes + <|endoftext|>
    sizes = min(args.block_size, args.bpe_sample_mb) > 0 and args.shard_tokens > args.block_size
    if small_vocab or not sizes or not 0 < args.val_fraction < 1:
        parser.error("need --vocab-size >= 257 for bpe, 0 < --val-fraction < 1, sizes > 0 and "
                     "--shard-tokens > --block-size (a window never crosses a shard)")  # fmt: skip
    bpe = args.tokenizer == "bpe"  # (bad input fails in the try below: one line)
    label = f"bpe{args.vocab_size}" if bpe else Path(args.tokenizer).stem
    out = Path(args.out or f"data/{Path(args.source).stem}-{label}")
    try:
        tok = demo_bpe(source_files(args.source), args) if bpe else get_tokenizer(args.tokenizer)
        name = str(out / "tokenizer.tiktoken") if bpe else args.tokenizer
        save_tok = (lambda: tok.save(name)) if bpe else None  # by prepare, once the input passed
        meta = prepare(args.source, tok, out, args.val_fraction, args.block_size, name, save_tok,
                       args.shard_tokens, args.text_field, args.quality, args.dedup)  # fmt: skip
        for split, shards in meta["shards"].items():  # also when prepare found them done
            n, files = meta[split + "_tokens"], len(shards)
            print(f"  {out}/{split}_*.bin: {n:,} tokens in {files} shard(s)")
        loaders = [DataLoader(out, "train", 2, 8, seed=0, dp_rank=r, dp_size=2) for r in (0, 1)]
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # bad input: one line, no traceback
        raise SystemExit(f"01_data.py: error: {' '.join(str(e).splitlines())}") from None
    a, b = (set(ld.window_ids(0).tolist()) for ld in loaders)  # B = 2 windows of T = 8 each
    x, y = loaders[0].get_batch(0)  # (B, T) each
    rows = " | ".join(f"{tok.decode(row[:6].tolist())!r}" for row in (x[0], y[0]))
    print(f"loader, step 0, B=2, T=8: dp_rank 0 takes windows {a}, dp_rank 1 {b}, disjoint: "
          f"{not a & b}; x, y = {rows}; y is x shifted: {y[:, :-1].equal(x[:, 1:])}")  # fmt: skip


def demo_bpe(files, args) -> Tokenizer:
    """The BPE, learned on the train split's first --bpe-sample-mb (one pass that stops there)."""
    cut, texts, left = val_cut(files, args.val_fraction), [], int(args.bpe_sample_mb * 1e6)
    for doc in iter_documents(files, [], args.text_field):  # (prepare reports binaries, no text)
        texts.append("".join(t for split, t in split_document(doc, cut) if split == "train")[:left])
        left -= len(texts[-1])
        if left <= 0 or doc[1] >= cut:  # full, or the train split is over
            break
    text = EOT.join(texts)
    small, vocab, t0 = text[:80_000], min(args.vocab_size, 512), time.perf_counter()
    naive, t1 = train_bpe_naive(small, vocab), time.perf_counter()  # simple first: they agree
    same, t2 = train_bpe(small, vocab).merges == naive.merges, time.perf_counter()
    took = f"naive {t1 - t0:.2f} s, incremental {t2 - t1:.2f} s"
    print(f"BPE on {len(small) / 1e3:.0f} KB, vocab {vocab}: {took}, same merges: {same}")
    t0, tok = time.perf_counter(), train_bpe(text, args.vocab_size)
    piece = text[-200_000:]  # ours == tiktoken's Rust encoder holding the same merges
    same = tok.encode(piece) == tok.to_tiktoken().encode(piece, allowed_special="all")
    print(f"a {args.vocab_size}-token BPE on {len(text) / 1e6:.1f} MB of the train split: "
          f"{time.perf_counter() - t0:.1f} s; ours == tiktoken: {same}")  # fmt: skip
    return tok


if __name__ == "__main__":
    main()
