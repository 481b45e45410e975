"""09's plan against the tensors and messages of real steps, and against the GPU runs.

On the CPU, each layout below is built with the lessons' own wrappers (03's
DataParallel, 07's zero_data_parallel, 04's apply_tensor_parallel (04b's with SP), 05's
split_model, 05b's pipeline_step, 06b's apply_recomputation, 08's
apply_context_parallel) on train.py's grid of groups, in one spawned world per size,
and one step runs. Then, per rank:
- the weights', gradients' and AdamW states' bytes (07's memory_per_rank: the storages
  that exist after a backward) equal plan's exactly, and so do ZeRO-3's whole flats at
  their most (seen at every module's forward: the root and two blocks);
- the payload bytes handed to each collective during the step (the dist functions
  wrapped, as support/tensor_parallel/sharding.count_comm does) equal plan's exactly, 08's ring's sends
  among them;
- the bytes kept for backward at the pipeline's peak, counted as 06b counts them
  (support/tensor_parallel/activations.saved_activation_bytes per chunk, replayed in the order the
  step's Events ran; zb1's W queue from each B to its W, which equals 05c's
  stage_w_bytes at tp 1 and 2), are within 5% of plan's (10% under full
  recomputation), and the microbatches alive then equal 05's count. Two layouts run
  under CPU autocast in bf16: autocast's weight copies, one per microbatch in flight.
Then each time and memory term is computed by hand on a small GPT and compared. The GPU
half checks plan against the H200 runs in docs/results.md (hard-coded, each with its
source line: they are measurements, not outputs of the planner): the runs the roofline
is not fitted on within 5% (tokens/s) and 10% (memory).
"""

import importlib
import inspect
import re
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from support import gpus
from support.tensor_parallel.activations import saved_activation_bytes
from support.train import grid as grid_lib
from support.train.run import adamw_groups
from tests.distributed import case_results, run_cases, run_ranks

plan_lib = importlib.import_module("09_plan")
model_lib = importlib.import_module("02_model")
ddp = importlib.import_module("03_ddp")
tp_lib = importlib.import_module("04_tensor_parallel")
sp_lib = importlib.import_module("04b_sequence_parallel")
pp_lib = importlib.import_module("05_pipeline")
sched_lib = importlib.import_module("05b_schedules")
recompute_lib = importlib.import_module("06b_recompute")
zero_lib = importlib.import_module("07_zero")
cp_lib = importlib.import_module("08_context_parallel")
zb_lib = importlib.import_module("05c_zero_bubble")

Layout = plan_lib.Layout
CONFIG = dict(n_layer=4, n_head=4, n_embd=64, block_size=32, vocab_size=256)
B = 2  # sequences per microbatch
C = CONFIG["n_embd"]
M_PP = 4  # microbatches of a pipeline step
T = 32

LAYOUTS = {
    2: {
        "dp zero 0": Layout(dp=2, micro_batch=B),
        "dp zero 1": Layout(dp=2, zero=1, micro_batch=B),
        "dp zero 2": Layout(dp=2, zero=2, micro_batch=B),
        "dp zero 3": Layout(dp=2, zero=3, micro_batch=B),
        "dp full": Layout(dp=2, micro_batch=B, recompute="full"),
        "tp": Layout(tp=2, micro_batch=B),
        "tp sp": Layout(tp=2, micro_batch=B, sequence_parallel=True),
        "tp selective": Layout(tp=2, micro_batch=B, recompute="selective"),
        "tp sp full": Layout(
            tp=2, micro_batch=B, sequence_parallel=True, recompute="full"
        ),
        "pp gpipe": Layout(pp=2, micro_batch=B, schedule="gpipe"),
        "pp 1f1b": Layout(pp=2, micro_batch=B),
        "pp interleaved": Layout(
            pp=2, micro_batch=B, schedule="interleaved", virtual_stages=2
        ),
        "pp selective": Layout(pp=2, micro_batch=B, recompute="selective"),
        "pp full": Layout(pp=2, micro_batch=B, recompute="full"),
        "cp": Layout(cp=2, micro_batch=B),
        "cp full": Layout(cp=2, micro_batch=B, recompute="full"),
        "pp zb1": Layout(pp=2, micro_batch=B, schedule="zb1"),
        "pp bf16": Layout(pp=2, micro_batch=B),
        "pp zb1 bf16": Layout(pp=2, micro_batch=B, schedule="zb1"),
    },
    4: {
        "dp zero 3": Layout(dp=4, zero=3, micro_batch=B),
        "tp sp": Layout(tp=4, micro_batch=B, sequence_parallel=True),
        "pp 1f1b": Layout(pp=4, micro_batch=B),
        "tp pp": Layout(tp=2, pp=2, micro_batch=B),
        "tp pp sp": Layout(tp=2, pp=2, micro_batch=B, sequence_parallel=True),
        "tp pp zb1": Layout(tp=2, pp=2, micro_batch=B, schedule="zb1"),
    },
}
BF16 = {"pp bf16", "pp zb1 bf16"}  # run under CPU autocast (05b's dtype), planned bf16


def gpt_config():
    return model_lib.GPTConfig(pad_vocab_multiple=64, **CONFIG)


def batch_size(layout: Layout) -> int:
    return B * layout.dp * (M_PP if layout.pp > 1 else 1)


# ------------------------------------------------------------ counting collectives
# Each wrapped collective -> the argument whose tensors make its payload.
PAYLOAD = dict(
    all_reduce="tensor",
    all_gather="tensor_list",
    all_gather_into_tensor="output_tensor",
    all_gather_single="output_tensor",
    reduce_scatter="input_list",
    reduce_scatter_tensor="input",
    reduce_scatter_single="input",
)
KIND = dict(
    all_gather_into_tensor="all_gather",
    all_gather_single="all_gather",
    reduce_scatter_tensor="reduce_scatter",
    reduce_scatter_single="reduce_scatter",
)


class Counter:
    """Wrap dist's collectives (and batch_isend_irecv's sends) and add up payloads."""

    def __init__(self):
        self.bytes = dict(all_reduce=0, reduce_scatter=0, all_gather=0, send=0)
        self.saved = {op: getattr(dist, op) for op in PAYLOAD if hasattr(dist, op)}
        self.saved["batch_isend_irecv"] = dist.batch_isend_irecv

    def __enter__(self):
        for op, fn in self.saved.items():
            setattr(dist, op, self._wrap(op, fn))
        return self

    def __exit__(self, *exc):
        for op, fn in self.saved.items():
            setattr(dist, op, fn)

    def _wrap(self, op, fn):
        def collective(*args, **kwargs):
            if op == "batch_isend_irecv":
                sends = [o.tensor for o in args[0] if o.op is dist.isend]
                self.bytes["send"] += sum(t.numel() * t.element_size() for t in sends)
                return fn(*args, **kwargs)
            payload = inspect.signature(fn).bind(*args, **kwargs).arguments[PAYLOAD[op]]
            tensors = payload if isinstance(payload, list) else [payload]
            n = sum(t.numel() * t.element_size() for t in tensors)
            self.bytes[KIND.get(op, op)] += n
            return fn(*args, **kwargs)

        return collective


