"""01 · Data: from text to tokens to batches.

A language model eats integers: learn a byte-level BPE vocabulary (the most frequent
adjacent pair becomes a new token, again and again), encode the documents once into
memory-mapped token shards, and cut (x, y) batches from them as a pure function of the
step. BPE (Sennrich et al. 2016; byte-level as GPT-2's) runs on the "words" of GPT-2's
pre-tokenization regex: no merge crosses a word or a special token.

    start:  every word is its UTF-8 bytes        "hug" -> [h, u, g]    vocab = 256 bytes
    repeat: (a, b) = the most frequent adjacent pair, counted over words x frequency
            vocab[256 + i] = vocab[a] + vocab[b];  replace every (a, b) by the new id
    ties:   among equal counts, the lexicographically greatest (bytes(a), bytes(b)) wins
    encode: in each word, merge the adjacent pair of lowest rank, and repeat

BPE is taught naive first (`train_bpe_naive` recounts every pair after each merge), then
incremental (`train_bpe`: a merge recounts only its words; a heap gives the next pair).

Who holds what (nothing is distributed yet, except who reads which window):

    files, .jsonl --> (01b: clean) --> encode (tiktoken) --> OUT/train_000000.bin ...
    each shard is [header | t0 ... t(n-1)] (np.memmap, n <= --shard-tokens), cut into
    windows of T+1 tokens at stride T that never cross a shard, W of them in all:
        \\_window_/\\_window_/ ...
    step s, epoch e = s // steps_per_epoch:  perm_e = permutation(W, key=(seed, e))
        dp_rank 0 -> perm_e[k*dp*B + 0*B : ... + B]    x = window[:-1], y = window[1:]
        dp_rank 1 -> perm_e[k*dp*B + 1*B : ... + B]    (disjoint from rank 0's)

perm_e is computed a position at a time, never stored (a stored permutation of every
window grows with the corpus: 2.5 GB for 10B tokens at T = 32). A Feistel network (Luby
and Rackoff 1988) on x = (L, R), h bits each, 4^h >= W, is a bijection of range(4^h)
whatever its round function F:  (L, R) -> (R, L xor F_k(R)), undone by its mirror;
cycle-walking (apply it again while the value is >= W) makes it one of range(W).

Launch: `python 01_data.py` (a 4,096-token BPE on the standard library's source, shards
in data/; --source FILES.jsonl for a real corpus; timings: bench/bench_data.py). It keeps
every document: `prepare(..., cleaner=None)`. 01b_cleaning.py passes its cleaner, so
`python 01b_cleaning.py --dedup minhash` is this pipeline, cleaned, in one command; the
`prepare` that cleans (--dedup, --quality) is `01b_cleaning.prepare`. Plumbing: support/data/
(sources, token_files, splitmix, data_flags) and support/files. Left out on purpose:
cleaning (01b), Unicode normalisation, fast trainers, packing masks.
"""

import heapq
import time
from collections import Counter
from pathlib import Path

import numpy as np
import regex
import tiktoken
import torch

from support import files as files_lib
from support.data import data_flags, sources, splitmix, token_files
from support.data.sources import split_document, val_cut

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


# --- Token shards: a header, then the ids, read back as a memory map ------------------
SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 4  # magic, version, bytes per id, number of ids: four int64s.


def shard_header(dtype, n: int) -> bytes:
    """Four int64s: magic, version, bytes per id (2: uint16, 4: uint32), id count."""
    fields = [SHARD_MAGIC, SHARD_VERSION, np.dtype(dtype).itemsize, n]
    return np.array(fields, np.int64).tobytes()


def read_shard(path) -> np.ndarray:
    """Memory-map a shard: its ids are read from disk only when a batch needs them."""
    header = np.fromfile(path, np.int64, count=HEADER_INTS)
    ours = len(header) == HEADER_INTS and header[0] == SHARD_MAGIC
    not_ours = f"{path} is not a token shard of version {SHARD_VERSION}"
    assert ours and header[1] == SHARD_VERSION, not_ours
    dtype = {2: np.uint16, 4: np.uint32}[int(header[2])]
    n = int(header[3])
    return np.memmap(path, dtype, mode="r", offset=HEADER_INTS * 8, shape=(n,))


