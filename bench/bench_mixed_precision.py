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
import gc
import importlib
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # the numbered files live there
model_lib = importlib.import_module("02_model")
mp = importlib.import_module("06_mixed_precision")
rc = importlib.import_module("06b_recompute")  # recomputation, the chunked loss
gpus = importlib.import_module("support.gpus")  # peak_flops, mfu

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
    measured = [tensor_bytes(params), tensor_bytes(p.grad for p in params if p.grad is not None),
                tensor_bytes(state), activations]  # fmt: skip
    optimizer.zero_grad(set_to_none=True)
    formulas = [(2 + 4) * N if master else 4 * N,  # by hand: 16-bit working + fp32 master
                4 * N,  # fp32 grads (by hand: the 16-bit ones are freed once copied up)
                8 * N + 4 * len(masters),  # AdamW's m and v, fp32, and a 4-byte step per tensor
                rc.activation_formula(model.config, *x.shape, mode)]  # fmt: skip
    return dict(
        zip(("params", "grads", "AdamW state", "activations"), zip(measured, formulas))
    )


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
            losses.append(
                mp.train_step(model, optimizer, scaler, master, ac, x, y)
            )  # synced
            times.append(time.perf_counter() - t0)
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
    bins, k = (
        torch.arange(-50.0, 20.0, 0.5).numpy(),
        math.log2(scale),
    )  # log2 |g| bins; S = 2^k
    fp16 = torch.finfo(torch.float16)
    lines = {"fp16 smallest subnormal (below: 0)": fp16.tiny * fp16.eps,
             "fp16 smallest normal": fp16.tiny, "fp16 max": fp16.max}  # fmt: skip
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
    settings, device, runs = (
        dict(init_scale=2.0**28, growth_interval=2),
        batches[0][0].device,
        [],
    )
    print(
        "fp16 autocast from S = 2^28, growth every 2 clean steps; log2 S after each step:"
    )
    for scaler in (
        mp.DynamicLossScaler(**settings),
        torch.amp.GradScaler(device.type, **settings),
    ):
        torch.manual_seed(args.seed)  # the same init for both
        model = model_lib.GPT(config).to(device)
        optimizer, log2_scale = torch.optim.AdamW(model.parameters(), lr=args.lr), []
        for x, y in batches:
            loss = mp.train_step(model, optimizer, scaler, None, torch.float16, x, y)
            log2_scale.append(int(math.log2(scaler.get_scale())))
        runs.append((log2_scale, loss))
        print(f"{type(scaler).__name__:<18} {log2_scale}, last loss {loss!r}")
    print(f"the same scales and losses, to the last bit: {runs[0] == runs[1]}\n")


def _storages(tree) -> dict:
    tensors = [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
    return {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}


class StepPeak(TorchDispatchMode):
    """The most bytes alive at once among the tensors allocated inside (after every op: forward,
    backward and optimizer), for a CPU, which has no torch.cuda.max_memory_allocated. Each op's
    new storages (not views of its inputs) are watched through weak references, which expire
    when nothing holds that memory any more."""

    def __init__(self):
        super().__init__()
        self.made = {}  # address -> (weak reference, bytes) of the latest storage there
        self.peak = 0

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        out = op(*args, **(kwargs or {}))
        inputs = _storages((args, kwargs))
        for address, storage in _storages(out).items():
            if address not in inputs:
                self.made[address] = (StorageWeakRef(storage), storage.nbytes())
        self.made = {a: v for a, v in self.made.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.made.values()))
        return out


