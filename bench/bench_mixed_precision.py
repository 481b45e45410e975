"""Mixed precision, measured side by side: step time, tokens/s, MFU, memory and loss of one GPT
training step in fp32, tf32 (CUDA only), bf16 (autocast), fp16 (autocast + 06's
DynamicLossScaler) and fp16 by hand (06's MasterWeights), all from the same init on the same
batches (02's byte_batches: real text, so the loss curves mean something), in one process.

    python bench/bench_mixed_precision.py                          # GPU: GPT-2 124M, B=16, T=1024
    python bench/bench_mixed_precision.py --steps 150 --figure docs/mixed_precision_loss.png  # CPU
    python bench/bench_mixed_precision.py --modes fp32 --underflow-figure docs/grad_underflow.png
    python bench/bench_mixed_precision.py --preset small --vocab-size 4096 --modes fp32

On a GPU the memory column is torch.cuda.max_memory_allocated for that mode alone (each mode
runs on its own, after the previous one is freed); on a CPU it is the sum of the components. A
second table prints each component measured against its formula: parameters, gradients, AdamW's
state and the activations saved for the backward (06b's saved_activation_bytes against
activation_formula). --figure writes the loss curves of every mode (the README's
docs/mixed_precision_loss.png comes from the CPU line above). The speed-up is a tensor-core
property: on a CPU without 16-bit matmul units, 16-bit is slower than fp32.

Then, in --recompute-precision, 06b's recomputation modes: ms per step, the activation bytes
of one sequence held for the backward (measured, and 06b's formula), the largest micro-batch that
leaves them room in --budget-gb, and the step's peak memory (a GPU's max_memory_allocated; on a
CPU the weights and AdamW's state plus the most bytes the step's own tensors hold at once). On a
CPU selective can cost more than full: torch runs its keep-or-redo policy in Python on every op,
a fixed cost that small ops do not hide. Last, 06's DynamicLossScaler against
torch.amp.GradScaler on one fp16 run, and with --underflow-figure 06's underflow table drawn as a
histogram.
"""

import argparse
import contextlib
import functools
import gc
import importlib
import math
import statistics
import sys
from pathlib import Path

import torch

# The repo root: the numbered files live there.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import timing  # noqa: E402

model_lib = importlib.import_module("02_model")
mp = importlib.import_module("06_mixed_precision")
rc = importlib.import_module("06b_recompute")  # recomputation, the chunked loss

MODES = ("fp32", "tf32", "bf16 autocast", "fp16 autocast + scaler", "fp16 by hand")


def build(mode: str, config, args, device):
    """Model, AdamW, scaler, MasterWeights (by hand only) and autocast dtype; the same init."""
    torch.manual_seed(args.seed)
    model = model_lib.GPT(config).to(device)
    dtype = (
        mp.DTYPES[mode[:4]] if mode != "tf32" else torch.float32
    )  # "fp16 by hand" -> fp16
    master = mp.MasterWeights(model, dtype) if mode == "fp16 by hand" else None
    optimizer = torch.optim.AdamW(
        master.parameters() if master else model.parameters(), lr=args.lr
    )
    scaler = mp.make_scaler(
        dtype, init_scale=2.0**16, growth_interval=args.growth_interval
    )
    return (
        model,
        optimizer,
        scaler,
        master,
        dtype if "autocast" in mode else torch.float32,
    )


