"""bench/bench_ddp.py: 03_ddp.py's data-parallel wrappers timed side by side, and ZeRO-1's memory.

Naive against bucketed, bucketed against torch's DistributedDataParallel, how much of the
all-reduce the buckets hide behind backward, and ZeRO-1's optimizer state per rank.

One training step = forward, backward (with the gradient all-reduce), AdamW step, on the same
GPT and the same batch for every variant. Variants alternate step by step in one run, so drift
in the machine's speed hits all alike; each number is the median step of the slowest rank.
Target: bucketed / DDP <= 1.10x.

The overlap table. compute: the same step without communication (under no_sync(); the naive
wrapper simply skips all_reduce_gradients()). exposed = step - compute: the communication the
step waited for. comm alone: the same collectives with no compute (naive: one blocking call per
gradient; bucketed: every bucket in flight at once). hidden = 1 - exposed / comm alone: the
share of the communication that ran behind backward. Naive starts communicating only after
backward, so nothing of it can hide (printed as —). On a CPU, gloo's threads need the very cores
the compute uses, so little can hide (on 2 cores, about 0%); on GPUs NCCL runs beside the
kernels, on its own stream, and the buckets hide most of it.

Run:  python bench/bench_ddp.py [--ranks 2]      (starts torchrun for you; about a minute)
      torchrun --standalone --nproc_per_node=4 bench/bench_ddp.py
"""

import argparse
import gc
import importlib
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

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
TIMED = ("naive", "bucketed", "torch DDP")


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


def timed_step(model, opt, x, y, communicate: bool) -> None:
    """03's training step, or the same work with no communication (communicate=False)."""
    if communicate:
        return ddp.train_step(model, opt, x, y)
    with model.no_sync():  # torch DDP decides at forward, ours at backward: cover both
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # the naive wrapper's all_reduce_gradients() is simply not called
    opt.step()


def _now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def time_steps(variants, x, y, steps, warmup, device) -> dict:
    """name -> (step, compute-only) median seconds of the slowest rank. Variants alternate step
    by step, so drift in the machine's speed hits them alike."""
    samples = {name: ([], []) for name in variants}
    for i in range(warmup + steps):
        for name, (model, opt) in variants.items():
            for kind, communicate in enumerate((True, False)):
                dist.barrier()  # start together: a step's time is not a peer's lateness
                t0 = _now(device)
                timed_step(model, opt, x, y, communicate)
                if i >= warmup:
                    samples[name][kind].append(_now(device) - t0)
    medians = [[statistics.median(s) for s in samples[n]] for n in variants]
    medians = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(variants, medians.tolist()))


def time_comm_alone(buffers, blocking: bool, device, reps: int = 7) -> float:
    """Median seconds to all-reduce these buffers (one by one, or all in flight at once)."""
    samples = []
    for _ in range(reps):
        dist.barrier()
        t0 = _now(device)
        works = [dist.all_reduce(b, async_op=not blocking) for b in buffers]
        for work in [] if blocking else works:
            work.wait()
        samples.append(_now(device) - t0)
    return statistics.median(samples)


def bench_case(label, overrides, batch, bucket_mb, args, rank, device) -> float:
    config = GPTConfig.from_preset("small", vocab_size=VOCAB, **overrides)
    settings = argparse.Namespace(seed=0, lr=1e-4, bucket_mb=bucket_mb)
    variants = ddp.make_variants(settings, config, device)  # 03's demo models and optimizers
    variants = {name: variants[name] for name in TIMED}
    g = torch.Generator().manual_seed(rank)  # each rank its own rows, every variant the same
    data = torch.randint(0, VOCAB, (batch, config.block_size + 1), generator=g).to(device)
    times = time_steps(variants, data[:, :-1], data[:, 1:], args.steps, args.warmup, device)
    naive, bucketed = variants["naive"][0], variants["bucketed"][0]
    alone = {  # torch DDP's buckets are its own business
        "naive": time_comm_alone([torch.zeros_like(p) for p in naive.params], True, device),
        "bucketed": time_comm_alone(
            [torch.zeros_like(b.buffer) for b in bucketed.buckets], False, device
        ),
    }
    n_params = naive.module.num_params()
    ddp.print0(
        f"\n{label}: {n_params / 1e6:.2f}M params ({4 * n_params / 1e6:.1f} MB of fp32 "
        f"gradients), B={batch} T={config.block_size} per rank, {len(bucketed.buckets)} buckets"
    )
    ddp.print0(
        f"  {'':<10} {'step':>9} {'compute':>9} {'exposed':>9} {'comm alone':>11} {'hidden':>6}"
    )
    for name, (step, compute) in times.items():
        exposed = step - compute
        line = f"  {name:<10} {step * 1e3:6.1f} ms {compute * 1e3:6.1f} ms {exposed * 1e3:6.1f} ms"
        if name in alone:
            hidden = max(0.0, 1 - exposed / alone[name])  # naive: nothing can hide, by design
            line += f" {alone[name] * 1e3:8.1f} ms " + (
                "     —" if name == "naive" else f"{hidden:6.0%}"
            )
        ddp.print0(line)
    ratio = times["bucketed"][0] / times["torch DDP"][0]
    speedup = times["naive"][0] / times["bucketed"][0]
    ddp.print0(f"  bucketed / torch DDP = {ratio:.2f}x    naive / bucketed = {speedup:.2f}x")
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
    dist.all_gather_object(per_rank, ddp.optimizer_state_bytes(zero))  # this rank's shard only
    shards = "  ".join(f"{b / 1e6:.1f}" for b in per_rank)
    ddp.print0(
        f"  {preset:<6} {model.num_params() / 1e6:7.2f}M params   plain AdamW "
        f"{plain_bytes / 1e6:8.1f} MB/rank   ZeRO-1 per rank: {shards} MB   "
        f"(max/plain = {max(per_rank) / plain_bytes:.3f}, 1/N = {1 / world:.3f})"
    )


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2, help="ranks to start outside torchrun")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant; medians")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    parser.add_argument("--zero-presets", default="small,gpt2", help="models for ZeRO memory")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--ranks and --steps must be >= 1, --warmup >= 0")
    if "WORLD_SIZE" not in os.environ:
        return ddp.relaunch_with_torchrun(args.ranks, argv, __file__)
    rank, _, world, device = ddp.init_distributed()
    try:
        ddp.print0(
            f"{world} ranks, {dist.get_backend()}, {machine()}, {torch.get_num_threads()} "
            f"thread(s) per rank; median of {args.steps} steps"
        )
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
