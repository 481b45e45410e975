"""09 · Plan a run: memory, step time, tokens/s and cost of a layout, before it runs.

The idea in one sentence: every byte and every FLOP of a training step was counted in
lessons 02 to 08, so a layout's memory and time are sums of their formulas, and a
search over layouts finds the ones that fit and run fastest, before a GPU is rented.

The model of one step, per GPU (Ψ parameters, N = dp·cp ranks sharing ZeRO's shards):
    memory = weights + gradients + AdamW states    (07's 16Ψ: ZeRO splits over N, 04/05
                                                    over tp and pp)
           + activations                           (06b's activation_formula, a layer's
             x the microbatches in flight           sharded part / tp, T / cp; GPipe
                                                    keeps m, 1F1B p - rank (05), zb1
                                                    (p - rank)·A + rank·Q (05c))
           + the loss's logits                     (b·T·V/tp/cp, on the last stage;
                                                    --loss chunked: 1,024 tokens' worth)
           + ZeRO-3's gathered weights             (07: the root and two blocks whole)
    time = compute / (1 - bubble) + the wire that compute does not hide, a ring's bytes
           ((n-1)/n of a gather's or scatter's, twice an all-reduce's) / link:
    compute = a roofline, each part at the GPU's limit (support/gpus, fitted): matmuls
              (6Ψ a token, 02) / (peak · e(C/tp)), e(w) = e_max·w/(w + knee); attention
              (12·L·C·T a token) / (peak · its share); memory-bound bytes (β_L·L·C +
              β_V·V a token; AdamW's per Ψ) / HBM; x 1.36 under selective recomputation,
              x 1.57 eager (zb1, no --compile; measured); + train.py's loop, m x 7.5 ms
    bubble  = (p - 1)/(v·m + p - 1); zb1: (p - 1)/(3m + p - 1)       (05, 05b, 05c)
    TP      = each block's f and g, the embedding's g (first stage), the head's f and
              the loss (last), on the critical path                  (04)
    PP      = sends of (b, T/cp, C), SP's (b, T/cp/tp, C), + the tied gradient  (05)
    ring    = 08's ring_bytes_per_layer · L/pp · m, less attention's compute (08 posts
              each transfer before the block's compute)
    DP      = 03's all-reduce of 4Ψ/tp/pp less the last backward; ZeRO-1/2's after
              backward, exposed; ZeRO-3's gathers less each of the m backwards  (07)
    links: NVLink if a group's size·stride fits a node, else the network (the grid
    arange(world).view(pp, dp, cp, tp): TP's stride 1, CP's tp, PP's tp·cp·dp). CP's
    zigzag gives every rank (cp+1)/2 blocks of attention (08's blocks_per_rank).
Then tokens/s = B·T / time, MFU, hours, GPU-hours, energy (at TDP) and cost.

    dp 2, tp 2, pp 2 on 8 GPUs of one node (tp fastest: its pairs are neighbours):
    GPU 0 1 | 2 3 | 4 5 | 6 7     pp 0: dp 0 (tp 0, 1), dp 1 (tp 0, 1); pp 1: same

Checked (tests/test_plan.py): 25 layouts built with the lessons' wrappers on CPU ranks
(cp, tp x pp, zb1, bf16 among them) hold plan's model-state bytes and send its collective
and ring bytes exactly, and keep its activations within 5% (full recompute: 10%); each
time term equals its formula by hand; the H200 runs held out (not fitted) within 5% (their
tokens/s) and 10% (memory); published runs: docs/planning.md.

Run it:  python 09_plan.py    (a worked example by hand, a search)
         python 09_plan.py --model gpt2-xl --gpus 16 --gpu h100 --tokens 10e9

What changed from 08_context_parallel.py: nothing runs; the lessons' formulas, 08's
ring among them, are summed. Left out on purpose: TP and PP messages overlapping
compute, offload, fp8, fragmentation (a plan fits in 90% of the memory), eager mode's
temporaries (the fitted runs were compiled), selective recomputation and zb1 compiled
(train.py cannot compile zb1), TP's replicated LayerNorms (no SP), collectives' latency
and NCCL's share of a link (docs/planning.md says where the model extrapolates).
"""

import argparse
import dataclasses
import functools
import importlib
import sys

