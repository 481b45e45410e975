"""01_data.py: byte-level BPE against worked examples and tiktoken; shards; the loader."""

import importlib
import json
import os
import random
import re
import subprocess
import sys
import sysconfig
import threading
import tracemalloc
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import tiktoken.load
import torch

from support import files
from support.data import sources, splitmix, token_files

data = importlib.import_module("01_data")
EOT = data.EOT


@pytest.fixture(scope="module")
def real_text():
    """~300 KB of real text: the first files of the standard-library corpus."""
    docs = [text for _, _, text, _ in sources.iter_documents(sources.stdlib_files()[:40], [])]
    return EOT.join(docs)[:300_000]


@pytest.fixture(scope="module")
def trained(real_text):
    return data.train_bpe(real_text, 600)


def random_unicode(rng: random.Random, n: int) -> str:
    """Strings that stress the regex and the byte fallback: ASCII words, digits, apostrophes,
    whitespace runs, accents, CJK, emoji, combining marks and lone control characters."""
    alphabet = (
        list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789 '\"!?.,;:-_()[]{}")
        + [" ", "  ", "\n", "\n\n", "\t", " \n", "'s", "'ll", "'re", "'ve", "'t"]
        + ["é", "ß", "Ω", "ж", "中", "文", "語", "😀", "🚀", "\u0301", "\u200b", "\x00", "\x7f"]
    )
    return "".join(rng.choice(alphabet) for _ in range(n))


# ---------------------------------------------------------------------------------------------
# BPE training
# ---------------------------------------------------------------------------------------------
TRAINERS = pytest.mark.parametrize("train", ["train_bpe_naive", "train_bpe"])


@TRAINERS
def test_wikipedia_example_aaabdaaabac(train):
    """Wikipedia's BPE example, byte-level, with our tie-break rule.

    "aaabdaaabac" is one pre-token (all letters). Pair counts over its bytes:
        (a,a)=4  (a,b)=2  (b,d)=1  (d,a)=1  (b,a)=1  (a,c)=1        -> merge 256 = "aa"
    The word becomes [aa,a,b,d,aa,a,b,a,c] and the counts are
        (aa,a)=2  (a,b)=2  (b,d)=1  (d,aa)=1  (b,a)=1  (a,c)=1
    a tie at 2. The lexicographically greatest pair wins: (b"aa", b"a") > (b"a", b"b") because
    b"aa" > b"a"                                                     -> merge 257 = "aaa"
    (Wikipedia picks "ab" here; its tie-break is arbitrary.) Now [aaa,b,d,aaa,b,a,c] has
    (aaa,b)=2 and everything else 1                                  -> merge 258 = "aaab"
    so the text encodes as [aaab, d, aaab, a, c] = [258, 100, 258, 97, 99].
    """
    tok = getattr(data, train)("aaabdaaabac", 256 + 3, special_tokens=())
    assert tok.merges == [(b"a", b"a"), (b"aa", b"a"), (b"aaa", b"b")]
    assert tok.encode("aaabdaaabac") == [258, ord("d"), 258, ord("a"), ord("c")]
    assert tok.decode([258, 100]) == "aaabd"


@TRAINERS
def test_ties_break_to_the_greatest_pair_whatever_the_input_order(train):
    """In "ab cd" every pair occurs once: (a,b), (" ",c), (c,d). The greatest byte-string pair
    is (b"c", b"d") (b"c" > b"a" > b" "), then (b"a", b"b"), then (b" ", b"cd"). The order in
    which words appear, and hash seeds, must not matter."""
    expected = [(b"c", b"d"), (b"a", b"b"), (b" ", b"cd")]
    assert getattr(data, train)("ab cd", 256 + 3, special_tokens=()).merges == expected
    assert getattr(data, train)("cd ab", 256 + 3, special_tokens=()).merges[:2] == expected[:2]


def test_naive_and_incremental_trainers_learn_the_same_merges(real_text):
    """The naive trainer recounts every pair after each merge; the incremental one patches the
    counts of the words a merge touched. On real code (many ties among rare pairs), on runs such
    as "aaaaa" (a merge of (a, a) must take "aa" "aa" "a" left to right, and the counts of the
    overlapping pairs must follow) and on random Unicode, both must pick the same pair every
    time, until the text runs out of pairs."""
    rng = random.Random(5)
    text = real_text[:30_000] + EOT.join(random_unicode(rng, 300) for _ in range(20))
    text += " aaaaa aaa aaaa bbbbbb abab ababab" * 7
    naive, fast = data.train_bpe_naive(text, 700), data.train_bpe(text, 700)
    assert len(naive.merges) == 700 - 257
    assert naive.merges == fast.merges
    tiny = "aaaaa aaa"  # runs out of pairs after a few merges
    assert data.train_bpe_naive(tiny, 300).merges == data.train_bpe(tiny, 300).merges
    assert len(data.train_bpe(tiny, 300).merges) < 300 - 257


def test_training_is_deterministic_and_lays_out_the_vocab(real_text, trained):
    again = data.train_bpe(real_text, 600)
    assert again.merges == trained.merges
    assert len(trained.merges) == 600 - 256 - 1
    assert all(trained.vocab[i] == bytes([i]) for i in range(256))
    for i, (a, b) in enumerate(trained.merges):
        assert trained.vocab[256 + i] == a + b
    assert trained.special_tokens == {EOT: 599} and trained.n_vocab == 600
    assert trained.eot_token == 599


def test_special_tokens_are_never_merged_into_or_across():
    """Without cutting specials out, "x<|endoftext|>y" repeated would make "<|", "endoftext",
    "x<" and ">y" the most frequent pairs. None of those may appear in a learned token."""
    text = f"x{EOT}y" * 200 + "hello world " * 10
    tok = data.train_bpe(text, 300)
    learned = [a + b for a, b in tok.merges]  # it runs out of pairs before 300: fine
    assert learned and not any(b"<|" in t or b"|>" in t or b"endof" in t for t in learned), learned
    assert tok.encode(EOT + EOT) == [tok.eot_token, tok.eot_token]  # doubled stays two tokens
    assert tok.encode(f"x{EOT}y") == [ord("x"), tok.eot_token, ord("y")]
    assert len(tok.encode_ordinary(EOT)) > 1  # as ordinary text it is just characters


@TRAINERS
def test_rejects_a_vocab_too_small_for_the_specials(train):
    with pytest.raises(AssertionError, match="vocab_size 256 < 256 bytes"):
        getattr(data, train)("abc", 256)


