"""05b · Schedules as tables: any pipeline schedule as data, run by one executor.

05's two loops each hard-code one order. Here a schedule is a table: for each rank, its
steps, each a forward or backward (or, interleaved, one of each) of a microbatch on one
of its chunks. Four tables, one executor (`pipeline_step`):

    gpipe         warm-up m forwards (all), then the backwards
    1f1b          warm-up p-r-1 forwards, then F, B in turn, then the backwards left
    interleaved   rank r holds stages r, r+p, ... (v chunks, Megatron-LM 2104.04473):
                  forwards go round the ring p microbatches at a time per chunk,
                  warm-up 2(p-r-1) + (v-1)p, each steady step a forward AND a backward
    zb1           1F1B's, each backward split into B (input gradient) and W (weights'):
                  B's go first; stage r defers r W's and runs each where it would
                  wait (`zero_bubble_order`; ZB-H1: 05c teaches it)

    bubble = (p - 1) / (v·m + p - 1)        fill and drain shrink v times, for v
                                            times the messages (05's, at v·m)

Interleaved p=2, m=2, v=2 (t_f = t_b; a, b: the rank's chunks; bubble 2/10 = 1/5):

    r0 F0a F1a F0b F1b  .  B0b  .  B1b B0a B1a
    r1  .  F0a F1a F0b B0b F1b B1b B0a B1a  .

The messages: `comm_plan` puts every rank's steps on one clock of p2p groups (a tick: a
rank's actions, then ONE batch_isend_irecv group). NCCL's rule: a send completes only
once its receive is posted, and a group only as a whole, so two ranks whose groups each
wait on the other's LATER group hang on GPUs while gloo, which buffers sends, passes.
`nccl_timeline` runs a plan on paper under that rule: it raises if a group would hang,
and with a forward taking t_f and a backward t_b it is the simulator whose timelines
give the bubble. The demo runs gpipe, 1f1b and interleaved for real (05c's runs zb1)
and prints the measured bubble beside the simulated one and the formula; `--plot`
draws both as Gantt charts.

Launch:  python 05b_schedules.py [--ranks N] [--microbatches M] [--virtual-stages V]
         torchrun --standalone --nproc_per_node=4 05b_schedules.py [--plot]

What changed from 05: the order of a step is data (`schedule_steps`), not a loop, so
one executor runs them all and a checker proves each safe before any GPU runs it. And
`Microbatches` grows the step train.py runs: 03's DP around each chunk, the forwards in
a lower precision with messages in it, backward from a scaled loss, and a token count
made elsewhere without a host sync (06 comes later: its choices are passed in).
To add a schedule: name it in SCHEDULES, give `warmup_forwards` and `schedule_steps` its
order, and teach any new kind of action to `input_message`, `SENDS_TO`, `nccl_timeline`'s
durations and `run_plan`, as zb1's W (a weight gradient, sent nowhere) is taught.
Left out on purpose: the B/W split itself (05c_zero_bubble.py, whose demo runs zb1),
ZB-H2 and ZB-V, DualPipe, unbalanced stages, overlapping messages with compute.
"""

import argparse
import contextlib
import functools
import importlib
import os
import time
from collections import defaultdict, namedtuple
from pathlib import Path

import torch
import torch.distributed as dist

from support import distributed
from support.distributed import print0
from support.pipeline.gantt import plot_timelines

pipe = importlib.import_module("05_pipeline")  # split_model, Microbatches, the loops

Action = namedtuple("Action", "op mb chunk")  # "F", "B" or "W" of mb on a chunk
Tick = namedtuple("Tick", "actions sends recvs")  # run actions, then ONE p2p group
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1")
Event = pipe.Event  # an Action as it ran (or was simulated): op mb chunk start end


def check_config(schedule, p, m=None, v=1, n_layer=None, batch_size=None) -> None:
    """05's checks, and the schedule's: every rank fails here before any send."""
    assert schedule in SCHEDULES, f"unknown schedule {schedule!r}: not in {SCHEDULES}"
    chunked = f"virtual_stages={v} > 1 needs schedule='interleaved'"
    assert v == 1 or schedule == "interleaved", chunked
    pipe.check_pipeline(p, m, v, n_layer, batch_size)
    ring = f"interleaved needs microbatches divisible by pp_size (m={m}, p={p})"
    assert m is None or schedule != "interleaved" or m % p == 0, ring


