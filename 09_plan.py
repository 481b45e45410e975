"""09 · Plan a run: memory, step time, tokens/s and cost of a layout, before it runs.

The idea in one sentence: every byte and every FLOP of a training step was counted in
lessons 02 to 07, so a layout's memory and time are sums of their formulas, and a
search over layouts finds the ones that fit and run fastest, before a GPU is rented.

The model of one step, per GPU (Ψ parameters, N = dp·cp ranks sharing ZeRO's shards):
    memory = weights + gradients + AdamW states    (07's 16Ψ: ZeRO splits over N, 04/05
                                                    over tp and pp)
           + activations                           (06's activation_formula, a layer's
             x the microbatches in flight           sharded part / tp; GPipe keeps m,
                                                    1F1B p - rank: 05's schedule_steps)
           + the loss's logits                     (b·T·V/tp, the largest temporary)
    time = compute / (1 - bubble) + TP's all-reduces + PP's sends + DP's exposed part
    compute = tokens · (6N + 12·L·C·T, 02's flops_per_token; + 2N: full recompute)
              / (GPUs · peak FLOP/s · e),   e: the matmul efficiency, calibrated once
    bubble  = (p - 1)/(v·m + p - 1)                                  (05)
    TP      = comm_formula's bytes · 2(tp-1)/tp / link, on the critical path   (04)
    DP      = 2(N-1)/N · 4Ψ/tp/pp / link, hidden behind the last backward  (03, 07)
    links: NVLink inside a node, else the network (grid arange(world).view(pp, dp, cp,
    tp): TP shares a node when it fits).
Then tokens/s = B·T / time, MFU, hours to a token budget, GPU-hours, energy (at the
datasheet's board power, TDP) and cost at the price per GPU-hour you give.

    dp 2, tp 2, pp 2 on 8 GPUs of one node (tp fastest: its pairs are neighbours):
    GPU 0 1 | 2 3 | 4 5 | 6 7     pp 0: dp 0 (tp 0, 1), dp 1 (tp 0, 1); pp 1: same

Checked (tests/test_plan.py): 17 layouts built with the lessons' wrappers on CPU ranks
hold plan's model-state bytes and send its collective bytes exactly, and keep its
activations within 10%; docs/results.md's H200 runs (one calibrates e) within 10%.

Run it:  python 09_plan.py    (a worked example beside its hand calculation, a search)
         python 09_plan.py --model gpt2-xl --gpus 16 --gpus-per-node 8 --gpu h100 \\
             --tokens 10e9 [--price 2.5]

What changed from 07_zero.py: nothing runs; the lessons' formulas are summed. Left out
on purpose: context parallelism (08's ring is not in it: cp = 1), TP and PP messages overlapping
compute, offload, fp8, fragmentation (a plan fits in 90% of the memory), and eager
mode's temporaries (the calibrating runs were compiled).
"""

import argparse
import dataclasses
import functools
import importlib
import itertools
import math
import sys
from dataclasses import dataclass, field

import torch

from support import plan_report
from support.gpu_specs import CALIBRATION, GPUS, get_gpu
from support.gpus import recompute_flops_per_token
from support.run import adamw_groups
from support.sharding import comm_formula, tp_layout

model_lib = importlib.import_module("02_model")
tp_lib = importlib.import_module("04_tensor_parallel")
pp_lib = importlib.import_module("05_pipeline")
mp_lib = importlib.import_module("06_mixed_precision")
zero_lib = importlib.import_module("07_zero")

GIB = 2**30
FIT = 0.9  # A plan fits in 90% of the memory: the CUDA context and fragmentation.
BYTES = {"fp32": 4, "bf16": 2}  # A 16-bit activation or message under autocast.
ACTIVATION_MODE = {"fp32": "fp32", "bf16": "bf16 autocast"}  # 06's mode names.


class PlanError(ValueError):
    """A layout or a request the planner refuses: reported as one line."""