# ------------------------------------------------------------ one layout on the ranks
def build(layout: Layout, rank: int, world: int):
    """-> (chunks as one module, chunks list, optimizer, train.py's grid of groups)."""
    torch.manual_seed(0)
    model = model_lib.GPT(gpt_config())
    recompute_lib.apply_recomputation(model, layout.recompute)
    sizes = (layout.pp, layout.dp, layout.tp, rank, world, pp_lib.embedding_group)
    grid = grid_lib.build_grid(*sizes, layout.cp)
    kw = dict(lr=1e-3, weight_decay=0.1)
    if layout.tp > 1:
        apply = tp_lib.apply_tensor_parallel  # 04b's SP builds on 04's split
        if layout.sequence_parallel:
            apply = sp_lib.apply_sequence_parallel
        apply(model, grid.tp_group)
    if layout.cp > 1:
        cp_lib.apply_context_parallel(model, grid.cp_group)
    if layout.pp > 1:
        chunks = pp_lib.split_model(model, grid.pp_rank, grid.pp, layout.virtual_stages)
        zb_lib.split_for_schedule(chunks, layout.schedule)  # zb1: B and W split (05c)
        tied = [pp_lib.tied_parameter(c) for c in chunks]
        opt = torch.optim.AdamW(adamw_groups(chunks, tied, 0.1), **kw)
        return nn.ModuleList(chunks), chunks, opt, grid
    groups = adamw_groups([model], [], 0.1)
    if layout.dp > 1:
        args = (model, layout.zero, groups, torch.optim.AdamW)
        wrapped, opt = zero_lib.zero_data_parallel(*args, group=grid.dp_group, **kw)
        return model, [wrapped], opt, grid
    return model, [model], torch.optim.AdamW(groups, **kw), grid


def rows_sent(layout: Layout) -> int:
    """The tokens of a sequence a stage sends (train.py's act_shape): SP's T/tp."""
    return T // layout.tp if layout.sequence_parallel else T


def step(layout, chunks, batch, grid, dtype=None):
    """One step's forward and backward; -> (bytes kept for backward, Events or None).
    dtype: autocast's in 05b's forwards (a pipeline's only here)."""
    if layout.cp > 1:  # 08's cp_step, its forward counted: this rank's zigzag chunks
        model = chunks[0]
        rank = grid.cp_rank
        x, y = (cp_lib.zigzag_split(t, rank, layout.cp) for t in batch)
        n = cp_lib.cp_token_count(y, model.cp_group)
        (_, loss), kept = saved_activation_bytes(lambda: model(x, y, reduction="sum"))
        (loss / n * layout.cp).backward()
        cp_lib.average_gradients(model, model.cp_group)
        return kept, None
    if layout.pp > 1:
        m = len(batch[0]) // B
        kw = dict(embed_group=grid.embed_group, act_shape=(B, rows_sent(layout), C))
        kw["dtype"] = dtype
        args = (chunks, batch, m, layout.schedule, grid.pp_group)
        return None, sched_lib.pipeline_step(*args, **kw)
    (_, loss), kept = saved_activation_bytes(lambda: chunks[0](*batch))
    loss.backward()
    return kept, None


def chunk_bytes(chunk, batch, layout, dtype=None) -> tuple[int, int]:
    """(bytes one microbatch keeps for backward in one pipeline chunk (06b's count),
    the bytes 05c's W queue then keeps from its B to its W (0 unless split)), its
    forward under its own autocast context, as 05b runs each."""
    x, y = (t[:B] for t in batch)
    rows = rows_sent(layout)
    inp = x if chunk.is_first else torch.zeros(B, rows, C, requires_grad=True)

    def forward():
        with torch.autocast("cpu", dtype or torch.bfloat16, enabled=dtype is not None):
            out = chunk(inp)
        return chunk.loss_fn(out, y, "sum") if chunk.is_last else out

    out, kept = saved_activation_bytes(forward)
    queue = getattr(chunk, "weight_grads", None)
    if queue is None:
        return kept, 0
    out.backward(torch.ones_like(out))  # B: the queue fills with what W reads
    w = queue.nbytes()
    for mb in list(queue.pending):  # W (keyed by the step's last mb), emptying it
        queue.run(mb)
    return kept, w


def measure(rank: int, world: int, layout: Layout, dtype=None) -> dict:
    module, chunks, opt, grid = build(layout, rank, world)
    rows = batch_size(layout) // layout.dp  # DP: this rank's rows
    batches = model_lib.byte_batches(T, rows, 2, seed=grid.dp_rank)
    step(layout, chunks, batches[0], grid, dtype)  # AdamW's state exists after one
    opt.step()
    opt.zero_grad(set_to_none=True)
    gathered = [0]  # ZeRO-3: 07's whole flats alive, seen at every module's forward
    full = [f.full.untyped_storage() for f in getattr(opt, "flats", [])]

    def sample(*_):
        gathered.append(sum(x.nbytes() for x in full))

    for m in module.modules() if layout.zero == 3 else []:
        m.register_forward_hook(sample)
    with Counter() as counter:
        kept, result = step(layout, chunks, batches[1], grid, dtype)
        memory = zero_lib.memory_per_rank(module, opt)  # after backward, as 07 counts
        opt.step()
    memory["gathered"] = max(gathered)
    out = dict(memory=memory, collectives=counter.bytes)
    if result is None:
        out.update(activations=kept, alive=1)
        return out
    sizes = [chunk_bytes(c, batches[1], layout, dtype) for c in chunks]
    alive = 0
    peak = 0
    for e in result.events:  # the order the step ran its F, B (and zb1's W) in
        kept, w = sizes[e.chunk]
        alive += {"F": kept, "B": w - kept, "W": -w}[e.op]
        peak = max(peak, alive)
    out.update(activations=peak, alive=result.peak_in_flight)
    out["w"] = [w for _, w in sizes]
    return out


def _case(layout, dtype):
    def case(rank, world):
        return measure(rank, world, layout, dtype)

    return case