# ---------------------------------------------------------------------------------------------
# Encoding: the pure-Python encoder equals tiktoken built from the same ranks
# ---------------------------------------------------------------------------------------------
def test_encoder_equals_tiktoken_on_random_unicode_and_real_text(trained, real_text):
    fast = trained.to_tiktoken()
    rng = random.Random(0)
    for _ in range(300):
        s = random_unicode(rng, rng.randint(0, 80))
        assert trained.encode_ordinary(s) == fast.encode_ordinary(s), repr(s)
        assert trained.encode(s + EOT + s) == fast.encode(s + EOT + s, allowed_special="all")
    assert trained.encode(real_text) == fast.encode(real_text, allowed_special="all")


def test_round_trip(trained):
    rng = random.Random(1)
    for _ in range(200):
        s = random_unicode(rng, rng.randint(0, 60))
        assert trained.decode(trained.encode(s)) == s


def test_any_vocab_encodes_like_tiktoken():
    """Not only vocabularies we trained: byte ids permuted, and a token ("abc") that is reachable
    by two different splits. tiktoken looks up the rank of the concatenation, so we must too."""
    order = list(range(256))
    random.Random(2).shuffle(order)
    vocab = {i: bytes([b]) for i, b in enumerate(order)}
    merges = [(b"a", b"b"), (b"b", b"c"), (b"a", b"bc"), (b" ", b"abc")]
    vocab.update({256 + i: a + b for i, (a, b) in enumerate(merges)})
    tok = data.Tokenizer(vocab, merges, [EOT])
    fast = tok.to_tiktoken()
    for s in ["abc", "bcabc", " abcab", "aabbcc abc", "xyz abc" + EOT + "abc"]:
        assert tok.encode(s) == fast.encode(s, allowed_special="all"), s


GPT2_VOCAB_BPE = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe"
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"


def gpt2_tokenizer():
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
    return data.Tokenizer(vocab, merges, [EOT])


def test_gpt2_merges_equal_tiktoken_gpt2(gpt2_encoding, real_text):
    """GPT-2's own 50,000 merges, read from tiktoken's cached vocab.bpe, give tiktoken's ids."""
    ours = gpt2_tokenizer()
    assert len(ours.merges) == 50_000 and ours.n_vocab == gpt2_encoding.n_vocab == 50_257
    assert ours.eot_token == gpt2_encoding.eot_token
    rng = random.Random(3)
    for _ in range(300):
        s = random_unicode(rng, rng.randint(0, 80))
        assert ours.encode(s) == gpt2_encoding.encode(s, allowed_special="all"), repr(s)
    assert ours.encode(real_text) == gpt2_encoding.encode(real_text, allowed_special="all")


def test_encode_iterable_equals_encode_for_any_chunking(trained, real_text):
    """Chunk boundaries inside words, whitespace runs and special tokens change nothing."""
    text = (real_text[:150_000] + " a \nb" + EOT + "  \n" + EOT) * 2
    expected = trained.encode(text)
    rng = random.Random(4)
    for max_chunk in (1, 7, 5000):
        chunks, pos = [], 0
        while pos < len(text):
            n = rng.randint(1, max_chunk)
            chunks.append(text[pos : pos + n])
            pos += n
        assert list(trained.encode_iterable(chunks)) == expected


def test_encode_iterable_without_a_place_to_cut_and_specials_with_spaces(trained):
    """120K characters with no whitespace at all stream whole (no cut) and still equal encode;
    a special token that holds a space is refused, since a cut could fall inside it."""
    text = "ab,cd;" * 20_000 + EOT + "ef"
    chunks = (text[i : i + 1000] for i in range(0, len(text), 1000))
    assert list(trained.encode_iterable(chunks)) == trained.encode(text)
    with pytest.raises(AssertionError, match="a special's space"):
        data.Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|im start|>"])


def test_encode_iterable_runs_in_bounded_memory(trained):
    """2 MB of text streamed from a generator: the peak Python allocation stays far below the
    input size (a non-streaming encoder holds the 2 MB string plus a list of ~0.5M ids). The
    streaming peak is ~0.7 MB at 1.5, 2 and 4 MB alike (64K characters of buffer and their
    ids), so 2 MB keeps the string alone twice the bound at half the time of 4 MB."""
    line = "def f(x):\n    return x + 1  # a line of code\n" + EOT
    n_lines = 2_000_000 // len(line)
    tracemalloc.start()
    n_ids = sum(1 for _ in trained.encode_iterable(line for _ in range(n_lines)))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert n_ids == n_lines * len(trained.encode(line))
    assert peak < 1_000_000, f"peak {peak / 1e6:.1f} MB for a 2 MB stream"


def test_save_and_load_round_trip(tmp_path, trained, monkeypatch):
    path = trained.save(tmp_path / "tok")
    assert path.suffix == ".tiktoken"
    loaded = data.Tokenizer.load(path)
    assert loaded.vocab == trained.vocab and loaded.merges == trained.merges
    assert loaded.special_tokens == trained.special_tokens
    # the ranks file is tiktoken's own format ("" turns tiktoken's path-keyed file cache off)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    assert tiktoken.load.load_tiktoken_bpe(str(path)) == trained.ranks
    assert data.get_tokenizer(str(path)).encode("hello" + EOT) == trained.encode("hello" + EOT)


def test_retrained_tokenizer_loads_its_new_ranks(tmp_path, real_text, monkeypatch):
    """Retrain into the same path at another size: load must read the new file, and write
    nothing into tiktoken's cache (tiktoken's own loader caches by path string)."""
    cache = tmp_path / "tiktoken_cache"
    cache.mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    for vocab_size in (300, 280, 320):
        tok = data.train_bpe(real_text[:20_000], vocab_size)
        loaded = data.Tokenizer.load(tok.save(tmp_path / "tok"))
        assert loaded.n_vocab == tok.n_vocab == vocab_size
        assert loaded.vocab == tok.vocab and loaded.merges == tok.merges
    assert list(cache.iterdir()) == [], "Tokenizer.load wrote into TIKTOKEN_CACHE_DIR"


def test_three_tokenizers_share_one_interface(trained, gpt2_encoding):
    text = "Hello, wörld!\n"
    for tok in (trained, data.CharTokenizer(), gpt2_encoding):
        ids = tok.encode_ordinary(text)
        assert tok.decode(ids) == text
        assert 0 <= tok.eot_token < tok.n_vocab
        assert max(ids) < tok.n_vocab
    char = data.get_tokenizer("char")
    assert char.encode("a" + EOT) == [97, 256] and char.decode([104, 105, 256]) == "hi" + EOT
    assert char.merges == [] and char.n_vocab == 257


def test_unknown_tokenizer_says_what_is_allowed():
    with pytest.raises(ValueError, match="use 'gpt2', 'char' or a saved BPE's path"):
        data.get_tokenizer("sentencepiece")


