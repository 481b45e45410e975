"""05 · Pipeline parallelism: cut the model into stages and stream microbatches.

Each of p ranks holds consecutive layers, a stage. A step's batch of B sequences is cut
into m microbatches of b = B/m; stage r works on microbatch i while stage r+1 works on
i-1. Activations go forward and gradients back, point-to-point:

    rank 0: embed + blocks 0-1 ─▶ rank 1: 2-3 ─▶ rank 2: 4-5 ─▶ rank 3: 6-7 + head
            ◀── dL/dx (b, T, C) ◀──        ◀──             ◀──      loss
    wte and lm_head are one matrix, kept on ranks 0 and 3: their gradients are summed.

The bubble: stages idle while the pipeline fills and drains. With t_f and t_b a stage's
forward and backward of one microbatch, m microbatches take (m+p-1)(t_f+t_b):

    bubble = (p - 1) / (m + p - 1)          GPipe and 1F1B
    bubble = (p - 1) / (v·m + p - 1)        interleaved, v chunks per rank

GPipe (arXiv 1811.06965) runs all m forwards, then all m backwards, so a stage holds m
microbatches' activations. 1F1B (PipeDream-flush, 1806.03377) has the same bubble and
holds at most p: stage r runs p-r-1 warm-up forwards, then a forward and a backward in
turn (the steady phase), then the backwards left (the cool-down). Interleaving
(Megatron-LM, 2104.04473) gives rank r the stages r, r+p, ...: fill and drain shrink v
times, for v times the messages. 1F1B at p=4, m=8, drawn with t_f = t_b (bubble 3/11,
as simulate's default t_b = 2 t_f; Fi: forward of microbatch i; . idle; <= 4 alive).
The warm-ups are 3, 2, 1 and 0 forwards, so r0's F3 is the first of its steady phase:

    r0 F0F1F2F3 . . .B0F4B1F5B2F6B3F7B4 .B5 .B6 .B7
    r1  .F0F1F2 . .B0F3B1F4B2F5B3F6B4F7B5 .B6 .B7
    r2  . .F0F1 .B0F2B1F3B2F4B3F5B4F6B5F7B6 .B7
    r3  . . .F0B0F1B1F2B2F3B3F4B4F5B5F6B6F7B7

Simple first: `gpipe_naive`, then `one_f_one_b`, 1F1B as a loop with every message
named (`StageLinks`). Then any schedule as data (`schedule_steps`) on a clock of p2p
groups (`comm_plan`), run by `pipeline_step`. NCCL completes a send only once its
receive is posted, and a group only whole: `nccl_timeline` checks that none hangs.

Launch:  python 05_pipeline.py [--ranks N] [--plot]   (relaunches itself in torchrun)
         torchrun --standalone --nproc_per_node=4 05_pipeline.py   (gloo or NCCL)

What changed from 04: 03 copied the whole model and 04 split every matrix; here a rank
holds whole layers and talks only to its two neighbours, so PP can stretch across nodes.
Left out on purpose: zero-bubble schedules (2401.10241), DualPipe, unbalanced stages,
freeing sent outputs early, recomputation, overlapping messages with compute.
"""

import contextlib
import functools
import importlib
import os
import time
from collections import defaultdict, namedtuple

import torch
import torch.distributed as dist

from support import distributed, gantt, nccl_rule, pipeline_report
from support.nccl_rule import blocking_p2p  # ONE batch_isend_irecv group, waited whole

model_lib = importlib.import_module("02_model")  # GPT, GPTConfig, byte_batches

Action = namedtuple("Action", "op mb chunk")  # "F" or "B" of microbatch mb on a chunk
Event = namedtuple("Event", "op mb chunk start end")  # an Action as it ran, in seconds
StepResult = namedtuple("StepResult", "loss events peak_in_flight")  # pipeline_step's
Tick = namedtuple("Tick", "actions sends recvs")  # run actions, then ONE p2p group
SCHEDULES = ("gpipe", "1f1b", "interleaved")


