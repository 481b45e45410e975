"""The plain loss against 06b's chunked linear + cross-entropy at GPT-2 124M's shape
(C = 768, V = 50,257 padded to 50,304, T = 1,024), side by side in one process: the
bytes each keeps for the backward and the time of a step.

    python bench/bench_loss.py                  # CPU: B = 16, 32 counted; B = 1 run
    python bench/bench_loss.py --measure 16,32  # a GPU: the whole model's step

First, for every --batch-sizes B (no run, 06b's loss_formula): the bytes lm_head and the
loss keep for the backward, and the (B, T, V) logits and dL/dlogits that the plain loss
holds beside them. Then, for every --measure B, both losses run: on a CPU lm_head + the
loss alone, from a random (B, T, C) ln_f output (--scope head, the default there:
GPT-2's whole step at T = 1,024 takes minutes on a laptop, and its blocks are the same
for both losses); on a GPU the whole model's forward and backward (--scope model). Each
row prints the bytes kept, counted by 06b's saved_activation_bytes, beside the formula;
the step's peak: on a CPU the most bytes the step's own tensors hold at once
(bench/timing.py's StepPeak: weights left out), on a GPU
torch.cuda.max_memory_allocated less the memory held before the step; and the median ms
per step. A GPU step runs under bf16 autocast, a CPU step in fp32 (--dtype). The CUDA
branch has not run yet (no GPU on the development VMs).
"""

import argparse
import functools
import importlib
import sys
from pathlib import Path

import torch

# The repo root: the numbered files live there.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import timing  # noqa: E402

model_lib = importlib.import_module("02_model")
mp = importlib.import_module("06_mixed_precision")
rc = importlib.import_module("06b_recompute")  # recomputation, the chunked loss

LOSSES = ("plain", "chunked")
GB = 1e9


def mode_of(dtype: str) -> str:
    """06b's name for the precision: its formulas take it."""
    return "fp32" if dtype == "fp32" else f"{dtype} autocast"


def print_formulas(config, T: int, batch_sizes, mode: str):
    """Bytes lm_head + loss keep for the backward, and the (B, T, V) tensors besides."""
    V = config.padded_vocab_size
    a = 4 if mode == "fp32" else 2
    print(f"the head, C = {config.n_embd}, T = {T:,}, V = {V:,}, {mode}: 06b's formulas, GB")
    print(f"{'B':>4} {'loss':<8} {'kept':>8} {'+ logits, dlogits':>18} {'all':>8}")
    for B in batch_sizes:
        for loss in LOSSES:
            kept = rc.loss_formula(config, B, T, mode, loss)
            besides = B * T * V * (a + 4) if loss == "plain" else 0
            row = (
                f"{kept / GB:>8.2f} {besides / GB:>18.2f} {(kept + besides) / GB:>8.2f}"
            )
            print(f"{B:>4} {loss:<8} {row}")


def build(config, loss: str, B: int, args, device):
    """A GPT with this loss, and the forward to measure: head + loss, or the model."""
    torch.manual_seed(args.seed)
    model = model_lib.GPT(config).to(device)
    if loss == "chunked":
        rc.apply_chunked_loss(model, args.chunk_tokens)
    T = config.block_size
    x = torch.randint(0, config.vocab_size, (B, T), device=device)
    y = torch.randint(0, config.vocab_size, (B, T), device=device)
    if args.scope == "model":
        return model, functools.partial(lambda m: m(x, y)[1], model)
    hidden = torch.randn(B, T, config.n_embd, device=device, requires_grad=True)
    return model, functools.partial(lambda m: m.loss_fn(m.head(hidden), y), model)


def step(forward, model, dtype, device) -> None:
    """One forward and backward."""
    with mp.autocast_context(dtype, device.type):
        loss = forward()
    loss.backward()
    model.zero_grad(set_to_none=True)


def measure(config, B: int, args, device) -> list:
    """Each loss at batch B: bytes kept and formula, the step's peak, ms per step."""
    mode = mode_of(args.dtype)
    dtype = mp.DTYPES[args.dtype]
    T = config.block_size
    rows = []
    for loss in LOSSES:
        model, forward = build(config, loss, B, args, device)
        with mp.autocast_context(dtype, device.type):
            kept = rc.saved_activation_bytes(forward)[1]
        if args.scope == "model":
            formula = rc.activation_formula(config, B, T, mode, loss=loss)
        else:  # ln_f's input, mean and rstd come first: the head is ln_f + lm_head
            formula = B * T * (config.n_embd + 2) * 4
            formula += rc.loss_formula(config, B, T, mode, loss)
        if device.type == "cuda":
            timing.clock(device)  # the queue drained: nothing of before is in flight
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            step(forward, model, dtype, device)
            peak = torch.cuda.max_memory_allocated(device) - before
        else:
            with timing.StepPeak() as watched:
                step(forward, model, dtype, device)
            peak = watched.peak
        one = functools.partial(step, forward, model, dtype, device)
        ms = 1e3 * timing.median_seconds(one, args.steps, 0, device)
        rows.append((B, loss, kept, formula, peak, ms))
        del model, forward
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    add = parser.add_argument
    add("--batch-sizes", default="16,32", help="B for the formulas' table")
    add("--measure", default="16,32" if cuda else "1", help="B to run both losses at")
    add("--scope", default="model" if cuda else "head", choices=("head", "model"))
    add("--dtype", default="bf16" if cuda else "fp32", choices=tuple(mp.DTYPES))
    add("--chunk-tokens", type=int, default=1024, help="apply_chunked_loss's default")
    add("--steps", type=int, default=3, help="timed steps per loss, after one watched")
    add("--block-size", type=int, default=1024, help="T")
    add("--preset", default="gpt2", help="02's preset: GPT-2 124M's shape, or smaller to try")
    add("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if cuda else "cpu")
    T = args.block_size
    config = model_lib.GPTConfig.from_preset(
        args.preset, block_size=T, pad_vocab_multiple=64
    )
    print(timing.machine() + "\n")
    print_formulas(
        config, T, [int(b) for b in args.batch_sizes.split(",")], mode_of(args.dtype)
    )
    scope = "lm_head + loss" if args.scope == "head" else "the whole model"
    print(
        f"\nmeasured, {scope}, {mode_of(args.dtype)}, chunks of {args.chunk_tokens:,}"
    )
    peak = "max_memory_allocated GB" if cuda else "StepPeak GB"
    print(f"{'B':>4} {'loss':<8} {'kept GB':>8} {'formula':>8} {peak:>24} {'ms':>9}")
    for B in [int(b) for b in args.measure.split(",")]:
        for _, loss, kept, formula, peak, ms in measure(config, B, args, device):
            same = "=" if kept == formula else "!="
            bytes_kept = f"{kept / GB:>8.3f} {same} {formula / GB:>6.3f}"
            print(f"{B:>4} {loss:<8} {bytes_kept} {peak / GB:>24.3f} {ms:>9.1f}")


if __name__ == "__main__":
    main()