@contextlib.contextmanager
def matmul_precision(mode: str):
    """tf32 is fp32 with torch.set_float32_matmul_precision("high"); every other mode: highest."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if mode == "tf32" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views and tied weights counted once)."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
    }
    return sum(storages.values())


def memory_table(model, optimizer, master, autocast_dtype, x, y, mode) -> dict:
    """{component: (measured bytes, formula bytes)} after training: one more forward/backward
    (no step) measures the parameters, gradients, AdamW state and saved activations."""
    with mp.autocast_context(autocast_dtype, x.device.type):
        (_, loss), activations = rc.saved_activation_bytes(lambda: model(x, y))
    loss.backward()
    if master:
        master.grads_to_master()
    params = master.working + master.master if master else list(model.parameters())
    masters = master.master if master else params
    N = sum(p.numel() for p in masters)
    state = [
        t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    ]
    grads = [p.grad for p in params if p.grad is not None]
    table = {}
    # By hand: 16-bit working weights and fp32 masters.
    weights = (2 + 4) * N if master else 4 * N
    table["params"] = (tensor_bytes(params), weights)
    # fp32 gradients (by hand: the 16-bit ones are freed once copied up).
    table["grads"] = (tensor_bytes(grads), 4 * N)
    # AdamW's m and v, fp32, and a 4-byte step count per tensor.
    table["AdamW state"] = (tensor_bytes(state), 8 * N + 4 * len(masters))
    formula = rc.activation_formula(model.config, *x.shape, mode)
    table["activations"] = (activations, formula)
    optimizer.zero_grad(set_to_none=True)
    return table


def run(mode: str, config, batches, args, device) -> dict:
    """Train `mode` on the batches; median step time after the warm-up, memory and losses."""
    build_mode = "fp32" if mode == "tf32" else mode
    model, optimizer, scaler, master, ac = build(mode, config, args, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    losses = []
    with matmul_precision(mode):
        for x, y in batches:
            step = functools.partial(mp.train_step, model, optimizer, scaler, master, ac)
            loss, seconds = timing.timed(step, x, y, device=device)
            losses.append(loss)
            times.append(seconds)
        memory = (
            torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        )
        table = memory_table(model, optimizer, master, ac, *batches[0], build_mode)
        memory = memory or sum(measured for measured, _ in table.values())
    ms = 1e3 * statistics.median(times[args.warmup :])
    return dict(
        ms=ms, memory=memory, table=table, losses=losses, skipped=scaler.skipped_steps
    )


def plot_grad_histogram(grads: dict, scale: float, path):
    """06's underflow table as a picture: log2 |gradient| as computed and times S, against fp16's
    range (the README's docs/grad_underflow.png)."""
    from matplotlib.figure import Figure  # no pyplot: a file, never a window

    fig = Figure(figsize=(9, 6))
    axes = fig.subplots(2, 1, sharex=True)
    bins = torch.arange(-50.0, 20.0, 0.5).numpy()  # log2 |g|
    k = math.log2(scale)  # S = 2^k
    fp16 = torch.finfo(torch.float16)
    lines = {}
    lines["fp16 smallest subnormal (below: 0)"] = fp16.tiny * fp16.eps
    lines["fp16 smallest normal"] = fp16.tiny
    lines["fp16 max"] = fp16.max
    for ax, (name, g) in zip(axes, grads.items()):
        log2 = g.double().log2().numpy()
        ax.hist(log2, bins=bins, alpha=0.6, label=f"{name}, as computed (fp32)")
        ax.hist(
            log2 + k,
            bins=bins,
            histtype="step",
            linewidth=1.5,
            label=f"x S = 2^{k:.0f}",
        )
        for (text, x), style in zip(lines.items(), (":", "--", "-")):
            ax.axvline(
                math.log2(x), color="k", linestyle=style, linewidth=1, label=text
            )
        ax.set(ylabel="count")
        ax.legend(loc="upper left", fontsize=8)
    axes[0].set_title(
        "Tiny GPT gradients against fp16's range: loss scaling shifts them right"
    )
    axes[1].set(xlabel="log2 |gradient|")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"wrote {path}\n")


def scaler_comparison(config, batches, args):
    """DynamicLossScaler against torch.amp.GradScaler on one fp16 autocast run from S = 2^28 (so
    large that the backward overflows): the same scales and losses, to the last bit."""
    settings = dict(init_scale=2.0**28, growth_interval=2)
    device = batches[0][0].device
    runs = []
    print(
        "fp16 autocast from S = 2^28, growth every 2 clean steps; log2 S after each step:"
    )
    for scaler in (
        mp.DynamicLossScaler(**settings),
        torch.amp.GradScaler(device.type, **settings),
    ):
        torch.manual_seed(args.seed)  # the same init for both
        model = model_lib.GPT(config).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        log2_scale = []
        for x, y in batches:
            loss = mp.train_step(model, optimizer, scaler, None, torch.float16, x, y)
            log2_scale.append(int(math.log2(scaler.get_scale())))
        runs.append((log2_scale, loss))
        print(f"{type(scaler).__name__:<18} {log2_scale}, last loss {loss!r}")
    print(f"the same scales and losses, to the last bit: {runs[0] == runs[1]}\n")


