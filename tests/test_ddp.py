"""03_ddp.py: data parallelism proven equal to one process, and to PyTorch's own DDP.

The worked example behind every equality test: N ranks each take ROWS different sequences per
step. Their mean losses L_r average to the loss L of one process on all N·ROWS sequences, and
∇L = 1/N Σ_r ∇L_r, so after identical optimizer steps every replica must hold exactly the
parameters of a single process trained on the concatenated batch, up to fp32 rounding (the
sums run in a different order). The single process runs right here, in the test; the ranks run
in spawned gloo worlds, one world per world size, with every case inside it.
"""

import contextlib
import functools
import gc
import importlib
import io
import os
import subprocess
import sys
import time
import traceback
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests import symptoms
from tests.distributed import RankError, case_results, run_cases, run_ranks
from tests.test_readme import run_output

ddp = importlib.import_module("03_ddp")
compression = importlib.import_module("03b_compression")  # hooks in the freed-wrapper test
zero_lib = importlib.import_module("07_zero")  # ZeroOptimizer over DataParallel, below
model_lib = importlib.import_module("02_model")

SEED, STEPS, ROWS, MICRO = 1234, 3, 2, 3  # MICRO: accumulation steps in the no_sync() cases
WORLD_SIZES = [2, 4]
OPTIMIZERS = {
    # SGD for the equality-with-one-process tests: its update is linear in the gradient, so the
    # gradients' rounding differences stay rounding differences. (Adam divides by sqrt(v): where
    # a gradient is ~0, rounding noise becomes a sizable step; ZeRO+AdamW is compared exactly.)
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
}
# fp32 parameters after 3 SGD steps whose gradients differ only in summation order (one big
# batch here, per-rank sums then a ring all-reduce there). Measured: at most 1.2e-7 on the toy
# (4 ranks; values O(1)) and 7.5e-9 on the tiny GPT, a few ulps. 1e-6 absolute + 1e-5 relative
# leaves about 10x margin, while a real bug (a missing / N, a rank's gradient dropped, a stale
# bucket) moves parameters by lr·|grad| ~ 1e-2: test_the_comparison_can_fail checks that a run
# without one rank's data is far outside this tolerance (measured 1.4e-2 .. 3.5e-2).
TOL = dict(rtol=1e-5, atol=1e-6)


class Toy(nn.Module):
    """Every awkward case in a few hundred parameters: tied weights (out.weight is emb.weight),
    a frozen bias (hidden.bias), a frozen layer (frozen), a buffer (shift) and 4 trainable
    tensors (emb.weight, hidden.weight, norm.weight, norm.bias)."""

    V, C, T = 16, 8, 8

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(self.V, self.C)
        self.hidden = nn.Linear(self.C, self.C)
        self.hidden.bias.requires_grad_(False)
        self.norm = nn.LayerNorm(self.C)
        self.frozen = nn.Linear(self.C, self.C).requires_grad_(False)
        self.out = nn.Linear(self.C, self.V, bias=False)
        self.out.weight = self.emb.weight  # tied: one tensor, two uses, reduced once
        self.register_buffer("shift", torch.randn(self.C))

    def forward(self, idx, targets):
        x = self.emb(idx) + self.shift  # (B, T, C)
        x = self.frozen(torch.tanh(self.norm(self.hidden(x))))  # (B, T, C)
        logits = self.out(x)  # (B, T, V)
        return logits, F.cross_entropy(logits.view(-1, self.V), targets.reshape(-1))


