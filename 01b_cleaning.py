"""01b · Cleaning: which documents deserve to become tokens.

Web text is full of menus, spam, tables and copies; a model trained on copies memorises
them (Lee et al. 2021). Clean data (as FineWeb, Penedo et al. 2024) keeps prose by rules
and drops what was seen before. --quality gopher keeps prose by Gopher's rules (Rae et
al. 2021). --dedup drops a document seen before: exact (the same text up to case and
spacing: the simple version, a set of keys), or minhash (Broder 1997), near copies too;
or --dedup lines drops each line seen twice in the corpus (CCNet, Wenzek et al. 2019).

    exact:   key = digest(lowercase text, spaces collapsed); seen before -> a duplicate
    minhash: A, B = the word 5-gram sets of two texts;  J = |A∩B| / |A∪B|
             min over A of a random hash h == min over B  iff  the least of A∪B is in
             A∩B, so P = J; 112 hashes: J ≈ the share of equal minima, with sd
             sqrt(J(1-J)/112)
    LSH:     14 bands of 8 hashes, a key a band; a shared key makes a candidate pair:
             P = 1 - (1 - J^8)^14: 92% at J = 0.8, 5% at 0.5, 50% at J ≈ 0.685 (the
             usual estimate of the 50% point, (1/14)^(1/8) = 0.72, gives 65%)
             a candidate is a duplicate only when its share of equal hashes is >=
             --dedup-threshold (0.8); the first of a cluster stays
    lines:   pass 1 counts each line's hash over the corpus; pass 2 keeps the lines seen
             once (a menu or a footer on every page goes, even its first copy)

Who holds what (one process; it remembers hashes, never the text):

    document -> Gopher rules -> exact key -> signature (112 x uint32) -> 14 band keys
                                   |               |                      |
                          a set: ~75 B a doc  sigs[doc]: 448 B  key -> first doc: 1.4 KB
    minhash: ~1.9 KB a document, ~25 GB for 10B tokens of prose; lines: ~100 B a line

Launch: `python 01b_cleaning.py` (01's pipeline, cleaned: every flag of `python
01_data.py`, and --quality none|gopher, --dedup none|exact|minhash|lines, default exact,
and --dedup-threshold). What changed from 01_data.py: 01's `prepare` keeps every
document unless it is given a cleaner; `Cleaner` here is one, so the data pipeline stays
one command and one pass over the corpus, and 01 never imports this file. `prepare`
here is 01's with the cleaning flags (DESIGN's `prepare(... --dedup, --quality)`). Left
out on purpose: language ID, URL and repetition filters, fuzzy line dedup, a dedup index
sharded over machines by band key, substring (suffix-array) dedup.
"""

import hashlib
import importlib
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import regex

from support.data import data_flags
from support.data.splitmix import splitmix64

data = importlib.import_module("01_data")  # prepare, run: the pipeline this cleans

STOP_WORDS = "the|be|to|of|and|that|have|with"  # Gopher's eight: prose has them.
WORD = regex.compile(r"\w+")  # A word tokenizer's cuts: words, then symbol runs.
SYMBOLS = regex.compile(r"[^\w\s]+")
LETTERED = regex.compile(r"\w*\p{L}\w*")
STOP = regex.compile(rf"\b(?:{STOP_WORDS})\b", regex.I)
QUALITY = ("none", "gopher")  # The choices of --quality.
DEDUP = ("none", "exact", "minhash", "lines")  # The choices of --dedup.
LINE = regex.compile(r"[^\n]*\n|[^\n]+")  # A line and its newline, as a file gives it.
# The hash parameters' seed: fixed, so every run removes the same documents.
SEED = 20240520


# --- Quality: Gopher's rules ----------------------------------------------------------
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


# --- Duplicates: exact keys first, then MinHash signatures and LSH bands -------------
def _digest(raw: bytes) -> bytes:
    return hashlib.blake2b(raw, digest_size=8).digest()


def exact_key(text: str) -> bytes:
    """The simple version: one 8-byte key a text, up to case and spacing."""
    return _digest(" ".join(text.lower().split()).encode())