# ---------------------------------------------------------------------------------------------
# Sources, shards and prepare
# ---------------------------------------------------------------------------------------------
def test_stdlib_corpus_is_found_in_a_deterministic_order():
    files = sources.stdlib_files()
    assert len(files) > 100 and files == sorted(files)
    assert not any("site-packages" in f.parts for f in files)


def test_stdlib_corpus_leaves_out_generated_tables():
    """The charmap codecs (encodings/cp437.py: a 256-line `decoding_table` of string literals),
    Sphinx's help text (pydoc_data/topics.py, 750 KB) and html/entities.py are in the standard
    library but are not Python anyone writes. Code stays in, the codecs' code included."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sources.stdlib_files()
    names = {f.relative_to(root).as_posix() for f in files}
    assert {"json/decoder.py", "codecs.py", "encodings/utf_8.py", "encodings/idna.py"} <= names
    assert not names & {"encodings/cp437.py", "pydoc_data/topics.py", "html/entities.py"}
    charmaps = [f for f in root.glob("encodings/*.py") if "decoding_table = (" in f.read_text()]
    assert len(charmaps) > 30, "the standard library has charmap codecs to leave out"
    assert not set(charmaps) & set(files)
    # the rule by hand: a table is mostly lines that open with a string or number literal
    assert sources.is_table("X = {\n    'a': 1,\n    'b': 2,\n    'c': 3,\n    0x41: 'A',\n}\n")
    assert not sources.is_table('def f(x):\n    """Doc."""\n    return {"a": x}\n')


def test_shakespeare_offline_gives_a_clear_error(tmp_path, monkeypatch):
    """01's --source shakespeare downloads the corpus once; offline, it says what to do."""

    def offline(*args, **kwargs):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(sources.urllib.request, "urlopen", offline)
    with pytest.raises(RuntimeError, match="could not download tiny-shakespeare.*--source"):
        sources.download_shakespeare(tmp_path)
    assert list(tmp_path.iterdir()) == []
    # 01's --source reaches the same download, and no other source touches the network.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="could not download tiny-shakespeare"):
        sources.source_files("shakespeare")
    cached = tmp_path / "data" / "downloads" / "tinyshakespeare.txt"
    cached.parent.mkdir(parents=True)
    cached.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n")
    assert sources.source_files("shakespeare") == [Path("data/downloads/tinyshakespeare.txt")]
    assert sources.source_files(str(cached)) == [cached]


def write_shard(path, tokens: np.ndarray) -> None:
    """A shard by hand (01's writer names its own): the header, then the tokens."""
    files.atomic_write(
        path,
        lambda tmp: tmp.write_bytes(
            data.shard_header(tokens.dtype, len(tokens)) + tokens.tobytes()
        ),
    )


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_shards_round_trip(tmp_path, dtype):
    tokens = np.arange(0, 70_000, 7, dtype=np.int64) % np.iinfo(dtype).max
    write_shard(tmp_path / "s.bin", tokens.astype(dtype))
    back = data.read_shard(tmp_path / "s.bin")
    assert back.dtype == dtype and np.array_equal(back, tokens)
    assert (tmp_path / "s.bin").stat().st_size == 32 + tokens.size * np.dtype(dtype).itemsize


def test_atomic_write_replaces_whole_or_not_at_all(tmp_path):
    """`write` gets a temporary path in the same folder (so the rename is atomic) whose name
    holds the pid (two processes never share one); a write that fails leaves the old file and
    no temporary behind."""
    path, seen = tmp_path / "sub" / "f.json", []

    def write(tmp):
        seen.append(tmp)
        tmp.write_text("new")

    files.atomic_write(path, write)
    assert path.read_text() == "new" and seen[0].parent == path.parent
    assert str(os.getpid()) in seen[0].name and not seen[0].exists()

    def torn(tmp):
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.atomic_write(path, torn)
    assert path.read_text() == "new" and sorted(path.parent.iterdir()) == [path]
    files.fsync_dir(path.parent)  # a folder can be fsynced (train.py does after its renames)