class WithUnused(nn.Module):
    """A Toy plus a layer that forward never uses (registered first: its bucket is the last)."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(4, 4)
        self.toy = Toy()

    def forward(self, idx, targets, use_unused=False):
        logits, loss = self.toy(idx, targets)
        if use_unused:
            loss = loss + 0.0 * sum(p.sum() for p in self.unused.parameters())
        return logits, loss


def build(kind: str, seed: int = SEED) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "toy":
        return Toy()
    return model_lib.GPT(model_lib.GPTConfig.from_preset("tiny"))  # 2 layers, C=32, V=256


def batch(kind: str, step: int, dp_rank: int, micro: int = 0, salt: int = 0):
    """ROWS sequences of random tokens, a pure function of (salt, step, dp_rank, micro)."""
    V, T = (Toy.V, Toy.T) if kind == "toy" else (256, 16)
    g = torch.Generator().manual_seed(((salt * 100 + step) * 100 + dp_rank) * 100 + micro)
    rows = torch.randint(0, V, (ROWS, T + 1), generator=g)  # (ROWS, T+1)
    return rows[:, :-1], rows[:, 1:]  # (ROWS, T) each


def make_optimizer(name, params, zero=False, group=None):
    cls, kwargs = OPTIMIZERS[name]
    if zero:
        return zero_lib.ZeroOptimizer(params, cls, group=group, **kwargs)
    return cls(params, **kwargs)


def train(model, opt, micro_batches, steps, start=0, schedule=True, set_to_none=True):
    """micro_batches(step) -> [(x, y), ...]: all but the last backward run under no_sync(); the
    naive wrapper all-reduces once, after the last (its no_sync() is a no-op: not calling
    all_reduce_gradients() is what skips communication). The LR schedule is there to prove
    ZeroOptimizer's param_groups reach the real update."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)) if schedule else None
    for step in range(start, start + steps):
        opt.zero_grad(set_to_none=set_to_none)
        pieces = micro_batches(step)
        for i, (x, y) in enumerate(pieces):
            last = i == len(pieces) - 1
            with contextlib.nullcontext() if last else model.no_sync():
                _, loss = model(x, y)
                (loss / len(pieces)).backward()  # mean over micro-batches, as one big batch
        if isinstance(model, ddp.NaiveDataParallel):
            model.all_reduce_gradients()
        opt.step()
        if sched:
            sched.step()