class SignatureStore:
    """MinHash signatures by document number, and which documents hold each band key:
    the LSH buckets. A key maps to the first document that had it; the rare later ones
    (near copies, or two bands that collide by chance) go to a side list, so no
    candidate is ever lost. Fixed memory a document, whatever its length: the signature
    (112 uint32: 448 B) and one dict entry a band key (~100 B: 1.4 KB for 14 bands)."""

    def __init__(self, n_hashes: int):
        self.sigs = np.zeros((1024, n_hashes), np.uint32)
        self.n = 0  # Documents stored: rows 0..n-1 of sigs.
        self.first = {}  # A band key -> the first document that had it.
        self.more = {}  # A band key -> the later documents that had it too.

    def candidates(self, keys) -> list[int]:
        """The documents that share at least one band key with `keys`, in order."""
        docs = set()
        for key in keys:
            if key in self.first:
                docs.add(self.first[key])
                docs.update(self.more.get(key, ()))
        return sorted(docs)

    def add(self, sig: np.ndarray, keys) -> None:
        """Store one document's signature and band keys."""
        if self.n == len(self.sigs):  # Grow by doubling: amortised O(1) a document.
            self.sigs = np.concatenate([self.sigs, np.zeros_like(self.sigs)])
        self.sigs[self.n] = sig
        for key in keys:
            if key in self.first:
                self.more.setdefault(key, []).append(self.n)
            else:
                self.first[key] = self.n
        self.n += 1


class Deduplicator:
    """--dedup exact: `exact_key`s in a set (~75 B a text). minhash adds its signature
    and a key per band (a SignatureStore: ~1.9 KB a text). lines: two passes,
    `count_lines` over the corpus first (a dict of 64-bit line hashes, ~100 B a distinct
    line), then `unique_lines` keeps each text's lines counted once."""

    def __init__(self, mode: str, threshold=0.8, hashes=112, bands=14, ngram=5):
        assert mode in DEDUP, f"dedup {mode!r} unknown: one of {DEDUP}"
        assert hashes % bands == 0, f"{hashes} hashes do not split in {bands} bands"
        # Fixed integers (splitmix64, not a NumPy Generator's stream, which may change
        # between versions): the same removals everywhere. a is odd, so a·s mod 2^64 is
        # one-to-one. Each has shape (hashes, 1).
        self.a = splitmix64(SEED, 0, hashes)[:, None] | np.uint64(1)
        self.b = splitmix64(SEED, 1, hashes)[:, None]
        self.mode = mode
        self.threshold = threshold
        self.bands = bands
        # A band is `rows` consecutive hashes of a signature.
        self.rows = hashes // bands
        self.ngram = ngram
        self.exact = set()
        self.store = SignatureStore(hashes)
        self.line_counts = {}

    def ngram_hashes(self, text: str) -> np.ndarray:
        """(k,): a 64-bit hash of each of the text's k lowercase word n-grams, in
        order. A word is hashed by crc32 (hash() varies by process), an n-gram as a
        polynomial of its words' hashes, base 2^64/φ (odd)."""
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
        """What duplicate `text` is, or None. A shared band key makes a candidate; it is
        a near duplicate when the share of equal hashes (an estimate of the Jaccard
        similarity) is >= threshold. Kept either way, so a chain of near copies goes."""
        key = exact_key(text)
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
        """Pass 2: the text without its lines seen twice in the corpus (first copies
        too)."""
        lines = LINE.findall(text)
        kept = [line for line in lines if self.line_counts[hash(line)] == 1]
        seen["duplicate lines"] += len(lines) - len(kept)
        return "".join(kept)


# --- The cleaner 01's prepare takes ---------------------------------------------------
class Cleaner:
    """The document filter for 01_data.prepare(..., cleaner=): the Gopher rules, then
    one --dedup mode. `settings` go into meta.json and the shards' fingerprint (other
    cleaning: other shards); `clean` filters the stream; `report` prints what went."""

    def __init__(self, quality="none", dedup="exact", dedup_threshold=0.8):
        assert quality in QUALITY, f"quality {quality!r} unknown: one of {QUALITY}"
        assert dedup in DEDUP, f"dedup {dedup!r} unknown: one of {DEDUP}"
        self.settings = dict(quality=quality, dedup=dedup)
        self.settings["dedup_threshold"] = dedup_threshold
        self.removed = Counter()  # Documents, by reason.
        self.lines = Counter()  # "duplicate lines": lines dropped by --dedup lines.

    def clean(self, docs, read_again):
        """The documents (start, end, text, whole) that pass the quality rules and are
        no duplicates. `read_again()` reads the corpus anew (--dedup lines' pass 1)."""
        quality = self.settings["quality"]
        deduper = Deduplicator(self.settings["dedup"], self.settings["dedup_threshold"])
        self.removed.clear()  # A new run: new keys, new counts.
        self.lines.clear()
        if deduper.mode == "lines":  # Pass 1 of 2: count every line of the corpus.
            deduper.count_lines(text for _, _, text, _ in read_again())
        for start, end, text, whole in docs:
            why = None
            # As CCNet: lines first, then the rules judge what is left.
            if deduper.mode == "lines":
                had_text = bool(text.strip())
                text = deduper.unique_lines(text, self.lines)
                why = had_text and not text.strip() and "every line a duplicate"
            # The rules go before the document keys: a text they remove adds none.
            why = why or (quality == "gopher" and gopher_rule_broken(text))
            if not why and deduper.mode in ("exact", "minhash"):
                why = deduper.why_duplicate(text)
            if why:
                self.removed[why] += 1  # Its bytes still count towards the val cut.
            else:
                yield start, end, text, whole

    def report(self, seen: Counter) -> dict:
        """One line, documents kept and removed by reason; meta.json's fields of it."""
        quality = self.settings["quality"]
        flags = f"--quality {quality}, --dedup {self.settings['dedup']}"
        lost = ", ".join(f"{why} ({n:,})" for why, n in self.removed.items()) or "none"
        line = f"cleaning ({flags}): kept {seen['kept']:,} of {seen['documents']:,}"
        line += f" documents; removed: {lost}"
        dropped = self.lines["duplicate lines"]
        if self.settings["dedup"] == "lines":
            line += f"; {dropped:,} duplicate lines dropped"
        print(line)
        return {"removed": dict(self.removed), "duplicate_lines_removed": dropped}


