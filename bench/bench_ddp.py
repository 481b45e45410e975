"""bench/bench_ddp.py: 03_ddp.py's data parallelism and 07_zero.py's ZeRO timed side by side;
traffic and memory counted.

Part 1, all-reduce: naive against bucketed, bucketed against torch's DistributedDataParallel,
and how much of the all-reduce the buckets hide behind backward. Part 2, ZeRO: step times of
ZeRO-1/2/3 against plain DP and against torch's FSDP2 (fully_shard on every block, then the root;
reshard_after_forward=True is ZeRO-3, False keeps the weights gathered from forward to backward,
as ZeRO-2 does); the bytes each stage sends per step against the formulas; the bytes per rank
of stages 0-3, measured next to the formula, and the formula alone for GPT-2 124M and 1.5B.

One training step = forward, backward (with the gradient communication), AdamW step, on the same
GPT and the same batch for every variant. Variants alternate step by step in one run, so drift
in the machine's speed hits all alike; each number is the median step of the slowest rank.
Targets: bucketed / DDP <= 1.10x; ZeRO-2 and ZeRO-3 / FSDP2 <= 1.10x.

The overlap table. compute: the same step without communication (under no_sync(); the naive
wrapper simply skips all_reduce_gradients()). exposed = step - compute: the communication the
step waited for. comm alone: the same collectives with no compute (naive: one blocking call per
gradient; bucketed: every bucket in flight at once). hidden = 1 - exposed / comm alone: the
share of the communication that ran behind backward. Naive starts communicating only after
backward, so nothing of it can hide (printed as —). On a CPU, gloo's threads need the very cores
the compute uses, so little can hide (on 2 cores, about 0%); on GPUs NCCL runs beside the
kernels, on its own stream, and the buckets hide most of it.

Run:  python bench/bench_ddp.py [--ranks 2]      (starts torchrun for you; about two minutes)
      torchrun --standalone --nproc_per_node=4 bench/bench_ddp.py
"""

import argparse
import functools
import importlib
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: numbered files
from bench import timing
from support import distributed

ddp = importlib.import_module("03_ddp")
zero_lib = importlib.import_module("07_zero")
model_lib = importlib.import_module("02_model")
GPT = model_lib.GPT
GPTConfig = model_lib.GPTConfig

# (label, GPTConfig overrides, sequences per rank, bucket cap in MB for both ours and torch DDP)
CASES = [
    ("small, 1 MB buckets", dict(n_layer=4, n_embd=128, block_size=64), 4, 1.0),
    ("small, 25 MB buckets", dict(n_layer=4, n_embd=128, block_size=64), 4, 25.0),
    ("L6 C256, 4 MB buckets", dict(n_layer=6, n_embd=256, n_head=4, block_size=64), 2, 4.0),
]
VOCAB = 257  # the char tokenizer of 01_data.py
TIMED = ("naive", "bucketed", "torch DDP")


def make_variants(config, device, names, bucket_mb: float = 25.0) -> dict:
    """name -> (model, AdamW or ZeRO's), every one the same GPT from the same seed."""
    from torch.distributed.fsdp import fully_shard

    AdamW = torch.optim.AdamW
    kw = dict(lr=1e-4, weight_decay=0.1)
    out = {}
    for name in names:
        torch.manual_seed(0)
        m = GPT(config).to(device)
        if name.startswith("ZeRO-"):
            stage = int(name[-1])
            out[name] = zero_lib.zero_data_parallel(m, stage, m.parameters(), AdamW, **kw)
            continue
        if name.startswith("FSDP2"):  # torch's ZeRO-3; reshard_after_forward=False: ZeRO-2's
            reshard = name == "FSDP2"
            for block in m.transformer.h:
                fully_shard(block, reshard_after_forward=reshard)
            model = fully_shard(m, reshard_after_forward=reshard)
        elif name == "naive":
            model = ddp.NaiveDataParallel(m)
        elif name in ("bucketed", "DP"):
            model = ddp.DataParallel(m, bucket_mb=bucket_mb)
        else:  # torch DDP
            ids = [device.index] if device.type == "cuda" else None
            model = torch.nn.parallel.DistributedDataParallel(m, ids, bucket_cap_mb=bucket_mb)
        out[name] = (model, AdamW(m.parameters(), **kw))
    return out