def world_cases(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    items = LAYOUTS[world].items()
    dtype = {True: torch.bfloat16, False: None}
    cases = {name: _case(lay, dtype[name in BF16]) for name, lay in items}
    return run_cases(rank, world, cases)


@pytest.fixture(scope="module", params=[2, 4])
def world(request):
    """Each world size spawned once; every layout of LAYOUTS runs inside it."""
    return request.param, run_ranks(world_cases, request.param, timeout=240)


def test_plan_equals_the_bytes_of_real_steps(world):
    size, per_rank = world
    config = gpt_config()
    for name, layout in LAYOUTS[size].items():
        got = case_results(per_rank, name)
        args = (config, layout, batch_size(layout), "cpu", size)
        dtype = "bf16" if name in BF16 else "fp32"
        p = plan_lib.plan(*args, seq_len=T, dtype=dtype)
        for rank, measured in enumerate(got):
            pp_rank = rank // (size // layout.pp)  # the grid's slowest axis
            want = p.ranks[pp_rank]
            where = f"{name}, world {size}, rank {rank}"
            mem = measured["memory"]
            model_states = (mem["params"], mem["grads"], mem["optimizer"])
            wanted = tuple(want["memory"][k] for k in ("weights", "grads", "optimizer"))
            assert model_states == wanted, f"{where}: model states"
            assert mem["gathered"] == want["memory"]["gathered"], f"{where}: gathered"
            expected = dict(want["collectives"])
            expected["send"] += expected.pop("ring")  # 08's ring sends as 05's do
            if layout.zero and not measured["collectives"]["reduce_scatter"]:
                # gloo without a reduce-scatter: 07 runs it as an all-reduce, same input
                expected["all_reduce"] += expected.pop("reduce_scatter")
                expected["reduce_scatter"] = 0
            assert measured["collectives"] == expected, f"{where}: collectives"
            # 06b's formula is exact for a whole GPT; a TP rank's loss keeps a few
            # (B, T)-sized tensors it does not list (the vocab-parallel max and sums),
            # and SP's split of them is counted whole: 5% (seen: at most 2.9%, tp sp at
            # world 4). Full recomputation keeps little, so those small gaps weigh
            # more: 10% (seen: 7.9%, tp sp full; 5.1%, pp full's stage 0).
            predicted = want["memory"]["activations"]
            kept = measured["activations"]
            tolerance = 0.1 if layout.recompute == "full" else 0.05
            assert abs(kept - predicted) <= tolerance * kept, (
                f"{where}: {kept} vs {predicted}"
            )
            assert measured["alive"] == want["in_flight"], f"{where}: in flight"
            if layout.schedule == "zb1":  # 05c's W queue, each TP rank's share too
                a = plan_lib.BYTES[dtype]
                shape = (B, T, layout.pp, pp_rank, a, layout.tp)
                assert measured["w"] == [zb_lib.stage_w_bytes(config, *shape)], where


# ------------------------------------------------------------ the GPU runs
# One NVIDIA H200, bf16 autocast, torch.compile, T = 1,024 (docs/results.md, "MFU: GPT-2
# and up"): (preset, B, tokens/s, peak GiB). 124M and medium at 32 fit the roofline's
# memory-bound bytes (support/gpus.CALIBRATION); the others fit nothing: predictions.
CALIBRATING_RUNS = [
    # "| `bench/bench_compiled_step.py` | GPT-2 124M | 32 | 515,639 | 44.6% | 21.3 |"
    ("gpt2", 32, 515_639, 21.3),
    # "| the same | gpt2-medium (355M) | 32 | 194,643 | 47.7% | 41.2 |"
    ("gpt2-medium", 32, 194_643, 41.2),
]
PREDICTED_RUNS = [
    # "| the same † | GPT-2 124M | 64 | 519,019 | 44.9% | 40.8 |"
    ("gpt2", 64, 519_019, 40.8),
    # "| the same † | gpt2-large (774M) | 16 | 89,074 | 46.8% | 40.4 |"
    ("gpt2-large", 16, 89_074, 40.4),
]


def h200_plan(preset, batch, micro_batch=None, trainer=False):
    """The lean step (bench_compiled_step.py), or train.py's (trainer=True)."""
    config = plan_lib.model_config(preset)
    layout = Layout(micro_batch=micro_batch or batch)
    return plan_lib.plan(config, layout, batch, "h200", 1, trainer=trainer)


@pytest.mark.parametrize("preset, batch, tokens_per_s, peak_gib", PREDICTED_RUNS)
def test_plan_predicts_the_h200_runs_within_10_percent(
    preset, batch, tokens_per_s, peak_gib
):
    p = h200_plan(preset, batch)
    # 5% on tokens/s: they hold at 1.3% (124M, B = 64) and 3.6% (large); the project's
    # target for runs the planner was not fitted on is 10%. Memory within 10%: large's
    # plan is 6.6% over its allocator's 40.4 GiB (124M's 0.7%).
    assert abs(p.tokens_per_s / tokens_per_s - 1) <= 0.05, p.tokens_per_s
    assert abs(p.memory["total"] / 2**30 / peak_gib - 1) <= 0.10, p.memory["total"]


@pytest.mark.parametrize("preset, batch, tokens_per_s, peak_gib", CALIBRATING_RUNS)
def test_the_calibrating_runs_are_reproduced(preset, batch, tokens_per_s, peak_gib):
    # 1e-9: the bytes fitted to two runs make both exact, up to float rounding.
    assert h200_plan(preset, batch).tokens_per_s == pytest.approx(tokens_per_s, 1e-9)


# train.py on the H200 (docs/results.md, its log lines at steps 10-39): (micro-batch,
# microbatches, lowest and highest tokens/s). The lean step's runs fit the roofline;
# these fit only TRAINER_OVERHEAD's 7.5 ms (their mean), so each is checked within 3%:
# the two differ by 0.5 ms a microbatch, 0.4% of a step, and their rows spread 1.7%.
TRAIN_PY_RUNS = [(32, 2, 459_022, 466_727), (64, 1, 485_697, 492_176)]


@pytest.mark.parametrize("micro_batch, m, low, high", TRAIN_PY_RUNS)
def test_train_py_pays_its_loop_a_microbatch(micro_batch, m, low, high):
    """plan() predicts train.py: the lean step plus gpus.TRAINER_OVERHEAD a microbatch
    (7.8 ms over the lean step at 64 x 1, 7.2 at 32 x 2: measured, not fitted here)."""
    run = h200_plan("gpt2", 64, micro_batch, trainer=True)
    lean = h200_plan("gpt2", 64, micro_batch)
    loop = run.time["total"] - lean.time["total"]
    assert loop == pytest.approx(m * gpus.TRAINER_OVERHEAD, rel=1e-9)
    assert 0.0073 < gpus.TRAINER_OVERHEAD < 0.0077, gpus.TRAINER_OVERHEAD
    assert abs(run.tokens_per_s / ((low + high) / 2) - 1) <= 0.03, run.tokens_per_s


def test_each_gpu_by_its_own_hbm_and_peak():
    """The roofline (support/gpus.roofline_seconds): H100 and H200 share a peak and
    differ in HBM (3.35 against 4.8 TB/s), so GPT-2 124M's steps differ by exactly its
    memory-bound bytes over each: (β_L·L·C + β_V·V) a token and AdamW's bytes a parameter.
    An A100 runs the FLOPs at its own 312 TFLOP/s and the bytes at 2.039 TB/s."""
    config = plan_lib.model_config("gpt2")
    lay = Layout(micro_batch=32)
    keys = gpus.plannable()
    steps = {g: plan_lib.plan(config, lay, 32, g, 1, trainer=False) for g in keys}
    f = plan_lib.calibrate("bf16", "h200")
    stepped = steps["h200"].memory["optimizer"] / 8
    moved = 32 * 1024 * (f["layer_bytes"] * 12 * 768 + f["vocab_bytes"] * 50_304)
    moved += f["param_bytes"] * stepped
    gap = moved / 3.35e12 - moved / 4.8e12
    # 1e-9: the same sum in another order.
    assert steps["h100"].time["total"] - steps["h200"].time["total"] == pytest.approx(
        gap, rel=1e-9
    )
    assert steps["h100"].tokens_per_s < 0.9 * steps["h200"].tokens_per_s
    flops = steps["h200"].time["total"] - moved / 4.8e12  # the H200's FLOP seconds
    a100 = flops * 989.5 / 312 + moved / 2.039e12
    assert steps["a100"].time["total"] == pytest.approx(a100, rel=1e-9)
    # 02's FLOPs are the same everywhere: MFU differs by each card's own peak.
    assert steps["b200"].mfu != steps["h100"].mfu


def test_a_lora_run_computes_no_frozen_weight_gradient():
    """LoRA (02's apply_lora) trains the factors only: the backward computes each frozen
    weight's input gradient (2N) but not its own (2N more), so a token's matmuls are
    4N + 6·16·r·C·L, not 6N (PaLM's 6N counts both). Charge 6N and this goes red."""
    config = plan_lib.model_config("gpt2")
    lay = Layout(micro_batch=8)
    full = plan_lib.plan(config, lay, 8, "h200", 1, trainer=False)
    lora = plan_lib.plan(config, lay, 8, "h200", 1, lora_rank=8, trainer=False)
    N = model_lib.count_params(config, non_embedding=True)
    L, C, T = 12, 768, 1024
    assert lora.flops_per_token == 4 * N + 6 * 16 * 8 * C * L + 12 * L * C * T
    counts = plan_lib.roofline_counts(config, T, 100, lay, lora.memory, lora_rank=8)
    assert counts[0] == 100 * (4 * N + 6 * 16 * 8 * C * L)  # attention's kept apart
    assert lora.time["compute"] < 0.8 * full.time["compute"], (lora.time, full.time)


def test_the_matmuls_run_nearer_the_peak_when_wider():
    """e(C) = e_max C / (C + knee) passes through the profile's two measured matmul
    rates (721 TFLOP/s at C = 768, 742 at 1,024, of 989.5) and rises with C."""
    e_max, knee = gpus.width_efficiency()
    e = [e_max * C / (C + knee) for C in (768, 1024, 1600, 12_288)]
    assert e[0] == pytest.approx(721 / 989.5, rel=1e-12)
    assert e[1] == pytest.approx(742 / 989.5, rel=1e-12)
    assert e[1] < e[2] < e[3] < e_max < 1


def test_fewer_larger_microbatches_are_faster():
    """train.py's loop costs 7.5 ms a microbatch (support/gpus.TRAINER_OVERHEAD), so
    64 x 1 beats 32 x 2 (measured: 485,697-492,176 tokens/s against 459,022-466,727)
    and the search takes the largest micro-batch that fits (once it picked mb 1)."""
    one = h200_plan("gpt2", 64, 64, trainer=True).tokens_per_s
    two = h200_plan("gpt2", 64, 32, trainer=True).tokens_per_s
    assert one > two
    config = plan_lib.model_config("gpt2")
    best = plan_lib.search(config, 32, "h200", 1)[0]
    assert best.layout.micro_batch == 32, best.layout


def test_a_tie_goes_to_the_larger_micro_batch():
    """On the CPU (one fitted run: one share of the peak, no loop) every micro-batch
    takes the same time: the ranking's assumption takes the largest that fits."""
    config = plan_lib.model_config("tiny")
    best = plan_lib.search(config, 8, "cpu", 1, dtype="fp32")[0]
    assert best.layout.micro_batch == 8, best.layout


def test_selective_costs_its_measured_time():
    """docs/results.md measured selective at 67.6 ms against none's 49.8 (eager)."""
    none = h200_plan("gpt2", 32)
    config = plan_lib.model_config("gpt2")
    layout = Layout(micro_batch=32, recompute="selective")
    selective = plan_lib.plan(config, layout, 32, "h200", 1, trainer=False)
    # The whole roofline is scaled (its FLOPs and bytes are none's: dropout 0).
    ratio = selective.time["compute"] / none.time["compute"]
    assert ratio == pytest.approx(67.6 / 49.8, rel=1e-12)


def test_a_run_without_compile_is_charged_eagers_kernels():
    """train.py runs eager unless --compile (zb1 always): plan_run reads cfg.compile, so
    gpt2-medium pp 4 1f1b's kernels cost EAGER_SLOWDOWN more without it (the bubble
    scales with them); zb1 costs the same either way. Where the fitted run was eager
    (the CPU's), no factor."""
    from support.train.config import TrainConfig

    config = plan_lib.model_config("gpt2-medium")
    rates = {}
    for schedule in ("1f1b", "zb1"):
        for compiled in (False, True):
            kw = dict(pp=4, micro_batch_size=4, batch_size=64, compile=compiled)
            cfg = TrainConfig(model="gpt2-medium", schedule=schedule, **kw)
            rates[schedule, compiled] = plan_lib.plan_run(cfg, config, "h200")
    loop = 16 * gpus.TRAINER_OVERHEAD
    eager, fast = (rates["1f1b", c].time["compute"] - loop for c in (False, True))
    assert eager == pytest.approx(fast * gpus.EAGER_SLOWDOWN, rel=1e-12)
    zb1 = [rates["zb1", c].tokens_per_s for c in (False, True)]
    assert zb1[0] == zb1[1]
    cpu = plan_lib.model_config("tiny")
    on_cpu = [
        plan_lib.plan(cpu, Layout(micro_batch=8), 8, "cpu", 1, dtype="fp32", compiled=c)
        for c in (False, True)
    ]
    assert on_cpu[0].time == on_cpu[1].time


def test_ring_bytes_and_memory_of_cp_follow_08():
    """cp 4 x tp 2 on gpt2 at T = 4,096: the ring's bytes are 08's formula by hand
    (E = b T/cp C/tp, forward 2(cp-1)E·2, backward that + 2cp·E·4), every layer and
    microbatch; activations (positions too) and logits are those of T/cp tokens."""
    config = plan_lib.model_config("gpt2", block_size=4096)
    lay = Layout(dp=1, tp=2, cp=4, micro_batch=2)
    p = plan_lib.plan(config, lay, 4, "h100", 8)
    E = 2 * 1024 * 384
    per_layer = 3 * 2 * E * 2 + (3 * 2 * E * 2 + 4 * 2 * E * 4)
    assert p.ranks[0]["collectives"]["ring"] == 2 * 12 * per_layer
    one = plan_lib.plan(config, Layout(tp=2, micro_batch=2), 4, "h100", 2, seq_len=1024)
    assert p.memory["logits"] == one.memory["logits"]
    assert p.memory["activations"] == one.memory["activations"]


def test_chunked_loss_keeps_no_logits():
    """--loss chunked: 06b's loss_formula(loss="chunked") replaces the plain one."""
    config = plan_lib.model_config("gpt2")
    args = (config, Layout(micro_batch=8), 8, "h100", 1)
    plain = plan_lib.plan(*args)
    chunked = plan_lib.plan(*args, loss="chunked")
    saved = recompute_lib.loss_formula(
        config, 8, 1024, "bf16 autocast"
    ) - recompute_lib.loss_formula(config, 8, 1024, "bf16 autocast", loss="chunked")
    assert plain.memory["activations"] - chunked.memory["activations"] == saved
    assert chunked.memory["logits"] == 2 * 1024 * config.padded_vocab_size
    cfg = types.SimpleNamespace(
        dp=1, tp=1, pp=1, zero=0, recompute="none", micro_batch_size=8, batch_size=8
    )
    cfg.__dict__.update(schedule="1f1b", virtual_stages=1, sequence_parallel=False)
    cfg.__dict__.update(dtype="bf16", lora_rank=0, loss="chunked", compile=False)
    run = plan_lib.plan_run(cfg, config, "h100")  # train.py's --loss chunked
    assert run.memory == chunked.memory
    best = plan_lib.search(config, 8, "h100", 1, loss="chunked")[0]
    assert best.memory["logits"] == chunked.memory["logits"]


def test_why_best_answers_every_other_value():
    """One line per other value of each choice, naming the whole rival layout."""
    config = plan_lib.model_config("gpt2")
    plans = plan_lib.search(config, 64, "h100", 8)
    lines = plan_lib.plan_report.why_best(plans)
    best = plans[0].layout
    for value in ("none", "selective", "full"):
        if value != best.recompute:
            mine = f"recompute {best.recompute}, not {value} ("
            assert any(line.startswith(mine) for line in lines), lines
    assert any(line.startswith("tp 1, not 2 (dp 4 tp 2") for line in lines), lines


def test_bad_requests_are_one_line_errors():
    config = plan_lib.model_config("gpt2")
    with pytest.raises(plan_lib.PlanError, match="does not fill 8 GPUs"):
        plan_lib.plan(config, Layout(dp=3), 24, "h100", 8)
    with pytest.raises(ValueError, match="unknown GPU 'tpu'"):
        plan_lib.plan(config, Layout(), 8, "tpu", 1)
    with pytest.raises(plan_lib.PlanError, match="n_head=12 is not divisible by tp=8"):
        plan_lib.plan(config, Layout(tp=8), 8, "h100", 8)
    # With cp, each refusal names only its own setting, and selective is 09's gap.
    with pytest.raises(plan_lib.PlanError, match=r"^09 cannot plan selective recomp"):
        plan_lib.plan(config, Layout(cp=2, recompute="selective"), 8, "h100", 2)
    dropout = plan_lib.model_config("gpt2", dropout=0.1)
    with pytest.raises(plan_lib.PlanError, match=r"^cp 2 needs dropout 0: 08's ring"):
        plan_lib.plan(dropout, Layout(cp=2), 8, "h100", 2)
    with pytest.raises(SystemExit):
        plan_lib.main(["--model", "gpt2-xl", "--gpus", "1", "--gpu", "cpu"])


def test_zero_1_and_2_expose_what_07_sends_after_backward():
    """07's ZeRO-1 reduce-scatters after backward and ZeRO-1/2 all-gather after the
    step: nothing overlaps them. On one node of 8 H100s (NVLink) with a long step,
    plain DP's all-reduce hides behind backward (0 s exposed); ZeRO-1 exposes both
    halves, 2 h / link, and ZeRO-2 one, h / link, with h = (N-1)/N · 4Ψ (fp32)."""
    config = plan_lib.model_config("gpt2")
    spec = gpus.get_gpu("h100")
    exposed = {}
    for zero in range(3):
        layout = Layout(dp=8, zero=zero, micro_batch=16)
        exposed[zero] = plan_lib.plan(config, layout, 8 * 16 * 8, "h100", 8).time["dp"]
    psi = plan_lib.model_state_bytes(config, Layout(dp=8, micro_batch=16))["grads"]
    h = 7 / 8 * psi
    assert exposed[0] == 0.0
    assert exposed[1] == pytest.approx(2 * h / spec.nvlink, rel=1e-9)
    assert exposed[2] == pytest.approx(h / spec.nvlink, rel=1e-9)


# ------------------------------------------------------------ each term by hand
# CONFIG's GPT (L = 4, C = 64, V = 256, T = 32, biases, wte tied to the head): a block
# holds 12C² matrix numbers and 13C vector ones (2 LayerNorms, 4 biases), the root wte
# V·C, wpe T·C and ln_f 2C. Every flat (a unit's decayed or not) is even, so 07's
# padding to N·S = 2⌈n/2⌉ adds nothing at N = 2. fp32: 4 bytes a number everywhere.
L = CONFIG["n_layer"]
V = CONFIG["vocab_size"]
BLOCK = 12 * C * C + 13 * C
ROOT = V * C + T * C + 2 * C
PSI = L * BLOCK + ROOT
M = 4  # microbatches a step
E = B * T * C * 4  # a microbatch's activations (b, T, C), fp32
H100 = gpus.get_gpu("h100")  # links one way: NVLink 450e9, network 50e9 B/s


def small_plan(layout: Layout, gpus_per_node: int = 8):
    n = layout.dp * layout.tp * layout.pp * layout.cp
    args = (gpt_config(), layout, B * layout.dp * M, "h100", n, gpus_per_node)
    return plan_lib.plan(*args, seq_len=T, dtype="fp32")


def compute_by_hand(layout: Layout) -> float:
    """A GPU's share of the step's FLOPs (02's count a token) at e of the peak (fp32:
    one calibrating run, nothing memory-bound), train.py's loop apart."""
    e = plan_lib.calibrate("fp32", "h100")["e_max"]  # one run: one share for all
    n = layout.dp * layout.tp * layout.pp * layout.cp
    flops = B * layout.dp * M * T * model_lib.flops_per_token(gpt_config(), T)
    return flops / n / (H100.flops["fp32"] * e)


def test_the_small_gpt_has_the_parameters_counted_by_hand():
    assert PSI == model_lib.count_params(gpt_config()) == 218_496


def test_tp_collectives_fall_on_the_stages_that_hold_them():
    """tp 2 x pp 2, m = 4 microbatches of b = 2. Each stage runs its 2 blocks' two f and
    two g (8E); the first adds the embedding's g, the last the head's f and the loss's 3
    fp32 all-reduces of (b, T); both all-reduce the tied wte's gradient (V/tp rows) in
    05's embedding group. Full recompute replays each block's attention g (2E). SP:
    those E's as gathers and scatters, f on the replicated gradients (wpe's T·C
    first; 6C a block: 2 LayerNorms, 2 row biases; ln_f's 2C last), sends of T/tp."""
    tied = 4 * V * C // 2
    plain = small_plan(Layout(tp=2, pp=2, micro_batch=B))
    first, last = (r["collectives"] for r in plain.ranks)
    assert first["all_reduce"] == M * 9 * E + tied
    assert last["all_reduce"] == M * (9 * E + 3 * 4 * B * T) + tied
    assert first["send"] == last["send"] == M * E
    full = small_plan(Layout(tp=2, pp=2, micro_batch=B, recompute="full"))
    assert full.ranks[0]["collectives"]["all_reduce"] == M * (9 + 2) * E + tied
    sp = Layout(tp=2, pp=2, micro_batch=B, sequence_parallel=True)
    first, last = (r["collectives"] for r in small_plan(sp).ranks)
    assert first["all_gather"] == first["reduce_scatter"] == M * 9 * E
    assert first["all_reduce"] == M * 4 * (T * C + 2 * 6 * C) + tied
    assert last["all_reduce"] == M * (3 * 4 * B * T + 4 * (2 * 6 * C + 2 * C)) + tied
    assert first["send"] == last["send"] == M * E // 2


def test_tp_time_is_a_ring_on_nvlink_at_the_slowest_stage():
    """A ring all-reduce puts 2(tp-1)/tp of its payload on the wire, a gather or a
    scatter (tp-1)/tp. TP's pairs are neighbours (size 2 x stride 1 <= 8): NVLink. The
    slowest stage: the last without SP (the loss), the first with it (wpe)."""
    last = M * (9 * E + 3 * 4 * B * T)  # TP's all-reduces (the tied one is PP's)
    plain = small_plan(Layout(tp=2, pp=2, micro_batch=B))
    assert plain.time["tp"] == pytest.approx(2 * last / 2 / H100.nvlink, rel=1e-12)
    first = M * 4 * (T * C + 2 * 6 * C)
    wire = 2 * first + 2 * M * 9 * E  # + its gathers and scatters
    sp = small_plan(Layout(tp=2, pp=2, micro_batch=B, sequence_parallel=True))
    assert sp.time["tp"] == pytest.approx(wire / 2 / H100.nvlink, rel=1e-12)


def test_pp_time_and_the_node_boundary():
    """dp 2 x pp 2: a pipeline's neighbours are tp·cp·dp = 2 ranks apart (the grid
    arange(4).view(pp, dp, cp, tp)), so its group spans size·stride = 4 GPUs: NVLink on
    nodes of 4, the network on nodes of 2. Each stage sends one (b, T, C) a microbatch
    and all-reduces the tied gradient with the other (2 ranks: its bytes once)."""
    wire = M * E + 4 * V * C
    for per_node, link in ((4, H100.nvlink), (2, H100.network)):
        p = small_plan(Layout(dp=2, pp=2, micro_batch=B), per_node)
        assert p.time["pp"] == pytest.approx(wire / link, rel=1e-12), per_node


def test_cp_exposes_the_ring_that_attention_does_not_hide():
    """cp 2 on nodes of 1 GPU: the ring crosses the network. 08's bytes a layer and
    microbatch, E' = b·T/cp·C numbers: forward K and V to cp - 1 peers, 2(cp-1)E'·4;
    backward the same, and dK, dV travelling the whole ring home, 2cp·E'·4. It hides
    behind attention's share of the compute, 12·L·C·T of 02's FLOPs a token."""
    layout = Layout(cp=2, micro_batch=B)
    p = small_plan(layout, gpus_per_node=1)
    share = B * T // 2 * C
    ring = M * L * (2 * share * 4 + 2 * share * 4 + 2 * 2 * share * 4)
    attention = 12 * L * C * T / model_lib.flops_per_token(gpt_config(), T)
    want = ring / H100.network - compute_by_hand(layout) * attention
    assert want > 0
    assert p.time["cp"] == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_dp_time_of_each_zero_stage(zero):
    """dp 2 on nodes of 1 GPU (the network), m = 4: a ring puts 1/2 (= (N-1)/N) of a
    reduce-scatter's or an all-gather's payload on the wire, both for an all-reduce.
    03's all-reduce hides behind the last microbatch's backward (2/3 of its compute);
    ZeRO-1 sends both halves after backward, exposed; ZeRO-2 reduce-scatters in backward
    (hidden) and gathers after the step (exposed); ZeRO-3 reduce-scatters once and
    gathers every unit each forward and all but the root each backward, beside m
    backwards, each hiding 1/m of the bytes."""
    layout = Layout(dp=2, zero=zero, micro_batch=B)
    half = 4 * PSI / 2 / H100.network  # seconds of one reduce-scatter or all-gather
    backward = 2 / 3 * compute_by_hand(layout) / M
    gathers = M * 4 * PSI + M * 4 * L * BLOCK
    zero_3 = (4 * PSI + gathers) / 2 / H100.network
    want = {
        0: max(0.0, 2 * half - backward),
        1: 2 * half,
        2: max(0.0, half - backward) + half,
        3: M * max(0.0, zero_3 / M - backward),
    }[zero]
    assert 0 < backward < half  # partly hidden: each window shows
    assert small_plan(layout, 1).time["dp"] == pytest.approx(want, rel=1e-9)


def test_zb1_hides_dp_behind_the_last_w_alone():
    """zb1 (05c) syncs a chunk's gradients in its last W, a third of a microbatch's
    compute, not after a whole backward (2/3): beside 1F1B (fp32: the same kernels,
    the CPU-fitted H100's eager share), dp 2 x pp 2 on the network shows 1/3 more."""
    plans = {}
    for schedule in ("1f1b", "zb1"):
        layout = Layout(dp=2, pp=2, micro_batch=B, schedule=schedule)
        plans[schedule] = small_plan(layout, 1)
    assert plans["zb1"].time["compute"] == plans["1f1b"].time["compute"]
    third = compute_by_hand(layout) / M / 3
    dp = [plans[s].time["dp"] for s in ("1f1b", "zb1")]
    assert dp[0] > 0  # partly hidden under 1F1B: the difference is the whole third
    assert dp[1] - dp[0] == pytest.approx(third, rel=1e-9)


def test_zb1_at_pp_1_and_an_odd_block_at_cp_1_are_what_train_py_says():
    """train.py refuses --schedule zb1 at --pp 1 (support/train/config); 09 with its line.
    An odd --block-size splits into no zigzag chunks, but cp 1 splits nothing: both
    plan it, and 09's search finds layouts for it."""
    from support.train import config as train_config

    config = plan_lib.model_config("gpt2")
    cfg = train_config.TrainConfig(schedule="zb1")
    with pytest.raises(train_config.ConfigError) as train_says:
        train_config.check_combinations(cfg)
    with pytest.raises(plan_lib.PlanError) as plan_says:
        plan_lib.plan(config, Layout(schedule="zb1", micro_batch=8), 8, "h100", 1)
    assert str(plan_says.value) == str(train_says.value)
    train_config.check_data(train_config.TrainConfig(), 1023, lambda *a, **k: None)
    plan_lib.plan(config, Layout(micro_batch=8), 8, "h100", 1, seq_len=1023)
    assert plan_lib.search(config, 8, "h100", 1, seq_len=1023)
    with pytest.raises(train_config.ConfigError, match="--cp 2 cuts a sequence"):
        train_config.check_data(train_config.TrainConfig(cp=2), 1023, None)


def test_when_no_layout_runs_09_says_why(capsys):
    """Every layout refused (7 GPUs: 12 heads, 6 blocks, T = 1,024 and a batch of 8
    split over none): 09 prints the plainest layout's reason in one line."""
    argv = ["--model", "gpt2", "--n-layer", "6", "--gpus", "7", "--batch-size", "8"]
    with pytest.raises(SystemExit):
        plan_lib.main(argv)
    assert "batch 8 is not micro_batch 1 x dp 7 x m" in capsys.readouterr().err


def test_09_says_when_no_published_run_checks_the_gpu(capsys):
    """e(C) and the bytes a token are the H200's fit on every row: only the H200, A100
    and H100 rows have a measured run beside them (docs/planning.md)."""
    for gpu, unchecked in (("mi300x", True), ("h100", False)):
        plan_lib.main(["--model", "gpt2", "--gpus", "1", "--gpu", gpu, "--top", "1"])
        said = "no published run checks the " in capsys.readouterr().out
        assert said == unchecked, gpu


def test_logits_on_the_last_stage_and_zero_3_holds_the_root_and_two_blocks():
    """The loss's fp32 (b, T, V/tp) logits on the last stage only. ZeRO-3 (07) keeps
    the root gathered through backward and gathers a block while prefetching the next:
    the root and two blocks whole, beside the shards, at the peak."""
    p = small_plan(Layout(tp=2, pp=2, micro_batch=B))
    assert [r["memory"]["logits"] for r in p.ranks] == [0, 4 * B * T * V // 2]
    z3 = small_plan(Layout(dp=2, zero=3, micro_batch=B)).memory
    assert z3["gathered"] == 4 * ROOT + 2 * 4 * BLOCK
    assert z3["total"] == sum(n for k, n in z3.items() if k != "total")
    assert small_plan(Layout(dp=2, zero=2, micro_batch=B)).memory["gathered"] == 0


def test_every_micro_batch_that_divides_the_batch_per_dp_rank_is_tried():
    """nanoGPT's 12 sequences of 480 on 8 GPUs (60 a rank): not a power of two."""
    config = plan_lib.model_config("gpt2")
    tried = {x.micro_batch for x in plan_lib.layouts(config, 480, 8, 8) if x.dp == 8}
    assert tried == {1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30, 60}


def test_memory_is_what_the_card_reports():
    """nvidia-smi's MiB (support/gpus cites each). gpt2-large at micro-batch 30 on
    one A100 80GB needs 69.4 GiB: over 90% of the datasheet's 80e9 B (67.1 GiB), within
    90% of the 81,920 MiB the card reports (72.0 GiB): it fits. The list below is a copy
    of the table's figures, so it pins them against an accidental edit but cannot catch
    a figure copied wrong from its printout: the comments cite each source instead."""
    MiB = 2**20
    keys = ("h100", "h200", "a100", "a100-40gb", "h100-pcie", "b200", "mi300x")
    cards = [gpus.GPUS[k].memory / MiB for k in keys]
    assert cards == [81_559, 143_771, 81_920, 40_960, 81_559, 183_359, 196_288]
    large = plan_lib.model_config("gpt2-large")
    p = plan_lib.plan(large, Layout(micro_batch=30), 30, "a100", 1)
    assert 0.9 * 80e9 < p.memory["total"] <= 0.9 * 81_920 * MiB and p.fits


# ------------------------------------------------------------ published runs
# Measured training runs others published (docs/planning.md, "Checked against published
# runs", cites each): name -> (preset, shape, GPU, GPUs, layout, batch, tokens/s). No
# constant of the planner is fitted on any of them (it fits only our H200's runs), so
# each is a prediction; the llm.c and modded-nanogpt rows are the held-out set.
PUBLISHED = {
    # karpathy/llm.c scripts/run_gpt2_124M.sh: 8X A100 80GB SXM, "~300ms/iter" of
    # 524,288 tokens; -b 64 -t 1024 -z 1 (ZeRO-1), -r 0 (no recomputation).
    "llm.c 124M A100": (
        "gpt2",
        {},
        "a100",
        8,
        dict(micro_batch=64),
        512,
        524_288 / 0.3,
    ),
    # scripts/run_gpt2_350M.sh: the same node, "~820ms/iter", -b 64.
    "llm.c 350M A100": (
        "gpt2-medium",
        {},
        "a100",
        8,
        dict(micro_batch=64),
        512,
        524_288 / 0.82,
    ),
    # scripts/run_gpt2_774M.sh: the same node, "~1.7s/iter", -b 32 (2 microbatches).
    "llm.c 774M A100": (
        "gpt2-large",
        {},
        "a100",
        8,
        dict(micro_batch=32),
        512,
        524_288 / 1.7,
    ),
    # scripts/run_gpt2_1558M.sh: 8X H100 80GB SXM, "2.80s/iter" of 1,048,576; -b 16.
    "llm.c 1558M H100": (
        "gpt2-xl",
        {},
        "h100",
        8,
        dict(micro_batch=16),
        1024,
        1_048_576 / 2.8,
    ),
    # KellerJordan/modded-nanogpt records/track_1_short/2024-10-13_llmc/README.md: llm.c
    # as discussion #481 runs it (-b 64), 8x H100 HBM3, "mean per-step time was 140ms".
    "llm.c 124M H100": (
        "gpt2",
        {},
        "h100",
        8,
        dict(micro_batch=64),
        512,
        524_288 / 0.14,
    ),
    # NVIDIA/Megatron-LM README (before cde92b27ac): GPT-3 175B, tp 8 x pp 16 on 1,024
    # A100s, global batch 1,536 of 2,048, "each iteration takes around 32 seconds";
    # micro-batch 1 (examples/gpt3/train_gpt3_175b_distributed.sh), full recomputation
    # (its 138 TFLOP/s count four passes).
    "Megatron GPT-3 175B A100": (
        "gpt2",
        dict(n_layer=96, n_head=96, n_embd=12_288, block_size=2048),
        "a100",
        1024,
        dict(tp=8, pp=16, micro_batch=1, recompute="full"),
        1536,
        1536 * 2048 / 32,
    ),
    # mosaicml/llm-foundry scripts/train/benchmarking/README.md, "A100 80GB" table: the
    # row "125m | 2048 | 8 | a100_80gb | ... | 32 | 2 | 512 | 553 | 1133901 | ...":
    # FSDP FULL_SHARD (ZeRO-3), activation checkpointing False; mpt-125m.yaml's shape.
    "MPT-125m A100": (
        "gpt2",
        dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50_368, block_size=2048),
        "a100",
        8,
        dict(micro_batch=32, zero=3),
        512,
        1_133_901,
    ),
    # The same file, "H100 80GB BF16" table: "1b | 2048 | 8 | h100_80gb | ... | 14 | 1 |
    # 112 | 177 | 363645 | ...": FULL_SHARD, no checkpointing; mpt-1b.yaml's shape.
    "MPT-1b H100": (
        "gpt2",
        dict(n_layer=24, n_head=16, n_embd=2048, vocab_size=50_368, block_size=2048),
        "h100",
        8,
        dict(micro_batch=14, zero=3),
        112,
        363_645,
    ),
}
# Each MPT row's NumParams column: 02's count of that GPT-2 shape, so the model is ours.
MPT_PARAMS = {"MPT-125m A100": 125_311_488, "MPT-1b H100": 1_315_950_592}


def published_plan(name):
    preset, shape, gpu, n, sizes, batch, _ = PUBLISHED[name]
    config = plan_lib.model_config(preset, **shape)
    dp = n // sizes.get("tp", 1) // sizes.get("pp", 1)
    zero = 1 if dp > 1 and sizes.get("pp", 1) == 1 else 0  # llm.c's -z 1
    layout = Layout(dp=dp, **{"zero": zero, **sizes})
    return plan_lib.plan(config, layout, batch, gpu, n, trainer=False)


def test_the_published_runs_table_is_what_the_planner_predicts():
    """docs/planning.md's table: each row's prediction and ratio (predicted / measured
    tokens/s) are the planner's today, so the page cannot rot; at least six runs, two
    GPU kinds, three model sizes. The ratios are reported, not bounded: the page says
    why those outside 0.85-1.15 are."""
    page = (Path(__file__).resolve().parent.parent / "docs/planning.md").read_text()
    rows = {}
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in PUBLISHED:
            rows[cells[0]] = cells
    assert set(rows) == set(PUBLISHED), sorted(rows)
    for name, cells in rows.items():
        measured = PUBLISHED[name][-1]
        predicted = published_plan(name).tokens_per_s
        assert f"{measured:,.0f}" in cells, (name, cells)
        assert f"{predicted:,.0f}" in cells, (name, predicted, cells)
        assert f"{predicted / measured:.2f}" in cells, (name, predicted / measured)
    assert len({PUBLISHED[n][2] for n in rows}) >= 2
    assert len({(PUBLISHED[n][0], str(PUBLISHED[n][1])) for n in rows}) >= 3


def test_the_mpt_rows_are_gpt2_shaped():
    """llm-foundry's NumParams for each MPT row is 02's count of the shape planned."""
    for name, want in MPT_PARAMS.items():
        preset, shape = PUBLISHED[name][:2]
        assert model_lib.count_params(plan_lib.model_config(preset, **shape)) == want


# ------------------------------------------------------------ docs/planning.md's samples
# The commands whose printouts docs/planning.md quotes, each in a plain ``` block after it,
# in the page's order. The planner is arithmetic, so each reruns in seconds, in this
# process. Every quoted line must be a line the command prints now (spaces collapsed;
# "..." marks lines left out), and each `backticked` part of the recipes table's
# "predicted by 09" column must be in what `train.py --config recipes/NAME --plan`
# prints: a change to 09 that moves a quoted number fails here until the page is pasted
# again.
PLANNING_SAMPLES = [
    "python 09_plan.py --model gpt2-xl --gpus 16 --gpus-per-node 8 --gpu h100 "
    "--tokens 10e9 --price 2.5",
    "python 09_plan.py --model gpt2 --n-layer 24 --n-head 24 --n-embd 2304 "
    "--vocab-size 51200 --block-size 2048 --gpus 8 --batch-size 512 --top 2",
    "python train.py --config recipes/gpt2-124m-8gpu.toml --plan",
]
REPO = Path(__file__).resolve().parent.parent
PLANNING = REPO / "docs/planning.md"


def printed(command: str, capsys) -> list[str]:
    """What `python FILE ARGS...` prints, run in this process; lines, spaces collapsed."""
    import train

    _, file, *argv = command.split()
    argv = [str(REPO / a) if a.startswith("recipes/") else a for a in argv]
    capsys.readouterr()
    {"09_plan.py": plan_lib.main, "train.py": train.main}[file](argv)
    return [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]


def quoted_blocks(page: str) -> list[list[str]]:
    """The page's plain ``` blocks (no language named): their lines, spaces collapsed."""
    blocks, block, fenced = [], None, False
    for line in page.splitlines():
        fence = line.strip()
        if fence.startswith("```"):
            if fenced and block is not None:  # the end of a plain block
                blocks.append(block)
            block = [] if not fenced and fence == "```" else None
            fenced = not fenced
        elif block is not None:
            block.append(" ".join(line.split()))
    return blocks


def test_planning_md_quotes_what_the_commands_print(capsys):
    """Each quoted printout of docs/planning.md is what its command prints today."""
    page = PLANNING.read_text()
    blocks = quoted_blocks(page)
    assert len(blocks) == len(PLANNING_SAMPLES), blocks
    for command, block in zip(PLANNING_SAMPLES, blocks):
        assert command in page, f"docs/planning.md no longer shows {command!r}"
        out = printed(command, capsys)
        for line in (x for x in block if x and x != "..."):
            assert line in out, f"{command}: paste it again; not printed now: {line!r}"


def test_planning_md_recipes_table_is_what_plan_prints(capsys):
    """The recipes table's predictions are what --plan prints for each recipe today."""
    page = PLANNING.read_text()
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in page.splitlines()]
    rows = [r for r in cells if r and r[0].endswith(".toml`")]
    assert len(rows) >= 6, rows
    for name, _, _, predicted, _ in rows:
        command = f"python train.py --config recipes/{name.strip('`')} --plan"
        out = " ".join(printed(command, capsys))
        quoted = re.findall(r"`([^`]+)`", predicted)
        assert quoted, (name, predicted)
        for part in quoted:
            assert part in out, f"{name}: not printed now: {part!r} (in: {out})"