# --- Prepare: documents -> (a cleaner's choice) -> token shards on disk ---------------
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
    cleaner=None,
) -> dict:
    """Stream `source` (files, a folder, a glob; .jsonl lines) by `tokenizer` into shards
    of <= `shard_tokens` ids a split, in OUT/meta.json; idempotent, atomic. `cleaner`
    (01b_cleaning's: `.settings`, `.clean(docs, read_again)`, `.report(seen)`) picks the
    documents; None keeps all. Bad input: one line, OUT untouched; `before_write()` runs
    before OUT is written."""
    named = isinstance(tokenizer, str)
    tok = get_tokenizer(tokenizer) if named else tokenizer
    name = tokenizer_name or (tokenizer if named else type(tok).__name__)
    files = sources.source_files(source)
    settings = dict(val_fraction=val_fraction, block_size=block_size)
    settings.update(shard_tokens=shard_tokens, text_field=text_field)
    if cleaner is not None:  # Other cleaning, other shards: it is in the fingerprint.
        settings.update(cleaner.settings)
    merges = repr(getattr(tok, "merges", ""))  # The same name, other merges: other ids.
    inputs = [files_lib.file_stats(files), name, tok.n_vocab, merges, settings]

    def build(stage):
        meta = write_shards(source, tok, files, stage, settings, cleaner)
        return dict(meta, tokenizer=name, **settings)

    return files_lib.build_once(out_dir, inputs, build, before_write, "*.bin")


def write_shards(source, tok, files, stage, settings: dict, cleaner) -> dict:
    """Every document (that `cleaner` keeps) encoded into shards in `stage`; then the
    checks that there was text and that each split holds a block. meta.json's fields."""
    cut = val_cut(files, settings["val_fraction"])
    total = val_cut(files, 0.0)  # The source's text bytes, for the progress line.
    field = settings["text_field"]
    skipped = []  # The binary files go here.
    seen = Counter()  # Documents read and kept, their bytes, those with text.

    def read():  # Every document, counted as it is read.
        for doc in sources.iter_documents(files, skipped, field):
            text = doc[2]
            seen.update(documents=1, bytes=len(text.encode()), text=bool(text.strip()))
            yield doc

    docs = read()
    if cleaner is not None:  # Its first pass, if any, reads the files again.
        docs = cleaner.clean(docs, lambda: sources.iter_documents(files, [], field))

    def pieces():  # Yields (split, text, the source's bytes read so far).
        for doc in docs:
            seen["kept"] += 1  # A removed document's bytes still count for the cut.
            for split, text in split_document(doc, cut):
                yield split, text, doc[1]

    enc = tok.to_tiktoken() if isinstance(tok, Tokenizer) else tok  # The fast encoder.
    dtype = np.uint16 if tok.n_vocab <= 1 << 16 else np.uint32  # GPT-2's ids: 16 bits.
    limit = settings["shard_tokens"]
    writers = token_files.writers(stage, SPLITS, dtype, limit, shard_header)
    token_files.encode_documents(enc, pieces(), writers, total)
    # What cleaning removed, by reason: printed before a check below can stop the run.
    cleaned = cleaner.report(seen) if cleaner is not None else {"removed": {}}
    if skipped:
        print(f"skipped {len(skipped)} of {len(files)} files as binary")
    sources.check_some_text(source, files, skipped, seen["text"])
    meta = token_files.splits_meta(writers, settings["block_size"], seen["kept"])
    meta.update(vocab_size=tok.n_vocab, eot_token=tok.eot_token, source=source)
    meta.update(n_bytes=seen["bytes"], documents_in=seen["documents"])
    meta["documents_kept"] = seen["kept"]
    meta.update(cleaned)  # "removed": documents by reason (and 01b's other counts).
    return meta


