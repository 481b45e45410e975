"""09_plan.py's records and report: the Layout and Plan dataclasses, why the best layout
wins over every other value of each choice, what would make another fit, and the
printed table. Plumbing: it teaches nothing new; 09 computes every number it prints.
"""

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

from support.gpus import GPUS, plannable, roofline_seconds
from support.plan.shape import SHAPE, shape_problem, shape_text

GIB = 2**30
MIB = 2**20
KNOBS = ("tp", "pp", "cp", "zero", "recompute", "micro_batch", "schedule")
RECOMPUTE = ("none", "selective", "full")  # 06b's modes, least recomputation first
# The rows a measured run checks: the H200's own (fitted on), the published A100 and
# H100 runs (docs/planning.md), and the CPU's (fitted on). Others are extrapolated.
CHECKED = ("h200", "a100", "h100", "cpu")


@dataclass(frozen=True)
class Layout:
    """How a step is cut: the grid (dp·tp·pp·cp GPUs), ZeRO, recomputation, batch."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 0
    recompute: str = "none"
    micro_batch: int = 1  # Sequences per microbatch per DP rank.
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False

    def __str__(self) -> str:
        grid = f"dp {self.dp} tp {self.tp}{' sp' if self.sequence_parallel else ''}"
        pipe = f"pp {self.pp}"
        if self.pp > 1:
            v = self.virtual_stages
            pipe += f" {self.schedule}" + (f" v{v}" if v > 1 else "")
        cp = f" cp {self.cp}" if self.cp > 1 else ""
        rest = f"zero {self.zero} mb {self.micro_batch} {self.recompute}"
        return f"{grid} {pipe}{cp} {rest}"


@dataclass
class Plan:
    """09's plan(): bytes per GPU (its fullest one), seconds per step, and rates."""

    layout: Layout
    gpu: str
    n_gpus: int
    tokens_per_step: int
    memory: dict  # weights, grads, optimizer, activations, logits, gathered, total
    time: dict  # compute, bubble, tp, pp, cp, dp, total: seconds per step
    ranks: list  # Per pipeline rank: memory, collectives (by op), groups, in_flight
    flops_per_token: int
    capacity: float  # The bytes a plan may use: FIT x the GPU's memory.
    fits: bool = field(init=False)

    def __post_init__(self):
        self.fits = self.memory["total"] <= self.capacity

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.time["total"]

    @property
    def mfu(self) -> float:
        peak = self.n_gpus * GPUS[self.gpu].flops[self.ranks[0]["dtype"]]
        return self.tokens_per_s * self.flops_per_token / peak

    def budget(self, tokens: float, price: float | None = None) -> dict:
        """Hours to `tokens`, GPU-hours, energy in kWh (None: no power known), cost."""
        hours = tokens / self.tokens_per_s / 3600
        gpu_hours = hours * self.n_gpus
        watts = GPUS[self.gpu].watts
        kwh = None if watts is None else gpu_hours * watts / 1000
        cost = None if price is None else gpu_hours * price
        return dict(hours=hours, gpu_hours=gpu_hours, kwh=kwh, cost=cost)


def train_layout(cfg) -> Layout:
    """The Layout of train.py's settings (support/train/config.TrainConfig)."""
    cp = getattr(cfg, "cp", 1)
    grid = (cfg.dp, cfg.tp, cfg.pp, cp, cfg.zero, cfg.recompute, cfg.micro_batch_size)
    return Layout(*grid, cfg.schedule, cfg.virtual_stages, cfg.sequence_parallel)


def grid_problem(lay: Layout, batch: int, n_gpus: int) -> str | None:
    """What 09's check_layout refuses before any lesson's check, in one line."""
    world = lay.dp * lay.tp * lay.pp * lay.cp
    if world != n_gpus:
        sizes = f"dp {lay.dp} x tp {lay.tp} x pp {lay.pp} x cp {lay.cp} = {world}"
        return f"{sizes} does not fill {n_gpus} GPUs"
    if batch % (lay.micro_batch * lay.dp):
        return f"batch {batch} is not micro_batch {lay.micro_batch} x dp {lay.dp} x m"
    no_zero3 = lay.zero == 3 and lay.pp > 1  # 07 refuses ZeRO-3 on pp's chunks
    if lay.zero not in range(4) or lay.zero and lay.dp * lay.cp == 1 or no_zero3:
        return f"zero {lay.zero} needs a stage 0-3, dp > 1 and, at 3, pp 1"
    if lay.sequence_parallel and lay.tp == 1:
        return "sequence parallelism needs tp > 1"
    if lay.schedule == "zb1" and lay.pp == 1:  # train.py's line (support/train/config)
        return "--schedule zb1 splits PP's backward, but --pp is 1: it would do nothing"
    return None