def warmup_forwards(schedule: str, p: int, m: int, v: int, rank: int) -> int:
    """Forwards before the first backward: GPipe all, 1F1B enough to keep the stages
    after this one busy, interleaved that and (v-1)p more so a steady step can
    exchange its forward's and backward's messages in one group."""
    if schedule == "gpipe":
        warmup = m
    elif schedule in ("1f1b", "zb1"):
        warmup = p - rank - 1
    else:
        warmup = 2 * (p - rank - 1) + (v - 1) * p
    return min(warmup, m * v)


def schedule_steps(schedule, p: int, m: int, v: int, rank: int, forward_only=False):
    """Rank's actions in steps, each run between two p2p exchanges: the warm-up
    forwards, then a forward and a backward in turn, then the backwards left."""
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
    warmup = warmup_forwards(schedule, p, m, v, rank)
    steps = [(f,) for f in fwd[:warmup]]
    for f, b in zip(fwd[warmup:], bwd):  # the steady phase: one forward, one backward
        steps += [(f, b)] if schedule == "interleaved" else [(f,), (b,)]
    steps += [(b,) for b in bwd[len(fwd) - warmup :]]  # the cool-down
    return zero_bubble_order(steps, rank) if schedule == "zb1" else steps


def zero_bubble_order(steps, rank: int):
    """ZB-H1 (2401.10241) from 1F1B's steps: stage `rank` lets its first `rank` B's go
    without a W, then follows each B with the W of the oldest B still waiting (W_i
    after B_{i+rank}), and runs its last `rank` W's at the end, where 1F1B's cool-down
    idles. The last stage, which holds one microbatch, lags p-1 W's and the first
    none, so each stage has at most p microbatches forwarded and not yet through W,
    as 1F1B's first stage."""
    waiting = []  # backwards done, their W's not yet run
    order = []
    for step in steps:
        order.append(step)
        waiting += [Action("W", a.mb, a.chunk) for a in step if a.op == "B"]
        if step[0].op == "B" and len(waiting) > rank:
            order.append((waiting.pop(0),))
    return order + [(w,) for w in waiting]


@functools.lru_cache(maxsize=4096)
def peak_kept(schedule, p, m, v, rank, chunk_bytes, w_bytes=0) -> tuple[int, int]:
    """(the most bytes kept for backward as the rank runs its schedule_steps, the
    microbatches alive then): a forward keeps chunk_bytes[its chunk], its backward
    frees them, or under zb1 keeps w_bytes of them until its W (05c measures both)."""
    alive = 0
    count = 0
    peak = (0, 0)
    freed = "W" if schedule == "zb1" else "B"  # zb1: a microbatch counts until its W
    w_bytes = w_bytes if schedule == "zb1" else 0  # no W: B frees all
    for step in schedule_steps(schedule, p, m, v, rank):
        for a in step:
            kept = {"F": chunk_bytes[a.chunk], "B": w_bytes - chunk_bytes[a.chunk]}
            alive += kept.get(a.op, -w_bytes)  # W: -w_bytes
            count += 1 if a.op == "F" else -(a.op == freed)
            peak = max(peak, (alive, count))
    return peak


# An action's output travels one stage on: a forward's to s+1, a backward's to s-1.
# A new kind of action that sends nothing (zero-bubble's W) is simply not in this table.
SENDS_TO = {"F": +1, "B": -1}


def consumer_rank(a: Action, rank: int, p: int, v: int) -> int | None:
    """The rank using a's output: stage s+1 after a forward at s, s-1 after a backward."""
    if a.op not in SENDS_TO:
        return None
    s = a.chunk * p + rank + SENDS_TO[a.op]
    return s % p if 0 <= s < p * v else None


def input_message(a: Action, s: int, n_stages: int):
    """The message (op, microbatch, stage) whose tensor action a, at stage s, consumes."""
    if a.op == "F":
        return ("F", a.mb, s - 1) if s > 0 else None  # the previous stage's activation
    if a.op == "W":
        return ("B", a.mb, s)  # this stage's own backward: W reads what B queued
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