def test_a_file_that_is_not_a_shard_is_rejected(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\0" * 64)
    with pytest.raises(AssertionError, match="not a token shard"):
        data.read_shard(tmp_path / "x.bin")


def write_corpus(folder, n_docs=6, words=400):
    folder.mkdir(parents=True, exist_ok=True)
    for d in range(n_docs):
        (folder / f"doc{d}.txt").write_text(" ".join(f"w{d}_{i % 50}" for i in range(words)))
    return folder


def split_tokens(out, split) -> np.ndarray:
    """A split's shards, end to end (as meta.json lists them)."""
    return np.concatenate([data.read_shard(p) for p in token_files.listed_shards(out, split)])


def test_prepare_writes_shards_that_decode_back_to_the_corpus(tmp_path):
    """With the char tokenizer the tokens are the bytes, so train + val decode to the documents
    joined by <|endoftext|>: nothing lost at the split, one EOT between documents."""
    corpus = write_corpus(tmp_path / "corpus")
    meta = data.prepare(str(corpus), "char", tmp_path / "out", val_fraction=0.2, block_size=64)
    train, val = split_tokens(tmp_path / "out", "train"), split_tokens(tmp_path / "out", "val")
    char = data.CharTokenizer()
    docs = [p.read_text() for p in sorted(corpus.iterdir())]
    assert char.decode(train.tolist()) + char.decode(val.tolist()) == EOT.join(docs)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 257
    assert 0.15 < len(val) / (len(train) + len(val)) < 0.25
    assert json.loads((tmp_path / "out" / "meta.json").read_text()) == meta


def test_prepare_is_idempotent(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    data.prepare(str(corpus), "char", tmp_path / "out", block_size=64)
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()}
    data.prepare(str(corpus), "char", tmp_path / "out", block_size=64)
    assert "nothing to do" in capsys.readouterr().out
    assert before == {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()}


class BytesAndEot:
    """Bytes, with the end-of-text id at `eot_token` and n_vocab = eot_token + 1: the ids of a big
    vocabulary without training one (prepare needs only these three things of a tokenizer)."""

    def __init__(self, eot_token):
        self.eot_token, self.n_vocab = eot_token, eot_token + 1

    def encode_ordinary_batch(self, texts, num_threads=1):
        return [list(t.encode("utf-8")) for t in texts]


@pytest.mark.parametrize("n_vocab, dtype", [(65_536, np.uint16), (65_537, np.uint32)])
def test_prepare_uses_uint32_only_when_the_vocab_needs_it(tmp_path, n_vocab, dtype):
    """uint16 holds ids 0..65,535: a vocabulary of 65,536 still fits, one of 65,537 does not. The
    end-of-text id, the largest, sits between documents and must survive the cast."""
    corpus = write_corpus(tmp_path / "corpus")
    meta = data.prepare(str(corpus), BytesAndEot(n_vocab - 1), tmp_path / "out", block_size=64)
    train = split_tokens(tmp_path / "out", "train")
    assert meta["dtype"] == np.dtype(dtype).name and train.dtype == dtype
    assert n_vocab - 1 in train  # the EOT between documents survived


class RecordingBytes(BytesAndEot):
    """BytesAndEot that records how many characters each encode_ordinary_batch call was handed."""

    def __init__(self, eot_token):
        super().__init__(eot_token)
        self.calls = []

    def encode_ordinary_batch(self, texts, num_threads=1):
        self.calls.append(sum(map(len, texts)))
        return super().encode_ordinary_batch(texts, num_threads)


def test_encoding_holds_one_batch_of_text_at_a_time_not_the_corpus(monkeypatch, tmp_path):
    """A document is a whole file, so one call per 256 documents could hand tiktoken GBs of text
    and hold all their id lists at once. A call takes documents until ENCODE_BATCH_CHARS is
    reached, at least one: with a limit of 100,000, twelve documents of 30,000 characters go in
    3 calls of 4 (120,000: never more than the limit plus one document), and a document above
    the limit goes alone. The tokens are those of one document at a time, EOT between them."""
    monkeypatch.setattr(token_files, "ENCODE_BATCH_CHARS", 100_000)

    def encode(docs):
        enc, w = RecordingBytes(256), token_files.RollingWriter(tmp_path, "train", np.uint16, 10**9, data.shard_header)
        token_files.encode_documents(enc, [("train", d, 0) for d in docs], {"train": w}, 1)
        return enc.calls, data.read_shard(tmp_path / w.shards[0]["file"]).tolist()

    docs = [chr(ord("a") + d) * 30_000 for d in range(12)]
    calls, tokens = encode(docs)
    assert calls == [120_000] * 3  # the old code: one call of 360,000
    assert tokens == [t for d in docs for t in [256, *d.encode()]][1:]
    assert encode(["x" * 250_000, "y" * 250_000])[0] == [250_000, 250_000]


@pytest.mark.parametrize(
    "make_source, tokenizer, error, match",
    [
        (lambda p: str(write_corpus(p, n_docs=0)), "char", FileNotFoundError, "not a file"),
        (
            lambda p: (p / "e.txt").write_text("  \n") and str(p / "e.txt"),
            "char",
            ValueError,
            "holds no text",
        ),
        (
            lambda p: (p / "s.txt").write_text("too short") and str(p / "s.txt"),
            "char",
            ValueError,
            "fewer than one block",
        ),
        (lambda p: str(p / "missing.txt"), "char", FileNotFoundError, "not a file"),
        (lambda p: str(write_corpus(p)), "no-such-tokenizer", ValueError, "unknown tokenizer"),
    ],
    ids=["empty-dir", "empty-text", "shorter-than-a-block", "missing-file", "unknown-tokenizer"],
)
def test_bad_input_fails_clearly_and_writes_nothing(tmp_path, make_source, tokenizer, error, match):
    (tmp_path / "src").mkdir()
    source = make_source(tmp_path / "src")
    with pytest.raises(error, match=match):
        data.prepare(source, tokenizer, tmp_path / "out", block_size=64)
    assert not (tmp_path / "out").exists()


PNG = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(range(256)) * 4  # an image: 0x89 is no UTF-8
ELF = b"\x7fELF\x02\x01\x01" + bytes(9) + bytes(range(1, 256)) * 4  # an executable: NULs
NOT_UTF8 = bytes(random.Random(0).randrange(1, 256) for _ in range(4096))  # random, but no NUL


def test_binary_means_a_nul_or_not_utf8_in_the_first_8kb():
    """The old rule (a NUL only) took random bytes for text; a strict decode of the head would
    reject good text whose 8 KB cut splits a character, or accept a Latin-1 byte at the end."""
    assert not sources.is_binary("héllo wörld 中文 😀\n".encode())
    # "a" + 2-byte "é"s: the 8,192-byte cut falls inside an "é". A plain decode of the head
    # would call this text binary; the incremental decoder waits for the missing byte.
    assert not sources.is_binary(("a" + "é" * 5000).encode())
    assert sources.is_binary(b"caf\xe9")  # Latin-1: not UTF-8 (at the end of a file, no byte follows)
    assert sources.is_binary(PNG) and sources.is_binary(ELF) and sources.is_binary(NOT_UTF8)
    assert not sources.is_binary(b"a" * 8192 + b"\0")  # only the head is judged


BAD_SOURCES = {  # case: (files to write, the --source to name, what the one-line error says)
    "empty-file": ({"e.txt": b""}, "e.txt", "holds no text: empty or whitespace"),
    "png-file": ({"x.png": PNG}, "x.png", "holds no text: 1 of 1 files binary"),
    "random-bytes": ({"r.bin": NOT_UTF8}, "r.bin", "holds no text: 1 of 1 files binary"),
    "missing-path": ({}, "nope.txt", "is not a file, a folder with files"),
    "empty-folder": ({"d": None}, "d", "is not a file, a folder with files"),
    "no-text-files": ({"d/ls": ELF, "d/x.png": PNG, "d/b.txt": b"\n"}, "d", "2 of 3 files binary"),
    "too-short": ({"s.txt": b"too short"}, "s.txt", "fewer than one block of 64+1"),
}


def write_source(root, case) -> str:
    files, source, _ = BAD_SOURCES[case]
    for name, raw in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        if raw is None:
            (root / name).mkdir()
        else:
            (root / name).write_bytes(raw)
    return str(root / source)


@pytest.mark.parametrize("case", BAD_SOURCES)
def test_cli_bad_input_is_one_line_and_writes_nothing(tmp_path, case):
    """prepare() raises ValueError/FileNotFoundError, main() turns it into one line
    `01_data.py: error: ...` (SystemExit, no traceback), and --out is never created. The trap is
    --tokenizer bpe: it used to save the trained tokenizer into --out before prepare refused the
    corpus (too short), and it used to train on empty text (binary or empty source)."""
    source, match, out = write_source(tmp_path, case), BAD_SOURCES[case][2], tmp_path / "out"
    with pytest.raises((ValueError, FileNotFoundError), match=re.escape(match)):
        data.prepare(source, "char", out, block_size=64)
    assert not out.exists()
    args = ["--source", source, "--out", str(out), "--vocab-size", "300", "--block-size", "64"]
    with pytest.raises(SystemExit) as e:
        data.main([*args, "--tokenizer", "bpe"])
    msg = str(e.value.code)
    assert msg.startswith("01_data.py: error: ") and "\n" not in msg and match in msg, msg
    assert not out.exists(), f"{case}: wrote {sorted(p.name for p in out.iterdir())}"


def test_cli_refuses_impossible_flags_before_reading_the_source(tmp_path, capsys):
    """A BPE vocabulary without room for the 256 bytes and <|endoftext|> used to end in an
    AssertionError traceback from train_bpe; the source named here is missing on purpose, so a
    flag that slipped through would fail on the source instead (exit status 1, not 2)."""
    impossible = (
        ["--vocab-size", "100"],
        ["--block-size", "0"],
        ["--val-fraction", "1"],
        ["--shard-tokens", "1024"],
    )  # fmt: skip (a shard must hold a window: > block size)
    for flags in impossible:
        with pytest.raises(SystemExit) as e:
            data.main([*flags, "--source", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
        assert e.value.code == 2 and "need --vocab-size >= 257" in capsys.readouterr().err, flags


def test_cli_error_through_a_real_process_has_no_traceback(tmp_path):
    """What a user sees: exit status 1 and one line on stderr, not a Python traceback."""
    source, out = write_source(tmp_path, "png-file"), tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "01_data.py", "--source", source, "--out", str(out)],
        cwd=Path(data.__file__).parent, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines() == [f"01_data.py: error: source {source!r} holds no "
                                               "text: 1 of 1 files binary (NUL or not UTF-8); "
                                               "nothing to tokenize"]  # fmt: skip
    assert not out.exists()


def test_cli_skips_binaries_in_a_folder_and_saves_the_tokenizer_with_the_shards(tmp_path, capsys):
    """A folder of text with a binary in it: the binary is skipped and counted, the shards decode
    back to the text files alone, and the BPE tokenizer (saved only once the inputs passed) is
    on disk, even after it was deleted by hand and the run repeated (prepare had nothing to do)."""
    corpus = write_corpus(tmp_path / "corpus")
    (corpus / "zz.png").write_bytes(PNG)
    out = tmp_path / "out"
    args = ["--source", str(corpus), "--out", str(out), "--vocab-size", "300", "--block-size", "64"]
    data.main(args)
    assert "skipped 1 of 7 files as binary" in capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text())
    tok = data.get_tokenizer(meta["tokenizer"])
    assert meta["tokenizer"] == str(out / "tokenizer.tiktoken")
    assert tok.n_vocab == meta["vocab_size"]
    shards = [split_tokens(out, split).tolist() for split in ("train", "val")]
    texts = [p.read_text() for p in sorted(corpus.glob("*.txt"))]
    assert tok.decode(shards[0]) + tok.decode(shards[1]) == EOT.join(texts)
    for p in out.glob("tokenizer.*"):
        p.unlink()
    data.main(args)
    printed = capsys.readouterr().out
    assert "nothing to do" in printed
    for split in ("train", "val"):  # a re-run still says what the shards hold
        assert f"{out}/{split}_*.bin: {meta[split + '_tokens']:,} tokens in 1 shard(s)" in printed
    assert data.get_tokenizer(meta["tokenizer"]).merges == tok.merges


def test_the_demo_prints_its_headlines_and_trains_on_the_train_split_only(tmp_path, capsys):
    """`python 01_data.py` prints each lesson with its check: naive == incremental BPE, our
    encoder == tiktoken's with the same merges and a loader step for two dp ranks; it cleans
    nothing (01b does). The tokenizer is trained on the train split alone: the last
    file, "qx qx ...", lies wholly in the validation tail, so no learned token may contain "qx"
    (training on all the text made "qx" its first merge)."""
    corpus = write_corpus(tmp_path / "corpus")
    (corpus / "zz.txt").write_text("qx " * 250)
    out = tmp_path / "out"
    flags = ["--vocab-size", "300", "--block-size", "64", "--val-fraction", "0.2"]
    data.main(["--source", str(corpus), "--out", str(out), *flags])
    printed = capsys.readouterr().out
    assert "ours == tiktoken: True" in printed, printed
    assert re.search(r"naive [\d.]+ s, incremental [\d.]+ s, same merges: True", printed), printed
    assert "cleaning" not in printed
    meta = json.loads((out / "meta.json").read_text())
    assert meta["documents_in"] == meta["documents_kept"] == 7 and meta["removed"] == {}
    assert "disjoint: True" in printed and "y is x shifted: True" in printed
    files = sorted(corpus.iterdir())
    cut, docs = sources.val_cut(files, 0.2), sources.iter_documents(files, [])
    pieces = [piece for doc in docs for piece in sources.split_document(doc, cut)]
    train_docs = [text for split, text in pieces if split == "train"]
    val_docs = [text for split, text in pieces if split == "val"]
    assert "qx" in "".join(val_docs) and "qx" not in "".join(train_docs)
    tok = data.get_tokenizer(str(out / "tokenizer.tiktoken"))
    assert tok.merges == data.train_bpe(EOT.join(train_docs), 300).merges
    assert not any(b"qx" in a + b for a, b in tok.merges)


def test_a_one_line_file_still_gets_a_validation_split(tmp_path):
    """The val cut moves forward to the next newline. When that newline was the file's last
    character, val was empty and prepare refused a perfectly good corpus."""
    (tmp_path / "one.txt").write_text("word " * 400 + "\n")  # 2,001 characters
    meta = data.prepare(str(tmp_path / "one.txt"), "char", tmp_path / "out", 0.1, block_size=64)
    assert meta["val_tokens"] == 2001 - int(2001 * 0.9)  # cut mid-line at the 90% mark


# ---------------------------------------------------------------------------------------------
# At scale: many shards, .jsonl sources, interrupted runs
# ---------------------------------------------------------------------------------------------
def test_tiny_shards_hold_the_one_shard_stream_document_for_document(tmp_path):
    """Shards of at most 1,000 ids, end to end, are the stream a single shard holds: the same
    documents in the same order, EOT between them, each split cut only by the size limit; and
    meta.json lists every shard with its count, in order."""
    corpus = write_corpus(tmp_path / "corpus", n_docs=8)
    one = data.prepare(str(corpus), "char", tmp_path / "one", 0.2, block_size=64)
    many = data.prepare(str(corpus), "char", tmp_path / "many", 0.2, 64, shard_tokens=1_000)
    for split in ("train", "val"):
        assert len(one["shards"][split]) == 1 and len(many["shards"][split]) > 3
        counts = [s["tokens"] for s in many["shards"][split]]
        assert all(c == 1_000 for c in counts[:-1]) and 0 < counts[-1] <= 1_000
        assert sum(counts) == many[f"{split}_tokens"] == one[f"{split}_tokens"]
        names = [s["file"] for s in many["shards"][split]]
        assert names == [f"{split}_{k:06d}.bin" for k in range(len(names))]
        tokens = split_tokens(tmp_path / "many", split)
        assert np.array_equal(tokens, split_tokens(tmp_path / "one", split))
    docs = data.CharTokenizer().decode(split_tokens(tmp_path / "many", "train").tolist())
    assert docs.split(EOT)[:3] == [(corpus / f"doc{d}.txt").read_text() for d in range(3)]
    assert sorted(p.name for p in (tmp_path / "many").iterdir()) == sorted(
        many["files"] + ["meta.json"]
    )


def test_the_loader_over_many_shards_equals_one_shard_when_windows_align(tmp_path):
    """Windows never cross a shard, so cut the stream where a window ends (shard k holds tokens
    kT .. (k+m)T, the next starts at its last token): every window is the same, and so is every
    batch of every step and rank. The one-shard folder is the layout from before shards (train.bin)."""
    T, tokens = 8, (np.arange(24 * 8 + 1) * 7 % 1000).astype(np.uint16)
    write_shard(tmp_path / "one" / "train.bin", tokens)
    cuts, shards = [0, 5 * T, 13 * T, 24 * T], []
    for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
        write_shard(tmp_path / "many" / f"train_{k:06d}.bin", tokens[a : b + 1])
        shards.append({"file": f"train_{k:06d}.bin", "tokens": b + 1 - a})
    meta = {"shards": {"train": shards, "val": []}}
    (tmp_path / "many" / "meta.json").write_text(json.dumps(meta))
    for rank in (0, 1):
        one, many = (
            data.DataLoader(tmp_path / d, "train", 3, T, 5, rank, 2) for d in ("one", "many")
        )
        assert one.n_windows == many.n_windows == 24
        for step in range(9):  # two epochs and more
            assert all(a.equal(b) for a, b in zip(one.get_batch(step), many.get_batch(step)))


def test_jsonl_gives_the_tokens_of_the_same_documents_as_text_files(tmp_path):
    """The same 5 documents as 5 files and as 5 JSON lines ("text", escapes and all) give the same
    tokens: train the first 4, val the last (val_fraction 1/5 on equal sizes cuts between them)."""
    docs = [f'doc {d}: "quoted", tab\t, é, {"x" * 200}\n' for d in range(5)]
    (tmp_path / "files").mkdir()
    for d, text in enumerate(docs):
        (tmp_path / "files" / f"{d}.txt").write_text(text)
    lines = [json.dumps({"id": d, "text": text}) for d, text in enumerate(docs)]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    a = data.prepare(str(tmp_path / "files"), "char", tmp_path / "a", 0.2, block_size=16)
    b = data.prepare(str(tmp_path / "docs.jsonl"), "char", tmp_path / "b", 0.2, block_size=16)
    assert a["documents_in"] == b["documents_in"] == a["documents_kept"] == 5
    for split in ("train", "val"):
        assert np.array_equal(
            split_tokens(tmp_path / "a", split), split_tokens(tmp_path / "b", split)
        )
    assert data.CharTokenizer().decode(split_tokens(tmp_path / "b", "val").tolist()) == docs[4]


@pytest.mark.parametrize("line", ['{"text": 3}', '{"body": "x"}', '{"text": "x"', "[1, 2]"])
def test_a_malformed_jsonl_line_is_one_line_naming_file_and_line(tmp_path, line):
    good = json.dumps({"text": "fine " * 40})
    (tmp_path / "d.jsonl").write_text(f"{good}\n\n{good}\n{line}\n{good}\n")
    with pytest.raises(
        ValueError, match=r"d\.jsonl:4: not a JSON object with a string field 'text'"
    ):
        data.prepare(str(tmp_path / "d.jsonl"), "char", tmp_path / "out", block_size=8)
    assert not (tmp_path / "out").exists()


def test_an_interrupted_preparation_leaves_no_shard_and_a_rerun_finishes_it(tmp_path, monkeypatch):
    """Killed after its second shard (an exception here; a real kill leaves the sibling
    .out.partial folder, which the next run clears): OUT holds no shard and no meta.json, and the
    rerun writes the very files of an uninterrupted run, byte for byte."""
    corpus = write_corpus(tmp_path / "corpus", n_docs=8)
    args = dict(val_fraction=0.2, block_size=64, shard_tokens=1_000)
    data.prepare(str(corpus), "char", tmp_path / "straight", **args)
    close, closed = token_files.RollingWriter.close, []

    def dying_close(self):
        if self.file is not None and len(closed) == 2:
            raise KeyboardInterrupt("killed")
        closed.append(self.file and self.path.name)
        close(self)

    monkeypatch.setattr(token_files.RollingWriter, "close", dying_close)
    with pytest.raises(KeyboardInterrupt):
        data.prepare(str(corpus), "char", tmp_path / "out", **args)
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()
    monkeypatch.setattr(token_files.RollingWriter, "close", close)
    (tmp_path / ".out.partial").mkdir()  # what a SIGKILL leaves: half a shard, in the side folder
    (tmp_path / ".out.partial" / "train_000000.tmp").write_bytes(b"half")
    data.prepare(str(corpus), "char", tmp_path / "out", **args)
    straight = {p.name: p.read_bytes() for p in (tmp_path / "straight").iterdir()}
    rerun = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    assert rerun.keys() == straight.keys() and len(rerun) > 4
    for name in straight:
        if name != "meta.json":  # (its source paths are the same; its folder is not in it)
            assert rerun[name] == straight[name], name
    assert json.loads(rerun["meta.json"]) == json.loads(straight["meta.json"])


def test_another_tokenizer_of_the_same_name_and_size_prepares_again(tmp_path):
    """The fingerprint holds the merges: two BPEs of 280 tokens learned from different text (as a
    changed --bpe-sample-mb gives) must not share shards, or the ids decode to garbage."""
    corpus = write_corpus(tmp_path / "corpus")
    text = " ".join((corpus / f"doc{d}.txt").read_text() for d in range(6))
    backwards = " ".join(word[::-1] for word in text.split())  # other pairs, other merges
    a, b = data.train_bpe(text, 280), data.train_bpe(backwards, 280)
    assert a.merges != b.merges and a.n_vocab == b.n_vocab
    for tok in (a, b):
        data.prepare(str(corpus), tok, tmp_path / "out", 0.2, block_size=16, tokenizer_name="bpe")
        assert tok.decode(split_tokens(tmp_path / "out", "val").tolist()).endswith(
            (corpus / "doc5.txt").read_text()
        )


def test_two_preparations_of_one_folder_take_turns(tmp_path):
    """A lock on OUT: the second waits, then finds the first's work done (without it both cleared
    one staging folder and one died, or renamed the other's half shard into place)."""
    corpus, errors = write_corpus(tmp_path / "corpus", n_docs=8), []

    def run():
        try:
            data.prepare(str(corpus), "char", tmp_path / "out", 0.2, 64, shard_tokens=500)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    data.prepare(str(corpus), "char", tmp_path / "one", 0.2, 64, shard_tokens=500)
    for split in ("train", "val"):
        assert np.array_equal(
            split_tokens(tmp_path / "out", split), split_tokens(tmp_path / "one", split)
        )


def test_big_documents_are_refused_and_lone_surrogates_repaired(tmp_path, monkeypatch):
    """A document is encoded whole, ~20x its size in memory: a file over MAX_DOCUMENT_BYTES is a
    one-line error (split it), not a machine out of memory. A JSON line may hold a lone UTF-16
    surrogate (web dumps do); it becomes U+FFFD, as tiktoken would make it, not a crash."""
    monkeypatch.setattr(sources, "MAX_DOCUMENT_BYTES", 1_000)
    (tmp_path / "big.txt").write_text("x" * 1_001)
    with pytest.raises(ValueError, match="one document: split it"):
        data.prepare(str(tmp_path / "big.txt"), "char", tmp_path / "out", block_size=8)
    lines = [json.dumps({"text": "ok " * 20}), '{"text": "half a pair \\ud83d here"}'] * 3
    (tmp_path / "s.jsonl").write_text("\n".join(lines))
    data.prepare(str(tmp_path / "s.jsonl"), "char", tmp_path / "j", 0.4, block_size=8)
    text = data.CharTokenizer().decode(
        np.concatenate([split_tokens(tmp_path / "j", s) for s in ("train", "val")]).tolist()
    )
    assert "half a pair \ufffd here" in text


# ---------------------------------------------------------------------------------------------
# The loader
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    write_shard(out / "train.bin", (np.arange(10_001) % 60_000).astype(np.uint16))
    return out


def test_batches_are_a_pure_function_of_seed_step_and_rank(shard_dir):
    a = data.DataLoader(shard_dir, "train", 4, 16, seed=1, dp_rank=1, dp_size=2)
    b = data.DataLoader(shard_dir, "train", 4, 16, seed=1, dp_rank=1, dp_size=2)
    for step in [5, 0, 77, 5]:  # any order: no hidden iterator state
        xa, ya = a.get_batch(step)
        xb, yb = b.get_batch(step)
        assert xa.equal(xb) and ya.equal(yb)
        assert xa.shape == (4, 16) and xa.dtype == torch.int64
        assert ya[:, :-1].equal(xa[:, 1:])  # y is x shifted by one token
    c = data.DataLoader(shard_dir, "train", 4, 16, seed=2, dp_rank=1, dp_size=2)
    assert not c.get_batch(5)[0].equal(a.get_batch(5)[0])


@pytest.mark.parametrize("dp_size", [2, 4])
def test_dp_ranks_get_disjoint_windows_and_an_epoch_repeats_none(shard_dir, dp_size):
    loaders = [
        data.DataLoader(shard_dir, "train", 3, 16, seed=0, dp_rank=r, dp_size=dp_size)
        for r in range(dp_size)
    ]
    epoch = []
    for step in range(loaders[0].steps_per_epoch):
        ids = [set(ld.window_ids(step).tolist()) for ld in loaders]
        assert sum(map(len, ids)) == len(set().union(*ids)) == 3 * dp_size  # disjoint
        epoch.extend(set().union(*ids))
    assert len(epoch) == len(set(epoch))  # no window twice in one epoch
    assert loaders[0].position(loaders[0].steps_per_epoch + 2) == (1, 2)


def test_every_epoch_reads_every_window_once_in_a_new_order(tmp_path):
    """Epoch e shuffles with the seed (seed, e). Seeding by `seed` alone, or keeping epoch 0's
    cached permutation, replays one order every epoch: as sets the epochs below would still be
    equal, but as sequences they would no longer differ. Token t sits at position t, so a row's
    window is x[0] // T, read from the batches themselves. 12 windows of T=8, B=2: an epoch is 6
    steps at dp=1 and 3 at dp=2 (the ranks together read the epoch)."""
    T, n_windows = 8, 12
    write_shard(tmp_path / "train.bin", np.arange(n_windows * T + 1, dtype=np.uint16))
    for dp in (1, 2):
        loaders = [data.DataLoader(tmp_path, "train", 2, T, 5, r, dp) for r in range(dp)]
        spe = loaders[0].steps_per_epoch
        assert spe * dp * 2 == n_windows, "no window left over: each epoch is all of them"

        def epoch(e, loaders=loaders, spe=spe) -> list[int]:
            steps = range(e * spe, (e + 1) * spe)
            return [w for s in steps for ld in loaders for w in (ld.get_batch(s)[0][:, 0] // T)]

        orders = [[int(w) for w in epoch(e)] for e in (0, 1, 2)]
        for e, order in enumerate(orders):  # no window twice in an epoch, so none in a batch
            assert sorted(order) == list(range(n_windows)), f"dp={dp} epoch {e}: {order}"
        assert orders[0] != orders[1] != orders[2] != orders[0], f"dp={dp}: one order {orders}"
        assert [int(w) for w in epoch(0)] == orders[0], "back to epoch 0: the same order again"


def test_window_count_is_hand_computed_and_every_last_window_is_read(tmp_path):
    """T = 8, a window is T + 1 = 9 tokens at stride 8. A shard of 96 tokens holds
    (96 - 1) // 8 = 11 windows (starts 0, 8, ..., 80; one at 88 would need token 96, which
    is not there); one of 97 holds 12 (the last starts at 88 and ends on token 96, the
    shard's last). Over the two shards: 23. An epoch at B = 1 reads each window once, every
    row is 9 consecutive tokens of one shard (the second shard's tokens start at 1000, so a
    row across the two would jump), and both shards' last windows (80 and 1088) are read."""
    T = 8
    lengths = [96, 97]
    shards = []
    for k, (n, first) in enumerate(zip(lengths, [0, 1000])):
        name = f"train_{k:06d}.bin"
        write_shard(tmp_path / name, np.arange(first, first + n, dtype=np.uint16))
        shards.append({"file": name, "tokens": n})
    meta = {"shards": {"train": shards, "val": []}}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    loader = data.DataLoader(tmp_path, "train", 1, T, seed=4)
    assert loader.n_windows == 11 + 12 and loader.steps_per_epoch == 23
    starts = []
    for step in range(23):
        x, y = loader.get_batch(step)
        row = torch.cat([x[0], y[0, -1:]]).tolist()  # the window's 9 tokens
        assert row == list(range(row[0], row[0] + T + 1)), f"step {step}: {row}"
        starts.append(row[0])
    want = [8 * i for i in range(11)] + [1000 + 8 * i for i in range(12)]
    assert sorted(starts) == want and 80 in starts and 1088 in starts


@pytest.mark.parametrize("n", [1, 2, 3, 12, 16, 17, 1000, 4097])
def test_the_computed_shuffle_is_a_permutation_for_any_size(n):
    """Cycle-walking restricts the Feistel network's bijection of range(4^h) to range(n):
    every item once, whatever n (a power of 4 or not, 1 and 2 included); the same order for
    the same (seed, epoch), another for another seed or epoch (n > 3: 2 of 3 orders of 3
    may coincide by chance, 1 in 6)."""
    order = data.shuffled(np.arange(n), n, seed=1, epoch=0).tolist()
    assert sorted(order) == list(range(n))
    assert data.shuffled(np.arange(n), n, 1, 0).tolist() == order
    if n > 3:
        assert data.shuffled(np.arange(n), n, 1, 1).tolist() != order
        assert data.shuffled(np.arange(n), n, 2, 0).tolist() != order


def test_the_computed_shuffle_spreads_each_position_evenly():
    """Over 3,000 (seed, epoch) keys, position 0 of range(10) lands on each item ~300 times:
    binomial sd sqrt(3000 * 0.1 * 0.9) = 16.4, so within 300 +- 90 (5.5 sd; a miss by chance
    ~1e-7 per item). A network whose keys do not reach the rounds, or a fixed-point-heavy
    walk, puts it on one item or a few."""
    hits = np.zeros(10, int)
    for key in range(3000):
        hits[data.shuffled([0], 10, seed=key, epoch=key % 7)[0]] += 1
    assert np.abs(hits - 300).max() <= 90, hits


def splitmix64_by_hand(seed: int, stream: int, i: int) -> int:
    """support/data/splitmix.py's key chain on Python's own integers (no NumPy): splitmix64's step
    x -> mix(x + 0x9E37...), chained over seed, stream and the index, mod 2^64."""
    m = 2**64 - 1

    def step(x: int) -> int:
        x = (x + 0x9E3779B97F4A7C15) & m
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
        return x ^ (x >> 31)

    return step(step(step(seed & m) ^ (stream & m)) ^ i)


def test_the_shuffle_order_is_pinned_across_library_versions():
    """The loader's order must not move when NumPy does (a resume after an upgrade would
    repeat or skip windows), so its keys are integer arithmetic and these outputs are fixed.
    splitmix64's step from state 0 is its published first output, 0xE220A8397B1DCDAF; the
    keys equal the chain on Python integers. The two orders were printed once and checked by
    hand to hold each of 0..9 and 0..16 once (17 is no power of 4: cycle-walking runs); a
    change of key derivation, round count, round function or walk changes them."""
    assert int(splitmix.mix(np.array([splitmix.GOLDEN]))[0]) == 0xE220A8397B1DCDAF
    for seed, stream in [(0, 0), (5, 1), (-3, 2**40)]:
        want = [splitmix64_by_hand(seed, stream, i) for i in range(data.ROUNDS)]
        assert splitmix.splitmix64(seed, stream, data.ROUNDS).tolist() == want
    want = [2, 0, 7, 8, 1, 3, 4, 5, 6, 9]
    assert data.shuffled(np.arange(10), 10, 0, 0).tolist() == want
    want = [11, 1, 16, 14, 4, 13, 10, 8, 15, 0, 7, 6, 9, 3, 12, 5, 2]
    assert data.shuffled(np.arange(17), 17, 5, 1).tolist() == want


PEAK_CHILD = """
import importlib, sys
from support.data import token_files
token_files.ENCODE_BATCH_CHARS = 1_000_000  # a small batch: the corpus's share shows early
importlib.import_module("01_data").main(sys.argv[1:])
status = open("/proc/self/status").read().splitlines()
print("VmHWM", [int(x.split()[1]) for x in status if x.startswith("VmHWM")][0])
"""


def prepare_in_a_child(tmp_path, megabytes: int) -> int:
    """`python 01_data.py --tokenizer char` on a generated .jsonl of `megabytes` MB, in a
    fresh process: its peak resident memory in KiB (VmHWM, the child's own; getrusage's
    ru_maxrss would carry the pytest parent's pages over the fork)."""
    r = np.random.default_rng(megabytes)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(r.choice(letters, r.integers(3, 10))) for _ in range(5000)]
    tmp_path.mkdir()
    src = tmp_path / "corpus.jsonl"
    with open(src, "w") as f:
        while f.tell() < megabytes * 1e6:  # documents of ~600 words, ~4 KB
            doc = " ".join(words[i] for i in r.integers(len(words), size=600))
            f.write(json.dumps({"text": doc}) + "\n")
    argv = ["--source", str(src), "--tokenizer", "char", "--out", str(tmp_path / "o")]
    argv = [*argv, "--shard-tokens", "2000000"]
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run(
        [sys.executable, "-c", PEAK_CHILD, *argv], cwd=root, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return int(run.stdout.split("VmHWM")[-1])


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs Linux's /proc")
def test_preparation_memory_does_not_grow_with_the_corpus(tmp_path):
    """01's whole run (encode, shards, then the demo's two loaders) on 3 MB and on 9 MB of
    .jsonl, one id a byte (char): the peaks differ by under 6 MiB. What may grow: malloc's
    noise (~1 MiB measured; 01b's exact-dedup key set would add ~75 B a document, 0.1 MB
    for the 1,500 more here). The loaders' stored permutations of every window (8 B a window
    of 8 ids, two loaders: 2 B an id, and the shuffle's temporaries) grew by 17 MiB for
    these 6M more ids (measured; issue 30's 0.8 MB per MB of GPT-2 tokens), so 6 MiB is a
    third of the old growth and several times the new."""
    small = prepare_in_a_child(tmp_path / "small", 3)
    large = prepare_in_a_child(tmp_path / "large", 9)
    assert large - small < 6 * 1024, f"peak {small / 1024:.0f} -> {large / 1024:.0f} MiB"


def test_loader_errors_are_clear(tmp_path, shard_dir):
    with pytest.raises(FileNotFoundError, match="prepare the data first"):
        data.DataLoader(tmp_path, "train", 4, 16)
    with pytest.raises(ValueError, match="one step needs dp_size\\*batch_size"):
        data.DataLoader(shard_dir, "train", 400, 16, dp_size=2)
