"""bench/bench_ring_kernel.py: 08's attention blocks against SDPA on one device, at cp = 1.

08's ring computes each block by hand (attend and attend_backward: q·kᵀ, masked, the
log-sum-exp, in fp32), not with a flash kernel, because it needs each block's lse to
merge blocks exactly. At cp = 1 the ring is one causal block, so its forward and
backward time and peak memory against F.scaled_dot_product_attention(is_causal=True)
(a flash kernel in bf16 on a GPU) is the price of computing blocks by hand. Both run
the same (B, nh, T, hs) queries, keys and values; the outputs are compared first.

    python bench/bench_ring_kernel.py                     # a CPU: small shapes, fp32
    python bench/bench_ring_kernel.py --seq-lens 1024,4096 --batch-size 8   # a GPU, bf16

Peak memory is the step's: torch.cuda.max_memory_allocated less what was held before
(GPU only). Not run on a GPU yet (no GPU on the development VMs).
"""

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the numbered files
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
    times = []
    peak = 0
    for i in range(steps + 1):  # The first one warms up, untimed.
        if cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = fn(q, k, v)
        out.backward(dout)
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
        if i:
            times.append(time.perf_counter() - t0)
        q.grad = k.grad = v.grad = None
    return statistics.median(times), peak


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--seq-lens", default="1024,4096" if cuda else "256,512")
    parser.add_argument("--batch-size", type=int, default=8 if cuda else 2)
    parser.add_argument("--heads", type=int, default=12, help="GPT-2 124M's")
    parser.add_argument("--head-size", type=int, default=64, help="GPT-2 124M's")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    print(f"{device} ({torch.cuda.get_device_name() if cuda else 'CPU'}), {dtype}")
    for T in (int(t) for t in args.seq_lens.split(",")):
        shape = (args.batch_size, args.heads, T, args.head_size)
        torch.manual_seed(0)
        q, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))
        for t in (q, k, v):
            t.requires_grad_(True)
        dout = torch.randn(shape, device=device, dtype=dtype)
        # bf16 inputs: both round their output to bf16 (8 bits of mantissa), so 2e-2.
        tol = dict(rtol=2e-2, atol=2e-2) if cuda else dict(rtol=1e-4, atol=1e-5)
        with torch.no_grad():
            torch.testing.assert_close(ring_at_cp1(q, k, v), sdpa(q, k, v), **tol)
        ring_s, ring_peak = step_time(ring_at_cp1, q, k, v, dout, args.steps)
        sdpa_s, sdpa_peak = step_time(sdpa, q, k, v, dout, args.steps)
        row = f"B={args.batch_size} nh={args.heads} T={T:>5} hs={args.head_size}: "
        row += f"SDPA {1e3 * sdpa_s:8.2f} ms, 08's blocks {1e3 * ring_s:8.2f} ms "
        row += f"({ring_s / sdpa_s:.1f}x)"
        if cuda:
            row += f"; peak {sdpa_peak / 2**20:,.0f} vs {ring_peak / 2**20:,.0f} MiB"
        print(row)


if __name__ == "__main__":
    main()
