"""01 · Data: from text to tokens to batches.

A language model eats integers: learn a byte-level BPE vocabulary (the most frequent
adjacent pair becomes a new token, again and again), clean the documents, encode them
once into memory-mapped token shards, and cut (x, y) batches from them as a pure
function of the step. BPE (Sennrich et al. 2016; byte-level as GPT-2's) runs on the
"words" of GPT-2's pre-tokenization regex: no merge crosses a word or a special token.

    start:  every word is its UTF-8 bytes        "hug" -> [h, u, g]    vocab = 256 bytes
    repeat: (a, b) = the most frequent adjacent pair, counted over words x frequency
            vocab[256 + i] = vocab[a] + vocab[b];  replace every (a, b) by the new id
    ties:   among equal counts, the lexicographically greatest (bytes(a), bytes(b)) wins
    encode: in each word, merge the adjacent pair of lowest rank, and repeat

BPE is taught naive first (`train_bpe_naive` recounts every pair after each merge), then
incremental (`train_bpe`: a merge recounts only its words; a heap gives the next pair).

Clean data (as FineWeb, Penedo et al. 2024): --quality gopher keeps prose by Gopher's
rules (Rae et al. 2021). --dedup drops a document seen before: exact (the same text up
to case and spacing), or minhash (Broder 1997), near copies too; or --dedup lines drops
each line seen twice in the corpus (CCNet, Wenzek et al. 2019: pass 1 counts hashes).
For word 5-gram sets A and B, J = |A∩B|/|A∪B|; the least hash over A is the least over
B iff the least over A∪B is in A∩B: P = J. 112 hashes in 14 bands of 8 (LSH: a key a
band) make a candidate with P = 1 - (1 - J^8)^14: 92% at J = 0.8, 5% at 0.5 (the
S-curve's midpoint: (1/14)^(1/8) = 0.72). A candidate is a duplicate only when its share
of equal hashes, J's estimate, is >= --dedup-threshold (0.8). The first of a cluster
stays; ~1.9 KB a document (its signature and keys): ~25 GB for 10B tokens of prose.

Who holds what (nothing is distributed yet, except who reads which window):

    files, .jsonl --> clean --> encode (tiktoken) --> OUT/train_000000.bin ..., val_*
    each shard is [header | t0 ... t(n-1)] (np.memmap, n <= --shard-tokens), cut into
    windows of T+1 tokens at stride T that never cross a shard, W of them in all:
        \\_window_/\\_window_/ ...
    step s, epoch e = s // steps_per_epoch:  perm_e = permutation(W, seed=(seed, e)),
    computed a window at a time, never stored (a Feistel network: support/shuffle.py)
        dp_rank 0 -> perm_e[k*dp*B + 0*B : ... + B]    x = window[:-1], y = window[1:]
        dp_rank 1 -> perm_e[k*dp*B + 1*B : ... + B]    (disjoint from rank 0's)

Launch: `python 01_data.py` (a 4,096-token BPE on the standard library's source, shards
in data/; --source FILES.jsonl for a real corpus; timings: bench/bench_data.py). The
plumbing is in support/ (sources, files, token_files, progress, dedup_store, shuffle,
data_flags). Left out on purpose: Unicode normalisation, fast trainers, packing masks,
language ID, URL and repetition filters.
"""

import hashlib
import heapq
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import regex
import tiktoken
import torch

from support import data_flags, dedup_store, progress, shuffle, sources, token_files
from support import files as files_lib
from support.files import atomic_write, fsync_dir  # noqa: F401 - callers use data.*
from support.sources import split_document, val_cut

# A shard is a header of four int64s (magic, version, bytes per id, number of ids), then
# the ids: support/token_files.py writes and memory-maps it.
from support.token_files import SHARD_MAGIC, read_shard, shard_header  # noqa: F401

