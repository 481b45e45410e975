"""05 · Pipeline parallelism: cut the model into stages and stream microbatches.

Each of p ranks holds consecutive layers, a stage. A step's batch of B sequences is cut
into m microbatches of b = B/m; stage r works on microbatch i while stage r+1 works on
i-1. Activations go forward and gradients back, point-to-point:

    rank 0: embed + blocks 0-1 ─▶ rank 1: 2-3 ─▶ rank 2: 4-5 ─▶ rank 3: 6-7 + head
            ◀── dL/dx (b, T, C) ◀──        ◀──             ◀──      loss
    wte and lm_head are one matrix, kept on ranks 0 and 3: their gradients are summed.

The bubble: stages idle while the pipeline fills and drains. With t_f and t_b a stage's
forward and backward of one microbatch, m microbatches take (m+p-1)(t_f+t_b), of which
each stage is busy m(t_f+t_b):

    bubble = (p - 1) / (m + p - 1)          GPipe and 1F1B alike

GPipe (arXiv 1811.06965) runs all m forwards, then all m backwards, so a stage holds m
microbatches' activations. 1F1B (PipeDream-flush, 1806.03377) has the same bubble and
holds at most p: stage r runs p-r-1 warm-up forwards, then a forward and a backward in
turn (the steady phase), then the backwards left (the cool-down). 1F1B at p=4, m=8,
drawn with t_f = t_b (Fi: forward of microbatch i; . idle; at most 4 alive). The
warm-ups are 3, 2, 1 and 0 forwards, so r0's F3 is the first of its steady phase:

    r0 F0F1F2F3 . . .B0F4B1F5B2F6B3F7B4 .B5 .B6 .B7
    r1  .F0F1F2 . .B0F3B1F4B2F5B3F6B4F7B5 .B6 .B7
    r2  . .F0F1 .B0F2B1F3B2F4B3F5B4F6B5F7B6 .B7
    r3  . . .F0B0F1B1F2B2F3B3F4B4F5B5F6B6F7B7

Simple first: `gpipe_naive`, a plain loop with a blocking call per message, then
`one_f_one_b`, 1F1B as the loop of picotron and Megatron with every message named
(`StageLinks`). Both run on `Microbatches`, one rank's fp32 step, and both equal one
process. A message is ONE `batch_isend_irecv` group, waited whole, as on NCCL, where a
send completes only once its receive is posted (`blocking_p2p`).

Launch:  python 05_pipeline.py [--ranks N] [--microbatches M]   (relaunches in torchrun)
         torchrun --standalone --nproc_per_node=4 05_pipeline.py   (gloo or NCCL)

What changed from 04b: 03 copied the whole model, 04 split every matrix and 04b the
tokens between the matrices; here a rank holds whole layers and talks only to its two
neighbours, so PP can stretch across nodes. Left out on purpose, for 05b_schedules.py:
schedules as tables (interleaved 1F1B), the check that no plan hangs under NCCL, the
simulator, and the step train.py runs (mixed precision, a loss scale, 03's DP around
each stage). For 05c_zero_bubble.py: the B/W split, ZB-H1. Left out of all three:
DualPipe, unbalanced stages, freeing sent outputs early, overlapping messages with
compute.
"""

import importlib
import os
import shlex
import sys
import time
from collections import namedtuple

import torch
import torch.distributed as dist

from support import distributed
from support.distributed import new_groups, print0

model_lib = importlib.import_module("02_model")  # GPT, GPTConfig, byte_batches

Event = namedtuple("Event", "op mb chunk start end")  # "F"/"B" of mb as it ran, seconds
StepResult = namedtuple("StepResult", "loss events peak_in_flight")  # a step's outcome