# NCCL's rule, on paper. A group is (rank, tick index). NCCL pairs the k-th send r->q
# with the k-th receive on q from r, whatever they carry; a group completes only once
# every group holding a partner of its operations has been posted.
def send_recv_pairs(plan) -> list[tuple]:
    """(group of a send, group of its receive) for every message; the messages must
    agree link by link, or the plan would hand a tensor to the wrong action."""
    sent = defaultdict(list)  # (src, dst) -> [((rank, tick index), message)]
    received = defaultdict(list)
    for r, ticks in enumerate(plan):
        for i, tick in enumerate(ticks):
            for q, msg in tick.sends:
                sent[(r, q)].append(((r, i), msg))
            for q, msg in tick.recvs:
                received[(q, r)].append(((r, i), msg))
    for link in sent.keys() | received.keys():
        out = [msg for _, msg in sent[link]]
        into = [msg for _, msg in received[link]]
        assert out == into, f"{link}: sends {out} but receives {into}"
    pairs = []
    for link in sent:
        for (g, _), (h, _) in zip(sent[link], received[link]):
            pairs.append((g, h))
    return pairs


def completes_at(g, partners, posted):
    """NCCL's rule: a send completes only once its receive is posted (a receive once
    its send is), and the group g only as a whole. -> when, or None: it blocks."""
    if any(h not in posted for h in partners):
        return None  # blocked until every partner has posted its group
    return max(posted[h] for h in [g, *partners])


def nccl_timeline(plan, v: int, t_f=1.0, t_b=2.0, t_w=None) -> list[list[Event]]:
    """Run a plan on paper as run_plan would under NCCL, or raise naming the groups that
    hang: a forward takes t_f per stage, a backward t_b, and a chunk 1/v of that; in a
    plan with W's, a backward is split: B takes t_b - t_w, W t_w (t_b/2 by default). A
    rank runs its tick's actions, posts its group, and waits until the group completes."""
    p = len(plan)
    split = any(a.op == "W" for ticks in plan for tick in ticks for a in tick.actions)
    t_w = t_b / 2 if t_w is None else t_w
    t_input = t_b - t_w if split else t_b  # B alone: the input gradient
    durations = {"F": t_f / v, "B": t_input / v, "W": t_w / v}  # a chunk: 1/v
    partners = defaultdict(list)  # group -> the groups holding its partners
    for g, h in send_recv_pairs(plan):
        partners[g].append(h)
        partners[h].append(g)
    at = [0] * p  # each rank's next tick
    clock = [0.0] * p
    posted = {}  # group -> when its rank posted it
    have = [set() for _ in range(p)]  # the messages each rank holds
    timeline = [[] for _ in range(p)]
    while any(at[r] < len(plan[r]) for r in range(p)):
        before = (sum(at), len(posted))
        for r in range(p):  # each rank runs until it blocks on a group, or ends
            while at[r] < len(plan[r]):
                g = (r, at[r])
                tick = plan[r][at[r]]
                if g not in posted:  # run the tick's actions, then post its group
                    for a in tick.actions:
                        s = a.chunk * p + r
                        need = input_message(a, s, p * v)
                        assert need in have[r] | {None}, f"rank {r}: {a} before {need}"
                        have[r].add((a.op, a.mb, s))
                        start = clock[r]
                        clock[r] += durations[a.op]
                        timeline[r].append(Event(*a, start, clock[r]))
                    posted[g] = clock[r]
                done = completes_at(g, partners[g], posted)
                if done is None:
                    break  # blocked: this rank waits, and every later tick with it
                clock[r] = done
                have[r].update(msg for _, msg in tick.recvs)
                at[r] += 1
        if (sum(at), len(posted)) == before:
            hung = [(r, at[r]) for r in range(p) if at[r] < len(plan[r])]
            raise RuntimeError(f"deadlock under NCCL's rule: groups {hung} hang")
    return timeline


def simulate(schedule: str, p: int, m: int, v: int = 1, t_f=1.0, t_b=2.0, t_w=None):
    """-> (each rank's actions, their Events as the executor's plan runs under NCCL)."""
    plan = comm_plan([schedule_steps(schedule, p, m, v, r) for r in range(p)], p, v)
    orders = [[a for tick in ticks for a in tick.actions] for ticks in plan]
    return orders, nccl_timeline(plan, v, t_f, t_b, t_w)