# GPT-2's pre-tokenization, as tiktoken's: 's 't 're 've 'm 'll 'd, ?letters, ?digits,
# ?other symbols, trailing whitespace, whitespace before a space, a single whitespace.
GPT2_SPLIT_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++"""
    r"""|\s++$|\s+(?!\S)|\s"""
)
EOT = "<|endoftext|>"
SPLITS = ("train", "val")
# Ids per shard at most, as llm.c and build-nanogpt: 200 MB in uint16.
SHARD_TOKENS = 100_000_000


# --- BPE training: the naive trainer, then the incremental one ------------------------
def _special_splitter(specials):
    """Cuts text at special tokens, longest first (one never hides another)."""
    alternatives = "|".join(map(regex.escape, sorted(specials, key=len, reverse=True)))
    return regex.compile(f"({alternatives or '(?!)'})")  # (?!) never matches.


def _pretokenize(text: str, specials) -> tuple[list[list[int]], list[int]]:
    """Each distinct pre-token once, as its bytes, with its frequency. Special tokens
    are cut out first, so no merge ever crosses or enters one."""
    pattern = regex.compile(GPT2_SPLIT_PATTERN)
    counts = Counter()
    for part in _special_splitter(specials).split(text):
        if part not in specials:
            counts.update(pattern.findall(part))
    return [list(w.encode("utf-8")) for w in counts], list(counts.values())


def merge(ids: list[int], a: int, b: int, new_id: int) -> list[int]:
    """Replace each (a, b) in `ids` by `new_id`, left to right: "aaa" -> [aa, a]."""
    out = []
    i = 0
    while i < len(ids):
        if i + 1 < len(ids) and ids[i] == a and ids[i + 1] == b:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def train_bpe_naive(text: str, vocab_size: int, special_tokens=(EOT,)) -> "Tokenizer":
    """The simple version (minbpe's BasicTokenizer, on GPT-2's pre-tokens): after every
    merge, recount every pair of every word. Each merge costs a pass over the corpus."""
    specials = list(special_tokens)
    too_small = f"vocab_size {vocab_size} < 256 bytes + {len(specials)} specials"
    assert vocab_size >= 256 + len(specials), too_small
    words, freqs = _pretokenize(text, specials)
    vocab = {i: bytes([i]) for i in range(256)}
    merges = []
    for new_id in range(256, vocab_size - len(specials)):
        counts = Counter()
        for word, f in zip(words, freqs):
            for pair in zip(word, word[1:]):
                counts[pair] += f
        if not counts:
            break  # Every word is one token: nothing is left to merge.
        # The most frequent pair; among equals, the greatest bytes win.
        a, b = max(counts, key=lambda p: (counts[p], vocab[p[0]], vocab[p[1]]))
        vocab[new_id] = vocab[a] + vocab[b]
        merges.append((vocab[a], vocab[b]))
        words = [merge(word, a, b, new_id) for word in words]
    return Tokenizer(vocab, merges, specials)


def _tie_key(token: bytes) -> tuple:
    """A min-heap pops the smallest key, and ties must go to the greatest bytes: so
    each byte x becomes 256 - x, and an end marker 257 makes a prefix sort after."""
    return tuple(256 - x for x in token) + (257,)


def train_bpe(text: str, vocab_size: int, special_tokens=(EOT,)) -> "Tokenizer":
    """`train_bpe_naive`'s merges, with the pair counts updated incrementally: a merge
    touches only the words that contain its pair (`where`), and the next pair comes
    from a lazy max-heap (an entry whose count moved is skipped when popped)."""
    specials = list(special_tokens)
    n_merges = vocab_size - 256 - len(specials)
    too_small = f"vocab_size {vocab_size} < 256 bytes + {len(specials)} specials"
    assert n_merges >= 0, too_small
    words, freqs = _pretokenize(text, specials)
    vocab = {i: bytes([i]) for i in range(256)}
    keys = {i: _tie_key(vocab[i]) for i in range(256)}
    pair_counts = Counter()
    where = {}  # A pair -> the ids of the words that contain it.
    for w, (word, f) in enumerate(zip(words, freqs)):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += f
            where.setdefault(pair, set()).add(w)
    heap = [(-c, keys[p[0]] + keys[p[1]], p) for p, c in pair_counts.items()]
    heapq.heapify(heap)
    merges = []  # (bytes of a, bytes of b), in merge order.
    while len(merges) < n_merges and heap:
        neg_count, _, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg_count:
            continue  # A stale heap entry: this pair's count has moved since.
        new_id = 256 + len(merges)
        vocab[new_id] = vocab[pair[0]] + vocab[pair[1]]
        keys[new_id] = _tie_key(vocab[new_id])
        merges.append((vocab[pair[0]], vocab[pair[1]]))
        for p in _apply_merge(pair, new_id, words, freqs, pair_counts, where):
            if pair_counts[p] > 0:
                heapq.heappush(heap, (-pair_counts[p], keys[p[0]] + keys[p[1]], p))
            else:
                del pair_counts[p]
    return Tokenizer(vocab, merges, specials)


def _apply_merge(pair, new_id, words, freqs, pair_counts, where) -> set:
    """Replace `pair` by `new_id` in every word that has it; return the pairs whose
    count moved."""
    changed = set()
    for w in where.pop(pair):
        word = words[w]
        merged = merge(word, *pair, new_id)
        if len(merged) == len(word):
            continue  # A stale entry: an earlier merge already took this occurrence.
        for p in zip(word, word[1:]):
            pair_counts[p] -= freqs[w]
            changed.add(p)
        for p in zip(merged, merged[1:]):
            pair_counts[p] += freqs[w]
            where.setdefault(p, set()).add(w)
            changed.add(p)
        words[w] = merged
    changed.discard(pair)
    pair_counts.pop(pair, None)  # Every occurrence of the pair is gone.
    return changed


# --- Tokenizers: our BPE, bytes ("char") and GPT-2 (tiktoken), with one interface -----
class Tokenizer:
    """Byte-level BPE whose pure-Python encoder gives exactly tiktoken's ids. `vocab`:
    id -> bytes, the 256 single bytes included (an id is also the merge's rank);
    `merges`: the pairs, in merge order."""

    def __init__(self, vocab: dict[int, bytes], merges: list, special_tokens=None):
        self.vocab = dict(vocab)
        self.merges = list(merges)
        specials = list(special_tokens or [])
        as_bytes = {s.encode("utf-8") for s in specials}
        self.ranks = {b: i for i, b in self.vocab.items() if b not in as_bytes}
        assert all(bytes([x]) in self.ranks for x in range(256)), "a byte has no token"
        for a, b in self.merges:
            assert a + b in self.ranks, f"merge {a!r} + {b!r} has no token in the vocab"
        assert not any(regex.search(r"\s", s) for s in specials), "a special's space"
        self.special_tokens = {}
        for s in specials:
            # A special keeps its id in the vocab, or is appended after the last id.
            ids = [j for j, b in self.vocab.items() if b == s.encode()]
            i = ids[0] if ids else max(self.vocab) + 1
            self.vocab[i] = s.encode()
            self.special_tokens[s] = i
        self.n_vocab = max(self.vocab) + 1
        self._pattern = regex.compile(GPT2_SPLIT_PATTERN)
        self._splitter = _special_splitter(self.special_tokens)
        # Where encode_iterable may cut: a lone whitespace between non-spaces, the last
        # one first ((?r) searches backwards).
        self._cut = regex.compile(r"(?r)(?<=\S)\s(?=\S)")
        self._cache: dict[bytes, list[int]] = {}

    @property
    def eot_token(self) -> int:
        assert EOT in self.special_tokens, f"this tokenizer has no {EOT} special token"
        return self.special_tokens[EOT]

    def _bpe(self, word: bytes) -> list[int]:
        """BPE on one pre-token: merge the adjacent pair of lowest rank, and repeat."""
        if word in self._cache:
            return self._cache[word]
        parts = [bytes([x]) for x in word]
        while len(parts) > 1:
            # A pair that is no token ranks n_vocab, after every real one.
            pairs = zip(parts, parts[1:])
            ranks = [self.ranks.get(a + b, self.n_vocab) for a, b in pairs]
            if min(ranks) == self.n_vocab:
                break
            i = ranks.index(min(ranks))  # The leftmost of equal pairs, as tiktoken.
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        if len(self._cache) > 100_000:
            self._cache.clear()  # Bounded memory for encode_iterable on huge streams.
        self._cache[word] = [self.ranks[p] for p in parts]
        return self._cache[word]

    def encode_ordinary(self, text: str) -> list[int]:
        """Encode, treating special-token text as ordinary text."""
        ids = []
        for word in self._pattern.findall(text):
            ids.extend(self._bpe(word.encode("utf-8")))
        return ids

    def encode(self, text: str) -> list[int]:
        """Encode; special tokens in the text become their ids, as tiktoken's "all"."""
        ids = []
        for part in self._splitter.split(text):
            special = self.special_tokens.get(part)
            if special is None:
                ids.extend(self.encode_ordinary(part))
            else:
                ids.append(special)
        return ids

    def encode_iterable(self, chunks):
        """`encode("".join(chunks))`, streamed: cut before a lone whitespace between
        non-spaces (" x", "\\nx"), which no pre-token crosses or looks past (specials
        hold none). Memory: 64K characters and the text since such a place."""
        buf = ""
        for chunk in chunks:
            new = max(0, len(buf) - 1)  # Search from here on: linear time in all.
            buf = buf + chunk
            if len(buf) < 1 << 16:
                continue
            cut = self._cut.search(buf, new)  # The last such place.
            if cut:
                yield from self.encode(buf[: cut.start()])
                buf = buf[cut.start() :]
        yield from self.encode(buf)

    def decode(self, ids) -> str:
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")

    def to_tiktoken(self, name: str = "bpe") -> tiktoken.Encoding:
        """The same ranks in tiktoken's Rust encoder (hundreds of times faster)."""
        return tiktoken.Encoding(
            name,
            pat_str=GPT2_SPLIT_PATTERN,
            mergeable_ranks=self.ranks,
            special_tokens=self.special_tokens,
        )

    def save(self, path) -> Path:
        """Write X.tiktoken (tiktoken's rank format) and X.json (specials, merges)."""
        args = (self.ranks, self.merges, self.special_tokens, GPT2_SPLIT_PATTERN)
        return token_files.save_bpe(path, *args)

    @classmethod
    def load(cls, path) -> "Tokenizer":
        """The tokenizer that Tokenizer.save wrote to X.tiktoken and X.json."""
        return cls(*token_files.load_bpe(path))


class CharTokenizer(Tokenizer):
    """A BPE with no merges: one token per UTF-8 byte, <|endoftext|> as id 256."""

    def __init__(self):
        super().__init__({i: bytes([i]) for i in range(256)}, [], [EOT])


def get_tokenizer(name: str):
    """ "gpt2" (tiktoken), "char", or the path of a tokenizer Tokenizer.save wrote."""
    if name == "char":
        return CharTokenizer()
    if name != "gpt2" and Path(name).with_suffix(".tiktoken").is_file():
        return Tokenizer.load(name)
    if name != "gpt2":
        allowed = "use 'gpt2', 'char' or a saved BPE's path"
        raise ValueError(f"unknown tokenizer {name!r}: {allowed}")
    return token_files.gpt2_encoding()  # tiktoken's, or one line that says what to do.


# --- Clean data: quality rules, then duplicates (exact, then near: MinHash, LSH) ----
STOP_WORDS = "the|be|to|of|and|that|have|with"  # Gopher's eight: prose has them.
WORD = regex.compile(r"\w+")  # A word tokenizer's cuts: words, then symbol runs.
SYMBOLS = regex.compile(r"[^\w\s]+")
LETTERED = regex.compile(r"\w*\p{L}\w*")
STOP = regex.compile(rf"\b(?:{STOP_WORDS})\b", regex.I)
QUALITY = ("none", "gopher")  # The choices of --quality.
DEDUP = ("none", "exact", "minhash", "lines")  # The choices of --dedup.
LINE = regex.compile(r"[^\n]*\n|[^\n]+")  # A line and its newline, as a file gives it.


def gopher_rule_broken(text: str) -> str | None:
    """The first Gopher rule (Rae et al. 2021; FineWeb's thresholds) `text` breaks, or
    None. Each rule's comment says what it removes: too few, then too many."""
    words = WORD.findall(text)  # Regexes run at C speed: no Python loop per character.
    lines = text.splitlines() or [""]
    n_words = max(1, len(words) + len(SYMBOLS.findall(text)))  # FineWeb counts runs.
    mean = len("".join(words)) / max(1, len(words))
    dots = text.count("...") + text.count("…")
    bullets = sum(s.lstrip().startswith(("•", "-")) for s in lines) / len(lines)
    trailing_dots = sum(s.rstrip().endswith(("...", "…")) for s in lines) / len(lines)
    lettered = len(LETTERED.findall(text))
    rules = {  # Each rule, and in its comment what it removes (too few; too many).
        "words not 50 to 100,000": not 50 <= len(words) <= 100_000,  # Fragments; logs.
        "mean word not 3 to 10 characters": not 3 <= mean <= 10,  # Numbers; URLs.
        "'#' over 0.1 a word": text.count("#") / n_words > 0.1,  # Hashtag spam.
        "'...' over 0.1 a word": dots / n_words > 0.1,  # Teasers.
        "bullet lines over 90%": bullets > 0.9,  # Lists.
        "'...' line ends over 30%": trailing_dots > 0.3,  # Teasers again.
        "alphabetic words under 80%": lettered / n_words < 0.8,  # Tables, code.
        "under 2 stop words": len(STOP.findall(text)) < 2,  # Not English prose.
    }
    return next((why for why, broken in rules.items() if broken), None)


def _digest(raw: bytes) -> bytes:
    return hashlib.blake2b(raw, digest_size=8).digest()


class Deduplicator:
    """--dedup exact: one key a text (its digest, up to case and spacing) in a set (~75 B).
    minhash adds its signature and a key per band (support/dedup_store.py: ~1.9 KB a text).
    lines: two passes, `count_lines` over the corpus first (a dict of 64-bit line hashes,
    ~100 B a distinct line), then `unique_lines` keeps each text's lines counted once."""

    def __init__(self, mode: str, threshold=0.8, hashes=112, bands=14, ngram=5):
        assert hashes % bands == 0, f"{hashes} hashes do not split in {bands} bands"
        # Fixed integers (splitmix64, not a NumPy Generator's stream, which may change
        # between versions): the same removals everywhere. a is odd, so a·s mod 2^64 is
        # one-to-one. Each has shape (hashes, 1).
        self.a = shuffle.splitmix64(SHARD_MAGIC, 0, hashes)[:, None] | np.uint64(1)
        self.b = shuffle.splitmix64(SHARD_MAGIC, 1, hashes)[:, None]
        self.mode = mode
        self.threshold = threshold
        self.bands = bands
        # A band is `rows` consecutive hashes of a signature.
        self.rows = hashes // bands
        self.ngram = ngram
        self.exact = set()
        self.store = dedup_store.SignatureStore(hashes)
        self.line_counts = {}

    def ngram_hashes(self, text: str) -> np.ndarray:
        """(k,): a 64-bit hash of each of the text's k lowercase word n-grams, in order. A
        word is hashed by crc32 (hash() varies by process), an n-gram as a polynomial of
        its words' hashes, base 2^64/φ (odd)."""
        crcs = [zlib.crc32(w.encode()) for w in WORD.findall(text.lower())]
        words = np.array(crcs, np.uint64)
        k = max(0, len(words) - self.ngram + 1)
        hashes = words[:k].copy()
        for i in range(1, self.ngram):
            hashes = hashes * np.uint64(0x9E3779B97F4A7C15) + words[i : i + k]
        return hashes

    def minhash(self, text: str) -> np.ndarray | None:
        """(hashes,): entry i = min over the n-gram hashes s of (a_i·s + b_i) >> 32,
        multiply-shift mod 2^64. None: the text has under n words."""
        shingles = self.ngram_hashes(text)
        if len(shingles) == 0:  # Only the exact key, or all such texts would match.
            return None
        sig = np.full(len(self.a), np.iinfo(np.uint64).max, np.uint64)
        for c in range(0, len(shingles), 4096):  # (hashes, 4,096) at a time.
            hashed = self.a * shingles[c : c + 4096] + self.b
            sig = np.minimum(sig, hashed.min(1))
        # The top 32 bits are the well-mixed ones, and min(x >> 32) = min(x) >> 32.
        return (sig >> 32).astype(np.uint32)

    def band_keys(self, sig: np.ndarray) -> list[bytes]:
        """A key per band of `rows` hashes, its index in front: band 2 never meets 5."""
        bands = sig.reshape(self.bands, self.rows)
        return [_digest(bytes([i]) + band.tobytes()) for i, band in enumerate(bands)]

    def why_duplicate(self, text: str) -> str | None:
        """What duplicate `text` is, or None. A shared band key makes a candidate; it is a
        near duplicate when the share of equal hashes (an estimate of the Jaccard
        similarity) is >= threshold. Kept either way, so a chain of near copies goes."""
        key = _digest(" ".join(text.lower().split()).encode())
        if key in self.exact:
            return "exact duplicate"
        self.exact.add(key)
        sig = self.minhash(text) if self.mode == "minhash" else None
        if sig is None:
            return None
        keys = self.band_keys(sig)
        docs = self.store.candidates(keys)
        similar = (self.store.sigs[docs] == sig).mean(1).max() if docs else 0.0
        self.store.add(sig, keys)
        return "near duplicate" if similar >= self.threshold else None

    def count_lines(self, texts) -> None:
        """Pass 1 of --dedup lines: count each line over the corpus (capped at 2)."""
        for text in texts:
            for line in LINE.findall(text):
                key = hash(line)  # 64 bits; salted per process: both passes run here.
                self.line_counts[key] = 2 if key in self.line_counts else 1

    def unique_lines(self, text: str, seen: Counter) -> str:
        """Pass 2: the text without its lines seen twice in the corpus, first copy too."""
        lines = LINE.findall(text)
        kept = [line for line in lines if self.line_counts[hash(line)] == 1]
        seen["duplicate lines"] += len(lines) - len(kept)
        return "".join(kept)


# --- Prepare: documents -> cleaned -> token shards on disk ----------------------------
def prepare(
    source,
    tokenizer,
    out_dir,
    val_fraction=0.05,
    block_size=1024,
    tokenizer_name=None,
    before_write=None,
    shard_tokens=SHARD_TOKENS,
    text_field="text",
    quality="none",
    dedup="exact",
    dedup_threshold=0.8,
) -> dict:
    """Stream `source` (files, a folder, a glob; .jsonl lines), cleaned, by `tokenizer`
    into shards of <= `shard_tokens` ids a split, in OUT/meta.json; idempotent, atomic.
    Bad input: one line, OUT untouched; `before_write()` runs before OUT is written."""
    named = isinstance(tokenizer, str)
    tok = get_tokenizer(tokenizer) if named else tokenizer
    name = tokenizer_name or (tokenizer if named else type(tok).__name__)
    files = sources.source_files(source)
    settings = dict(val_fraction=val_fraction, block_size=block_size)
    settings.update(shard_tokens=shard_tokens, text_field=text_field)
    settings.update(quality=quality, dedup=dedup, dedup_threshold=dedup_threshold)
    assert quality in QUALITY, f"quality {quality!r} unknown"
    assert dedup in DEDUP, f"dedup {dedup!r} unknown"
    merges = repr(getattr(tok, "merges", ""))  # The same name, other merges: other ids.
    inputs = [files_lib.file_stats(files), name, tok.n_vocab, merges, settings]

    def build(stage):
        meta = write_shards(source, tok, files, stage, settings)
        return dict(meta, tokenizer=name, **settings)

    return files_lib.build_once(out_dir, inputs, build, before_write, "*.bin")


def clean(docs, quality: str, deduper: Deduplicator, seen: Counter, removed: Counter):
    """The documents that pass the quality rules and are no duplicates. `seen` counts
    every document (and its bytes), `removed` the others, by reason."""
    for start, end, text, whole in docs:
        seen.update(documents=1, bytes=len(text.encode()), text=bool(text.strip()))
        why = None
        if deduper.mode == "lines":  # As CCNet: lines first; the rules judge the rest.
            had_text = bool(text.strip())
            text = deduper.unique_lines(text, seen)
            why = had_text and not text.strip() and "every line a duplicate"
        # The quality rules go before the document keys: a text they remove adds none.
        why = why or (quality == "gopher" and gopher_rule_broken(text))
        if not why and deduper.mode in ("exact", "minhash"):
            why = deduper.why_duplicate(text)
        if why:
            removed[why] += 1  # Its bytes still count towards the val cut.
        else:
            yield start, end, text, whole


def write_shards(source, tok, files, stage, settings: dict) -> dict:
    """Every document cleaned and encoded into shards in `stage`; then the checks that
    there was text and that each split holds a block. Returns meta.json's fields."""
    cut = val_cut(files, settings["val_fraction"])
    total = val_cut(files, 0.0)  # The source's text bytes, for the progress line.
    skipped = []  # The binary files go here.
    seen = Counter()
    removed = Counter()
    deduper = Deduplicator(settings["dedup"], settings["dedup_threshold"])
    if settings["dedup"] == "lines":  # Pass 1 of 2: count every line of the corpus.
        again = sources.iter_documents(files, [], settings["text_field"])
        deduper.count_lines(text for _, _, text, _ in again)
    docs = sources.iter_documents(files, skipped, settings["text_field"])
    docs = clean(docs, settings["quality"], deduper, seen, removed)

    def pieces():  # Yields (split, text, the source's bytes read so far).
        for doc in docs:
            for split, text in split_document(doc, cut):
                yield split, text, doc[1]

    enc = tok.to_tiktoken() if isinstance(tok, Tokenizer) else tok  # The fast encoder.
    dtype = np.uint16 if tok.n_vocab <= 1 << 16 else np.uint32  # GPT-2's ids: 16 bits.
    writers = token_files.writers(stage, SPLITS, dtype, settings["shard_tokens"])
    token_files.encode_documents(enc, pieces(), writers, total)
    kept = seen["documents"] - removed.total()
    flags = f"--quality {settings['quality']}, --dedup {settings['dedup']}"
    progress.report_cleaning(flags, seen, removed, len(skipped), len(files))
    sources.check_some_text(source, files, skipped, seen["text"])
    meta = token_files.splits_meta(writers, settings["block_size"], kept)
    meta.update(vocab_size=tok.n_vocab, eot_token=tok.eot_token, source=source)
    meta.update(n_bytes=seen["bytes"], documents_in=seen["documents"])
    meta["documents_kept"] = kept
    meta["removed"] = dict(removed)  # Documents, by reason.
    meta["duplicate_lines_removed"] = seen["duplicate lines"]  # --dedup lines only.
    return meta


# --- The loader: (x, y) = f(seed, step, dp_rank, dp_size), nothing else ---------------
class DataLoader:
    """B windows of T+1 tokens per rank and step from a split's shards (none crosses a
    shard). Epoch e permutes all windows with seed (seed, e); step s takes the next
    dp_size*B, rank r its own B: a pure function of (seed, step, dp_rank, dp_size)."""

    def __init__(
        self,
        data_dir,
        split,
        batch_size,
        block_size,
        seed=0,
        dp_rank=0,
        dp_size=1,
        device="cpu",
    ):
        paths = token_files.listed_shards(data_dir, split)
        assert 0 <= dp_rank < dp_size, f"dp_rank {dp_rank} outside dp_size {dp_size}"
        self.shards = [read_shard(p) for p in paths]
        self.B = batch_size
        self.T = block_size
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.device = device
        windows = [(len(shard) - 1) // block_size for shard in self.shards]
        # The first window of each shard, then the total.
        self.first = np.cumsum([0, *windows])
        self.n_windows = int(self.first[-1])
        self.steps_per_epoch = self.n_windows // (dp_size * batch_size)
        if self.steps_per_epoch < 1:
            where = f"{paths[0].parent}/{split}: {len(paths)} shard(s)"
            have = f"{where} hold {self.n_windows} windows of {block_size}+1 tokens"
            need = f"one step needs dp_size*batch_size = {dp_size * batch_size}"
            raise ValueError(f"{have}, but {need}")

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, step within the epoch): the data position a checkpoint records."""
        return divmod(step, self.steps_per_epoch)

    def window_ids(self, step: int) -> np.ndarray:
        """The B windows this rank reads at `step`."""
        epoch, k = self.position(step)
        first = (k * self.dp_size + self.dp_rank) * self.B
        # perm_e[first : first + B], computed, not stored: a stored permutation of all W
        # windows grows with the corpus (support/shuffle.py: a Feistel network).
        positions = np.arange(first, first + self.B)
        return shuffle.shuffled(positions, self.n_windows, self.seed, epoch)

    def get_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        windows = self.window_ids(step)
        # Which shard holds each window, and where inside it the window starts.
        shards = np.searchsorted(self.first, windows, side="right") - 1
        starts = (windows - self.first[shards]) * self.T
        rows = [self.shards[k][s : s + self.T + 1] for k, s in zip(shards, starts)]
        rows = np.stack(rows).astype(np.int64)  # (B, T+1)
        x = torch.from_numpy(rows[:, :-1])  # (B, T)
        y = torch.from_numpy(rows[:, 1:])  # (B, T): x shifted by one.
        cuda = torch.device(self.device).type == "cuda"
        if cuda:  # Pinned memory lets the copy to the GPU run asynchronously.
            x = x.pin_memory()
            y = y.pin_memory()
        x = x.to(self.device, non_blocking=cuda)
        return x, y.to(self.device, non_blocking=cuda)


# --- The demo: each lesson printed with its check -------------------------------------
def main(argv=None) -> None:
    """Train a BPE (naive == incremental, ours == tiktoken), clean and write the shards,
    show two DP ranks' batches. Bad input: one line, and --out untouched."""
    description = __doc__.split("\n")[0]
    args = data_flags.parse_args(argv, description, SHARD_TOKENS, QUALITY, DEDUP)
    bpe = args.tokenizer == "bpe"
    label = f"bpe{args.vocab_size}" if bpe else Path(args.tokenizer).stem
    out = Path(args.out or f"data/{Path(args.source).stem}-{label}")
    try:  # Bad input fails here with one line, and no traceback.
        if bpe:
            tok = demo_bpe(sources.source_files(args.source), args)
            name = str(out / "tokenizer.tiktoken")
        else:
            tok = get_tokenizer(args.tokenizer)
            name = args.tokenizer
        save = (lambda: tok.save(name)) if bpe else None  # Runs once checks pass.
        flags = "val_fraction block_size shard_tokens text_field quality dedup"
        flags += " dedup_threshold"
        options = {key: getattr(args, key) for key in flags.split()}  # Passed as is.
        options.update(tokenizer_name=name, before_write=save)
        meta = prepare(args.source, tok, out, **options)
        for split, shards in meta["shards"].items():  # Also when the work was done.
            n = meta[split + "_tokens"]
            print(f"  {out}/{split}_*.bin: {n:,} tokens in {len(shards)} shard(s)")
        loaders = [DataLoader(out, "train", 2, 8, 0, rank, 2) for rank in (0, 1)]
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        one_line = " ".join(str(e).splitlines())
        raise SystemExit(f"01_data.py: error: {one_line}") from None
    demo_loader(loaders, tok)


def demo_loader(loaders, tok) -> None:
    """Step 0 of two DP ranks, B = 2 windows of T = 8 tokens each."""
    mine = set(loaders[0].window_ids(0).tolist())
    theirs = set(loaders[1].window_ids(0).tolist())
    x, y = loaders[0].get_batch(0)  # (B, T) each
    rows = " | ".join(f"{tok.decode(row[:6].tolist())!r}" for row in (x[0], y[0]))
    shifted = y[:, :-1].equal(x[:, 1:])
    ranks = f"dp_rank 0 takes windows {mine}, dp_rank 1 {theirs}"
    print(f"loader, step 0, B=2, T=8: {ranks}, disjoint: {not mine & theirs}; ", end="")
    print(f"x, y = {rows}; y is x shifted: {shifted}")


def demo_bpe(files, args) -> Tokenizer:
    """The BPE, learned on the train split's first --bpe-sample-mb (one pass that stops
    there): first naive against incremental on a small piece, then the real one."""
    most = int(args.bpe_sample_mb * 1e6)
    texts = sources.train_head(files, args.val_fraction, most, args.text_field)
    text = EOT.join(texts)
    small = text[:80_000]
    vocab = min(args.vocab_size, 512)
    t0 = time.perf_counter()
    naive = train_bpe_naive(small, vocab)  # Simple first: the two must agree.
    t1 = time.perf_counter()
    same = train_bpe(small, vocab).merges == naive.merges
    t2 = time.perf_counter()
    took = f"naive {t1 - t0:.2f} s, incremental {t2 - t1:.2f} s"
    size = f"{len(small) / 1e3:.0f}K characters"  # The encoder's MB are bytes.
    print(f"BPE on {size}, vocab {vocab}: {took}, same merges: {same}")
    t0 = time.perf_counter()
    tok = train_bpe(text, args.vocab_size)
    took = time.perf_counter() - t0
    # Ours against tiktoken's Rust encoder holding the same merges.
    piece = text[-200_000:]
    same = tok.encode(piece) == tok.to_tiktoken().encode(piece, allowed_special="all")
    size = f"{len(text) / 1e6:.1f}M characters of the train split"
    print(f"a {args.vocab_size}-token BPE on {size}: {took:.1f} s; ", end="")
    print(f"ours == tiktoken: {same}")
    return tok


if __name__ == "__main__":
    main()
