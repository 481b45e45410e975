"""07_zero.py: ZeRO stages 1, 2 and 3 proven equal to one process, to PyTorch's own versions, and
counted against the paper's formulas (Rajbhandari et al. 2019, arXiv 1910.02054).

The worked example: N ranks each take ROWS sequences per step of a 2-block GPT whose sizes are
odd on purpose (C = 33, V = 255), so the flat buffers need padding. With Ψ parameters in fp32 and
AdamW, one rank holds after backward (bytes):
    DP 16Ψ,   ZeRO-1 8Ψ + 8Ψ/N,   ZeRO-2 4Ψ + 12Ψ/N,   ZeRO-3 16Ψ/N (+ the gathered units),
and sends 2(N-1)/N·Ψ words per step (ZeRO-3: one more all-gather, of every block). Padding makes
each flat buffer a multiple of N (Ψ_pad ≥ Ψ), and AdamW keeps a 4-byte step per tensor it steps.

Every stage runs train.py's recipe: AdamW with weight decay on matrices only (two param groups),
the tied wte/lm_head matrix, three steps. The single process runs here, in the test; the ranks
in spawned gloo worlds, one per world size, with every case inside it.
"""

import contextlib
import functools
import gc
import importlib
import io
import math
import os
import weakref

import pytest
import torch
import torch.distributed as dist

from support.ddp import gloo_exit
from tests.distributed import case_results, run_cases, run_ranks
from tests.test_readme import run_output

zero_lib = importlib.import_module("07_zero")
model_lib = importlib.import_module("02_model")

SEED, STEPS, ROWS, T, LR, MICRO = 1234, 3, 2, 16, 1e-3, 2
WORLD_SIZES = [2, 4]
STAGES = [0, 1, 2, 3]
CONFIG = model_lib.GPTConfig.from_preset(
    "tiny", n_layer=2, n_head=3, n_embd=33, vocab_size=255, block_size=T
)
# Tolerances, measured on this model (3 AdamW steps, lr 1e-3):
# - gradients: a sum over the batch in one process, per-rank sums then a reduce-scatter here:
#   fp32 rounding of values up to ~0.3, measured at most 4.5e-8 on an AMD EPYC and 1.9e-7 on
#   an Intel Xeon (other matmul kernels, other rounding). 1e-6 absolute + 1e-5 relative; a
#   wrong / N or a rank's data missing is off by the gradient itself (~1e-2).
# - weights after AdamW: its update m/sqrt(v) ~ ±1 per element turns a rounding difference in a
#   gradient near 0 into a fraction of lr; measured at most 1.2e-6 (N = 2), 7.9e-7 (N = 4).
#   5e-6 absolute; without one rank's data they are 6e-3 away (test_the_comparison_can_fail).
# - against torch's own versions: bit for bit with N = 2 (a sum of two numbers has one order,
#   and x/2 is exact); with N = 4 the sums run in another order: measured 7.1e-7, PARAM_TOL.
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)
PARAM_TOL = dict(rtol=1e-5, atol=5e-6)
EXACT = dict(rtol=0, atol=0)


def build(seed: int = SEED):
    torch.manual_seed(seed)
    return model_lib.GPT(CONFIG)


