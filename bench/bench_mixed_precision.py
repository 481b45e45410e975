"""Mixed precision, measured side by side: step time, tokens/s, MFU and memory of one GPT training
step in fp32, tf32 (CUDA only), bf16 (autocast), fp16 (autocast + DynamicLossScaler) and fp16 by
hand (MasterWeights), all from the same init on the same batches, in one process.

    python bench/bench_mixed_precision.py                          # GPU: GPT-2 124M, B=16, T=1024
    python bench/bench_mixed_precision.py --preset small --vocab-size 256 --steps 12   # a CPU

On a GPU the memory column is torch.cuda.max_memory_allocated for that mode alone (each mode
runs on its own, after the previous one is freed); on a CPU it is the sum of the components 06
measures (parameters, gradients, AdamW state, saved activations). The speed-up is a tensor-core
property: on a CPU without 16-bit matmul units, 16-bit is slower than fp32.
"""

import argparse
import contextlib
import gc
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the numbered files live there
model_lib = importlib.import_module("02_model")
mp = importlib.import_module("06_mixed_precision")

MODES = ("fp32", "tf32", "bf16 autocast", "fp16 autocast + scaler", "fp16 by hand")


@contextlib.contextmanager
def matmul_precision(mode: str):
    """tf32 is fp32 with torch.set_float32_matmul_precision("high"); every other mode: highest."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if mode == "tf32" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def run(mode: str, config, batches, args, device) -> dict:
    """Train `mode` on the batches; median step time after the warm-up, and memory."""
    run_args = argparse.Namespace(seed=0, lr=3e-4, init_scale=2.0**16, growth_interval=2000)
    build_mode = "fp32" if mode == "tf32" else mode
    model, optimizer, scaler, master, ac = mp.build(build_mode, config, run_args, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    with matmul_precision(mode):
        for x, y in batches:
            t0 = time.perf_counter()
            losses.append(mp.train_step(model, optimizer, scaler, master, ac, x, y))  # synced
            times.append(time.perf_counter() - t0)
        if device.type == "cuda":
            memory = torch.cuda.max_memory_allocated(device)
        else:
            table = mp.memory_table(model, optimizer, master, ac, *batches[0], build_mode)
            memory = sum(measured for measured, _ in table.values())
    ms = 1e3 * statistics.median(times[args.warmup :])
    return {"ms": ms, "memory": memory, "loss": losses[-1], "skipped": scaler.skipped_steps}


def main():
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="gpt2" if cuda else "tiny", help="02_model preset")
    parser.add_argument("--batch-size", type=int, default=16 if cuda else 8)
    parser.add_argument("--block-size", type=int, default=0, help="T (0: the preset's)")
    parser.add_argument("--vocab-size", type=int, default=0, help="V (0: the preset's)")
    parser.add_argument(
        "--steps", type=int, default=30, help="timed steps per mode, warm-up included"
    )
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the median")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (0: torch's default)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    args = parser.parse_args()
    assert args.steps > args.warmup, f"--steps {args.steps} must exceed --warmup {args.warmup}"
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if cuda else "cpu")
    overrides = {
        k: v for k, v in (("block_size", args.block_size), ("vocab_size", args.vocab_size)) if v
    }
    if args.preset == "gpt2":
        overrides["pad_vocab_multiple"] = 64  # 50257 -> 50304: tensor-core friendly shapes
    config = model_lib.GPTConfig.from_preset(args.preset, **overrides)
    T, V = config.block_size, config.vocab_size
    g = torch.Generator().manual_seed(0)
    batches = [
        tuple(torch.randint(0, V, (args.batch_size, T), generator=g).to(device) for _ in "xy")
        for _ in range(args.steps)
    ]
    name = torch.cuda.get_device_name() if cuda else f"CPU ({torch.get_num_threads()} threads)"
    n_params = model_lib.count_params(config)
    print(f"{args.preset}: {n_params:,} parameters, V = {V}, B = {args.batch_size}, T = {T}, "
          f"on {name}, torch {torch.__version__}")  # fmt: skip
    print(f"{'mode':<24} {'ms/step':>9} {'tokens/s':>10} {'speed-up':>8} {'MFU':>6} "
          f"{'memory MB':>10} {'loss':>7} {'skipped':>7}")  # fmt: skip
    modes = [m for m in args.modes.split(",") if cuda or m != "tf32"]  # tf32: a GPU mode
    base = None
    for mode in modes:
        r = run(mode, config, batches, args, device)
        base = base or r["ms"]
        tokens_per_s = args.batch_size * T / (r["ms"] / 1e3)
        dtype = {"fp32": "fp32", "tf32": "tf32"}.get(mode, mode[:4])
        peak = model_lib.peak_flops(name, dtype) if cuda else None
        mfu = model_lib.mfu(tokens_per_s, model_lib.flops_per_token(config, T), 1, peak)
        mfu_text = f"{mfu:.1%}" if mfu is not None else "-"
        print(f"{mode:<24} {r['ms']:>9.2f} {tokens_per_s:>10,.0f} {base / r['ms']:>7.2f}x "
              f"{mfu_text:>6} {r['memory'] / 2**20:>10,.1f} {r['loss']:>7.3f} {r['skipped']:>7}")  # fmt: skip
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    print("speed-up = fp32's ms/step / this mode's; memory: CUDA peak allocated, or on a CPU the "
          "sum of params, grads, AdamW state and saved activations")  # fmt: skip


if __name__ == "__main__":
    main()
