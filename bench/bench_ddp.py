"""bench/bench_ddp.py: our bucketed DataParallel against torch's DistributedDataParallel, naive
against bucketed, and ZeRO-1's optimizer memory per rank.

One training step = forward, backward (with the gradient all-reduce), AdamW step, on the same
GPT and the same batch for every variant. Variants alternate step by step in one run, so drift
in the machine's speed hits all alike; each number is the median step of the slowest rank. The
'compute' column is the same step under no_sync(): no communication.
Design target (DESIGN.md section 8): bucketed / DDP <= 1.10x.

Run:  python bench/bench_ddp.py [--ranks 2]      (starts torchrun for you; about a minute)
      torchrun --standalone --nproc_per_node=4 bench/bench_ddp.py
"""

import argparse
import gc
import importlib
import os
import platform
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: numbered files
ddp = importlib.import_module("03_ddp")
model_lib = importlib.import_module("02_model")
GPT, GPTConfig = model_lib.GPT, model_lib.GPTConfig

# (label, GPTConfig overrides, sequences per rank, bucket cap in MB for both ours and torch DDP)
CASES = [
    ("small, 1 MB buckets", dict(n_layer=4, n_embd=128, block_size=64), 4, 1.0),
    ("small, 25 MB buckets", dict(n_layer=4, n_embd=128, block_size=64), 4, 25.0),
    ("L6 C256, 4 MB buckets", dict(n_layer=6, n_embd=256, n_head=4, block_size=64), 2, 4.0),
]
VOCAB = 257  # the char tokenizer of 01_data.py


def machine() -> str:
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
    return f"{name}, {os.cpu_count()} CPUs, torch {torch.__version__}"


def make_variants(config, bucket_mb, device) -> dict:
    def fresh():
        torch.manual_seed(0)
        return GPT(config).to(device)

    ids = [device.index] if device.type == "cuda" else None
    models = {
        "naive": ddp.NaiveDataParallel(fresh()),
        "bucketed": ddp.DataParallel(fresh(), bucket_mb=bucket_mb),
        "torch DDP": nn.parallel.DistributedDataParallel(
            fresh(), device_ids=ids, bucket_cap_mb=bucket_mb
        ),
    }
    return {n: (m, torch.optim.AdamW(m.parameters(), lr=1e-4)) for n, m in models.items()}


def bench_case(label, overrides, batch, bucket_mb, args, rank, device) -> float:
    config = GPTConfig.from_preset("small", vocab_size=VOCAB, **overrides)
    variants = make_variants(config, bucket_mb, device)
    g = torch.Generator().manual_seed(rank)  # each rank its own rows, every variant the same
    data = torch.randint(0, VOCAB, (batch, config.block_size + 1), generator=g).to(device)
    times = ddp.time_steps(variants, data[:, :-1], data[:, 1:], args.steps, args.warmup, device)
    n_params = variants["naive"][0].module.num_params()
    n_buckets = len(variants["bucketed"][0].buckets)
    ddp.print0(f"\n{label}: {n_params / 1e6:.2f}M params ({4 * n_params / 1e6:.1f} MB of "
               f"fp32 gradients), B={batch} T={config.block_size} per rank, "
               f"{n_buckets} buckets")  # fmt: skip
    for name, (step, compute) in times.items():
        ddp.print0(f"  {name:<10} step {step * 1e3:7.1f} ms   compute {compute * 1e3:7.1f} ms   "
                   f"exposed comm {(step - compute) * 1e3:6.1f} ms")  # fmt: skip
    ratio = times["bucketed"][0] / times["torch DDP"][0]
    naive = times["naive"][0] / times["bucketed"][0]
    ddp.print0(f"  bucketed / torch DDP = {ratio:.2f}x    naive / bucketed = {naive:.2f}x")
    return ratio


def zero_memory(preset, world, device) -> None:
    """AdamW state per rank with and without ZeRO-1, measured after one step (zero gradients:
    the state's size does not depend on their values)."""
    config = GPTConfig.from_preset(preset, vocab_size=VOCAB if preset == "small" else 50257)
    torch.manual_seed(0)
    model = GPT(config).to(device)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    plain = torch.optim.AdamW(model.parameters(), lr=1e-4)
    plain.step()
    plain_bytes = ddp.optimizer_state_bytes(plain)
    del plain
    gc.collect()
    zero = ddp.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4)
    zero.step()
    per_rank = [None] * world
    dist.all_gather_object(per_rank, zero.state_bytes())
    shards = "  ".join(f"{b / 1e6:.1f}" for b in per_rank)
    ddp.print0(f"  {preset:<6} {model.num_params() / 1e6:7.2f}M params   plain AdamW "
               f"{plain_bytes / 1e6:8.1f} MB/rank   ZeRO-1 per rank: {shards} MB   "
               f"(max/plain = {max(per_rank) / plain_bytes:.3f}, "
               f"1/N = {1 / world:.3f})")  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    parser.add_argument("--ranks", type=int, default=2, help="ranks, when not under torchrun")
    parser.add_argument("--zero-presets", default="small,gpt2", help="models for ZeRO memory")
    args = parser.parse_args()
    if "WORLD_SIZE" not in os.environ:
        return ddp.relaunch_with_torchrun(args.ranks, sys.argv[1:], script=__file__)
    rank, _, world, device = ddp.init_distributed()
    try:
        ddp.print0(f"{world} ranks, {dist.get_backend()}, {machine()}, "
                   f"{torch.get_num_threads()} thread(s) per rank; "
                   f"median of {args.steps} steps")  # fmt: skip
        ratios = [bench_case(*case, args, rank, device) for case in CASES]
        listed = ", ".join(f"{r:.2f}x" for r in ratios)
        ddp.print0(f"\nbucketed / torch DDP over all cases: {listed} (target <= 1.10x)")
        ddp.print0("\nZeRO-1 optimizer state (AdamW m, v, step), measured after one step:")
        for preset in filter(None, args.zero_presets.split(",")):
            zero_memory(preset, world, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
