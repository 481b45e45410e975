"""05c_zero_bubble.py: the B/W split and 05b's zb1 table (ZB-H1, arXiv 2401.10241).

Worked example, p = 2, m = 2, t_f = t_B = t_W = 1 (05b's defaults t_b = 2, t_w = t_b/2).
Stage 1 (the last) puts off its first W: F0 B0 F1 B1 W0 W1; stage 0 none: F0 F1 B0 W0 B1
W1. r0 F0 [0,1] F1 [1,2]; r1 F0 [1,2] B0 [2,3]; r0 B0 [3,4] W0 [4,5]; r1 F1 [3,4] (r0's
F1 came at 2, and r1 was busy until 3) B1 [4,5] W0 [5,6] W1 [6,7]; r0 B1 [5,6] W1 [6,7].
Span 7, 6 busy per rank: bubble/ideal 1/6 = (p-1)/(3m), where 1F1B's is 1/2 = (p-1)/m.

The split must change no number: each deferred weight gradient is bit for bit
autograd's in fp32 (the same matmuls on the same tensors, added into .grad in the same
microbatch order), so ZB-H1 equals 1F1B exactly and one process within test_pipeline's
TOL. torch.distributed.pipelining's ScheduleInterleavedZeroBubble runs on gloo on CPU
with one stage a rank (its zero-bubble 1F1B): its action order is our zb1 table's, and
its gradients ours. Each world size is spawned once (`_world`) and runs every case.
"""

import functools
import importlib
import re

import pytest
import torch

from tests.distributed import nccl_p2p_rules, run_ranks
from tests.test_pipeline import (
    MICRO,
    TOL,
    _grads,
    assert_matches_reference,
    make_batch,
    make_model,
    reference,
)

pipe = importlib.import_module("05_pipeline")
pp = importlib.import_module("05b_schedules")
zb = importlib.import_module("05c_zero_bubble")
model_lib = importlib.import_module("02_model")


def split_chunks(model, rank, p, schedule="zb1"):
    """split_model's chunks, split by 05c for zb1."""
    chunks = pipe.split_model(model, rank, p)
    return [zb.split_weight_grads(c) for c in chunks] if schedule == "zb1" else chunks


# ---------------------------------------------------------------------------------------------
# Inside the spawned ranks
# ---------------------------------------------------------------------------------------------
def _schedules(rank, p):
    """1F1B and ZB-H1 at m = p and 2p under the NCCL emulation, then zb1's evaluation."""
    embed_group = pipe.embedding_group([list(range(p))])
    out = {}
    with nccl_p2p_rules():
        for m in (p, 2 * p):
            for schedule in ("1f1b", "zb1"):
                chunks = split_chunks(make_model(), rank, p, schedule)
                batch = make_batch(MICRO * m)
                res, kept = zb.measured_step(chunks[0], batch, m, schedule, embed_group)
                queue = getattr(chunks[0], "weight_grads", None)
                out[(schedule, m)] = dict(
                    loss=res.loss,
                    grads=_grads(chunks),
                    peak=res.peak_in_flight,
                    events=res.events,
                    w_bytes=queue.peak_bytes if queue else 0,
                    acts=kept.first,
                    kept=kept.peak,
                )
            chunks[0].zero_grad(set_to_none=True)
            res = pp.pipeline_step(chunks, batch, m, "zb1", forward_only=True)
            no_grads = all(q.grad is None for q in chunks[0].parameters())
            idle = not chunks[0].weight_grads.pending
            out[("eval", m)] = dict(loss=res.loss, clean=no_grads and idle)
    return out


