"""05_pipeline.py: pipeline parallelism. Cut the model into stages, stream microbatches through.

The idea in one sentence: give each of p ranks a consecutive slice of the layers (a stage), split
the batch into m microbatches, and let stage r work on microbatch i while stage r+1 works on
microbatch i-1, passing activations forward and their gradients back with point-to-point sends.

    rank 0: embed + blocks 0-1 ─▶ rank 1: blocks 2-3 ─▶ rank 2: blocks 4-5 ─▶ rank 3: blocks 6-7
            (wte copy)          ◀─  dL/dx (b, T, C)  ◀─                    ◀─   + ln_f, lm_head
                                                                                  (wte copy), loss
The bubble. A stage idles while the pipeline fills and drains: with t_f and t_b a microbatch's
forward and backward on one stage, GPipe and 1F1B take (m+p-1)(t_f+t_b) for m(t_f+t_b) of work,

    bubble = (p - 1) / (m + p - 1)                                  GPipe, 1F1B
    bubble = (p - 1) / (v·m + p - 1),  i.e. (p-1)/(v·m) of the work   interleaved, v chunks per rank

Interleaving gives rank r the v thin stages r, r+p, r+2p, ...: fill and drain come in chunk-sized
steps, v times shorter, for v times more messages. Memory: GPipe runs all m forwards first, so
each stage holds m microbatches' activations; 1F1B (PipeDream-flush) runs p-r-1 warm-up forwards
on stage r, then one forward and one backward in turn: at most p-r alive, for the same bubble.
Tied embeddings: the first stage's wte and the last stage's lm_head are copies of one matrix;
their gradients are summed over an "embedding group" of those two ranks (Megatron) every step.

Simple first: `gpipe_naive`, GPipe as a plain loop with blocking sends. Then the real thing: a
schedule is data, steps of (F|B, microbatch, chunk) per rank (`schedule_steps`), put on a shared
clock of ticks that each end in one p2p group (`comm_plan`), checked by a simulator (`simulate`)
and run as-is by `PipelineExecutor` (`pipeline_step`).

NCCL's rule. On GPUs a send completes only once the peer has posted the matching receive, and a
batch_isend_irecv group only as a whole: if rank 0's group waits on a receive rank 1 posts in a
later group, and rank 1's on one rank 0 posts later, both hang (gloo buffers sends, so this passes
on CPUs; the tests emulate NCCL). So what a rank sends at tick t, its neighbour receives in its
group of tick t, and `nccl_timeline` runs the plan under NCCL's rule to prove nothing hangs.

Timelines from `simulate()` with t_f = t_b = 1 (really t_b ~ 2 t_f); Fi/Bi: microbatch i; . idle:

    GPipe p=4, m=8: bubble 3/11, 8 alive             1F1B p=4, m=8: bubble 3/11, <= 4 alive
    r0 F0F1F2F3F4F5F6F7 . . . . . .B0B1B2B3B4B5B6B7  r0 F0F1F2F3 . . .B0F4B1F5B2F6B3F7B4 .B5 .B6 .B7
    r1  .F0F1F2F3F4F5F6F7 . . . .B0B1B2B3B4B5B6B7    r1  .F0F1F2 . .B0F3B1F4B2F5B3F6B4F7B5 .B6 .B7
    r2  . .F0F1F2F3F4F5F6F7 . .B0B1B2B3B4B5B6B7      r2  . .F0F1 .B0F2B1F3B2F4B3F5B4F6B5F7B6 .B7
    r3  . . .F0F1F2F3F4F5F6F7B0B1B2B3B4B5B6B7        r3  . . .F0B0F1B1F2B2F3B3F4B4F5B5F6B6F7B7

Launch:  python 05_pipeline.py [--ranks N] [--plot]   (relaunches itself under torchrun; N = 4)
         torchrun --standalone --nproc_per_node=4 05_pipeline.py [--plot]   (CPU gloo or GPUs)
It prints, for the naive GPipe and every schedule, the loss and largest gradient error against
one process, the bubble measured beside the simulator's and the formula's, and the peak memory.

Papers: GPipe (arXiv 1811.06965), PipeDream (1806.03377; flushed, it is 1F1B), and Megatron-LM's
interleaved schedule and bubble analysis (2104.04473, section 2.2).

What changed from 04: 03 copied the model, 04 split every matrix; here each rank holds whole
layers, only some, and talks only to its two neighbours: PP is the one to stretch across nodes.

Left out on purpose: zero-bubble schedules (arXiv 2401.10241) and DualPipe; unbalanced stages
(the first and last also run the embedding and the head); freeing sent outputs early;
recomputation; overlapping p2p with compute. Timing sweeps and traces: bench/bench_pipeline.py.
"""

import argparse
import contextlib
import functools
import importlib
import os
import sys
import time
from collections import defaultdict, namedtuple
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

