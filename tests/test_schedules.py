"""05b_schedules.py: schedules against hand-worked timelines; every schedule's table run
by the executor, p and m against one process (loss and every gradient), against 05's two
loops (the naive GPipe's order and gradients, the 1F1B loop's order and messages are the
plan's) and against torch.distributed.pipelining; NCCL's rule on paper and emulated on
gloo; DP x PP and TP x PP; the loss scale, evaluation and bf16 messages; bad configs.

Each world size is spawned ONCE (`_world`) and runs every case, 05's loops included
(tests/test_pipeline.py's, whose helpers this file shares)."""

import functools
import importlib
import json
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist

from tests.distributed import nccl_p2p_rules, run_ranks
from tests.test_pipeline import (
    CFG,
    MICRO,
    TOL,
    _grads,
    _loops,
    _torch_pipelining,
    assert_matches_reference,
    make_batch,
    make_model,
    reference,
)

pipe = importlib.import_module("05_pipeline")
pp = importlib.import_module("05b_schedules")
model_lib = importlib.import_module("02_model")
# zb1 runs only on chunks 05c split: tests/test_zero_bubble.py holds its proofs.
PLAIN = tuple(s for s in pp.SCHEDULES if s != "zb1")


def cases(p: int):
    """Every (schedule, m, v) the issue asks for at this p: m = 1..8; interleaved v=2,
    m % p == 0."""
    for schedule in PLAIN:
        v = 2 if schedule == "interleaved" else 1
        for m in range(1, 9):
            if schedule != "interleaved" or m % p == 0:
                yield schedule, m, v


# ---------------------------------------------------------------------------------------------
# Inside the spawned ranks
# ---------------------------------------------------------------------------------------------
def _step(
    model, rank, p, schedule, m, v, group, embed_group, batch, wrap=None, **kwargs
):
    chunks = pipe.split_model(model, rank, p, v)
    if wrap is not None:
        chunks = [wrap(c) for c in chunks]
    model.zero_grad(set_to_none=True)
    res = pp.pipeline_step(
        chunks, batch, m, schedule, group, embed_group=embed_group, **kwargs
    )
    return chunks, res


def _all_schedules(rank, p):
    """Every case on the whole world as one pipeline, p2p blocking as NCCL's does (gloo
    alone buffers sends and would forgive a grouping that hangs on GPUs)."""
    embed_group, out = pipe.embedding_group([list(range(p))]), {}
    with nccl_p2p_rules():
        for schedule, m, v in cases(p):
            model = make_model()
            chunks, res = _step(
                model, rank, p, schedule, m, v, None, embed_group, make_batch(MICRO * m)
            )
            out[(schedule, m)] = dict(
                loss=res.loss,
                grads=_grads(chunks),
                peak=res.peak_in_flight,
                events=res.events,
            )
    return out


def _ignored_targets(rank, p, m=4):
    """Every schedule on a batch whose microbatches hold 4 and 32 real target tokens."""
    embed_group, out = pipe.embedding_group([list(range(p))]), {}
    with nccl_p2p_rules():
        for schedule in PLAIN:
            v = 2 if schedule == "interleaved" else 1
            chunks, res = _step(
                make_model(),
                rank,
                p,
                schedule,
                m,
                v,
                None,
                embed_group,
                make_batch(MICRO * m, ignore=True),
            )
            out[schedule] = dict(loss=res.loss, grads=_grads(chunks))
    return out


