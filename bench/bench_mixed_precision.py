"""Mixed precision, measured side by side: step time, tokens/s, MFU, memory and loss of one GPT
training step in fp32, tf32 (CUDA only), bf16 (autocast), fp16 (autocast + 06's
DynamicLossScaler) and fp16 by hand (06's MasterWeights), all from the same init on the same
batches (02's byte_batches: real text, so the loss curves mean something), in one process.

    python bench/bench_mixed_precision.py                          # GPU: GPT-2 124M, B=16, T=1024
    python bench/bench_mixed_precision.py --steps 150 --figure docs/mixed_precision_loss.png  # CPU

On a GPU the memory column is torch.cuda.max_memory_allocated for that mode alone (each mode
runs on its own, after the previous one is freed); on a CPU it is the sum of the components, and
a second table prints each one measured against its formula: parameters, gradients, AdamW's
state and the activations saved for the backward (06's saved_activation_bytes against
activation_formula). --figure writes the loss curves of every mode (the README's
docs/mixed_precision_loss.png comes from the CPU line above). The speed-up is a tensor-core
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
gpus = importlib.import_module("bench.gpus")  # peak_flops, mfu

MODES = ("fp32", "tf32", "bf16 autocast", "fp16 autocast + scaler", "fp16 by hand")


def build(mode: str, config, args, device):
    """Model, AdamW, scaler, MasterWeights (by hand only) and autocast dtype; the same init."""
    torch.manual_seed(args.seed)
    model = model_lib.GPT(config).to(device)
    dtype = mp.DTYPES[mode[:4]] if mode != "tf32" else torch.float32  # "fp16 by hand" -> fp16
    master = mp.MasterWeights(model, dtype) if mode == "fp16 by hand" else None
    optimizer = torch.optim.AdamW(master.parameters() if master else model.parameters(), lr=args.lr)
    scaler = mp.make_scaler(dtype, init_scale=2.0**16, growth_interval=args.growth_interval)
    return model, optimizer, scaler, master, dtype if "autocast" in mode else torch.float32


@contextlib.contextmanager
def matmul_precision(mode: str):
    """tf32 is fp32 with torch.set_float32_matmul_precision("high"); every other mode: highest."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if mode == "tf32" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def memory_table(model, optimizer, master, autocast_dtype, x, y, mode) -> dict:
    """{component: (measured bytes, formula bytes)} after training: one more forward/backward
    (no step) measures the parameters, gradients, AdamW state and saved activations."""
    with mp.autocast_context(autocast_dtype, x.device.type):
        (_, loss), activations = mp.saved_activation_bytes(model, lambda: model(x, y))
    loss.backward()
    if master:
        master.grads_to_master()
    params = master.working + master.master if master else list(model.parameters())
    masters = master.master if master else params
    N = sum(p.numel() for p in masters)
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    measured = [mp.tensor_bytes(params), mp.tensor_bytes(p.grad for p in params if p.grad is not None),
                mp.tensor_bytes(state), activations]  # fmt: skip
    optimizer.zero_grad(set_to_none=True)
    formulas = [(2 + 4) * N if master else 4 * N,  # by hand: 16-bit working + fp32 master
                4 * N,  # fp32 grads (by hand: the 16-bit ones are freed once copied up)
                8 * N + 4 * len(masters),  # AdamW's m and v, fp32, and a 4-byte step per tensor
                mp.activation_formula(model.config, *x.shape, mode)]  # fmt: skip
    return dict(zip(("params", "grads", "AdamW state", "activations"), zip(measured, formulas)))