def check_pipeline(p: int, m=None, v: int = 1, n_layer=None, batch_size=None) -> None:
    """Every bad setting fails here on every rank before any send, since a failure after
    one leaves the peers blocked in a receive. m=None: split_model's, before m is known."""
    counts = f"need pp_size, virtual_stages, microbatches >= 1, got {p}, {v}, {m}"
    assert min(p, v) >= 1 and (m is None or m >= 1), counts
    few = f"n_layer={n_layer} blocks cannot fill pp_size*v = {p}*{v} stages"
    assert n_layer is None or n_layer >= p * v, few
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
    """This rank's chunks: of S = p·v balanced stages, stage s is chunk s//p of rank s%p.
    The loops below hold one (v = 1); 05b's interleaved schedule runs v > 1."""
    n_layer = len(model.transformer.h)
    n_stages = pp_size * virtual_stages
    check_pipeline(pp_size, v=virtual_stages, n_layer=n_layer)
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
    """Megatron's embedding group: {first, last} rank of this rank's pipeline, or None
    (a middle stage; p = 1: one copy). subtle: making groups is a world collective (on
    NCCL a split of the world's communicator), so EVERY rank passes EVERY pipeline's
    ranks, and all the pairs are made in one call (support/distributed.py says why)."""
    pairs = [sorted({ranks[0], ranks[-1]}) for ranks in pp_groups_ranks]
    return new_groups(pairs) if len(pairs[0]) > 1 else None


def allreduce_tied_grads(chunks, embed_group) -> None:
    """On both ranks: wte's gradient plus lm_head's, the tied matrix's gradient."""
    for param in (tied_parameter(chunk) for chunk in chunks):
        if param is not None and param.grad is not None:
            dist.all_reduce(param.grad, group=embed_group)  # SUM over {first, last}


# subtle: write for NCCL, not gloo. Gloo buffers a send, so it returns before anyone
# receives; NCCL has no send buffer: a send completes only once its peer has posted the
# matching receive, and a batch_isend_irecv group completes only as a whole. So every
# message here is one group, waited whole, and code that passes here passes on GPUs.
def blocking_p2p(ops, group=None) -> None:
    """Post (op, tensor, rank in group)s as ONE batch_isend_irecv group; wait on all."""
    world = group or dist.group.WORLD  # P2POp takes global ranks: map the group's
    ops = [dist.P2POp(op, t, dist.get_global_rank(world, q), group) for op, t, q in ops]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