def by_op(groups: dict) -> dict:
    """09's collective_bytes (by group, then op) summed by op, as tests count them."""
    out = dict(all_reduce=0, reduce_scatter=0, all_gather=0, send=0, ring=0)
    for ops in groups.values():
        for op, n in ops.items():
            out[op] += n
    return out


def given_shape(args, presets: dict) -> dict:
    """09's shape flags given on its command line (name -> value), checked: a
    ValueError of one line (shape_problem) if --model's preset cannot take them."""
    values = {**vars(args), "block_size": args.seq_len}  # --block-size is --seq-len
    given = {k: values[k] for k in SHAPE if values[k] is not None}
    if args.model not in presets:
        raise ValueError(f"--model {args.model}: 02 has {', '.join(presets)}")
    problem = shape_problem(presets, args.model, given)
    if problem:
        raise ValueError(problem)
    return given


def add_arguments(parser, presets, dtypes) -> None:
    """09's flags: --model's preset sets every size the shape flags do not."""
    add = parser.add_argument
    models = f"02's preset: {', '.join(presets)}; the shape flags' defaults"
    add("--model", default="gpt2-xl", help=models + " (default: %(default)s)")
    shape = "instead of the preset's"
    add("--n-layer", type=int, metavar="L", help=f"blocks, {shape}")
    add("--n-head", type=int, metavar="NH", help=f"heads (C/nh dims each), {shape}")
    add("--n-embd", type=int, metavar="C", help=f"the width, a multiple of nh, {shape}")
    vocab = f"wte's rows, {shape} (padded to a multiple of 64, as train.py)"
    add("--vocab-size", type=int, metavar="V", help=vocab)
    T = "T: a sequence's tokens and wpe's rows, instead of the preset's"
    add("--block-size", "--seq-len", dest="seq_len", type=int, metavar="T", help=T)
    add("--gpus", type=int, default=16, help="GPUs in all (default: %(default)s)")
    add("--gpus-per-node", type=int, default=8, help="GPUs sharing NVLink (default: 8)")
    add("--gpu", default="h100", help=f"{', '.join(plannable())} (default: h100)")
    add("--tokens", type=float, default=10e9, help="the run's tokens (default: 10e9)")
    add("--batch-size", type=int, default=512, help="sequences a step, all GPUs (512)")
    add("--dtype", default="bf16", choices=dtypes, help="default: bf16, autocast")
    add("--lora-rank", type=int, default=0, help="LoRA's rank (default: 0, off)")
    loss = "chunked: 06b's loss that never keeps the logits (default: plain)"
    add("--loss", default="plain", choices=("plain", "chunked"), help=loss)
    add("--price", type=float, default=None, help="$ per GPU-hour (default: no cost)")
    add("--top", type=int, default=5, help="fitting layouts printed (default: 5)")