def bubble_formula(p: int, m: int, v: int = 1, schedule: str = "1f1b") -> float:
    """(p-1)/(v·m + p-1): 05's bubble with v·m microbatches, as the fill and drain of
    a chunk take 1/v of a stage's time. zb1, t_f = t_B = t_W, m >= p: (p-1)/(3m + p-1),
    an idle t_f where 1F1B idles t_f + t_B + t_W (05c); m < p: each of the p-m
    microbatches missing leaves one more t_f idle, (2p-1-m)/(2m + 2p-1) (simulated)."""
    if schedule == "zb1":
        idle = p - 1 + max(0, p - m)  # in units of t_f
        return idle / (3 * m + idle)
    return pipe.bubble_formula(p, v * m)


class Microbatches(pipe.Microbatches):
    """05's step, grown into the one train.py runs. What it adds, each passed in (05b
    comes before 06, which chooses the dtype and the loss scale):
    - v chunks per rank, each maybe wrapped in 03's DataParallel, which all-reduces
      after a chunk's last backward only (no_sync() on the others);
    - forwards under autocast in `dtype` (bf16, fp16), messages in it: half the bytes;
    - `scale`: backward starts from the loss times DP's size (03's DP averages) times a
      loss scale, while the loss reported stays the true one;
    - n_tokens: the step's count of real targets over every DP replica, made elsewhere
      (a tensor, so that reading it here would not make the CPU wait for the GPU)."""

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
        self.tokens_in = n_tokens  # read by count_tokens, from 05's __init__
        stages = [getattr(c, "module", c) for c in chunks]  # unwrap 03's DP
        super().__init__(stages, batch, m, group, embed_group)
        check_config(schedule, self.p, m, len(chunks))  # before any message too
        self.chunks = chunks  # wrapped: DP's hooks run in their forward and backward
        self.shape = shape or self.shape  # SP, CP: (b, T/tp, C), (b, T/cp, C)
        self.param_dtype = next(self.stages[0].parameters()).dtype
        self.wire = dtype or self.param_dtype
        cast = dtype not in (None, torch.float32)
        device_type = self.device.type
        self.autocast = functools.partial(torch.autocast, device_type, dtype, cast)
        self.scale = 1.0
        self.deferred = set()  # (mb, chunk)s through B whose W has not run

    def count_tokens(self, y):
        """05's count of this batch's real targets, or the caller's n_tokens (a tensor
        is checked by its maker)."""
        if self.tokens_in is None:
            return super().count_tokens(y)
        ok = torch.is_tensor(self.tokens_in) or self.tokens_in > 0
        assert ok, "every target of the step is -1: no loss to average"
        return self.tokens_in

    def new_act(self):
        """An empty message buffer, in the wire's dtype."""
        return torch.empty(self.shape, dtype=self.wire, device=self.device)

    def compute(self, chunk: int, inp):
        """05's forward under autocast: the forward only, as autocast's docs say."""
        with self.autocast():
            return super().compute(chunk, inp)

    def loss_share(self, logits, mb: int):
        """05's share times `scale`, for backward only: self.loss stays unscaled."""
        return super().loss_share(logits, mb) * self.scale

    def backward(self, mb: int, grad, chunk: int = 0, sync: bool = True):
        """05's backward; DP all-reduces only when sync (the chunk's last backward).
        On a chunk split by 05c, only the input gradient: the weights' wait for W."""
        out = self.stash[(mb, chunk)][1]
        grad = None if grad is None else grad.to(out.dtype)  # from the wire's dtype
        if getattr(self.stages[chunk], "weight_grads", None) is not None:
            self.deferred.add((mb, chunk))  # alive until its W
        with self.quiet(chunk, sync):
            return super().backward(mb, grad, chunk)

    def quiet(self, chunk: int, sync: bool):
        """03's no_sync() around a pass that is not the chunk's last (no DP: nothing)."""
        wrapped = self.chunks[chunk]
        quiet = not sync and hasattr(wrapped, "no_sync")
        return wrapped.no_sync() if quiet else contextlib.nullcontext()

    def weight(self, mb: int, chunk: int = 0, sync: bool = True):
        """W (zero-bubble): the weight gradients B(mb) queued on a chunk split by 05c,
        added into .grad; DP all-reduces when sync (the chunk's last W)."""
        queue = getattr(self.stages[chunk], "weight_grads", None)
        assert queue is not None, "a W needs 05c_zero_bubble.split_weight_grads(chunk)"
        start = time.perf_counter() - self.t0
        with self.quiet(chunk, sync):
            queue.run(mb)
        self.deferred.remove((mb, chunk))
        self.events.append(Event("W", mb, chunk, start, time.perf_counter() - self.t0))

    def forward(self, mb: int, inp, chunk: int = 0):
        """05's forward, from a message cast from the wire's dtype to the parameters'.
        The peak counts (mb, chunk)s forwarded and not yet through B, or W if split."""
        inp = None if inp is None else inp.to(self.param_dtype)
        queue = getattr(self.stages[chunk], "weight_grads", None)
        if queue is not None:  # 05c's split: what B will queue is microbatch mb's
            queue.mb = mb
        out = super().forward(mb, inp, chunk)
        if torch.is_grad_enabled():
            self.peak = max(self.peak, len(self.stash) + len(self.deferred))
        return out

    def result(self) -> pipe.StepResult:
        stuck = f"(mb, chunk)s {sorted(self.deferred)} ran B but never W"
        assert not self.deferred, stuck
        return super().result()


