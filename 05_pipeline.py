"""05_pipeline.py: pipeline parallelism. Cut the model into stages, stream microbatches through.

The idea in one sentence: give each of p ranks a consecutive slice of the layers (a stage), split
the batch into m microbatches, and let stage r work on microbatch i while stage r+1 works on
microbatch i-1, passing activations forward and their gradients back with point-to-point sends.

    rank 0: embed + blocks 0-1 ─▶ rank 1: blocks 2-3 ─▶ rank 2: blocks 4-5 ─▶ rank 3: blocks 6-7
            (wte copy)          ◀─  dL/dx (b, T, C)  ◀─                    ◀─   + ln_f, lm_head
                                                                                  (wte copy), loss
The bubble. A stage idles while the pipeline fills and drains. With a forward taking t_f and a
backward t_b per microbatch per stage, GPipe and 1F1B both take (m + p - 1)(t_f + t_b) for
m (t_f + t_b) of work per rank, so the idle share of the step is

    bubble = (p - 1) / (m + p - 1)                                  GPipe, 1F1B
    bubble = (p - 1) / (v·m + p - 1),  i.e. (p-1)/(v·m) of the work   interleaved, v chunks per rank

Interleaving gives each rank v thin chunks (rank r holds stages r, r+p, r+2p, ...): the fill and
drain are made of chunk-sized steps, v times shorter, at the price of v times more messages.

Memory. GPipe runs all m forwards before any backward, so each stage stores the activations of
all m microbatches. 1F1B (PipeDream-flush) starts backward as soon as the last stage can: stage r
runs p-r-1 warm-up forwards, then alternates one forward and one backward, so it never holds more
than p-r <= p microbatches: with m >> p, the same bubble for a fraction p/m of the memory.
Tied embeddings: stage 0 looks tokens up in wte, the last stage multiplies by wte^T. Each keeps a
copy, and every step the two copies' gradients are summed over an "embedding group" of those two
ranks (Megatron), so both take the same optimizer step and stay one matrix.

NCCL's rule. Sends and receives go in batch_isend_irecv groups, and on GPUs a send completes only
once the peer has posted the matching receive, and a group only as a whole: if rank 0's group
waits on a receive rank 1 posts in a later group, and rank 1's on one rank 0 posts later, both
hang. (Plain gloo hands back one work per operation, so an executor that waits only its
receives passes on CPUs; the tests emulate NCCL's blocking instead.) So the plan is made on an
imaginary shared clock of ticks: what one rank sends at tick t, its neighbour receives in its own
group of tick t (`comm_plan`; in the steady state, Megatron's send_forward_recv_backward on one
side of a link and send_backward_recv_forward on the other). At run time each rank just posts its
groups in order. The simulator runs that plan under NCCL's rule (`nccl_timeline`).

Timelines below come from `simulate()` with t_f = t_b = 1 (a real backward costs ~2x); Fi/Bi is
microbatch i, "." idle; for interleaved a/b name the chunk and one column is one chunk's step:

    GPipe p=4, m=8: bubble 3/11, 8 alive             1F1B p=4, m=8: bubble 3/11, <= 4 alive
    r0 F0F1F2F3F4F5F6F7 . . . . . .B0B1B2B3B4B5B6B7  r0 F0F1F2F3 . . .B0F4B1F5B2F6B3F7B4 .B5 .B6 .B7
    r1  .F0F1F2F3F4F5F6F7 . . . .B0B1B2B3B4B5B6B7    r1  .F0F1F2 . .B0F3B1F4B2F5B3F6B4F7B5 .B6 .B7
    r2  . .F0F1F2F3F4F5F6F7 . .B0B1B2B3B4B5B6B7      r2  . .F0F1 .B0F2B1F3B2F4B3F5B4F6B5F7B6 .B7
    r3  . . .F0F1F2F3F4F5F6F7B0B1B2B3B4B5B6B7        r3  . . .F0B0F1B1F2B2F3B3F4B4F5B5F6B6F7B7

    1F1B p=4, m=4 (one column = half a stage's forward): bubble 3/7 = 43%
    r0 F0  F1  F2  F3   . . . . . .B0   . .B1   . .B2   . .B3
    r1  . .F0  F1  F2   . . . .B0  F3  B1   . .B2   . .B3
    r2  . . . .F0  F1   . .B0  F2  B1  F3  B2   . .B3
    r3  . . . . . .F0  B0  F1  B1  F2  B2  F3  B3
    interleaved p=4, m=4, v=2 (chunks a, b; same scale): bubble 3/11 = 27%
    r0 F0aF1aF2aF3aF0bF1bF2bF3b  .  .  .  .B0b  .  .B1bB2bB3bB0aB1aB2aB3a
    r1   .F0aF1aF2aF3aF0bF1bF2bF3b  .  .B0b  .B1bB2b  .B3bB0aB1aB2aB3a
    r2   .  .F0aF1aF2aF3aF0bF1b  .F2bB0bF3bB1bB2b  .B3bB0aB1aB2aB3a
    r3   .  .  .F0aF1aF2aF3aF0bB0bF1bB1bF2bB2bF3bB3bB0aB1aB2aB3a

Launch:  torchrun --standalone --nproc_per_node=4 05_pipeline.py [--plot]   (CPU gloo or GPUs)
         python 05_pipeline.py        prints these timelines and how to launch

Papers: GPipe (Huang et al. 2018, arXiv 1811.06965), PipeDream's one-forward-one-backward
(Narayanan et al. 2018, arXiv 1806.03377; the flushed variant is 1F1B), and Megatron-LM's
interleaved schedule and bubble analysis (Narayanan et al. 2021, arXiv 2104.04473, section 2.2).

What changed from 04: data parallelism (03) copied the model and tensor parallelism (04) split
every matrix; here each rank holds whole layers, only some of them, and talks only to its two
neighbours, which is why PP is the one to stretch across nodes. The schedules are data: steps of
(F|B, microbatch, chunk) per rank (`schedule_steps`), placed on a shared clock of ticks with p2p
groups (`comm_plan`), run under NCCL's rule by the simulator and executed as-is by
`pipeline_step`, whose loss is normalised by the step's token count exactly as 06's accumulation.

Left out on purpose: zero-bubble schedules that split the backward into input and weight
gradients (arXiv 2401.10241) and DualPipe; unbalanced stages (the first and last stage here also
run the embedding and the head); deallocating sent outputs early (Megatron keeps only grad_fn);
activation recomputation; overlapping the p2p with compute (each step's group is waited before
the next step, as Megatron does without overlap_p2p_comm).
"""

