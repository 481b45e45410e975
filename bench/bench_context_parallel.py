"""bench/bench_context_parallel.py: what context parallelism saves and costs, measured.

On 4 ranks (torchrun, started for you; --ranks 2 leaves cp = 4 out), a GPT of 2 layers
(C = 64, nh = 4, V = 256, fp32) whose context reaches 2,048 tokens, run whole (cp = 1, on each rank), and over CP
groups of 2 and 4 ranks (08's zigzag ring):
- activations: the bytes one rank keeps for backward (support/tensor_parallel/activations.py's
  saved_activation_bytes) at T = 256 ... 2,048, against 06b's activation_formula / cp;
- the ring: the bytes one rank sends per layer in a step, against ring_bytes_per_layer;
- time: the median forward + backward step at cp = 1, 2, 4, and the share of the ring's
  communication hidden behind the blocks' compute: 1 - (time waiting on ring steps
  during the step) / (time the same ring steps take alone, with nothing to overlap).

Run:  python bench/bench_context_parallel.py [--steps 5]   (~1-2 min on 2 CPU cores)
On CPU the 4 ranks share the machine's cores, so the step times show what the ring
costs here, not a speed-up; the ratios that carry over to GPUs are the bytes.
"""

import importlib
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# The repo root, where the numbered files are.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import timing
from support import distributed
from support.context_parallel import ring
from support.context_parallel.ring import count_p2p
from support.tensor_parallel.activations import saved_activation_bytes

model_lib = importlib.import_module("02_model")
recompute_lib = importlib.import_module("06b_recompute")  # activation_formula
cp_lib = importlib.import_module("08_context_parallel")
print0 = distributed.print0


def make_model(seed, T_max, group):
    torch.manual_seed(seed)
    sizes = dict(n_layer=2, n_head=4, n_embd=64, block_size=T_max, vocab_size=256)
    model = model_lib.GPT(model_lib.GPTConfig(**sizes))
    return model if group is None else cp_lib.apply_context_parallel(model, group)


def step(model, x, y, group):
    """One forward + backward: the whole model, or this rank's zigzag chunks."""
    if group is None:
        _, loss = model(x, y)
        loss.backward()
        return
    cp = dist.get_world_size(group)
    rank = dist.get_rank(group)
    cp_lib.cp_step(
        model, cp_lib.zigzag_split(x, rank, cp), cp_lib.zigzag_split(y, rank, cp), group
    )


def activations(model, x, y, group):
    """Bytes this rank keeps for backward in one forward."""
    if group is not None:
        rank = dist.get_rank(group)
        cp = dist.get_world_size(group)
        x = cp_lib.zigzag_split(x, rank, cp)
        y = cp_lib.zigzag_split(y, rank, cp)
    _, kept = saved_activation_bytes(lambda: model(x, y, reduction="sum"))
    return kept


class WaitClock:
    """Time spent in ring steps' wait(): the communication the compute did not hide."""

    def __init__(self):
        self.seconds = 0.0
        self.real = ring.Transfer.wait
        clock = self

        def wait(transfer):
            start = timing.clock()
            try:
                return clock.real(transfer)
            finally:
                clock.seconds += timing.clock() - start

        ring.Transfer.wait = wait

    def close(self):
        ring.Transfer.wait = self.real


def ring_alone(sizes, group) -> float:
    """Seconds for the same ring steps (message sizes in bytes) posted and waited one by
    one: no compute to hide behind."""
    dist.barrier(group)
    start = timing.clock()
    for n in sizes:
        cp_lib.ring_pass(torch.empty(n // 4), group).wait()
    return timing.clock() - start


def bench(args, rank, world_size, device):
    cps = [cp for cp in (1, 2, 4) if world_size % cp == 0]
    groups = {1: None}
    for cp in cps:
        ranks = [list(range(i, i + cp)) for i in range(0, world_size, cp)]
        made = [dist.new_group(r) for r in ranks]  # every rank makes every group
        groups[cp if cp > 1 else "1, by hand"] = made[rank // cp]
    B = args.batch_size
    T_max = max(args.seq_lens)
    batches = model_lib.byte_batches(T_max, B, seed=args.seed, device=device)
    x_all, y_all = batches[0]
    ranks = f"{world_size} gloo ranks on {device.type} (each)"
    print0(timing.machine(f"GPT L=2 C=64 nh=4 V=256, B={B}, fp32", ranks))
    print0(
        "\nactivations kept for backward per rank, MB (measured | 06b's formula / cp)"
    )
    print0(f"{'T':>6} " + " ".join(f"{'cp=' + str(cp):>21}" for cp in cps))
    for T in args.seq_lens:
        x = x_all[:, :T].contiguous()
        y = y_all[:, :T].contiguous()
        cells = []
        for cp in cps:
            model = make_model(args.seed, T_max, groups[cp])
            kept = activations(model, x, y, groups[cp])
            formula = recompute_lib.activation_formula(model.config, B, T, "fp32") / cp
            cells.append(f"{kept / 2**20:9.3f} | {formula / 2**20:9.3f}")
        print0(f"{T:>6} " + " ".join(f"{c:>21}" for c in cells))
    T = args.time_seq_len
    x = x_all[:, :T].contiguous()
    y = y_all[:, :T].contiguous()
    print0(f"\nT = {T}: ring bytes per layer and rank, a step's time, the ring hidden")
    print0("(cp=1: the whole model with SDPA; '1, by hand': 08's blocks, no ring)")
    for label, group in groups.items():
        cp = 1 if group is None else dist.get_world_size(group)
        model = make_model(args.seed, T_max, group)
        with count_p2p() as sent:
            step(model, x, y, group)
        per_layer = sum(sent) / model.config.n_layer
        formula = sum(cp_lib.ring_bytes_per_layer(B, T, model.config.n_embd, cp, 4))
        times = []
        waited = []
        for i in range(args.warmup + args.steps):
            model.zero_grad(set_to_none=True)
            clock = WaitClock()
            if group is not None:
                dist.barrier(group)
            try:
                _, seconds = timing.timed(step, model, x, y, group)
            finally:
                clock.close()
            if i >= args.warmup:
                times.append(seconds)
                waited.append(clock.seconds)
        ms = statistics.median(times) * 1e3
        line = f"  cp={label:<10} {per_layer:>10,.0f} B sent per layer"
        line += f" | formula {formula:>10,}   step {ms:7.1f} ms"
        if cp > 1:
            alone = statistics.median(
                ring_alone(sent, group) for _ in range(args.steps)
            )
            exposed = statistics.median(waited)
            hidden = max(0.0, 1 - exposed / alone)
            line += f"   ring alone {alone * 1e3:6.1f} ms,"
            line += f" waited {exposed * 1e3:6.1f} ms: {hidden:.0%} hidden"
        print0(line)
        dist.barrier()


def add_arguments(parser):
    parser.set_defaults(ranks=4)  # cp = 1, 2, 4 where they divide it
    parser.add_argument("--batch-size", type=int, default=2, help="B")
    seq_lens = [256, 512, 1024, 2048]
    parser.add_argument("--seq-lens", type=int, nargs="+", default=seq_lens)
    parser.add_argument("--time-seq-len", type=int, default=1024, help="T of the timing")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--seed", type=int, default=1337, help="model and batch")


def main(argv=None):
    distributed.run_on_ranks(bench, argv, __file__, __doc__, add_arguments)


if __name__ == "__main__":
    main()