def run_plan(step: Microbatches, ticks: list[Tick]) -> None:
    """The executor: run one rank's ticks, each its actions and then ONE p2p group."""
    p = step.p
    v = len(step.chunks)
    # DP all-reduces in a chunk's last pass that adds to .grad: its last B, or W.
    last = {a.chunk: a for tick in ticks for a in tick.actions if a.op in "BW"}
    inbox = {}  # message -> its tensor, received or made here for the next chunk
    for tick in ticks:
        for a in tick.actions:
            s = a.chunk * p + step.rank
            msg = input_message(a, s, p * v)
            if a.op == "F":
                out = step.forward(a.mb, inbox.pop(msg) if msg else None, a.chunk)
            elif a.op == "W":  # zero-bubble: from what B queued; sends nothing
                step.weight(a.mb, a.chunk, a == last[a.chunk])
            else:
                grad = inbox.pop(msg) if msg[0] == "B" else None  # last: from the loss
                out = step.backward(a.mb, grad, a.chunk, a == last[a.chunk])
            if consumer_rank(a, step.rank, p, v) is not None:  # sent below, or p = 1
                inbox[(a.op, a.mb, s)] = out.detach().to(step.wire)
        for _, msg in tick.recvs:
            inbox[msg] = step.new_act()
        ops = [(dist.isend, inbox.pop(msg), q) for q, msg in tick.sends]
        ops += [(dist.irecv, inbox[msg], q) for q, msg in tick.recvs]
        pipe.blocking_p2p(ops, step.group)  # ONE group, waited whole: comm_plan's
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
) -> pipe.StepResult:
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


def plot_simulated(p: int, m: int, v: int) -> Path:
    """The simulated timelines of gpipe, 1f1b and interleaved (v chunks), t_f = 1 and
    t_b = 2, as one PNG, each chart titled with its bubble. -> the file's path."""
    titled = {}
    for schedule, vs in (("gpipe", 1), ("1f1b", 1), ("interleaved", v)):
        timeline = simulate(schedule, p, m, vs)[1]
        label = f"{schedule} v={vs}" if vs > 1 else schedule
        bubble = f"bubble {pipe.bubble_fraction(timeline):.1%} = (p-1)/(v·m+p-1)"
        titled[f"{label}: simulated, {bubble}"] = timeline
    path = Path("out/pipeline") / f"pipeline_simulated_p{p}_m{m}.png"
    xlabel = "time in units of one stage's forward (t_f = 1, t_b = 2, messages free)"
    plot_timelines(titled, path, 1.0, xlabel)
    return path


def gradients(chunks) -> dict:
    """{name: a copy of its .grad} over this rank's chunks."""
    return {n: q.grad.clone() for c in chunks for n, q in c.named_parameters()}


LOOPS = {"gpipe": pipe.gpipe_naive, "1f1b": pipe.one_f_one_b}  # 05's loop per order