def param_groups(model) -> list:
    """train.py's: weight decay on matrices only."""
    ps = list(model.parameters())  # the tied wte/lm_head matrix once
    return [
        {"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0},
    ]


def batch(step: int, dp_rank: int, micro: int = 0):
    g = torch.Generator().manual_seed((step * 100 + dp_rank) * 100 + micro)
    rows = torch.randint(0, CONFIG.vocab_size, (ROWS, T + 1), generator=g)  # (ROWS, T+1)
    return rows[:, :-1], rows[:, 1:]  # (ROWS, T) each


def names(model) -> dict:
    return {p: n for n, p in model.named_parameters()}  # the tied matrix: transformer.wte.weight


def snapshot(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def full_weights(model, wrapper) -> dict:
    with wrapper.gathered() if hasattr(wrapper, "gathered") else contextlib.nullcontext():
        return snapshot(model)


def make(stage: int, seed: int = SEED):
    model = build(seed)
    wrapper, opt = zero_lib.zero_data_parallel(
        model, stage, param_groups(model), torch.optim.AdamW, lr=LR
    )
    return model, wrapper, opt


def grad_pieces(model, opt) -> list:
    """(name, offset, piece): this rank's averaged gradient of the parameter's
    view(-1)[offset : offset + len(piece)], from ZeroOptimizer.grad_pieces() (ZeRO-1 reduces
    there); stage 0: every whole p.grad. Cloned: the pieces are views the next step overwrites."""
    n = names(model)
    if not isinstance(opt, zero_lib.ZeroOptimizer):
        return [(n[p], 0, p.grad.reshape(-1).clone()) for p in model.parameters()]
    return [(n[p], offset, piece.clone()) for p, offset, piece in opt.grad_pieces()]


@functools.cache
def reference(world: int, micro: int = 1, clip: float = 0.0, offset: int = 0) -> dict:
    """One process, the concatenated batch of every rank: losses, gradients per step, weights.
    offset shifts the steps' batches (another DP group's data)."""
    model = build()
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    out = {"loss": [], "grads": [], "norm": []}
    for step in range(STEPS):
        pieces = [batch(step + offset, r, m) for r in range(world) for m in range(micro)]
        x, y = torch.cat([x for x, _ in pieces]), torch.cat([y for _, y in pieces])
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        out["loss"].append(loss.item())
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        if clip:
            out["norm"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
    with torch.no_grad():
        out["eval"] = model(*batch(99, 0))[1].item()
    out["weights"] = snapshot(model)
    return out


# ---------------------------------------------------------------------------------------------
# What every rank runs
# ---------------------------------------------------------------------------------------------
class CollectiveLog:
    """Records (op, bytes of the full buffer) for every collective this rank issues."""

    OPS = {"all_gather_single": 0, "reduce_scatter_single": 1, "all_reduce": 0, "broadcast": 0}

    def __init__(self):
        self.log, self.real = [], {}

    def __enter__(self):
        for op, arg in self.OPS.items():
            real = self.real[op] = getattr(dist, op)

            def fake(*args, _real=real, _op=op, _arg=arg, **kwargs):
                self.log.append((_op, zero_lib.nbytes(args[_arg])))
                return _real(*args, **kwargs)

            setattr(dist, op, fake)
        return self

    def __exit__(self, *exc):
        for op, real in self.real.items():
            setattr(dist, op, real)


def case_stages(rank, world):
    """Every stage: STEPS AdamW steps. Per step: this rank's loss, its gradient pieces and the
    collectives of forward + backward and of the optimizer step. Then an evaluation under
    no_grad, and the full weights."""
    out = {}
    for stage in STAGES:
        res = {"loss": [], "pieces": [], "log_backward": [], "log_step": []}
        model, wrapper, opt = make(stage)
        # the collectives NCCL gets: on gloo 07's comm all-reduces in place instead of
        # reduce-scattering (support/ddp/gloo_exit.py says why; every other case runs that path)
        if stage > 0:
            opt.comm.gloo = False
        for step in range(STEPS):
            with CollectiveLog() as log:
                opt.zero_grad(set_to_none=True)
                _, loss = wrapper(*batch(step, rank))
                loss.backward()
                n = len(log.log)  # then the gradient pieces (ZeRO-1 reduces here) and the step
                res["pieces"].append(grad_pieces(model, opt))
                opt.step()
            res["log_backward"].append(log.log[:n])
            res["log_step"].append(log.log[n:])
            res["loss"].append(loss.item())
        with torch.no_grad():
            res["eval"] = wrapper(*batch(99, 0))[1].item()
        res["weights"] = full_weights(model, wrapper)
        res["stats"] = dict(getattr(opt, "stats", {}))
        if stage == 3:
            res["gathered"] = gathered_during_forward(model, wrapper, *batch(0, rank))
        out[stage] = res
    return out


def live_bytes() -> int:
    """Bytes of every tensor storage alive in this process, each once, found by gc (not by 07),
    and the gradients of those tensors (autograd's p.grad has no Python object until read)."""
    gc.collect()
    tensors = [t for t in gc.get_objects() if issubclass(type(t), torch.Tensor)]
    tensors += [t.grad for t in tensors if t.is_leaf and t.grad is not None]
    return sum(
        {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values()
    )


def case_memory(rank, world):
    """Every stage: the bytes of the tensors alive after the second backward (AdamW's state
    exists since the first step), the batch and the loss gone, less those alive before the
    model was built. And 07's own memory_per_rank at that moment."""
    out = {}
    for stage in STAGES:
        before = live_bytes()
        model, wrapper, opt = make(stage)
        for step in range(2):
            opt.zero_grad(set_to_none=True)
            loss = wrapper(*batch(step, rank))[1]
            loss.backward()
            if step == 0:
                opt.step()
        del loss
        out[stage] = {"alive": live_bytes() - before, "measured": zero_lib.memory_per_rank(model, opt)}
        del model, wrapper, opt
    return out


def gathered_during_forward(model, wrapper, x, y) -> list:
    """ZeRO-3: bytes of the full weights in memory while each block runs its forward."""
    seen = []

    def count(*_):
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage() for p in model.parameters()}
        seen.append(sum(s.nbytes() for s in storages.values()))

    handles = [b.register_forward_pre_hook(count) for b in model.transformer.h]  # after ours
    wrapper(x, y)[1].backward()
    for h in handles:
        h.remove()
    return seen


def case_torch(rank, world):
    """torch's versions on the same model, groups and data: ZeroRedundancyOptimizer with DDP
    (ZeRO-1/2's update), FSDP2's fully_shard on every block, then the root (ZeRO-3)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    out = {}
    model = build()
    dp = torch.nn.parallel.DistributedDataParallel(model)
    opt = ZeroRedundancyOptimizer(param_groups(model), torch.optim.AdamW, lr=LR)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        dp(*batch(step, rank))[1].backward()
        opt.step()
    out["zero_redundancy"] = snapshot(model)
    model = build()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        model(*batch(step, rank))[1].backward()
        opt.step()
    out["fsdp2"] = {n: p.full_tensor() for n, p in model.named_parameters()}
    return out


def case_no_sync(rank, world):
    """MICRO microbatches per step, all but the last backward under no_sync()."""
    out = {}
    for stage in STAGES[1:]:
        model, wrapper, opt = make(stage)
        calls = []
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            for m in range(MICRO):
                with wrapper.no_sync() if m < MICRO - 1 else contextlib.nullcontext():
                    _, loss = wrapper(*batch(step, rank, m))
                    (loss / MICRO).backward()  # the mean over microbatches: one big batch
                calls.append(opt.stats["reduce_scatter_calls"])
            opt.step()
        out[stage] = {"weights": full_weights(model, wrapper), "calls": calls}
    return out


def case_clip(rank, world):
    """Clipping on the shards, as train.py does it: the global norm from every rank's
    grad_pieces(), then the pieces scaled in place, for a max norm below the actual one (so the
    clip changes the update). Only views of the shards' gradients can carry the scaling into
    step(); and the pieces must cover exactly the shards' real elements (not the padding)."""
    out = {}
    for stage in STAGES[1:]:
        model, wrapper, opt = make(stage)
        norms, views, covered = [], [], []
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            wrapper(*batch(step, rank))[1].backward()
            pieces = [piece for _, _, piece in opt.grad_pieces()]
            shard_grads = {f.shard.grad.untyped_storage().data_ptr() for f in opt.flats}
            views.append(all(g.untyped_storage().data_ptr() in shard_grads for g in pieces))
            real = sum(max(0, min(f.S, sum(f.numels) - f.lo)) for f in opt.flats)  # no padding
            covered.append((sum(len(g) for g in pieces), real))
            squares = sum(g.pow(2).sum() for g in pieces)  # every element once over the ranks
            dist.all_reduce(squares)
            norm = squares.sqrt()
            for g in pieces:
                g.mul_(torch.clamp(CLIP / (norm + 1e-6), max=1.0))  # as clip_grad_norm_
            norms.append(norm.item())
            opt.step()
        weights = full_weights(model, wrapper)
        out[stage] = {"weights": weights, "norms": norms, "views": views, "covered": covered}
    return out


CLIP = 0.5  # below this model's gradient norm (1 to 1.6), so clipping acts every step


def case_skipped_step(rank, world):
    """A step a loss scaler skips (fp16 overflow): backward, grad_pieces() (where the scaler finds
    the inf), zero_grad() and no step(). The STEPS normal steps after it must equal a run that
    never had it."""
    out = {}
    for stage in STAGES[1:]:
        model, wrapper, opt = make(stage)
        wrapper(*batch(0, rank, micro=1))[1].backward()  # another batch: its gradient must go
        opt.grad_pieces()
        opt.zero_grad(set_to_none=True)
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            wrapper(*batch(step, rank))[1].backward()
            opt.step()
        out[stage] = {"weights": full_weights(model, wrapper), "stats": dict(opt.stats)}
    return out


def case_checkpoint(rank, world):
    """Train 2 steps, save this rank's shard, train 1 more. A fresh model (another seed) that
    loads the shard must take that last step bit for bit alike. A shard of another stage or
    another rank is refused, in one line."""
    out, saved = {}, {}
    for stage in STAGES[1:]:
        model, wrapper, opt = make(stage)
        for step in range(STEPS):
            if step == 2:
                opt.param_groups[0]["lr"] = 3e-3  # a changed hyperparameter must come back
                buf = io.BytesIO()
                torch.save(opt.state_dict(), buf)
                saved[stage] = buf.getvalue()
            opt.zero_grad(set_to_none=True)
            wrapper(*batch(step, rank))[1].backward()
            opt.step()
        fresh, fresh_wrapper, fresh_opt = make(stage, seed=SEED + 1)
        fresh_opt.load_state_dict(torch.load(io.BytesIO(saved[stage]), weights_only=True))
        lr = fresh_opt.param_groups[0]["lr"]
        fresh_opt.zero_grad(set_to_none=True)
        fresh_wrapper(*batch(2, rank))[1].backward()
        fresh_opt.step()
        a, b = full_weights(model, wrapper), full_weights(fresh, fresh_wrapper)
        out[stage] = {"a": a, "b": b, "lr": lr}
    errors = {}
    _, _, opt3 = make(3)
    shard2 = torch.load(io.BytesIO(saved[2]), weights_only=True)
    other_rank = {**shard2, "layout": {**shard2["layout"], "dp_rank": (rank + 1) % world}}
    for name, shard in [("stage", shard2), ("rank", other_rank)]:
        target = opt3 if name == "stage" else make(2)[2]
        try:
            target.load_state_dict(shard)
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    out["errors"] = errors
    return out


def case_pipeline_chunks(rank, world):
    """Two pipeline chunks on one rank, one ZeroOptimizer over both chunks' units (as a pipeline
    builds it: zero_data_parallel takes one module): ZeRO-2 wraps each chunk, ZeRO-3 refuses."""
    out = {}
    for stage in (2, 3):
        chunks = [build(), build()]
        params = [p for c in chunks for p in c.parameters()]
        units = [u for c in chunks for u in zero_lib.zero_units(c)]
        opt = zero_lib.ZeroOptimizer(params, torch.optim.AdamW, units=units, stage=stage, lr=LR)
        try:
            wrappers = [zero_lib.ZeroDataParallel(c, opt) for c in chunks]
            out[stage] = [len(w.flats) for w in wrappers]
        except ValueError as e:
            out[stage] = str(e)
    return out


OFFSET = 50  # DP group 1's batches: steps 50, 51, 52 (group 0's: 0, 1, 2)


def case_subgroups(rank, world):
    """4 ranks as a 2 (dp) x 2 (tp) grid: DP groups {0, 2} and {1, 3}, each training stages
    1-3 on its own data. Returns this rank's weights per stage."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # same order on every rank
    g = rank % 2
    dp_rank = rank // 2
    out = {"group": g}
    for stage in STAGES[1:]:
        model = build()
        args = (model, stage, param_groups(model), torch.optim.AdamW, groups[g])
        wrapper, opt = zero_lib.zero_data_parallel(*args, lr=LR)
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            wrapper(*batch(step + OFFSET * g, dp_rank))[1].backward()
            opt.step()
        out[stage] = full_weights(model, wrapper)
    return out


def case_new_lr(rank, world):
    """Stages 1-3: a new LR set on the wrapper's param_groups, as a scheduler sets it: lr 0 on
    the vectors' group, 10x on the matrices'. After one step: the inner (shard) optimizer's
    groups, and which weights moved."""
    out = {}
    for stage in STAGES[1:]:
        model, wrapper, opt = make(stage)
        before = full_weights(model, wrapper)
        opt.param_groups[0]["lr"] = 10 * LR  # the matrices (weight decay 0.1)
        opt.param_groups[1]["lr"] = 0.0  # the vectors: AdamW with lr 0 moves nothing
        opt.zero_grad(set_to_none=True)
        wrapper(*batch(0, rank))[1].backward()
        opt.step()
        after = full_weights(model, wrapper)
        moved = {n: not torch.equal(after[n], before[n]) for n in after}
        out[stage] = {"inner_lr": [g["lr"] for g in opt.local.param_groups], "moved": moved}
    return out


def case_backward_peak(rank, world):
    """ZeRO-3 at in_flight 1 and 2, measured inside backward: as each block's backward starts
    (a hook on its output's gradient, after 07's own, which gathers it), the bytes of full
    weights in memory, the reduce-scatters launched so far in this backward, and the bytes of
    full (N·S) gradient buffers alive (a flat gradient is freed once its reduce-scatter is
    done)."""
    return {k: backward_peak(rank, k) for k in (1, 2)}


def backward_peak(rank, in_flight: int) -> list:
    model, wrapper, opt = make(3)
    wrapper.in_flight = in_flight
    seen = []

    def record(block):
        weights = {p.untyped_storage().data_ptr(): p.untyped_storage() for p in model.parameters()}
        grads = [f.grad.untyped_storage() for f in opt.flats if f.grad is not None]
        seen.append(
            {
                "block": block,
                "weights": sum(s.nbytes() for s in weights.values()),
                "launched": opt.stats["reduce_scatter_calls"] - launched_before,
                "grad_buffers": sum({s.data_ptr(): s.nbytes() for s in grads}.values()),
            }
        )

    def on_output(i):
        def hook(module, args, output):
            output.register_hook(lambda grad: record(f"h.{i}"))

        return hook

    for i, block in enumerate(model.transformer.h):
        block.register_forward_hook(on_output(i))  # after 07's: its gradient hook runs first
    launched_before = opt.stats["reduce_scatter_calls"]
    wrapper(*batch(0, rank))[1].backward()
    return seen


class Counted:
    """A reduce-scatter's handle that takes itself off `in_flight` when first waited."""

    def __init__(self, work, in_flight: list):
        self.work = work
        self.in_flight = in_flight
        self.waited = False

    def wait(self):
        self.work.wait()
        if not self.waited:
            self.in_flight[0] -= 1
        self.waited = True
        return True


def case_in_flight(rank, world):
    """ZeRO-2 and 3 at in_flight K = 1, 2 (not set: the default) and 3, one backward each:
    at each reduce-scatter's launch, how many are in flight, it included (launched and not
    yet waited: counted by wrapping 07's comm, not read from 07's own list), whether
    backward was still running, and then the gradient pieces."""
    out = {}
    for stage in (2, 3):
        for k in (1, 2, 3):
            model, wrapper, opt = make(stage)
            if k != 2:  # K = 2 is left to 07's default, what train.py's wrappers get.
                wrapper.in_flight = k
            in_flight = [0]  # launched, not yet waited
            seen = []
            real = opt.comm.reduce_scatter

            def reduce_scatter(out, full, real=real, in_flight=in_flight, seen=seen, w=wrapper):
                work = real(out, full)
                in_flight[0] += 1
                seen.append((in_flight[0], w._in_backward))
                return Counted(work, in_flight)

            opt.comm.reduce_scatter = reduce_scatter
            wrapper(*batch(0, rank))[1].backward()
            out[stage, k] = {"seen": seen, "left": in_flight[0]}
            out[stage, k]["pieces"] = grad_pieces(model, opt)
    return out


CASES = {
    "stages": case_stages,
    "memory": case_memory,
    "torch": case_torch,
    "no_sync": case_no_sync,
    "clip": case_clip,
    "skipped_step": case_skipped_step,
    "checkpoint": case_checkpoint,
    "pipeline_chunks": case_pipeline_chunks,
    "subgroups": case_subgroups,
    "new_lr": case_new_lr,
    "backward_peak": case_backward_peak,
    "in_flight": case_in_flight,
}


@functools.cache
def world_results(world: int) -> list:
    cases = {k: c for k, c in CASES.items() if k != "subgroups" or world == 4}  # needs 2 x 2
    # 300 s: on 2 cores shared with other work (load ~20) a world took over 150 s (2026-11-27)
    return run_ranks(run_cases, world, cases, timeout=300)


def results(world: int, case: str) -> list:
    return case_results(world_results(world), case)


def assert_states_close(actual: dict, expected: dict, **tol):
    assert actual.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(actual[k], expected[k], **tol, msg=lambda m, k=k: f"{k}: {m}")


# ---------------------------------------------------------------------------------------------
# The expected numbers, from parameter counts and N alone
# ---------------------------------------------------------------------------------------------
def flat_sizes(world: int) -> list:
    """(unit, numel, padded numel) per flat buffer, in backward order: the blocks last first,
    then the root (embeddings, ln_f, the tied head); in each, matrices then vectors."""
    model = build()
    blocks = list(model.transformer.h)
    in_blocks = {p for b in blocks for p in b.parameters()}
    root = [p for p in model.parameters() if p not in in_blocks]
    out = []
    for unit, ps in [*((f"h.{i}", list(blocks[i].parameters())) for i in (1, 0)), ("root", root)]:
        matrices = sum(p.numel() for p in ps if p.dim() >= 2)
        for numel in (matrices, sum(p.numel() for p in ps if p.dim() < 2)):
            out.append((unit, numel, math.ceil(numel / world) * world))
    return out


PSI = build().num_params()  # 36,003 (wte and lm_head one matrix)


def test_the_worked_example_needs_padding():
    """Ψ counted by hand, and the flat buffers not all multiples of 2 or 4 (padding is tested)."""
    C, V, L = 33, 255, 2
    block = 2 * C + 3 * C * C + 3 * C + C * C + C + 2 * C + 4 * C * C + 4 * C + 4 * C * C + C
    assert PSI == V * C + T * C + L * block + 2 * C == sum(n for _, n, _ in flat_sizes(2))
    for world in WORLD_SIZES:
        assert any(n % world for _, n, _ in flat_sizes(world)), "no flat buffer needs padding"


# ---------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_equals_one_process(world, stage):
    """Loss (the ranks' mean), every gradient reassembled from the ranks' shards (each element
    exactly once), every weight after three AdamW steps, and an evaluation under no_grad."""
    ref = reference(world)
    per_rank = [res[stage] for res in results(world, "stages")]
    for step in range(STEPS):
        mean_loss = sum(res["loss"][step] for res in per_rank) / world
        assert mean_loss == pytest.approx(ref["loss"][step], rel=1e-6, abs=0)
        grads = {n: torch.zeros(g.numel()) for n, g in ref["grads"][step].items()}
        covered = {n: torch.zeros(g.numel()) for n, g in ref["grads"][step].items()}
        for res in per_rank if stage > 0 else per_rank[:1]:  # DP: every rank holds all of it
            for name, offset, piece in res["pieces"][step]:
                grads[name][offset : offset + len(piece)] = piece
                covered[name][offset : offset + len(piece)] += 1
        for name, g in ref["grads"][step].items():
            assert torch.equal(covered[name], torch.ones_like(covered[name])), name
            torch.testing.assert_close(grads[name].view_as(g), g, **GRAD_TOL, msg=name)
    for res in per_rank:
        assert_states_close(res["weights"], ref["weights"], **PARAM_TOL)
        assert res["eval"] == pytest.approx(ref["eval"], rel=1e-5)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_equals_torch_zero_redundancy_optimizer_or_fsdp2(world, stage):
    """ZeRO-1 and 2 update as DDP + torch's ZeroRedundancyOptimizer; ZeRO-3 as FSDP2."""
    for ours, torch_res in zip(results(world, "stages"), results(world, "torch")):
        theirs = torch_res["fsdp2" if stage == 3 else "zero_redundancy"]
        assert_states_close(ours[stage]["weights"], theirs, **(EXACT if world == 2 else PARAM_TOL))


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_the_comparison_can_fail(world):
    """Without rank 1's data, or with the gradient summed but not divided by N, the same checks
    fail: they see every rank's share and the mean."""
    ours = results(world, "stages")[0][2]
    without_rank1 = reference(world - 1)  # ranks 0 .. N-2: rank N-1's rows missing
    with pytest.raises(AssertionError):
        assert_states_close(ours["weights"], without_rank1["weights"], **PARAM_TOL)
    name, offset, piece = ours["pieces"][0][0]
    expected = reference(world)["grads"][0][name].reshape(-1)[offset : offset + len(piece)]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(piece * world, expected, **GRAD_TOL)  # SUM without / N


def rss_mb() -> float:
    """This process's resident memory (Linux). Buffers this big are mmap'ed: freed, they leave."""
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _kept_handles_hold_no_memory(rank, world):
    """ZeRO-2 on gloo around one 64 MB matrix (SGD, lr 0: no state): the resident memory after
    each of 2 full steps, 4 skipped ones (zero_grad and backward, no step(): what the fp16 loss
    scaler does on an overflow) and 2 full ones, above the memory before the first backward."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4096, 4096, bias=False))  # 16M weights: 64 MB
    model, opt = zero_lib.zero_data_parallel(module, 2, module.parameters(), torch.optim.SGD, lr=0.0)
    x = torch.randn(4, 4096)
    with torch.no_grad():
        model(x)
    gc.collect()
    base = rss_mb()

    def iteration(step: bool) -> float:
        opt.zero_grad()
        model(x).sum().backward()
        if step:
            opt.step()
        gc.collect()
        return rss_mb() - base

    return [iteration(step) for step in (True, True, False, False, False, False, True, True)]


def test_kept_collective_handles_hold_no_memory():
    """On gloo 07 keeps every waited handle a while (support/ddp/gloo_exit.py: an exit-time
    abort on torch 2.13.0, tests/ddp_exit_job.py), and a kept handle must not keep its
    buffers: gloo's reduce-scatter handle holds a copy of the whole flat gradient (64 MB
    here), so there 07's comm all-reduces in place and empties what it hands over. Each
    rank must hold its 32 MB gradient shard above the memory before the first backward,
    and nothing more (16 MB of slack): kept reduce-scatter handles held 64 MB each, two
    steps' worth (+128 MB), and, rotated in step(), grew 64 MB a skipped step."""
    for growth in run_ranks(_kept_handles_hold_no_memory, 2, timeout=120):
        assert max(growth) < 32 + 16, f"MB above the start, 2 full, 4 skipped, 2 full: {growth}"


def _dropped_wrappers(rank, world) -> dict:
    """stage -> what is left after one ZeRO step, `del wrapper, opt` and gc.collect(): whether
    wrapper and optimizer were freed, the collectives a forward + backward of the bare module
    issue, the names of the parameters left without .grad, and how far those gradients are
    from plain autograd's on a copy. ZeRO-3's weights are copied out of its buffers first
    (gathered()): a freed ZeRO-3 wrapper leaves its module's buffers empty."""
    out = {}
    for stage in (2, 3):
        model, wrapper, opt = make(stage)
        x, y = batch(0, rank)
        wrapper(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
        with wrapper.gathered():
            for p in model.parameters():
                p.data = p.data.clone()  # the module's own weights, outside the flat buffers
        refs = [weakref.ref(wrapper), weakref.ref(opt)]
        del wrapper, opt
        gc.collect()
        kept = len(gloo_exit._KEPT)  # its last waited handles outlive it: the exit workaround
        copied = build()  # the same weights, no hooks (a deepcopy would copy leftover ones)
        copied.load_state_dict(model.state_dict())
        with CollectiveLog() as log:
            with torch.no_grad():
                model(x, y)  # ZeRO-3's forward pre-hooks gathered here
            model(x, y)[1].backward()
        copied(x, y)[1].backward()
        grads = dict(copied.named_parameters())
        errors = [
            (p.grad - grads[n].grad).abs().max().item()
            for n, p in model.named_parameters()
            if p.grad is not None
        ]
        out[stage] = {
            "freed": [r() is None for r in refs],
            "collectives": [op for op, _ in log.log],
            "no_grad": [n for n, p in model.named_parameters() if p.grad is None],
            "max_error": max(errors, default=None),
            "kept": kept,
        }
    return out


def test_a_dropped_zero_wrapper_is_freed_and_silent():
    """The bug (as test_ddp's for DataParallel): the gradient hooks and ZeRO-3's forward hooks
    held the wrapper (plain partials of its methods), so after `del wrapper, opt` a backward
    on the bare module still reduce-scattered every flat on every rank and left each p.grad
    None (moved into a flat gradient no optimizer reads), and a ZeRO-3 forward still
    all-gathered. Dropped (and gc.collect()), ZeRO-2's and ZeRO-3's wrapper and optimizer must
    be freed, their hooks removed: no collective, and every p.grad plain autograd's. Their
    last waited handles must outlive them (support/ddp/gloo_exit.py keeps them against an abort
    at exit on gloo): with the workaround gone that check fails."""
    for res in run_ranks(_dropped_wrappers, 2, timeout=120):
        for stage in (2, 3):
            r = res[stage]
            assert r["freed"] == [True, True], f"ZeRO-{stage} wrapper, optimizer alive: {r}"
            assert r["collectives"] == [], f"ZeRO-{stage}'s dropped hooks sent: {r}"
            assert r["no_grad"] == [], f"ZeRO-{stage}: gradients taken away: {r}"
            assert r["max_error"] == 0.0, r
            assert r["kept"] > 0, f"ZeRO-{stage}: no waited handle kept (the exit workaround)"


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_collectives_per_step_match_the_formula(world, stage):
    """Recorded on every rank, not taken from 07's counters: the same (op, bytes) sequence on
    every rank (NCCL's rule); reduce-scatters in the fixed flat order; and the bytes.
    Per step: a reduce-scatter of every flat gradient and an all-gather of every flat weight
    buffer: each rank sends (N-1)/N of each, 2(N-1)/N·Ψ_pad words, Ψ_pad = Ψ + padding (< N
    per flat). ZeRO-3 all-gathers every block again for backward (not the root, which stays
    gathered): (N-1)/N·(3Ψ_pad - root) words. ZeRO-1 communicates in step(), 2 and 3 in
    backward (3: forward too), and 1 and 2 all-gather the weights in step()."""
    sizes = flat_sizes(world)
    padded = [4 * pad for _, _, pad in sizes]  # bytes of each flat buffer, in backward order
    blocks = [4 * pad for unit, _, pad in sizes if unit != "root"]
    psi_pad = sum(pad for _, _, pad in sizes)
    assert 0 <= psi_pad - PSI < world * len(sizes)
    per_rank = results(world, "stages")
    for res in per_rank:
        res = res[stage]
        for step in range(STEPS):
            backward, step_log = res["log_backward"][step], res["log_step"][step]
            assert backward == per_rank[0][stage]["log_backward"][step]  # same on every rank
            assert step_log == per_rank[0][stage]["log_step"][step]
            log = backward + step_log
            rs = [b for op, b in log if op == "reduce_scatter_single"]
            ag = [b for op, b in log if op == "all_gather_single"]
            assert rs == padded, "reduce-scatters: one per flat, in the fixed backward order"
            assert {op for op, _ in log} <= {"reduce_scatter_single", "all_gather_single"}
            in_step = [op for op, _ in step_log]
            if stage == 1:  # every reduce-scatter, then every all-gather
                expected = ["reduce_scatter_single"] * len(rs) + ["all_gather_single"] * len(ag)
                assert in_step == expected
            else:
                assert "reduce_scatter_single" not in in_step  # during backward
            if stage < 3:
                assert sorted(ag) == sorted(padded)
                words = (world - 1) / world * (sum(rs) + sum(ag)) / 4
                assert words == pytest.approx(2 * (world - 1) / world * psi_pad)
            else:
                assert sorted(ag) == sorted(padded + blocks)  # forward: all; backward: blocks
                root = psi_pad - sum(blocks) / 4
                words = (world - 1) / world * (sum(rs) + sum(ag)) / 4
                assert words == pytest.approx((world - 1) / world * (3 * psi_pad - root))
        logs = res["log_backward"] + res["log_step"]  # and 07's own counters agree with them
        recorded = [b for log in logs for op, b in log if op == "reduce_scatter_single"]
        assert res["stats"]["reduce_scatter_bytes"] == sum(recorded)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
def test_memory_per_rank_matches_the_formula(world, stage):
    """After backward (AdamW's state exists: second step), the bytes of every tensor alive in
    the rank (found by gc), against the formula for Ψ_pad parameters (the flat buffers' padding
    included; DP has none) plus AdamW's 4-byte step per tensor it steps (ZeRO: one per flat
    shard). ZeRO-1's full gradients are autograd's p.grad, unpadded. And 07's memory_per_rank
    splits the same bytes into weights, gradients and state."""
    sizes = flat_sizes(world)
    psi = PSI if stage == 0 else sum(pad for _, _, pad in sizes)
    n_tensors = len(list(build().parameters())) if stage == 0 else len(sizes)
    formula = zero_lib.zero_memory_formula(stage, psi, world) + 4 * n_tensors
    weights = 4 * psi / world if stage == 3 else 4 * psi
    grads = {0: 4 * psi, 1: 4 * psi, 2: 4 * psi / world, 3: 4 * psi / world}[stage]
    state = 8 * psi / (1 if stage == 0 else world) + 4 * n_tensors
    assert weights + grads + state == pytest.approx(formula, abs=1e-6)  # the formula's terms
    if stage == 1:
        formula, grads = formula - 4 * (psi - PSI), 4 * PSI
    for res in results(world, "memory"):
        res = res[stage]
        assert res["alive"] == pytest.approx(formula, abs=1e-6), res["measured"]
        m = res["measured"]
        assert (m["params"], m["grads"], m["optimizer"]) == (weights, grads, state), m


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_zero3_holds_the_root_and_at_most_two_blocks_while_a_block_runs(world):
    """ZeRO-3's 'one gathered unit', counted honestly: while block i runs its forward, the full
    weights in memory are the root's (gathered from the start of forward to the end of
    backward) and block i's, plus block i+1's if it is being prefetched."""
    sizes = flat_sizes(world)
    root = sum(4 * pad for unit, _, pad in sizes if unit == "root")
    block = {u: sum(4 * pad for v, _, pad in sizes if v == u) for u, _, _ in sizes}
    expected = [root + block["h.0"] + block["h.1"], root + block["h.1"]]
    for res in results(world, "stages"):
        assert res[3]["gathered"] == expected


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_no_sync_accumulation_is_one_big_batch_with_one_reduce_round(world, stage):
    expected = reference(world, micro=MICRO)
    n_flats = len(flat_sizes(world))
    for res in results(world, "no_sync"):
        res = res[stage]
        assert_states_close(res["weights"], expected["weights"], **PARAM_TOL)
        # after every backward: the reduce-scatters so far; none inside no_sync()
        after = [n_flats * (s + (m == MICRO - 1)) for s in range(STEPS) for m in range(MICRO)]
        if stage == 1:  # ZeRO-1 reduces in step(), after the last backward
            after = [n_flats * s for s in range(STEPS) for m in range(MICRO)]
        assert res["calls"] == after, res["calls"]


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clipping_on_the_shards_equals_clip_grad_norm(world, stage):
    """The global norm from grad_pieces() on every rank equals one process's, and scaling the
    pieces in place before the step equals torch.nn.utils.clip_grad_norm_: they are views of the
    shards' gradients, covering each rank's real elements and none of the padding."""
    expected = reference(world, clip=CLIP)
    for res in results(world, "clip"):
        res = res[stage]
        assert res["norms"] == pytest.approx(expected["norm"], rel=1e-5)
        assert all(n > CLIP for n in res["norms"])
        assert all(res["views"]), "a piece is a copy: scaling it would not reach step()"
        assert all(n == real for n, real in res["covered"]), res["covered"]
        assert_states_close(res["weights"], expected["weights"], **PARAM_TOL)
    real = [res[stage]["covered"][0][1] for res in results(world, "clip")]
    assert sum(real) == PSI, real  # the ranks' pieces together: every element of Ψ once


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_step_the_loss_scaler_skips_leaves_no_trace(world, stage):
    """The bug: zero_grad() did not reset ZeRO-1's "reduced this step" flag. After a skipped step
    (grad_pieces() reduced, step() never came) the next step() reduce-scattered nothing: no
    gradient reached the shards, AdamW skipped them, and a step was silently lost (on the code
    before the fix: ZeRO-1 fails here, 2 and 3 pass). One reduce-scatter round per real step."""
    expected = reference(world)["weights"]
    for res in results(world, "skipped_step"):
        assert_states_close(res[stage]["weights"], expected, **PARAM_TOL)
        rounds = res[stage]["stats"]["reduce_scatter_calls"] / len(flat_sizes(world))
        assert rounds == STEPS + 1, res[stage]["stats"]  # the skipped one, then every step


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_a_sharded_checkpoint_resumes_bit_for_bit_and_refuses_another_layout(world):
    per_rank = results(world, "checkpoint")
    for res in per_rank:
        for stage in [1, 2, 3]:
            assert res[stage]["lr"] == 3e-3
            assert_states_close(res[stage]["b"], res[stage]["a"], **EXACT)
        errors = res["errors"]
        assert errors["stage"] is not None and "stage 2, here 3" in errors["stage"], errors
        assert errors["rank"] is not None and "dp_rank" in errors["rank"], errors
        assert "\n" not in errors["stage"] + errors["rank"]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_zero3_refuses_several_pipeline_chunks_per_rank(world):
    """ZeRO-2: each chunk's wrapper takes its own flats (2 blocks and the root, one param group);
    ZeRO-3: every microbatch would all-gather every unit again, so the wrapper refuses, in one
    line."""
    for res in results(world, "pipeline_chunks"):
        assert res[2] == [3, 3], res
        assert "ZeRO-3 with several pipeline chunks per rank is refused" in res[3], res
        assert "\n" not in res[3]


def test_collective_names_fall_back_to_older_torch(monkeypatch, tmp_path):
    """torch 2.13 renamed the one-tensor collectives; the GPU image's torch 2.11 has only the
    old ones, and ZeRO (then in 03) died there on reduce_scatter_single. support.distributed calls the
    new name where it exists, else the old one: both give the same sums, here on a world of 1
    with each name removed in turn. No lesson names either collective itself."""
    from support import distributed

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1
    )
    try:
        x = torch.arange(4.0)
        for gone in (None, "reduce_scatter_single", "all_gather_single"):
            with monkeypatch.context() as m:
                if gone:  # as under torch 2.11: only the old name
                    m.delattr(dist, gone)
                out = torch.empty(4)
                distributed.reduce_scatter_tensor(out, x.clone())
                assert out.equal(x)
                out = torch.empty(4)
                distributed.all_gather_tensor(out, x.clone())
                assert out.equal(x)
    finally:
        dist.destroy_process_group()
    lessons = ("03_ddp.py", "04_tensor_parallel.py", "04b_sequence_parallel.py")
    for lesson in (*lessons, "05_pipeline.py", "07_zero.py"):
        source = open(lesson).read()
        assert "dist.reduce_scatter_single(" not in source, lesson
        assert "dist.all_gather_single(" not in source, lesson


def test_the_demo_runs_as_a_script_and_prints_its_headline():
    """`python 07_zero.py` relaunches itself under torchrun (2 ranks) and prints its two
    headlines with numbers that hold: every stage's losses and weights within fp32 rounding
    of one process's after 3 AdamW steps (a rank's data missing moves the weights by ~lr =
    1e-3), and the bytes per rank after backward of stages 0-3 within a few bytes of their
    formulas: the padding of the flat buffers (< N elements each) and AdamW's 4-byte step
    counters."""
    out = run_output(("07_zero.py",))  # the run test_readme checks too, shared (stdout, stderr)
    assert "running: torchrun --standalone --nproc_per_node=2" in out, out
    assert "every stage == one process" in out, out
    stages = ["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    table = out.split("max |Δ| of the weights)")[1].split("fp32 rounding")[0].strip().splitlines()
    table = [row for row in table if row.split()[0] in ["simple", *stages]]
    names = [row.split()[0] for row in table]
    assert names == ["simple", *stages], out
    # SimpleZero1 and ZeroOptimizer at stage 1: the same sums and steps, elementwise.
    simple_vs_1 = float(out.split("simple == ZeRO-1: weights max |Δ|")[1].split()[0])
    assert simple_vs_1 < 1e-6, out
    # The bytes a rank sent per step: DP, ZeRO-1 and 2 at 2(N-1)/N·4Ψ (plus the padding),
    # ZeRO-3 at most 3(N-1)/N·4Ψ (the root is not gathered again for backward).
    sent = [line.split() for line in out.split("3. bytes each rank sends")[1].splitlines()]
    sent = {r[0]: (int(r[1].replace(",", "")), int(r[-1].replace(",", ""))) for r in sent
            if r and r[0] in stages}
    assert list(sent) == stages, out
    for name, (measured, formula) in sent.items():
        if name == "ZeRO-3":
            assert formula / 2 < measured <= formula, (name, measured, formula)
        else:
            assert 0 <= measured - formula < 1e-3 * formula, (name, measured, formula)
    for row in table:  # AdamW's first steps move a weight whose gradient is ~0 by up to ~lr
        loss_error, weight_error = (float(v) for v in row.split()[1:])
        assert loss_error < 1e-5 and weight_error < 1e-4, row
    rows = [line for line in out.splitlines() if " | " in line and "weights" in line]
    assert [r.split()[0] for r in rows] == ["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"], out
    for row in rows:
        measured = int(row.split("|")[0].split()[-1].replace(",", ""))
        formula = int(row.split()[-1].replace(",", ""))
        assert 0 <= measured - formula < 1e-3 * formula, row  # here ~200 B of ~7-13 MB


def test_the_demo_refuses_bad_flags_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        zero_lib.main(["--ranks", "0"])
    assert exit_info.value.code == 2
    assert "error: --ranks must be >= 1" in capsys.readouterr().err


def test_a_dp_subgroup_divides_by_its_own_size():
    """4 ranks as two DP groups of 2, each on its own data: every stage of each group equals
    one process on that group's two batches (PARAM_TOL, as every stage). Dividing the sums by
    the world (4) instead of the group (2) halves every gradient, and reducing over the world
    mixes the groups' data: either is off by ~lr (1e-3), far outside 5e-6."""
    for rank, res in enumerate(results(4, "subgroups")):
        assert res["group"] == rank % 2
        expected = reference(2, offset=OFFSET * res["group"])["weights"]
        for stage in STAGES[1:]:
            assert_states_close(res[stage], expected, **PARAM_TOL)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_a_new_lr_on_the_wrapper_reaches_the_shard_optimizer(world):
    """A scheduler sets lr on ZeroOptimizer's param_groups; the optimizer that steps the shards
    is another one (opt.local). After a step with 10x LR on the matrices and lr 0 on the
    vectors, its groups hold those LRs, and exactly the matrices moved: with the old LR kept,
    the vectors move too."""
    model = build()
    for res in results(world, "new_lr"):
        for stage in STAGES[1:]:
            assert res[stage]["inner_lr"] == [10 * LR, 0.0], stage
            moved = {n: p.dim() >= 2 for n, p in model.named_parameters()}
            assert res[stage]["moved"] == moved, stage


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_zero3_frees_each_block_and_reduces_while_backward_runs(world):
    """Measured inside ZeRO-3's backward, as each block's backward starts. Blocks run h.1 then
    h.0 (flat_sizes: h.1's two flats, then h.0's, then the root's). At h.1: every unit gathered
    (the root since forward, h.1 for its backward, h.0 prefetched), nothing reduced yet, and
    one gradient buffer alive: the root's vectors, whose ln_f gradients came first. At h.0:
    h.1 freed (its backward is over), its two flats reduce-scattered, and of their full
    gradient buffers those still in flight: at in_flight 1 the last one (h.1's vectors), at 2
    both (its matrices too), the bound the docstring states. A block kept gathered after its
    backward, every reduce-scatter held to the end of backward, or a full gradient kept past
    the bound, fails it."""
    sizes = flat_sizes(world)
    unit = {u: sum(4 * pad for v, _, pad in sizes if v == u) for u, _, _ in sizes}
    root_vectors = 4 * sizes[5][2]
    h1_matrices = 4 * sizes[0][2]
    h1_vectors = 4 * sizes[1][2]
    at_h1 = dict(weights=unit["root"] + unit["h.1"] + unit["h.0"], launched=0)
    at_h0 = dict(weights=unit["root"] + unit["h.0"], launched=2)
    in_flight_at_h0 = {1: h1_vectors, 2: h1_matrices + h1_vectors}
    assert [u for u, _, _ in sizes] == ["h.1", "h.1", "h.0", "h.0", "root", "root"]
    for res in results(world, "backward_peak"):
        for k, sent in in_flight_at_h0.items():
            expected = [
                {"block": "h.1", **at_h1, "grad_buffers": root_vectors},
                {"block": "h.0", **at_h0, "grad_buffers": root_vectors + sent},
            ]
            assert res[k] == expected, f"in_flight {k}"


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_zero2_and_3_keep_up_to_in_flight_reduce_scatters_going_at_once(world):
    """One backward of ZeRO-2 and of ZeRO-3, 6 flats each, at in_flight K = 1, 2, 3. At the
    i-th launch (i = 1..6) the reduce-scatters launched and not yet waited, it included, are
    min(i, K): 07 waits for the oldest only when K are going, so at K = 2 two are in flight
    from the second launch on (before, the gradient hook waited for the previous one first:
    always 1). K = 2 is ZeroDataParallel's default, never set here nor by train.py: a
    default of 1 makes K = 2's counts 1s, and fails. Every launch is inside backward; none is
    left unwaited after it; and the gradient pieces are the same bits at every K (the same
    sums, only waited later)."""
    for res in results(world, "in_flight"):
        for stage in (2, 3):
            for k in (1, 2, 3):
                r = res[stage, k]
                counts = [n for n, _ in r["seen"]]
                assert counts == [min(i, k) for i in range(1, 7)], f"ZeRO-{stage}, K={k}: {r}"
                assert all(during for _, during in r["seen"]), f"ZeRO-{stage}, K={k}"
                assert r["left"] == 0, f"ZeRO-{stage}, K={k}: unwaited after backward"
                for ours, base in zip(r["pieces"], res[stage, 1]["pieces"], strict=True):
                    assert ours[:2] == base[:2] and torch.equal(ours[2], base[2])