import argparse
import contextlib
import functools
import importlib
import json
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

model_lib = importlib.import_module("02_model")
ddp_lib = importlib.import_module("03_ddp")  # init_distributed, print0

SCHEDULES = ("gpipe", "1f1b", "interleaved")


class Action(NamedTuple):
    op: str  # "F" forward or "B" backward
    mb: int  # microbatch
    chunk: int  # which of this rank's v chunks (0 unless interleaved)


class Event(NamedTuple):  # an Action with its start and end: seconds since the step began
    op: str  # (measured) or time units (simulated)
    mb: int
    chunk: int
    start: float
    end: float


# --------------------------------------------------------------------------- validation


def check_config(schedule, p, m, v=1, n_layer=None, batch_size=None):
    """Every bad (schedule, p, m, v, layers, batch) raises here, before any send."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if min(p, m, v) < 1:
        raise ValueError(f"need pp_size, microbatches, virtual_stages >= 1, got {p}, {m}, {v}")
    if v > 1 and schedule != "interleaved":
        raise ValueError(f"virtual_stages={v} > 1 needs schedule='interleaved', not {schedule!r}")
    if schedule == "interleaved" and m % p != 0:
        raise ValueError(f"interleaved needs microbatches divisible by pp_size: m={m}, p={p} "
                         f"(m % p = {m % p}); microbatches go round the ring in groups of p")  # fmt: skip
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
    Rank 0's chunk 0 has the embeddings, rank p-1's last chunk the final LayerNorm and head.
    Build the full model from one seed on every rank, split it, then drop the full model."""
    p, v, L = pp_size, virtual_stages, len(model.transformer.h)
    check_config("interleaved" if v > 1 else "1f1b", p, p, v, n_layer=L)
    assert 0 <= pp_rank < p, f"pp_rank={pp_rank} outside [0, {p})"
    S = p * v
    return [
        PipelineChunk(model, s, S, range(s * L // S, (s + 1) * L // S))  # sizes differ by <= 1
        for s in range(pp_rank, S, p)
    ]


def tied_parameter(chunk):
    """The chunk's copy of the tied wte/lm_head matrix, or None."""
    if chunk.config.tie_embeddings and (chunk.is_first or chunk.is_last):
        return chunk.transformer.wte.weight if chunk.is_first else chunk.lm_head.weight


def embedding_group(pp_groups_ranks):
    """Megatron's embedding group: {first, last} rank of *this rank's* pipeline, for the tied
    wte/lm_head copies. Call it on EVERY rank of the world with the global ranks of EVERY PP
    group, in the same order. subtle: dist.new_group is a collective over the whole world, even
    for ranks not in the new group; if each rank created only its own pair, ranks would disagree
    on which group is which (with dp > 1 there is one pair per pipeline) and hang or mix them up."""
    mine = None
    for ranks in pp_groups_ranks:
        pair = sorted({ranks[0], ranks[-1]})
        if len(pair) == 1:
            continue  # p = 1: both copies are one Parameter already (same on every rank)
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine


def allreduce_tied_grads(chunks, embed_group):
    """The first stage's wte and the last stage's lm_head are two copies of one matrix, updated by
    two different uses (lookup, output projection). Its true gradient is the sum of both, so sum
    the two copies' grads: both ranks then take the same optimizer step and stay identical."""
    for chunk in chunks:
        param = tied_parameter(chunk)
        if param is not None and param.grad is not None:
            dist.all_reduce(param.grad, group=embed_group)  # SUM over {first, last}


# --------------------------------------------------------------------------- schedules as data


def schedule_steps(schedule: str, p: int, m: int, v: int, rank: int) -> list[tuple[Action, ...]]:
    """Rank's actions, in steps: what it runs between two p2p exchanges. All three schedules are:
    w warm-up forwards, then one forward and one backward in turn, then the remaining backwards.
    GPipe: w = m. 1F1B: w = p-rank-1, so stage r holds at most p-r microbatches. Interleaved
    (Megatron): forwards go round the ring in groups of p microbatches per chunk, backwards
    through the chunks in reverse; w = 2(p-rank-1)+(v-1)p. GPipe and 1F1B exchange after every
    action (Megatron's send_forward_recv_backward after a forward, send_backward_recv_forward
    after a backward). Interleaved runs each steady-state forward and backward back to back and
    exchanges once after both (send_forward_backward_recv_forward_backward): its longer warm-up
    is what lets each backward's gradient arrive in the previous exchange."""
    check_config(schedule, p, m, v)
    if schedule == "interleaved":
        mb = lambda k: k // (p * v) * p + k % p  # noqa: E731 - virtual microbatch k -> microbatch
        ck = lambda k: k % (p * v) // p  # noqa: E731 - ... and its chunk
        fwd = [Action("F", mb(k), ck(k)) for k in range(m * v)]
        bwd = [Action("B", mb(k), v - 1 - ck(k)) for k in range(m * v)]
        warmup = min(2 * (p - rank - 1) + (v - 1) * p, m * v)
    else:
        fwd = [Action("F", i, 0) for i in range(m)]
        bwd = [Action("B", i, 0) for i in range(m)]
        warmup = m if schedule == "gpipe" else min(p - rank - 1, m)
    steps = [(f,) for f in fwd[:warmup]]
    for f, b in zip(fwd[warmup:], bwd):  # steady state: one forward, one backward
        steps += [(f, b)] if schedule == "interleaved" else [(f,), (b,)]
    return steps + [(b,) for b in bwd[len(fwd) - warmup :]]  # cool-down


def schedule_order(schedule: str, p: int, m: int, v: int, rank: int) -> list[Action]:
    """Rank's actions in the order it runs them (schedule_steps, flattened)."""
    return [a for step in schedule_steps(schedule, p, m, v, rank) for a in step]


def _destination(a: Action, rank: int, p: int, v: int) -> int | None:
    """The rank that consumes action a's output: a forward at stage s feeds stage s+1, a
    backward stage s-1 (stage s lives on rank s % p); None at the ends of the pipeline."""
    s = a.chunk * p + rank + (1 if a.op == "F" else -1)
    return s % p if 0 <= s < p * v else None


# --------------------------------------------------------------------------- NCCL's rule, planned
# subtle: NCCL has no send buffer. A send completes only when the receiver has posted the
# matching receive, and a batch_isend_irecv group completes only as a whole. The obvious
# executor groups "send my last output, receive my next input" and waits on the group before
# computing. Interleaved p=2, m=4, v=2 then hangs on GPUs: after B0 of chunk b, rank 0 posts
# {send B0's gradient, receive F2's input}; rank 1 receives that gradient only in the group it
# posts after F2 of chunk a, which comes after the group it posts after B1 of chunk b, {send
# B1's gradient, receive F2's input}, and rank 0 receives B1's gradient only after its F3 of
# chunk a, which it cannot reach while its own group waits. Each waits on the other's later
# group. GPipe and 1F1B happen to pair up; interleaved with m > p does not (tests/test_pipeline).


class Tick(NamedTuple):
    """One rank's share of one tick of the plan's clock: compute, then one group. A message is
    (op, microbatch, stage) of the action that made the tensor."""

    actions: tuple  # what it computes first: (), (F,), (B,) or (F, B)
    sends: tuple  # ((peer, message), ...), then posted with the receives as ONE group
    recvs: tuple  # ((peer, message), ...)


def _needs(a: Action, s: int, S: int):
    """The (op, microbatch, stage) whose output action a, at stage s of S, consumes."""
    if a.op == "F":
        return ("F", a.mb, s - 1) if s > 0 else None  # the previous stage's activation
    return ("B", a.mb, s + 1) if s < S - 1 else ("F", a.mb, s)  # the next stage's gradient


def comm_plan(steps, p: int, v: int) -> list[list[Tick]]:
    """Each rank's steps placed on an imaginary shared clock, with the group it posts after each.

    Run the steps in lock-step: at tick t a rank runs its next step if the step's inputs were
    made before t (or by the step itself: the last stage's backward needs its own forward).
    A message made at tick t is sent in the sender's group of tick t and received in the
    receiver's group of tick t. So a rank's group of tick t matches exactly its neighbours'
    groups of tick t, all ranks post groups in increasing t, and no wait can depend on a peer's
    later group. The steady-state pairs of schedule_steps' docstring come out of this rule.
    Ticks where a rank neither computes nor communicates are left out of its list, so the same
    index on two ranks is not in general the same tick."""
    S, nxt, made, t = p * v, [0] * p, {}, 0
    plan = [[] for _ in range(p)]
    while any(nxt[r] < len(steps[r]) for r in range(p)):
        ran = {}
        for r in range(p):
            if nxt[r] < len(steps[r]):
                step = steps[r][nxt[r]]
                own = {(a.op, a.mb, a.chunk * p + r) for a in step}
                deps = {_needs(a, a.chunk * p + r, S) for a in step} - own - {None}
                if all(made.get(dep, t) < t for dep in deps):
                    ran[r], nxt[r] = step, nxt[r] + 1
        if not ran:
            stuck = {r: steps[r][nxt[r]] for r in range(p) if nxt[r] < len(steps[r])}
            raise RuntimeError(f"the steps deadlock at tick {t}; waiting: {stuck}")
        sends, recvs = defaultdict(list), defaultdict(list)
        for r, step in ran.items():
            for a in step:
                msg = (a.op, a.mb, a.chunk * p + r)
                made[msg] = t
                dst = _destination(a, r, p, v)
                if dst is not None and dst != r:  # p = 1: chunk k hands to chunk k+1 in-process
                    sends[r].append((dst, msg))
                    recvs[dst].append((r, msg))
        for r in range(p):
            if r in ran or sends[r] or recvs[r]:
                plan[r].append(Tick(ran.get(r, ()), tuple(sends[r]), tuple(recvs[r])))
        t += 1
    return plan


def _pairs(plan) -> list[tuple]:
    """((rank, tick index), (rank, tick index)) of each send and its receive: NCCL pairs the
    k-th send r->q with the k-th receive on q from r, whatever they carry, so check that too."""
    where, count = {}, defaultdict(int)
    for r, ticks in enumerate(plan):
        for i, tick in enumerate(ticks):
            for side, ops in (("send", tick.sends), ("recv", tick.recvs)):
                for peer, msg in ops:
                    key = ((r, peer) if side == "send" else (peer, r), side)
                    where[(*key, count[key])] = ((r, i), msg)
                    count[key] += 1
    pairs = []
    for (pair, side, k), (group, msg) in where.items():
        other = where.get((pair, "recv" if side == "send" else "send", k))
        assert other is not None, f"rank {group[0]}'s {side} of {msg} ({pair}) has no partner"
        assert other[1] == msg, f"{pair}: message {k} is {msg} on one side, {other[1]} on the other"
        if side == "send":
            pairs.append((group, other[0]))
    return pairs


def nccl_timeline(plan, v: int, t_f: float = 1.0, t_b: float = 2.0) -> list[list[Event]]:
    """Execute a comm plan under NCCL's rule: the Events, or an error naming the groups that hang.

    Each rank computes its tick's actions (a microbatch's forward and backward through one rank's
    layers take t_f and t_b; a chunk's t_f/v and t_b/v; their inputs must be here already), then
    launches the tick's group, if it has one, and blocks until the whole group completes. Inside
    a launched group the operations progress independently; each completes when the rank holding
    its partner has launched the partner's group (no send buffer; messages take no time)."""
    p, pending = len(plan), set(_pairs(plan))
    at, clock, launched_at = [0] * p, [0.0] * p, {}
    have, timeline = [set() for _ in range(p)], [[] for _ in range(p)]
    while True:
        for r in range(p):  # each rank runs until it blocks on a group (or ends)
            while at[r] < len(plan[r]):
                tick = plan[r][at[r]]
                if (r, at[r]) not in launched_at:
                    for a in tick.actions:
                        s, start = a.chunk * p + r, clock[r]
                        need = _needs(a, s, p * v)
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
            raise RuntimeError(f"deadlock under NCCL's rule: the groups (rank, index) "
                               f"{sorted(launched)} each wait on a peer's later group")  # fmt: skip
        for r, i in done:
            have[r].update(msg for _, msg in plan[r][i].recvs)
            at[r] += 1


def simulate(schedule: str, p: int, m: int, v: int = 1, t_f: float = 1.0, t_b: float = 2.0):
    """-> (orders, timeline): each rank's actions, and the Events when the executor's plan for
    them (comm_plan) runs under NCCL's rule with forward and backward times t_f and t_b and free
    messages. Raises if the steps deadlock, or if the plan's groups would pair sends and
    receives wrongly or hang on NCCL."""
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


def ascii_timeline(timeline, unit: float = 1.0, chunks: bool = False) -> str:
    """One row per rank, one column per `unit` of time: Fi/Bi (+ the chunk's letter), . idle."""
    w, lines = 3 if chunks else 2, []
    for r, events in enumerate(timeline):
        row, t = f"r{r} ", 0.0
        for e in events:
            row += ".".rjust(w) * round((e.start - t) / unit)
            label = f"{e.op}{e.mb}" + (chr(ord("a") + e.chunk) if chunks else "")
            row += label.ljust(w * round((e.end - e.start) / unit))
            t = e.end
        lines.append(row.rstrip())
    return "\n".join(lines)


# --------------------------------------------------------------------------- running a step


@dataclass
class StepResult:
    loss: torch.Tensor  # last stage: Σ token losses / the step's tokens (this replica's share)
    events: list  # Events in the order they ran, start/end in seconds since the step began
    peak_in_flight: int  # most (microbatch, chunk) forwards alive at once, awaiting backward


class _Run:
    """One step on one rank: received tensors, the stash of live activations, the clock."""

    def __init__(self, chunks, xs, ys, group, p, rank, shape, dtype):
        self.chunks, self.xs, self.ys, self.group, self.p = chunks, xs, ys, group, p
        self.modules = [getattr(c, "module", c) for c in chunks]  # unwrap DP wrappers
        self.rank, self.v, self.shape, self.dtype = rank, len(chunks), shape, dtype
        # pp_prev_rank/pp_next_rank as global ranks: the PP group is a subset of the world
        neighbours = {(rank - 1) % p, (rank + 1) % p} if p > 1 else set()
        self.peer = {q: dist.get_global_rank(group or dist.group.WORLD, q) for q in neighbours}
        self.inbox, self.stash, self.events = {}, {}, []  # inbox: message -> tensor
        self.loss, self.peak = torch.zeros((), device=xs[0].device), 0
        self.n_tokens, self.grad_scale = 1, 1.0  # pipeline_step sets them

    def exchange(self, tick: Tick, outs: dict):
        """This tick's sends and receives as ONE batch_isend_irecv group (NCCL launches it as one
        kernel), waited as a whole before the next compute: the plan made that safe."""
        ops = [dist.P2POp(dist.isend, outs[msg], self.peer[q], self.group) for q, msg in tick.sends]
        for q, msg in tick.recvs:  # the shape is known from the config: nothing describes it
            self.inbox[msg] = torch.empty(self.shape, dtype=self.dtype, device=self.xs[0].device)
            ops.append(dist.P2POp(dist.irecv, self.inbox[msg], self.peer[q], self.group))
        for work in dist.batch_isend_irecv(ops):  # NCCL: one work for the group; gloo: one each
            work.wait()

    def forward(self, a: Action, s: int):
        chunk, mod = self.chunks[a.chunk], self.modules[a.chunk]
        if mod.is_first:
            inp = self.xs[a.mb]  # (b, T) ids
        else:  # (b, T, C): we need dL/d(input) to send back
            inp = self.inbox.pop(_needs(a, s, mod.n_stages)).requires_grad_()
        out = chunk(inp)  # (b, T, C), or (b, T, V) logits on the last stage
        if mod.is_last:  # Σ of the microbatch's token losses / the step's token count (as 06)
            loss_sum = mod.loss_fn(out, self.ys[a.mb], "sum")
            self.loss += loss_sum.detach() / self.n_tokens
            out = loss_sum * self.grad_scale  # dp_size · loss_scale · loss_sum / n_tokens
        if torch.is_grad_enabled():  # (not when evaluating: no backward will come)
            self.stash[(a.mb, a.chunk)] = (inp, out)  # alive until this microbatch's backward
            self.peak = max(self.peak, len(self.stash))
        return None if mod.is_last else out.detach()

    def backward(self, a: Action, s: int, last_of_chunk: bool):
        inp, out = self.stash.pop((a.mb, a.chunk))
        chunk, mod = self.chunks[a.chunk], self.modules[a.chunk]
        grad = None if mod.is_last else self.inbox.pop(_needs(a, s, mod.n_stages))
        # DP syncs gradients once per step: in the last backward of each chunk, never before
        quiet = hasattr(chunk, "no_sync") and not last_of_chunk
        with chunk.no_sync() if quiet else contextlib.nullcontext():
            torch.autograd.backward(out, grad_tensors=grad)  # grads accumulate in .grad
        return None if mod.is_first else inp.grad

    def run(self, ticks: list[Tick]):
        last_b = {a.chunk: a for t in ticks for a in t.actions if a.op == "B"}  # chunk's last
        if self.p > 1:
            dist.barrier(group=self.group)  # a common t = 0; NCCL's first p2p wants everyone
        t0 = time.perf_counter()
        for tick in ticks:
            outs = {}  # message -> the tensor this tick sends
            for a in tick.actions:
                s, start = a.chunk * self.p + self.rank, time.perf_counter()
                if a.op == "F":
                    out = self.forward(a, s)
                else:
                    out = self.backward(a, s, last_b[a.chunk] == a)
                self.events.append(Event(*a, start - t0, time.perf_counter() - t0))
                if _destination(a, self.rank, self.p, self.v) == self.rank:  # p = 1: next chunk
                    self.inbox[(a.op, a.mb, s)] = out
                outs[(a.op, a.mb, s)] = out
            if tick.sends or tick.recvs:
                self.exchange(tick, outs)
        assert not self.inbox and not self.stash, "a received tensor or activation was not used"


@functools.lru_cache(maxsize=64)
def step_plan(schedule: str, p: int, m: int, v: int, forward_only: bool = False):
    """Every rank's comm plan for one step (forward_only: the schedule's forwards alone)."""
    steps = [schedule_steps(schedule, p, m, v, r) for r in range(p)]
    if forward_only:  # the forwards alone, one per step: still deadlock-free (tested)
        steps = [[(a,) for step in rank_steps for a in step if a.op == "F"] for rank_steps in steps]
    return comm_plan(steps, p, v)


def pipeline_step(chunks, batch, n_microbatches: int, schedule: str = "1f1b", pp_group=None, *,
                  act_shape=None, act_dtype=None, embed_group=None, loss_scale: float = 1.0,
                  n_tokens=None, dp_size: int = 1, forward_only: bool = False) -> StepResult:  # fmt: skip
    """Forwards and backwards of one training step under `schedule` (no optimizer step).

    chunks: this rank's split_model list, each possibly wrapped by DP (`.module`, `no_sync()`).
    batch: (x, y), both (B, T), the same on every rank of the pipeline (stage 0 reads x, the last
    stage y). act_shape/act_dtype: one microbatch's activation between stages, default
    (B/m, T, C) in the parameters' dtype; with sequence parallelism pass (B/m, T/tp, C).
    The loss is normalised as 06 does: each microbatch contributes its SUM of token losses over
    n_tokens, the target tokens (not -1) of the whole step: all microbatches of all DP replicas
    (06's global_token_count); default: those of this batch. With DP wrappers (which average
    over the dp_size replicas) pass dp_size, so the gradients are those of one big batch.
    Gradients accumulate into .grad (zero them first). With tied embeddings and p > 1, pass
    embed_group=embedding_group(...): the copies' grads are summed.
    loss_scale: backward starts from loss_scale * loss (fp16 with a loss scaler; .loss is unscaled).
    forward_only: run only the schedule's forwards, in its order, under no_grad (evaluation).
    Returns StepResult; .loss is this replica's share of the step's loss on the last stage and 0
    on the others, so a SUM all-reduce over pp_group (and over DP) gives it to every rank."""
    p = dist.get_world_size(pp_group) if dist.is_initialized() else 1
    rank = dist.get_rank(pp_group) if p > 1 else 0
    x, y = batch
    mods, m = [getattr(c, "module", c) for c in chunks], n_microbatches
    check_config(schedule, p, m, len(chunks), batch_size=x.size(0))
    S = p * len(chunks)
    assert all(mod.n_stages == S for mod in mods), f"chunks not split for {p}x{len(chunks)} stages"
    assert [mod.stage for mod in mods] == list(range(rank, S, p)), "chunks not split for this rank"
    tied = any(tied_parameter(mod) is not None for mod in mods)
    if p > 1 and tied and embed_group is None and not forward_only:
        raise ValueError("tied embeddings across stages need embed_group=embedding_group(...)")
    shape = tuple(act_shape or (x.size(0) // m, x.size(1), mods[0].config.n_embd))
    dtype = act_dtype or next(mods[0].parameters()).dtype
    run = _Run(chunks, x.chunk(m), y.chunk(m), pp_group, p, rank, shape, dtype)
    run.n_tokens = int((y != -1).sum()) if n_tokens is None else n_tokens  # 02's ignore index
    assert run.n_tokens > 0, "this step has no target tokens: every target is -1"
    run.grad_scale = dp_size * loss_scale / run.n_tokens
    ticks = step_plan(schedule, p, m, len(chunks), forward_only)[rank]
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        run.run(ticks)
    if embed_group is not None and not forward_only:
        allreduce_tied_grads(mods, embed_group)
    return StepResult(run.loss, run.events, run.peak)


def gather_timeline(events, pp_group=None):
    """Every pipeline rank's events, indexed by pp rank (a collective on pp_group)."""
    out = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(out, list(events), group=pp_group)
    return out


# --------------------------------------------------------------------------- pictures


def write_chrome_trace(timelines: dict, path) -> None:
    """{name: per-rank Events} -> Chrome-trace JSON (open in ui.perfetto.dev): a process per
    schedule, a thread per pipeline rank, a slice per forward or backward."""
    trace = []
    for pid, (name, timeline) in enumerate(timelines.items()):
        trace.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
        for r, events in enumerate(timeline):
            trace.append(
                dict(ph="M", name="thread_name", pid=pid, tid=r, args={"name": f"rank {r}"})
            )
            for e in events:
                op = "forward" if e.op == "F" else "backward"
                trace.append(
                    {"ph": "X", "name": f"{e.op}{e.mb} chunk {e.chunk}", "cat": op, "pid": pid,
                     "tid": r, "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6}
                )  # fmt: skip
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))


def plot_timelines(timelines: dict, path) -> None:
    """{title: per-rank Events} -> one Gantt chart per title, stacked on a shared time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    p, n = len(next(iter(timelines.values()))), len(timelines)
    fig, axes = plt.subplots(n, 1, figsize=(13, 1 + 0.45 * p * n), sharex=True, squeeze=False)
    colors = {("F", 0): "#4c72b0", ("F", 1): "#9fb8e0", ("B", 0): "#dd8452", ("B", 1): "#f3c3a2"}
    for ax, (title, timeline) in zip(axes[:, 0], timelines.items()):
        for r, events in enumerate(timeline):
            for e in events:
                x, w = e.start * 1e3, (e.end - e.start) * 1e3  # ms
                ax.broken_barh([(x, w)], (r - 0.4, 0.8), facecolors=colors[e.op, e.chunk % 2],
                               edgecolor="white", linewidth=0.4)  # fmt: skip
                ax.text(x + w / 2, r, str(e.mb), ha="center", va="center", fontsize=6)
        ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
        ax.set_ylim(p - 0.5, -0.5)
        ax.set_title(title, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("time since the step began (ms); numbers are microbatches")
    names = {"F": "forward", "B": "backward"}
    legend = [
        Patch(color=c, label=f"{names[op]}, chunk {'ab'[k]}") for (op, k), c in colors.items()
    ]
    fig.legend(handles=legend, loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / (1 + 0.45 * p * n)))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


# --------------------------------------------------------------------------- the demo


@dataclass
class DemoConfig:
    n_layer: int = 8  # p·v = 4·2 interleaved stages of one block each
    n_embd: int = 256  # wide enough that a block's matmuls, not Python or messages, take the time
    n_head: int = 4
    block_size: int = 64  # T
    micro_batch: int = 4  # b: sequences per microbatch
    microbatches: int = 8  # m; the bubble is (p-1)/(m+p-1)
    virtual_stages: int = 2  # v for the interleaved schedule
    steps: int = 3  # timed steps per schedule, after one warm-up step
    plot: bool = False
    out_dir: str = "out/pipeline"
    seed: int = 1337


def max_grad_error(model, chunks, x, y):
    """One process on the whole batch, then the largest |pipeline grad - its grad| over this
    rank's parameters (lm_head.weight is the tied wte's copy), and the one-process loss."""
    grads = {n: q.grad.clone() for c in chunks for n, q in c.named_parameters()}
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    ref = dict(model.named_parameters())
    wte = ref["transformer.wte.weight"]
    return max((g - ref.get(n, wte).grad).abs().max() for n, g in grads.items()), loss.detach()


def demo_schedule(cfg, model, x, y, schedule, p, rank, embed_group):
    """Warm-up, cfg.steps timed steps, then the check against one process; prints one row."""
    v = cfg.virtual_stages if schedule == "interleaved" else 1
    chunks, m = split_model(model, rank, p, v), cfg.microbatches
    times, bubbles = [], []
    for _ in range(cfg.steps + 1):
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        result = pipeline_step(chunks, (x, y), m, schedule, embed_group=embed_group)
        times.append(time.perf_counter() - t)
        timeline = gather_timeline(result.events)
        bubbles.append(bubble_fraction(timeline))
    assert [[Action(*e[:3]) for e in ev] for ev in timeline] == simulate(schedule, p, m, v)[0]
    err, ref_loss = max_grad_error(model, chunks, x, y)
    step_s = torch.tensor(sorted(times[1:])[cfg.steps // 2], device=x.device)
    stats = torch.stack([result.loss, err, step_s])
    dist.all_reduce(stats[:1])  # SUM of the losses: 0 on every stage but the last
    dist.all_reduce(stats[1:], op=dist.ReduceOp.MAX)
    loss, err, step_s = stats.tolist()
    assert abs(loss - ref_loss) < 1e-5 and err < 1e-5, f"{schedule} differs from one process"
    peaks = [None] * p
    dist.all_gather_object(peaks, result.peak_in_flight)
    name, bubble = f"{schedule}" + (f" v={v}" if v > 1 else ""), sorted(bubbles[1:])[cfg.steps // 2]
    ddp_lib.print0(f"{name:<16}{loss:>10.6f}{err:>11.1e}{step_s * 1e3:>9.0f}{bubble:>10.1%}"
                   f"{bubble_formula(p, m, v):>9.1%}   {peaks}" + (" chunks" if v > 1 else ""))  # fmt: skip
    title = f"{name}: measured bubble {bubbles[-1]:.1%}, formula {bubble_formula(p, m, v):.1%}"
    return title, timeline


def demo(cfg: DemoConfig, rank: int, p: int, device):
    config = model_lib.GPTConfig(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                                 block_size=cfg.block_size, vocab_size=256)  # fmt: skip
    torch.manual_seed(cfg.seed)  # the same model on every rank, cut afterwards
    model = model_lib.GPT(config).to(device)
    g = torch.Generator().manual_seed(cfg.seed)
    B, T = cfg.micro_batch * cfg.microbatches, cfg.block_size
    rows = torch.randint(0, 256, (B, T + 1), generator=g)  # random bytes: any tokens will do
    x, y = rows[:, :-1].to(device), rows[:, 1:].to(device)  # (B, T) each
    embed_group, print0 = embedding_group([list(range(p))]), ddp_lib.print0
    print0(f"p={p} stages, m={cfg.microbatches} microbatches of {cfg.micro_batch}x{cfg.block_size}"
           f" tokens, {cfg.n_layer} blocks of C={cfg.n_embd}, {dist.get_backend()} p2p\n")  # fmt: skip
    print0(f"{'schedule':<16}{'loss':>10}{'max|Δgrad|':>11}{'step ms':>9}{'bubble':>10}{'formula':>9}"
           f"   peak microbatches alive per stage")  # fmt: skip
    timelines = dict(demo_schedule(cfg, model, x, y, s, p, rank, embed_group) for s in SCHEDULES)
    print0("\nEvery schedule: loss and every gradient equal one process on the whole batch (< 1e-5),"
           "\nand every rank ran exactly the simulator's order. Bubble: the median timed step's idle"
           "\nshare, 1 - busy/span, where waiting, messages and Python count as idle.")  # fmt: skip
    if p > (os.cpu_count() or p):
        print0(f"Note: {p} ranks share {os.cpu_count()} cores, so they are not truly concurrent.")
    if cfg.plot and rank == 0:
        path = Path(cfg.out_dir) / f"pipeline_p{p}_m{cfg.microbatches}"
        plot_timelines(timelines, path.with_suffix(".png"))
        write_chrome_trace(timelines, path.with_suffix(".json"))
        print0(f"wrote {path}.png (Gantt) and {path}.json (Chrome trace: ui.perfetto.dev)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in DemoConfig.__dataclass_fields__.values():
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool:
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=f.type, default=f.default)
    cfg = DemoConfig(**vars(parser.parse_args()))
    if "WORLD_SIZE" not in os.environ:
        print("Pipeline parallelism needs several processes. Launch it with torchrun:")
        print("    torchrun --standalone --nproc_per_node=4 05_pipeline.py [--plot]\n")
        print("Meanwhile, the simulator's timelines (t_f = t_b = 1; a chunk's step is 1/v):")
        for schedule, m, v in (("gpipe", 8, 1), ("1f1b", 8, 1), ("interleaved", 8, 2)):
            _, timeline = simulate(schedule, 4, m, v, 1.0, 1.0)
            print(f"\n{schedule} p=4 m={m} v={v}: bubble {bubble_fraction(timeline):.1%} "
                  f"= (p-1)/(v·m+p-1) = {bubble_formula(4, m, v):.1%}")  # fmt: skip
            print(ascii_timeline(timeline, 1.0 / v, chunks=v > 1))
        return
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    rank, _, world_size, device = ddp_lib.init_distributed()
    try:
        demo(cfg, rank, world_size, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
