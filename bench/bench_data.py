"""Benchmark 01_data.py and 01b_cleaning.py: BPE training speed and data-preparation throughput.

    python bench/bench_data.py            # a few minutes on 2 CPU cores (--skip-reference: ~1)

1. The same 300 KB of text at vocab 512, three trainers side by side: ours (incremental pair
   counts), our naive trainer (recounts every pair after each merge, as minbpe) and tiktoken's
   reference trainer (`tiktoken._educational.bpe_train`, also a full recount). Target:
   ours >= 50x faster than the reference.
2. Ours at vocab 4,096 on the whole standard-library corpus (~10 MB once 01 leaves out the
   generated tables). Target: <= 20 s.
3. Preparation throughput: `prepare` (read, split, tiktoken's threaded batch encoder, shards),
   in MB/s, GPT-2 and our BPE, on the standard library; and bytes per token of ours, GPT-2 and
   char on the last 5% of the corpus (the validation split, which no tokenizer trained on).
4. `--corpus-gb 1`: preparation at scale. The bench writes a corpus of .jsonl files (generated
   prose: sentences of the standard library's words, Zipf-weighted, ~700 words a document, 1% of
   them exact and 1% near copies of earlier ones; into data/bench-prose/, not committed) and
   prepares it with GPT-2's tokenizer in a fresh process three times: without cleaning, with
   01b's default exact deduplication, and with --quality gopher --dedup minhash. For each: MB/s,
   time per GB, what was removed, the peak resident memory of that process (target: under 1
   GiB, whatever the corpus size), and the extrapolation to a corpus of 10 billion tokens.

5. `--memory-mb 300,900`: 01's whole run (`python 01_data.py --tokenizer gpt2 --shard-tokens
   20000000`: encode, shards, the demo's loaders) on one generated .jsonl file of each
   size (random words, in data/bench-memory/, deleted after), in a fresh process each: the peak
   resident memory of each (VmHWM), and the difference (issue 30: within 100 MB of each other,
   each under 1 GiB). Before the loader's shuffle was computed (01's `shuffled`), a stored
   permutation of every window grew ~0.8 MB per MB of text.

`--source` runs [1] to [3] on another text than the standard library: a local file, folder or
glob, or `shakespeare` (01's source option: support/data/sources.py downloads tiny-shakespeare once
into data/downloads/ when asked, the course's only network use). `--small-kb 20 --vocab-size
300 --skip-reference` on a small local file only tries the script (tests/test_bench.py).
"""

import argparse
import collections
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import timing  # noqa: E402