def _torch_zero_bubble(rank, p):
    """PyTorch's ScheduleInterleavedZeroBubble, one stage a rank, m = p and 2p, on our
    PipelineChunk stages: its loss, gradients and every rank's actions in order."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    embed_group = pipe.embedding_group([list(range(p))])
    out = {}
    for m in (p, 2 * p):
        model = make_model()
        (chunk,) = pipe.split_model(model, rank, p)
        stage = PipelineStage(chunk, rank, p, torch.device("cpu"))
        loss_fn = model_lib.cross_entropy_loss  # its mean over microbatches: ours
        schedule = ScheduleInterleavedZeroBubble([stage], m, loss_fn=loss_fn)
        x, y = make_batch(MICRO * m)
        losses = []
        if rank == 0:
            schedule.step(x, target=y, losses=losses)
        else:
            schedule.step(target=y, losses=losses)
        pipe.allreduce_tied_grads([chunk], embed_group)  # torch's stages know no tying
        loss = torch.stack(losses).mean().detach() if losses else None
        order = [
            [str(a) for a in ops if a is not None]
            for ops in schedule.pipeline_order.values()
        ]
        out[m] = dict(loss=loss, grads=_grads([chunk]), order=order)
    return out


def _dp_times_pp(rank, world):
    """pp=2 x dp=2 (grid arange(4).view(pp, dp)), zb1, every chunk in 03's DataParallel:
    the B's add nothing DP sends, so DP must sync in each chunk's last W, once."""
    ddp_lib = importlib.import_module("03_ddp")
    dp = 2
    pp_rank = rank // dp
    dp_rank = rank % dp
    pp_groups = [torch.distributed.new_group(r) for r in ([0, 2], [1, 3])]
    dp_groups = [torch.distributed.new_group(r) for r in ([0, 1], [2, 3])]
    embed_group = pipe.embedding_group([[0, 2], [1, 3]])
    m = 2
    x, y = make_batch(MICRO * m * dp)
    half = slice(dp_rank * MICRO * m, (dp_rank + 1) * MICRO * m)
    chunks = split_chunks(make_model(), pp_rank, 2)
    wrap = [ddp_lib.DataParallel(c, 1e-3, dp_groups[pp_rank]) for c in chunks]
    with nccl_p2p_rules():
        kw = dict(embed_group=embed_group, dp_size=dp, n_tokens=y.numel())  # both
        res = pp.pipeline_step(
            wrap, (x[half], y[half]), m, "zb1", pp_groups[dp_rank], **kw
        )
    loss = res.loss.clone()
    torch.distributed.all_reduce(loss, group=dp_groups[pp_rank])
    return dict(loss=loss, grads=_grads(chunks), syncs=[c.stats["syncs"] for c in wrap])


def _rank_main(rank, world):
    torch.manual_seed(0)
    results = dict(zb=_schedules(rank, world), torch=_torch_zero_bubble(rank, world))
    if world == 4:
        results["dp_pp"] = _dp_times_pp(rank, world)
    return results


@functools.cache
def _world(p: int):
    return run_ranks(_rank_main, p, timeout=240)


# ---------------------------------------------------------------------------------------------
# One process: the split itself
# ---------------------------------------------------------------------------------------------
def test_one_linear_defers_dw_and_db_bit_for_bit():
    """B gives dX and leaves dW, db to W; all three torch.equal autograd's (fp32)."""
    zb.one_linear_check()


def test_one_stage_defers_every_matrix_bit_for_bit_and_keeps_the_formulas_bytes():
    """The GPT as one stage, fp32: after B only LayerNorm's weights hold gradients; after
    W every gradient is torch.equal autograd's, and the queue held w_bytes_formula's bytes
    (worked: 2 blocks of C = 16 at b·T = 32 tokens: 2·16·16·32·4 = 65,536; the head,
    (16 + 64)·32·4 = 10,240; ids 8·(32 + 8) = 320 and wte's and wpe's dY 4·16·(32 + 8) =
    2,560: 78,656 bytes)."""
    config = model_lib.GPTConfig(
        n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=64
    )
    assert zb.w_bytes_formula(config, 4, 8, 2, True, True) == 78_656
    zb.stage_check(config, make_batch(4))


def test_w_adds_each_gradient_into_grad_before_computing_the_next():
    """W holds one weight's gradient at a time: each dW (logged when computed) is added
    into .grad (logged by a post-accumulate hook) before the next dW is computed. The
    tied wte/lm_head, both on this one stage, is added once, after both of its dWs."""
    (chunk,) = split_chunks(make_model(n_layer=2), 0, 1)
    queue = chunk.weight_grads
    queue.mb = 0
    x, y = make_batch(2)
    chunk.loss_fn(chunk(x), y, "sum").backward()  # B
    names = {q: n for n, q in chunk.named_parameters()}
    log = []
    for q in chunk.parameters():
        q.register_post_accumulate_grad_hook(lambda q: log.append(("add", names[q])))

    def logged(fn, name):
        def grad_fn(*tensors):
            log.append(("dW", name))
            return fn(*tensors)

        return grad_fn

    work = queue.pending[0]
    queue.pending[0] = [(q, logged(fn, names[q]), t) for q, fn, t in work]
    queue.run(0)  # W
    tied = "transformer.wte.weight"
    untied = [entry for entry in log if entry[1] != tied]
    assert untied == [(op, n) for _, n in untied[::2] for op in ("dW", "add")]
    assert [op for op, n in log if n == tied] == ["dW", "dW", "add"]
    assert len(untied) == 2 * (len(work) - 2)  # every deferred weight but the tied