def check_config(schedule, p, m=None, v=1, n_layer=None, batch_size=None) -> None:
    """Every bad setting fails here on every rank before any send, since a failure after
    one leaves the peers blocked in a receive. m=None: split_model's, before m is known."""
    assert schedule in SCHEDULES, f"unknown schedule {schedule!r}: not in {SCHEDULES}"
    counts = f"need pp_size, virtual_stages, microbatches >= 1, got {p}, {v}, {m}"
    assert min(p, v) >= 1 and (m is None or m >= 1), counts
    chunked = f"virtual_stages={v} > 1 needs schedule='interleaved'"
    assert v == 1 or schedule == "interleaved", chunked
    few = f"n_layer={n_layer} blocks cannot fill pp_size*v = {p}*{v} stages"
    assert n_layer is None or n_layer >= p * v, few
    ring = f"interleaved needs microbatches divisible by pp_size (m={m}, p={p})"
    assert m is None or schedule != "interleaved" or m % p == 0, ring
    uneven = f"batch {batch_size} does not split into {m} microbatches"
    assert batch_size is None or batch_size % m == 0, uneven


class PipelineChunk(torch.nn.Module):
    """Global stage s of p·v: [embed] -> its blocks -> [ln_f + lm_head], GPT modules."""

    def __init__(self, model, stage: int, n_stages: int, layers: range):
        super().__init__()
        self.stage = stage
        self.n_stages = n_stages
        self.layers = layers
        self.is_first = stage == 0
        self.is_last = stage == n_stages - 1
        self.config = model.config
        self.loss_fn = model.loss_fn  # 04 may have swapped in its vocab-parallel loss
        self.tp_rng = getattr(model, "tp_rng", None)  # 04's dropout stream
        drop = set() if self.is_first else {"wte", "wpe"}
        drop |= set() if self.is_last else {"ln_f"}
        kept = {k: mod for k, mod in model.transformer.items() if k not in drop}
        # subtle: keyed by the global layer index, names stay the GPT's (h.5 is h.5).
        blocks = model.transformer.h
        kept["h"] = torch.nn.ModuleDict({str(i): blocks[i] for i in layers})
        self.transformer = torch.nn.ModuleDict(kept)
        self.lm_head = model.lm_head if self.is_last else None  # tied: wte's Parameter

    embed = model_lib.GPT.embed  # the GPT's own code, on the modules this chunk kept
    head = model_lib.GPT.head

    def forward(self, inp):
        """first: (b, T) ids, others: (b, T, C) -> (b, T, C), or (b, T, V) on the last."""
        x = self.embed(inp) if self.is_first else inp  # (b, T, C)
        for block in self.transformer.h.values():
            x = block(x)  # (b, T, C)
        return self.head(x) if self.is_last else x


