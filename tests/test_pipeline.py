"""05_pipeline.py: the naive GPipe loop and the explicit 1F1B loop, p and m against one
process (loss and every gradient) and against torch.distributed.pipelining; their
orders, the microbatches they keep alive, tied and untied embeddings, ignored targets, an
optimizer's curve; split_model's cut; bad configs. tests/test_schedules.py proves 05b's
tables and executor, and that the loops here are their GPipe and 1F1B.

Starting a rank costs 1-2 s, so each world size is spawned ONCE (`_world`) and runs
every case; the tests below only read its results. Models are tiny: 8 blocks (so
p·v = 4·2 works), C = 16."""

import argparse
import contextlib
import functools
import importlib
import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed import nccl_p2p_rules, run_ranks

pp = importlib.import_module("05_pipeline")
model_lib = importlib.import_module("02_model")

CFG = dict(n_layer=8, n_head=2, n_embd=16, block_size=8, vocab_size=64)
MICRO = 2  # sequences per microbatch
# fp32 throughout. The pipeline computes each microbatch exactly as one process would;
# only the summation order differs (m per-microbatch grads of loss/m added up in .grad,
# against one batched matmul that reduces over all B*T rows at once). That moves results
# by a few float32 ulps of the summed terms: measured at most 3e-8 absolute (6e-7 of the
# tensor's largest entry) here. atol 1e-6 / rtol 1e-5 keep a 30x margin and still fail
# on any real bug: a missing 1/m, a dropped or repeated microbatch, or an un-summed tied
# embedding move gradients by 10% or more.
TOL = dict(rtol=1e-5, atol=1e-6)
LOOPS = {"naive": pp.gpipe_naive, "loop": pp.one_f_one_b}  # GPipe's, 1F1B's


def make_model(**overrides):
    torch.manual_seed(0)  # the same initial model in every process
    return model_lib.GPT(model_lib.GPTConfig(**{**CFG, **overrides}))


def make_batch(rows: int, seed: int = 0, ignore: bool = False):
    """(B, T) inputs and next-token targets. ignore: the first half of the rows keep
    only their first target (the rest -1, as padding or a masked prompt), so
    microbatches, and DP replicas, hold very different numbers of real tokens: 1 per row
    against T."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(
        0, CFG["vocab_size"], (rows, CFG["block_size"] + 1), generator=g
    )
    x, y = data[:, :-1], data[:, 1:].clone()
    if ignore:
        y[: rows // 2, 1:] = -1
    return x, y


def reference(m: int, seed: int = 0, ignore: bool = False, **overrides):
    """One process, one batch of MICRO*m rows: (loss, {name: grad})."""
    model = make_model(**overrides)
    _, loss = model(*make_batch(MICRO * m, seed, ignore))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def one_f_one_b_order(p: int, r: int, m: int) -> list[str]:
    """1F1B on stage r, worked out: w = min(p-r-1, m) warm-up forwards, then F(w+i)
    B(i) in turn, then the backwards left. p=4, r=1, m=4: F0 F1 F2 B0 F3 B1 B2 B3."""
    w = min(p - r - 1, m)
    order = [f"F{i}" for i in range(w)]
    for i in range(m - w):
        order += [f"F{w + i}", f"B{i}"]
    return order + [f"B{i}" for i in range(m - w, m)]


# ---------------------------------------------------------------------------------------------
# Inside the spawned ranks
# ---------------------------------------------------------------------------------------------
def _grads(chunks):
    return {
        n: q.grad.clone()
        for c in chunks
        for n, q in getattr(c, "module", c).named_parameters()
    }


def _loops(rank, p):
    """Both loops, m = 1..8, on the whole world as one pipeline, p2p blocking as NCCL's
    does (gloo alone buffers sends and would forgive a message that hangs on GPUs), each
    loop's forwards, backwards and p2p groups traced."""
    embed_group, out = pp.embedding_group([list(range(p))]), {}
    with nccl_p2p_rules():
        for name, loop in LOOPS.items():
            for m in range(1, 9):
                (chunk,) = pp.split_model(make_model(), rank, p)
                batch = make_batch(MICRO * m)
                res, trace = _traced(loop, chunk, batch, m, embed_group=embed_group)
                out[(name, m)] = dict(
                    loss=res.loss,
                    grads=_grads([chunk]),
                    peak=res.peak_in_flight,
                    events=res.events,
                    trace=trace,
                )
    return out