def snapshot(module: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def trainable(module: nn.Module) -> list:
    return [p for p in module.parameters() if p.requires_grad]  # a tied tensor counted once


@functools.cache
def reference(kind, opt_name, world, micro=1, salt=0, seed=SEED, ranks=None) -> dict:
    """One process, one model, the concatenated batch of every rank (and micro-batch)."""
    model = build(kind, seed)
    opt = make_optimizer(opt_name, model.parameters())
    ranks = range(world) if ranks is None else ranks

    def whole_batch(step):
        pieces = [batch(kind, step, r, m, salt) for r in ranks for m in range(micro)]
        return [(torch.cat([x for x, _ in pieces]), torch.cat([y for _, y in pieces]))]

    train(model, opt, whole_batch, STEPS)
    return snapshot(model)


# ---------------------------------------------------------------------------------------------
# What every rank runs: one spawned world per world size, every case inside it
# ---------------------------------------------------------------------------------------------
def variants(kind: str) -> dict:
    """name -> (wrapper, bucket_mb). Bucket sizes: below every parameter (one bucket each),
    about half the model (a few buckets), above the whole model (one bucket)."""
    half_mb = sum(ddp.nbytes(p) for p in trainable(build(kind))) / 2 / 2**20
    return {
        "naive": (ddp.NaiveDataParallel, None),
        "bucket-min": (ddp.DataParallel, 1e-7),
        "bucket-half": (ddp.DataParallel, half_mb),
        "bucket-max": (ddp.DataParallel, 1e3),
        "zero": (ddp.DataParallel, 25.0),
        "bucket-none": (functools.partial(ddp.DataParallel, bucket_mb=None), None),  # no cap
    }


def wrap(wrapper, module, bucket_mb, group=None):
    if bucket_mb is None:
        return wrapper(module, group=group)
    return wrapper(module, bucket_mb=bucket_mb, group=group)


def summary(model) -> dict:
    return {
        "state": snapshot(model.module),
        "stats": dict(model.stats),
        "n_buckets": len(getattr(model, "buckets", [])),
    }


def case_variants(rank, world, kind):
    out = {}
    for name, (wrapper, bucket_mb) in variants(kind).items():
        try:  # a variant that raises (on every rank alike) must not hide the others' results
            model = wrap(wrapper, build(kind), bucket_mb)
            opt = make_optimizer("sgd", model.parameters(), zero=name == "zero")
            train(model, opt, lambda s: [batch(kind, s, rank)], STEPS)
            out[name] = summary(model)
        except Exception:  # noqa: BLE001 - reported by the test that reads this variant
            out[name] = {"error": traceback.format_exc()}
    return out


def case_torch_ddp(rank, world, kind):
    model = nn.parallel.DistributedDataParallel(build(kind), bucket_cap_mb=0.01)
    opt = make_optimizer("sgd", model.parameters())
    train(model, opt, lambda s: [batch(kind, s, rank)], STEPS)
    return snapshot(model.module)


def case_no_sync(rank, world):
    out = {}
    for name, wrapper, bucket_mb in [
        ("naive", ddp.NaiveDataParallel, None),
        ("bucketed", ddp.DataParallel, 0.02),
        ("bucketed, grads kept", ddp.DataParallel, 0.02),  # p.grad stays the bucket's view
    ]:
        model = wrap(wrapper, build("gpt"), bucket_mb)
        opt = make_optimizer("sgd", model.parameters())
        micro_batches = lambda s: [batch("gpt", s, rank, m) for m in range(MICRO)]  # noqa: E731
        train(model, opt, micro_batches, STEPS, set_to_none="kept" not in name)
        out[name] = summary(model)
    return out


def case_broadcast(rank, world):
    """Ranks initialise with different seeds; wrapping must copy the group's first rank's."""
    out = {}
    for name, wrapper in [("naive", ddp.NaiveDataParallel), ("bucketed", ddp.DataParallel)]:
        toy = build("toy", seed=100 + rank)
        before = snapshot(toy)
        wrapper(toy)
        out[name] = {"before": before, "after": snapshot(toy)}
    if world == 4:  # a subgroup whose first rank is 1, not 0: src is a global rank
        group = dist.new_group([1, 2, 3])  # every rank must call new_group, members or not
        toy = build("toy", seed=100 + rank)
        before = snapshot(toy)
        if rank in (1, 2, 3):
            ddp.DataParallel(toy, group=group)
        out["subgroup"] = {"before": before, "after": snapshot(toy)}
    return out


def case_dp_subgroups(rank, world):
    """A 2 (dp) x 2 (tp) grid: DP groups {0, 2} and {1, 3} train independently, on their own
    data, from their own first rank's initialisation (rank 0 and rank 1)."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # same order on every rank
    g, dp_rank = rank % 2, rank // 2
    model = ddp.DataParallel(build("gpt", seed=SEED + rank), bucket_mb=0.01, group=groups[g])
    opt = make_optimizer("sgd", model.parameters(), zero=True, group=groups[g])
    train(model, opt, lambda s: [batch("gpt", s, dp_rank, salt=1 + g)], STEPS)
    return {"group": g, "state": snapshot(model.module)}


def case_missing_grad(rank, world):
    """Every rank leaves `unused` out of the loss: every rank must raise, naming it (the naive
    wrapper when its loop reaches it, before any all-reduce of it)."""
    naive = ddp.NaiveDataParallel(WithUnused())
    naive(*batch("toy", 0, rank))[1].backward()
    try:
        naive.all_reduce_gradients()
        naive_message = None
    except RuntimeError as e:
        naive_message = str(e)
    model = ddp.DataParallel(WithUnused(), bucket_mb=1e-7)  # the other buckets launch first
    _, loss = model(*batch("toy", 0, rank))
    try:
        loss.backward()
        message = None
    except RuntimeError as e:
        message = str(e)
    model.module.zero_grad(set_to_none=True)
    _, loss = model(*batch("toy", 1, rank), use_unused=True)
    loss.backward()  # the wrapper recovers: a complete backward synchronises again
    return {"message": message, "syncs_after": model.stats["syncs"], "naive": naive_message}


def case_zero(rank, world):
    out = {}
    for name in ("plain", "zero"):
        model = ddp.DataParallel(build("gpt"), bucket_mb=0.02)
        opt = make_optimizer("adamw", model.parameters(), zero=name == "zero")
        train(model, opt, lambda s: [batch("gpt", s, rank)], STEPS)
        state = zero_lib.memory_per_rank(model.module, opt)["optimizer"]
        out[name] = {"state": snapshot(model.module), "state_bytes": state}
    return out


def case_zero_round_trip(rank, world):
    """Train 2 steps, checkpoint, train 2 more; a fresh model and optimizer loaded from the
    checkpoint must reach bit for bit the same parameters."""
    batches = lambda s: [batch("gpt", s, rank)]  # noqa: E731
    model = ddp.DataParallel(build("gpt"))
    opt = make_optimizer("adamw", model.parameters(), zero=True)
    train(model, opt, batches, 2, schedule=False)
    opt.param_groups[0]["lr"] = 3e-3  # a changed hyperparameter must come back too
    buf = io.BytesIO()
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict()}, buf)
    train(model, opt, batches, 2, start=2, schedule=False)

    fresh = ddp.DataParallel(build("gpt", seed=SEED + 1))
    fresh_opt = make_optimizer("adamw", fresh.parameters(), zero=True)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    fresh.module.load_state_dict(ckpt["model"])
    fresh_opt.load_state_dict(ckpt["opt"])
    lr = fresh_opt.param_groups[0]["lr"]
    train(fresh, fresh_opt, batches, 2, start=2, schedule=False)
    try:
        layout = {**ckpt["opt"]["layout"], "dp_rank": (rank + 1) % world}
        fresh_opt.load_state_dict({**ckpt["opt"], "layout": layout})
        wrong_rank = None
    except ValueError as e:
        wrong_rank = str(e)
    return {"a": snapshot(model.module), "b": snapshot(fresh.module), "lr": lr, "wrong": wrong_rank}


def _calls_in_one_backward(stats: dict, model, rank) -> dict:
    """name -> the all-reduces that wrapper counted (in stats[name]) during one backward."""
    before = {name: s["allreduce_calls"] for name, s in stats.items()}
    model(*batch("toy", 0, rank))[1].backward()
    return {name: s["allreduce_calls"] - before[name] for name, s in stats.items()}


def case_lifecycle(rank, world):
    """Wrap a module, wrap it again and drop the first wrapper: it must be freed and silent.
    Wrap a third time and close() the second, still referenced: it must fall silent too.
    And ZeroOptimizer.add_param_group after construction must be refused, not ignored.
    (Only DataParallel: the naive wrapper has no hooks; it communicates when called.)"""
    toy = build("toy")
    first = ddp.DataParallel(toy)
    stats, first_ref = {"first": first.stats}, weakref.ref(first)
    second = ddp.DataParallel(toy)  # as in `model = DataParallel(model.module)`: two, briefly
    del first
    gc.collect()
    stats["second"] = second.stats
    rewrap = _calls_in_one_backward(stats, second, rank)
    third = ddp.DataParallel(toy)
    second.close()
    stats["third"] = third.stats
    close = _calls_in_one_backward(stats, third, rank)
    out = {"freed": first_ref() is None, "rewrap": rewrap, "close": close}
    toy = build("toy")
    groups = [{"params": [toy.emb.weight]}, {"params": [toy.hidden.weight], "lr": 0.0}]
    opt = zero_lib.ZeroOptimizer(groups, torch.optim.SGD, lr=0.1)  # groups up front: fine
    try:
        opt.add_param_group({"params": [toy.norm.weight]})
        out["add_param_group"] = None
    except NotImplementedError as e:
        out["add_param_group"] = str(e)
    return out


class Chain(nn.Module):
    """Four bias-free layers in a row: backward makes their gradients ready strictly last
    layer first (l3, l2, l1, l0), the reverse of registration."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(SEED)
        self.layers = nn.Sequential(*(nn.Linear(8, 8, bias=False) for _ in range(4)))

    def forward(self, x):
        return self.layers(x).square().mean()


def launch_log(module, bucket_mb, run):
    """Events in time order: ("ready", name) when backward makes a gradient ready (a hook
    registered before the wrapper's, so it fires first), ("launch", names) when DataParallel
    hands a bucket to its comm hook. run(model) runs one forward and backward."""
    names = {p: n for n, p in module.named_parameters()}
    log = []
    for p in names:
        p.register_post_accumulate_grad_hook(lambda p: log.append(("ready", names[p])))

    def hook(dp, bucket):
        log.append(("launch", [names[p] for p in bucket.params]))
        return ddp.all_reduce_hook(dp, bucket)

    model = ddp.DataParallel(module, bucket_mb=bucket_mb, comm_hook=hook)
    run(model)
    return log


def case_launch_order(rank, world):
    """The chain with a bucket per parameter, and the GPT with small buckets."""
    chain = launch_log(Chain(), 1e-7, lambda m: m(torch.randn(4, 8)).backward())
    gpt = launch_log(build("gpt"), 0.02, lambda m: m(*batch("gpt", 0, rank))[1].backward())
    return {"chain": chain, "gpt": gpt}


CASES = {
    "toy": functools.partial(case_variants, kind="toy"),
    "gpt": functools.partial(case_variants, kind="gpt"),
    "ddp-toy": functools.partial(case_torch_ddp, kind="toy"),
    "ddp-gpt": functools.partial(case_torch_ddp, kind="gpt"),
    "no_sync": case_no_sync,
    "broadcast": case_broadcast,
    "missing": case_missing_grad,  # before others: they prove the world is still in step
    "zero": case_zero,
    "zero_round_trip": case_zero_round_trip,
    "lifecycle": case_lifecycle,
    "subgroups": case_dp_subgroups,
    "launch_order": case_launch_order,
}


@functools.cache
def world_results(world: int) -> list[dict]:
    cases = {k: c for k, c in CASES.items() if k != "subgroups" or world == 4}  # needs 2 x 2
    # 300 s: on 2 cores shared with other work (load ~20) a world took over 150 s (2026-11-27)
    return run_ranks(run_cases, world, cases, timeout=300)


def results(world: int, case: str) -> list:
    return case_results(world_results(world), case)


def _named(key, message):
    return f"{key}: {message}"


def assert_states_close(actual: dict, expected: dict, start: dict | None = None, **tol):
    """Every tensor of two state dicts close. Given the weights both runs `start`ed from, a
    failure opens with what broke in the reader's words, read off the two runs' updates:
    `the updates of fc.weight are 2x one process's` (a lost / N: tests/symptoms.py)."""
    assert actual.keys() == expected.keys()
    for k in expected:
        msg = functools.partial(_named, k)
        if start is None:
            torch.testing.assert_close(actual[k], expected[k], **(tol or TOL), msg=msg)
            continue
        try:
            torch.testing.assert_close(actual[k], expected[k], **(tol or TOL), msg=msg)
        except AssertionError as error:
            change = symptoms.diagnose(actual[k] - start[k], expected[k] - start[k])
            words = change.replace("the reference", "one process")
            raise AssertionError(f"the updates of {k} {words}\n{error}") from None


# ---------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("kind", ["toy", "gpt"])
@pytest.mark.parametrize(
    "variant", ["naive", "bucket-min", "bucket-half", "bucket-max", "zero", "bucket-none"]
)
def test_every_variant_equals_one_process(world, kind, variant):
    expected = reference(kind, "sgd", world)
    start = snapshot(build(kind))
    for rank_result in results(world, kind):
        res = rank_result[variant]
        assert "error" not in res, res["error"]
        assert_states_close(res["state"], expected, start)  # every parameter and buffer
        # one round of all-reduces per step, each trainable gradient once (the tied one once)
        model = build(kind)
        n_params, n_bytes = len(trainable(model)), sum(ddp.nbytes(p) for p in trainable(model))
        n_calls = {"naive": n_params, "bucket-min": n_params, "bucket-max": 1, "bucket-none": 1}
        n_calls = n_calls.get(variant)  # bucket_mb=None: one bucket (one dtype) whatever the size
        assert res["stats"]["syncs"] == STEPS
        assert res["stats"]["allreduce_bytes"] == STEPS * n_bytes
        if n_calls is not None:
            assert res["stats"]["allreduce_calls"] == STEPS * n_calls, res["stats"]
        if variant == "bucket-half":
            assert 1 < res["n_buckets"] < n_params, res["n_buckets"]
            assert res["stats"]["allreduce_calls"] == STEPS * res["n_buckets"]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_the_comparison_can_fail(world):
    """The same training without rank 1's data is far outside the tolerance: the equality
    tests above really see every rank's contribution."""
    ours = results(world, "gpt")[0]["bucket-half"]["state"]
    without_rank1 = reference("gpt", "sgd", world, ranks=(0,) + tuple(range(2, world)))
    with pytest.raises(AssertionError):
        assert_states_close(ours, without_rank1)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("kind", ["toy", "gpt"])
@pytest.mark.parametrize("variant", ["naive", "bucket-half", "bucket-max"])
def test_naive_and_bucketed_equal_torch_ddp(world, kind, variant):
    for ddp_state, ours in zip(results(world, f"ddp-{kind}"), results(world, kind)):
        assert_states_close(ours[variant]["state"], ddp_state)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("kind", ["toy", "gpt"])
def test_naive_equals_bucketed(world, kind):
    """The simple version and the real one, each rank against itself. Naive computes
    (g_0 + ... + g_N-1) / N, bucketed g_0/N + ... + g_N-1/N. With N = 2 that is bit for bit the
    same: x/2 is exact in binary floating point and a sum of two numbers has one order. With
    N = 4 the ring adds four numbers in an order that depends on where a chunk boundary falls
    (per tensor for naive, per flat bucket for bucketed): equal up to fp32 rounding. (Bit for
    bit holds away from subnormals, where x/2 rounds; these gradients are far from them.)"""
    for ours in results(world, kind):
        for bucketed in ("bucket-min", "bucket-half", "bucket-max"):
            tol = dict(rtol=0, atol=0) if world == 2 else TOL
            assert_states_close(ours["naive"]["state"], ours[bucketed]["state"], **tol)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("variant", ["naive", "bucketed", "bucketed, grads kept"])
def test_no_sync_accumulation_is_one_big_batch_with_one_allreduce_round(world, variant):
    """MICRO backward passes per step, all but the last under no_sync(): the calls counted are
    exactly one round per optimizer step, and the result is the MICRO·N·ROWS-row batch's."""
    expected = reference("gpt", "sgd", world, micro=MICRO)
    n_params = len(trainable(build("gpt")))
    for res in results(world, "no_sync"):
        res = res[variant]
        assert_states_close(res["state"], expected)
        per_round = n_params if variant == "naive" else res["n_buckets"]
        assert res["stats"]["syncs"] == STEPS
        assert res["stats"]["allreduce_calls"] == STEPS * per_round, res["stats"]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_parameters_start_identical_despite_different_seeds(world):
    per_rank = results(world, "broadcast")
    for variant in ("naive", "bucketed"):
        first = per_rank[0][variant]["before"]
        assert any(not torch.equal(first[k], per_rank[1][variant]["before"][k]) for k in first)
        for res in per_rank:
            for k in first:  # parameters, frozen ones included, and buffers
                assert torch.equal(res[variant]["after"][k], first[k]), (variant, k)
    if world == 4:  # group {1, 2, 3}: everyone copies rank 1; rank 0 is left alone
        sub = [res["subgroup"] for res in per_rank]
        for r in (1, 2, 3):
            assert all(
                torch.equal(sub[r]["after"][k], sub[1]["before"][k]) for k in sub[1]["before"]
            )
        assert all(torch.equal(sub[0]["after"][k], sub[0]["before"][k]) for k in sub[0]["before"])


def test_dp_subgroups_train_independently():
    """Two DP groups in a 4-rank world, each equal to its own single-process run."""
    for rank, res in enumerate(results(4, "subgroups")):
        g = res["group"]
        assert g == rank % 2
        expected = reference("gpt", "sgd", 2, salt=1 + g, seed=SEED + g)
        assert_states_close(res["state"], expected)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_a_parameter_without_gradient_raises_a_clear_error(world):
    for res in results(world, "missing"):
        msg = res["message"]
        assert msg is not None, "backward with an unused parameter did not raise"
        assert "unused.weight" in msg and "unused.bias" in msg and "no gradient" in msg
        assert res["syncs_after"] == 1  # and the next complete backward synchronised
        assert "has no gradient" in (res["naive"] or ""), res["naive"]


def _one_rank_skips(rank, world):
    model = ddp.DataParallel(WithUnused(), bucket_mb=1e-7)
    _, loss = model(*batch("toy", 0, rank), use_unused=rank == 0)
    loss.backward()  # rank 1 raises; rank 0 waits on an all-reduce that rank 1 never starts


def test_a_parameter_missing_on_one_rank_fails_fast_instead_of_hanging():
    """Rank 1 skips `unused` (data-dependent control flow): it raises the clear error at once,
    and the harness stops rank 0, blocked in the all-reduce, a few seconds later."""
    start = time.monotonic()
    with pytest.raises(RankError) as err:
        run_ranks(_one_rank_skips, 2, timeout=40)
    assert "rank 1 raised" in str(err.value) and "unused.weight" in str(err.value)
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_zero_equals_plain_adamw(world):
    """ZeroOptimizer alone (ZeRO-1, as train.py uses it today) over DataParallel: the gradients
    arrive averaged already, and its reduce-scatter averages N equal copies again. With N = 2
    that is exact ((g + g)/2 = g), so the parameters must be bit for bit those of plain AdamW;
    with N = 4 the ring may round g + g + g (an ulp), so TOL. (zero_data_parallel does not
    all-reduce first: tests/test_zero.py.)"""
    tol = dict(rtol=0, atol=0) if world == 2 else TOL
    for res in results(world, "zero"):
        assert_states_close(res["zero"]["state"], res["plain"]["state"], **tol)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_zero_shards_the_optimizer_state(world):
    """Plain AdamW holds m and v (fp32) and a step counter for every parameter on every rank;
    ZeroOptimizer alone flattens the one param group into one buffer padded to N·S elements
    (S = ceil(P / N)), and rank r holds m, v and a step for its S only: about 1/N each."""
    gpt = build("gpt")
    P, n = sum(p.numel() for p in gpt.parameters()), len(list(gpt.parameters()))
    S = -(-P // world)
    for res in results(world, "zero"):
        assert res["plain"]["state_bytes"] == 8 * P + 4 * n
        assert res["zero"]["state_bytes"] == 8 * S + 4


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_zero_state_dict_round_trips(world):
    for res in results(world, "zero_round_trip"):
        assert res["lr"] == 3e-3
        assert_states_close(res["b"], res["a"], rtol=0, atol=0)  # same arithmetic: bit for bit
        assert res["wrong"] is not None and "dp_rank" in res["wrong"]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_a_dropped_wrapper_is_freed_and_silent(world):
    """The bug: the gradient hooks held the wrapper, so wrapping a module again left both
    wrappers all-reducing every backward (twice the traffic) and the old buckets in memory.
    One backward after re-wrapping must launch exactly one wrapper's collectives (one bucket at
    25 MB), and close() must silence a wrapper that is still referenced."""
    for res in results(world, "lifecycle"):
        assert res["freed"], "the first wrapper is still alive after del + gc.collect()"
        assert res["rewrap"] == {"first": 0, "second": 1}, res["rewrap"]
        assert res["close"] == {"first": 0, "second": 0, "third": 1}, res["close"]


def _freed_wrappers_bucket_bytes(rank, world) -> dict:
    """hook -> the bytes its freed DataParallel's bucket buffers still hold, found through
    weak references (a buffer whose Python object is gone counts 0)."""
    out = {}
    for name in ("default", "fp16", "powersgd"):
        module = build("gpt")
        if name == "fp16":
            hook = compression.HalfPrecision(torch.half)
        elif name == "powersgd":  # one exact step, then two sketched ones
            hook = compression.PowerSGD(module.parameters(), rank=1, warmup_steps=1)
        else:
            hook = None
        model = ddp.DataParallel(module, bucket_mb=0.01, comm_hook=hook)
        for s in range(3):
            model(*batch("gpt", s, rank))[1].backward()
        refs = [weakref.ref(b.buffer) for b in model.buckets]
        del model, module, hook
        gc.collect()
        alive = [r() for r in refs if r() is not None]
        out[name] = sum(b.untyped_storage().nbytes() for b in alive)
    return out


def test_a_freed_wrapper_leaves_no_bucket_memory():
    """The bug: anything that outlives a wrapper and holds what it sent (a waited handle,
    which support/ddp/gloo_exit.py keeps a while on gloo against an exit-time abort, or a
    Then's closure) keeps the buckets alive, so a script that built wrappers one after
    another kept each freed one's 4Ψ bytes. Freed, a wrapper (model and hook gone too)
    must leave 0 bytes in its buckets' buffers, with the default hook, fp16 (its closure
    holds the bucket) and PowerSGD (its closure holds the Ps and Qs). With the wrapper's
    comm no longer emptying its buckets when freed (no buffers= given), this test fails."""
    for held in run_ranks(_freed_wrappers_bucket_bytes, 2, timeout=120):
        assert held == {"default": 0, "fp16": 0, "powersgd": 0}, held


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_zero_refuses_add_param_group_after_construction(world):
    """The bug: the group was accepted into param_groups but never reached the rank-local
    optimizer, so its parameters silently never updated."""
    for res in results(world, "lifecycle"):
        msg = res["add_param_group"]
        assert msg is not None, "add_param_group was accepted (and would be ignored by step())"
        assert "add_param_group" in msg and "ZeroOptimizer(" in msg, msg


def test_the_demo_runs_as_a_script_and_prints_its_headline():
    """`python 03_ddp.py` relaunches itself under torchrun (2 ranks) and prints its
    headlines with numbers that hold: both wrappers' losses and weights within fp32
    rounding of one process's after 3 AdamW steps (a rank's data missing moves the
    weights by ~lr = 1e-3); the naive wrapper's all-reduces one per gradient tensor, the
    bucketed one's one per 1 MB bucket, both reducing 4Ψ bytes, as the formula's row.
    (03b_compression.py's hooks: tests/test_compression.py.)"""
    out = run_output(("03_ddp.py",))  # the run test_readme checks too, shared (stdout, stderr)
    assert "running: torchrun --standalone --nproc_per_node=2" in out, out
    assert "both wrappers == one process" in out, out
    table = out.split("max |Δ| of the weights)")[1].split("fp32 rounding")[0].strip().splitlines()[1:]
    assert [row.split()[0] for row in table] == ["naive", "bucketed"], out
    for row in table:  # AdamW's first steps move a weight whose gradient is ~0 by ~lr
        loss_error, weight_error = (float(v) for v in row.split()[1:])
        assert loss_error < 1e-5 and weight_error < 1e-4, row
    rows = [line.split() for line in out.splitlines() if "bytes reduced" in line]
    assert [r[0] for r in rows] == ["naive", "bucketed", "formula"], out
    psi = int(out.split("Ψ = ")[1].split()[0].replace(",", ""))
    n_tensors = len(list(model_lib.GPT(model_lib.GPTConfig.from_preset("small")).parameters()))
    assert int(rows[0][1]) == n_tensors, rows  # naive: one all-reduce per gradient tensor
    assert int(rows[1][1]) == 4, rows  # bucketed: 4 buckets of at most 1 MB
    for r in rows:
        assert int(r[3].replace(",", "")) == 4 * psi, r  # each gradient once, in fp32


def test_the_demo_refuses_bad_flags_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        ddp.main(["--ranks", "0"])
    assert exit_info.value.code == 2
    assert "error: --ranks must be >= 1" in capsys.readouterr().err


# DP, ZeRO-2, DP, ZeRO-3: one job of each kind, a few seconds. Without the workaround the abort
# struck from 0 in 100 jobs to 1 in 15, all on torch 2.13.0, so the suite runs a short plumbing
# check and the long count under load lives in tests/ddp_exit_count.py (its counts in docs/results.md).
EXIT_JOBS = 4


def test_ranks_exit_cleanly_after_backward():
    """The bug: a rank that had finished its work aborted at interpreter exit (SIGABRT,
    "terminate called without an active exception") when a gloo thread freed a collective
    launched in backward while Python was finalising; tests/ddp_exit_job.py explains, and
    tests/ddp_exit_count.py has the history of counts. This runs fresh 2-rank jobs of
    DataParallel (a bucket per parameter), ZeRO-2 and ZeRO-3, each ending as a torchrun
    script does, with the GIL switch interval (SWITCH_S=1.0) that made the race likeliest;
    every rank must exit with 0.
    Honestly: this is a plumbing check (every kind builds, trains, drops its wrapper, and
    exits 0), not a proof that can show the abort. All on torch 2.13.0 (CI's pin since the
    first commit), without the workaround (support/ddp/gloo_exit.py keeps waited handles a
    while) it struck about one job in 10 to 20 under load in issue 30, and 1 of 15 ZeRO-2
    exits in a CI run (commits 898a44c, 58afab9); issue 39 then ran 0 of 100 jobs without
    it, too few to tell (at 1% to 7% a job, 25 ZeRO-2 jobs are all clean 78% to 16% of the
    time), so the workaround stays. The long version under load: `python tests/ddp_exit_count.py`.
    """
    helper = Path(__file__).with_name("ddp_exit_job.py")
    env = {**os.environ, "SWITCH_S": "1.0"}
    run = [sys.executable, str(helper), str(EXIT_JOBS)]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=300, env=env)
    report = proc.stdout + proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr, report
    assert proc.returncode == 0, report
    assert f"0 of {EXIT_JOBS} two-rank jobs failed" in proc.stdout, report


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_buckets_launch_in_backwards_order_as_their_gradients_become_ready(world):
    """The overlap of DataParallel: a bucket is sent the moment its last gradient is ready, in
    the order backward makes them ready. The chain's gradients arrive l3, l2, l1, l0 (each
    layer's after the next one's), so the log must read ready l3, launch [l3], ready l2, launch
    [l2], and so on. In the GPT, the tied wte/lm_head matrix is ready last (it waits for the
    embedding's gradient too), so every other bucket must be on its way before it. Buckets
    packed in forward order put l0 (wte) in the first bucket, which must go first: nothing
    launches until backward is over (no overlap), and both checks fail."""
    for res in results(world, "launch_order"):
        expected = []
        for name in (f"layers.{i}.weight" for i in (3, 2, 1, 0)):
            expected += [("ready", name), ("launch", [name])]
        assert res["chain"] == expected
        kinds = [kind for kind, _ in res["gpt"]]
        last_ready = len(kinds) - 1 - kinds[::-1].index("ready")
        early = kinds[:last_ready].count("launch")
        assert early == kinds.count("launch") - 1 >= 3, f"launched before the end: {early}"