# --- The shuffle: a permutation computed a position at a time -------------------------
# Four rounds already make a pseudo-random permutation (Luby-Rackoff); six mix more.
ROUNDS = 6


def _feistel(x: np.ndarray, keys: np.ndarray, half_bits: int) -> np.ndarray:
    """One pass of the network over uint64 values below 4^half_bits."""
    mask = np.uint64((1 << half_bits) - 1)
    left = x >> np.uint64(half_bits)
    right = x & mask
    for key in keys:  # A round: (L, R) -> (R, L xor F_key(R)).
        new_right = left ^ (splitmix.mix(right ^ key) & mask)
        left = right
        right = new_right
    return (left << np.uint64(half_bits)) | right


def shuffled(positions, n: int, seed: int, epoch: int) -> np.ndarray:
    """The items at `positions` (each in range(n)) of the order (seed, epoch) picks.
    Over positions 0..n-1 it returns every item of range(n) once: a permutation."""
    positions = np.asarray(positions, dtype=np.uint64)
    assert n >= 1 and (positions < n).all(), f"positions outside range({n})"
    half_bits = max(1, (int(n - 1).bit_length() + 1) // 2)  # 4^h >= n
    # Keys from (seed, epoch) by integer arithmetic: the same on any NumPy version.
    keys = splitmix.splitmix64(seed, epoch, ROUNDS)  # A new order each epoch.
    out = _feistel(positions, keys, half_bits)
    outside = out >= n
    # Cycle-walking: the cycle through a value < n comes back below n. 4^h < 4n, so
    # fewer than 4 passes are expected a position.
    while outside.any():
        out[outside] = _feistel(out[outside], keys, half_bits)
        outside = out >= n
    return out.astype(np.int64)


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
        # perm_e[first : first + B], computed, not stored (the docstring's Feistel).
        positions = np.arange(first, first + self.B)
        return shuffled(positions, self.n_windows, self.seed, epoch)

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
    """Train a BPE (naive == incremental, ours == tiktoken), write the shards, show two
    DP ranks' batches. Bad input: one line, and --out untouched."""
    description = __doc__.split("\n")[0]
    run(data_flags.parse_args(argv, description, SHARD_TOKENS))


def run(args, cleaner=None, prog="01_data.py") -> None:
    """main's work on parsed flags; 01b_cleaning.py runs it with its `cleaner`."""
    bpe = args.tokenizer == "bpe"
    label = f"bpe{args.vocab_size}" if bpe else Path(args.tokenizer).stem
    label += "-clean" if cleaner else ""  # 01b's shards never overwrite 01's.
    out = Path(args.out or f"data/{Path(args.source).stem}-{label}")
    try:  # Bad input fails here with one line, and no traceback.
        if bpe:
            tok = demo_bpe(sources.source_files(args.source), args)
            name = str(out / "tokenizer.tiktoken")
        else:
            tok = get_tokenizer(args.tokenizer)
            name = args.tokenizer
        save = (lambda: tok.save(name)) if bpe else None  # Runs once checks pass.
        flags = "val_fraction block_size shard_tokens text_field"
        options = {key: getattr(args, key) for key in flags.split()}  # Passed as is.
        options.update(tokenizer_name=name, before_write=save, cleaner=cleaner)
        meta = prepare(args.source, tok, out, **options)
        for split, shards in meta["shards"].items():  # Also when the work was done.
            n = meta[split + "_tokens"]
            print(f"  {out}/{split}_*.bin: {n:,} tokens in {len(shards)} shard(s)")
        loaders = [DataLoader(out, "train", 2, 8, 0, rank, 2) for rank in (0, 1)]
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        one_line = " ".join(str(e).splitlines())
        raise SystemExit(f"{prog}: error: {one_line}") from None
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