def test_a_padding_idx_embedding_is_refused():
    """nn.Embedding passes padding_idx to F.embedding positionally: 0 must be refused
    too (SplitEmbedding's dW would count the padding row)."""
    table = torch.nn.Embedding(10, 4, padding_idx=0)
    queue = zb.WeightGradQueue()
    with zb.DeferWeightGrads(queue, table.parameters()):
        with pytest.raises(AssertionError, match="no padding_idx"):
            table(torch.tensor([[1, 0]]))


def test_bf16_split_equals_autocasts_linear():
    """Under bf16 autocast the split casts as autocast does (x, W, b to bf16, saved
    cast): the loss and every gradient equal autograd's own autocast run, and the queue
    keeps w_bytes_formula's bytes with a = 2 (bf16 X and dY), res = 4 (the embeddings'
    dY, in the fp32 residual stream)."""
    model = make_model(n_layer=2)
    x, y = make_batch(4)
    with torch.autocast("cpu", torch.bfloat16):
        _, loss = model(x, y)
    loss.backward()
    ref = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    (chunk,) = split_chunks(model, 0, 1)
    res = pp.pipeline_step([chunk], (x, y), 2, "zb1", dtype=torch.bfloat16)
    for n, q in chunk.named_parameters():
        scale = ref[n].abs().max().item()
        torch.testing.assert_close(q.grad, ref[n], rtol=0, atol=2e-2 * scale)
    torch.testing.assert_close(res.loss, loss.detach(), rtol=1e-2, atol=0)
    b, T = x.size(0) // 2, x.size(1)
    bf16 = zb.w_bytes_formula(model.config, b, T, 2, True, True, a=2, res=4)
    assert chunk.weight_grads.peak_bytes == bf16


def test_one_process_zb1_is_gradient_accumulation_and_a_missing_w_or_split_fails():
    """p = 1: B and W of m = 4 microbatches accumulate one process's gradients (the tied
    wte/lm_head on one chunk: two deferred gradients for one Parameter, both added).
    Unsplit, a W fails naming 05c; a W dropped from the plan fails at the step's end;
    a W run twice fails in the queue."""
    chunks = split_chunks(make_model(), 0, 1)
    res = pp.pipeline_step(chunks, make_batch(MICRO * 4), 4, "zb1")
    ref_loss, ref_grads = reference(4)
    got = [dict(loss=res.loss, grads=_grads(chunks))]
    assert_matches_reference(got, ref_loss, ref_grads, "zb1 p=1")
    assert res.peak_in_flight == 1
    plain = pipe.split_model(make_model(), 0, 1)
    with pytest.raises(AssertionError, match="05c_zero_bubble"):
        pp.pipeline_step(plain, make_batch(4), 2, "zb1")
    ticks = pp.step_plan("zb1", 1, 2, 1)[0]
    dropped = [
        pp.Tick(tuple(a for a in t.actions if a != pp.Action("W", 1, 0)), *t[1:])
        for t in ticks
    ]
    chunks = split_chunks(make_model(), 0, 1)
    step = pp.Microbatches(chunks, make_batch(4), 2, None, "zb1", None)
    pp.run_plan(step, dropped)
    with pytest.raises(AssertionError, match=r"\(1, 0\)\] ran B but never W"):
        step.result()
    with pytest.raises(AssertionError, match="or run twice"):
        chunks[0].weight_grads.run(0)


# ---------------------------------------------------------------------------------------------
# On paper: the table, the simulator and NCCL's rule
# ---------------------------------------------------------------------------------------------
def bubble_rate(timeline):
    return zb.bubble_rate(timeline)


def test_p2_m2_by_hand():
    """The docstring's worked example."""
    _, sim = pp.simulate("zb1", 2, 2)
    name = lambda e: (f"{e.op}{e.mb}", e.start, e.end)  # noqa: E731
    assert [name(e) for e in sim[0]] == [
        ("F0", 0, 1),
        ("F1", 1, 2),
        ("B0", 3, 4),
        ("W0", 4, 5),
        ("B1", 5, 6),
        ("W1", 6, 7),
    ]
    assert [name(e) for e in sim[1]] == [
        ("F0", 1, 2),
        ("B0", 2, 3),
        ("F1", 3, 4),
        ("B1", 4, 5),
        ("W0", 5, 6),
        ("W1", 6, 7),
    ]
    assert bubble_rate(sim) == pytest.approx(1 / 6)


