"""bench/bench_ring_kernel.py: 08's attention blocks against SDPA on one device, at cp = 1.

08's ring computes each block by hand (attend and attend_backward: q·kᵀ, masked, the
log-sum-exp, in fp32), not with a flash kernel, because it needs each block's lse to
merge blocks exactly. At cp = 1 the ring is one causal block, so its forward and
backward time and peak memory against F.scaled_dot_product_attention(is_causal=True)
(a flash kernel in bf16 on a GPU) is the price of computing blocks by hand. Both run
the same (B, nh, T, hs) queries, keys and values; the outputs are compared first.
08 runs twice: tiled (QUERY_TILE query rows at a time, 08's default 1,024, or --tile)
and untiled (one tile of all T rows, as 08 computed blocks before it tiled them).

    python bench/bench_ring_kernel.py                     # a CPU: small shapes, fp32
    python bench/bench_ring_kernel.py --seq-lens 4096 --heads 4 --batch-size 1 --steps 2
    python bench/bench_ring_kernel.py --seq-lens 1024,4096 --batch-size 8   # a GPU, bf16

Peak memory is the step's (forward + backward) above what was held before it. On a GPU:
torch.cuda.max_memory_allocated. On a CPU, each variant runs once more in a fresh
process with MALLOC_MMAP_THRESHOLD_ fixed at 64 KiB (so glibc maps every tensor and
unmaps it when freed): the peak RSS (VmHWM) less the RSS before the step. Printed
beside the formula of the block's transient scores, B nh rows T x 20 bytes (rows = T
untiled, the tile when tiled; ~20 bytes a score at the backward's peak: s, p, dp and dS
in fp32 and one more temporary). Not run on a GPU yet (no GPU on the development VMs).
"""

import argparse
import importlib
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the numbered files
from bench import timing  # noqa: E402

cp_lib = importlib.import_module("08_context_parallel")


class RingAtCP1(torch.autograd.Function):
    """08's RingAttention at cp = 1: one causal block, no transfer (pass_on unused)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out, lse = cp_lib.ring_forward(q, k, v, 0, 1, "zigzag", None)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return cp_lib.ring_backward(q, k, v, out, lse, dout, 0, 1, "zigzag", None)


ring_at_cp1 = RingAtCP1.apply


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def step_time(fn, q, k, v, dout, steps: int):
    """Median seconds of forward + backward, and the step's peak bytes (GPU; else 0)."""
    cuda = q.device.type == "cuda"
    peak = 0

    def step():
        fn(q, k, v).backward(dout)

    def before():
        nonlocal peak
        q.grad = k.grad = v.grad = None
        if cuda:
            timing.clock(q.device)
            peak = torch.cuda.memory_allocated()  # held before, taken off below
            torch.cuda.reset_peak_memory_stats()

    # The first step warms up, untimed.
    seconds = timing.median_seconds(step, steps, 1, q.device, before)
    if cuda:
        peak = torch.cuda.max_memory_allocated() - peak
    return seconds, peak


def inputs(args, T: int, device, dtype):
    """The same q, k, v (leaves) and dO for every variant: seeded."""
    shape = (args.batch_size, args.heads, T, args.head_size)
    torch.manual_seed(0)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))
    for t in (q, k, v):
        t.requires_grad_(True)
    return q, k, v, torch.randn(shape, device=device, dtype=dtype)


def variants(T: int, tile: int) -> dict:
    """name -> (function, 08's QUERY_TILE while it runs)."""
    tiled = f"08 tile {min(tile, T)}"
    return {
        "SDPA": (sdpa, tile),
        "08 untiled": (ring_at_cp1, T),
        tiled: (ring_at_cp1, tile),
    }


def status_bytes(key: str) -> int:
    """VmRSS (resident now) or VmHWM (its high-water mark) of this process, in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(key))
    return int(line.split()[1]) * 1024  # kB


def measure_one(args) -> None:
    """In a fresh process: one forward + backward of one variant; prints the peak RSS
    above the RSS before it, in bytes. Writing 5 to /proc/self/clear_refs resets the
    high-water mark to the RSS now (Linux 4.0+), so imports' peaks do not count."""
    T = args.seq_lens
    fn, tile = list(variants(T, args.tile).values())[args.measure_one]
    cp_lib.QUERY_TILE = tile
    q, k, v, dout = inputs(args, T, torch.device("cpu"), torch.float32)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_bytes("VmRSS")
    fn(q, k, v).backward(dout)
    print(status_bytes("VmHWM") - before)


def cpu_peak(args, T: int, index: int) -> int:
    """measure_one's bytes, for variant `index` at T, from a fresh process."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(64 * 1024))
    cmd = [sys.executable, __file__, "--seq-lens", str(T), "--tile", str(args.tile)]
    cmd += ["--batch-size", str(args.batch_size), "--heads", str(args.heads)]
    cmd += ["--head-size", str(args.head_size), "--measure-one", str(index)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--seq-lens", default="1024,4096" if cuda else "256,512")
    parser.add_argument("--batch-size", type=int, default=8 if cuda else 2)
    parser.add_argument("--heads", type=int, default=12, help="GPT-2 124M's")
    parser.add_argument("--head-size", type=int, default=64, help="GPT-2 124M's")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tile", type=int, default=cp_lib.QUERY_TILE, help="08's")
    parser.add_argument("--measure-one", type=int, default=None, help=argparse.SUPPRESS)
    no_rss = "CPU: no fresh process per variant, so no peak (only tries the script)"
    parser.add_argument("--skip-rss", action="store_true", help=no_rss)
    args = parser.parse_args(argv)
    if args.measure_one is not None:
        args.seq_lens = int(args.seq_lens)
        return measure_one(args)
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    print(timing.machine(f"{device}, {dtype}"))
    B = args.batch_size
    nh = args.heads
    print(
        f"B={B} nh={nh} hs={args.head_size}; peak: measured | formula B nh rows T 20 B"
    )
    for T in (int(t) for t in args.seq_lens.split(",")):
        q, k, v, dout = inputs(args, T, device, dtype)
        # bf16 inputs: both round their output to bf16 (8 bits of mantissa), so 2e-2.
        tol = dict(rtol=2e-2, atol=2e-2) if cuda else dict(rtol=1e-4, atol=1e-5)
        results = {}
        for i, (name, (fn, tile)) in enumerate(variants(T, args.tile).items()):
            cp_lib.QUERY_TILE = tile
            with torch.no_grad():
                torch.testing.assert_close(fn(q, k, v), sdpa(q, k, v), **tol)
            seconds, peak = step_time(fn, q, k, v, dout, args.steps)
            if not cuda:
                peak = 0 if args.skip_rss else cpu_peak(args, T, i)
            results[name] = (seconds, peak)
        sdpa_s = results["SDPA"][0]
        for name, (seconds, peak) in results.items():
            row = f"  T={T:>5} {name:<13} {1e3 * seconds:9.2f} ms"
            row += f" ({seconds / sdpa_s:4.1f}x SDPA), peak {peak / 2**20:8,.1f} MiB"
            if name != "SDPA":
                rows = min(args.tile, T) if "tile " in name else T
                formula = B * nh * rows * T * 20
                row += f" | {formula / 2**20:8,.1f} MiB"
                above = peak - results["SDPA"][1]  # q, k, v, O and grads held by both
                row += f" ({above / (B * nh * rows * T):.1f} B a score above SDPA's)"
            print(row)


if __name__ == "__main__":
    main()