data = importlib.import_module("01_data")
clean = importlib.import_module("01b_cleaning")
files_lib = importlib.import_module("support.files")
sources = importlib.import_module("support.data.sources")


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--skip-reference",
        action="store_true",
        help="skip the two full-recount trainers of [1] (minutes on 2 cores)",
    )
    parser.add_argument("--source", default="stdlib", help="01's --source: what [1]-[3] read")
    parser.add_argument("--small-kb", type=int, default=300, help="[1]: text of this many KB")
    parser.add_argument("--vocab-size", type=int, default=4096, help="[2]: ours on all of it")
    parser.add_argument(
        "--corpus-gb", type=float, default=0, help="[4]: a corpus this big (0: skip)"
    )
    parser.add_argument(
        "--memory-mb", default="", help="[5] alone: peak RSS at these sizes, e.g. 300,900"
    )
    args = parser.parse_args(argv)
    if args.memory_mb:
        return peak_memory([float(mb) for mb in args.memory_mb.split(",")])
    print(timing.machine(f"Python {platform.python_version()}"))
    files = sources.source_files(args.source)  # shakespeare: downloaded here, once
    docs = [text for _, _, text, _ in sources.iter_documents(files, [])]
    corpus = data.EOT.join(docs)
    # The reference trainer knows no special tokens.
    small = corpus.replace(data.EOT, "\n")[: args.small_kb * 1000]
    vocab = min(512, args.vocab_size)
    fast, ours = timing.timed(data.train_bpe, small, vocab, special_tokens=())
    print(f"[1] {args.small_kb} KB, vocab {vocab}: ours {ours:6.2f} s", end="", flush=True)
    if not args.skip_reference:
        from tiktoken._educational import bpe_train

        naive, t_naive = timing.timed(data.train_bpe_naive, small, vocab, special_tokens=())
        pattern = data.GPT2_SPLIT_PATTERN
        _, ref = timing.timed(bpe_train, small, vocab, pattern, visualise=None)
        print(
            f" | our naive {t_naive:6.1f} s (same merges: {naive.merges == fast.merges}, "
            f"{t_naive / ours:4.0f}x) | tiktoken._educational {ref:6.1f} s | speed-up "
            f"{ref / ours:5.0f}x (target >= 50x)"
        )
    else:
        print()

    tok, full = timing.timed(data.train_bpe, corpus, args.vocab_size)
    mb = len(corpus.encode()) / 1e6
    print(f"[2] {mb:.1f} MB, vocab {args.vocab_size}: ours {full:6.2f} s (target <= 20 s)")

    tokenizers = {"ours": tok}
    try:
        tokenizers["gpt2"] = data.get_tokenizer("gpt2")
    except RuntimeError as e:
        print(f"    gpt2 unavailable: {e}")
    val = corpus[int(0.95 * len(corpus)) :]  # as 01's --val-fraction 0.05: no tokenizer saw it
    ratios = {k: len(val.encode()) / len(t.encode_ordinary(val)) for k, t in tokenizers.items()}
    ratios["char"] = 1.0  # one token a byte
    print(
        "[3] bytes per token on the last 5%: "
        + ", ".join(f"{k} {r:.2f}" for k, r in ratios.items())
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name, t in tokenizers.items():
            out = Path(tmp) / name
            meta, took = timing.timed(data.prepare, args.source, t, out, block_size=64)
            mb = meta["n_bytes"] / 1e6
            tokens = meta["train_tokens"] + meta["val_tokens"]
            what = f"{mb:.1f} MB, {tokens:,} tokens, {os.cpu_count()} threads"
            print(f"[3] prepare {name:5s} {mb / took:6.1f} MB/s ({what})")
    if args.corpus_gb:
        at_scale(corpus, args.corpus_gb)


def prose_corpus(corpus: str, gb: float, folder="data/bench-prose", seed=0) -> tuple[Path, float]:
    """[4]'s corpus, written once (128 MB a file) and reused: documents of 15 to 90 sentences of 4
    to 20 words drawn from the corpus's 20,000 commonest words (Zipf weights: word k has weight
    1/k), the eight stop words Gopher counts spread in; 1% exact and 1% near copies (one sentence
    changed) of earlier documents. Distinct, prose-shaped text: cleaning does all its work and
    removes little, so its cost is not hidden by documents it drops before the encoder."""
    out = Path(folder)
    rng = np.random.default_rng(seed)
    counts = collections.Counter(w for w in clean.WORD.findall(corpus) if w.isalpha())
    stop = clean.STOP_WORDS.split("|")
    vocab = np.array([w.lower() for w, _ in counts.most_common(20_000)] + stop)
    weights = 1 / np.arange(1, len(vocab) + 1)
    weights[-len(stop) :] = weights[0]  # stop words as common as the commonest word
    weights /= weights.sum()

    def document() -> list[str]:
        lengths = rng.integers(4, 21, rng.integers(15, 91))
        words = vocab[rng.choice(len(vocab), lengths.sum(), p=weights)]
        return [" ".join(s).capitalize() + "." for s in np.split(words, np.cumsum(lengths)[:-1])]

    files = []
    size = 0
    kept = []
    while size < gb * 1e9:
        path = out / f"part_{len(files):03d}.jsonl"
        files.append(path)
        if not path.is_file():
            lines = []
            n = 0
            while n < 128e6 and size + n < gb * 1e9:
                roll = rng.random()
                # A copy of an earlier document: exact, or one sentence new.
                if roll < 0.02 and kept:
                    doc = list(kept[rng.integers(len(kept))])
                    if roll < 0.01:
                        doc[rng.integers(len(doc))] = document()[0]
                else:
                    doc = document()
                    kept = kept[-999:] + [doc]  # the originals copies are drawn from
                lines.append(json.dumps({"text": " ".join(doc)}) + "\n")
                n += len(lines[-1])
            files_lib.atomic_write(path, lambda tmp, c=lines: tmp.write_text("".join(c)))
        size += path.stat().st_size
    return out, size


def at_scale(corpus: str, gb: float, folder="data/bench-prose"):
    """[4]: prepare the prose corpus with GPT-2's tokenizer in a child process per cleaning setting
    (its peak RSS from /proc/self/status's VmHWM, the child's own: getrusage's ru_maxrss would
    carry the parent's over the fork and exec, 755 MiB here whatever the child did)."""
    out, size = prose_corpus(corpus, gb, folder)
    print(f"[4] {size / 1e9:.2f} GB of .jsonl in {out}; preparing with gpt2 ...", flush=True)
    root = Path(__file__).resolve().parents[1]
    base = None
    for quality, dedup in (("none", "none"), ("none", "exact"), ("gopher", "minhash")):
        target = f"{out}-gpt2-{quality}-{dedup}"
        shutil.rmtree(target, ignore_errors=True)  # prepared before: it would do nothing
        argv = [sys.executable, "-c", PREPARE_CHILD, str(out), target, quality, dedup]
        run, took = timing.timed(subprocess.run, argv, cwd=root, capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"[4] preparing {out} failed: {run.stderr.strip().splitlines()[-1]}")
        meta = json.loads(run.stdout.strip().splitlines()[-1])
        shutil.rmtree(target, ignore_errors=True)  # ~1 GB of shards each
        tokens = meta["train_tokens"] + meta["val_tokens"]
        gb_text = meta["n_bytes"] / 1e9
        per_gb = took / gb_text
        tokens_per_gb = tokens / gb_text
        base = base or took
        removed = ", ".join(f"{n:,} {why}" for why, n in meta["removed"].items()) or "nothing"
        print(f"    --quality {quality} --dedup {dedup}: {gb_text:.2f} GB of text,")
        print(f"      {meta['documents_in']:,} documents, removed {removed} -> {tokens:,} tokens")
        speed = f"{gb_text * 1e3 / took:.1f} MB/s, {per_gb:.0f} s per GB"
        print(f"      in {took:.0f} s: {speed} ({took / base:.2f}x the uncleaned time)")
        peak = meta["peak"] / 2**10
        print(f"      peak RSS {peak:.0f} MiB (target < 1,024)")
        hours = 10e9 / tokens_per_gb * per_gb / 3600
        text_gb = 10e9 / tokens_per_gb
        print(f"      10 billion tokens ({text_gb:.0f} GB of such text): {hours:.1f} h on these")
        print(f"      {os.cpu_count()} cores")


PREPARE_CHILD = """
import importlib, json, sys
cleaning = importlib.import_module("01b_cleaning")
source, target, quality, dedup = sys.argv[1:]
m = cleaning.prepare(source, "gpt2", target, block_size=1024, quality=quality, dedup=dedup)
status = open("/proc/self/status").read().splitlines()
m["peak"] = [int(x.split()[1]) for x in status if x.startswith("VmHWM")][0]
print(json.dumps({k: v for k, v in m.items() if k not in ("shards", "files")}))
"""


PEAK_CHILD = """
import importlib, sys
importlib.import_module("01_data").main(sys.argv[1:])
status = open("/proc/self/status").read().splitlines()
print("VmHWM", [int(x.split()[1]) for x in status if x.startswith("VmHWM")][0])
"""


def random_jsonl(path: Path, mb: float, seed: int = 0) -> None:
    """`mb` MB of .jsonl documents of ~700 random words (a 20,000-word vocabulary)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = ["".join(rng.choice(letters, rng.integers(2, 9))) for _ in range(20_000)]
    vocab += ["the", "of", "and", "to", "be", "that", "have", "with"]  # Gopher's stop words
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        while f.tell() < mb * 1e6:
            words = rng.integers(len(vocab), size=rng.integers(300, 1100))
            f.write(json.dumps({"text": " ".join(vocab[i] for i in words)}) + "\n")


def peak_memory(sizes_mb: list, folder=Path("data/bench-memory")) -> None:
    """[5]: 01's whole run on one .jsonl of each size, in a fresh process: its peak RSS."""
    print(timing.machine(f"Python {platform.python_version()}"))
    root = Path(__file__).resolve().parents[1]
    peaks = []
    for mb in sizes_mb:
        src = folder / f"random_{mb:g}mb.jsonl"
        out = folder / f"out_{mb:g}mb"
        random_jsonl(src, mb)
        argv = ["--source", str(src), "--tokenizer", "gpt2", "--shard-tokens", "20000000"]
        argv = [sys.executable, "-c", PEAK_CHILD, *argv, "--out", str(out)]
        run, took = timing.timed(subprocess.run, argv, cwd=root, capture_output=True, text=True)
        shutil.rmtree(out, ignore_errors=True)
        src.unlink()
        if run.returncode:
            raise SystemExit(f"[5] {mb:g} MB failed: {run.stderr.strip().splitlines()[-1]}")
        peaks.append(int(run.stdout.split("VmHWM")[-1]) / 1024)
        speed = f"{took:.0f} s ({mb / took:.1f} MB/s)"
        print(f"[5] {mb:g} MB of .jsonl, gpt2: {speed}, peak RSS {peaks[-1]:.0f} MiB", flush=True)
    spread = max(peaks) - min(peaks)
    listed = ", ".join(f"{p:.0f}" for p in peaks)
    print(f"[5] peaks {listed} MiB (target < 1,024 each): spread {spread:.0f} MiB")
    print("    (issue 30: within 100 MB)")


if __name__ == "__main__":
    main()