def prepare(
    source,
    tokenizer,
    out_dir,
    *args,
    quality="none",
    dedup="exact",
    dedup_threshold=0.8,
    **kwargs,
) -> dict:
    """01's `prepare` (args, kwargs: its own), cleaned: DESIGN's `prepare(..., quality,
    dedup)`, whose meta.json also says what was removed, by reason."""
    cleaner = Cleaner(quality, dedup, dedup_threshold)
    return data.prepare(source, tokenizer, out_dir, *args, cleaner=cleaner, **kwargs)


# --- The demo: the worked pair, then 01's pipeline with the cleaner -------------------
def main(argv=None) -> None:
    """Each idea on a worked document (exact key, rules, MinHash and LSH), then `python
    01_data.py`'s pipeline with this cleaner. Bad input: one line, --out untouched."""
    description = __doc__.split("\n")[0]
    choices = (QUALITY, DEDUP)
    args = data_flags.parse_args(argv, description, data.SHARD_TOKENS, choices)
    demo_documents()
    cleaner = Cleaner(args.quality, args.dedup, args.dedup_threshold)
    data.run(args, cleaner, prog="01b_cleaning.py")


def shingles(text: str, n=5) -> set:
    """The text's word n-grams, lowercase, as a set: what J is counted on."""
    words = WORD.findall(text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def demo_documents():
    """The simple version, then the rules, then MinHash and LSH on near copies: 400
    words of the frozen demo corpus, every k-th word changed."""
    corpus = Path(data.__file__).parent / "support" / "frozen_corpus.txt"
    text = corpus.read_text()
    prose = " ".join(WORD.findall(text)[:400])
    copy = "  ".join(prose.upper().split())
    d = Deduplicator("exact")
    whys = [d.why_duplicate(t) for t in (prose, copy)]
    print(f"exact keys: a text, then itself in upper case and other spacing: {whys}")
    code = text[text.index("def heappush") :][:2000]
    rules = f"{gopher_rule_broken(prose) or 'passes'}, heapq's code: "
    print(f"gopher: the prose {rules}{gopher_rule_broken(code) or 'passes'}")
    words = prose.split()
    for k in (80, 20):
        near = " ".join(w if i % k else "zz" + w for i, w in enumerate(words))
        demo_near_copy(prose, near, f"every {k}th word changed")


def demo_near_copy(text: str, near: str, what: str) -> None:
    """J counted on the 5-gram sets against MinHash's estimate, the S-curve's P of a
    candidate, and what a fresh Deduplicator decides."""
    a = shingles(text)
    b = shingles(near)
    j = len(a & b) / len(a | b)
    d = Deduplicator("minhash")
    sigs = [d.minhash(t) for t in (text, near)]  # (112,) each
    estimate = float(np.mean(sigs[0] == sigs[1]))
    p = 1 - (1 - j**d.rows) ** d.bands
    d.why_duplicate(text)
    candidate = bool(d.store.candidates(d.band_keys(sigs[1])))
    why = d.why_duplicate(near) or "kept"
    found = f"J = {j:.3f}, estimated {estimate:.3f} (112 hashes)"
    curve = f"P(candidate) = 1 - (1 - J^8)^14 = {p:.3f}"
    print(f"minhash, {what}: {found}; {curve}, a candidate: {candidate}: {why}")


if __name__ == "__main__":
    main()
