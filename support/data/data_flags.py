"""The command lines of 01_data.py and 01b_cleaning.py (01's flags and the cleaning ones):
their defaults and the checks made before any file is read (a bad flag costs one line,
not a minute of BPE training)."""

import argparse
import shlex
import sys

CLEANING_FLAGS = ("--quality", "--dedup", "--dedup-threshold")


def parse_args(argv, description: str, shard_tokens: int, cleaning=None):
    """The flags of `python 01_data.py`; with `cleaning` (the --quality and the --dedup
    choices), those of `python 01b_cleaning.py`: the same, and the cleaning flags."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if cleaning is None:
        refuse_cleaning_flags(argv)
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(description=description, formatter_class=formatter)
    arg = parser.add_argument
    sources_help = "stdlib (Python's source), shakespeare (downloaded once), a file, folder"
    sources_help += " or glob (.jsonl lines)"
    arg("--source", default="stdlib", help=sources_help)
    arg("--tokenizer", default="bpe", help="bpe (trained here), gpt2, char, X.tiktoken")
    vocab = "bpe: its vocabulary (256 bytes + merges + 1 special); larger takes longer"
    arg("--vocab-size", type=int, default=4096, help=vocab)
    block = "T: each split must hold one window of T+1 ids, checked here"
    arg("--block-size", type=int, default=1024, help=block)
    arg("--val-fraction", type=float, default=0.05, help="the tail held out for val")
    arg("--text-field", default="text", help="the field of a .jsonl line with the text")
    arg("--shard-tokens", type=int, default=shard_tokens, help="ids per shard at most")
    arg("--bpe-sample-mb", type=float, default=16, help="train text the BPE learns on")
    if cleaning is not None:
        add_cleaning_flags(arg, *cleaning)
    where = "data/SOURCE-TOKENIZER when not given (01b: ...-clean)"
    arg("--out", help=f"output folder; {where}")
    args = parser.parse_args(argv)
    # A BPE needs the 256 bytes and <|endoftext|>; a window never crosses a shard.
    small_vocab = args.tokenizer == "bpe" and args.vocab_size < 257
    positive = min(args.block_size, args.bpe_sample_mb) > 0
    fits = args.shard_tokens > args.block_size
    threshold = getattr(args, "dedup_threshold", 1.0)
    fractions = 0 < args.val_fraction < 1 and 0 < threshold <= 1
    if small_vocab or not positive or not fits or not fractions:
        need = "--vocab-size >= 257 for bpe, 0 < --val-fraction < 1, sizes > 0"
        need += ", 0 < --dedup-threshold <= 1"
        parser.error(f"need {need} and --shard-tokens > --block-size")
    return args


def add_cleaning_flags(arg, quality, dedup) -> None:
    """01b's flags; `quality`, `dedup`: the allowed choices."""
    arg("--quality", default="none", choices=quality, help="gopher: Gopher's rules")
    what = "exact: copies; minhash: near copies too; lines: lines seen twice (CCNet);"
    what += " all but none hold keys that grow with the corpus (docs/reference.md)"
    arg("--dedup", default="exact", choices=dedup, help=what)
    near = "minhash: a candidate pair whose estimated Jaccard similarity is >= this is"
    near += " a near duplicate (0.8: the usual FineWeb-style setting)"
    arg("--dedup-threshold", type=float, default=0.8, help=near)


def refuse_cleaning_flags(argv) -> None:
    """01 cleans nothing: a cleaning flag is one line that names 01b's command, which
    takes every flag of 01's as well."""
    named = [a for a in argv if a.split("=")[0] in CLEANING_FLAGS]
    if named:
        again = shlex.join(["python", "01b_cleaning.py", *argv])
        moved = f"{named[0].split('=')[0]} is 01b_cleaning.py's (the same pipeline, cleaned)"
        raise SystemExit(f"01_data.py: error: {moved}: run `{again}`")
