"""05_pipeline.py: pipeline parallelism. Cut the model into stages, stream microbatches through.

Each of p ranks holds consecutive layers (a stage); of m microbatches, stage r works on microbatch i
while stage r+1 works on i-1, passing activations forward and gradients back point-to-point:
    rank 0: embed + blocks 0-1 ─▶ rank 1: blocks 2-3 ─▶ rank 2: blocks 4-5 ─▶ rank 3: blocks 6-7
            (wte copy)          ◀─  dL/dx (b, T, C)  ◀─                    ◀─   + ln_f, lm_head
    (wte copy): wte and lm_head are one matrix: gradients summed every step       (wte copy), loss
The bubble: stages idle while the pipeline fills and drains. With t_f, t_b a microbatch's forward
and backward on one stage, GPipe and 1F1B take (m+p-1)(t_f+t_b) for m(t_f+t_b) of work:
    bubble = (p - 1) / (m + p - 1)                                  GPipe, 1F1B
    bubble = (p - 1) / (v·m + p - 1),  i.e. (p-1)/(v·m) of the work   interleaved, v chunks per rank

GPipe (arXiv 1811.06965) runs all m forwards first: a stage holds m microbatches' activations.
1F1B (PipeDream-flush, 1806.03377) runs p-r-1 warm-up forwards on stage r, then alternates: at
most p-r alive, same bubble. Interleaving (Megatron-LM, 2104.04473) gives rank r stages r, r+p, ...:
fill and drain shrink v times, for v times the messages. simulate() draws (Fi/Bi: microbatch i):
    GPipe p=4, m=8, t_f = t_b: bubble 3/11, 8 alive  1F1B p=4, m=8: bubble 3/11, <= 4 alive; . idle
    r0 F0F1F2F3F4F5F6F7 . . . . . .B0B1B2B3B4B5B6B7  r0 F0F1F2F3 . . .B0F4B1F5B2F6B3F7B4 .B5 .B6 .B7
    r1  .F0F1F2F3F4F5F6F7 . . . .B0B1B2B3B4B5B6B7    r1  .F0F1F2 . .B0F3B1F4B2F5B3F6B4F7B5 .B6 .B7
    r2  . .F0F1F2F3F4F5F6F7 . .B0B1B2B3B4B5B6B7      r2  . .F0F1 .B0F2B1F3B2F4B3F5B4F6B5F7B6 .B7
    r3  . . .F0F1F2F3F4F5F6F7B0B1B2B3B4B5B6B7        r3  . . .F0B0F1B1F2B2F3B3F4B4F5B5F6B6F7B7

Simple first: `gpipe_naive`, a plain loop with blocking sends; then a schedule as data
(`schedule_steps`), on a clock of p2p groups (`comm_plan`), run by `pipeline_step`. NCCL's rule: on
GPUs a send completes only once its receive is posted, a batch_isend_irecv group only as a whole, so
comm_plan makes every group match a neighbour's group of the same tick (`nccl_timeline` proves it).

Launch:  python 05_pipeline.py [--ranks N] [--plot]   (relaunches itself under torchrun; N = 4)
         torchrun --standalone --nproc_per_node=4 05_pipeline.py [--plot]   (CPU gloo or GPUs)

What changed from 04: 03 copied the model, 04 split every matrix; here each rank holds only some
whole layers and talks only to its two neighbours: PP is the one to stretch across nodes. Left
out: zero-bubble schedules (2401.10241), DualPipe, unbalanced stages, freeing sent outputs early,
recomputation, overlapping p2p with compute. Sweeps and traces: bench/bench_pipeline.py.
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

from support import distributed

model_lib = importlib.import_module("02_model")  # GPT, GPTConfig, byte_batches

SCHEDULES = ("gpipe", "1f1b", "interleaved")
Action = namedtuple("Action", "op mb chunk")  # op "F" or "B", microbatch, which of v chunks
Event = namedtuple("Event", "op mb chunk start end")  # start/end: s into the step, or simulated
StepResult = namedtuple("StepResult", "loss events peak_in_flight")  # see pipeline_step
# a rank's clock tick: run `actions`, then post ONE p2p group of `sends` and `recvs`: ((peer, msg),)
Tick = namedtuple("Tick", "actions sends recvs")


def check_config(schedule, p, m, v=1, n_layer=None, batch_size=None):
    """Every bad (schedule, p, m, v, layers, batch) raises here, before any send."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if min(p, m, v) < 1:
        raise ValueError(f"need pp_size, microbatches, virtual_stages >= 1, got {p}, {m}, {v}")
    if v > 1 and schedule != "interleaved":
        raise ValueError(f"virtual_stages={v} > 1 needs schedule='interleaved', not {schedule!r}")
    if schedule == "interleaved" and m % p != 0:  # microbatches go round the ring p at a time
        raise ValueError(f"interleaved needs microbatches divisible by pp_size (m={m}, p={p})")
    if n_layer is not None and n_layer < p * v:
        raise ValueError(f"n_layer={n_layer} blocks cannot fill pp_size*virtual_stages={p}*{v}")
    if batch_size is not None and batch_size % m != 0:
        raise ValueError(f"batch of {batch_size} sequences does not split into {m} microbatches")