# ------------------------------------------------------------ any GPT shape (issue 42)
# Megatron-LM's 1.7B (2104.04473, Table 1: 24 layers, 24 heads, hidden 2,304), with
# Megatron's vocabulary padded to 51,200 and T = 2,048: no preset of 02 has it.
MEGATRON_1_7B = dict(
    n_layer=24, n_head=24, n_embd=2304, vocab_size=51200, block_size=2048
)


def shape_flags(shape: dict) -> list[str]:
    """{"n_layer": 24, ...} -> ["--n-layer", "24", ...]: 09's and train.py's flags."""
    return [a for k, v in shape.items() for a in ("--" + k.replace("_", "-"), str(v))]


def test_09_plans_a_custom_shape_with_the_parameters_of_its_model(capsys, monkeypatch):
    """09's shape flags over --model gpt2 build Megatron's 1.7B and plan it: the shape
    and the parameter count it prints, and its plan's weights (4 bytes each at ZeRO 0,
    tp 1, pp 1), are those of 02's GPT built from the five sizes by hand:
    12·L·C² + 13·L·C + (V + T + 2)·C = 1,652,230,656."""
    searched = []
    search = plan_lib.search

    def spy(config, *args, **kwargs):
        searched.append(config)
        return search(config, *args, **kwargs)

    monkeypatch.setattr(plan_lib, "search", spy)
    argv = ["--model", "gpt2", "--gpus", "8", "--batch-size", "8", "--top", "1"]
    plan_lib.main(argv + shape_flags(MEGATRON_1_7B))
    out = capsys.readouterr().out
    L = MEGATRON_1_7B["n_layer"]
    C = MEGATRON_1_7B["n_embd"]
    V = MEGATRON_1_7B["vocab_size"]
    T = MEGATRON_1_7B["block_size"]
    with torch.device("meta"):  # shapes, no memory
        model = model_lib.GPT(model_lib.GPTConfig(**MEGATRON_1_7B))
    psi = model.num_params()
    assert psi == 12 * L * C**2 + 13 * L * C + (V + T + 2) * C == 1_652_230_656
    shape = ", ".join(f"{k} {v}" for k, v in MEGATRON_1_7B.items())
    assert f"model: {shape}\n" in out and f" {psi:,} parameters" in out
    assert "on 8 x h100 (8 a node), batch 8 x 2048, bf16" in out
    (config,) = searched
    p = plan_lib.plan(config, Layout(micro_batch=1), 1, "h100", 1)
    assert p.memory["weights"] == p.memory["grads"] == 4 * psi


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--n-embd", "1000", "--n-head", "24"], "--n-embd 1000 does not split into --n-head 24 heads"),
        (["--n-head", "7"], "--n-embd 768 (--model gpt2's) does not split into --n-head 7 heads"),
        (["--n-layer", "0"], "--n-layer 0: a size, a positive integer"),
        (["--vocab-size", "-1"], "--vocab-size -1: a size, a positive integer"),
        (["--block-size", "0"], "--block-size 0: a size, a positive integer"),
        (["--model", "gpt3"], "--model gpt3: 02 has tiny, small, gpt2,"),
    ],
    ids=["width", "preset-width", "layers", "vocab", "context", "preset"],
)  # fmt: skip
def test_09_refuses_a_bad_shape_in_one_line_naming_the_flags(argv, message, capsys):
    """02's rules (positive sizes, whole heads: C a multiple of nh), each one line that
    names the flags; a size the flags leave to the preset says so."""
    with pytest.raises(SystemExit) as stop:
        plan_lib.main(["--model", "gpt2", "--gpus", "8", *argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(f"09_plan.py: error: {message}"), err
    assert err.count("\n") == 1, err


def test_09_searches_only_the_tps_that_divide_a_custom_shapes_heads():
    """04 gives each TP rank whole heads: 6 heads of 128 split over tp 1, 2 (and 3, 6
    with more GPUs), never 4 or 8; the width alone (768) would allow every tp."""
    config = plan_lib.model_config("gpt2", n_head=6)
    assert {lay.tp for lay in plan_lib.layouts(config, 64, 8, 8)} == {1, 2}
    with pytest.raises(plan_lib.PlanError, match="n_head=6 is not divisible by tp=4"):
        plan_lib.plan(config, Layout(dp=2, tp=4, micro_batch=1), 2, "h100", 8)