def model_config(name: str, **overrides) -> "model_lib.GPTConfig":
    """02's preset, its vocabulary padded to a multiple of 64 (train.py's and the
    benchmarks' choice: 50,257 -> 50,304, which splits over tp = 2..64)."""
    try:
        return model_lib.GPTConfig.from_preset(
            name, **{"pad_vocab_multiple": 64, **overrides}
        )
    except ValueError as e:
        raise PlanError(str(e)) from None


def _items(config) -> tuple:
    """A GPTConfig as a hashable key for the caches below."""
    return tuple(vars(config).items())


@functools.lru_cache(maxsize=64)
def _flops(config_items: tuple, T: int) -> int:
    """02's flops_per_token, once per model (it builds the model on the meta device)."""
    return model_lib.flops_per_token(model_lib.GPTConfig(**dict(config_items)), T)


@functools.lru_cache(maxsize=8)
def efficiency(dtype: str, gpu: str) -> float:
    """e of CALIBRATION: the share of the peak the calibrating run's matmuls reached."""
    row = CALIBRATION["cpu" if gpu == "cpu" else dtype]
    config = model_config(row["model"], vocab_size=row.get("vocab_size", 50257))
    flops = _flops(_items(config), row["seq_len"])
    return row["tokens_per_s"] * flops / GPUS[row["gpu"]].flops[dtype]


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
    """plan()'s answer: bytes per GPU (its fullest one), seconds per step, and rates."""

    layout: Layout
    gpu: str
    n_gpus: int
    tokens_per_step: int
    memory: dict  # weights, grads, optimizer, activations, logits, total: bytes
    time: dict  # compute, bubble, tp, pp, dp, total: seconds per step
    ranks: list  # Per pipeline rank: memory dict, collectives dict, in_flight
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


# ------------------------------------------------------------ model states per rank
class _Shapes(model_lib.GPT):
    """02's GPT with its tensors' shapes only: on the meta device nothing is drawn."""

    def _init_weights(self):
        pass


@functools.lru_cache(maxsize=8)
def _meta_gpt(config_items: tuple, lora_rank: int):
    """02's GPT on the meta device (no memory), LoRA-wrapped if asked."""
    with torch.device("meta"):
        model = _Shapes(model_lib.GPTConfig(**dict(config_items)))
        if lora_rank:
            model_lib.apply_lora(model, lora_rank, alpha=16.0)
    return model