class PipelineChunk(torch.nn.Module):
    """Global stage s of p·v: [embed] -> its blocks -> [ln_f + lm_head], the GPT's own modules."""

    def __init__(self, model, stage: int, n_stages: int, layers: range):
        super().__init__()
        self.stage, self.n_stages, self.layers = stage, n_stages, layers
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.config, self.loss_fn = model.config, model.loss_fn  # TP may have swapped loss_fn
        self.tp_rng = getattr(model, "tp_rng", None)  # 04's dropout stream, for checkpoints
        drop = (set() if self.is_first else {"wte", "wpe"}) | (set() if self.is_last else {"ln_f"})
        kept = {name: module for name, module in model.transformer.items() if name not in drop}
        # subtle: keyed by the global layer index, names stay the GPT's (h.5 is h.5), as do grads
        kept["h"] = torch.nn.ModuleDict({str(i): model.transformer.h[i] for i in layers})
        self.transformer = torch.nn.ModuleDict(kept)
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
    """This rank's chunks: of S = p·v balanced stages, stage s is chunk s // p of rank s % p."""
    p, v, L, S = pp_size, virtual_stages, len(model.transformer.h), pp_size * virtual_stages
    check_config("interleaved" if v > 1 else "1f1b", p, p, v, n_layer=L)
    assert 0 <= pp_rank < p, f"pp_rank={pp_rank} outside [0, {p})"
    layers = [range(s * L // S, (s + 1) * L // S) for s in range(S)]  # sizes differ by <= 1
    return [PipelineChunk(model, s, S, layers[s]) for s in range(pp_rank, S, p)]


def tied_parameter(chunk):
    """The chunk's copy of the tied wte/lm_head matrix, or None."""
    if chunk.config.tie_embeddings and (chunk.is_first or chunk.is_last):
        return chunk.transformer.wte.weight if chunk.is_first else chunk.lm_head.weight


def embedding_group(pp_groups_ranks):
    """Megatron's embedding group: {first, last} rank of *this rank's* pipeline. subtle: new_group
    is a world collective, so EVERY rank passes EVERY PP group's global ranks, in the same order."""
    pairs = [sorted({ranks[0], ranks[-1]}) for ranks in pp_groups_ranks]
    groups = [dist.new_group(pair) if len(pair) > 1 else None for pair in pairs]  # p = 1: no copy
    return next((g for g, pair in zip(groups, pairs) if dist.get_rank() in pair), None)


def allreduce_tied_grads(chunks, embed_group):
    """wte and lm_head use one matrix: its grad is the SUM of both copies', so both stay equal."""
    for param in (tied_parameter(chunk) for chunk in chunks):
        if param is not None and param.grad is not None:
            dist.all_reduce(param.grad, group=embed_group)  # SUM over {first, last}


def blocking_p2p(ops, group=None) -> None:
    """Post (op, tensor, pp rank)s as ONE batch_isend_irecv group and wait on all of it, as NCCL."""
    world = group or dist.group.WORLD  # p2p takes global ranks: map them
    ops = [dist.P2POp(op, t, dist.get_global_rank(world, q), group) for op, t, q in ops]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


def gpipe_naive(chunk, batch, n_microbatches: int, group=None, embed_group=None) -> StepResult:
    """GPipe as a plain loop, one chunk per rank: all m forwards, then all m backwards, each message
    a blocking call. No hang under NCCL (a send returns once its receive is posted): a send waits
    only on its receiver, whose waits in that phase point away from it, and both ends of a link post
    the same messages in order; waits chain one way to rank 0 or p-1, never round (tests check)."""
    p = dist.get_world_size(group) if dist.is_initialized() else 1
    r, (x, y), m = dist.get_rank(group) if p > 1 else 0, batch, n_microbatches
    check_config("gpipe", p, m, batch_size=x.size(0))
    if p > 1 and tied_parameter(chunk) is not None and embed_group is None:
        raise ValueError("tied embeddings across stages need embed_group=embedding_group(...)")
    shape, n_tokens = (x.size(0) // m, x.size(1), chunk.config.n_embd), int((y != -1).sum())
    if p > 1:  # a common t = 0 for the Events (and NCCL wants every rank in its first p2p call)
        dist.barrier(group=group)
    loss, stash, events, t0 = torch.zeros((), device=x.device), [], [], time.perf_counter()
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


def schedule_steps(schedule: str, p: int, m: int, v: int, rank: int, forward_only: bool = False):
    """Rank's actions in steps (run between two p2p exchanges): w warm-up forwards, a forward and a
    backward in turn, the other backwards. GPipe: w = m; 1F1B: p-rank-1; interleaved (Megatron):
    forwards go round the ring in groups of p per chunk, backwards through the chunks in reverse,
    w = 2(p-rank-1)+(v-1)p, long enough for exchanges once per steady forward+backward pair."""
    check_config(schedule, p, m, v)
    # forward k -> (microbatch, chunk), p microbatches per chunk: p=2, v=2: F0a F1a F0b F1b F2a ...
    mb_of, chunk_of = (lambda k: k // (p * v) * p + k % p), (lambda k: k % (p * v) // p)
    fwd = [Action("F", mb_of(k), chunk_of(k)) for k in range(m * v)]  # v = 1: F0 F1 ... F(m-1)
    bwd = [Action("B", mb_of(k), v - 1 - chunk_of(k)) for k in range(m * v)]
    if forward_only:  # evaluation: the forwards alone, one per step (deadlock-free too: tested)
        return [(f,) for f in fwd]
    w = {"gpipe": m, "1f1b": p - rank - 1, "interleaved": 2 * (p - rank - 1) + (v - 1) * p}
    warmup = min(w[schedule], m * v)
    steps = [(f,) for f in fwd[:warmup]]
    for f, b in zip(fwd[warmup:], bwd):  # steady state: one forward, one backward
        steps += [(f, b)] if schedule == "interleaved" else [(f,), (b,)]
    return steps + [(b,) for b in bwd[len(fwd) - warmup :]]  # cool-down


def consumer_rank(a: Action, rank: int, p: int, v: int) -> int | None:
    """The rank using a's output: stage s+1 after a forward at s, s-1 after a backward; or None."""
    s = a.chunk * p + rank + (1 if a.op == "F" else -1)
    return s % p if 0 <= s < p * v else None


def input_message(a: Action, s: int, n_stages: int):
    """The message (op, microbatch, stage) whose tensor action a, at stage s, consumes."""
    if a.op == "F":
        return ("F", a.mb, s - 1) if s > 0 else None  # the previous stage's activation
    return ("B", a.mb, s + 1) if s < n_stages - 1 else ("F", a.mb, s)  # the next one's gradient


# subtle: ONE group {send my last output, receive my next input} hangs GPUs (tests: old_grouping)
def comm_plan(steps, p: int, v: int) -> list[list[Tick]]:
    """Each rank's steps on a shared clock: at tick t a rank runs its next step if its inputs were
    made before t (or by the step: the last stage's backward). A message made at tick t is sent
    and received in both ranks' groups of tick t: groups match one to one, none waits on a later."""
    next_step, made_at, plan, t = [0] * p, {}, [[] for _ in range(p)], 0  # message -> its tick
    while waiting := {r: steps[r][i] for r, i in enumerate(next_step) if i < len(steps[r])}:
        ran = {}  # rank -> the step it runs at tick t
        for r, step in waiting.items():
            own = {(a.op, a.mb, a.chunk * p + r) for a in step}
            deps = {input_message(a, a.chunk * p + r, p * v) for a in step} - own - {None}
            if all(made_at.get(dep, t) < t for dep in deps):
                ran[r], next_step[r] = step, next_step[r] + 1
        if not ran:
            raise RuntimeError(f"the steps deadlock at tick {t}; waiting: {waiting}")
        sends, recvs = defaultdict(list), defaultdict(list)
        for r, step in ran.items():
            for a in step:
                msg, dst = (a.op, a.mb, a.chunk * p + r), consumer_rank(a, r, p, v)
                made_at[msg] = t
                if dst is not None and dst != r:  # p = 1: chunk k hands to chunk k+1 in-process
                    sends[r].append((dst, msg))
                    recvs[dst].append((r, msg))
        for r in ran.keys() | recvs.keys():  # a rank that neither computes nor receives idles
            plan[r].append(Tick(ran.get(r, ()), tuple(sends[r]), tuple(recvs[r])))
        t += 1
    return plan


def send_recv_pairs(plan) -> list[tuple]:
    """((rank, tick index), (rank, tick index)) of each send and its receive: NCCL pairs the k-th
    send r->q with the k-th receive on q from r, whatever they carry, so check what they carry."""
    sent, received = defaultdict(list), defaultdict(list)  # (src, dst) -> [((rank, i), message)]
    for r, ticks in enumerate(plan):
        for i, tick in enumerate(ticks):
            for q, msg in tick.sends:
                sent[(r, q)].append(((r, i), msg))
            for q, msg in tick.recvs:
                received[(q, r)].append(((r, i), msg))
    for link in sent.keys() | received.keys():
        what = [msg for _, msg in sent[link]], [msg for _, msg in received[link]]
        assert what[0] == what[1], f"{link}: sends {what[0]} but receives {what[1]}"
    return [(g, h) for link in sent for (g, _), (h, _) in zip(sent[link], received[link])]


def nccl_timeline(plan, v: int, t_f: float = 1.0, t_b: float = 2.0) -> list[list[Event]]:
    """Run a plan under NCCL's rule, or name the groups that hang: a rank runs its tick's actions
    (t_f, t_b per stage; 1/v per chunk), launches its group, and blocks until every partner has."""
    p, partners = len(plan), defaultdict(list)  # group (rank, tick index) -> its ops' partners
    for g, h in send_recv_pairs(plan):
        partners[g].append(h)
        partners[h].append(g)
    at, clock, launched_at = [0] * p, [0.0] * p, {}
    have, timeline = [set() for _ in range(p)], [[] for _ in range(p)]
    while any(at[r] < len(plan[r]) for r in range(p)):
        progress = False
        for r in range(p):  # each rank runs until it blocks on a group (or ends)
            while at[r] < len(plan[r]):
                g, tick = (r, at[r]), plan[r][at[r]]
                if g not in launched_at:  # run the tick's actions, then launch its group
                    for a in tick.actions:
                        s, start = a.chunk * p + r, clock[r]
                        need = input_message(a, s, p * v)
                        assert need is None or need in have[r], f"rank {r} runs {a} before {need}"
                        have[r].add((a.op, a.mb, s))
                        clock[r] += (t_f if a.op == "F" else t_b) / v
                        timeline[r].append(Event(*a, start, clock[r]))
                    launched_at[g], progress = clock[r], True
                if any(h not in launched_at for h in partners[g]):
                    break  # blocked: each op waits until its partner's group is launched
                clock[r] = max([clock[r]] + [launched_at[h] for h in partners[g]])
                have[r].update(msg for _, msg in tick.recvs)
                at[r], progress = at[r] + 1, True
        if not progress:
            hung = [(r, at[r]) for r in range(p) if at[r] < len(plan[r])]
            raise RuntimeError(f"deadlock under NCCL's rule: groups (rank, index) {hung} hang")
    return timeline


def simulate(schedule: str, p: int, m: int, v: int = 1, t_f: float = 1.0, t_b: float = 2.0):
    """-> (each rank's actions, their Events as the executor's plan runs under NCCL's rule)."""
    plan = comm_plan([schedule_steps(schedule, p, m, v, r) for r in range(p)], p, v)
    orders = [[a for tick in ticks for a in tick.actions] for ticks in plan]
    return orders, nccl_timeline(plan, v, t_f, t_b)


def bubble_formula(p: int, m: int, v: int = 1) -> float:
    """Idle share of the step: (p-1)/(v·m + p-1); v = 1 for GPipe and 1F1B."""
    return (p - 1) / (v * m + p - 1)


def bubble_fraction(timeline) -> float:
    """1 - (mean busy time per rank) / (first start to last end): the idle share. As run, waits,
    messages, Python and (more ranks than cores) time-sharing count as idle."""
    events = [e for rank_events in timeline for e in rank_events]
    busy = sum(e.end - e.start for e in events) / len(timeline)
    return 1.0 - busy / (max(e.end for e in events) - min(e.start for e in events))


class PipelineExecutor:
    """Runs one rank's comm plan for one step: received tensors (inbox), stash, loss, Events."""

    def __init__(self, chunks, batch, m, group, p, rank, act, n_tokens, scale):
        self.chunks, self.group, self.p, self.rank, self.new_act = chunks, group, p, rank, act
        self.modules = [getattr(c, "module", c) for c in chunks]  # unwrap DP wrappers
        self.xs, self.ys, self.n_tokens = batch[0].chunk(m), batch[1].chunk(m), n_tokens
        self.grad_scale = scale / n_tokens  # backward from dp_size · loss_scale · the loss
        self.inbox, self.stash, self.events = {}, {}, []  # inbox: message -> tensor
        self.loss, self.peak = torch.zeros((), device=batch[0].device), 0

    def forward(self, a: Action, s: int):
        chunk, mod = self.chunks[a.chunk], self.modules[a.chunk]
        msg = input_message(a, s, mod.n_stages)  # stage 0 reads (b, T) ids; others (b, T, C)
        inp = self.inbox.pop(msg).requires_grad_() if msg else self.xs[a.mb]  # its grad goes back
        out = chunk(inp)  # (b, T, C), or (b, T, V) logits on the last stage
        if mod.is_last:  # Σ of the microbatch's token losses / the step's token count (as 06)
            loss_sum = mod.loss_fn(out, self.ys[a.mb], "sum")
            self.loss += loss_sum.detach() / self.n_tokens
            out = loss_sum * self.grad_scale
        if torch.is_grad_enabled():  # (not when evaluating: no backward will come)
            self.stash[(a.mb, a.chunk)] = (inp, out)  # alive until this microbatch's backward
            self.peak = max(self.peak, len(self.stash))
        return None if mod.is_last else out.detach()

    def backward(self, a: Action, s: int):
        inp, out = self.stash.pop((a.mb, a.chunk))
        chunk, mod = self.chunks[a.chunk], self.modules[a.chunk]
        grad = None if mod.is_last else self.inbox.pop(input_message(a, s, mod.n_stages))
        quiet = hasattr(chunk, "no_sync") and a != self.last_backward[a.chunk]  # DP: sync once
        with chunk.no_sync() if quiet else contextlib.nullcontext():
            torch.autograd.backward(out, grad_tensors=grad)  # grads accumulate in .grad
        return None if mod.is_first else inp.grad

    def run(self, ticks: list[Tick]):
        self.last_backward = {a.chunk: a for t in ticks for a in t.actions if a.op == "B"}
        if self.p > 1:  # a common t = 0 for the Events, as in gpipe_naive
            dist.barrier(group=self.group)
        t0 = time.perf_counter()
        for tick in ticks:
            for a in tick.actions:
                s, start = a.chunk * self.p + self.rank, time.perf_counter()
                out = self.forward(a, s) if a.op == "F" else self.backward(a, s)
                self.events.append(Event(*a, start - t0, time.perf_counter() - t0))
                if out is not None:  # the next stage's input: sent below, or kept here (p = 1)
                    self.inbox[(a.op, a.mb, s)] = out
            self.inbox.update((msg, self.new_act()) for _, msg in tick.recvs)
            ops = [(dist.isend, self.inbox.pop(msg), q) for q, msg in tick.sends]
            ops += [(dist.irecv, self.inbox[msg], q) for q, msg in tick.recvs]
            blocking_p2p(ops, self.group)  # ONE group, waited whole: comm_plan made that safe
        assert not self.inbox and not self.stash, "a received tensor or activation was not used"


@functools.lru_cache(maxsize=64)
def step_plan(schedule: str, p: int, m: int, v: int, forward_only: bool = False):
    """Every rank's comm plan for one step, cached: train.py runs the same one every step."""
    return comm_plan([schedule_steps(schedule, p, m, v, r, forward_only) for r in range(p)], p, v)


def pipeline_step(chunks, batch, n_microbatches: int, schedule: str = "1f1b", pp_group=None, *,
                  act_shape=None, act_dtype=None, embed_group=None, loss_scale: float = 1.0,
                  n_tokens=None, dp_size: int = 1, forward_only: bool = False) -> StepResult:  # fmt: skip
    """One step's forwards and backwards under `schedule`, grads into .grad. chunks: split_model's,
    maybe DP-wrapped. batch: (x, y), (B, T), the same on the whole pipeline. act_*: an activation
    between stages, default (B/m, T, C) and the parameters' dtype. A microbatch adds its token-loss
    SUM / n_tokens (the step's real targets over DP: 06; default: this batch's) · dp_size (DP
    averages) · loss_scale (fp16). forward_only: evaluation. -> .loss: this replica's share on the
    last stage, else 0 (SUM it); .events; .peak_in_flight: most (mb, chunk) forwards alive."""
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
    dtype = act_dtype or next(mods[0].parameters()).dtype  # no message says its shape: the config
    act = functools.partial(torch.empty, shape, dtype=dtype, device=x.device)  # receive into it
    n_tokens = int((y != -1).sum()) if n_tokens is None else n_tokens  # 02's ignore index
    assert n_tokens > 0, "this step has no target tokens: every target is -1"
    run = PipelineExecutor(chunks, batch, m, pp_group, p, rank, act, n_tokens, dp_size * loss_scale)
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        run.run(step_plan(schedule, p, m, len(chunks), forward_only)[rank])
    if embed_group is not None and not forward_only:
        allreduce_tied_grads(mods, embed_group)
    return StepResult(run.loss, run.events, run.peak)


def plot_timelines(timelines: dict, path) -> None:
    """{title: per-rank Events} -> Gantt charts, each box shaded and numbered by microbatch."""
    from matplotlib import colormaps, figure  # no pyplot: a file, never a window

    p, n = len(next(iter(timelines.values()))), len(timelines)
    fig = figure.Figure(figsize=(13, 1 + 0.45 * p * n), layout="tight")
    axes = fig.subplots(n, 1, sharex=True, squeeze=False)[:, 0]
    for ax, (title, timeline) in zip(axes, timelines.items()):
        chunked = any(e.chunk for events in timeline for e in events)
        for r, e in [(r, e) for r, events in enumerate(timeline) for e in events]:
            x, w, shade = e.start * 1e3, (e.end - e.start) * 1e3, 0.3 + 0.2 * (e.mb % 4)
            colour = colormaps["Blues" if e.op == "F" else "Oranges"](shade)
            ax.broken_barh([(x, w)], (r - 0.4, 0.8), color=colour, ec="k", lw=0.3)
            label = f"{e.mb}{'abcdefgh'[e.chunk]}" if chunked else f"{e.mb}"  # 0a: chunk 0
            ink = "w" if shade > 0.6 else "k"  # white text on the darker shades
            ax.text(x + w / 2, r, label, ha="center", va="center", fontsize=6, color=ink)
        ax.set(yticks=range(p), yticklabels=[f"rank {r}" for r in range(p)], ylim=(p - 0.5, -0.5))
        ax.set_title(title, fontsize=9, loc="left")
    axes[-1].set_xlabel("ms since the step began; forwards blue, backwards orange")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)


def demo(args, rank: int, p: int, device) -> None:
    """The naive GPipe and every schedule on one batch, checked against one process and simulate."""
    m, T, b, cores, print0 = args.microbatches, 64, 4, os.cpu_count(), distributed.print0
    torch.manual_seed(0)  # the same model on every rank, cut afterwards
    # 8 blocks: one per stage at p·v = 8; C = 256, so that matmuls outweigh the messages
    config = model_lib.GPTConfig(n_layer=8, n_head=4, n_embd=256, block_size=T, vocab_size=256)
    model = model_lib.GPT(config).to(device)
    (batch,) = model_lib.byte_batches(T, b * m, device=device)
    _, ref_loss = model(*batch)  # one process on the whole batch: what every row must give
    ref_loss.backward()
    ref = {n: q.grad.clone() for n, q in model.named_parameters(remove_duplicate=False)}  # + tied
    embed_group, timelines = embedding_group([list(range(p))]), {}
    setup = f"m={m} microbatches of {b}x{T} bytes, 8 blocks of C=256, {dist.get_backend()}"
    print0(f"p={p} stages on {cores} cores, {setup}", end="\n\n")
    print0(f"{'':21}loss max|Δgrad|   bubble  simulated  formula  peak alive (mb, chunk) per stage")
    for name in ("gpipe, naive", *SCHEDULES):
        schedule, v = name.split(",")[0], args.virtual_stages if name == "interleaved" else 1
        chunks = split_model(model, rank, p, v)
        for _ in range(2):  # a warm-up step, then the measured one
            model.zero_grad(set_to_none=True)
            if name == "gpipe, naive":
                result = gpipe_naive(chunks[0], batch, m, embed_group=embed_group)
            else:
                result = pipeline_step(chunks, batch, m, schedule, embed_group=embed_group)
        grads = [(q.grad - ref[n]).abs().max() for c in chunks for n, q in c.named_parameters()]
        gathered = [None] * p  # every rank's Events, peak alive, loss share, largest grad error
        mine = result.events, result.peak_in_flight, result.loss.item(), max(grads).item()
        dist.all_gather_object(gathered, mine)
        timeline, peaks, losses, errs = zip(*gathered)
        orders, ideal = simulate(schedule, p, m, v)  # t_b = 2 t_f, free messages
        assert [[Action(*e[:3]) for e in ev] for ev in timeline] == orders, f"{name}: order"
        loss, err, formula = sum(losses), max(errs), bubble_formula(p, m, v)
        assert abs(loss - ref_loss) < 1e-5 and err < 1e-5, f"{name} differs from one process"
        bubble, label = bubble_fraction(timeline), f"{name} v={v}" if v > 1 else name
        row = f"{label:<16}{loss:>9.5f}{err:>11.1e}{bubble:>9.1%}{bubble_fraction(ideal):>11.1%}"
        print0(f"{row}{formula:>9.1%}  {list(peaks)}")
        timelines[f"{label}: measured bubble {bubble:.1%}, formula {formula:.1%}"] = timeline
    print0("\nEvery row equals one process (loss, all gradients < 1e-5), in the simulator's order;")
    print0("bubble: 1 - busy/span, one step as run; simulated: the plan, NCCL's rule, t_b = 2 t_f")
    if p > (cores or p):  # more ranks than cores: they time-share them
        print0(f"{p} ranks time-share {cores} cores: measured differs from ideal, usually above")
        print0("(it can also stretch busy time). Medians: python bench/bench_pipeline.py --naive")
    if args.plot and rank == 0:
        plot_timelines(timelines, path := Path("out/pipeline") / f"pipeline_p{p}_m{m}.png")
        print(f"wrote {path}")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=formatter)
    parser.add_argument("--ranks", type=int, default=4, help="p, pipeline stages: one process each")
    parser.add_argument("--microbatches", type=int, default=8, help="m; bubble (p-1)/(m+p-1)")
    parser.add_argument("--virtual-stages", type=int, default=2, help="v, interleaved's chunks")
    parser.add_argument("--plot", action="store_true", help="draw out/pipeline/*.png, the Gantt")
    args = parser.parse_args(argv)
    p = int(os.environ.get("WORLD_SIZE", args.ranks))  # under torchrun, the world is the pipeline
    try:  # the interleaved schedule asks the most: m % p == 0 and 8 blocks >= p·v
        check_config("interleaved", p, args.microbatches, args.virtual_stages, n_layer=8)
    except ValueError as e:
        parser.error(str(e))
    if "WORLD_SIZE" not in os.environ:
        return distributed.relaunch_with_torchrun(args.ranks, argv, __file__)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // p))  # a fair share of the cores each
    rank, _, world_size, device = distributed.init_distributed()
    try:
        demo(args, rank, world_size, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