class Microbatches:
    """One rank's fp32 step, for both loops: the checks, the m microbatches, the
    activations each forward keeps for its backward (the stash), the loss and Events.
    05b_schedules.py extends it into the step train.py runs."""

    def __init__(self, chunks, batch, m: int, group=None, embed_group=None):
        x, y = batch  # (B, T) ids and targets, the same on every stage
        self.p = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if self.p > 1 else 0
        self.chunks = chunks  # split_model's for this rank: one, or v for 05b
        self.stages = chunks  # 05b: the same chunks, unwrapped from 03's DP
        check_pipeline(self.p, m, len(chunks), batch_size=x.size(0))
        n_stages = self.p * len(chunks)
        assert all(c.n_stages == n_stages for c in self.stages), "split for another p"
        mine = list(range(self.rank, n_stages, self.p))
        assert [c.stage for c in self.stages] == mine, "chunks not split for this rank"
        tied = any(tied_parameter(c) is not None for c in self.stages)
        # Evaluation runs no backward (no grad), so it has no tied gradients to sum.
        if self.p > 1 and tied and embed_group is None and torch.is_grad_enabled():
            raise ValueError("tied embeddings need embed_group=embedding_group(...)")
        self.group = group
        self.embed_group = embed_group
        self.xs = x.chunk(m)  # m microbatches of (b, T)
        self.ys = y.chunk(m)
        self.n_tokens = self.count_tokens(y)
        # No message says its shape: both ends know it, (b, T, C), from the config.
        self.shape = (x.size(0) // m, x.size(1), self.stages[0].config.n_embd)
        self.device = x.device
        self.stash = {}  # (microbatch, chunk) -> (input, output) until its backward
        self.peak = 0
        self.loss = torch.zeros((), device=x.device)
        self.events = []
        # A common t = 0 for the Events; not on GPUs, where a barrier is a host sync.
        if self.p > 1 and x.device.type == "cpu":
            dist.barrier(group=group)
        self.t0 = time.perf_counter()

    def count_tokens(self, y) -> int:
        """The loss's denominator: the step's real targets (-1 is ignored)."""
        n_tokens = int((y != -1).sum())
        assert n_tokens > 0, "every target of the step is -1: no loss to average"
        return n_tokens

    def new_act(self):
        """An empty (b, T, C) buffer for a message to arrive in."""
        return torch.empty(self.shape, device=self.device)

    def compute(self, chunk: int, inp):
        """The chunk's forward: (b, T) ids or (b, T, C) -> (b, T, C), or (b, T, V)."""
        return self.chunks[chunk](inp)

    def loss_share(self, logits, mb: int):
        """Microbatch mb's part of the step's loss: its SUM over targets divided by the
        step's count, so the m shares add up to one process's mean over the batch."""
        loss_sum = self.stages[-1].loss_fn(logits, self.ys[mb], "sum")  # fp32
        self.loss += loss_sum.detach() / self.n_tokens
        return loss_sum / self.n_tokens  # what backward starts from

    def forward(self, mb: int, inp, chunk: int = 0):
        """Microbatch mb through one chunk, from stage s-1's activation (None on stage 0,
        which reads ids). -> the next stage's input, or on the last the loss to run."""
        inp = self.xs[mb] if inp is None else inp.requires_grad_()  # its grad goes back
        start = time.perf_counter() - self.t0
        out = self.compute(chunk, inp)  # (b, T, C), or (b, T, V) logits on the last
        if self.stages[chunk].is_last:
            out = self.loss_share(out, mb)
        self.events.append(Event("F", mb, chunk, start, time.perf_counter() - self.t0))
        if torch.is_grad_enabled():  # not when evaluating: no backward will come
            self.stash[(mb, chunk)] = (inp, out)
            self.peak = max(self.peak, len(self.stash))
        return out

    def backward(self, mb: int, grad, chunk: int = 0):
        """Microbatch mb's backward from dL/d(out), None if out is the loss: -> dL/d(in)."""
        inp, out = self.stash.pop((mb, chunk))
        start = time.perf_counter() - self.t0
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


def gpipe_naive(chunk, batch, m: int, group=None, embed_group=None) -> StepResult:
    """GPipe as a plain loop, one chunk per rank: all m forwards, then all m backwards,
    each message a blocking call. It cannot hang under NCCL: a send waits only on its
    receiver, whose waits in that phase point away from the sender (tests check it)."""
    step = Microbatches([chunk], batch, m, group, embed_group)
    links = StageLinks(step)
    for i in range(m):  # all m stay alive: GPipe's memory cost
        out = step.forward(i, links.recv_forward())
        links.send_forward(out)
    for i in range(m):
        grad_in = step.backward(i, links.recv_backward())
        links.send_backward(grad_in)
    return step.result()


def one_f_one_b(chunk, batch, m: int, group=None, embed_group=None) -> StepResult:
    """1F1B (PipeDream-flush) as the loop of picotron and Megatron, one chunk per rank.
    Warm-up: stage r runs p-r-1 forwards, enough to keep the stages after it busy.
    Steady: a forward, then the backward of the oldest microbatch alive (so at most
    p-r are alive), its messages in mirrored pairs of groups. Cool-down: the rest."""
    step = Microbatches([chunk], batch, m, group, embed_group)
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


def bubble_formula(p: int, m: int) -> float:
    """Idle share of a GPipe or 1F1B step: (p-1)/(m+p-1)."""
    return (p - 1) / (m + p - 1)


def bubble_fraction(timeline) -> float:
    """1 - (mean busy time per rank) / (first start to last end): the idle share, where
    waits, messages, Python and cores shared between ranks all count as idle."""
    events = [e for rank_events in timeline for e in rank_events]
    busy = sum(e.end - e.start for e in events) / len(timeline)
    return 1.0 - busy / (max(e.end for e in events) - min(e.start for e in events))


def max_difference(grads: dict, ref: dict):
    """Max |a - b| over the gradients this rank holds, as a tensor to all-reduce."""
    return max((g - ref[n]).abs().max() for n, g in grads.items())


LOOPS = {"gpipe, naive": gpipe_naive, "1f1b, loop": one_f_one_b}


def one_process(m: int, device) -> tuple:
    """The demo's model and batch, and one process's loss and gradients on the whole
    batch: what every pipeline must give (05b's schedules too). 8 blocks, C = 256, so
    that matmuls outweigh messages."""
    torch.manual_seed(0)  # the same model on every rank, cut afterwards
    config = dict(n_layer=8, n_head=4, n_embd=256, block_size=64, vocab_size=256)
    model = model_lib.GPT(model_lib.GPTConfig(**config)).to(device)
    (batch,) = model_lib.byte_batches(64, 4 * m, device=device)  # (4m, 64)
    _, ref_loss = model(*batch)
    ref_loss.backward()
    named = model.named_parameters(remove_duplicate=False)  # lm_head: the tied copy
    return model, batch, ref_loss, {n: q.grad.clone() for n, q in named}


def demo(args, rank: int, p: int, device) -> None:
    """Both loops on one batch, checked against one process and each other."""
    m = args.microbatches
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // p))  # a fair share of cores
    model, batch, ref_loss, ref = one_process(m, device)
    embed_group = embedding_group([list(range(p))])
    (chunk,) = split_model(model, rank, p)
    where = f"{os.cpu_count()} CPU cores" if device.type == "cpu" else "a GPU each"
    print0(f"p={p} stages on {where}; m={m} microbatches of (b, T) = (4, 64), C=256")
    print0(f"{'':14}{'loss':>8}{'vs 1 proc':>10}{'vs GPipe':>9}{'bubble':>8}", end="")
    print0(f"{'formula':>8}  peak alive per stage")
    gpipe = None
    for name, loop in LOOPS.items():
        for _ in range(2):  # a warm-up step, then the measured one
            model.zero_grad(set_to_none=True)
            result = loop(chunk, batch, m, embed_group=embed_group)
        grads = {n: q.grad.clone() for n, q in chunk.named_parameters()}
        gpipe = gpipe or grads  # the first loop's: naive GPipe's
        diffs = torch.stack([max_difference(grads, ref), max_difference(grads, gpipe)])
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
        loss = result.loss.clone()
        dist.all_reduce(loss)  # SUM: only the last stage's share is not 0
        assert abs(loss - ref_loss) < 1e-5, f"{name}: loss differs from one process"
        assert diffs.max() < 1e-5, f"{name}: gradients differ from 1 process or GPipe"
        gathered = [None] * p  # every rank's Events and peak microbatches alive
        dist.all_gather_object(gathered, (result.events, result.peak_in_flight))
        bubble = bubble_fraction([events for events, _ in gathered])
        text = f"{name:<14}{loss:>8.4f}{diffs[0]:>10.1e}{diffs[1]:>9.1e}"
        text += f"{bubble:>8.1%}{bubble_formula(p, m):>8.1%}"
        print0(f"{text}  {[peak for _, peak in gathered]}")
    print0("\nBoth loops equal one process (loss, gradients < 1e-5) and each other.")
    print0("bubble: 1 - busy/span of one step as it ran; ", end="")
    print0(f"formula: (p-1)/(m+p-1) = {p - 1}/{m + p - 1}.")
    if p > (os.cpu_count() or p):  # More ranks than cores: they time-share them.
        print0(f"{p} ranks share {os.cpu_count()} cores, which stretches the bubble.")
    print0("Schedules as tables, the simulator, interleaving: python 05b_schedules.py")


def add_arguments(parser) -> None:
    parser.set_defaults(ranks=4)  # p: one stage each
    parser.add_argument("--microbatches", type=int, default=8, help="m")


def check(args, p: int) -> None:  # 8 blocks must fill p stages
    check_pipeline(p, args.microbatches, n_layer=8)


# The schedules' flags left with them for 05b (issue 39): each is one line naming 05b.
MOVED_TO_05B = ("--virtual-stages", "--schedule", "--plot")


def refuse_moved_flags(argv) -> None:
    """A flag of 05b's is one line naming its command: the same flags, less --schedule
    (05b runs every schedule)."""
    moved = [a.split("=")[0] for a in argv if a.split("=")[0] in MOVED_TO_05B]
    if not moved:
        return
    kept = []
    skip = False
    for a in argv:  # --schedule X or --schedule=X: dropped
        if not skip and a.split("=")[0] != "--schedule":
            kept.append(a)
        skip = a == "--schedule"
    again = shlex.join(["python", "05b_schedules.py", *kept])
    why = f"{moved[0]} moved to 05b_schedules.py (schedules as tables, every one run)"
    raise SystemExit(f"05_pipeline.py: error: {why}: run `{again}`")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    refuse_moved_flags(argv)
    distributed.run_on_ranks(demo, argv, __file__, __doc__, add_arguments, check)


if __name__ == "__main__":
    main()