def timed_step(model, opt, x, y, communicate: bool) -> None:
    """03's training step, or the same work with no communication (communicate=False)."""
    if communicate:
        return ddp.train_step(model, opt, x, y)
    with model.no_sync():  # torch DDP decides at forward, ours at backward: cover both
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # the naive wrapper's all_reduce_gradients() is simply not called
    opt.step()


def time_steps(variants, x, y, steps, warmup, device) -> dict:
    """name -> (step, compute-only) median seconds of the slowest rank. Variants alternate step
    by step, so drift in the machine's speed hits them alike."""
    calls = {}
    for name, (model, opt) in variants.items():
        for communicate in (True, False):
            step = functools.partial(timed_step, model, opt, x, y, communicate)
            calls[(name, communicate)] = step
    # A barrier first: a step's time is not a peer's lateness.
    times = timing.alternate(calls, steps, warmup, device, before=dist.barrier)
    medians = [[statistics.median(times[(n, c)]) for c in (True, False)] for n in variants]
    medians = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(variants, medians.tolist()))


def time_comm_alone(buffers, blocking: bool, device, reps: int = 7) -> float:
    """Median seconds to all-reduce these buffers (one by one, or all in flight at once)."""

    def all_reduce():
        works = [dist.all_reduce(b, async_op=not blocking) for b in buffers]
        for work in [] if blocking else works:
            work.wait()

    return timing.median_seconds(all_reduce, reps, 0, device, before=dist.barrier)