def demo(args, rank: int, p: int, device) -> None:
    """Every schedule on one batch, checked against one process and 05's loops."""
    m = args.microbatches
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // p))  # a fair share of cores
    model, batch, ref_loss, ref = pipe.one_process(m, device)  # 8 blocks: p·v = 8
    embed_group = pipe.embedding_group([list(range(p))])
    where = f"{os.cpu_count()} CPU cores" if device.type == "cpu" else "a GPU each"
    print0(f"p={p} stages on {where}; m={m} microbatches of (b, T) = (4, 64), C=256")
    print0(f"{'':15}{'loss':>8}{'vs 1 proc':>10}{'vs loop':>9}{'bubble':>8}", end="")
    print0(f"{'simulated':>10}{'formula':>8}  peak alive (mb, chunk) per stage")
    measured = {}
    for schedule in SCHEDULES[:3]:  # zb1 needs 05c's split: python 05c_zero_bubble.py
        v = args.virtual_stages if schedule == "interleaved" else 1
        chunks = pipe.split_model(model, rank, p, v)
        loop = ref  # interleaved has no loop in 05: compared with one process twice
        if schedule in LOOPS:  # 05's loop of the same order, one step
            model.zero_grad(set_to_none=True)
            LOOPS[schedule](chunks[0], batch, m, embed_group=embed_group)
            loop = gradients(chunks)
        for _ in range(2):  # a warm-up step, then the measured one
            model.zero_grad(set_to_none=True)
            result = pipeline_step(chunks, batch, m, schedule, embed_group=embed_group)
        grads = gradients(chunks)
        diffs = [pipe.max_difference(grads, ref), pipe.max_difference(grads, loop)]
        diffs = torch.stack(diffs)
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
        loss = result.loss.clone()
        dist.all_reduce(loss)  # SUM: only the last stage's share is not 0
        assert abs(loss - ref_loss) < 1e-5, f"{schedule}: loss differs from one process"
        assert diffs.max() < 1e-5, f"{schedule}: gradients differ from 1 process or 05"
        gathered = [None] * p  # every rank's Events and peak activations alive
        dist.all_gather_object(gathered, (result.events, result.peak_in_flight))
        timeline = [events for events, _ in gathered]
        bubble = pipe.bubble_fraction(timeline)
        ideal = pipe.bubble_fraction(simulate(schedule, p, m, v)[1])  # t_b = 2 t_f
        label = f"{schedule} v={v}" if v > 1 else schedule
        against = f"{diffs[1]:.1e}" if schedule in LOOPS else "-"
        text = f"{label:<15}{loss:>8.4f}{diffs[0]:>10.1e}{against:>9}{bubble:>8.1%}"
        text += f"{ideal:>10.1%}{bubble_formula(p, m, v):>8.1%}"
        print0(f"{text}  {[peak for _, peak in gathered]}")
        measured[f"{label}: measured on {where}, bubble {bubble:.1%}"] = timeline
    print0("\nEvery schedule equals one process and 05's loop of its order (loss and")
    print0("gradients < 1e-5; '-': interleaving has no loop in 05).")
    print0("bubble: 1 - busy/span of one step as it ran; simulated: the same plan")
    print0("under NCCL's rule, t_b = 2 t_f, messages free; formula: (p-1)/(v·m+p-1).")
    if p > (os.cpu_count() or p):  # More ranks than cores: they time-share them.
        print0(f"{p} ranks time-share {os.cpu_count()} cores: measured != simulated.")
        print0("Medians over steps, and the measured figure: bench/bench_pipeline.py")
    if args.plot and rank == 0:  # the simulated timelines, then this run's
        print0(f"wrote {plot_simulated(p, m, args.virtual_stages)}")
        path = Path("out/pipeline") / f"pipeline_measured_p{p}_m{m}.png"
        plot_timelines(measured, path)
        print0(f"wrote {path}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(ranks=4)  # p: one stage each
    parser.add_argument("--microbatches", type=int, default=8, help="m")
    parser.add_argument("--virtual-stages", type=int, default=2, help="interleaved's v")
    parser.add_argument("--plot", action="store_true", help="draw the timelines' PNGs")


def check(args, p: int) -> None:  # interleaved asks the most: m % p == 0, 8 >= p·v
    check_config("interleaved", p, args.microbatches, args.virtual_stages, n_layer=8)


def main(argv=None) -> None:
    distributed.run_on_ranks(demo, argv, __file__, __doc__, add_arguments, check)


if __name__ == "__main__":
    main()
