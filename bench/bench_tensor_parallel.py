"""bench/bench_tensor_parallel.py: what tensor parallelism costs, next to its formula.

04_tensor_parallel.py's demo GPT (02's "small" preset, V = 256 bytes) and one batch, on
tp ranks:
- communication: every collective of one training step (forward + backward), counted by
  wrapping torch.distributed's all_reduce, all_gather and reduce_scatter, next to
  comm_formula (derived in 04's docstring) and the bytes a ring algorithm sends per rank;
- memory: parameters and activations saved for backward (06b's saved_activation_bytes)
  per rank, as a share of the whole model's;
- time: the median forward + backward step of the whole model (rank 0 alone), of TP, and
  of TP + SP.
tests/test_tensor_parallel.py checks support/tensor_parallel/sharding.py's count_comm and comm_formula
against a count derived by hand.

Run:  python bench/bench_tensor_parallel.py [--ranks 2]   (starts torchrun for you; ~30 s)
      torchrun --standalone --nproc_per_node=4 bench/bench_tensor_parallel.py
"""

import copy
import importlib
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# The repo root, where the numbered files are.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import timing
from support import distributed
from support.tensor_parallel import sharding

model_lib = importlib.import_module("02_model")
tp_lib = importlib.import_module("04_tensor_parallel")
sp_lib = importlib.import_module("04b_sequence_parallel")
recompute_lib = importlib.import_module("06b_recompute")  # saved_activation_bytes

# A ring all-reduce sends 2(tp-1)/tp * S per rank, S being the payload that
# sharding.count_comm records; all-gather (S: the gathered list) and reduce-scatter (S:
# the input list) send (tp-1)/tp * S. RING holds those factors of (tp-1)/tp * S.
RING = dict(all_reduce=2, all_gather=1, reduce_scatter=1)


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def ms_per_step(model, x, y, args) -> float:
    """Median milliseconds of a forward + backward, after args.warmup untimed ones."""

    def step():
        model.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()

    return timing.median_seconds(step, args.steps, args.warmup, x.device) * 1e3


def bench(args, group, device):
    tp = dist.get_world_size(group)
    print0 = distributed.print0
    MB = 2**20
    config = model_lib.GPTConfig.from_preset(
        args.preset, vocab_size=256, pad_vocab_multiple=math.lcm(64, tp), dropout=0.0
    )
    torch.manual_seed(args.seed)  # the same whole model on every rank, sliced after
    full = model_lib.GPT(config).to(device)
    [(x, y)] = model_lib.byte_batches(
        config.block_size, args.batch_size, seed=args.seed, device=device
    )
    B, T = x.shape
    variants = {}
    variants[False] = tp_lib.apply_tensor_parallel(copy.deepcopy(full), group)
    variants[True] = sp_lib.apply_sequence_parallel(copy.deepcopy(full), group)
    p_full = param_bytes(full)
    _, act_full = recompute_lib.saved_activation_bytes(lambda: full(x, y))
    ms_full = ms_per_step(full, x, y, args) if dist.get_rank(group) == 0 else 0.0
    dist.barrier(group)  # the others wait while rank 0 times the whole model alone
    shape = f"L={config.n_layer} nh={config.n_head} C={config.n_embd}"
    backend = dist.get_backend(group)
    print0(timing.machine(f"{backend} on {device.type} (per rank)"))
    print0(
        f"GPT '{args.preset}' {shape} V={config.padded_vocab_size}, (B, T) = ({B}, {T}), "
        f"fp32, median of {args.steps} steps\ntp=1, one process, the whole model: parameters "
        f"{p_full / MB:.3f} MB, activations (saved for backward) "
        f"{act_full / MB:.2f} MB, {ms_full:.1f} ms per step (fwd+bwd)"
    )
    for sp, model in variants.items():
        p = param_bytes(model)
        _, act = recompute_lib.saved_activation_bytes(lambda m=model: m(x, y))
        with sharding.count_comm() as log:
            _, loss = model(x, y)
            loss.backward()
        ms = torch.tensor(ms_per_step(model, x, y, args))
        # The slowest rank sets the pace.
        dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
        print0(
            f"\ntp={tp}{' + sequence parallel' if sp else ''}, per rank: parameters "
            f"{p / MB:.3f} MB ({p / p_full:.0%} of the whole; 1/tp = {1 / tp:.0%}), "
            f"activations {act / MB:.2f} MB ({act / act_full:.0%}), {ms:.1f} ms per step"
        )
        for op, formula in sharding.comm_formula(config, B, T, sp).items():
            sizes = [n for o, n in log if o == op]
            ring = RING[op] * (tp - 1) / tp * sum(sizes)
            payload = (
                f"payload {sum(sizes) / MB:7.3f} MB (formula {formula / MB:7.3f} MB)"
            )
            print0(
                f"  {op:<15}{len(sizes):>3} calls, {payload}, "
                f"sent per rank by a ring {ring / MB:7.3f} MB"
            )
    print0(
        f"\n{tp} ranks share this machine over {backend}: on CPU the times show the "
        "cost of the communication, not a speed-up (that needs one GPU per rank, on "
        "NVLink)."
    )


def add_arguments(parser):
    parser.add_argument("--preset", default="small", help="02's preset, as 04's demo")
    parser.add_argument("--batch-size", type=int, default=8, help="B, as 04's demo")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--seed", type=int, default=1337, help="model and batch")


def demo(args, rank, world_size, device):
    group = dist.new_group(list(range(world_size)))  # the TP group: the whole world
    bench(args, group, device)


def main(argv=None):
    distributed.run_on_ranks(demo, argv, __file__, __doc__, add_arguments)


if __name__ == "__main__":
    main()