def test_the_lessons_pictures_are_the_simulators():
    """05c's docstring draws 1F1B, then ZB-H1, at p=4, m=8 on one clock, a slot per
    t_f (1F1B's backward fills two: B0--): each is the simulated timeline, slot by
    slot, 33 and 27 slots long."""
    doc = zb.__doc__.splitlines()
    rows = [line[7:] for line in doc if re.match(r"    r\d ", line)]
    assert len(rows) == 8
    for picture, schedule in enumerate(("1f1b", "zb1")):
        _, sim = pp.simulate(schedule, 4, 8)
        for r, events in enumerate(sim):
            drawn = [" ."] * int(max(e.end for e in events))
            for e in events:
                drawn[int(e.start)] = f"{e.op}{e.mb}"
                drawn[int(e.start) + 1 : int(e.end)] = ["--"] * int(e.end - e.start - 1)
            assert rows[4 * picture + r] == "".join(drawn), (schedule, r)
        assert zb.span(sim) == {"1f1b": 33, "zb1": 27}[schedule]


def test_zb1_passes_nccls_rule_and_its_bubble_is_a_third_of_1f1bs():
    """p <= 8, m <= 16: the zb1 plan (and its evaluation's) completes under NCCL's rule;
    every rank runs each of its m B's and W's once, each W after its B; at most p
    microbatches are forwarded and not yet through W on any stage; the simulated bubble
    is 05b's bubble_formula (m < p too: (2p-1-m)/(2m+2p-1) of the step), and for m >= p
    over ideal time (p-1)/(3m) with t_f = t_B = t_W, 1F1B's (p-1)/m."""
    for p in range(1, 9):
        for m in range(1, 17):
            orders, sim = pp.simulate("zb1", p, m)  # raises if a group would hang
            evaluation = pp.nccl_timeline(pp.step_plan("zb1", p, m, 1, True), 1)
            assert sum(map(len, evaluation)) == p * m
            for order in orders:
                for i in range(m):
                    assert order.index(pp.Action("B", i, 0)) < order.index(
                        pp.Action("W", i, 0)
                    )
                assert sorted(a.op for a in order) == ["B"] * m + ["F"] * m + ["W"] * m
                alive = 0
                for a in order:
                    alive += {"F": 1, "B": 0, "W": -1}[a.op]
                    assert alive <= p, (p, m, order)
            formula = pp.bubble_formula(p, m, 1, "zb1")  # m < p too
            assert pipe.bubble_fraction(sim) == pytest.approx(formula), (p, m)
            x = zb.bubble_formula("zb1", p, m)  # 05c's, over the ideal: m < p too
            assert bubble_rate(sim) == pytest.approx(x), (p, m)
            if m >= p:
                _, one_f = pp.simulate("1f1b", p, m)
                assert bubble_rate(sim) == pytest.approx((p - 1) / (3 * m)), (p, m)
                assert bubble_rate(one_f) == pytest.approx((p - 1) / m), (p, m)


# ---------------------------------------------------------------------------------------------
# For real, on 2 and 4 gloo ranks
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [2, 4])
def test_zb1_equals_one_process_and_1f1b_bit_for_bit(p):
    """Loss and every gradient (tied embeddings included) at m = p and 2p, run under the
    NCCL emulation (a send waits for its receive: completing is the proof that the
    measured run obeys the rule): one process's within TOL, 1F1B's exactly. Evaluation
    (forward_only) gives one process's loss and leaves no gradient and no W queued."""
    for m in (p, 2 * p):
        ref_loss, ref_grads = reference(m)
        per_rank = [r["zb"][("zb1", m)] for r in _world(p)]
        assert_matches_reference(per_rank, ref_loss, ref_grads, f"zb1 p={p} m={m}")
        for ours, one_f in zip(per_rank, (r["zb"][("1f1b", m)] for r in _world(p))):
            for n, g in ours["grads"].items():
                assert torch.equal(g, one_f["grads"][n]), (n, m)
        evaluation = [r["zb"][("eval", m)] for r in _world(p)]
        torch.testing.assert_close(sum(e["loss"] for e in evaluation), ref_loss, **TOL)
        assert all(e["clean"] for e in evaluation)