def run(mode: str, config, batches, args, device) -> dict:
    """Train `mode` on the batches; median step time after the warm-up, memory and losses."""
    build_mode = "fp32" if mode == "tf32" else mode
    model, optimizer, scaler, master, ac = build(mode, config, args, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses, table = [], [], None
    with matmul_precision(mode):
        for x, y in batches:
            t0 = time.perf_counter()
            losses.append(mp.train_step(model, optimizer, scaler, master, ac, x, y))  # synced
            times.append(time.perf_counter() - t0)
        if device.type == "cuda":
            memory = torch.cuda.max_memory_allocated(device)
        else:
            table = memory_table(model, optimizer, master, ac, *batches[0], build_mode)
            memory = sum(measured for measured, _ in table.values())
    ms = 1e3 * statistics.median(times[args.warmup :])
    return dict(ms=ms, memory=memory, table=table, losses=losses, skipped=scaler.skipped_steps)


def print_memory(results: dict):
    """The CPU's per-component table: measured / formula, in KB."""
    columns = "".join(f"{k:>20}" for k in next(iter(results.values()))["table"])
    print(f"\n{'KB: measured / formula':<24}{columns}")
    for mode, r in results.items():
        cells = "".join(f"{m / 1024:>10,.1f} / {f / 1024:>7,.1f}" for m, f in r["table"].values())
        print(f"{mode:<24}{cells}")


def plot_losses(results: dict, path):
    """Every mode's loss curve, and its difference from fp32's, from the same init and batches."""
    from matplotlib.figure import Figure  # no pyplot: a file, never a window

    fig = Figure(figsize=(9, 6))
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    base = torch.tensor(results["fp32"]["losses"])
    for mode, r in results.items():
        top.plot(r["losses"], label=f"{mode} ({r['ms']:.1f} ms/step)", linewidth=1)
        bottom.plot((torch.tensor(r["losses"]) - base).numpy(), linewidth=1)
    top.set(ylabel="training loss", title=f"{' vs '.join(results)}: the same init and batches")
    bottom.set(xlabel="step", ylabel="loss - fp32 loss")
    top.legend()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"wrote {path}")


def main(argv=None):
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--preset", default="gpt2" if cuda else "tiny", help="02_model preset; GPT-2 124M on GPUs"
    )
    parser.add_argument(
        "--batch-size", type=int, default=16 if cuda else 8, help="sequences per step (B)"
    )
    parser.add_argument("--block-size", type=int, default=0, help="T (0: the preset's)")
    parser.add_argument(
        "--steps", type=int, default=30, help="steps per mode, warm-up included; 150 for curves"
    )
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the median")
    parser.add_argument(
        "--lr", type=float, default=3e-4 if cuda else 3e-3, help="AdamW's; higher for tiny"
    )
    parser.add_argument(
        "--growth-interval", type=int, default=2000, help="fp16 scaler: GradScaler's default"
    )
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (0: torch's default)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    parser.add_argument("--figure", default="", help="write the loss curves here ('': none)")
    parser.add_argument("--seed", type=int, default=0, help="init and batch seed; runs repeat")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if cuda else "cpu")
    # bytes are token ids < 256, valid for every vocabulary; 64: tensor-core friendly V (50304)
    overrides = {"block_size": args.block_size} if args.block_size else {}
    if args.preset.startswith("gpt2"):
        overrides["pad_vocab_multiple"] = 64
    config = model_lib.GPTConfig.from_preset(args.preset, **overrides)
    T, V = config.block_size, config.vocab_size
    batches = model_lib.byte_batches(T, args.batch_size, args.steps, args.seed, device)
    name = torch.cuda.get_device_name() if cuda else f"CPU ({torch.get_num_threads()} threads)"
    print(f"{args.preset}: {model_lib.count_params(config):,} parameters, V = {V}, "
          f"B = {args.batch_size}, T = {T}, on {name}, torch {torch.__version__}")  # fmt: skip
    print(f"{'mode':<24} {'ms/step':>9} {'tokens/s':>10} {'speed-up':>8} {'MFU':>6} "
          f"{'memory MB':>10} {'loss':>7} {'skipped':>7}")  # fmt: skip
    results, base = {}, None
    for mode in [m for m in args.modes.split(",") if cuda or m != "tf32"]:  # tf32: a GPU mode
        r = results[mode] = run(mode, config, batches, args, device)
        base = base or r["ms"]
        tokens_per_s = args.batch_size * T / (r["ms"] / 1e3)
        dtype = {"fp32": "fp32", "tf32": "tf32"}.get(mode, mode[:4])
        peak = gpus.peak_flops(name, dtype) if cuda else None
        mfu = gpus.mfu(tokens_per_s, model_lib.flops_per_token(config, T), 1, peak)
        mfu_text = f"{mfu:.1%}" if mfu is not None else "-"
        print(f"{mode:<24} {r['ms']:>9.2f} {tokens_per_s:>10,.0f} {base / r['ms']:>7.2f}x "
              f"{mfu_text:>6} {r['memory'] / 2**20:>10,.1f} {r['losses'][-1]:>7.3f} "
              f"{r['skipped']:>7}")  # fmt: skip
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    print("speed-up = fp32's ms/step / this mode's; memory: CUDA peak allocated, or on a CPU the "
          "sum of params, grads, AdamW state and saved activations")  # fmt: skip
    if not cuda:
        print_memory(results)
    if args.figure and "fp32" in results:
        plot_losses(results, args.figure)


if __name__ == "__main__":
    main()
