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

Needs a GPU; compiling takes about a minute per preset.
"""

import argparse
import gzip
import importlib
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: numbered files
model_lib = importlib.import_module("02_model")
gpus = importlib.import_module("support.gpus")

# kernel name pieces -> what the GPU was doing (first match wins; CUTLASS/cuBLAS GEMMs: "gemm",
# Hopper's "sm90_xmma"/"nvjet"; Triton's fused kernels from inductor start "triton_")
CATEGORIES = (("attention", ("flash", "fmha", "attention", "sdpa", "dot_do_o")),
              ("matmul", ("gemm", "xmma", "nvjet", "cutlass", "matmul")),
              ("optimizer", ("adam", "multi_tensor", "foreach")),
              ("triton fused", ("triton",)))  # fmt: skip


def make_step(model, optimizer):
    def step(x, y):
        with torch.autocast("cuda", torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def measure(preset: str, args):
    config = model_lib.GPTConfig.from_preset(preset, pad_vocab_multiple=64)
    torch.manual_seed(0)
    model = model_lib.GPT(config).cuda()
    if not args.no_compile:
        model.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), fused=True)
    step, T = make_step(model, optimizer), config.block_size
    x, y = torch.randint(0, config.vocab_size, (2, args.batch_size, T), device="cuda")
    t0 = time.perf_counter()
    for _ in range(args.warmup):  # the compile happens here
        step(x, y)
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step(x, y)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / args.steps
    tokens_per_s, flops = args.batch_size * T / dt, model_lib.flops_per_token(config, T)
    peak = gpus.peak_flops(torch.cuda.get_device_name(), "bf16")
    util = gpus.mfu(tokens_per_s, flops, 1, peak)
    mfu = "n/a" if util is None else f"{util:.1%}"
    print(f"{preset:<12} B={args.batch_size} T={T}: {dt * 1e3:7.1f} ms/step {tokens_per_s:>9,.0f} "
          f"tok/s  MFU {mfu}  ({tokens_per_s * flops / 1e12:.0f} TFLOP/s of the model's "
          f"{flops:,} FLOPs/token)  peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} "
          f"GiB  (warm-up and compile {warm:.0f} s)", flush=True)  # fmt: skip
    if args.profile_dir:
        profile(step, x, y, preset, Path(args.profile_dir))
    del model, optimizer
    torch.cuda.empty_cache()


def profile(step, x, y, preset: str, out: Path):
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            step(x, y)
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e6  # us, as the profiler counts
    cuda = torch.autograd.DeviceType.CUDA  # kernels and copies; not the GPU-side annotations
    events = [e for e in prof.key_averages() if e.device_type == cuda and not e.is_user_annotation]
    busy = {}
    for e in events:
        name = e.key.lower()
        kind = next((c for c, words in CATEGORIES if any(w in name for w in words)), "other")
        busy[kind] = busy.get(kind, 0.0) + e.self_device_time_total
    total = sum(busy.values())
    print(f"  profile of 3 steps ({wall / 3e3:.1f} ms each under the profiler, which slows the "
          f"CPU's launches): kernels {total / 3e3:.1f} ms a step, the GPU busy {total / wall:.0%} "
          "of the profiled time (compare the kernels' ms with the unprofiled step); of it:")  # fmt: skip
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
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (on a CPU: bench/bench_model.py)")
    print(gpus.machine(), f"CUDA {torch.version.cuda}; bf16 autocast, fused AdamW, "
          f"{'eager' if args.no_compile else 'torch.compile'}")  # fmt: skip
    for preset in args.presets.split(","):
        measure(preset, args)


if __name__ == "__main__":
    main()