def bench_case(label, overrides, batch, bucket_mb, args, rank, device) -> float:
    config = GPTConfig.from_preset("small", vocab_size=VOCAB, **overrides)
    variants = make_variants(config, device, TIMED, bucket_mb)
    g = torch.Generator().manual_seed(rank)  # each rank its own rows, every variant the same
    data = torch.randint(0, VOCAB, (batch, config.block_size + 1), generator=g).to(device)
    times = time_steps(variants, data[:, :-1], data[:, 1:], args.steps, args.warmup, device)
    naive = variants["naive"][0]
    bucketed = variants["bucketed"][0]
    alone = {  # torch DDP's buckets are its own business
        "naive": time_comm_alone([torch.zeros_like(p) for p in naive.params], True, device),
        "bucketed": time_comm_alone(
            [torch.zeros_like(b.buffer) for b in bucketed.buckets], False, device
        ),
    }
    n_params = naive.module.num_params()
    distributed.print0(
        f"\n{label}: {n_params / 1e6:.2f}M params ({4 * n_params / 1e6:.1f} MB of fp32 "
        f"gradients), B={batch} T={config.block_size} per rank, {len(bucketed.buckets)} buckets"
    )
    distributed.print0(
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
        distributed.print0(line)
    ratio = times["bucketed"][0] / times["torch DDP"][0]
    speedup = times["naive"][0] / times["bucketed"][0]
    distributed.print0(f"  bucketed / torch DDP = {ratio:.2f}x    naive / bucketed = {speedup:.2f}x")
    return ratio


# ---------------------------------------------------------------------------------------------
# Part 2: ZeRO
# ---------------------------------------------------------------------------------------------
ZERO_TIMED = ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP2 no reshard", "FSDP2")


def time_zero(label, overrides, batch, args, rank, device) -> dict:
    """Step times of DP, ZeRO-1/2/3 and FSDP2, alternating, on one model and one batch."""
    config = GPTConfig.from_preset("small", vocab_size=VOCAB, **overrides)
    variants = make_variants(config, device, ZERO_TIMED)
    g = torch.Generator().manual_seed(rank)
    data = torch.randint(0, VOCAB, (batch, config.block_size + 1), generator=g).to(device)
    x = data[:, :-1]
    y = data[:, 1:]
    calls = {n: functools.partial(ddp.train_step, *v, x, y) for n, v in variants.items()}
    samples = timing.alternate(calls, args.steps, args.warmup, device, before=dist.barrier)
    medians = torch.tensor([statistics.median(samples[n]) for n in variants], device=device)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    times = dict(zip(variants, medians.tolist()))
    n_params = variants["DP"][0].module.num_params()
    distributed.print0(f"\n{label}: {n_params / 1e6:.2f}M params, B={batch} T={config.block_size} per rank")
    for name, t in times.items():
        distributed.print0(f"  {name:<17} {t * 1e3:7.1f} ms   {t / times['DP']:5.2f}x DP")
    ratios = {
        "ZeRO-2 / FSDP2 no reshard": times["ZeRO-2"] / times["FSDP2 no reshard"],
        "ZeRO-3 / FSDP2": times["ZeRO-3"] / times["FSDP2"],
    }
    distributed.print0("  " + "    ".join(f"{k} = {v:.2f}x" for k, v in ratios.items()))
    return ratios


def zero_traffic(world, device) -> None:
    """What each stage sent in one step (03's and 07's counters) against the formulas: every rank sends
    (N-1)/N of each collective's buffer; a ring all-reduce is a reduce-scatter + an all-gather."""
    config = GPTConfig.from_preset("small", vocab_size=VOCAB, block_size=64)
    variants = make_variants(config, device, ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"))
    data = torch.randint(0, VOCAB, (4, config.block_size + 1)).to(device)
    psi = variants["DP"][0].module.num_params()
    sent = (world - 1) / world
    model = variants["ZeRO-3"][0]
    root = sum(f.full.numel() for f in model.flats if f.unit is model.module)
    distributed.print0(f"\nwords sent per rank in one step, counted | formula (Ψ = {psi:,}, N = {world})")
    for stage, (name, (model, opt)) in enumerate(variants.items()):
        before = dict(model.stats)
        ddp.train_step(model, opt, data[:, :-1], data[:, 1:])
        moved = sum(v - before[k] for k, v in model.stats.items() if k.endswith("bytes"))
        factor = 2 if stage == 0 else 1  # all-reduce: a reduce-scatter and an all-gather
        words = factor * sent * moved / 4
        formula = (3 if stage == 3 else 2) * sent * psi
        what = "3(N-1)/N·Ψ" if stage == 3 else "2(N-1)/N·Ψ"
        distributed.print0(f"  {name:<7} {words:12,.0f} | {what} = {formula:12,.0f}")
    distributed.print0(
        f"  (ZeRO-3: the root, {root:,} words of embeddings and ln_f, stays gathered from "
        f"forward to backward, so {sent * root:,.0f} fewer; all: padding to N·S)"
    )


def zero_memory(world, device) -> None:
    """Bytes per rank after backward, stages 0-3, measured (07's memory_per_rank) | formula."""
    config = GPTConfig.from_preset("small", vocab_size=VOCAB, block_size=64)
    variants = make_variants(config, device, ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"))
    data = torch.randint(0, VOCAB, (4, config.block_size + 1)).to(device)
    psi = variants["DP"][0].module.num_params()
    distributed.print0(f"\nbytes per rank after backward, measured | formula (Ψ = {psi:,}, N = {world})")
    for stage, (name, (model, opt)) in enumerate(variants.items()):
        ddp.train_step(model, opt, data[:, :-1], data[:, 1:])  # AdamW's state exists after it
        opt.zero_grad(set_to_none=True)
        model(data[:, :-1], data[:, 1:])[1].backward()  # the gradients, as before the next step
        m = zero_lib.memory_per_rank(model.module, opt)
        formula = zero_lib.zero_memory_formula(stage, psi, world)
        distributed.print0(
            f"  {name:<7} {sum(m.values()) / 1e6:9.3f} MB | {zero_lib.FORMULAS[name]:<13} = "
            f"{formula / 1e6:9.3f} MB   (weights {m['params'] / 1e6:.3f}, gradients "
            f"{m['grads'] / 1e6:.3f}, AdamW {m['optimizer'] / 1e6:.3f})"
        )
    # ZeRO-3's gathered units, measured while the first block runs its forward
    model, opt = variants["ZeRO-3"]
    seen = []

    def count(*_) -> None:
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage() for p in model.parameters()}
        seen.append(sum(s.nbytes() for s in storages.values()))

    handle = model.module.transformer.h[0].register_forward_pre_hook(count)
    opt.zero_grad(set_to_none=True)
    model(data[:, :-1], data[:, 1:])[1].backward()
    handle.remove()
    distributed.print0(
        f"  ZeRO-3 + gathered while block 0 computes: {seen[0] / 1e6:.3f} MB (the root, block 0 "
        "and block 1's prefetch)"
    )


def gpt2_memory_table() -> None:
    """The formulas alone for GPT-2 124M and 1.5B: GB per rank, fp32 + AdamW."""
    distributed.print0("\nformula only, GB per rank (fp32 weights, gradients, AdamW m and v):")
    for preset in ("gpt2", "gpt2-xl"):
        config = GPTConfig.from_preset(preset)
        psi = model_lib.count_params(config)
        C = config.n_embd
        block = 12 * C * C + 13 * C  # ZeRO-3 gathers the root and two blocks (one prefetched)
        root = psi - config.n_layer * block
        sizes = f"root {4 * root / 1e9:.2f} GB, block {4 * block / 1e9:.3f} GB"
        distributed.print0(f"  {preset} ({psi / 1e6:,.0f}M): {sizes}")
        for world in (2, 4, 8, 64):
            cells = [zero_lib.zero_memory_formula(s, psi, world) / 1e9 for s in range(4)]
            units = 4 * (root + 2 * block) / 1e9
            row = "  ".join(f"{n} {c:6.2f}" for n, c in zip(("DP", "Z1", "Z2", "Z3"), cells))
            distributed.print0(f"    N={world:<3} {row}  (+ {units:.2f} gathered)")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2, help="ranks to start outside torchrun")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant; medians")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    parser.add_argument("--parts", default="dp,zero", help="dp: part 1, zero: part 2")
    parser.add_argument("--cases", type=int, default=3, help="the first N models of each part")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--ranks and --steps must be >= 1, --warmup >= 0")
    if "WORLD_SIZE" not in os.environ:
        return distributed.relaunch_with_torchrun(args.ranks, argv, __file__)
    rank, _, world, device = distributed.init_distributed()
    try:
        distributed.print0(
            timing.machine(f"{world} ranks, {dist.get_backend()}")
            + f" (per rank); median of {args.steps} steps"
        )
        if "dp" in args.parts:
            ratios = [bench_case(*case, args, rank, device) for case in CASES[: args.cases]]
            listed = ", ".join(f"{r:.2f}x" for r in ratios)
            distributed.print0(f"\nbucketed / torch DDP over all cases: {listed} (target <= 1.10x)")
        if "zero" in args.parts:
            ratios = [time_zero(*case, args, rank, device) for case in ZERO_CASES[: args.cases]]
            for key in ratios[0]:
                listed = ", ".join(f"{r[key]:.2f}x" for r in ratios)
                distributed.print0(f"{key} over all cases: {listed} (target <= 1.10x)")
            zero_traffic(world, device)
            zero_memory(world, device)
            gpt2_memory_table()
    finally:
        dist.destroy_process_group()


ZERO_CASES = [
    ("small", dict(n_layer=4, n_embd=128, block_size=64), 4),
    ("L6 C256", dict(n_layer=6, n_embd=256, n_head=4, block_size=64), 2),
]


if __name__ == "__main__":
    main()