def _bad_configs(rank, p):
    """Each bad call must raise before anything is sent; then a good step must still be
    exact (a stray message would be received by it and corrupt its activations)."""
    model, embed_group, errors = make_model(), pipe.embedding_group([list(range(p))]), {}
    chunks = pipe.split_model(model, rank, p)
    bad = {
        "batch": lambda: pp.pipeline_step(
            chunks, make_batch(5), 2, "1f1b", None, embed_group=embed_group
        ),
        "interleaved_m": lambda: pp.pipeline_step(
            pipe.split_model(model, rank, p, 2),
            make_batch(6),
            3,
            "interleaved",
            None,
            embed_group=embed_group,
        ),
        "virtual_1f1b": lambda: pp.pipeline_step(
            pipe.split_model(model, rank, p, 2),
            make_batch(4),
            2,
            "1f1b",
            None,
            embed_group=embed_group,
        ),
        "no_embed_group": lambda: pp.pipeline_step(
            chunks, make_batch(4), 2, "1f1b", None
        ),
        "wrong_rank": lambda: pp.pipeline_step(
            pipe.split_model(model, (rank + 1) % p, p),
            make_batch(4),
            2,
            "1f1b",
            None,
            embed_group=embed_group,
        ),
    }
    for name, call in bad.items():
        try:
            call()
            errors[name] = None
        except (ValueError, AssertionError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    _, res = _step(
        model, rank, p, "1f1b", 4, 1, None, embed_group, make_batch(MICRO * 4)
    )
    return errors, dict(loss=res.loss, grads=_grads(pipe.split_model(model, rank, p)))


def _dp_times_pp(rank, world):
    """pp=2 x dp=2 on 4 ranks, grid arange(4).view(pp, dp): PP groups {0,2} {1,3}, DP
    groups {0,1} {2,3}. Each DP replica runs its own pipeline on its half of the batch,
    every chunk wrapped in 03's bucketed DataParallel (tiny buckets, so there are
    several per chunk). The batch has ignored targets: replica 0's half holds 4 real
    tokens, replica 1's 32, so only normalising by the step's token count over both
    replicas gives one process's gradient."""
    ddp_lib, dp = importlib.import_module("03_ddp"), 2
    pp_rank, dp_rank = rank // dp, rank % dp
    pp_ranks, dp_ranks = [[0, 2], [1, 3]], [[0, 1], [2, 3]]
    pp_groups = [
        dist.new_group(r) for r in pp_ranks
    ]  # every rank creates every group, in order
    dp_groups = [dist.new_group(r) for r in dp_ranks]
    embed_group = pipe.embedding_group(pp_ranks)
    mp_lib, out = importlib.import_module("06_mixed_precision"), {}
    for schedule in PLAIN:
        m, v = 2, 2 if schedule == "interleaved" else 1
        x, y = make_batch(MICRO * m * dp, ignore=True)
        half = slice(dp_rank * MICRO * m, (dp_rank + 1) * MICRO * m)
        n_tokens = mp_lib.global_token_count([(x[half], y[half])], dp_groups[pp_rank])
        with nccl_p2p_rules():
            chunks, res = _step(
                make_model(),
                pp_rank,
                2,
                schedule,
                m,
                v,
                pp_groups[dp_rank],
                embed_group,
                (x[half], y[half]),
                wrap=lambda c: ddp_lib.DataParallel(c, 1e-3, dp_groups[pp_rank]),
                n_tokens=n_tokens,
                dp_size=dp,
            )
        loss = res.loss.clone()
        dist.all_reduce(loss, group=dp_groups[pp_rank])  # SUM of the replicas' shares
        syncs = [
            c.stats["syncs"] for c in chunks
        ]  # gradient all-reduce rounds, per chunk
        out[schedule] = dict(loss=loss, grads=_grads(chunks), syncs=syncs)
    return out


def _tp_times_pp(rank, world):
    """tp=2 x pp=2 on 4 ranks, grid arange(4).view(pp, tp): TP groups {0,1} {2,3}, PP
    groups {0,2} {1,3}. 04 (or 04b, with sequence parallelism) shards the model in place
    first; split_model then cuts the sharded model. With sequence parallelism the
    activation between stages is (b, T/tp, C)."""
    try:
        tp_lib = importlib.import_module("04_tensor_parallel")
        sp_lib = importlib.import_module("04b_sequence_parallel")
    except ImportError as e:
        return f"04 or 04b cannot be imported: {e}"
    tp, pp_rank = 2, rank // 2
    tp_groups = [dist.new_group(r) for r in ([0, 1], [2, 3])]
    pp_ranks = [[0, 2], [1, 3]]
    pp_groups = [dist.new_group(r) for r in pp_ranks]
    embed_group, out = pipe.embedding_group(pp_ranks), {}
    for apply in (tp_lib.apply_tensor_parallel, sp_lib.apply_sequence_parallel):
        sp = apply is sp_lib.apply_sequence_parallel
        for schedule, v in (("1f1b", 1), ("interleaved", 2)):
            model = apply(make_model(), tp_groups[pp_rank])
            T, C = CFG["block_size"], CFG["n_embd"]
            chunks = pipe.split_model(model, pp_rank, 2, v)
            with nccl_p2p_rules():
                res = pp.pipeline_step(
                    chunks,
                    make_batch(MICRO * 2),
                    2,
                    schedule,
                    pp_groups[rank % tp],
                    act_shape=(MICRO, T // tp if sp else T, C),
                    embed_group=embed_group,
                )
            out[(sp, schedule)] = dict(loss=res.loss, grads=_grads(chunks))
    return out


def _scaled_and_forward_only(rank, p):
    """train.py's two extra uses: fp16 loss scaling (backward from S·loss) and
    evaluation."""
    embed_group, batch = pipe.embedding_group([list(range(p))]), make_batch(MICRO * 4)
    model = make_model()
    chunks = pipe.split_model(model, rank, p)
    res = pp.pipeline_step(
        chunks, batch, 4, "1f1b", embed_group=embed_group, scale=1024.0
    )
    scaled = dict(loss=res.loss, grads={n: g / 1024 for n, g in _grads(chunks).items()})
    model.zero_grad(set_to_none=True)
    evaluated = pp.pipeline_step(chunks, batch, 4, "1f1b", forward_only=True)
    no_grads = all(q.grad is None for c in chunks for q in c.parameters())
    return dict(scaled=scaled, eval_loss=evaluated.loss, no_grads=no_grads)


def _compute_dtype(rank, p):
    """bf16 autocast two ways, 1F1B, m = 4: the old train.py's (the whole step inside
    torch.autocast, so activations and gradients travel in fp32) and dtype=bf16 (autocast
    around the forwards only, messages in bf16). Returns each one's loss, gradients and the
    bytes this rank's sends carried, counted at batch_isend_irecv."""
    embed_group, batch = pipe.embedding_group([list(range(p))]), make_batch(MICRO * 4)
    real = dist.batch_isend_irecv
    out = {}
    for name in ("fp32 travel", "bf16 travel"):
        sent = []

        def counting(ops, sent=sent):
            sent.extend(o.tensor.nbytes for o in ops if o.op is dist.isend)
            return real(ops)

        dist.batch_isend_irecv = counting
        try:
            model = make_model()
            chunks = pipe.split_model(model, rank, p)
            kwargs = dict(embed_group=embed_group)
            if name == "bf16 travel":
                res = pp.pipeline_step(chunks, batch, 4, dtype=torch.bfloat16, **kwargs)
            else:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    res = pp.pipeline_step(chunks, batch, 4, **kwargs)
        finally:
            dist.batch_isend_irecv = real
        out[name] = dict(loss=res.loss, grads=_grads(chunks), bytes=sum(sent))
    return out




def _rank_main(rank, world):
    torch.manual_seed(0)
    results = dict(
        all=_all_schedules(rank, world),
        loops=_loops(rank, world),  # 05's, to hold against the tables
        torch=_torch_pipelining(rank, world),
    )
    if world == 2:
        results["ignored"] = _ignored_targets(rank, world)
        results["bad"] = _bad_configs(rank, world)
        results["scaled"] = _scaled_and_forward_only(rank, world)
        results["dtype"] = _compute_dtype(rank, world)
    else:
        results["dp_pp"] = _dp_times_pp(rank, world)
        results["tp_pp"] = _tp_times_pp(rank, world)
    return results


@functools.cache
def _world(p: int):
    return run_ranks(_rank_main, p, timeout=240)


# ---------------------------------------------------------------------------------------------
# Checks (parent process)
# ---------------------------------------------------------------------------------------------
def test_loss_scale_and_forward_only():
    """scale=S: gradients are S times the true ones (a power of two: exact), the
    reported loss is unscaled. forward_only: the same loss, and no gradient anywhere."""
    results = _world(2)
    ref_loss, ref_grads = reference(4)
    assert_matches_reference(
        [r["scaled"]["scaled"] for r in results], ref_loss, ref_grads, "scale=1024"
    )
    torch.testing.assert_close(
        sum(r["scaled"]["eval_loss"] for r in results), ref_loss, **TOL
    )
    assert all(r["scaled"]["no_grads"] for r in results)


def test_bf16_activations_travel_in_bf16_at_half_the_bytes_and_equal_fp32_travel():
    """dtype=bf16: forwards under autocast, backward outside it, and what stages send each
    other (activations forward, their gradients back) in bf16: exactly half the bytes of
    the fp32 messages the old train.py sent (its autocast around the whole step). The
    results differ only by rounding each message to bf16 once (8 bits: 2^-9 relative) on
    top of autocast's own bf16 matmuls: the loss within 1e-3 relative, each gradient within
    2e-2 of its largest entry. A stage computing in fp32 or sending fp32 keeps the bytes."""
    results = _world(2)
    for rank, r in enumerate(results):
        fp32 = r["dtype"]["fp32 travel"]
        bf16 = r["dtype"]["bf16 travel"]
        assert fp32["bytes"] > 0 and bf16["bytes"] * 2 == fp32["bytes"], (rank, r["dtype"])
        torch.testing.assert_close(bf16["loss"], fp32["loss"], rtol=1e-3, atol=0)
        for name, g in fp32["grads"].items():
            scale = g.abs().max().item()
            torch.testing.assert_close(bf16["grads"][name], g, rtol=0, atol=2e-2 * scale,
                                       msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")  # fmt: skip


@pytest.mark.parametrize("p", [2, 4])
def test_every_schedule_equals_one_process(p):
    """Loss and every gradient (tied embeddings included), all schedules, m = 1..8."""
    results = _world(p)
    for schedule, m, _ in cases(p):
        ref_loss, ref_grads = reference(m)
        per_rank = [r["all"][(schedule, m)] for r in results]
        assert_matches_reference(
            per_rank, ref_loss, ref_grads, f"{schedule} p={p} m={m}"
        )


@pytest.mark.parametrize("p", [2, 4])
def test_naive_gpipe_is_the_tables_gpipe(p):
    """05's plain loop (all forwards, then all backwards, blocking sends under NCCL's
    rule), m = 1..8: it runs the GPipe table's order, holds all m microbatches on every
    stage as the executor's GPipe does, and gives the executor's gradients."""
    for m in range(1, 9):
        per_rank = [r["loops"][("naive", m)] for r in _world(p)]
        ran = [[pp.Action(*e[:3]) for e in r["events"]] for r in per_rank]
        assert ran == pp.simulate("gpipe", p, m)[0], (
            f"naive p={p} m={m}: not GPipe's order"
        )
        peaks = [r["all"][("gpipe", m)]["peak"] for r in _world(p)]
        assert [r["peak"] for r in per_rank] == peaks == [m] * p
        for naive, scheduled in zip(
            per_rank, (r["all"][("gpipe", m)] for r in _world(p))
        ):
            for n, g in naive["grads"].items():
                torch.testing.assert_close(g, scheduled["grads"][n], **TOL)


def loop_plan(traces, events):
    """A traced plain loop as a comm plan (pp.Tick per p2p group: the actions since the
    last group, then the group), so the simulator can check it. A send carries the
    output of the action just before it: (op, microbatch, this stage). A receive from
    stage r-1 is the next forward in order, from r+1 the next gradient; nccl_timeline
    checks both guesses, since each link's sends must equal its receives."""
    plan = []
    for r, (trace, done) in enumerate(zip(traces, events)):
        actions = iter(pp.Action(*e[:3]) for e in done)
        received = {r - 1: 0, r + 1: 0}  # messages from each neighbour so far
        ticks = []
        pending = []
        for item in trace:
            if item in ("F", "B"):
                pending.append(next(actions))
                assert pending[-1].op == item
                continue
            sends, recvs = item
            sent = ()
            if sends:  # a send follows the action whose output it carries
                last = pending[-1]
                assert all((q == r + 1) == (last.op == "F") for q in sends), (r, item)
                sent = tuple((q, (last.op, last.mb, r)) for q in sends)
            got = []
            for q in recvs:
                got.append((q, ("F" if q == r - 1 else "B", received[q], q)))
                received[q] += 1
            ticks.append(pp.Tick(tuple(pending), sent, tuple(got)))
            pending = []
        if pending:
            ticks.append(pp.Tick(tuple(pending), (), ()))
        plan.append(ticks)
    return plan


def flat(ticks):
    """A rank's plan as its actions in order, and the messages it sends to and receives
    from each neighbour, in order per link: what NCCL pairs. (Across its two links a
    rank may post them in other orders: the loop receives B0 before F2 on stage 2 of 4
    at m = 3, where the plan has F2 first.)"""
    actions = [a for t in ticks for a in t.actions]
    links = defaultdict(list)
    for t in ticks:
        for q, msg in t.sends:
            links[("to", q)].append(msg)
        for q, msg in t.recvs:
            links[("from", q)].append(msg)
    return actions, dict(links)


@pytest.mark.parametrize("p", [2, 4])
def test_1f1b_loop_is_the_plans_1f1b(p):
    """The explicit loop (warm-up p-r-1 forwards, steady send_forward_recv_backward /
    send_backward_recv_forward, cool-down), m = 1..8, run under the NCCL emulation: its
    forwards and backwards run in the plan's order, it sends and receives the plan's
    messages in the plan's order on each link, its own grouping completes under NCCL's
    rule with the bubble (p-1)/(m+p-1), at most min(p-r, m) microbatches are alive on
    stage r, and its loss and gradients equal one process's and the executor's 1F1B."""
    for m in range(1, 9):
        per_rank = [r["loops"][("loop", m)] for r in _world(p)]
        ref_loss, ref_grads = reference(m)
        assert_matches_reference(
            per_rank, ref_loss, ref_grads, f"1f1b loop p={p} m={m}"
        )
        executor = [r["all"][("1f1b", m)] for r in _world(p)]
        for loop, scheduled in zip(per_rank, executor):
            for n, g in loop["grads"].items():
                torch.testing.assert_close(g, scheduled["grads"][n], **TOL)
        ours = loop_plan(
            [r["trace"] for r in per_rank], [r["events"] for r in per_rank]
        )
        plan = pp.step_plan("1f1b", p, m, 1)
        for r in range(p):
            assert flat(ours[r]) == flat(plan[r]), f"1f1b loop p={p} m={m} rank {r}"
        timeline = pp.nccl_timeline(ours, 1)  # raises if the loop could hang on NCCL
        assert pipe.bubble_fraction(timeline) == pytest.approx(pp.bubble_formula(p, m))
        assert [r["peak"] for r in per_rank] == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize("p", [2, 4])
def test_executed_order_is_the_simulators(p):
    for schedule, m, v in cases(p):
        orders, _ = pp.simulate(schedule, p, m, v)
        ran = [
            [pp.Action(*e[:3]) for e in r["all"][(schedule, m)]["events"]]
            for r in _world(p)
        ]
        assert ran == orders, f"{schedule} p={p} m={m}"
        for r in _world(p):  # real, ordered, non-overlapping measured intervals
            events = r["all"][(schedule, m)]["events"]
            assert all(0 <= e.start <= e.end for e in events)
            assert all(a.end <= b.start for a, b in zip(events, events[1:]))


@pytest.mark.parametrize("p", [2, 4])
def test_peak_microbatches_in_flight(p):
    """Counted from the real stash of live activations. GPipe: all m on every stage.
    1F1B: stage r runs p-r-1 warm-up forwards, then one more before its first backward:
    min(p-r, m) <= p."""
    for m in range(1, 9):
        peaks = {
            s: [r["all"][(s, m)]["peak"] for r in _world(p)] for s in ("gpipe", "1f1b")
        }
        assert peaks["gpipe"] == [m] * p
        assert peaks["1f1b"] == [min(p - r, m) for r in range(p)]
        assert max(peaks["1f1b"]) <= p


@pytest.mark.parametrize("p", [2, 4])
def test_same_as_torch_distributed_pipelining(p):
    """ScheduleGPipe and Schedule1F1B from torch.distributed.pipelining (run for real on
    gloo), on the same PipelineChunk stages and batch: the same loss and gradients as
    the executor's GPipe and 1F1B and as one process."""
    ref_loss, ref_grads = reference(4)
    for name in ("gpipe", "1f1b"):
        theirs = [r["torch"][name] for r in _world(p)]
        assert_matches_reference(theirs, ref_loss, ref_grads, f"torch {name} p={p}")
        for ours, t in zip((r["all"][(name, 4)] for r in _world(p)), theirs):
            for n, g in t["grads"].items():
                torch.testing.assert_close(ours["grads"][n], g, **TOL)


def test_dp_times_pp_syncs_once_per_step():
    """pp=2 x dp=2: subset PP groups (peers via get_global_rank), the embedding group
    built collectively, and 03's DataParallel around each chunk: grads equal one process
    on the whole batch, and DP synchronises once per step and chunk (no_sync() on every
    earlier backward)."""
    results = _world(4)
    ref_loss, ref_grads = reference(
        2 * 2, ignore=True
    )  # both replicas' halves together
    for schedule in PLAIN:
        per_rank = [r["dp_pp"][schedule] for r in results]
        for r in (
            per_rank
        ):  # one synchronised backward per chunk: no_sync() on all the others
            assert r["syncs"] == [1] * (2 if schedule == "interleaved" else 1), (
                schedule,
                r,
            )
        for pipeline in ((0, 2), (1, 3)):  # each pipeline's stages hold the whole model
            stages = [per_rank[i] for i in pipeline]
            assert_matches_reference(
                stages, ref_loss, ref_grads, f"dp x pp {schedule} {pipeline}"
            )


def test_tp_times_pp():
    """split_model on a model 04 already made tensor-parallel (with and without sequence
    parallelism): the loss, and every rank's gradient shard equals the same slice of the
    one-process gradient (04's tp_layout/shard_tensor say which slice)."""
    results = _world(4)
    if isinstance(results[0]["tp_pp"], str):
        pytest.skip(results[0]["tp_pp"])
    tp_lib = importlib.import_module("04_tensor_parallel")
    ref_loss, ref_grads = reference(2)
    for key in results[0]["tp_pp"]:
        for rank, r in enumerate(results):
            tp_rank, case = rank % 2, r["tp_pp"][key]
            if rank >= 2:  # the last stage: the full loss on every TP rank
                torch.testing.assert_close(case["loss"], ref_loss, **TOL)
            for name, grad in case["grads"].items():
                full = ref_grads[
                    name if name in ref_grads else "transformer.wte.weight"
                ]
                layout = tp_lib.tp_layout(name)
                want = (
                    tp_lib.shard_tensor(full, *layout, tp_rank, 2) if layout else full
                )
                torch.testing.assert_close(
                    grad, want, **TOL, msg=lambda s, n=name, k=key: f"{k} {n}: {s}"
                )
        names = {n for r in results for n in r["tp_pp"][key]["grads"]}
        assert names | {"transformer.wte.weight"} >= set(ref_grads), key


def test_bad_configurations_fail_before_any_send():
    results = _world(2)
    expected = {
        "batch": "does not split into 2 microbatches",
        "interleaved_m": "divisible by pp_size",
        "virtual_1f1b": "needs schedule='interleaved'",
        "no_embed_group": "embed_group",
        "wrong_rank": "not split for this rank",
    }
    for errors, _ in (r["bad"] for r in results):
        for name, fragment in expected.items():
            assert errors[name] is not None and fragment in errors[name], (
                name,
                errors[name],
            )
    ref_loss, ref_grads = reference(4)
    assert_matches_reference(
        [r["bad"][1] for r in results], ref_loss, ref_grads, "after errors"
    )


def test_bad_configurations_in_one_process():
    with pytest.raises(AssertionError, match="cannot fill pp_size"):
        pp.check_config("interleaved", 4, 4, 3, n_layer=8)  # 8 blocks < 12 stages
    with pytest.raises(AssertionError, match="needs schedule='interleaved'"):
        pp.check_config("1f1b", 2, 4, 2)
    with pytest.raises(AssertionError, match="unknown schedule"):
        pp.check_config("zero-bubble", 2, 4)
    with pytest.raises(AssertionError, match="m=6, p=4"):
        pp.check_config("interleaved", 4, 6, 2)
    with pytest.raises(AssertionError, match="does not split"):
        pp.check_config("gpipe", 2, 3, batch_size=8)


def test_a_step_whose_targets_are_all_ignored_fails_loudly():
    """Every target -1 (all padding): the loss has no token to average over, so the step
    must raise, not divide by 0 into a NaN loss and NaN gradients: the executor with a
    caller's count (as train.py passes) and with the batch's own."""
    chunks = pipe.split_model(make_model(), 0, 1)
    x, y = make_batch(4)
    batch = (x, torch.full_like(y, -1))
    for n_tokens in (None, 0):
        with pytest.raises(AssertionError, match="every target of the step is -1"):
            pp.pipeline_step(chunks, batch, 2, "1f1b", n_tokens=n_tokens)


# ---------------------------------------------------------------------------------------------
# The single-process pipeline
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", PLAIN)
def test_one_process_pipeline_is_gradient_accumulation(schedule):
    """p = 1 needs no process group: chunks hand over in-process, m microbatches
    accumulate."""
    v = 2 if schedule == "interleaved" else 1
    model = make_model()
    chunks = pipe.split_model(model, 0, 1, v)
    res = pp.pipeline_step(chunks, make_batch(MICRO * 4), 4, schedule)
    ref_loss, ref_grads = reference(4)
    assert_matches_reference(
        [dict(loss=res.loss, grads=_grads(chunks))], ref_loss, ref_grads, schedule
    )
    # GPipe holds all m = 4; 1F1B at p = 1 has no warm-up: one alive; interleaved warms
    # up with (v-1)·p = 1 chunk-forward, so two (microbatch, chunk) activations are
    # alive at most.
    assert res.peak_in_flight == {"gpipe": 4, "1f1b": 1, "interleaved": 2}[schedule]


# ---------------------------------------------------------------------------------------------
# The simulator against timelines worked out by hand
# ---------------------------------------------------------------------------------------------
def timeline(sim_rank):
    return [
        (f"{e.op}{e.mb}" + "ab"[e.chunk] * (e.chunk > 0), e.start, e.end)
        for e in sim_rank
    ]


def test_1f1b_p2_m3_by_hand():
    """t_f = 1, t_b = 2. Rank 0 warms up with p-0-1 = 1 forward, rank 1 with none:
        rank 0 order: F0 F1 B0 F2 B1 B2        rank 1 order: F0 B0 F1 B1 F2 B2
    r0 F0 [0,1]. r1 F0 needs it: [1,2]; r0 F1 [1,2]. r1 B0 (last stage: needs its own F0) [2,4].
    r0 B0 needs r1's B0: [4,6]. r1 F1 needs r0's F1 (t=2) and itself free (t=4): [4,5]; B1 [5,7].
    r0 F2 [6,7]; r0 B1 needs r1 B1 (7): [7,9]. r1 F2 needs r0 F2 (7): [7,8]; B2 [8,10].
    r0 B2 [10,12]. Makespan 12, 9 busy per rank: bubble 3/12 = (p-1)/(m+p-1) = 1/4.
        r0  F0 F1 .  .  B0 B0 F2 B1 B1 .  B2 B2
        r1  .  F0 B0 B0 F1 B1 B1 F2 B2 B2 .  ."""
    _, sim = pp.simulate("1f1b", 2, 3, 1, t_f=1, t_b=2)
    assert timeline(sim[0]) == [
        ("F0", 0, 1),
        ("F1", 1, 2),
        ("B0", 4, 6),
        ("F2", 6, 7),
        ("B1", 7, 9),
        ("B2", 10, 12),
    ]
    assert timeline(sim[1]) == [
        ("F0", 1, 2),
        ("B0", 2, 4),
        ("F1", 4, 5),
        ("B1", 5, 7),
        ("F2", 7, 8),
        ("B2", 8, 10),
    ]
    assert pipe.bubble_fraction(sim) == pytest.approx(1 / 4)


def test_gpipe_p2_m2_by_hand():
    """t_f = 1, t_b = 2. All forwards, then all backwards, microbatch 0 first:
        r0  F0 F1 .  .  .  .  B0 B0 B1 B1  -> r0 F0 [0,1] F1 [1,2], B0 after r1's B0 [5,7], B1 [7,9]
        r1  .  F0 F1 B0 B0 B1 B1 .  .      -> r1 F0 [1,2] F1 [2,3] B0 [3,5] B1 [5,7]
    Makespan 9, 6 busy per rank: bubble 3/9 = (p-1)/(m+p-1) = 1/3."""
    _, sim = pp.simulate("gpipe", 2, 2, 1, t_f=1, t_b=2)
    assert timeline(sim[0]) == [("F0", 0, 1), ("F1", 1, 2), ("B0", 5, 7), ("B1", 7, 9)]
    assert timeline(sim[1]) == [("F0", 1, 2), ("F1", 2, 3), ("B0", 3, 5), ("B1", 5, 7)]
    assert pipe.bubble_fraction(sim) == pytest.approx(1 / 3)


def test_interleaved_p2_m2_v2_by_hand():
    """Megatron's interleaved 1F1B, p=2, v=2: stages 0,1,2,3 live on ranks 0,1,0,1 (chunks a,a,b,b).
    Forward virtual microbatch k is (mb, chunk) = (k//4*2 + k%2, k%4//2): F0a F1a F0b F1b; the
    backwards visit chunks in reverse: B0b B1b B0a B1a. Warm-up 2(p-r-1) + (v-1)p: rank 0: 4 (all),
    rank 1: 2. So rank 0: F0a F1a F0b F1b B0b B1b B0a B1a, rank 1: F0a F1a F0b B0b F1b B1b B0a B1a.
    With t_f = t_b = 2 per rank, a chunk's step takes 1:
        r0  F0a F1a F0b F1b  .  B0b  .  B1b B0a B1a       busy 8 of 10
        r1   .  F0a F1a F0b B0b F1b B1b B0a B1a  .
    r0 F0b needs r1's F0a (ends 2) [2,3], F1b [3,4]; r1 F0b needs r0 F0b: [3,4], then B0b [4,5],
    F1b [5,6], B1b [6,7]. r0 B0b needs r1 B0b: [5,6], B1b [7,8]; r1 B0a [7,8], B1a [8,9];
    r0 B0a [8,9], B1a [9,10]. Bubble 2/10 = (p-1)/(v·m+p-1) = 1/5, where 1F1B needs 1/3."""
    _, sim = pp.simulate("interleaved", 2, 2, 2, t_f=2, t_b=2)
    assert timeline(sim[0]) == [
        ("F0", 0, 1),
        ("F1", 1, 2),
        ("F0b", 2, 3),
        ("F1b", 3, 4),
        ("B0b", 5, 6),
        ("B1b", 7, 8),
        ("B0", 8, 9),
        ("B1", 9, 10),
    ]
    assert timeline(sim[1]) == [
        ("F0", 1, 2),
        ("F1", 2, 3),
        ("F0b", 3, 4),
        ("B0b", 4, 5),
        ("F1b", 5, 6),
        ("B1b", 6, 7),
        ("B0", 7, 8),
        ("B1", 8, 9),
    ]
    assert pipe.bubble_fraction(sim) == pytest.approx(1 / 5)


def test_simulated_bubble_is_the_formula_and_nothing_deadlocks():
    """Over many shapes and t_b/t_f ratios the ideal timeline's idle share is the closed
    form (p-1)/(v·m+p-1) (Megatron-LM sec. 2.2), and every order passes the deadlock and
    message-pairing checks inside simulate()."""
    for schedule in PLAIN:
        for p in (1, 2, 3, 4, 8):
            for m in range(1, 17):
                for v in (1, 2, 3) if schedule == "interleaved" else (1,):
                    if schedule == "interleaved" and m % p:
                        continue
                    for t_b in (1.0, 2.0):
                        _, sim = pp.simulate(schedule, p, m, v, 1.0, t_b)
                        expected = (p - 1) / (v * m + p - 1)
                        assert pipe.bubble_fraction(sim) == pytest.approx(expected), (
                            schedule,
                            p,
                            m,
                            v,
                        )


def old_grouping(schedule, p, m, v):
    """The executor before NCCL's rule was modelled: before each action one group =
    {send the previous action's output, receive this action's input}, waited as a whole.
    Interleaved p=2, m=4, v=2 then hangs on GPUs: after B0 of chunk b, rank 0 posts
    {send B0's gradient, receive F2's input}; rank 1 receives that gradient only in the
    group it posts after F2 of chunk a, which comes after the group it posts after B1 of
    chunk b, {send B1's gradient, receive F2's input}, and rank 0 receives B1's gradient
    only after its F3 of chunk a, which it cannot reach while its own group waits. Each
    waits on the other's later group."""
    plan = []
    for r in range(p):
        ticks, prev = [], None
        order = [a for step in pp.schedule_steps(schedule, p, m, v, r) for a in step]
        for a in order + [None]:
            dst = prev and pp.consumer_rank(prev, r, p, v)
            need = a and pp.input_message(
                a, a.chunk * p + r, p * v
            )  # made on rank need[2] % p
            sends = (
                ((dst, (prev.op, prev.mb, prev.chunk * p + r)),)
                if dst not in (None, r)
                else ()
            )
            recvs = (
                ((need[2] % p, need),) if need and need[2] % p != r else ()
            )  # p=1: local
            ticks.append(pp.Tick((prev,) if prev else (), sends, recvs))
            prev = a
        plan.append(
            ticks if ticks[0].recvs else ticks[1:]
        )  # rank 0 starts by computing
    return plan


def test_the_executors_groups_complete_under_nccls_rule():
    """Every schedule, p <= 8, m <= 16, v <= 3: the plan the executor runs never hangs
    when a send completes only once its receive is posted, nor does evaluation's
    (forward_only: every forward once, no backward). The old grouping hangs in every
    interleaved case with m > p (38 of them here; e.g. p=2, m=4, v=2, the case found in
    review) and in none with m = p, nor for GPipe or 1F1B: the checker tells them
    apart."""
    hung = []
    for schedule in PLAIN:
        for p in range(1, 9):
            for m in range(1, 17):
                for v in (1, 2, 3) if schedule == "interleaved" else (1,):
                    if schedule == "interleaved" and m % p:
                        continue
                    steps = [pp.schedule_steps(schedule, p, m, v, r) for r in range(p)]
                    pp.nccl_timeline(
                        pp.comm_plan(steps, p, v), v
                    )  # raises if it would hang
                    evaluation = pp.step_plan(schedule, p, m, v, forward_only=True)
                    ran = pp.nccl_timeline(
                        evaluation, v
                    )  # evaluation's forwards alone, too
                    assert all(e.op == "F" for events in ran for e in events)
                    assert (
                        sum(map(len, ran)) == p * m * v
                    )  # every (microbatch, stage) once
                    try:
                        pp.nccl_timeline(old_grouping(schedule, p, m, v), v)
                    except RuntimeError:
                        hung.append((schedule, p, m, v))
    assert ("interleaved", 2, 4, 2) in hung
    assert all(s == "interleaved" and m > p for s, p, m, _ in hung), hung
    assert len(hung) == sum(
        1 for v in (2, 3) for p in range(2, 9) for m in range(2 * p, 17, p)
    )


def naive_plan(p, m):
    """gpipe_naive's calls as a comm plan: each blocking receive, and each forward or
    backward with its blocking send, is a group of its own. Stage r: receive F_i from
    r-1, compute F_i, send it to r+1, for every i; then receive B_i from r+1, compute
    B_i, send it to r-1."""
    plan = []
    for r in range(p):
        ticks = []
        for op, src, dst in (("F", r - 1, r + 1), ("B", r + 1, r - 1)):
            for i in range(m):
                if (
                    0 <= src < p
                ):  # not the first stage's forward, nor the last's backward
                    ticks.append(pp.Tick((), (), ((src, (op, i, src)),)))
                send = ((dst, (op, i, r)),) if 0 <= dst < p else ()
                ticks.append(pp.Tick((pp.Action(op, i, 0),), send, ()))
        plan.append(ticks)
    return plan


def test_naive_gpipe_cannot_hang_under_nccls_rule():
    """gpipe_naive's docstring argues its blocking calls never hang on NCCL; here the
    simulator checks it for p <= 8, m <= 16: the plan completes, in GPipe's order, with
    GPipe's ideal bubble (p-1)/(m+p-1). The checker is not blind to such loops: if
    rank 0 waits for its first gradient before sending its last forward, all ranks hang."""
    for p in range(1, 9):
        for m in range(1, 17):
            timeline = pp.nccl_timeline(naive_plan(p, m), 1)  # raises if it would hang
            order = [[pp.Action(*e[:3]) for e in events] for events in timeline]
            assert order == pp.simulate("gpipe", p, m)[0], (p, m)
            assert pipe.bubble_fraction(timeline) == pytest.approx(
                pp.bubble_formula(p, m)
            )
    plan = naive_plan(2, 3)  # rank 0: F0+send, F1+send, F2+send, receive B0, B0, ...
    plan[0][2], plan[0][3] = plan[0][3], plan[0][2]  # receive B0 before F2 and its send
    with pytest.raises(RuntimeError, match="deadlock under NCCL's rule"):
        pp.nccl_timeline(plan, 1)


def _groups(plan):
    """A plan as [(computed, sent, received)] per rank, messages named like F0 or B1."""
    name = lambda op, mb, *_: f"{op}{mb}"  # noqa: E731
    return [
        [
            (
                " ".join(name(*a) for a in t.actions),
                [name(*m) for _, m in t.sends],
                [name(*m) for _, m in t.recvs],
            )
            for t in ticks
        ]
        for ticks in plan
    ]


def test_1f1b_p2_m4_groups_pair_like_megatron():
    """Worked example, derived tick by tick. Rank 0 runs F0 F1 B0 F2 B1 F3 B2 B3 and
    rank 1 F0 B0 F1 B1 F2 B2 F3 B3. In the steady state rank 0, after a forward, posts
    {send it, receive a gradient} (Megatron's send_forward_recv_backward) in the same
    tick as rank 1, after a backward, posts the mirror group {send the gradient, receive
    a forward} (send_backward_recv_forward): the groups match one to one."""
    steps = [pp.schedule_steps("1f1b", 2, 4, 1, r) for r in range(2)]
    rank0, rank1 = _groups(pp.comm_plan(steps, 2, 1))
    assert rank0 == [
        ("F0", ["F0"], []),
        ("F1", ["F1"], []),
        ("", [], ["B0"]),
        ("B0", [], []),
        ("F2", ["F2"], ["B1"]),
        ("B1", [], []),
        ("F3", ["F3"], ["B2"]),
        ("B2", [], []),
        ("", [], ["B3"]),
        ("B3", [], []),
    ]
    assert rank1 == [
        ("", [], ["F0"]),
        ("F0", [], ["F1"]),
        ("B0", ["B0"], []),
        ("F1", [], []),
        ("B1", ["B1"], ["F2"]),
        ("F2", [], []),
        ("B2", ["B2"], ["F3"]),
        ("F3", [], []),
        ("B3", ["B3"], []),
    ]


def test_interleaved_steady_state_exchanges_after_each_forward_backward_pair():
    """Interleaved p=2, m=4, v=2 (the case that hung): in the steady state a step is a
    forward and a backward (Megatron's send_forward_backward_recv_forward_backward after
    both), and every group of rank 0 is matched by rank 1's group of the same tick, so
    the plan runs under NCCL's rule (nccl_timeline would raise otherwise) with the
    bubble of the formula."""
    steps = [pp.schedule_steps("interleaved", 2, 4, 2, r) for r in range(2)]
    assert [len(s) for s in steps[1]] == [1, 1] + [2] * 6 + [1, 1]  # warm-up 2 = (v-1)p
    timeline = pp.nccl_timeline(pp.comm_plan(steps, 2, 2), 2, t_f=1.0, t_b=2.0)
    assert pipe.bubble_fraction(timeline) == pytest.approx(pp.bubble_formula(2, 4, 2))


def test_ignored_targets_are_normalised_by_the_steps_tokens():
    """Microbatches with 4 and 32 real tokens: each contributes its token SUM over the
    step's count, so every schedule equals one process's mean over the real tokens. The
    old mean of per-microbatch means was off by up to 0.24 in a gradient here (same
    tolerance as above)."""
    ref_loss, ref_grads = reference(4, ignore=True)
    for schedule in PLAIN:
        per_rank = [r["ignored"][schedule] for r in _world(2)]
        assert_matches_reference(
            per_rank, ref_loss, ref_grads, f"{schedule}, ignored targets"
        )


def test_simulator_catches_a_deadlock():
    """A rank that wants microbatch 0's backward before its forward can never run."""

    def broken(schedule, p, m, v, rank):
        return [(pp.Action("B", 0, 0),), (pp.Action("F", 0, 0),)]

    original = pp.schedule_steps
    pp.schedule_steps = broken
    try:
        with pytest.raises(RuntimeError, match="deadlock"):
            pp.simulate("1f1b", 2, 1)
    finally:
        pp.schedule_steps = original


def test_figures_are_written(tmp_path, monkeypatch):
    """The lesson's Gantt PNGs (`--plot`'s simulated one, drawn by 05b), and the Chrome
    trace bench/bench_pipeline.py writes (one X slice per action, a thread per rank),
    drawn by support/pipeline/gantt.py."""
    from support.pipeline.gantt import plot_timelines, write_chrome_trace

    monkeypatch.chdir(tmp_path)  # --plot writes under out/pipeline/
    simulated = pp.plot_simulated(2, 4, 2)
    assert simulated.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    timelines = {
        s: pp.simulate(s, 2, 4, 2 if s == "interleaved" else 1, 0.01, 0.02)[1]
        for s in pp.SCHEDULES
    }
    plot_timelines(timelines, tmp_path / "gantt.png")
    write_chrome_trace(timelines, tmp_path / "trace.json")
    assert (tmp_path / "gantt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    slices = [e for e in trace if e["ph"] == "X"]
    assert len(slices) == sum(len(ev) for tl in timelines.values() for ev in tl)
    assert {e["tid"] for e in slices} == {0, 1} and all(e["dur"] > 0 for e in slices)


def test_demo_refuses_a_bad_configuration_before_launching(monkeypatch, capsys):
    """`python 05b_schedules.py --microbatches 6` at the default 4 ranks: interleaved
    needs m % p == 0, so the parser says why in one line and exits 2, before any
    torchrun is started."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        pp.main(["--microbatches", "6"])
    assert (
        exit_info.value.code == 2 and "divisible by pp_size" in capsys.readouterr().err
    )