def recompute_rows(config, args, device, mode: str) -> list:
    """Each recompute mode of 02 on `config` in 06b's `mode`: ms per training step (median of
    --steps at --batch-size), and the activation bytes held for the backward (06b's
    saved_activation_bytes) at B = 1 and 2: their difference is one sequence's, the rest is per
    batch (autocast's weight copies), with activation_formula's; and the step's peak memory."""
    rows = []
    dtype = mp.DTYPES[mode[:4]] if "autocast" in mode else torch.float32
    batches = model_lib.byte_batches(
        config.block_size, args.batch_size, args.steps, args.seed, device
    )
    for recompute in rc.RECOMPUTE:
        torch.manual_seed(args.seed)
        model = rc.apply_recomputation(model_lib.GPT(config).to(device), recompute)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        scaler = mp.make_scaler(dtype)
        held = []
        formula = []
        for B in (1, 2):
            x, y = model_lib.byte_batches(config.block_size, B, 1, args.seed, device)[0]
            with mp.autocast_context(
                dtype, device.type
            ):  # (a new cache: weight copies again)
                held.append(
                    rc.saved_activation_bytes(lambda m=model, x=x, y=y: m(x, y))[1]
                )
            formula.append(
                rc.activation_formula(config, B, config.block_size, mode, recompute)
            )
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for x, y in batches:
            step = functools.partial(mp.train_step, model, optimizer, scaler, None, dtype)
            _, seconds = timing.timed(step, x, y, device=device)
            times.append(seconds)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
        else:  # one more step, watched: the weights and AdamW's state, plus the step's own peak
            state = [
                t
                for s in optimizer.state.values()
                for t in s.values()
                if torch.is_tensor(t)
            ]
            with timing.StepPeak() as step:
                mp.train_step(model, optimizer, scaler, None, dtype, *batches[-1])
            peak = tensor_bytes(list(model.parameters()) + state) + step.peak
        per_sequence = held[1] - held[0]
        per_batch = 2 * held[0] - held[1]
        # The formula's (sequence, batch), as the measured ones.
        formula = (formula[1] - formula[0], 2 * formula[0] - formula[1])
        ms = 1e3 * statistics.median(times[args.warmup :])
        row = dict(recompute=recompute, ms=ms, sequence=per_sequence, batch=per_batch)
        rows.append(dict(row, peak=peak, formula=formula))
    return rows


def print_recompute(config, args, device, mode: str):
    """The recomputation table, and the largest micro-batch each mode fits in --budget-gb:
    (budget - 16 bytes per parameter for fp32 weights, gradients and AdamW's two moments - the
    per-batch bytes) / one sequence's bytes, both measured (flash attention: linear in T)."""
    rows = recompute_rows(config, args, device, mode)
    N = model_lib.count_params(config)
    T = config.block_size
    MB = 1e6
    free = args.budget_gb * 1e9 - 16 * N
    print(f"\nrecomputation, {mode}, B = {args.batch_size}, T = {T}: activation bytes held")
    print(f"for the backward, measured (06b's formula); max B = ({args.budget_gb:g} GB")
    print(f"- 16 x {N:,} parameters - per batch) / per sequence")
    head = f"{'recompute':<10} {'ms/step':>9} {'x none':>7} {'MB per sequence':>22}"
    print(f"{head} {'MB per batch':>20} {'max B':>8} {'peak MB':>9}")
    for r in rows:
        sequence = f"{r['sequence'] / MB:,.2f} ({r['formula'][0] / MB:,.2f})"
        batch = f"{r['batch'] / MB:,.2f} ({r['formula'][1] / MB:,.2f})"
        max_b = int((free - r["batch"]) // r["sequence"])
        row = f"{r['recompute']:<10} {r['ms']:>9.1f} {r['ms'] / rows[0]['ms']:>6.2f}x"
        print(f"{row} {sequence:>22} {batch:>20} {max_b:>8,} {r['peak'] / MB:>9,.1f}")


def print_memory(results: dict):
    """The per-component table: measured / formula, in MB, and their sums (a GPU's peak adds the
    step's short-lived tensors, the logits' among them, and the allocator's rounding)."""
    columns = "".join(f"{k:>22}" for k in next(iter(results.values()))["table"])
    print(f"\n{'MiB: measured / formula':<24}{columns}{'sum':>22}")
    for mode, r in results.items():
        pairs = list(r["table"].values()) + [tuple(map(sum, zip(*r["table"].values())))]
        cells = "".join(f"{m / 2**20:>11,.2f} / {f / 2**20:>8,.2f}" for m, f in pairs)
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
    top.set(
        ylabel="training loss",
        title=f"{' vs '.join(results)}: the same init and batches",
    )
    bottom.set(xlabel="step", ylabel="loss - fp32 loss")
    top.legend()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"wrote {path}")