model_lib = importlib.import_module("02_model")  # GPT, GPTConfig, byte_batches
ddp_lib = importlib.import_module("03_ddp")  # init_distributed, print0, relaunch_with_torchrun

SCHEDULES = ("gpipe", "1f1b", "interleaved")
Action = namedtuple("Action", "op mb chunk")  # op "F" or "B", microbatch, which of v chunks
# An Action's start and end: seconds since the step began (measured) or time units (simulated)
Event = namedtuple("Event", "op mb chunk start end")
# loss: Σ token losses / the step's tokens on the last stage (this replica's share), else 0;
# events: the Events in the order they ran; peak_in_flight: most (microbatch, chunk) forwards
# alive at once, awaiting their backward
StepResult = namedtuple("StepResult", "loss events peak_in_flight")


def check_config(schedule, p, m, v=1, n_layer=None, batch_size=None):
    """Every bad (schedule, p, m, v, layers, batch) raises here, before any send."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if min(p, m, v) < 1:
        raise ValueError(f"need pp_size, microbatches, virtual_stages >= 1, got {p}, {m}, {v}")
    if v > 1 and schedule != "interleaved":
        raise ValueError(f"virtual_stages={v} > 1 needs schedule='interleaved', not {schedule!r}")
    if schedule == "interleaved" and m % p != 0:
        why = f"m={m}, p={p}: microbatches go round the ring in groups of p"
        raise ValueError(f"interleaved needs microbatches divisible by pp_size: {why}")
    if n_layer is not None and n_layer < p * v:
        raise ValueError(f"n_layer={n_layer} blocks cannot fill pp_size*virtual_stages={p}*{v}")
    if batch_size is not None and batch_size % m != 0:
        raise ValueError(f"batch of {batch_size} sequences does not split into {m} microbatches")


# --------------------------------------------------------------------------- the model cut


class PipelineChunk(nn.Module):
    """Global stage s of S = p·v: [embed] -> its blocks -> [ln_f + lm_head]. It keeps the GPT's
    own module objects under the GPT's own names (transformer.h.5 stays h.5), so whatever 04's
    tensor parallelism did to them stays done, and state dicts and gradients line up by name."""

    def __init__(self, model, stage: int, n_stages: int, layers: range):
        super().__init__()
        self.stage, self.n_stages, self.layers = stage, n_stages, layers
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.config, self.loss_fn = model.config, model.loss_fn  # TP may have swapped loss_fn
        self.tp_rng = getattr(model, "tp_rng", None)  # 04's dropout stream, for checkpoints
        drop = (set() if self.is_first else {"wte", "wpe"}) | (set() if self.is_last else {"ln_f"})
        kept = {name: module for name, module in model.transformer.items() if name not in drop}
        # subtle: a ModuleDict keyed by the global layer index keeps the full model's names
        kept["h"] = nn.ModuleDict({str(i): model.transformer.h[i] for i in layers})
        self.transformer = nn.ModuleDict(kept)
        self.lm_head = model.lm_head if self.is_last else None  # tied: it *is* wte's Parameter

    embed = model_lib.GPT.embed  # the GPT's own code, run on the modules this chunk kept
    head = model_lib.GPT.head

    def forward(self, inp):
        """first: (b, T) ids, others: (b, T, C) -> (b, T, C), or (b, T, V) logits on the last."""
        x = self.embed(inp) if self.is_first else inp  # (b, T, C)
        for block in self.transformer.h.values():
            x = block(x)  # (b, T, C)
        return self.head(x) if self.is_last else x


def split_model(model, pp_rank: int, pp_size: int, virtual_stages: int = 1) -> list[PipelineChunk]:
    """This rank's v chunks of a GPT: blocks cut into S = p·v balanced stages, stage s living on
    rank s % p as its chunk s // p (Megatron's interleaved placement; v = 1 is the plain one).
    Build the full model from one seed on every rank, split it, then drop the full model."""
    p, v, L = pp_size, virtual_stages, len(model.transformer.h)
    check_config("interleaved" if v > 1 else "1f1b", p, p, v, n_layer=L)
    assert 0 <= pp_rank < p, f"pp_rank={pp_rank} outside [0, {p})"
    S = p * v  # stage s: blocks s·L//S to (s+1)·L//S; sizes differ by at most one
    return [
        PipelineChunk(model, s, S, range(s * L // S, (s + 1) * L // S))
        for s in range(pp_rank, S, p)
    ]


def tied_parameter(chunk):
    """The chunk's copy of the tied wte/lm_head matrix, or None."""
    if chunk.config.tie_embeddings and (chunk.is_first or chunk.is_last):
        return chunk.transformer.wte.weight if chunk.is_first else chunk.lm_head.weight