def recompute_rows(config, args, device, mode: str) -> list:
    """Each recompute mode of 02 on `config` in 06b's `mode`: ms per training step (median of
    --steps at --batch-size), and the activation bytes held for the backward (06b's
    saved_activation_bytes) at B = 1 and 2: their difference is one sequence's, the rest is per
    batch (autocast's weight copies), with activation_formula's; and the step's peak memory."""
    rows, dtype = [], mp.DTYPES[mode[:4]] if "autocast" in mode else torch.float32
    batches = model_lib.byte_batches(
        config.block_size, args.batch_size, args.steps, args.seed, device
    )
    for recompute in rc.RECOMPUTE:
        torch.manual_seed(args.seed)
        model = rc.apply_recomputation(model_lib.GPT(config).to(device), recompute)
        optimizer, scaler = (
            torch.optim.AdamW(model.parameters(), lr=args.lr),
            mp.make_scaler(dtype),
        )
        held, formula = [], []
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
            t0 = time.perf_counter()
            mp.train_step(
                model, optimizer, scaler, None, dtype, x, y
            )  # ends in .item(): synced
            times.append(time.perf_counter() - t0)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
        else:  # one more step, watched: the weights and AdamW's state, plus the step's own peak
            state = [
                t
                for s in optimizer.state.values()
                for t in s.values()
                if torch.is_tensor(t)
            ]
            with StepPeak() as step:
                mp.train_step(model, optimizer, scaler, None, dtype, *batches[-1])
            peak = tensor_bytes(list(model.parameters()) + state) + step.peak
        per_sequence, per_batch = held[1] - held[0], 2 * held[0] - held[1]
        formula = (
            formula[1] - formula[0],
            2 * formula[0] - formula[1],
        )  # sequence, batch
        ms = 1e3 * statistics.median(times[args.warmup :])
        rows.append(dict(recompute=recompute, ms=ms, sequence=per_sequence, batch=per_batch,
                         peak=peak, formula=formula))  # fmt: skip
    return rows


def print_recompute(config, args, device, mode: str):
    """The recomputation table, and the largest micro-batch each mode fits in --budget-gb:
    (budget - 16 bytes per parameter for fp32 weights, gradients and AdamW's two moments - the
    per-batch bytes) / one sequence's bytes, both measured (flash attention: linear in T)."""
    rows = recompute_rows(config, args, device, mode)
    N, T, MB = model_lib.count_params(config), config.block_size, 1e6
    free = args.budget_gb * 1e9 - 16 * N
    print(f"\nrecomputation, {mode}, B = {args.batch_size}, T = {T}: activation bytes held for the "
          f"backward, measured (06b's formula); max B = ({args.budget_gb:g} GB - 16 x {N:,} "
          "parameters - per batch) / per sequence")  # fmt: skip
    print(f"{'recompute':<10} {'ms/step':>9} {'x none':>7} {'MB per sequence':>22} "
          f"{'MB per batch':>20} {'max B':>8} {'peak MB':>9}")  # fmt: skip
    for r in rows:
        sequence = f"{r['sequence'] / MB:,.2f} ({r['formula'][0] / MB:,.2f})"
        batch = f"{r['batch'] / MB:,.2f} ({r['formula'][1] / MB:,.2f})"
        max_b = int((free - r["batch"]) // r["sequence"])
        print(f"{r['recompute']:<10} {r['ms']:>9.1f} {r['ms'] / rows[0]['ms']:>6.2f}x "
              f"{sequence:>22} {batch:>20} {max_b:>8,} {r['peak'] / MB:>9,.1f}")  # fmt: skip


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
    precision, choices = (
        "bf16 autocast" if cuda else "fp32",
        ("fp32", "bf16 autocast", ""),
    )
    parser.add_argument("--recompute-precision", default=precision, choices=choices,
                        help="06b's mode the recomputation table runs in (every recompute mode: "
                        "time, bytes held, max batch, peak); '' skips the table")  # fmt: skip
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
    T, V = config.block_size, config.vocab_size
    batches = model_lib.byte_batches(T, args.batch_size, args.steps, args.seed, device)
    name = (
        torch.cuda.get_device_name()
        if cuda
        else f"CPU ({torch.get_num_threads()} threads)"
    )
    print(f"{args.preset}: {model_lib.count_params(config):,} parameters, V = {V}, "
          f"B = {args.batch_size}, T = {T}, on {name}, torch {torch.__version__}")  # fmt: skip
    print(f"{'mode':<24} {'ms/step':>9} {'tokens/s':>10} {'speed-up':>8} {'MFU':>6} "
          f"{'memory MiB':>10} {'loss':>7} {'skipped':>7}")  # fmt: skip
    results, base = {}, None
    for mode in [
        m for m in args.modes.split(",") if m and (cuda or m != "tf32")
    ]:  # tf32: GPU
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
