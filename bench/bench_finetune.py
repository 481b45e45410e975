"""bench/bench_finetune.py: fine-tuning on a CPU, all weights against LoRA, from a small GPT-2-layout
model, on a text the base model never saw.

1. The base: `train.py --model small --tokenizer gpt2` (4 blocks of 128, GPT-2's 50,257-token
   vocabulary) trained for --base-steps on data/stdlib-gpt2 (Python's standard library), exported
   and written in Hugging Face's GPT-2 layout (support/train/export.to_hf_state_dict, config.json):
   what `--init-from` reads, as it would read GPT-2's own files.
2. The new text: this repository's docs/*.md (English prose about training), GPT-2's tokenizer.
3. --steps of fine-tuning each, from the same base and the same batches: every weight (--lr-full)
   and LoRA at --lora-rank (--lr-lora). Printed: the validation loss before and after,
   tokens/s (the median of train.py's log rows), the parameters that train, and AdamW's state,
   measured after one step beside its formula: 2 moments x 4 bytes per trained number, plus a
   4-byte step count per tensor.

    python bench/bench_finetune.py          (about 5 minutes on 2 CPU cores; needs GPT-2's
                                             tokenizer files: TIKTOKEN_CACHE_DIR)
"""

import argparse
import importlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the repo root: numbered files, train.py
from bench import timing  # noqa: E402

data_lib = importlib.import_module("01_data")
model_lib = importlib.import_module("02_model")
export_lib = importlib.import_module("support.train.export")
train = importlib.import_module("train")


def rows(out_dir, kind):
    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def base_model(work: Path, args) -> Path:
    """Pretrain the small model on Python's standard library; write it in GPT-2's layout."""
    run = work / "base"
    argv = ["--model", "small", "--tokenizer", "gpt2", "--max-steps", str(args.base_steps)]
    argv += ["--batch-size", "16", "--micro-batch-size", "16", "--lr", "3e-3"]
    argv += ["--warmup-steps", str(min(20, args.base_steps)), "--eval-interval", "0"]
    argv += ["--eval-steps", "4", "--ckpt-interval", "0", "--sample-tokens", "0"]
    argv += ["--dtype", "fp32", "--seed", str(args.seed), "--out-dir", str(run)]
    if args.base_data:
        argv += ["--data-dir", args.base_data]
    _, seconds = timing.timed(train.main, argv)
    model, _ = train.load_exported(run / "model.pt")
    folder = work / "base-hf"
    folder.mkdir()
    torch.save(export_lib.to_hf_state_dict(model), folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps({"n_head": model.config.n_head}))
    loss = rows(run, "val")[-1]["val_loss"]
    where = args.base_data or "Python's standard library"
    print(f"base: {args.base_steps} steps on {where} in {seconds:.0f} s,")
    print(f"validation loss {loss:.3f}; written as {folder}\n")
    return folder


def fine_tune(name, base: Path, text: Path, work: Path, args, extra) -> dict:
    run = work / name
    argv = ["--init-from", str(base), "--model", "small", "--tokenizer", "gpt2"]
    argv += ["--data-dir", str(text), "--max-steps", str(args.steps), "--batch-size", "8"]
    argv += ["--micro-batch-size", "8", "--warmup-steps", str(min(5, args.steps))]
    argv += ["--lr-schedule", "constant", "--eval-interval", "0", "--eval-steps", "1"]
    argv += ["--log-interval", "5", "--ckpt-interval", "0"]
    argv += ["--sample-tokens", "0", "--dtype", "fp32", "--seed", str(args.seed)]
    train.main(argv + ["--out-dir", str(run)] + extra)
    logged = rows(run, "train")
    speed = statistics.median(r["tokens_per_s"] for r in logged[1:] or logged)
    return dict(after=rows(run, "val")[-1]["val_loss"], tokens_per_s=speed)


def validation_loss(model, text: Path, seed: int) -> float:
    """The loss on train.py's validation batch (--eval-steps 1), before any fine-tuning step
    (train.py's own first evaluation comes after step 0's update)."""
    x, y = data_lib.DataLoader(text, "val", 8, 128, seed=seed).get_batch(0)
    with torch.no_grad():
        return model(x, y)[1].item()


def adamw_state(lora_rank: int) -> tuple:
    """(trained numbers, AdamW state bytes measured after one step, the formula's bytes)."""
    torch.manual_seed(0)
    config = model_lib.GPTConfig.from_preset("small", vocab_size=50257, pad_vocab_multiple=64)
    model = model_lib.GPT(config)
    if lora_rank:
        model_lib.apply_lora(model, lora_rank, alpha=16.0)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained)
    x = torch.randint(0, 50257, (2, config.block_size))
    model(x, x)[1].backward()
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    n = sum(p.numel() for p in trained)
    measured = sum(t.numel() * t.element_size() for t in state)
    return n, measured, 2 * 4 * n + 4 * len(trained)


def main(argv=None):
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=formatter)
    parser.add_argument("--base-steps", type=int, default=200, help="the base model's training")
    parser.add_argument("--steps", type=int, default=60, help="fine-tuning steps of 8 x 128 tokens")
    parser.add_argument("--lr-full", type=float, default=1e-3, help="every weight's fine-tuning")
    parser.add_argument("--lr-lora", type=float, default=3e-3, help="LoRA's (its factors only)")
    parser.add_argument("--lora-rank", type=int, default=8, help="r; alpha is 16")
    parser.add_argument("--seed", type=int, default=1337, help="init and data order")
    base_data = "the base's --data-dir, GPT-2 tokens ('': data/stdlib-gpt2, made if missing)"
    parser.add_argument("--base-data", default="", help=base_data)
    args = parser.parse_args(argv)
    print(timing.machine("fp32") + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = base_model(work, args)
        text = work / "docs-gpt2"
        data_lib.prepare(str(ROOT / "docs" / "*.md"), "gpt2", text, block_size=128)
        lora = ["--lr", str(args.lr_lora), "--lora-rank", str(args.lora_rank)]
        full = ["--lr", str(args.lr_full)]
        runs = {"full": fine_tune("full", base, text, work, args, full)}
        runs[f"LoRA r={args.lora_rank}"] = fine_tune("lora", base, text, work, args, lora)
        before = validation_loss(model_lib.GPT.load_pretrained(base), text, args.seed)
    print(f"\nfine-tuning on docs/*.md, {args.steps} steps of 8 x 128 tokens from the same")
    print(f"base (validation loss before: {before:.3f})")
    head = f"{'':<12} {'val after':>10} {'tokens/s':>9} {'trained':>11}"
    print(f"{head} {'AdamW state':>14} {'formula':>14}")
    for (name, r), rank in zip(runs.items(), (0, args.lora_rank)):
        n, measured, formula = adamw_state(rank)
        row = f"{name:<12} {r['after']:>10.3f} {r['tokens_per_s']:>9,.0f} {n:>11,}"
        print(f"{row} {measured:>12,} B {formula:>12,} B")
    print("AdamW state: 2 moments x 4 bytes per trained number + a 4-byte step per tensor")


if __name__ == "__main__":
    main()