def _traced(loop, *args, **kwargs):
    """Run a plain loop and record, in order, each forward ("F"), backward ("B") and p2p
    group it posts (the peers it sends to, the peers it receives from)."""
    trace = []
    real = (pp.blocking_p2p, pp.Microbatches.forward, pp.Microbatches.backward)

    def p2p(ops, group=None):
        if ops:
            sends = [q for op, _, q in ops if op is dist.isend]
            trace.append((sends, [q for op, _, q in ops if op is dist.irecv]))
        return real[0](ops, group)

    def forward(self, *a, **k):
        trace.append("F")
        return real[1](self, *a, **k)

    def backward(self, *a, **k):
        trace.append("B")
        return real[2](self, *a, **k)

    pp.blocking_p2p = p2p
    pp.Microbatches.forward = forward
    pp.Microbatches.backward = backward
    try:
        return loop(*args, **kwargs), trace
    finally:
        pp.blocking_p2p = real[0]
        pp.Microbatches.forward = real[1]
        pp.Microbatches.backward = real[2]


def _ignored_targets(rank, p, m=4):
    """Both loops on a batch whose microbatches hold 4 and 32 real target tokens."""
    embed_group, out = pp.embedding_group([list(range(p))]), {}
    with nccl_p2p_rules():
        for name, loop in LOOPS.items():
            (chunk,) = pp.split_model(make_model(), rank, p)
            batch = make_batch(MICRO * m, ignore=True)
            res = loop(chunk, batch, m, embed_group=embed_group)
            out[name] = dict(loss=res.loss, grads=_grads([chunk]))
    return out


def _p2p_blocking(rank, p, wait_s=1.0):
    """Both ranks send first and receive in a LATER group: a hang on NCCL. For plain
    gloo and the emulation: how many works the send group returns, and whether the send
    was still pending after wait_s (then the pattern drains: the barrier keeps either
    rank from posting its receive before both have looked)."""
    peer, seen = 1 - rank, []
    for emulate in (False, True):
        with nccl_p2p_rules() if emulate else contextlib.nullcontext():
            works = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, torch.ones(4), peer),
                    dist.P2POp(dist.isend, torch.ones(4), peer),
                ]
            )
            deadline = time.monotonic() + wait_s
            while (
                not all(w.is_completed() for w in works) and time.monotonic() < deadline
            ):
                time.sleep(0.01)
            seen.append((len(works), not all(w.is_completed() for w in works)))
            dist.barrier()
            bufs = [torch.zeros(4), torch.zeros(4)]
            for w in dist.batch_isend_irecv(
                [dist.P2POp(dist.irecv, b, peer) for b in bufs]
            ):
                w.wait()
            for w in works:
                w.wait()
            assert all(torch.equal(b, torch.ones(4)) for b in bufs)
    return seen