@pytest.mark.parametrize("p", [2, 4])
def test_executed_order_peak_and_w_bytes(p):
    """The executor ran the simulator's order; at most p microbatches alive on every
    stage (1F1B: p - r); the queue's peak bytes are peak_w_bytes' formula per stage."""
    config = make_model().config
    for m in (p, 2 * p):
        orders, _ = pp.simulate("zb1", p, m)
        results = [r["zb"][("zb1", m)] for r in _world(p)]
        assert [[pp.Action(*e[:3]) for e in r["events"]] for r in results] == orders
        assert [r["peak"] for r in results] == [min(p, m)] * p
        one_f = [r["zb"][("1f1b", m)]["peak"] for r in _world(p)]
        assert one_f == [min(p - r, m) for r in range(p)]
        want = [zb.peak_w_bytes(config, MICRO, 8, p, m, r) for r in range(p)]
        assert [r["w_bytes"] for r in results] == want


@pytest.mark.parametrize("p", [2, 4])
def test_bytes_kept_per_stage_are_the_formulas(p):
    """At the end of every action, what autograd saved and the W queue holds: at most
    kept_bytes_formula's on every stage, with A measured after the stage's first
    forward (the same in both schedules) and W = w_bytes_formula. m >= p: 1F1B keeps
    (p-r)·A, ZB-H1 (p-r)·A + r·W: the same on stage 0, more on every later stage."""
    config = make_model().config
    for m in (p, 2 * p):
        for r, ranks in enumerate(_world(p)):
            W = zb.stage_w_bytes(config, MICRO, 8, p, r)
            for schedule in ("1f1b", "zb1"):
                got = ranks["zb"][(schedule, m)]
                assert got["acts"] == ranks["zb"][("1f1b", m)]["acts"]
                want = zb.kept_bytes_formula(schedule, p, m, r, got["acts"], W)
                assert got["kept"] == want, (schedule, m, r)
            one_f = ranks["zb"][("1f1b", m)]["kept"]
            assert got["kept"] == one_f + r * W, (m, r)  # closed form


@pytest.mark.parametrize("p", [2, 4])
def test_same_as_torch_distributed_pipelining(p):
    """ScheduleInterleavedZeroBubble, one stage a rank: its actions (F, I for our B, W)
    are our zb1 table's, in order, and its loss and gradients ours."""
    for m in (p, 2 * p):
        theirs = [r["torch"][m] for r in _world(p)]
        ref_loss, ref_grads = reference(m)
        assert_matches_reference(theirs, ref_loss, ref_grads, f"torch zb p={p} m={m}")
        for ours, t in zip((r["zb"][("zb1", m)] for r in _world(p)), theirs):
            for n, g in t["grads"].items():
                torch.testing.assert_close(ours["grads"][n], g, **TOL)
        for r, order in enumerate(theirs[0]["order"]):
            mine = [a for step in pp.schedule_steps("zb1", p, m, 1, r) for a in step]
            assert order == [f"{r}{'I' if a.op == 'B' else a.op}{a.mb}" for a in mine]


def test_dp_times_pp_syncs_once_in_the_last_w():
    """pp=2 x dp=2, zb1 in 03's DataParallel: one sync per chunk (in its last W, no_sync
    in every B and earlier W), every replica's gradients one process's."""
    results = _world(4)
    ref_loss, ref_grads = reference(2 * 2)
    per_rank = [r["dp_pp"] for r in results]
    assert all(r["syncs"] == [1] for r in per_rank), per_rank
    for pipeline in ((0, 2), (1, 3)):
        stages = [per_rank[i] for i in pipeline]
        assert_matches_reference(stages, ref_loss, ref_grads, f"dp x pp zb1 {pipeline}")