def split_model(model, pp_rank: int, pp_size: int, virtual_stages: int = 1) -> list:
    """This rank's chunks: of S = p·v balanced stages, stage s is chunk s//p of rank s%p."""
    n_layer = len(model.transformer.h)
    n_stages = pp_size * virtual_stages
    schedule = "interleaved" if virtual_stages > 1 else "1f1b"
    check_config(schedule, p=pp_size, v=virtual_stages, n_layer=n_layer)
    assert 0 <= pp_rank < pp_size, f"pp_rank={pp_rank} outside [0, {pp_size})"
    chunks = []
    for s in range(pp_rank, n_stages, pp_size):  # stages differ by one block at most
        layers = range(s * n_layer // n_stages, (s + 1) * n_layer // n_stages)
        chunks.append(PipelineChunk(model, s, n_stages, layers))
    return chunks


# The tied embedding: GPT-2's wte (first stage) and lm_head (last stage) are one matrix,
# so cut into stages it exists twice. Each copy gets its own stage's gradient; the
# matrix's is their SUM, which both ranks take, so both copies step alike and stay equal.
def tied_parameter(chunk):
    """The chunk's copy of the tied wte/lm_head matrix, or None."""
    if chunk.config.tie_embeddings and (chunk.is_first or chunk.is_last):
        return chunk.transformer.wte.weight if chunk.is_first else chunk.lm_head.weight


def embedding_group(pp_groups_ranks):
    """Megatron's embedding group: {first, last} rank of this rank's pipeline. subtle:
    new_group is a world collective, so EVERY rank passes EVERY pipeline's ranks."""
    mine = None
    for ranks in pp_groups_ranks:
        pair = sorted({ranks[0], ranks[-1]})
        group = dist.new_group(pair) if len(pair) > 1 else None  # p = 1: one copy
        mine = group if dist.get_rank() in pair else mine
    return mine


def allreduce_tied_grads(chunks, embed_group) -> None:
    """On both ranks: wte's gradient plus lm_head's, the tied matrix's gradient."""
    for param in (tied_parameter(chunk) for chunk in chunks):
        if param is not None and param.grad is not None:
            dist.all_reduce(param.grad, group=embed_group)  # SUM over {first, last}


class Microbatches:
    """One rank's step, for both loops and the executor: the checks, the m microbatches,
    the activations each forward keeps for its backward (the stash), loss and Events."""

    def __init__(
        self,
        chunks,
        batch,
        m,
        group,
        schedule,
        embed_group,
        shape=None,
        n_tokens=None,
        dtype=None,
    ):
        x, y = batch  # (B, T) ids and targets, the same on every stage
        self.p = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if self.p > 1 else 0
        self.stages = [getattr(c, "module", c) for c in chunks]  # unwrap 03's DP
        n_stages = self.p * len(chunks)
        check_config(schedule, self.p, m, len(chunks), batch_size=x.size(0))
        assert all(c.n_stages == n_stages for c in self.stages), "split for another p"
        mine = list(range(self.rank, n_stages, self.p))
        assert [c.stage for c in self.stages] == mine, "chunks not split for this rank"
        tied = any(tied_parameter(c) is not None for c in self.stages)
        # Evaluation runs no backward (no grad), so it has no tied gradients to sum.
        if self.p > 1 and tied and embed_group is None and torch.is_grad_enabled():
            raise ValueError("tied embeddings need embed_group=embedding_group(...)")
        self.chunks = chunks
        self.group = group
        self.embed_group = embed_group
        self.xs = x.chunk(m)  # m microbatches of (b, T)
        self.ys = y.chunk(m)
        # The loss averages the step's real targets (-1 is ignored), or a count passed in
        # (a tensor is checked by its maker: reading it here would make the CPU wait).
        self.n_tokens = int((y != -1).sum()) if n_tokens is None else n_tokens
        ok = torch.is_tensor(self.n_tokens) or self.n_tokens > 0
        assert ok, "every target of the step is -1: no loss to average"
        self.scale = 1.0
        # No message says its shape: both ends know it, (b, T, C), from the config.
        shape = shape or (x.size(0) // m, x.size(1), self.stages[0].config.n_embd)
        # Forwards run in autocast's `dtype`; what they send travels in it (half fp32's).
        self.param_dtype = next(self.stages[0].parameters()).dtype
        self.wire = dtype or self.param_dtype
        cast = dtype not in (None, torch.float32)
        self.autocast = functools.partial(torch.autocast, x.device.type, dtype, cast)
        like = dict(dtype=self.wire, device=x.device)
        self.new_act = functools.partial(torch.empty, shape, **like)
        self.stash = {}  # (microbatch, chunk) -> (input, output) until its backward
        self.peak = 0
        self.loss = torch.zeros((), device=x.device)
        self.events = []
        # A common t = 0 for the Events; not on GPUs, where a barrier is a host sync.
        if self.p > 1 and x.device.type == "cpu":
            dist.barrier(group=group)
        self.t0 = time.perf_counter()

    def forward(self, mb: int, inp, chunk: int = 0):
        """Microbatch mb through one chunk, from stage s-1's activation (None on stage 0,
        which reads ids). -> the next stage's input, or on the last the loss to run."""
        # Stage s-1's activation, from the wire's dtype; its grad goes back.
        inp = self.xs[mb] if inp is None else inp.to(self.param_dtype).requires_grad_()
        start = time.perf_counter() - self.t0
        with self.autocast():  # the forward only: autocast's docs keep backward out
            out = self.chunks[chunk](inp)  # (b, T, C), or (b, T, V) logits on the last
        if self.stages[chunk].is_last:  # SUM over the step's targets: m shares add up
            loss_sum = self.stages[chunk].loss_fn(out, self.ys[mb], "sum")  # fp32
            self.loss += loss_sum.detach() / self.n_tokens
            # `scale` multiplies only what backward sees, not the loss above: DP's size
            # (03's DataParallel averages) times a loss scale the caller may pass.
            out = loss_sum * (self.scale / self.n_tokens)
        self.events.append(Event("F", mb, chunk, start, time.perf_counter() - self.t0))
        if torch.is_grad_enabled():  # not when evaluating: no backward will come
            self.stash[(mb, chunk)] = (inp, out)
            self.peak = max(self.peak, len(self.stash))
        return out

    def backward(self, mb: int, grad, chunk: int = 0, sync: bool = True):
        """Microbatch mb's backward from dL/d(out), None if out is the loss: -> dL/d(in)."""
        inp, out = self.stash.pop((mb, chunk))
        start = time.perf_counter() - self.t0
        wrapped = self.chunks[chunk]
        # 03's DataParallel all-reduces after every backward unless told not to.
        quiet = not sync and hasattr(wrapped, "no_sync")
        grad = None if grad is None else grad.to(out.dtype)  # from the wire's dtype
        with wrapped.no_sync() if quiet else contextlib.nullcontext():
            torch.autograd.backward(out, grad_tensors=grad)  # grads add up in .grad
        self.events.append(Event("B", mb, chunk, start, time.perf_counter() - self.t0))
        return inp.grad if inp.requires_grad else None

    def result(self) -> StepResult:
        assert not self.stash, f"microbatches {sorted(self.stash)} never ran backward"
        if self.embed_group is not None and torch.is_grad_enabled():
            allreduce_tied_grads(self.stages, self.embed_group)
        return StepResult(self.loss, self.events, self.peak)


class StageLinks:
    """A stage's messages, named as in Megatron's p2p_communication: each call is ONE
    group, waited whole; a call with no neighbour (first or last stage) does nothing."""

    def __init__(self, step: Microbatches):
        stage = step.stages[0]  # the plain loops hold one chunk per rank
        self.prev = None if stage.is_first else step.rank - 1  # ranks in the group
        self.next = None if stage.is_last else step.rank + 1
        self.step = step

    def talk(self, peer, send=None, receive=False):
        """ONE group with `peer`: send `send` if given, receive a new buffer if asked."""
        if peer is None:
            return None
        ops = [] if send is None else [(dist.isend, send, peer)]
        received = self.step.new_act() if receive else None
        if receive:
            ops.append((dist.irecv, received, peer))
        blocking_p2p(ops, self.step.group)
        return received

    def recv_forward(self):
        """Stage r-1's activation (b, T, C); None on the first stage, which reads ids."""
        return self.talk(self.prev, receive=True)

    def send_forward(self, out):
        """This stage's activation to stage r+1."""
        self.talk(self.next, send=out.detach())

    def recv_backward(self):
        """dL/d(out) from stage r+1; None on the last stage, where out is the loss."""
        return self.talk(self.next, receive=True)

    def send_backward(self, grad):
        """dL/d(input) to stage r-1."""
        self.talk(self.prev, send=grad)

    def send_forward_recv_backward(self, out):
        """1F1B's steady phase: send this output, receive the oldest one's gradient."""
        return self.talk(self.next, send=out.detach(), receive=True)

    def send_backward_recv_forward(self, grad):
        """The mirror group: this backward's gradient goes up, the next input down."""
        return self.talk(self.prev, send=grad, receive=True)


def gpipe_naive(chunk, batch, m: int, group=None, embed_group=None):
    """GPipe as a plain loop, one chunk per rank: all m forwards, then all m backwards,
    each message a blocking call. It cannot hang under NCCL: a send waits only on its
    receiver, whose waits in that phase point away from the sender (tests check it)."""
    step = Microbatches([chunk], batch, m, group, "gpipe", embed_group)
    links = StageLinks(step)
    for i in range(m):  # all m stay alive: GPipe's memory cost
        out = step.forward(i, links.recv_forward())
        links.send_forward(out)
    for i in range(m):
        grad_in = step.backward(i, links.recv_backward())
        links.send_backward(grad_in)
    return step.result()


def one_f_one_b(chunk, batch, m: int, group=None, embed_group=None):
    """1F1B (PipeDream-flush) as the loop of picotron and Megatron, one chunk per rank.
    Warm-up: stage r runs p-r-1 forwards, enough to keep the stages after it busy.
    Steady: a forward, then the backward of the oldest microbatch alive (so at most
    p-r are alive), its messages in mirrored pairs of groups. Cool-down: the rest."""
    step = Microbatches([chunk], batch, m, group, "1f1b", embed_group)
    links = StageLinks(step)
    warmup = min(step.p - step.rank - 1, m)
    steady = m - warmup
    for i in range(warmup):
        out = step.forward(i, links.recv_forward())
        links.send_forward(out)
    inp = links.recv_forward() if steady > 0 else None
    for i in range(steady):  # forward warmup + i, then backward i
        out = step.forward(warmup + i, inp)
        grad = links.send_forward_recv_backward(out)
        grad_in = step.backward(i, grad)
        if i < steady - 1:
            inp = links.send_backward_recv_forward(grad_in)
        else:
            links.send_backward(grad_in)
    for i in range(steady, m):  # the cool-down
        grad_in = step.backward(i, links.recv_backward())
        links.send_backward(grad_in)
    return step.result()


# The general machinery: any schedule as data, on a clock of NCCL-safe p2p groups.
def schedule_steps(schedule, p: int, m: int, v: int, rank: int, forward_only=False):
    """Rank's actions in steps, each run between two p2p exchanges: w warm-up forwards,
    then a forward and a backward in turn, then the backwards left. GPipe: w = m; 1F1B:
    w = p-rank-1. Interleaved (Megatron): forwards go round the ring p microbatches at a
    time per chunk, backwards through the chunks in reverse, and w = 2(p-rank-1) +
    (v-1)p lets each steady step, a forward and a backward, exchange in one group."""
    check_config(schedule, p, m, v)
    fwd = []  # v = 2, p = 2: F0a F1a F0b F1b F2a F3a ...; v = 1: F0 F1 F2 ...
    bwd = []  # the same microbatches, chunks in reverse: B0b B1b B0a B1a ...
    for k in range(m * v):
        mb = k // (p * v) * p + k % p
        chunk = k % (p * v) // p
        fwd.append(Action("F", mb, chunk))
        bwd.append(Action("B", mb, v - 1 - chunk))
    if forward_only:  # evaluation: the forwards alone, one per step
        return [(f,) for f in fwd]
    if schedule == "gpipe":
        warmup = m
    elif schedule == "1f1b":
        warmup = p - rank - 1
    else:
        warmup = 2 * (p - rank - 1) + (v - 1) * p
    warmup = min(warmup, m * v)
    steps = [(f,) for f in fwd[:warmup]]
    for f, b in zip(fwd[warmup:], bwd):  # the steady phase: one forward, one backward
        steps += [(f, b)] if schedule == "interleaved" else [(f,), (b,)]
    return steps + [(b,) for b in bwd[len(fwd) - warmup :]]  # the cool-down


def consumer_rank(a: Action, rank: int, p: int, v: int) -> int | None:
    """The rank using a's output: stage s+1 after a forward at s, s-1 after a backward."""
    s = a.chunk * p + rank + (1 if a.op == "F" else -1)
    return s % p if 0 <= s < p * v else None


def input_message(a: Action, s: int, n_stages: int):
    """The message (op, microbatch, stage) whose tensor action a, at stage s, consumes."""
    if a.op == "F":
        return ("F", a.mb, s - 1) if s > 0 else None  # the previous stage's activation
    if s < n_stages - 1:
        return ("B", a.mb, s + 1)  # the next stage's gradient
    return ("F", a.mb, s)  # the last stage's backward starts from its own loss


# subtle: under NCCL a group must not wait for a message that a peer posts only in a
# LATER group. A group with two peers, {send my last output to one, receive my next
# input from the other}, does that under interleaving when that input's sender waits on
# this group. 1F1B's send_backward_recv_forward has one peer, posting the mirror group.
def comm_plan(steps, p: int, v: int) -> list[list[Tick]]:
    """Each rank's steps on a shared clock: a rank runs its next step at tick t if its
    inputs were made before t (or by it: the last backward); its outputs go out at t."""
    next_step = [0] * p
    made_at = {}  # message -> the tick that made it
    plan = [[] for _ in range(p)]
    t = 0
    while any(next_step[r] < len(steps[r]) for r in range(p)):
        waiting = {r: steps[r][i] for r, i in enumerate(next_step) if i < len(steps[r])}
        ran = {}  # rank -> the step it runs at tick t
        for r, step in waiting.items():
            own = {(a.op, a.mb, a.chunk * p + r) for a in step}
            deps = {input_message(a, a.chunk * p + r, p * v) for a in step}
            if all(made_at.get(dep, t) < t for dep in deps - own - {None}):
                ran[r] = step
                next_step[r] += 1
        if not ran:
            raise RuntimeError(f"the steps deadlock at tick {t}; waiting: {waiting}")
        sends = defaultdict(list)
        recvs = defaultdict(list)
        for r, step in ran.items():
            for a in step:
                msg = (a.op, a.mb, a.chunk * p + r)
                dst = consumer_rank(a, r, p, v)
                made_at[msg] = t
                if dst is not None and dst != r:  # p = 1: chunks hand over in-process
                    sends[r].append((dst, msg))
                    recvs[dst].append((r, msg))
        for r in ran.keys() | recvs.keys():  # a rank that neither computes nor receives
            plan[r].append(Tick(ran.get(r, ()), tuple(sends[r]), tuple(recvs[r])))
        t += 1
    return plan


def nccl_timeline(plan, v: int, t_f=1.0, t_b=2.0) -> list[list[Event]]:
    """Run a plan on paper as run_plan would under NCCL, or raise naming the groups that
    hang: a forward takes t_f per stage, a backward t_b, and a chunk 1/v of that."""

    def completes_at(g, partners, posted):
        """NCCL's rule: a send completes only once its receive is posted (a receive
        once its send is), and the group g only as a whole. -> when, or None."""
        if any(h not in posted for h in partners):
            return None  # blocked until every partner has posted its group
        return max(posted[h] for h in [g, *partners])

    durations = {"F": t_f / v, "B": t_b / v}  # a chunk is 1/v of a stage
    ran = nccl_rule.run(plan, completes_at, input_message, len(plan) * v, durations)
    return [[Event(*a, start, end) for a, start, end in rank] for rank in ran]


def simulate(schedule: str, p: int, m: int, v: int = 1, t_f=1.0, t_b=2.0):
    """-> (each rank's actions, their Events as the executor's plan runs under NCCL)."""
    plan = comm_plan([schedule_steps(schedule, p, m, v, r) for r in range(p)], p, v)
    orders = [[a for tick in ticks for a in tick.actions] for ticks in plan]
    return orders, nccl_timeline(plan, v, t_f, t_b)


def bubble_formula(p: int, m: int, v: int = 1) -> float:
    """Idle share of the step: (p-1)/(v·m + p-1); v = 1 for GPipe and 1F1B."""
    return (p - 1) / (v * m + p - 1)


def bubble_fraction(timeline) -> float:
    """1 - (mean busy time per rank) / (first start to last end): the idle share, where
    waits, messages, Python and cores shared between ranks all count as idle."""
    events = [e for rank_events in timeline for e in rank_events]
    busy = sum(e.end - e.start for e in events) / len(timeline)
    return 1.0 - busy / (max(e.end for e in events) - min(e.start for e in events))


def run_plan(step: Microbatches, ticks: list[Tick]) -> None:
    """The executor: run one rank's ticks, each its actions and then ONE p2p group."""
    p = step.p
    v = len(step.chunks)
    last_backward = {a.chunk: a for tick in ticks for a in tick.actions if a.op == "B"}
    inbox = {}  # message -> its tensor, received or made here for the next chunk
    for tick in ticks:
        for a in tick.actions:
            s = a.chunk * p + step.rank
            msg = input_message(a, s, p * v)
            if a.op == "F":
                out = step.forward(a.mb, inbox.pop(msg) if msg else None, a.chunk)
            else:
                grad = inbox.pop(msg) if msg[0] == "B" else None  # last: from the loss
                sync = a == last_backward[a.chunk]  # DP: all-reduce on the last one
                out = step.backward(a.mb, grad, a.chunk, sync)
            if consumer_rank(a, step.rank, p, v) is not None:  # sent below, or p = 1
                inbox[(a.op, a.mb, s)] = out.detach().to(step.wire)
        for _, msg in tick.recvs:
            inbox[msg] = step.new_act()
        ops = [(dist.isend, inbox.pop(msg), q) for q, msg in tick.sends]
        ops += [(dist.irecv, inbox[msg], q) for q, msg in tick.recvs]
        blocking_p2p(ops, step.group)  # ONE group, waited whole: comm_plan made it safe
    assert not inbox, f"received tensors {sorted(inbox)} were never used"


@functools.lru_cache(maxsize=64)
def step_plan(schedule: str, p: int, m: int, v: int, forward_only: bool = False):
    """Every rank's comm plan for one step, cached: train.py runs one plan every step."""
    steps = [schedule_steps(schedule, p, m, v, r, forward_only) for r in range(p)]
    return comm_plan(steps, p, v)


def pipeline_step(
    chunks,
    batch,
    m: int,
    schedule: str = "1f1b",
    pp_group=None,
    *,
    act_shape=None,
    embed_group=None,
    scale: float = 1.0,
    n_tokens=None,
    dp_size: int = 1,
    forward_only: bool = False,
    dtype=None,
) -> StepResult:
    """One step's m microbatches under `schedule`, gradients into .grad.

    chunks: split_model's, maybe wrapped by 03's DataParallel. batch: (x, y), (B, T),
    the same on the whole pipeline. act_shape: what passes between stages, (b, T, C)
    by default. The loss is token-normalised: its sum over the step's n_tokens real
    targets (this batch's by default) divided by their count. Backward starts from it
    times dp_size (03's DP averages) times `scale`, a loss scale the caller may pass.
    forward_only: evaluation. dtype: autocast's (bf16, fp16), for the forwards only;
    activations and gradients travel in it. -> .loss: this replica's share on the last
    stage, else 0 (SUM it); .events; .peak_in_flight: most (mb, chunk) alive."""
    v = len(chunks)
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        setup = (chunks, batch, m, pp_group, schedule, embed_group, act_shape, n_tokens)
        step = Microbatches(*setup, dtype)
        step.scale = dp_size * scale
        run_plan(step, step_plan(schedule, step.p, m, v, forward_only)[step.rank])
        return step.result()


LOOPS = {"gpipe, naive": gpipe_naive, "1f1b, loop": one_f_one_b}  # the demo's rows 1-2


def demo(args, rank: int, p: int, device) -> None:
    """Both loops and every schedule on one batch, checked against one process and GPipe."""
    m = args.microbatches
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // p))  # a fair share of cores
    torch.manual_seed(0)  # the same model on every rank, cut afterwards
    # 8 blocks: one per stage at p·v = 8. C = 256, so that matmuls outweigh messages.
    config = dict(n_layer=8, n_head=4, n_embd=256, block_size=64, vocab_size=256)
    model = model_lib.GPT(model_lib.GPTConfig(**config)).to(device)
    (batch,) = model_lib.byte_batches(64, 4 * m, device=device)  # (4m, 64)
    _, ref_loss = model(*batch)  # one process on the whole batch: what all rows give
    ref_loss.backward()
    named = model.named_parameters(remove_duplicate=False)  # lm_head: the tied copy
    ref = {n: q.grad.clone() for n, q in named}
    embed_group = embedding_group([list(range(p))])
    where = f"{os.cpu_count()} CPU cores" if device.type == "cpu" else "a GPU each"
    pipeline_report.header(p, m, where)
    naive = {}
    for name in (*LOOPS, *SCHEDULES):
        schedule = name.split(",")[0]
        v = args.virtual_stages if schedule == "interleaved" else 1
        chunks = split_model(model, rank, p, v)
        for _ in range(2):  # a warm-up step, then the measured one
            model.zero_grad(set_to_none=True)
            if name in LOOPS:  # a plain loop holds one chunk
                result = LOOPS[name](chunks[0], batch, m, embed_group=embed_group)
            else:
                result = pipeline_step(chunks, batch, m, name, embed_group=embed_group)
        grads = {n: q.grad.clone() for c in chunks for n, q in c.named_parameters()}
        naive = naive or grads  # the first row's: naive GPipe's gradients
        # Max |Δgrad| from one process, and from naive GPipe (same layers unless v > 1).
        diffs = torch.zeros(2, device=device)
        for n, g in grads.items():
            diffs[0] = max(diffs[0], (g - ref[n]).abs().max())
            diffs[1] = max(diffs[1], (g - naive[n]).abs().max() if v == 1 else 0)
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
        loss = result.loss.clone()
        dist.all_reduce(loss)  # SUM: only the last stage's share is not 0
        assert abs(loss - ref_loss) < 1e-5, f"{name}: loss differs from one process"
        assert diffs.max() < 1e-5, f"{name}: gradients differ from 1 process or GPipe"
        gathered = [None] * p  # every rank's Events and peak activations alive
        dist.all_gather_object(gathered, (result.events, result.peak_in_flight))
        timeline = [events for events, _ in gathered]
        ideal = bubble_fraction(simulate(schedule, p, m, v)[1])  # t_b = 2 t_f
        bubbles = (bubble_fraction(timeline), ideal, bubble_formula(p, m, v))
        peaks = [peak for _, peak in gathered]
        pipeline_report.row(name, v, loss, diffs, bubbles, peaks)
    pipeline_report.footer(p, os.cpu_count())
    if args.plot and rank == 0:  # the simulated timelines of the three schedules
        v = args.virtual_stages
        print(f"wrote {gantt.plot_simulated(simulate, bubble_fraction, p, m, v)}")


def add_arguments(parser) -> None:
    parser.set_defaults(ranks=4)  # p: one stage each
    parser.add_argument("--microbatches", type=int, default=8, help="m")
    parser.add_argument("--virtual-stages", type=int, default=2, help="interleaved's v")
    parser.add_argument("--plot", action="store_true", help="draw the simulated PNG")


def check(args, p: int) -> None:  # interleaved asks the most: m % p == 0, 8 >= p·v
    check_config("interleaved", p, args.microbatches, args.virtual_stages, n_layer=8)


def main(argv=None) -> None:
    distributed.run_on_ranks(demo, argv, __file__, __doc__, add_arguments, check)


if __name__ == "__main__":
    main()