from support import gpus
from support.meta import shapes_only
from support.plan import plan_report
from support.plan.plan_report import Layout, Plan, layouts
from support.tensor_parallel.sharding import tp_layout
from support.train import config as train_config
from support.train.run import adamw_groups

model_lib = importlib.import_module("02_model")
tp_lib = importlib.import_module("04_tensor_parallel")
pp_lib = importlib.import_module("05_pipeline")
sched_lib = importlib.import_module("05b_schedules")
zb_lib = importlib.import_module("05c_zero_bubble")
recompute_lib = importlib.import_module("06b_recompute")
zero_lib = importlib.import_module("07_zero")
cp_lib = importlib.import_module("08_context_parallel")

GIB = 2**30
FIT = 0.9  # A plan fits in 90% of the memory: the CUDA context and fragmentation.
BYTES = {"fp32": 4, "bf16": 2}  # A 16-bit activation or message under autocast.
ACTIVATION_MODE = {"fp32": "fp32", "bf16": "bf16 autocast"}  # 06b's mode names.
CHUNK_TOKENS = 1024  # train.py's chunk of 06b's chunked loss.


class PlanError(ValueError):
    """A layout or a request the planner refuses: reported as one line."""


def model_config(name: str, **overrides) -> "model_lib.GPTConfig":
    """02's preset, its vocabulary padded to a multiple of 64 (train.py's and the
    benchmarks' choice: 50,257 -> 50,304, which splits over tp = 2..64)."""
    try:
        return model_lib.GPTConfig.from_preset(name, pad_vocab_multiple=64, **overrides)
    except ValueError as e:
        raise PlanError(str(e)) from None


def _items(config) -> tuple:
    """A GPTConfig as a hashable key for the caches below."""
    return tuple(vars(config).items())


@functools.lru_cache(maxsize=64)
def _flops(config_items: tuple, T: int, lora_rank: int = 0) -> int:
    """02's flops_per_token, once per model (it builds the model on the meta device)."""
    return model_lib.flops_per_token(model_lib.GPTConfig(**dict(config_items)), T, lora_rank)


@functools.lru_cache(maxsize=8)
def calibrate(dtype: str, gpu: str) -> dict:
    """The roofline's constants (support/gpus.fit_roofline), fitted on the measured runs
    of gpus.CALIBRATION: bf16 on any GPU on the H200's, fp32 and the CPU on one each."""
    row = gpus.CALIBRATION[gpus.calibration_row(dtype, gpu)]
    runs = []
    for preset, b, tokens_per_s, shape in row["runs"]:
        config = model_config(preset, **shape)
        T = config.block_size
        lay = Layout(micro_batch=b)
        counts = roofline_counts(config, T, b * T, lay, model_state_bytes(config, lay))
        runs.append((b * T / tokens_per_s, counts))
    return gpus.fit_roofline(row["gpu"], dtype, runs)


def roofline_counts(config, T, tokens, layout: Layout, memory: dict, lora_rank=0):
    """A GPU's work for `tokens` tokens, as support/gpus.roofline_seconds times it:
    matmul FLOPs (02's count a token, LoRA's without frozen weights' gradients, +
    recomputation's), attention's, the width C/tp, the memory-bound kernels' L·C and V
    a token times tokens, the parameters stepped (AdamW's 8 bytes each in `memory`)."""
    L = config.n_layer
    C = config.n_embd
    attention = tokens * 12 * L * C * T
    extra = model_lib.recompute_flops_per_token(config, T, layout.recompute)
    matmuls = tokens * (_flops(_items(config), T, lora_rank) + extra) - attention
    vocab = tokens * config.padded_vocab_size
    stepped = memory["optimizer"] / 8
    return matmuls, attention, C / layout.tp, tokens * L * C, vocab, stepped


# ------------------------------------------------------------ model states per rank
@functools.lru_cache(maxsize=8)
def _meta_gpt(config_items: tuple, lora_rank: int):
    """02's GPT on the meta device (no memory), LoRA-wrapped if asked."""
    with shapes_only():  # support/meta.py: shapes only, nothing drawn
        model = model_lib.GPT(model_lib.GPTConfig(**dict(config_items)))
        if lora_rank:
            model_lib.apply_lora(model, lora_rank, alpha=16.0)
    return model