def test_the_planner_knows_zb1s_bubble_and_memory():
    """09_plan's bubble for zb1 is 05b's bubble_formula: a third of 1F1B's idle time
    per unit of compute for m >= p ((p-1)/(3m) against (p-1)/m), and at m < p the
    simulated (2p-1-m)/(2m+2p-1) of the step. Its activations per stage are 1F1B's plus
    r·W (05c's measured composition), W = w_bytes_formula in bf16 (a = 2): a microbatch
    waiting for its W keeps what W reads, not its activations."""
    plan_lib = importlib.import_module("09_plan")
    from support import gpus
    from support.plan.plan_report import Layout

    config = plan_lib.model_config("gpt2-medium")
    plans = {}
    for schedule in ("1f1b", "zb1"):
        layout = Layout(pp=4, micro_batch=4, schedule=schedule)
        plans[schedule] = plan_lib.plan(config, layout, 64, "h200", 4)  # m = 16
    for schedule, idle in (("1f1b", 3 / 16), ("zb1", 3 / 48)):
        t = plans[schedule].time
        assert t["bubble"] == pytest.approx(t["compute"] * idle), schedule
    # zb1 runs eager (train.py cannot compile it): its kernels cost eager's measured
    # 1.57x of the compiled 1F1B's; train.py's loop (m x its overhead) is the same.
    # rel 1e-3: the roofline's optimizer bytes are the fullest stage's, which W's queue
    # moves from stage 0 to another stage with a few more or fewer weights (0.02% here).
    loop = 16 * gpus.TRAINER_OVERHEAD
    kernels = [plans[s].time["compute"] - loop for s in ("1f1b", "zb1")]
    eager = kernels[0] * gpus.EAGER_SLOWDOWN
    assert kernels[1] == pytest.approx(eager, rel=1e-3)
    for r in range(4):
        acts = [plans[s].ranks[r]["memory"]["activations"] for s in ("1f1b", "zb1")]
        W = zb.stage_w_bytes(config, 4, 1024, 4, r, a=2)
        assert acts[1] == acts[0] + r * W, r
    short = plan_lib.plan(
        config, Layout(pp=4, micro_batch=4, schedule="zb1"), 8, "h200", 4
    )
    t = short.time  # m = 2 < p = 4
    assert t["bubble"] / (t["bubble"] + t["compute"]) == pytest.approx(5 / 11)


PLANNED = dict(pp=2, micro_batch=4, schedule="zb1")


@pytest.mark.parametrize(
    "layout, run, refused",
    [
        (dict(recompute="full"), {}, "--recompute"),
        (dict(recompute="selective"), {}, "--recompute"),
        (dict(cp=2), {}, "--cp"),
        (dict(tp=2, sequence_parallel=True), {}, "--sequence-parallel"),
        ({}, dict(lora_rank=4), "--lora-rank"),
        ({}, dict(loss="chunked"), "--loss chunked"),
        ({}, dict(dtype="fp16"), "--dtype fp16"),
        (dict(tp=2, dp=2, zero=2), dict(dtype="fp32"), None),  # what train.py runs
    ],
    ids=["full", "selective", "cp", "sp", "lora", "chunked", "fp16", "supported"],
)
def test_the_planner_refuses_what_train_refuses_with_zb1(layout, run, refused):
    """09's check_layout refuses a zb1 layout exactly when train.py does, with its
    line: both read support/train/config's one list (train.py's --compile and
    --grad-compression are no planner input: 09 plans neither)."""
    plan_lib = importlib.import_module("09_plan")
    from support.plan.plan_report import Layout
    from support.train import config as train_config

    lay = Layout(**{**PLANNED, **layout})
    n = lay.dp * lay.tp * lay.pp * lay.cp
    cfg = train_config.TrainConfig(**run)
    for name in ("recompute", "cp", "tp", "dp", "pp", "sequence_parallel"):
        setattr(cfg, name, getattr(lay, name))
    config = plan_lib.model_config("gpt2")
    if refused is None:
        train_config.check_zero_bubble(cfg)
        plan_lib.plan(config, lay, 16, "h200", n, **run)  # no PlanError
        return
    with pytest.raises(train_config.ConfigError) as train_says:
        train_config.check_zero_bubble(cfg)
    with pytest.raises(plan_lib.PlanError) as plan_says:
        plan_lib.plan(config, lay, 16, "h200", n, **run)
    assert str(plan_says.value) == str(train_says.value)
    assert str(train_says.value).startswith(f"{refused} with --schedule zb1")


def test_the_search_tries_zb1_when_pp_is_above_1():
    """09's search plans zb1 on every grid with pp > 1 that it can run on (cp 1)."""
    plan_lib = importlib.import_module("09_plan")
    config = plan_lib.model_config("gpt2")
    plans = plan_lib.search(config, 16, "h200", 4)
    layouts = [p.layout for p in plans]
    zb1 = {(lay.pp, lay.dp, lay.tp) for lay in layouts if lay.schedule == "zb1"}
    pipelines = {
        (lay.pp, lay.dp, lay.tp) for lay in layouts if lay.pp > 1 and lay.cp == 1
    }
    assert zb1 == pipelines and len(zb1) > 1