def embedding_group(pp_groups_ranks):
    """Megatron's embedding group: {first, last} rank of *this rank's* pipeline. Call it on EVERY
    rank with the global ranks of EVERY PP group, in the same order. subtle: dist.new_group is a
    collective over the whole world; if each rank created only its own pair, ranks would disagree
    on which group is which (with dp > 1 there is one pair per pipeline) and hang."""
    mine = None
    for ranks in pp_groups_ranks:
        pair = sorted({ranks[0], ranks[-1]})
        if len(pair) > 1:  # p = 1: both copies are one Parameter already
            group = dist.new_group(pair)
            mine = group if dist.get_rank() in pair else mine
    return mine


def allreduce_tied_grads(chunks, embed_group):
    """wte (lookup) and lm_head (output projection) are two uses of one matrix, so its gradient is
    the sum of both copies' grads: both ranks take the same optimizer step and stay identical."""
    for param in (tied_parameter(chunk) for chunk in chunks):
        if param is not None and param.grad is not None:
            dist.all_reduce(param.grad, group=embed_group)  # SUM over {first, last}


def blocking_p2p(ops, group=None) -> None:
    """Post (op, tensor, pp rank) as ONE batch_isend_irecv group and wait for all of it (NCCL
    hands back one work for the group, gloo one per op). p2p takes global ranks: map them."""
    world = group or dist.group.WORLD
    ops = [dist.P2POp(op, t, dist.get_global_rank(world, q), group) for op, t, q in ops]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def start_clock(group, p: int) -> float:
    """A common t = 0 for a step's Events (and NCCL wants every rank in its first p2p call)."""
    if p > 1:
        dist.barrier(group=group)
    return time.perf_counter()


# --------------------------------------------------------------------------- simple first: GPipe


