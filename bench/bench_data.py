"""Benchmark 01_data.py: BPE training speed and data-preparation throughput.

    python bench/bench_data.py            # a few minutes on 2 CPU cores (--skip-reference: ~1)

1. The same 300 KB of text at vocab 512, three trainers side by side: ours (incremental pair
   counts), our naive trainer (recounts every pair after each merge, as minbpe) and tiktoken's
   reference trainer (`tiktoken._educational.bpe_train`, also a full recount). Target:
   ours >= 50x faster than the reference.
2. Ours at vocab 4,096 on the whole standard-library corpus (~10 MB once 01 leaves out the
   generated tables). Target: <= 20 s.
3. Preparation throughput: tiktoken's threaded batch encoder, in MB/s, GPT-2 and our BPE.

`--shakespeare` runs them on tiny-shakespeare instead (downloaded once into data/downloads/, the
only network use; then `python 01_data.py --source data/downloads/tinyshakespeare.txt`).
"""

import argparse
import importlib
import os
import platform
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
data = importlib.import_module("01_data")
SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def download_shakespeare(cache_dir="data/downloads") -> Path:
    """Fetch tiny-shakespeare once into a cache (only when the user asks for it)."""
    path = Path(cache_dir) / "tinyshakespeare.txt"
    try:
        if not path.is_file():
            with urllib.request.urlopen(SHAKESPEARE_URL, timeout=20) as r:
                data.atomic_write(path, lambda tmp: tmp.write_bytes(r.read()))
    except OSError as e:  # urllib's URLError is an OSError
        raise RuntimeError(
            f"could not download tiny-shakespeare from {SHAKESPEARE_URL} ({e}); "
            "if you are offline, give 01_data.py a local text file: --source path/to/file.txt"
        ) from e
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--skip-reference",
        action="store_true",
        help="skip the two full-recount trainers of [1] (minutes on 2 cores)",
    )
    parser.add_argument(
        "--shakespeare", action="store_true", help="tiny-shakespeare (downloaded once), not stdlib"
    )
    args = parser.parse_args(argv)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}"
    )
    files = [download_shakespeare()] if args.shakespeare else data.stdlib_files()
    docs = data.read_documents(files)
    corpus = data.EOT.join(docs)
    small = corpus.replace(data.EOT, "\n")[:300_000]  # the reference trainer knows no specials

    fast, ours = timed(data.train_bpe, small, 512, special_tokens=())
    print(f"[1] 300 KB, vocab 512: ours {ours:6.2f} s", end="", flush=True)
    if not args.skip_reference:
        from tiktoken._educational import bpe_train

        naive, t_naive = timed(data.train_bpe_naive, small, 512, special_tokens=())
        _, ref = timed(bpe_train, small, 512, data.GPT2_SPLIT_PATTERN, visualise=None)
        print(
            f" | our naive {t_naive:6.1f} s (same merges: {naive.merges == fast.merges}, "
            f"{t_naive / ours:4.0f}x) | tiktoken._educational {ref:6.1f} s | speed-up "
            f"{ref / ours:5.0f}x (target >= 50x)"
        )
    else:
        print()

    tok, full = timed(data.train_bpe, corpus, 4096)
    mb = len(corpus.encode()) / 1e6
    print(f"[2] {mb:.1f} MB, vocab 4096: ours {full:6.2f} s (target <= 20 s)")

    encoders = {"ours (via tiktoken)": tok.to_tiktoken()}
    try:
        encoders["gpt2"] = data.get_tokenizer("gpt2")
    except RuntimeError as e:
        print(f"    gpt2 unavailable: {e}")
    for name, enc in encoders.items():
        ids, t = timed(data.encode_documents, enc, docs, enc.eot_token, name)
        print(
            f"[3] prepare/encode {name:20s} {mb / t:6.1f} MB/s ({len(ids):,} tokens, "
            f"{os.cpu_count()} threads)"
        )


if __name__ == "__main__":
    main()