def _optimizer_curve(rank, p, steps=4):
    """AdamW on the 1F1B loop (m=4), on one batch: the loss of each step."""
    model, embed_group, losses = make_model(), pp.embedding_group([list(range(p))]), []
    (chunk,) = pp.split_model(model, rank, p)
    opt = torch.optim.AdamW(chunk.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        res = pp.one_f_one_b(chunk, make_batch(MICRO * 4), 4, embed_group=embed_group)
        loss = res.loss.clone()
        dist.all_reduce(loss)  # SUM: the last stage's loss, 0 elsewhere
        losses.append(loss.item())
        opt.step()
    tied = pp.tied_parameter(chunk)
    return losses, None if tied is None else tied.detach().clone()


def _torch_pipelining(rank, p, m=4):
    """PyTorch's own schedules on the same stages (our PipelineChunk modules) and
    batch."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    embed_group, out = pp.embedding_group([list(range(p))]), {}
    for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        model = make_model()
        (chunk,) = pp.split_model(model, rank, p)
        stage = PipelineStage(chunk, rank, p, torch.device("cpu"))
        # scale_grads=True (default) divides grads by m: the mean over microbatches,
        # like ours
        schedule = cls(stage, n_microbatches=m, loss_fn=model_lib.cross_entropy_loss)
        x, y = make_batch(MICRO * m)
        losses = []
        if rank == 0:
            schedule.step(x)
        elif rank == p - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        pp.allreduce_tied_grads(
            [chunk], embed_group
        )  # torch's stages know nothing of tying
        loss = torch.stack(losses).mean().detach() if losses else None
        out[name] = dict(loss=loss, grads=_grads([chunk]))
    return out


def _bad_configs(rank, p):
    """Each bad call must raise before anything is sent; then a good step must still be
    exact (a stray message would be received by it and corrupt its activations)."""
    model, embed_group, errors = make_model(), pp.embedding_group([list(range(p))]), {}
    (chunk,) = pp.split_model(model, rank, p)
    (wrong,) = pp.split_model(model, (rank + 1) % p, p)
    bad = {
        "naive_no_embed_group": lambda: pp.gpipe_naive(chunk, make_batch(4), 2),
        "loop_no_embed_group": lambda: pp.one_f_one_b(chunk, make_batch(4), 2),
        "loop_batch": lambda: pp.one_f_one_b(
            chunk, make_batch(5), 2, embed_group=embed_group
        ),
        "naive_batch": lambda: pp.gpipe_naive(
            chunk, make_batch(5), 2, embed_group=embed_group
        ),
        "wrong_rank": lambda: pp.one_f_one_b(
            wrong, make_batch(4), 2, embed_group=embed_group
        ),
    }
    for name, call in bad.items():
        try:
            call()
            errors[name] = None
        except (ValueError, AssertionError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    model.zero_grad(set_to_none=True)
    res = pp.one_f_one_b(chunk, make_batch(MICRO * 4), 4, embed_group=embed_group)
    return errors, dict(loss=res.loss, grads=_grads([chunk]))


def _untied(rank, p):
    (chunk,) = pp.split_model(make_model(tie_embeddings=False), rank, p)
    res = pp.one_f_one_b(chunk, make_batch(MICRO * 4), 4)  # no embed_group needed
    return dict(loss=res.loss, grads=_grads([chunk]))


def _rank_main(rank, world):
    torch.manual_seed(0)
    results = dict(loops=_loops(rank, world), torch=_torch_pipelining(rank, world))
    if world == 2:
        results["blocking"] = _p2p_blocking(rank, world)
        results["ignored"] = _ignored_targets(rank, world)
        results["curve"] = _optimizer_curve(rank, world)
        results["untied"] = _untied(rank, world)
        results["bad"] = _bad_configs(rank, world)
    return results


@functools.cache
def _world(p: int):
    return run_ranks(_rank_main, p, timeout=240)


# ---------------------------------------------------------------------------------------------
# Checks (parent process)
# ---------------------------------------------------------------------------------------------
def assert_matches_reference(per_rank, ref_loss, ref_grads, what):
    """Sum of the stages' losses == the one-process loss; every parameter of the
    one-process model appears on some rank with the same gradient (lm_head.weight is the
    tied wte's copy)."""
    loss = sum(r["loss"] for r in per_rank if r["loss"] is not None)
    torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda s: f"{what} loss: {s}")
    seen = set()
    for r in per_rank:
        for name, grad in r["grads"].items():
            key = name if name in ref_grads else "transformer.wte.weight"
            torch.testing.assert_close(
                grad,
                ref_grads[key],
                **TOL,
                msg=lambda s, n=name: f"{what} grad {n}: {s}",
            )
            seen.add(key)
    assert seen == set(ref_grads), (
        f"{what}: no rank holds {sorted(set(ref_grads) - seen)}"
    )


def names(events) -> list[str]:
    """A rank's Events as F0, B0, ...: the order it ran."""
    return [f"{e.op}{e.mb}" for e in events]


@pytest.mark.parametrize("p", [2, 4])
def test_naive_gpipe_equals_one_process(p):
    """The plain loop (all forwards, then all backwards, blocking sends under NCCL's
    rule): loss and every gradient equal one process, m = 1..8; it runs GPipe's order
    and holds all m microbatches on every stage."""
    for m in range(1, 9):
        ref_loss, ref_grads = reference(m)
        per_rank = [r["loops"][("naive", m)] for r in _world(p)]
        assert_matches_reference(
            per_rank, ref_loss, ref_grads, f"naive gpipe p={p} m={m}"
        )
        gpipe = [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]
        for r in per_rank:
            assert names(r["events"]) == gpipe, f"naive p={p} m={m}: not GPipe's order"
        assert [r["peak"] for r in per_rank] == [m] * p


@pytest.mark.parametrize("p", [2, 4])
def test_1f1b_loop_equals_one_process_and_gpipe(p):
    """The explicit loop (warm-up p-r-1 forwards, steady send_forward_recv_backward /
    send_backward_recv_forward, cool-down), m = 1..8, under the NCCL emulation: loss and
    every gradient equal one process's and naive GPipe's, stage r runs 1F1B's order and
    keeps at most min(p-r, m) <= p microbatches alive, where GPipe keeps m."""
    for m in range(1, 9):
        per_rank = [r["loops"][("loop", m)] for r in _world(p)]
        ref_loss, ref_grads = reference(m)
        assert_matches_reference(
            per_rank, ref_loss, ref_grads, f"1f1b loop p={p} m={m}"
        )
        naive = [r["loops"][("naive", m)] for r in _world(p)]
        for loop, gpipe in zip(per_rank, naive):
            for n, g in loop["grads"].items():
                torch.testing.assert_close(g, gpipe["grads"][n], **TOL)
        for r, ran in enumerate(per_rank):
            assert names(ran["events"]) == one_f_one_b_order(p, r, m), (p, m, r)
        assert [r["peak"] for r in per_rank] == [min(p - r, m) for r in range(p)]


def test_optimizer_steps_follow_one_process():
    """Four AdamW steps, p=2, the 1F1B loop, on one batch: the same loss curve as one
    process, and the two copies of the tied embedding (rank 0's wte, rank 1's lm_head)
    stay identical."""
    (curve0, wte), (curve1, head) = _world(2)[0]["curve"], _world(2)[1]["curve"]
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expected = []
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        _, loss = model(*make_batch(MICRO * 4))
        loss.backward()
        opt.step()
        expected.append(loss.item())
    assert curve0 == curve1  # every rank saw the same (all-reduced) loss
    torch.testing.assert_close(torch.tensor(curve0), torch.tensor(expected), **TOL)
    assert expected[-1] < expected[0]  # it learned something
    assert torch.equal(wte, head)
    torch.testing.assert_close(wte, model.transformer.wte.weight.detach(), **TOL)


def test_untied_embeddings():
    ref_loss, ref_grads = reference(4, tie_embeddings=False)
    assert "lm_head.weight" in ref_grads
    assert_matches_reference(
        [r["untied"] for r in _world(2)], ref_loss, ref_grads, "untied"
    )


@pytest.mark.parametrize("p", [2, 4])
def test_same_as_torch_distributed_pipelining(p):
    """ScheduleGPipe and Schedule1F1B from torch.distributed.pipelining (run for real on
    gloo), on the same PipelineChunk stages and batch: the same loss and gradients as
    our two loops and as one process."""
    ref_loss, ref_grads = reference(4)
    for name, loop in (("gpipe", "naive"), ("1f1b", "loop")):
        theirs = [r["torch"][name] for r in _world(p)]
        assert_matches_reference(theirs, ref_loss, ref_grads, f"torch {name} p={p}")
        for ours, t in zip((r["loops"][(loop, 4)] for r in _world(p)), theirs):
            for n, g in t["grads"].items():
                torch.testing.assert_close(ours["grads"][n], g, **TOL)


def test_bad_configurations_fail_before_any_send():
    results = _world(2)
    expected = {
        "naive_no_embed_group": "embed_group",
        "loop_no_embed_group": "embed_group",
        "loop_batch": "does not split into 2 microbatches",
        "naive_batch": "does not split into 2 microbatches",
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
        pp.split_model(make_model(), 0, 4, virtual_stages=3)  # 8 blocks < 12 stages
    with pytest.raises(AssertionError, match="outside"):
        pp.split_model(make_model(), 2, 2)
    with pytest.raises(AssertionError, match="does not split"):
        pp.check_pipeline(2, 3, batch_size=8)
    with pytest.raises(AssertionError, match=">= 1"):
        pp.check_pipeline(2, 0)


def test_a_step_whose_targets_are_all_ignored_fails_loudly():
    """Every target -1 (all padding): the loss has no token to average over, so the step
    must raise, not divide by 0 into a NaN loss and NaN gradients."""
    (chunk,) = pp.split_model(make_model(), 0, 1)
    x, y = make_batch(4)
    for loop in LOOPS.values():
        with pytest.raises(AssertionError, match="every target of the step is -1"):
            loop(chunk, (x, torch.full_like(y, -1)), 2)


def test_ignored_targets_are_normalised_by_the_steps_tokens():
    """Microbatches with 4 and 32 real tokens: each contributes its token SUM over the
    step's count, so both loops equal one process's mean over the real tokens. The
    old mean of per-microbatch means was off by up to 0.24 in a gradient here (same
    tolerance as above)."""
    ref_loss, ref_grads = reference(4, ignore=True)
    for name in LOOPS:
        per_rank = [r["ignored"][name] for r in _world(2)]
        assert_matches_reference(
            per_rank, ref_loss, ref_grads, f"{name}, ignored targets"
        )


def test_nccl_emulation_blocks_a_send_until_its_receive_is_posted():
    """The emulation the loops' tests run under is itself checked. Plain gloo hands
    back one work per operation, so a loop may wait on its receives alone and leave a
    send pending (an old executor did, which is how it passed on CPUs); NCCL hands back
    one work for the group. Under the emulation: one work, still pending while the peer
    has not posted the receives."""
    for plain, emulated in (r["blocking"] for r in _world(2)):
        assert plain[0] == 2 and emulated == (1, True), (plain, emulated)


# ---------------------------------------------------------------------------------------------
# The model cut and the single-process pipeline
# ---------------------------------------------------------------------------------------------
def test_split_model_layout():
    """8 blocks, p=2, v=2: stages s=0..3 of 2 blocks; stage s on rank s % 2 as chunk
    s // 2, so rank 0 holds blocks 0-1 (+ embeddings) and 4-5, rank 1 holds 2-3 and
    6-7 (+ ln_f, head). Parameter names stay the full model's, and nothing is held twice
    except the tied matrix."""
    model = make_model()
    rank0, rank1 = pp.split_model(model, 0, 2, 2), pp.split_model(model, 1, 2, 2)
    assert [list(c.layers) for c in rank0 + rank1] == [[0, 1], [4, 5], [2, 3], [6, 7]]
    names = [{n for n, _ in c.named_parameters()} for c in rank0 + rank1]
    assert "transformer.wte.weight" in names[0] and "transformer.wpe.weight" in names[0]
    assert "lm_head.weight" in names[3] and "transformer.ln_f.weight" in names[3]
    assert not any(
        "wte" in n or "ln_f" in n or "lm_head" in n for n in names[1] | names[2]
    )
    full = dict(model.named_parameters())
    for c in rank0 + rank1:
        for n, q in c.named_parameters():
            assert q is full.get(n, full["transformer.wte.weight"])
    assert (
        sum(len(n) for n in names) == len(full) + 1
    )  # + lm_head.weight, the tied copy


def test_one_process_loops_are_gradient_accumulation():
    """p = 1 needs no process group: neither loop has a neighbour to talk to, and its m
    microbatches accumulate one process's gradients; GPipe keeps all m alive, 1F1B
    (no warm-up at p = 1) one."""
    ref_loss, ref_grads = reference(4)
    for name, loop in LOOPS.items():
        (chunk,) = pp.split_model(make_model(), 0, 1)
        res = loop(chunk, make_batch(MICRO * 4), 4)
        ran = dict(loss=res.loss, grads=_grads([chunk]))
        assert_matches_reference([ran], ref_loss, ref_grads, name)
        assert res.peak_in_flight == {"naive": 4, "loop": 1}[name]


def test_demo_refuses_a_bad_configuration_before_launching(monkeypatch, capsys):
    """`python 05_pipeline.py --ranks 16`: the demo's 8 blocks cannot fill 16 stages,
    so the parser says why in one line and exits 2, before any torchrun is started."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        pp.main(["--ranks", "16"])
    assert exit_info.value.code == 2 and "cannot fill" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, command",
    [
        (["--virtual-stages", "2"], "python 05b_schedules.py --virtual-stages 2"),
        (["--plot", "--ranks", "2"], "python 05b_schedules.py --plot --ranks 2"),
        (["--schedule", "gpipe", "--ranks", "2"], "python 05b_schedules.py --ranks 2"),
    ],
)
def test_schedule_flags_name_05b_in_one_line(argv, command, monkeypatch):
    """The flags that left with the schedules (issue 39) are one line naming 05b's
    command, before any torchrun starts; 05b parses it (it runs every schedule, so a
    --schedule is dropped)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        pp.main(argv)
    msg = str(exit_info.value.code)
    assert msg.startswith(f"05_pipeline.py: error: {argv[0]} moved to 05b_schedules.py")
    assert f"run `{command}`" in msg and "\n" not in msg, msg
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int)  # run_on_ranks' own
    importlib.import_module("05b_schedules").add_arguments(parser)
    parser.parse_args(command.split()[2:])  # 05b takes every flag it was handed