@functools.lru_cache(maxsize=4096)
def _flats(config_items, lora_rank, tp, pp, v, pp_rank) -> tuple:
    """This rank's ZeRO flats as 07's ZeroOptimizer cuts them: one per unit (zero_units
    of each of 05's chunks), AdamW group (train.py's adamw_groups) and dtype, each
    holding a parameter in the first unit that has it. -> ((numel, trainable, root,
    tensors, unit)...), numels per rank: a tensor that 04 shards (tp_layout) holds
    numel / tp."""
    model = _meta_gpt(config_items, lora_rank)
    chunks = pp_lib.split_model(model, pp_rank, pp, v)
    tied = [pp_lib.tied_parameter(c) for c in chunks] if pp > 1 else []
    groups = [set(g["params"]) for g in adamw_groups(chunks, tied, 0.1)]
    names = {p: n for c in chunks for n, p in c.named_parameters()}
    per_rank = {p: p.numel() // (tp if tp_layout(n) else 1) for p, n in names.items()}
    taken = set()
    flats = []
    units = [u for c in chunks for u in zero_lib.zero_units(c)]
    for i, unit in enumerate(units):
        for group in groups:
            mine = [p for p in unit.parameters() if p in group and p not in taken]
            taken.update(mine)
            if mine:
                root = any(unit is c for c in chunks)
                flats.append((sum(per_rank[p] for p in mine), True, root, len(mine), i))
    frozen = [n for p, n in per_rank.items() if not p.requires_grad]
    flats.append((sum(frozen), False, True, 0, None))  # LoRA's frozen base: whole
    return tuple(flats)


def model_state_bytes(config, layout: Layout, pp_rank: int = 0, lora_rank=0) -> dict:
    """Weights, gradients and AdamW states (fp32: autocast keeps fp32 masters) on one
    rank, after a backward, as 07's memory_per_rank counts them: 07's flats padded to
    N·S (S = ⌈numel/N⌉), AdamW's 4-byte step per tensor it steps."""
    items = _items(config)
    lay = layout
    flats = _flats(items, lora_rank, lay.tp, lay.pp, lay.virtual_stages, pp_rank)
    trainable = [n for n, t, *_ in flats if t]
    frozen = sum(n for n, t, *_ in flats if not t)
    N = lay.dp * lay.cp  # ZeRO shards over DP x CP ranks, as train.py's.
    S = [-(-n // N) for n in trainable]  # ⌈numel / N⌉ a flat
    psi = sum(trainable)
    if lay.zero == 0:  # 03's DataParallel: everything whole; one step counter a tensor
        n_tensors = sum(f[3] for f in flats)
        sizes = dict(weights=psi, grads=psi, optimizer=2 * psi + n_tensors)
    else:
        padded = sum(N * s for s in S)
        weights = sum(S) if lay.zero == 3 else padded
        grads = sum(S) if lay.zero >= 2 else psi  # ZeRO-1: whole, in p.grad
        sizes = dict(weights=weights, grads=grads, optimizer=2 * sum(S) + len(S))
    sizes["weights"] += frozen
    return {k: 4 * n for k, n in sizes.items()}  # fp32: 4 bytes each


def gathered_bytes(config, layout: Layout, lora_rank=0) -> int:
    """ZeRO-3's whole weights at the step's peak, beside its shards: 07 keeps the root
    gathered through backward, and two blocks (the one running, the next prefetched);
    each unit's flats padded to N·S, fp32. Other stages gather after the step."""
    if layout.zero != 3:
        return 0
    N = layout.dp * layout.cp
    units = {}
    flats = _flats(_items(config), lora_rank, layout.tp, 1, 1, 0)  # ZeRO-3: pp 1
    for n, trainable, root, _, unit in flats:
        if trainable:
            units[root, unit] = units.get((root, unit), 0) + 4 * N * -(-n // N)
    blocks = sorted(size for (root, _), size in units.items() if not root)
    return sum(size for (root, _), size in units.items() if root) + sum(blocks[-2:])


# ------------------------------------------------------------ activations per rank
@functools.lru_cache(maxsize=4096)
def _split_formula(items: tuple, b: int, T: int, dtype, recompute, loss) -> dict:
    """06b's activation_formula cut into a layer's and the rest's bytes, per microbatch
    (what grows with b) and per stage (autocast's weight copies): by differences."""
    mode = ACTIVATION_MODE[dtype]
    config = model_lib.GPTConfig(**dict(items))

    def f(n_layer, rows):
        c = dataclasses.replace(config, n_layer=n_layer)
        return recompute_lib.activation_formula(c, rows, T, mode, recompute, loss)

    layer = (f(2, b) - f(2, 0)) - (f(1, b) - f(1, 0))
    rest = f(1, b) - f(1, 0) - layer
    return dict(
        layer=layer,
        embed=8 * b * T,  # The int64 ids the embedding's lookup keeps.
        head=rest - 8 * b * T,  # ln_f, then 06b's loss_formula (plain or chunked)
        layer_copies=f(2, 0) - f(1, 0),
        rest_copies=f(1, 0) - (f(2, 0) - f(1, 0)),
    )


def _tp_shard(parts: dict, config, b, T, dtype, layout: Layout) -> dict:
    """A layer's bytes on a TP rank: 04 splits q|k|v, attention's output and its
    log-sum-exp, c_fc's output and GELU's (12C numbers of none's 14C; 8C of selective's
    10C), whole heads' lse; SP also splits the LayerNorms' inputs (full: the block's
    input). The matmuls' inputs stay whole (04b leaves SP's saving them /tp out)."""
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
    config, layout: Layout, b, m, T, dtype, pp_rank: int = 0, loss="plain"
) -> tuple[int, int]:
    """(bytes kept for backward at this rank's peak, microbatches alive then); CP's
    rank keeps T/cp tokens of each sequence (08's ring keeps 06b's tensors of them)."""
    lay = layout
    args = (_items(config), b, T // lay.cp, dtype, lay.recompute, loss)
    parts = _split_formula(*args)
    parts = _tp_shard(parts, config, b, T // lay.cp, dtype, lay)
    S = lay.pp * lay.virtual_stages
    n = config.n_layer
    chunk_bytes = []
    for c in range(lay.virtual_stages):
        s = c * lay.pp + pp_rank  # 05's split: stage s holds these blocks
        layers = (s + 1) * n // S - s * n // S
        size = layers * parts["layer"]
        size += parts["embed"] if s == 0 else 0
        size += parts["head"] if s == S - 1 else 0
        # Autocast's bf16 weight copies, a set a microbatch from F to B: 05b gives each
        # forward its own autocast context (torch.compile may recast: not modelled).
        size += layers * parts["layer_copies"] // lay.tp
        size += parts["rest_copies"] // lay.tp if s == S - 1 else 0
        chunk_bytes.append(size)
    if lay.pp == 1:  # accumulation: one microbatch at a time
        return chunk_bytes[0], 1
    a = BYTES[dtype]  # zb1 (05c): after B, a microbatch keeps only what W reads
    w = zb_lib.stage_w_bytes(config, b, T // lay.cp, lay.pp, pp_rank, a, lay.tp)
    args = (lay.schedule, lay.pp, m, lay.virtual_stages, pp_rank, tuple(chunk_bytes))
    return sched_lib.peak_kept(*args, w)


# ------------------------------------------------------------ collectives per rank
def tp_bytes(config, layout: Layout, b: int, T: int, a: int, layers, first, last):
    """04's collectives of a microbatch (b x T/cp) on a stage of `layers` blocks: each
    block's two f and two g of E = b·T·C activations, the embedding's g (first stage),
    the head's f and the loss's 3 fp32 all-reduces of (b, T) (last). SP: gathers and
    scatters, and f sums the replicated fp32 gradients: wpe (first), a block's
    LayerNorms and row biases, ln_f (last). 06b's replay runs the attention's g again
    (SP: both gathers, one scatter): torch's checkpoint stops before the MLP's."""
    C = config.n_embd
    E = b * T * C * a
    acts = (4 * layers + first + last) * E
    loss = 3 * 4 * b * T * last
    replay = layers * E if layout.recompute != "none" else 0
    if not layout.sequence_parallel:
        return dict(all_reduce=acts + loss + replay)
    bias = int(config.bias)
    grads = T * C * first + layers * (2 + 4 * bias) * C + (1 + bias) * C * last
    out = dict(all_gather=acts + 2 * replay, reduce_scatter=acts + replay)
    return dict(out, all_reduce=loss + 4 * grads)


def collective_bytes(
    config, layout: Layout, b: int, m: int, T: int, pp_rank=0, lora_rank=0, dtype="fp32"
) -> dict:
    """Payload bytes per step a rank hands each collective, by group (tp, pp, cp, dp),
    as tests count them: all_reduce / reduce_scatter / all_gather (their input or output
    list), send (05's pipeline), ring (08's K, V and their gradients)."""
    lay = layout
    a = BYTES[dtype]
    C = config.n_embd
    S = lay.pp * lay.virtual_stages
    stages = [c * lay.pp + pp_rank for c in range(lay.virtual_stages)]  # 05's split
    L = config.n_layer
    layers = sum((s + 1) * L // S - s * L // S for s in stages)
    out = {group: plan_report.by_op({}) for group in ("tp", "pp", "cp", "dp")}
    if lay.tp > 1:  # 04, each microbatch
        ends = (0 in stages, S - 1 in stages)
        per_microbatch = tp_bytes(config, lay, b, T // lay.cp, a, layers, *ends)
        out["tp"].update({op: m * n for op, n in per_microbatch.items()})
    if lay.pp > 1:  # 05: an activation forward and a gradient back per stage boundary
        sends = sum((s < S - 1) + (s > 0) for s in stages)
        rows = T // lay.cp // (lay.tp if lay.sequence_parallel else 1)  # SP: T/cp/tp
        out["pp"]["send"] = m * sends * b * rows * C * a
        if config.tie_embeddings and pp_rank in (0, lay.pp - 1):  # the tied gradient
            out["pp"]["all_reduce"] = 4 * config.padded_vocab_size * C // lay.tp
    if lay.cp > 1:  # 08: per layer and microbatch; a replayed block runs its ring again
        width = C // lay.tp  # the width of a rank's K: heads split over tp
        forward, backward = cp_lib.ring_bytes_per_layer(b, T, width, lay.cp, a)
        replays = forward if lay.recompute == "full" else 0
        out["cp"]["ring"] = m * layers * (forward + backward + replays)
        out["cp"]["all_reduce"] = 8 * m  # 08's cp_token_count: one int64 a microbatch
    if lay.dp * lay.cp > 1:
        items = _items(config)
        flats = _flats(items, lora_rank, lay.tp, lay.pp, lay.virtual_stages, pp_rank)
        N = lay.dp * lay.cp
        trainable = [n for n, t, *_ in flats if t]
        padded = sum(4 * N * -(-n // N) for n in trainable)
        blocks = sum(4 * N * -(-n // N) for n, t, root, *_ in flats if t and not root)
        if lay.zero == 0:  # 03: all-reduce every gradient once, fp32
            out["dp"]["all_reduce"] = 4 * sum(trainable)
        else:  # 07: reduce-scatter every flat, all-gather the weights
            out["dp"].update(reduce_scatter=padded, all_gather=padded)
        if lay.zero == 3:  # gathered each forward, again each backward but root's
            out["dp"]["all_gather"] += (m - 1) * padded + m * blocks
    return out


# ------------------------------------------------------------ the plan
def check_layout(config, layout: Layout, batch: int, n_gpus: int, **run) -> int:
    """PlanError (one line) unless the layout can run; -> microbatches per step.
    run: plan's dtype, lora_rank and loss, which zb1's refusals read."""
    lay = layout
    problem = plan_report.grid_problem(lay, batch, n_gpus)
    if problem:
        raise PlanError(problem)
    if lay.cp > 1 and config.dropout > 0:  # 08's ring has no attention dropout.
        raise PlanError(f"cp {lay.cp} needs dropout 0: 08's ring has none")
    if lay.cp > 1 and lay.recompute == "selective":  # Its replayed ring: not modelled.
        raise PlanError("09 cannot plan selective recompute with cp (train.py runs it)")
    m = batch // (lay.micro_batch * lay.dp)
    try:
        tp_lib.check_tp_config(config, lay.tp)
        schedule = lay.schedule if lay.pp > 1 else "1f1b"
        sched_lib.check_config(schedule, lay.pp, m, lay.virtual_stages, config.n_layer)
        assert lay.recompute in recompute_lib.RECOMPUTE, f"recompute {lay.recompute!r}"
        if schedule == "zb1":  # train.py's refusals, its one list (support/train/config)
            zb1 = train_config.TrainConfig(recompute=lay.recompute, cp=lay.cp, **run)
            zb1.sequence_parallel = lay.sequence_parallel
            train_config.check_zero_bubble(zb1)
    except (AssertionError, train_config.ConfigError) as e:
        raise PlanError(str(e)) from None
    return m


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
    loss: str = "plain",
    trainer: bool = True,
    compiled: bool = True,
) -> Plan:
    """The memory (its fullest GPU) and time of a step of `batch` sequences of T;
    loss: "plain" (02's) or "chunked" (06b's); trainer=False: the lean step alone;
    compiled=False (train.py without --compile; zb1 always): eager's kernels."""
    spec = gpus.get_gpu(gpu)
    T = seq_len or config.block_size
    lay = layout
    run = dict(dtype=dtype, lora_rank=lora_rank, loss=loss)  # zb1's refusals read them
    m = check_layout(config, layout, batch, n_gpus, **run)
    if lay.cp > 1 and T % (2 * lay.cp):  # 08's zigzag; cp 1 splits nothing
        raise PlanError(f"T={T} does not split into 2cp = {2 * lay.cp} zigzag chunks")
    if loss not in ("plain", "chunked") or loss == "chunked" and lay.tp > 1:
        raise PlanError(f"loss {loss!r}: plain, or chunked at tp 1 (06b's)")
    b = lay.micro_batch
    ranks = []
    for r in range(lay.pp):
        memory = model_state_bytes(config, layout, r, lora_rank)
        args = (config, layout, b, m, T, dtype, r, loss)
        memory["activations"], alive = activation_bytes(*args)
        # The largest temporary: the loss's (b, T/cp, V/tp) logits (chunked: 1,024 rows)
        rows = b * T // lay.cp if loss == "plain" else min(CHUNK_TOKENS, b * T)
        logits = BYTES[dtype] * rows * config.padded_vocab_size // lay.tp
        memory["logits"] = logits if r == lay.pp - 1 else 0
        memory["gathered"] = gathered_bytes(config, layout, lora_rank)
        memory["total"] = sum(memory.values())
        groups = collective_bytes(config, layout, b, m, T, r, lora_rank, dtype)
        comm = plan_report.by_op(groups)
        rank = dict(memory=memory, collectives=comm, groups=groups, in_flight=alive)
        ranks.append(dict(rank, dtype=dtype))
    fullest = max(ranks, key=lambda x: x["memory"]["total"])
    fpt = _flops(_items(config), T, lora_rank)
    tokens = batch * T
    counts = roofline_counts(config, T, tokens / n_gpus, lay, fullest["memory"], lora_rank)
    fit = calibrate(dtype, gpu.lower())
    kernels, attention = gpus.roofline_seconds(spec, fit, dtype, *counts)
    kernels *= gpus.SELECTIVE_SLOWDOWN if lay.recompute == "selective" else 1.0
    compiled = compiled and lay.schedule != "zb1"  # train.py cannot compile zb1
    kernels *= gpus.eager_slowdown(dtype, gpu, compiled)
    loop = m * gpus.TRAINER_OVERHEAD if trainer and gpu.lower() != "cpu" else 0.0
    t = dict(compute=kernels + loop)
    bubble = sched_lib.bubble_formula(lay.pp, m, lay.virtual_stages, lay.schedule)
    t["bubble"] = t["compute"] * bubble / (1 - bubble)
    # 08's zigzag: every CP rank computes (cp+1)/2 blocks, so the FLOPs split evenly;
    # the ring hides behind the attention FLOPs (02's 12·L·C·T a token) it overlaps.
    assert len(set(cp_lib.blocks_per_rank(lay.cp, "zigzag"))) == 1
    step = (kernels, attention, m)
    waits = [wire_seconds(spec, gpus_per_node, lay, r["groups"], *step) for r in ranks]
    for part in ("tp", "pp", "cp", "dp"):  # the slowest pipeline rank's
        t[part] = max(w[part] for w in waits)
    t["total"] = sum(t.values())
    sizes = (layout, gpu.lower(), n_gpus, tokens, fullest["memory"], t, ranks, fpt)
    return Plan(*sizes, FIT * spec.memory)


def wire_seconds(spec, gpus_per_node, lay, groups, compute, attention, m) -> dict:
    """Seconds of a rank's step on each group's wire that compute does not hide (see
    the top). PP's tied gradient: an all-reduce of 2 ranks, its bytes once. DP hides
    behind a microbatch's backward, 2/3 of its compute; zb1's sync fires in the chunk's
    last W (05c), 1/3 of it. ZeRO-3's m windows hide 1/m each."""
    tp = groups["tp"]
    wire = 2 * tp["all_reduce"] + tp["all_gather"] + tp["reduce_scatter"]
    t = dict(tp=(lay.tp - 1) / lay.tp * wire / gpus.link_of(spec, lay.tp, 1, gpus_per_node))
    stride = lay.tp * lay.cp * lay.dp  # a pipeline's neighbours are a grid slice apart
    pp = groups["pp"]["send"] + groups["pp"]["all_reduce"]
    t["pp"] = pp / gpus.link_of(spec, lay.pp, stride, gpus_per_node)
    ring = groups["cp"]["ring"] / gpus.link_of(spec, lay.cp, lay.tp, gpus_per_node)
    t["cp"] = max(0.0, ring - attention)
    N = lay.dp * lay.cp
    overlapped, exposed = _dp_wire(lay.zero, groups["dp"], N)
    link = gpus.link_of(spec, N, lay.tp, gpus_per_node)
    windows = m if lay.zero == 3 else 1
    backward = compute / m * (1 / 3 if lay.schedule == "zb1" else 2 / 3)
    unhidden = windows * max(0.0, overlapped / windows / link - backward)
    t["dp"] = unhidden + exposed / link
    return t


def _dp_wire(zero: int, dp: dict, N: int) -> tuple[float, float]:
    """(bytes overlapped, bytes exposed) a DP rank sends a step: 03 all-reduces in
    backward; 07's ZeRO-1 reduce-scatters after it and ZeRO-1/2 all-gather after the
    step; ZeRO-3 gathers in each microbatch's forward and backward, beside them."""
    share = (N - 1) / N
    scatter = share * (dp["reduce_scatter"] + dp["all_reduce"])
    gather = share * (dp["all_gather"] + dp["all_reduce"])
    if zero == 1:
        return 0.0, scatter + gather
    if zero == 2:
        return scatter, gather
    return scatter + gather, 0.0


def plan_run(cfg, gpt_config, gpu: str, gpus_per_node: int = 8) -> Plan:
    """The plan of train.py's settings (cfg: support/train/config.TrainConfig; gpt_config:
    the model it builds): train.py --plan prints it, and its first log lines."""
    cpu = gpu.lower() == "cpu"
    dtype = "fp32" if cfg.dtype == "fp32" or cfg.dtype == "auto" and cpu else "bf16"
    layout = plan_report.train_layout(cfg)
    n = layout.dp * layout.tp * layout.pp * layout.cp
    options = (gpus_per_node, gpt_config.block_size, dtype, cfg.lora_rank)
    loss = getattr(cfg, "loss", "plain")
    kw = dict(loss=loss, compiled=cfg.compile)  # eager is train.py's default
    return plan(gpt_config, layout, cfg.batch_size, gpu, n, *options, **kw)


# ------------------------------------------------------------ the search
def search(
    config,
    batch: int,
    gpu: str,
    n_gpus: int,
    gpus_per_node: int = 8,
    seq_len=None,
    dtype="bf16",
    lora_rank=0,
    loss="plain",
) -> list[Plan]:
    """Every valid layout's plan, the fitting ones first, fastest first."""
    plans = []
    for layout in layouts(config, batch, n_gpus, gpus_per_node, seq_len):
        try:
            args = (config, layout, batch, gpu, n_gpus, gpus_per_node, seq_len, dtype)
            plans.append(plan(*args, lora_rank, loss))
        except PlanError:
            continue  # e.g. interleaved's m % p, a vocabulary that does not split
    plans.sort(key=plan_report.rank_key)  # fitting first, fastest first
    return plans


def worked_example() -> None:
    """GPT-2 124M on one H200, B = 32, bf16: the plan beside its formulas' arithmetic
    with the numbers filled in; then gpt2-large, held out (not fitted), on two GPUs."""
    config = model_config("gpt2")
    p = plan(config, Layout(micro_batch=32), 32, "h200", 1)
    psi = model_lib.count_params(config)
    print("worked example: GPT-2 124M, 1 H200, bf16 compiled, B = 32 x T = 1,024")
    hand = zero_lib.zero_memory_formula(0, psi, 1)
    states = sum(p.memory[k] for k in ("weights", "grads", "optimizer"))
    print(f"  model states: 16Ψ = 16 x {psi:,} = {hand:,.0f} B (07); plan {states:,} B")
    print("    (Ψ with V padded to 50,304; plan: + AdamW's 4-byte step of 148 tensors)")
    # 06b's formula by hand: C = 768, L = 12, nh = 12, V = 50,304; a = 2 (bf16 matmul
    # operands), r = 4 (the fp32 residual stream).
    layer = 2 * 770 * 4 + 14 * 768 * 2 + 4 * 12  # LayerNorms, operands, lse
    rest = 770 * 4 + 8  # ln_f's input, mean and rstd; the int64 id
    head = 768 * 2 + 4 * 50_304 + 8  # lm_head's input, the fp32 log-softmax, target
    copies = 2 * 12 * 12 * 768**2 + 2 * 50_304 * 768  # autocast's bf16 weights
    act = 32 * 1024 * (12 * layer + rest + head) + 8 * 1024 + 4 + copies
    print(f"  a layer, a token: 2(C+2)4 + 14C·2 + 4nh = {layer:,} B (06b's none)")
    print(f"  activations: 32·1,024·(12·{layer:,} + ln_f {rest:,} + head {head:,})")
    print(f"    + positions 8·1,024 + the token count 4 + autocast's copies {copies:,}")
    print(f"    = {act:,} B; plan {p.memory['activations']:,}")
    logits = 2 * 32 * 1024 * 50_304
    print(f"  logits: 2·32·1,024·50,304 = {logits:,} B; plan {p.memory['logits']:,}")
    print(f"  peak {plan_report.gib(p.memory['total'])} GiB; measured 21.3 GiB")
    f = calibrate("bf16", "h200")
    counts = roofline_counts(config, 1024, 32 * 1024, p.layout, p.memory)
    print("  time: support/gpus' roofline, H200 (989.5 TFLOP/s, 4.8 TB/s), 32,768 tok:")
    kernels = plan_report.print_roofline("h200", f, "bf16", counts)
    rate = f"{32_768 / kernels:,.0f} tokens/s (fitted: its measured rate)"
    print(f"    = {1e3 * kernels:.1f} ms: {rate}")  # the lean step: no bubble, no wire
    loop = f"+ train.py's loop, {1e3 * gpus.TRAINER_OVERHEAD:.1f} ms a microbatch"
    total = 1e3 * p.time["total"]
    print(f"    {loop} = {total:.1f} ms: {p.tokens_per_s:,.0f} tokens/s")
    large = (model_config("gpt2-large"), Layout(micro_batch=16), 16)
    rate = [plan(*large, g, 1, trainer=False).tokens_per_s for g in ("h200", "h100")]
    print(f"gpt2-large, B = 16, held out (not fitted): H200 {rate[0]:,.0f} tokens/s")
    print(f"  (measured 89,074), H100 {rate[1]:,.0f} (same peak, its HBM 3.35 TB/s)")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    plan_report.add_arguments(parser, model_lib.PRESETS, tuple(BYTES))
    args = parser.parse_args(argv)
    try:
        if not argv:
            worked_example()
        gpus.get_gpu(args.gpu)
        if args.gpus % args.gpus_per_node and args.gpus > args.gpus_per_node:
            nodes = f"whole nodes of {args.gpus_per_node}"
            raise PlanError(f"{args.gpus} GPUs are not {nodes}")
        shape = plan_report.given_shape(args, model_lib.PRESETS)  # --n-layer, ...
        config = model_config(args.model, **shape)
        cluster = (args.gpu, args.gpus, args.gpus_per_node)
        options = (args.seq_len, args.dtype, args.lora_rank, args.loss)
        plans = search(config, args.batch_size, *cluster, *options)
        if not plans:  # the plainest layout's refusal says why, else:
            plan(config, Layout(dp=args.gpus), args.batch_size, *cluster, *options)
            raise PlanError(f"no layout of {args.model} divides {args.gpus} GPUs")
        if not any(p.fits for p in plans):
            need = min(p.memory["total"] for p in plans) / GIB
            where = f"{args.gpus} {args.gpu}: the smallest needs {need:.1f} GiB"
            raise PlanError(f"{args.model} fits no layout of {where} > {FIT:.0%}")
        plan_report.print_search(plans, args, FIT, config, model_lib.count_params)
    except (PlanError, ValueError) as e:
        parser.exit(2, f"09_plan.py: error: {e}\n")


if __name__ == "__main__":
    main()