def layouts(config, batch: int, n_gpus: int, gpus_per_node: int, T=None):
    """Every layout worth trying: TP, then CP, inside a node, each pipeline schedule,
    every ZeRO stage and recompute mode, every micro-batch that divides the batch per DP
    rank (nanoGPT's 12 of 480 too, not only powers of two)."""
    T = T or config.block_size
    sizes = [d for d in range(1, n_gpus + 1) if n_gpus % d == 0]
    for tp, pp, cp in itertools.product(sizes, repeat=3):
        dp = n_gpus // (tp * pp * cp)
        if n_gpus % (tp * pp * cp) or tp * cp > gpus_per_node or batch % dp:
            continue
        if config.n_head % tp or pp > config.n_layer or cp > 1 and T % (2 * cp):
            continue
        schedules = (
            [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zb1", 1)]
            if pp > 1
            else [("1f1b", 1)]
        )
        zeros = [0] if dp * cp == 1 else ([0, 1, 2] if pp > 1 else [0, 1, 2, 3])
        per_rank = batch // dp
        mbs = [b for b in range(1, per_rank + 1) if per_rank % b == 0]
        for (schedule, v), zero, recompute, mb in itertools.product(
            schedules, zeros, RECOMPUTE, mbs
        ):
            for sp in (False, True) if tp > 1 else (False,):
                yield Layout(dp, tp, pp, cp, zero, recompute, mb, schedule, v, sp)


def differs_in(a, b, name: str) -> bool:
    """b is a with `name` changed (and dp with tp, pp or cp, as the world is fixed)."""
    free = {name, "dp"} if name in ("tp", "pp", "cp") else {name}
    if name in ("pp", "schedule"):
        free |= {"schedule", "virtual_stages"}
    if name == "tp":
        free.add("sequence_parallel")
    same = all(
        getattr(a, f.name) == getattr(b, f.name)
        for f in dataclasses.fields(a)
        if f.name not in free
    )
    return same and getattr(a, name) != getattr(b, name)


def gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def size(n: float) -> str:
    """Bytes in GiB, or in MiB below 1 GiB (a CPU plan's sizes are not 0.0 GiB)."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def rank_key(p) -> tuple:
    """09's ranking: fitting plans first, fastest first; on a tie (to 0.1%) the simpler
    one: a lower ZeRO stage, less recomputation, fewer CP ranks, then the larger
    micro-batch (an assumption: fewer microbatches cost no more, where c is not
    measured), then less memory (cost_of says which). Plans that do not fit: least
    memory first."""
    if not p.fits:
        return (1, p.memory["total"])
    speed = round(math.log(p.tokens_per_s), 3)
    lay = p.layout
    simpler = (lay.zero, RECOMPUTE.index(lay.recompute), lay.cp)
    return (0, -speed, *simpler, -lay.micro_batch, p.memory["total"])


def cost_of(best, rival) -> str:
    """What taking `rival` instead of `best` would cost: memory it lacks, or time."""
    if not rival.fits:
        return f"does not fit: needs {size(rival.memory['total'])}"
    slower = 1 - rival.tokens_per_s / best.tokens_per_s
    if slower >= 0.0005:
        parts = [k for k in best.time if k != "total"]
        worse = max(parts, key=lambda k: rival.time[k] - best.time[k])
        grows = 1e3 * (rival.time[worse] - best.time[worse])
        zb1 = "zb1" in (rival.layout.schedule, best.layout.schedule)
        eager = "; zb1 runs eager: train.py cannot compile it" if zb1 else ""
        return f"{slower:.1%} slower ({worse} +{grows:.1f} ms{eager})"
    a = best.layout
    b = rival.layout
    if b.zero > a.zero:
        why = "a higher ZeRO stage"
    elif RECOMPUTE.index(b.recompute) > RECOMPUTE.index(a.recompute):
        why = "more recomputation"
    elif b.cp > a.cp:
        why = "a ring to run"
    elif b.micro_batch < a.micro_batch:
        why = "more microbatches (the ranking assumes they cost time)"
    else:
        why = f"{size(rival.memory['total'])} against {size(best.memory['total'])}"
    return f"as fast; ranked below for {why}"


def why_best(plans: list) -> list[str]:
    """For each choice of the best plan and each other value it could take: the best
    plan that differs only there (its whole layout: dp moves with tp, pp and cp), and
    what that value would cost (it does not fit, or the step part that grows most)."""
    best = plans[0]
    reasons = []
    for name in KNOBS:
        rivals = {}
        for p in plans[1:]:  # ranked: the first of each value is its best
            if differs_in(best.layout, p.layout, name):
                rivals.setdefault(getattr(p.layout, name), p)
        mine = f"{name} {getattr(best.layout, name)}"
        for value, rival in rivals.items():
            reasons.append(
                f"{mine}, not {value} ({rival.layout}): {cost_of(best, rival)}"
            )
    return reasons


def fix_for(bad, plans: list) -> str:
    """The fastest fitting plan one choice away from a plan that does not fit."""
    for p in plans:
        if not p.fits:
            break
        for name in ("zero", "recompute", "micro_batch", "tp", "pp", "cp"):
            if differs_in(bad.layout, p.layout, name):
                return f"{name} {getattr(p.layout, name)} would fit: {p.layout}"
    return "no single change fits"


def describe(p) -> list[str]:
    """Two lines: memory (GiB, or MiB under 1 GiB) and step time (ms), then rates;
    with cp > 1 a third: what 09 does not model of 08's ring."""
    m = p.memory
    scale, unit = (GIB, "GiB") if m["total"] >= GIB else (MIB, "MiB")
    mem = "+".join(f"{m[k] / scale:.1f}" for k in ("weights", "grads", "optimizer"))
    mem += f" +act {m['activations'] / scale:.1f} +logits {m['logits'] / scale:.1f}"
    if m.get("gathered"):  # ZeRO-3's whole root and two blocks at the peak (07)
        mem += f" +gathered {m['gathered'] / scale:.1f}"
    t = p.time
    parts = ("compute", "bubble", "tp", "pp", "cp", "dp")
    ms = " ".join(f"{k} {1e3 * t[k]:.0f}" for k in parts)
    head = f"{str(p.layout):<42} {m['total'] / scale:>5.1f} {unit}"
    rate = f"{p.tokens_per_s:>10,.0f} tok/s MFU {p.mfu:.0%}"
    lines = [f"{head} {rate}", f"{unit} {mem}; ms {ms}"]
    if p.layout.cp > 1:  # Its memory and time are below what the ring costs today.
        ring = "08's ring computes its blocks by hand in fp32"
        lines.append(f"not modelled: {ring} (bench/bench_ring_kernel.py)")
    return lines


def print_roofline(gpu: str, fit: dict, dtype: str, counts: tuple) -> float:
    """09's worked example: gpus.roofline_seconds' four terms, each alone (the others
    zeroed), printed beside their formulas filled in. -> their sum, in seconds."""
    seconds = []
    for keep in ((0,), (1,), (3, 4), (5,)):  # matmuls, attention, L·C and V, Ψ stepped
        alone = [n if i in (2, *keep) else 0 for i, n in enumerate(counts)]
        seconds.append(roofline_seconds(GPUS[gpu], fit, dtype, *alone)[0])
    e = fit["e_max"] * counts[2] / (counts[2] + fit["knee"])  # e(C) at this width
    beta = f"{fit['layer_bytes']:.0f}·L·C + {fit['vocab_bytes']:.1f}·V"
    rows = (
        f"matmuls   6Ψ·tokens / (peak · e({counts[2]:.0f}) = {e:.3f})",
        f"attention 12·L·C·T·tokens / (peak · {fit['attention']:.3f})",
        f"memory    ({beta})·tokens / HBM",
        f"AdamW     {fit['param_bytes']:.1f} B·Ψ / HBM",
    )
    for row, t in zip(rows, seconds):
        print(f"    {row:<48}{t * 1e3:5.1f} ms")
    return sum(seconds)


def print_search(plans: list, args, fit_share: float, config, count_params) -> None:
    """The model's shape and parameters (02's `count_params`); the fitting layouts,
    fastest first; why the best wins; two that do not fit and what would make them
    fit; the best one's hours, GPU-hours, energy and cost."""
    fit = [p for p in plans if p.fits]
    gpu = GPUS[args.gpu.lower()]
    print(f"\nmodel: {shape_text(config)}")
    preset = f"--model {args.model}'s where no flag says"
    psi = count_params(config)
    print(f"  ({preset}): {psi:,} parameters (02's count, V padded to 64)")
    what = f"{args.gpus} x {args.gpu} ({args.gpus_per_node} a node)"
    T = config.block_size
    print(f"on {what}, batch {args.batch_size} x {T}, {args.dtype}:")
    if args.gpu.lower() not in CHECKED:  # docs/planning.md, "Checked against ..."
        fitted = "e(C) and the bytes a token are the H200's"
        print(f"no published run checks the {args.gpu} row: {fitted}")
    share = f"{fit_share:.0%} of {size(gpu.memory)}"
    print(f"{len(plans)} layouts, {len(fit)} fit in {share}; the fastest:")
    for i, p in enumerate(fit[: args.top]):
        lines = describe(p)
        print(f"{i + 1:>2}. " + "\n    ".join(lines))
    print("why the best wins: each other value of each choice, at its best")
    for reason in why_best(plans):
        print(f"  {reason}")
    for p in [p for p in plans if not p.fits][:2]:
        over = p.memory["total"] - p.capacity
        print(f"does not fit: {p.layout}: {size(over)} over")
        print(f"  {fix_for(p, plans)}")
    cost = fit[0].budget(args.tokens, args.price)
    hours = f"{cost['hours']:.1f} h, {cost['gpu_hours']:,.0f} GPU-hours"
    print(f"the best on {args.tokens:,.0f} tokens: {hours}")
    if cost["kwh"] is not None:
        print(f"  energy {cost['kwh']:,.0f} kWh at {gpu.watts:.0f} W ({gpu.name} TDP)")
    if cost["cost"] is not None:
        print(f"  cost ${cost['cost']:,.0f} at ${args.price}/GPU-hour")