def gpipe_naive(chunk, batch, n_microbatches: int, group=None, embed_group=None) -> StepResult:
    """GPipe as a plain loop, one chunk per rank (no DP, no SP): all m forwards, then all m backwards, each
    input received and each output sent with a blocking call. Why this order cannot hang under
    NCCL, where a send returns only once its receive is posted: a rank's sends wait only on the
    rank they go to, which posts the matching receive without waiting on the sender (its waits in
    that phase point the other way, away from it), and both ends of a link post the same messages
    in the same order. So a chain of waits runs one way along the pipeline and ends at rank 0 or
    p-1: it never closes into a cycle (tests/test_pipeline.py checks it with the simulator)."""
    p = dist.get_world_size(group) if dist.is_initialized() else 1
    r, (x, y), m = dist.get_rank(group) if p > 1 else 0, batch, n_microbatches
    check_config("gpipe", p, m, batch_size=x.size(0))
    if p > 1 and tied_parameter(chunk) is not None and embed_group is None:
        raise ValueError("tied embeddings across stages need embed_group=embedding_group(...)")
    shape, n_tokens = (x.size(0) // m, x.size(1), chunk.config.n_embd), int((y != -1).sum())
    loss, stash, events, t0 = torch.zeros((), device=x.device), [], [], start_clock(group, p)
    for i, (inp, targets) in enumerate(zip(x.chunk(m), y.chunk(m))):  # inp: (b, T) ids
        if not chunk.is_first:  # (b, T, C) from stage r-1; we need dL/d(input) to send back
            inp = torch.empty(shape, dtype=next(chunk.parameters()).dtype, device=x.device)
            blocking_p2p([(dist.irecv, inp, r - 1)], group)
            inp.requires_grad_()
        start, out = time.perf_counter() - t0, chunk(inp)  # (b, T, C), or (b, T, V) logits
        if chunk.is_last:  # Σ of the microbatch's token losses / the step's tokens (as 06)
            out = chunk.loss_fn(out, targets, "sum") / n_tokens
            loss += out.detach()
        events.append(Event("F", i, 0, start, time.perf_counter() - t0))
        if not chunk.is_last:
            blocking_p2p([(dist.isend, out.detach(), r + 1)], group)
        stash.append((inp, out))  # all m microbatches alive at once: GPipe's memory cost
    for i, (inp, out) in enumerate(stash):
        grad = None if chunk.is_last else torch.empty_like(out)  # dL/d(out), from stage r+1
        if grad is not None:
            blocking_p2p([(dist.irecv, grad, r + 1)], group)
        start = time.perf_counter() - t0
        torch.autograd.backward(out, grad_tensors=grad)  # grads accumulate in .grad
        events.append(Event("B", i, 0, start, time.perf_counter() - t0))
        if not chunk.is_first:
            blocking_p2p([(dist.isend, inp.grad, r - 1)], group)
    if embed_group is not None:
        allreduce_tied_grads([chunk], embed_group)
    return StepResult(loss, events, len(stash))


# --------------------------------------------------------------------------- schedules as data


def schedule_steps(schedule: str, p: int, m: int, v: int, rank: int) -> list[tuple[Action, ...]]:
    """Rank's actions, in steps: what it runs between two p2p exchanges. Every schedule is w
    warm-up forwards, then one forward and one backward in turn, then the remaining backwards.
    GPipe: w = m. 1F1B: w = p-rank-1. Interleaved (Megatron): forwards go round the ring in groups
    of p microbatches per chunk, backwards through the chunks in reverse, w = 2(p-rank-1)+(v-1)p,
    and one exchange after each steady-state forward+backward pair (Megatron's
    send_forward_backward_recv_forward_backward): the longer warm-up is what lets each
    backward's gradient arrive in the previous exchange. The others exchange after every action."""
    check_config(schedule, p, m, v)
    if schedule == "interleaved":  # virtual microbatch k -> (microbatch, chunk)
        mb_of, chunk_of = (lambda k: k // (p * v) * p + k % p), (lambda k: k % (p * v) // p)
        fwd = [Action("F", mb_of(k), chunk_of(k)) for k in range(m * v)]
        bwd = [Action("B", mb_of(k), v - 1 - chunk_of(k)) for k in range(m * v)]
        warmup = min(2 * (p - rank - 1) + (v - 1) * p, m * v)
    else:
        fwd, bwd = [Action("F", i, 0) for i in range(m)], [Action("B", i, 0) for i in range(m)]
        warmup = m if schedule == "gpipe" else min(p - rank - 1, m)
    steps = [(f,) for f in fwd[:warmup]]
    for f, b in zip(fwd[warmup:], bwd):  # steady state: one forward, one backward
        steps += [(f, b)] if schedule == "interleaved" else [(f,), (b,)]
    return steps + [(b,) for b in bwd[len(fwd) - warmup :]]  # cool-down


def consumer_rank(a: Action, rank: int, p: int, v: int) -> int | None:
    """The rank that consumes a's output: a forward at stage s feeds stage s+1, a backward s-1
    (stage s lives on rank s % p); None at the ends of the pipeline."""
    s = a.chunk * p + rank + (1 if a.op == "F" else -1)
    return s % p if 0 <= s < p * v else None


def input_message(a: Action, s: int, n_stages: int):
    """The message (op, microbatch, stage) whose tensor action a, at stage s, consumes."""
    if a.op == "F":
        return ("F", a.mb, s - 1) if s > 0 else None  # the previous stage's activation
    return ("B", a.mb, s + 1) if s < n_stages - 1 else ("F", a.mb, s)  # the next one's gradient


# --------------------------------------------------------------------------- NCCL's rule, planned
# subtle: the obvious executor posts {send my last output, receive my next input} and waits on it
# before computing. Interleaved p=2, m=4, v=2 then hangs on GPUs: each rank's group waits on a
# message its peer sends only in a later group (step by step: old_grouping in the tests).
# A Tick is one rank's share of one tick of the plan's clock: it computes `actions` ((), (F,),
# (B,) or (F, B)), then posts `sends` and `recvs`, ((peer, message), ...), as ONE group. A
# message is (op, microbatch, stage) of the action that made the tensor.
Tick = namedtuple("Tick", "actions sends recvs")


def comm_plan(steps, p: int, v: int) -> list[list[Tick]]:
    """Each rank's steps placed on an imaginary shared clock, with the group it posts after each.
    At tick t a rank runs its next step if the step's inputs were made before t (or by the step
    itself: the last stage's backward needs its own forward). A message made at tick t is sent
    in the sender's group of tick t and received in the receiver's group of tick t, so groups of
    the same tick match one to one and no wait can depend on a peer's later group. Ticks where a
    rank does nothing are left out of its list."""
    S, next_step, made_at, t = p * v, [0] * p, {}, 0  # made_at: message -> its tick
    plan = [[] for _ in range(p)]
    while any(next_step[r] < len(steps[r]) for r in range(p)):
        ran = {}  # rank -> the step it runs at tick t
        for r in range(p):
            if next_step[r] < len(steps[r]):
                step = steps[r][next_step[r]]
                own = {(a.op, a.mb, a.chunk * p + r) for a in step}
                deps = {input_message(a, a.chunk * p + r, S) for a in step} - own - {None}
                if all(made_at.get(dep, t) < t for dep in deps):
                    ran[r], next_step[r] = step, next_step[r] + 1
        if not ran:
            stuck = {r: steps[r][next_step[r]] for r in range(p) if next_step[r] < len(steps[r])}
            raise RuntimeError(f"the steps deadlock at tick {t}; waiting: {stuck}")
        sends, recvs = defaultdict(list), defaultdict(list)
        for r, step in ran.items():
            for a in step:
                msg, dst = (a.op, a.mb, a.chunk * p + r), consumer_rank(a, r, p, v)
                made_at[msg] = t
                if dst is not None and dst != r:  # p = 1: chunk k hands to chunk k+1 in-process
                    sends[r].append((dst, msg))
                    recvs[dst].append((r, msg))
        for r in range(p):
            if r in ran or sends[r] or recvs[r]:
                plan[r].append(Tick(ran.get(r, ()), tuple(sends[r]), tuple(recvs[r])))
        t += 1
    return plan


def send_recv_pairs(plan) -> list[tuple]:
    """((rank, tick index), (rank, tick index)) of each send and its receive: NCCL pairs the
    k-th send r->q with the k-th receive on q from r, whatever they carry, so check that too."""
    sent, received = defaultdict(list), defaultdict(list)  # (src, dst) -> [(group, message)]
    for r, ticks in enumerate(plan):
        for i, tick in enumerate(ticks):
            for q, msg in tick.sends:
                sent[(r, q)].append(((r, i), msg))
            for q, msg in tick.recvs:
                received[(q, r)].append(((r, i), msg))
    pairs = []
    for link in sent.keys() | received.keys():
        assert len(sent[link]) == len(received[link]), f"{link}: sends and receives differ"
        for (group, msg), (other, msg2) in zip(sent[link], received[link]):
            assert msg == msg2, f"{link}: {msg} is sent where {msg2} is received"
            pairs.append((group, other))
    return pairs


def nccl_timeline(plan, v: int, t_f: float = 1.0, t_b: float = 2.0) -> list[list[Event]]:
    """Execute a comm plan under NCCL's rule: the Events, or an error naming the groups that hang.
    Each rank computes its tick's actions (a stage's forward takes t_f, backward t_b; a chunk's
    1/v of that; their inputs must be here already), then launches the tick's group and blocks
    until all of it completes. Each op completes when its partner's group has been launched (no
    send buffer; messages take no time)."""
    p, pending = len(plan), set(send_recv_pairs(plan))
    at, clock, launched_at = [0] * p, [0.0] * p, {}
    have, timeline = [set() for _ in range(p)], [[] for _ in range(p)]
    while True:
        for r in range(p):  # each rank runs until it blocks on a group (or ends)
            while at[r] < len(plan[r]):
                tick = plan[r][at[r]]
                if (r, at[r]) not in launched_at:
                    for a in tick.actions:
                        s, start = a.chunk * p + r, clock[r]
                        need = input_message(a, s, p * v)
                        assert need is None or need in have[r], f"rank {r} runs {a} before {need}"
                        have[r].add((a.op, a.mb, s))
                        clock[r] += (t_f if a.op == "F" else t_b) / v
                        timeline[r].append(Event(*a, start, clock[r]))
                    launched_at[(r, at[r])] = clock[r]
                if tick.sends or tick.recvs:
                    break
                at[r] += 1
        launched = {(r, at[r]) for r in range(p) if at[r] < len(plan[r])}
        if not launched:
            return timeline
        for pair in [pair for pair in pending if set(pair) <= launched]:  # both ends posted:
            pending.discard(pair)  # the transfer happens when the later of the two launches
            for r, _ in pair:
                clock[r] = max(clock[r], *(launched_at[g] for g in pair))
        done = launched - {g for pair in pending for g in pair}
        if not done:
            hung = sorted(launched)
            raise RuntimeError(f"deadlock under NCCL's rule: groups (rank, index) {hung} hang")
        for r, i in done:
            have[r].update(msg for _, msg in plan[r][i].recvs)
            at[r] += 1


def simulate(schedule: str, p: int, m: int, v: int = 1, t_f: float = 1.0, t_b: float = 2.0):
    """-> (orders, timeline): each rank's actions, and the Events when the executor's plan for
    them runs under NCCL's rule with free messages. Raises if anything would deadlock."""
    steps = [schedule_steps(schedule, p, m, v, r) for r in range(p)]
    orders = [[a for step in rank_steps for a in step] for rank_steps in steps]
    return orders, nccl_timeline(comm_plan(steps, p, v), v, t_f, t_b)


def bubble_formula(p: int, m: int, v: int = 1) -> float:
    """Idle share of the step: (p-1)/(v·m + p-1); v = 1 for GPipe and 1F1B."""
    return (p - 1) / (v * m + p - 1)


def bubble_fraction(timeline) -> float:
    """1 - (mean busy time per rank) / (first start to last end): the idle share, as run."""
    t0 = min(e.start for events in timeline for e in events)
    t1 = max(e.end for events in timeline for e in events)
    busy = sum(e.end - e.start for events in timeline for e in events) / len(timeline)
    return 1.0 - busy / (t1 - t0)


# --------------------------------------------------------------------------- the real thing


class PipelineExecutor:
    """Runs one rank's comm plan for one step, keeping the received tensors (the inbox), the
    stash of live activations awaiting their backward, the loss and the Events."""

    def __init__(self, chunks, batch, m, group, p, rank, act, n_tokens, scale):
        self.chunks, self.group, self.p, self.rank, self.act = chunks, group, p, rank, act
        self.modules = [getattr(c, "module", c) for c in chunks]  # unwrap DP wrappers
        self.xs, self.ys, self.n_tokens = batch[0].chunk(m), batch[1].chunk(m), n_tokens
        self.grad_scale = scale / n_tokens  # backward from dp_size · loss_scale · the loss
        self.inbox, self.stash, self.events = {}, {}, []  # inbox: message -> tensor
        self.loss, self.peak = torch.zeros((), device=self.xs[0].device), 0

    def forward(self, a: Action, s: int):
        chunk, mod = self.chunks[a.chunk], self.modules[a.chunk]
        if mod.is_first:
            inp = self.xs[a.mb]  # (b, T) ids
        else:  # (b, T, C): we need dL/d(input) to send back
            inp = self.inbox.pop(input_message(a, s, mod.n_stages)).requires_grad_()
        out = chunk(inp)  # (b, T, C), or (b, T, V) logits on the last stage
        if mod.is_last:  # Σ of the microbatch's token losses / the step's token count (as 06)
            loss_sum = mod.loss_fn(out, self.ys[a.mb], "sum")
            self.loss += loss_sum.detach() / self.n_tokens
            out = loss_sum * self.grad_scale
        if torch.is_grad_enabled():  # (not when evaluating: no backward will come)
            self.stash[(a.mb, a.chunk)] = (inp, out)  # alive until this microbatch's backward
            self.peak = max(self.peak, len(self.stash))
        return None if mod.is_last else out.detach()

    def backward(self, a: Action, s: int, last_of_chunk: bool):
        inp, out = self.stash.pop((a.mb, a.chunk))
        chunk, mod = self.chunks[a.chunk], self.modules[a.chunk]
        grad = None if mod.is_last else self.inbox.pop(input_message(a, s, mod.n_stages))
        # DP syncs gradients once per step: in the last backward of each chunk, never before
        quiet = hasattr(chunk, "no_sync") and not last_of_chunk
        with chunk.no_sync() if quiet else contextlib.nullcontext():
            torch.autograd.backward(out, grad_tensors=grad)  # grads accumulate in .grad
        return None if mod.is_first else inp.grad

    def run(self, ticks: list[Tick]):
        last_b = {a.chunk: a for t in ticks for a in t.actions if a.op == "B"}  # chunk's last
        t0 = start_clock(self.group, self.p)
        for tick in ticks:
            outs = {}  # message -> the tensor this tick sends
            for a in tick.actions:
                s, start = a.chunk * self.p + self.rank, time.perf_counter()
                msg = (a.op, a.mb, s)  # what this action makes
                if a.op == "F":
                    outs[msg] = self.forward(a, s)
                else:
                    outs[msg] = self.backward(a, s, last_b[a.chunk] == a)
                self.events.append(Event(*a, start - t0, time.perf_counter() - t0))
                if consumer_rank(a, self.rank, self.p, len(self.chunks)) == self.rank:  # p = 1:
                    self.inbox[msg] = outs[msg]  # the next chunk's input, in this process
            if tick.sends or tick.recvs:  # ONE group, waited whole: comm_plan made that safe
                shape, dtype = self.act  # known from the config: nothing describes a message
                for _, msg in tick.recvs:
                    self.inbox[msg] = torch.empty(shape, dtype=dtype, device=self.xs[0].device)
                recvs = [(dist.irecv, self.inbox[msg], q) for q, msg in tick.recvs]
                sends = [(dist.isend, outs[msg], q) for q, msg in tick.sends]
                blocking_p2p(sends + recvs, self.group)
        assert not self.inbox and not self.stash, "a received tensor or activation was not used"


@functools.lru_cache(maxsize=64)
def step_plan(schedule: str, p: int, m: int, v: int, forward_only: bool = False):
    """Every rank's comm plan for one step (forward_only: the schedule's forwards alone)."""
    steps = [schedule_steps(schedule, p, m, v, r) for r in range(p)]
    if forward_only:  # the forwards alone, one per step: still deadlock-free (tested)
        steps = [[(a,) for step in rank_steps for a in step if a.op == "F"] for rank_steps in steps]
    return comm_plan(steps, p, v)


def pipeline_step(
    chunks,
    batch,
    n_microbatches: int,
    schedule: str = "1f1b",
    pp_group=None,
    *,
    act_shape=None,
    act_dtype=None,
    embed_group=None,
    loss_scale: float = 1.0,
    n_tokens=None,
    dp_size: int = 1,
    forward_only: bool = False,
) -> StepResult:
    """Forwards and backwards of one training step under `schedule` (no optimizer step).

    chunks: this rank's split_model list, each possibly wrapped by DP (`.module`, `no_sync()`).
    batch: (x, y), both (B, T), the same on every rank of the pipeline. act_shape/act_dtype: one
    microbatch's activation between stages, default (B/m, T, C) in the parameters' dtype (with
    sequence parallelism, (B/m, T/tp, C)). Each microbatch adds its SUM of token losses over
    n_tokens, the target tokens (not -1) of the whole step, all DP replicas included (06's
    global_token_count; default: this batch's), times dp_size (DP wrappers average over replicas).
    Gradients accumulate into .grad. Tied embeddings with p > 1 need embed_group (their grads are
    summed). loss_scale: backward starts from loss_scale * loss (fp16). forward_only: the
    schedule's forwards under no_grad (evaluation). .loss: this replica's share on the last stage,
    0 on the others, so a SUM all-reduce over pp_group (and DP) gives it to every rank."""
    p = dist.get_world_size(pp_group) if dist.is_initialized() else 1
    rank, (x, y), m = dist.get_rank(pp_group) if p > 1 else 0, batch, n_microbatches
    mods, S = [getattr(c, "module", c) for c in chunks], p * len(chunks)
    check_config(schedule, p, m, len(chunks), batch_size=x.size(0))
    assert all(mod.n_stages == S for mod in mods), f"chunks not split for {p}x{len(chunks)} stages"
    assert [mod.stage for mod in mods] == list(range(rank, S, p)), "chunks not split for this rank"
    tied = any(tied_parameter(mod) is not None for mod in mods)
    if p > 1 and tied and embed_group is None and not forward_only:
        raise ValueError("tied embeddings across stages need embed_group=embedding_group(...)")
    shape = tuple(act_shape or (x.size(0) // m, x.size(1), mods[0].config.n_embd))
    act = shape, act_dtype or next(mods[0].parameters()).dtype
    n_tokens = int((y != -1).sum()) if n_tokens is None else n_tokens  # 02's ignore index
    assert n_tokens > 0, "this step has no target tokens: every target is -1"
    run = PipelineExecutor(chunks, batch, m, pp_group, p, rank, act, n_tokens, dp_size * loss_scale)
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        run.run(step_plan(schedule, p, m, len(chunks), forward_only)[rank])
    if embed_group is not None and not forward_only:
        allreduce_tied_grads(mods, embed_group)
    return StepResult(run.loss, run.events, run.peak)


# --------------------------------------------------------------------------- the demo


def plot_timelines(timelines: dict, path) -> None:
    """{title: per-rank Events} -> one Gantt chart per title, on a shared time axis. Forwards in
    blues, backwards in oranges, the shade cycling with the microbatch, whose number is in the box
    (with its chunk's letter where a rank holds several chunks)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    p, n = len(next(iter(timelines.values()))), len(timelines)
    colours = {"F": plt.get_cmap("Blues"), "B": plt.get_cmap("Oranges")}
    fig, axes = plt.subplots(n, 1, figsize=(13, 1 + 0.45 * p * n), sharex=True, squeeze=False)
    for ax, (title, timeline) in zip(axes[:, 0], timelines.items()):
        chunked = any(e.chunk for events in timeline for e in events)
        for r, events in enumerate(timeline):
            for e in events:
                x, w, shade = e.start * 1e3, (e.end - e.start) * 1e3, 0.3 + 0.2 * (e.mb % 4)
                ax.broken_barh([(x, w)], (r - 0.4, 0.8), color=colours[e.op](shade), ec="k", lw=0.3)
                label = f"{e.mb}" + ("abcdefgh"[e.chunk] if chunked else "")  # no "a" alone
                ink = "black" if shade < 0.6 else "white"
                ax.text(x + w / 2, r, label, ha="center", va="center", fontsize=6, color=ink)
        ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
        ax.set_ylim(p - 0.5, -0.5)
        ax.set_title(title, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("time since the step began (ms); each box: its microbatch (and chunk)")
    names = {"F": "forward", "B": "backward"}
    legend = [Patch(color=colours[op](0.6), label=name) for op, name in names.items()]
    fig.legend(handles=legend, loc="upper right", fontsize=7, ncol=2)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / (1 + 0.45 * p * n)))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def max_grad_error(model, chunks, x, y):
    """One process on the whole batch: the largest |pipeline grad - its grad| over this rank's
    parameters (lm_head.weight is the tied wte's copy), and the one-process loss."""
    grads = {n: q.grad.clone() for c in chunks for n, q in c.named_parameters()}
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    ref = dict(model.named_parameters())
    wte = ref["transformer.wte.weight"]
    return max((g - ref.get(n, wte).grad).abs().max() for n, g in grads.items()), loss.detach()


def median_step(args, model, chunks, batch, name, embed_group):
    """One warm-up and args.steps timed steps of `name` (a schedule, or "gpipe, naive"): the
    median step's bubble, every rank's (Events, peak microbatches alive), this rank's result."""
    steps = []
    for _ in range(args.steps + 1):
        model.zero_grad(set_to_none=True)
        if name == "gpipe, naive":
            result = gpipe_naive(chunks[0], batch, args.microbatches, embed_group=embed_group)
        else:
            result = pipeline_step(chunks, batch, args.microbatches, name, embed_group=embed_group)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (result.events, result.peak_in_flight))
        steps.append((bubble_fraction([events for events, _ in gathered]), gathered))
    return (*sorted(steps[1:], key=lambda step: step[0])[args.steps // 2], result)


def demo(args, rank: int, p: int, device) -> None:
    """The naive GPipe and every schedule on one model and batch, each checked against one
    process and the simulator's order: one printed row each, from the median timed step."""
    m, T, print0 = args.microbatches, 64, ddp_lib.print0
    torch.manual_seed(0)  # the same model on every rank, cut afterwards
    config = dict(n_layer=args.n_layer, n_head=4, n_embd=args.n_embd, block_size=T, vocab_size=256)
    model = model_lib.GPT(model_lib.GPTConfig(**config)).to(device)
    (batch,) = model_lib.byte_batches(T, args.micro_batch * m, device=device)
    embed_group, timelines = embedding_group([list(range(p))]), {}
    print0(
        f"p={p} stages, m={m} microbatches of {args.micro_batch}x{T} bytes, {args.n_layer} "
        f"blocks of C={args.n_embd}, {dist.get_backend()}; the median of {args.steps} steps:\n"
    )
    print0(
        f"{'':<16}{'loss':>9}{'max|Δgrad|':>11}{'bubble':>9}{'simulated':>11}{'formula':>9}"
        "   peak alive per stage"
    )
    for name in ("gpipe, naive", *SCHEDULES):
        schedule, v = name.split(",")[0], args.virtual_stages if name == "interleaved" else 1
        chunks = split_model(model, rank, p, v)
        bubble, gathered, result = median_step(args, model, chunks, batch, name, embed_group)
        timeline, peaks = [events for events, _ in gathered], [peak for _, peak in gathered]
        orders, ideal = simulate(schedule, p, m, v)  # t_b = 2 t_f, free messages
        assert [[Action(*e[:3]) for e in ev] for ev in timeline] == orders, f"{name}: order"
        err, ref_loss = max_grad_error(model, chunks, *batch)
        stats = torch.stack([result.loss, err])
        dist.all_reduce(stats[:1])  # SUM of the losses: 0 on every stage but the last
        dist.all_reduce(stats[1:], op=dist.ReduceOp.MAX)
        (loss, err), formula = stats.tolist(), bubble_formula(p, m, v)
        assert abs(loss - ref_loss) < 1e-5 and err < 1e-5, f"{name} differs from one process"
        label = f"{name} v={v}" if v > 1 else name
        print0(
            f"{label:<16}{loss:>9.5f}{err:>11.1e}{bubble:>9.1%}{bubble_fraction(ideal):>11.1%}"
            f"{formula:>9.1%}   {peaks}" + (" (microbatch, chunk) pairs" if v > 1 else "")
        )
        timelines[f"{label}: measured bubble {bubble:.1%}, formula {formula:.1%}"] = timeline
    print0(
        "\nEvery row: loss and every gradient equal one process on the whole batch (< 1e-5), and"
        "\nevery rank ran the simulator's order. bubble: 1 - busy/span as run (waiting, messages"
        "\nand Python count as idle). simulated: the same plan under NCCL's rule with free"
        "\nmessages and t_b = 2 t_f. formula: (p-1)/(v·m+p-1)."
    )
    if p > (os.cpu_count() or p):  # then the measured bubble also counts time-sharing
        print0(f"Note: {p} ranks share {os.cpu_count()} cores, so they are not truly concurrent.")
    if args.plot and rank == 0:
        path = Path("out/pipeline") / f"pipeline_p{p}_m{m}.png"
        plot_timelines(timelines, path)
        print(f"wrote {path}")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=4, help="p, pipeline stages: one process each")
    parser.add_argument("--microbatches", type=int, default=8, help="m; bubble (p-1)/(m+p-1)")
    parser.add_argument("--micro-batch", type=int, default=4, help="b, sequences per microbatch")
    parser.add_argument("--virtual-stages", type=int, default=2, help="v, interleaved's chunks")
    parser.add_argument("--n-layer", type=int, default=8, help="blocks: one per stage at p·v=8")
    parser.add_argument("--n-embd", type=int, default=256, help="C: so matmuls outweigh messages")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    parser.add_argument("--plot", action="store_true", help="draw out/pipeline/*.png, the Gantt")
    args = parser.parse_args(argv)
    p = int(os.environ.get("WORLD_SIZE", args.ranks))  # under torchrun, the world is the pipeline
    try:  # the interleaved schedule asks the most: m % p == 0 and n_layer >= p·v
        check_config("interleaved", p, args.microbatches, args.virtual_stages, args.n_layer)
    except ValueError as e:
        parser.error(str(e))
    if "WORLD_SIZE" not in os.environ:
        return ddp_lib.relaunch_with_torchrun(args.ranks, argv, __file__)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // p))  # a fair share of the cores each
    rank, _, world_size, device = ddp_lib.init_distributed()
    try:
        demo(args, rank, world_size, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
