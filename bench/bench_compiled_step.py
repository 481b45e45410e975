"""One compiled bf16 training step of 02's GPT on a GPU, as lean as it gets: tokens/s, MFU and peak
memory per preset, then a torch.profiler breakdown of where the GPU's time goes.

The step is train.py's at one rank without its plumbing (no data loader, no logging): bf16
autocast, SDPA flash attention, `model.compile()` as `--compile` does, fused AdamW, gradient
clipping, on random tokens. MFU = tokens/s x 02's flops_per_token / the card's dense bf16 peak
(support/gpus.py). The profile sorts the GPU's kernels into matmuls, attention (SDPA's kernels:
cuDNN's or flash attention's), Triton's fused elementwise kernels, the optimizer (with the
clipping's foreach kernels) and the rest, and prints the kernels' total time per step: set
against the unprofiled step time above it, the difference is the time the GPU sat idle (the
profiler itself slows the CPU's launches, so its own "busy" share is a lower bound).

    python bench/bench_compiled_step.py --presets gpt2,gpt2-medium --profile-dir out/profile

Needs a GPU; compiling takes about a minute per preset. `--device cpu --no-compile
--presets tiny` only tries the script on a CPU (tests/test_bench.py's smoke run).
"""

import argparse
import gzip
import importlib
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: numbered files
from bench import timing  # noqa: E402

model_lib = importlib.import_module("02_model")

# Kernel name pieces say what the GPU was doing; the first match wins. CUTLASS and cuBLAS
# GEMMs say "gemm", Hopper's "sm90_xmma" or "nvjet"; inductor's fused kernels "triton_".
CATEGORIES = [
    ("attention", ("flash", "fmha", "attention", "sdpa", "dot_do_o")),
    ("matmul", ("gemm", "xmma", "nvjet", "cutlass", "matmul")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("triton fused", ("triton",)),
]


def measure(preset: str, args):
    config = model_lib.GPTConfig.from_preset(preset, pad_vocab_multiple=64)
    cuda = args.device.type == "cuda"
    torch.manual_seed(0)
    model = model_lib.GPT(config).to(args.device)
    if not args.no_compile:
        model.compile()
    betas = (0.9, 0.95)
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=betas, fused=cuda)
    step = timing.make_step(model, optimizer, torch.bfloat16, clip=1.0)
    T = config.block_size
    shape = (2, args.batch_size, T)
    x, y = torch.randint(0, config.vocab_size, shape, device=args.device)
    # The first steps compile: timed apart, before the memory peak is reset.
    _, warm = timing.timed(lambda: [step(x, y) for _ in range(args.warmup)], device=args.device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    # The steps back to back, as train.py runs them: the GPU's queue never drains between.
    _, total = timing.timed(lambda: [step(x, y) for _ in range(args.steps)], device=args.device)
    dt = total / args.steps
    flops = model_lib.flops_per_token(config, T)
    result = timing.throughput(dt, args.batch_size * T, flops, "bf16", args.device)
    peak = f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if cuda else "n/a"
    print(f"{preset:<12} B={args.batch_size} T={T}: {result}")
    print(f"{'':<12} {flops:,} FLOPs/token, peak memory {peak}, warm-up {warm:.0f} s")
    if args.profile_dir and cuda:
        profile(step, x, y, preset, Path(args.profile_dir))
    del model, optimizer
    if cuda:
        torch.cuda.empty_cache()


def profile(step, x, y, preset: str, out: Path):
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    start = timing.clock("cuda")
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            step(x, y)
    wall = (timing.clock("cuda") - start) * 1e6  # us, as the profiler counts
    cuda = torch.autograd.DeviceType.CUDA  # kernels and copies; not the GPU-side annotations
    events = [e for e in prof.key_averages() if e.device_type == cuda and not e.is_user_annotation]
    busy = {}
    for e in events:
        name = e.key.lower()
        kind = next((c for c, words in CATEGORIES if any(w in name for w in words)), "other")
        busy[kind] = busy.get(kind, 0.0) + e.self_device_time_total
    total = sum(busy.values())
    each = f"{wall / 3e3:.1f} ms each under the profiler, which slows the CPU's launches"
    print(f"  profile of 3 steps ({each}): kernels {total / 3e3:.1f} ms a step,")
    busy_share = f"the GPU busy {total / wall:.0%} of the profiled time"
    print(f"  {busy_share} (compare the kernels' ms with the unprofiled step); of it:")
    for kind, us in sorted(busy.items(), key=lambda kv: -kv[1]):
        print(f"    {kind:<13} {us / total:6.1%}  ({us / 3e3:7.2f} ms per step)")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15))
    out.mkdir(parents=True, exist_ok=True)
    trace = out / f"trace_{preset}.json"
    prof.export_chrome_trace(str(trace))  # open in https://ui.perfetto.dev
    with open(trace, "rb") as f, gzip.open(f"{trace}.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    trace.unlink()
    print(f"  trace: {trace}.gz", flush=True)


def main(argv=None):
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=formatter)
    parser.add_argument("--presets", default="gpt2,gpt2-medium", help="02 presets, comma-separated")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step (B)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps: the compile")
    parser.add_argument("--no-compile", action="store_true", help="eager, for the compile's gain")
    parser.add_argument("--profile-dir", default="", help="profile each preset; traces go here")
    cuda = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=cuda, help="cpu: only to try the script")
    args = parser.parse_args(argv)
    args.device = torch.device(args.device)
    mode = "eager" if args.no_compile else "torch.compile"
    print(timing.machine(f"CUDA {torch.version.cuda}", "bf16 autocast, AdamW", mode))
    for preset in args.presets.split(","):
        measure(preset, args)


if __name__ == "__main__":
    main()