@functools.lru_cache(maxsize=4096)
def _flats(config_items, lora_rank, tp, pp, v, pp_rank) -> tuple:
    """This rank's ZeRO flats as 07's ZeroOptimizer cuts them: one per unit (zero_units
    of each of 05's chunks), AdamW group (train.py's adamw_groups) and dtype, each
    holding a parameter in the first unit that has it. -> ((numel, trainable, root,
    tensors)...),
    numels per rank: a tensor that 04 shards (tp_layout) holds numel / tp."""
    model = _meta_gpt(config_items, lora_rank)
    chunks = pp_lib.split_model(model, pp_rank, pp, v)
    tied = [pp_lib.tied_parameter(c) for c in chunks] if pp > 1 else []
    groups = [set(g["params"]) for g in adamw_groups(chunks, tied, 0.1)]
    names = {p: n for c in chunks for n, p in c.named_parameters()}
    per_rank = {p: p.numel() // (tp if tp_layout(n) else 1) for p, n in names.items()}
    taken = set()
    flats = []
    for unit in [u for c in chunks for u in zero_lib.zero_units(c)]:
        for group in groups:
            mine = [p for p in unit.parameters() if p in group and p not in taken]
            taken.update(mine)
            if mine:
                root = any(unit is c for c in chunks)
                flats.append((sum(per_rank[p] for p in mine), True, root, len(mine)))
    frozen = [n for p, n in per_rank.items() if not p.requires_grad]
    flats.append((sum(frozen), False, True, 0))  # LoRA's frozen base: whole
    return tuple(flats)


def model_state_bytes(config, layout: Layout, pp_rank: int = 0, lora_rank=0) -> dict:
    """Weights, gradients and AdamW states (fp32: autocast keeps fp32 masters) on one
    rank, after a backward, as 07's memory_per_rank counts them: 07's flats padded to
    N·S (S = ⌈numel/N⌉), AdamW's 4-byte step per tensor it steps."""
    items = _items(config)
    L = layout
    flats = _flats(items, lora_rank, L.tp, L.pp, L.virtual_stages, pp_rank)
    trainable = [n for n, t, *_ in flats if t]
    frozen = sum(n for n, t, *_ in flats if not t)
    N = L.dp * L.cp  # ZeRO shards over DP x CP ranks (DESIGN §4).
    S = [-(-n // N) for n in trainable]  # ⌈numel / N⌉ a flat
    psi = sum(trainable)
    if L.zero == 0:  # 03's DataParallel: everything whole; one step counter a tensor
        n_tensors = sum(f[3] for f in flats)
        sizes = dict(weights=psi, grads=psi, optimizer=2 * psi + n_tensors)
    else:
        padded = sum(N * s for s in S)
        weights = sum(S) if L.zero == 3 else padded
        grads = sum(S) if L.zero >= 2 else psi  # ZeRO-1: whole, in p.grad
        sizes = dict(weights=weights, grads=grads, optimizer=2 * sum(S) + len(S))
    sizes["weights"] += frozen
    return {k: 4 * n for k, n in sizes.items()}  # fp32: 4 bytes each


# ------------------------------------------------------------ activations per rank
@functools.lru_cache(maxsize=4096)
def _split_formula(items: tuple, b: int, T: int, dtype: str, recompute: str) -> dict:
    """06's activation_formula cut into a layer's and the rest's bytes, per microbatch
    (what grows with b) and per stage (autocast's weight copies): by differences."""
    mode = ACTIVATION_MODE[dtype]
    config = model_lib.GPTConfig(**dict(items))

    def f(n_layer, rows):
        c = dataclasses.replace(config, n_layer=n_layer)
        return mp_lib.activation_formula(c, rows, T, mode, recompute)

    layer = (f(2, b) - f(2, 0)) - (f(1, b) - f(1, 0))
    rest = f(1, b) - f(1, 0) - layer
    return dict(
        layer=layer,
        embed=8 * b * T,  # The int64 ids the embedding's lookup keeps.
        head=rest - 8 * b * T,  # ln_f, lm_head's input, the log-softmax, targets
        layer_copies=f(2, 0) - f(1, 0),
        rest_copies=f(1, 0) - (f(2, 0) - f(1, 0)),
    )


def _tp_shard(parts: dict, config, b, T, dtype, layout: Layout) -> dict:
    """A layer's bytes on a TP rank: 04 splits q|k|v, attention's output and its
    log-sum-exp, c_fc's output and GELU's (12C numbers of none's 14C; 8C of selective's
    10C), whole heads' lse; SP also splits the LayerNorms' inputs (full: the block's
    input). The matmuls' inputs stay whole (04 leaves SP's saving them /tp out)."""
    tp = layout.tp
    recompute = layout.recompute
    C = config.n_embd
    a = 4 if dtype == "fp32" else 2  # a matmul operand
    r = 4  # the residual stream stays fp32 under autocast
    split = {"none": 12 * C * a, "selective": 8 * C * a, "full": 0}[recompute]
    split += 4 * config.n_head if recompute != "full" else 0
    if layout.sequence_parallel:
        split += {"none": 2 * (C + 2) * r, "selective": C * r, "full": C * r}[recompute]
    out = dict(parts)
    out["layer"] -= b * T * split * (tp - 1) // tp
    V = config.padded_vocab_size
    out["head"] -= b * T * 4 * V * (tp - 1) // tp  # the loss's (b, T, V/tp) in fp32
    return out


def activation_bytes(
    config, layout: Layout, b: int, m: int, T: int, dtype: str, pp_rank: int = 0
) -> tuple[int, int]:
    """(bytes kept for backward at this rank's peak, microbatches alive then)."""
    L = layout
    parts = _split_formula(_items(config), b, T // L.cp, dtype, L.recompute)
    parts = _tp_shard(parts, config, b, T // L.cp, dtype, L)
    S = L.pp * L.virtual_stages
    n = config.n_layer
    chunk_bytes = []
    copies = 0
    for c in range(L.virtual_stages):
        s = c * L.pp + pp_rank  # 05's split: stage s holds these blocks
        layers = (s + 1) * n // S - s * n // S
        size = layers * parts["layer"]
        size += parts["embed"] if s == 0 else 0
        size += parts["head"] if s == S - 1 else 0
        chunk_bytes.append(size)
        copies += layers * parts["layer_copies"] // L.tp
        copies += parts["rest_copies"] // L.tp if s == S - 1 else 0
    if L.pp == 1:  # accumulation: one microbatch at a time
        return chunk_bytes[0] + copies, 1
    args = (L.schedule, L.pp, m, L.virtual_stages, pp_rank, tuple(chunk_bytes))
    peak, alive = _peak(*args)
    return peak + copies, alive


@functools.lru_cache(maxsize=4096)
def _peak(schedule, p, m, v, rank, chunk_bytes) -> tuple[int, int]:
    """The most bytes alive as the rank runs 05's schedule_steps (a forward stashes a
    microbatch's activations, its backward frees them), and the microbatches then."""
    alive = 0
    count = 0
    peak = (0, 0)
    for step in pp_lib.schedule_steps(schedule, p, m, v, rank):
        for a in step:
            sign = 1 if a.op == "F" else -1
            alive += sign * chunk_bytes[a.chunk]
            count += sign
            peak = max(peak, (alive, count))
    return peak


# ------------------------------------------------------------ collectives per rank
def collective_bytes(
    config, layout: Layout, b: int, m: int, T: int, pp_rank=0, lora_rank=0, dtype="fp32"
) -> dict:
    """Payload bytes per step a rank hands each collective, as tests count them:
    all_reduce / reduce_scatter / all_gather (their input or output list), send."""
    L = layout
    a = BYTES[dtype]
    out = dict(all_reduce=0, reduce_scatter=0, all_gather=0, send=0)
    if L.tp > 1:  # 04: per microbatch, the whole model's (pp = 1) or a stage's share
        c = dataclasses.replace(config, n_layer=max(1, config.n_layer // L.pp))
        for op, n in comm_formula(c, b, T // L.cp, L.sequence_parallel).items():
            out[op] += m * n * a // 4
    if L.tp > 1 and L.recompute != "none":  # 06 redoes a block's forward in backward
        # subtle: torch's checkpoint stops replaying once the last kept tensor is back,
        # before the MLP's g: the attention's g again (SP: both gathers, one scatter).
        E = m * (config.n_layer // L.pp) * b * (T // L.cp) * config.n_embd * a
        if L.sequence_parallel:
            out["all_gather"] += 2 * E
            out["reduce_scatter"] += E
        else:
            out["all_reduce"] += E
    if L.pp > 1:  # 05: an activation forward and a gradient back per stage boundary
        S = L.pp * L.virtual_stages
        stages = [c * L.pp + pp_rank for c in range(L.virtual_stages)]
        sends = sum((s < S - 1) + (s > 0) for s in stages)
        out["send"] += m * sends * b * (T // L.cp) * config.n_embd * a
        if config.tie_embeddings and pp_rank in (0, L.pp - 1):  # the tied gradient
            out["all_reduce"] += 4 * config.padded_vocab_size * config.n_embd // L.tp
    if L.dp * L.cp > 1:
        items = _items(config)
        flats = _flats(items, lora_rank, L.tp, L.pp, L.virtual_stages, pp_rank)
        N = L.dp * L.cp
        trainable = [n for n, t, *_ in flats if t]
        padded = [4 * N * -(-n // N) for n in trainable]
        blocks = [4 * N * -(-n // N) for n, t, root, _ in flats if t and not root]
        if L.zero == 0:  # 03: all-reduce every gradient once, fp32
            out["all_reduce"] += 4 * sum(trainable)
        else:  # 07: reduce-scatter every flat, all-gather the weights
            out["reduce_scatter"] += sum(padded)
            out["all_gather"] += sum(padded)
        if L.zero == 3:  # gathered for each forward, again for each backward but root's
            out["all_gather"] += (m - 1) * sum(padded) + m * sum(blocks)
    return out


# ------------------------------------------------------------ the plan
def check_layout(config, layout: Layout, batch: int, n_gpus: int) -> int:
    """PlanError (one line) unless the layout can run; -> microbatches per step."""
    L = layout
    world = L.dp * L.tp * L.pp * L.cp
    if world != n_gpus:
        sizes = f"dp {L.dp} x tp {L.tp} x pp {L.pp} x cp {L.cp} = {world}"
        raise PlanError(f"{sizes} does not fill {n_gpus} GPUs")
    if L.cp > 1:
        raise PlanError("cp > 1: the planner does not model 08's ring yet")
    split = f"micro_batch {L.micro_batch} x dp {L.dp} x m"
    if batch % (L.micro_batch * L.dp):
        raise PlanError(f"batch {batch} is not {split}")
    zero_ok = L.zero in range(4) and (L.zero == 0 or L.dp * L.cp > 1)
    if not zero_ok or L.zero == 3 and L.pp > 1:  # 07 refuses ZeRO-3 on pp's chunks
        raise PlanError(f"zero {L.zero} needs a stage 0-3, dp > 1 and, at 3, pp 1")
    if L.sequence_parallel and L.tp == 1:
        raise PlanError("sequence parallelism needs tp > 1")
    m = batch // (L.micro_batch * L.dp)
    try:
        tp_lib.check_tp_config(config, L.tp)
        schedule = L.schedule if L.pp > 1 else "1f1b"
        pp_lib.check_config(schedule, L.pp, m, L.virtual_stages, config.n_layer)
        assert L.recompute in mp_lib.RECOMPUTE, f"recompute {L.recompute!r}"
    except AssertionError as e:
        raise PlanError(str(e)) from None
    return m


def _link(gpu, size: int, stride: int, gpus_per_node: int) -> float:
    """A group's slowest link: NVLink if its `size` ranks, `stride` apart, share a
    node, else the network."""
    inside = size == 1 or size * stride <= gpus_per_node
    return gpu.nvlink if inside else gpu.network


def plan(
    config,
    layout: Layout,
    batch: int,
    gpu: str,
    n_gpus: int,
    gpus_per_node: int = 8,
    seq_len: int | None = None,
    dtype: str = "bf16",
    lora_rank: int = 0,
) -> Plan:
    """The memory (its fullest GPU) and time of a step of `batch` sequences of T."""
    spec = get_gpu(gpu)
    T = seq_len or config.block_size
    L = layout
    m = check_layout(config, layout, batch, n_gpus)
    b = L.micro_batch
    ranks = []
    for r in range(L.pp):
        memory = model_state_bytes(config, layout, r, lora_rank)
        memory["activations"], alive = activation_bytes(
            config, layout, b, m, T, dtype, r
        )
        last = r == L.pp - 1  # the loss's logits: b·T·V/tp, the largest temporary
        V = config.padded_vocab_size
        memory["logits"] = BYTES[dtype] * b * (T // L.cp) * V // L.tp if last else 0
        memory["total"] = sum(memory.values())
        comm = collective_bytes(config, layout, b, m, T, r, lora_rank, dtype)
        ranks.append(
            dict(memory=memory, collectives=comm, in_flight=alive, dtype=dtype)
        )
    fullest = max(ranks, key=lambda x: x["memory"]["total"])
    items = _items(config)
    fpt = _flops(items, T)
    extra = recompute_flops_per_token(config, T, L.recompute)
    tokens = batch * T
    e = efficiency(dtype, gpu.lower())
    t = dict(compute=tokens * (fpt + extra) / n_gpus / (spec.flops[dtype] * e))
    bubble = pp_lib.bubble_formula(L.pp, m, L.virtual_stages)  # of the whole step
    t["bubble"] = t["compute"] * bubble / (1 - bubble)
    worst = max(ranks, key=lambda x: sum(x["collectives"].values()))["collectives"]
    tp_wire = 2 * (L.tp - 1) / L.tp * worst["all_reduce"] if L.tp > 1 else 0
    if L.tp > 1 and L.sequence_parallel:
        tp_wire = (L.tp - 1) / L.tp * (worst["all_gather"] + worst["reduce_scatter"])
    t["tp"] = tp_wire / _link(spec, L.tp, 1, gpus_per_node)
    t["pp"] = worst["send"] / _link(spec, L.pp, L.tp * L.cp * L.dp, gpus_per_node)
    N = L.dp * L.cp
    grads = model_state_bytes(config, dataclasses.replace(L, zero=0), 0, lora_rank)
    dp_wire = 2 * (N - 1) / N * grads["grads"] if N > 1 else 0
    dp_wire += (N - 1) / N * grads["grads"] * 2 * m if L.zero == 3 else 0
    dp_time = dp_wire / _link(spec, N, L.tp, gpus_per_node)
    hidden = 2 / 3 * t["compute"] / m  # the last microbatch's backward overlaps it
    t["dp"] = max(0.0, dp_time - hidden)
    t["total"] = sum(t.values())
    capacity = FIT * spec.memory
    return Plan(
        layout, gpu.lower(), n_gpus, tokens, fullest["memory"], t, ranks, fpt, capacity
    )


def plan_run(cfg, gpt_config, gpu: str, gpus_per_node: int = 8) -> Plan:
    """The plan of train.py's settings (cfg: support/config.TrainConfig; gpt_config:
    the model it builds): train.py --plan prints it, and its first log lines."""
    cpu = gpu.lower() == "cpu"
    dtype = "fp32" if cfg.dtype == "fp32" or cfg.dtype == "auto" and cpu else "bf16"
    grid = (cfg.dp, cfg.tp, cfg.pp, 1, cfg.zero, cfg.recompute, cfg.micro_batch_size)
    pipe = (cfg.schedule, cfg.virtual_stages, cfg.sequence_parallel)
    layout = Layout(*grid, *pipe)
    n = cfg.dp * cfg.tp * cfg.pp
    options = (gpus_per_node, gpt_config.block_size, dtype, cfg.lora_rank)
    return plan(gpt_config, layout, cfg.batch_size, gpu, n, *options)


# ------------------------------------------------------------ the search
def layouts(config, batch: int, n_gpus: int, gpus_per_node: int):
    """Every layout worth trying: TP inside a node, each pipeline schedule, every ZeRO
    stage and recompute mode, micro-batches that are powers of two."""
    sizes = [d for d in range(1, n_gpus + 1) if n_gpus % d == 0]
    for tp, pp in itertools.product(sizes, repeat=2):
        dp = n_gpus // (tp * pp)
        if n_gpus % (tp * pp) or tp > gpus_per_node or batch % dp:
            continue
        if config.n_head % tp or pp > config.n_layer:
            continue
        schedules = (
            [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)] if pp > 1 else [("1f1b", 1)]
        )
        zeros = [0] if dp == 1 else ([0, 1, 2] if pp > 1 else [0, 1, 2, 3])
        mbs = [b for b in (1, 2, 4, 8, 16, 32, 64) if (batch // dp) % b == 0]
        for (schedule, v), zero, recompute, mb in itertools.product(
            schedules, zeros, mp_lib.RECOMPUTE, mbs
        ):
            for sp in (False, True) if tp > 1 else (False,):
                yield Layout(dp, tp, pp, 1, zero, recompute, mb, schedule, v, sp)


def search(
    config,
    batch: int,
    gpu: str,
    n_gpus: int,
    gpus_per_node: int = 8,
    seq_len=None,
    dtype="bf16",
    lora_rank=0,
) -> list[Plan]:
    """Every valid layout's plan, the fitting ones first, fastest first."""
    plans = []
    for layout in layouts(config, batch, n_gpus, gpus_per_node):
        try:
            args = (config, layout, batch, gpu, n_gpus, gpus_per_node, seq_len, dtype)
            plans.append(plan(*args, lora_rank))
        except PlanError:
            continue  # e.g. interleaved's m % p, a vocabulary that does not split
    plans.sort(key=_rank)
    return plans


def _rank(p: Plan) -> tuple:
    """Fitting plans first, fastest first; on a tie (to 0.1%) the simpler one: a lower
    ZeRO stage, less recomputation, then less memory. Others: least memory first."""
    if not p.fits:
        return (1, p.memory["total"])
    speed = round(math.log(p.tokens_per_s), 3)
    simpler = (p.layout.zero, mp_lib.RECOMPUTE.index(p.layout.recompute))
    return (0, -speed, *simpler, p.memory["total"])


def worked_example() -> None:
    """GPT-2 124M on one H200, B = 32, bf16: the plan beside the sums done by hand."""
    gib = plan_report.gib
    config = model_config("gpt2")
    p = plan(config, Layout(micro_batch=32), 32, "h200", 1)
    psi = model_lib.count_params(config)
    print("worked example: GPT-2 124M, 1 H200, bf16 compiled, B = 32 x T = 1,024")
    hand = zero_lib.zero_memory_formula(0, psi, 1)
    states = sum(p.memory[k] for k in ("weights", "grads", "optimizer"))
    print(f"  model states: 16Ψ = 16 x {psi:,} = {hand:,.0f} B (07); plan {states:,} B")
    print("    (plan adds AdamW's 4-byte step counter for each of the 148 tensors)")
    act = mp_lib.activation_formula(config, 32, 1024, "bf16 autocast", "none")
    print(f"  activations: 06's formula {act:,} B; plan {p.memory['activations']:,} B")
    logits = 2 * 32 * 1024 * config.padded_vocab_size
    print(
        f"  logits: 2 x 32 x 1,024 x 50,304 = {logits:,} B; plan {p.memory['logits']:,}"
    )
    print(f"  peak {gib(p.memory['total'])} GiB; measured 21.3 GiB (docs/results.md)")
    fpt = model_lib.flops_per_token(config, 1024)
    e = efficiency("bf16", "h200")
    step = 32 * 1024 * fpt / (989.5e12 * e)
    hand = f"{1e3 * step:.1f} ms; plan {1e3 * p.time['total']:.1f} ms"
    print(f"  time: 32,768 x {fpt:,} FLOPs / (989.5e12 x e {e:.3f}) = {hand}")
    print(f"  tokens/s {p.tokens_per_s:,.0f}: the calibrating run (measured 515,639)")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--model", default="gpt2-xl", help="02's preset")
    add("--gpus", type=int, default=16, help="GPUs in all")
    add("--gpus-per-node", type=int, default=8, help="GPUs sharing NVLink")
    add("--gpu", default="h100", help=f"one of {', '.join(GPUS)}")
    add("--tokens", type=float, default=10e9, help="the token budget of the run")
    add("--batch-size", type=int, default=512, help="global batch, sequences (GPT-2's)")
    add("--seq-len", type=int, default=None, help="T; default: the model's block_size")
    add("--dtype", default="bf16", choices=tuple(BYTES), help="bf16: autocast")
    add("--lora-rank", type=int, default=0, help="LoRA: only its factors train")
    add("--price", type=float, default=None, help="dollars per GPU-hour, for the cost")
    add("--top", type=int, default=5, help="how many fitting layouts to print")
    args = parser.parse_args(argv)
    try:
        if not argv:
            worked_example()
        get_gpu(args.gpu)
        if args.gpus % args.gpus_per_node and args.gpus > args.gpus_per_node:
            nodes = f"whole nodes of {args.gpus_per_node}"
            raise PlanError(f"{args.gpus} GPUs are not {nodes}")
        config = model_config(args.model)
        cluster = (args.gpu, args.gpus, args.gpus_per_node)
        options = (args.seq_len, args.dtype, args.lora_rank)
        plans = search(config, args.batch_size, *cluster, *options)
        if not plans:
            raise PlanError(f"no layout of {args.model} divides {args.gpus} GPUs")
        if not any(p.fits for p in plans):
            need = min(p.memory["total"] for p in plans) / GIB
            where = f"{args.gpus} {args.gpu}: the smallest needs {need:.1f} GiB"
            raise PlanError(f"{args.model} fits no layout of {where} > {FIT:.0%}")
        plan_report.print_search(plans, args, FIT)
    except (PlanError, ValueError) as e:
        parser.exit(2, f"09_plan.py: error: {e}\n")


if __name__ == "__main__":
    main()