def main(argv=None):
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--preset",
        default="gpt2" if cuda else "tiny",
        help="02_model preset; GPT-2 124M on GPUs",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=16 if cuda else 8,
        help="sequences per step (B)",
    )
    parser.add_argument("--block-size", type=int, default=0, help="T (0: the preset's)")
    parser.add_argument(
        "--steps",
        type=int,
        default=30,
        help="steps per mode, warm-up included; 150 for curves",
    )
    parser.add_argument(
        "--warmup", type=int, default=5, help="first steps left out of the median"
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=3e-4 if cuda else 3e-3,
        help="AdamW's; higher for tiny",
    )
    parser.add_argument(
        "--growth-interval",
        type=int,
        default=2000,
        help="fp16 scaler: GradScaler's default",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (0: torch's default)"
    )
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated subset"
    )
    parser.add_argument(
        "--figure", default="", help="write the loss curves here ('': none)"
    )
    parser.add_argument("--vocab-size", type=int, default=0, help="V (0: the preset's)")
    precision = "bf16 autocast" if cuda else "fp32"
    choices = ("fp32", "bf16 autocast", "")
    why = "06b's mode the recomputation table runs in (every recompute mode: time, bytes"
    why += " held, max batch, peak); '' skips the table"
    parser.add_argument("--recompute-precision", default=precision, choices=choices, help=why)
    parser.add_argument(
        "--budget-gb", type=float, default=80.0, help="memory for the max batch"
    )
    parser.add_argument(
        "--underflow-figure", default="", help="draw 06's underflow table here"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="init and batch seed; runs repeat"
    )
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if cuda else "cpu")
    # bytes are token ids < 256, valid for every vocabulary; 64: tensor-core friendly V (50304)
    overrides = {"block_size": args.block_size} if args.block_size else {}
    overrides.update({"vocab_size": args.vocab_size} if args.vocab_size else {})
    if args.preset.startswith("gpt2"):
        overrides["pad_vocab_multiple"] = 64
    config = model_lib.GPTConfig.from_preset(args.preset, **overrides)
    T = config.block_size
    V = config.vocab_size
    batches = model_lib.byte_batches(T, args.batch_size, args.steps, args.seed, device)
    shape = f"{model_lib.count_params(config):,} parameters, V = {V}"
    print(f"{args.preset}: {shape}, B = {args.batch_size}, T = {T}")
    print(timing.machine())
    head = f"{'mode':<24} {'ms/step':>8} {'tokens/s':>16} {'TFLOP/s':>13}"
    print(f"{head} {'speed-up':>8} {'memory MiB':>10} {'loss':>7} {'skipped':>7}")
    results = {}
    base = None
    for mode in [
        m for m in args.modes.split(",") if m and (cuda or m != "tf32")
    ]:  # tf32: GPU
        r = results[mode] = run(mode, config, batches, args, device)
        base = base or r["ms"]
        dtype = {"fp32": "fp32", "tf32": "tf32"}.get(mode, mode[:4])
        flops = model_lib.flops_per_token(config, T)
        tokens = args.batch_size * T
        result = timing.throughput(r["ms"] / 1e3, tokens, flops, dtype, device)
        row = f"{mode:<24}{result} {base / r['ms']:>7.2f}x {r['memory'] / 2**20:>10,.1f}"
        print(f"{row} {r['losses'][-1]:>7.3f} {r['skipped']:>7}")
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    print("speed-up = fp32's ms/step / this mode's; memory: CUDA peak allocated, or on a CPU")
    print("the sum of params, grads, AdamW state and saved activations")
    if results:
        print_memory(results)
    if args.figure and "fp32" in results:
        plot_losses(results, args.figure)
    if args.recompute_precision:
        print_recompute(config, args, device, args.recompute_precision)
    tiny = model_lib.GPTConfig.from_preset(
        "tiny"
    )  # 06's demo model, and its defaults below
    demo = argparse.Namespace(seed=1337, lr=3e-3, init_scale=2.0**16, device=device)
    tiny_batches = model_lib.byte_batches(tiny.block_size, 8, 51, demo.seed, device)
    print()
    scaler_comparison(tiny, tiny_batches[:16], demo)
    if args.underflow_figure:
        grads = mp.underflow_demo(tiny, tiny_batches, demo)
        plot_grad_histogram(grads, demo.init_scale, args.underflow_figure)


if __name__ == "__main__":
    main()
