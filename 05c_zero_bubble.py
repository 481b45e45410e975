"""05c · Zero bubble: split each backward in two and fill 1F1B's bubble with the half
that nobody waits for (ZB-H1, Qi et al. 2023, "Zero Bubble Pipeline Parallelism",
arXiv 2401.10241).

A linear layer y = x Wᵀ + bias has a backward of two matmuls of different urgency:

    B:  dX = dY W        the stage before this one waits for it
    W:  dW = dYᵀ X       nobody needs it until the optimizer step (nor the bias's Σ dY)

So B runs at once and sends dX upstream, while (X, dY) wait in a queue that a later W
drains into .grad, in the idle slots where 1F1B waits for gradients to come back. On
05b's simulator's clock, p=4, m=8: a slot is t_f, a backward takes t_b = 2·t_f (B0--:
1F1B's, two slots), and split, B and W take t_f each (Fi, Bi, Wi: microbatch i; .
idle). 1F1B (above) ends after 33 slots, ZB-H1 (below) after 27; the ideal is 24:

    r0 F0F1F2F3 . . . . . .B0--F4B1--F5B2--F6B3--F7B4-- .B5-- .B6-- .B7--
    r1  .F0F1F2 . . . .B0--F3B1--F4B2--F5B3--F6B4--F7B5-- .B6-- .B7--
    r2  . .F0F1 . .B0--F2B1--F3B2--F4B3--F5B4--F6B5--F7B6-- .B7--
    r3  . . .F0B0--F1B1--F2B2--F3B3--F4B4--F5B5--F6B6--F7B7--

    r0 F0F1F2F3 . . .B0W0F4B1W1F5B2W2F6B3W3F7B4W4B5W5B6W6B7W7
    r1  .F0F1F2 . .B0F3B1W0F4B2W1F5B3W2F6B4W3F7B5W4B6W5B7W6W7
    r2  . .F0F1 .B0F2B1F3B2W0F4B3W1F5B4W2F6B5W3F7B6W4B7W5W6W7
    r3  . . .F0B0F1B1F2B2F3B3W0F4B4W1F5B5W2F6B6W3F7B7W4W5W6W7

ZB-H1 keeps 1F1B's order and warm-up; stage r lets its first r B's go without a W,
then runs after each B the W of the oldest B still waiting (W_i after B_{i+r}), and
its last r W's in the cool-down, where 1F1B idles. A stage then holds at most p
microbatches forwarded and not yet through W, like 1F1B's first stage (05b's peak
counts those; the waiting ones keep only what W reads). The bubble x, idle time over
the ideal (busy) time, the paper's bubble rate, for m >= p:

    1F1B  x = (p-1)(t_f + t_B + t_W) / (m (t_f + t_B + t_W))  = (p-1)/m
    ZB-H1 x = (p-1)(t_f + t_B - t_W) / (m (t_f + t_B + t_W))  = (p-1)/(3m)   equal times

As a share of the step, x/(1+x): (p-1)/(m+p-1) and (p-1)/(3m+p-1), 05b's
bubble_formula, which 09 uses. ZB-H1 saves two t_W a stage: W is off the backward's
path, so the gradient crosses each stage in t_B and the fill shrinks by (p-1)·t_W (W
right after each B everywhere: x = 25.0% at m=8, simulated); and the later stages put
their W's off to the cool-down, so their B's come sooner: another (p-1)·t_W.

The cost: what W reads, each linear's X and dY (the embeddings' ids and dY), lives
from B to W: Q bytes a microbatch (`w_bytes_formula`; a: bytes of a matmul operand,
4 in fp32; the embeddings' dY is in the fp32 residual stream, 4C + 8 with the id):

    Q = a·b·T·(16C·L + [last stage] (C + V)) + [first stage] (b·T + T)(4C + 8)

With A bytes saved by a forward, stage r keeps at most (p-r)·A under 1F1B and
(p-r)·A + r·Q under ZB-H1 (measured beside it): stage 0 the same, each later one more.
ZB-H1's most is stage 0's p·A if no stage's A or Q exceeds stage 0's A. Here Q ≈ A
(both hold every linear's X): ZB-H1's most is 2% over 1F1B's. With a large vocabulary
the last stage's Q holds the head's (b, T, V) dY, p-1 times: for GPT-2 124M at pp 4,
b 4, m 8 in bf16, 09 plans 3.23 GiB on the last stage under zb1 against 1.31 GiB,
1F1B's most. The paper's equal-memory claim assumes equal stages.

Launch:  python 05c_zero_bubble.py [--ranks 4] [--plot]    (relaunches in torchrun)
         torchrun --standalone --nproc_per_node=4 05c_zero_bubble.py

What changed from 05b: a third action, W, in its tables ("zb1"); its executor calls
the W runner of a chunk split here (`split_weight_grads`), which trains train.py's
--schedule zb1, eager (torch.compile does not trace the function mode: 09 charges its
kernels eager's 1.57x) and without --recompute, --loss chunked, SP, CP, LoRA, fp16 or
gradient compression (support/train/config's check_zero_bubble). Left out on purpose: ZB-H2
(more warm-up forwards, up to 2p-1 microbatches alive on the first stage: about twice
1F1B's activations, for no bubble at all) and ZB-V (two chunks a rank in a V, p
microbatches of activations, like ZB-H1's, and no bubble, at interleaving's extra
messages), the paper's optimizer post-validation, and DualPipe.
"""

import argparse
import functools
import importlib
import os
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from support import distributed
from support.distributed import print0
from support.pipeline.gantt import plot_timelines
from support.pipeline.zero_bubble import KeptBytes, ReadAfterEachAction, mib, view_key

model_lib = importlib.import_module("02_model")  # GPT, GPTConfig, byte_batches
pipe = importlib.import_module("05_pipeline")  # split_model, bubble_fraction
sched = importlib.import_module("05b_schedules")  # pipeline_step, simulate


# ------------------------------------------------ W's three gradients, written out
def linear_weight_grad(x, dy):
    """dW = dYᵀ X over every token: (out, b·T) @ (b·T, in) -> (out, in)."""
    return dy.reshape(-1, dy.size(-1)).T @ x.reshape(-1, x.size(-1))


def bias_grad(dy):
    """The bias's gradient, Σ dY over every token: (out,)."""
    return dy.reshape(-1, dy.size(-1)).sum(0)


def embedding_weight_grad(ids, dy, rows: int):
    """dW[id] += dY at each token's id: (rows, C). A table has no input gradient."""
    grad = dy.new_zeros(rows, dy.size(-1))
    return grad.index_add_(0, ids.reshape(-1), dy.reshape(-1, dy.size(-1)))


# ------------------------------------------------ simple first: W as a list of closures
class NaiveSplitLinear(torch.autograd.Function):
    """y = x Wᵀ + bias, whose backward returns dX only: dW and the bias's gradient go
    to the list `later` as closures, for W to run."""

    @staticmethod
    def forward(ctx, x, linear, later):
        ctx.save_for_backward(x)
        ctx.linear = linear  # a Module, not a tensor: autograd does not see its weights
        ctx.later = later
        return F.linear(x, linear.weight, linear.bias)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        weight = ctx.linear.weight
        ctx.later.append((weight, lambda: linear_weight_grad(x, dy)))
        ctx.later.append((ctx.linear.bias, lambda: bias_grad(dy)))
        return dy @ weight, None, None  # B: dX only


def naive_weight_pass(later: list) -> None:
    """W, naively: p.grad += fn() for each closure B left, then forget them."""
    for param, fn in later:
        param.grad = fn() if param.grad is None else param.grad + fn()
    later.clear()


# The real split's W is ONE autograd pass chaining the gradients: 03's and 07's hooks
# fire in it and DP syncs once, as in a backward (the naive loop fires none), and each
# gradient is added into .grad before the next is computed: one held at a time.
class WeightGradQueue:
    """A stage's deferred weight gradients: B(mb) queues them, W(mb) runs them."""

    def __init__(self, device="cpu"):
        self.pending = defaultdict(list)  # mb -> [(parameter, its dW function, inputs)]
        self.mb = None  # the microbatch whose forward runs: 05b's forward sets it
        self.peak_bytes = 0
        # subtle: the split Functions take their weights out of autograd's sight (in a
        # tuple), or B would run each weight's gradient hook, with no gradient: 03's and
        # 07's hooks would fire too early. This 0-element leaf is an input autograd does
        # see, so it records them even where nothing else needs a gradient (wte's ids).
        self.anchor = torch.zeros(0, device=device, requires_grad=True)

    def add(self, mb, param, grad_fn, *tensors) -> None:
        """From B: param's gradient is grad_fn(*tensors), computed later, in W."""
        self.pending[mb].append((param, grad_fn, tensors))

    def kept(self) -> dict:
        """{view_key: bytes} of every tensor the queue keeps alive."""
        views = {}
        for work in self.pending.values():
            for _, _, tensors in work:
                views.update((view_key(t), t.nbytes) for t in tensors)
        return views

    def nbytes(self) -> int:
        """Bytes the queue keeps alive: every tensor it holds, once."""
        return sum(self.kept().values())

    def run(self, mb) -> None:
        """W: microbatch mb's weight gradients into .grad, in ONE autograd pass (so 03's
        and 07's gradient hooks fire, and DP syncs once, as in a backward), one weight
        at a time: each link of the chain computes one dW, and autograd adds it into
        .grad (AccumulateGrad runs first of the ready nodes) before the next link runs.
        So W holds one weight's gradient at a time, never the stage's."""
        assert mb in self.pending, f"W of microbatch {mb} before its B, or run twice"
        self.peak_bytes = max(self.peak_bytes, self.nbytes())  # B's only add to it
        link = self.anchor.detach()  # the chain's start: needs no gradient
        for param, grad_fn, tensors in self.pending.pop(mb):
            link = WeightGrad.apply(link, param, grad_fn, list(tensors))
        torch.autograd.backward(link, link.new_zeros(0))  # the last link's first


class WeightGrad(torch.autograd.Function):
    """One link of W's chain: identity (0 elements) forward; backward computes ONE
    deferred gradient, for `param`, frees what it read, and passes on to the link
    before it."""

    @staticmethod
    def forward(ctx, link, param, grad_fn, tensors):
        ctx.param_dtype = param.dtype
        ctx.grad_fn = grad_fn
        ctx.tensors = tensors  # a list it empties: X and dY live until this link runs
        return link.new_zeros(0)

    @staticmethod
    def backward(ctx, dlink):
        tensors = [ctx.tensors.pop() for _ in range(len(ctx.tensors))][::-1]
        grad = ctx.grad_fn(*tensors).to(ctx.param_dtype)
        return dlink, grad, None, None


def autocast_casts(x, weight, bias):
    """Autocast's casts of F.linear's inputs (none when it is off), made here, so that
    B and W use the very tensors autograd's own linear would have saved."""
    kind = x.device.type
    if not torch.is_autocast_enabled(kind):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(kind)
    return x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


class SplitLinear(torch.autograd.Function):
    """y = x Wᵀ + b; backward: dX = dY W now, dW = dYᵀ X and db = Σ dY queued for W."""

    @staticmethod
    def forward(ctx, x, anchor, params, queue):
        weight, bias = params  # hidden from autograd: see WeightGradQueue's anchor
        x, cast_weight, cast_bias = autocast_casts(x, weight, bias)
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(x, cast_weight, cast_bias)  # (b, T, in) -> (b, T, out)
        ctx.save_for_backward(x, cast_weight)
        ctx.params = params  # the Parameters whose .grad W adds to
        ctx.queue = queue
        ctx.mb = queue.mb
        return y

    @staticmethod
    def backward(ctx, dy):  # dy: (b, T, out)
        x, weight = ctx.saved_tensors
        param, bias = ctx.params
        if param.requires_grad:
            ctx.queue.add(ctx.mb, param, linear_weight_grad, x, dy)
        if bias is not None and bias.requires_grad:
            ctx.queue.add(ctx.mb, bias, bias_grad, dy)
        return dy @ weight, None, None, None  # dX: (b, T, out) @ (out, in)


class SplitEmbedding(torch.autograd.Function):
    """Rows of W by id; backward: nothing now (ids have no gradient), dW queued for W."""

    @staticmethod
    def forward(ctx, ids, anchor, weight, queue):
        (weight,) = weight  # hidden from autograd: see WeightGradQueue's anchor
        ctx.save_for_backward(ids)
        ctx.param = weight
        ctx.queue = queue
        ctx.mb = queue.mb
        return F.embedding(ids, weight)  # (b, T) -> (b, T, C)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        rows = ctx.param.size(0)
        grad_fn = functools.partial(embedding_weight_grad, rows=rows)
        ctx.queue.add(ctx.mb, ctx.param, grad_fn, ids, dy)
        return None, None, None, None


# Which weights wait for W: every F.linear and F.embedding weight of the stage, so 02's
# blocks (c_attn, c_proj, c_fc, c_proj), wte, wpe and lm_head, and 04's shards of them.
# LayerNorm's γ and β stay in B: their gradients are sums over tokens of dY·x̂ and dY,
# as cheap as the input gradient's pass that computes x̂ anyway, and deferring them
# would keep x̂ and dY (2·b·T·C numbers each) alive to save next to no time.
EMBEDDING_OPTIONS = ("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq")
EMBEDDING_OPTIONS += ("sparse",)  # F.embedding's arguments after (input, weight)
PLAIN = ("padding_idx", "max_norm", "scale_grad_by_freq", "sparse")  # unset: 02's, 04's


class DeferWeightGrads(TorchFunctionMode):
    """Inside: F.linear and F.embedding on one of `weights` run split (B now, W later).
    A torch function mode sees every call of theirs, so 02's nn.Linear, 04's sharded
    layers and the tied lm_head all split without a line of theirs changed."""

    def __init__(self, queue: WeightGradQueue, weights):
        super().__init__()
        self.queue = queue
        self.ids = {id(w) for w in weights if w.requires_grad}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        grad = torch.is_grad_enabled()  # evaluation's forwards: no backward to split
        if grad and func is F.linear and id(args[1]) in self.ids:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            params = (args[1], bias)
            return SplitLinear.apply(args[0], self.queue.anchor, params, self.queue)
        if grad and func is F.embedding and id(args[1]) in self.ids:
            given = dict(zip(EMBEDDING_OPTIONS, args[2:]), **kwargs)  # nn.Embedding's
            unset = [given.get(k) is None or given.get(k) is False for k in PLAIN]
            assert all(unset), "SplitEmbedding has no padding_idx, max_norm or sparse"
            anchor = self.queue.anchor
            return SplitEmbedding.apply(args[0], anchor, (args[1],), self.queue)
        return func(*args, **kwargs)


def split_weight_grads(chunk):
    """Split a pipeline chunk's backward in place: its forward runs under
    DeferWeightGrads, and chunk.weight_grads is the queue 05b's W actions drain."""
    assert not hasattr(chunk, "weight_grads"), "this chunk is split already"
    queue = WeightGradQueue(next(chunk.parameters()).device)
    forward = chunk.forward

    def split_forward(*args, **kwargs):
        with DeferWeightGrads(queue, chunk.parameters()):
            return forward(*args, **kwargs)

    chunk.weight_grads = queue
    chunk.forward = split_forward  # parameter names, and checkpoints, unchanged
    return chunk


def split_for_schedule(chunks: list, schedule: str) -> list:
    """train.py's chunks, each split if the schedule has W's (zb1), else unchanged."""
    if schedule == "zb1":
        for chunk in chunks:
            split_weight_grads(chunk)
    return chunks


def w_bytes_formula(config, b, T, layers, first, last, a=4, res=4, tp=1) -> int:
    """Bytes one microbatch leaves in a stage's queue from its B to its W. Per block,
    X of c_attn, c_proj, c_fc, c_proj (C, C/tp, C, 4C/tp) and their dY (3C/tp, C, 4C/tp,
    C): 16C numbers a token at tp 1; the head's X and dY, C + V/tp; the embeddings'
    int64 ids and dY, for the b·T tokens (wte) and the T positions (wpe). a: bytes of a
    matmul's saved operand and of its dY (autocast's dtype: 2 in bf16); res: of the
    residual stream, which the embeddings' dY is in (fp32 under autocast). Q in the
    module's docstring."""
    C = config.n_embd
    V = config.padded_vocab_size // tp
    matmuls = b * T * (4 * C + 12 * C // tp) * layers
    matmuls += b * T * (C + V) if last else 0
    embeddings = (b * T + T) * (C * res + 8) if first else 0
    return a * matmuls + embeddings


def stage_w_bytes(config, b: int, T: int, p: int, r: int, a=4, tp=1) -> int:
    """w_bytes_formula on stage r of p (split_model's balanced cut of the blocks)."""
    n = config.n_layer
    layers = (r + 1) * n // p - r * n // p
    return w_bytes_formula(config, b, T, layers, r == 0, r == p - 1, a, 4, tp)


def peak_w_bytes(config, b: int, T: int, p: int, m: int, r: int) -> int:
    """Stage r's most bytes kept for W under ZB-H1 (fp32): it puts off r W's, so while
    a B queues, min(r+1, m) microbatches wait, each w_bytes_formula's bytes."""
    return min(r + 1, m) * stage_w_bytes(config, b, T, p, r)


# What a stage keeps for its backward, measured (support/pipeline/zero_bubble.py): the tensors
# autograd saved and what its W queue holds, each once, at the end of every action.
class MeasuredMicrobatches(ReadAfterEachAction, sched.Microbatches):
    """05b's step, reading the stage's KeptBytes at the end of every F, B and W."""


def measured_step(chunk, batch, m: int, schedule: str, embed_group=None):
    """05b's pipeline_step on one chunk a rank, measured. -> (StepResult, KeptBytes)."""
    step = MeasuredMicrobatches([chunk], batch, m, None, schedule, embed_group)
    step.kept = KeptBytes(chunk)
    with step.kept.hooks():
        sched.run_plan(step, sched.step_plan(schedule, step.p, m, 1)[step.rank])
    return step.result(), step.kept


def kept_bytes_formula(schedule: str, p: int, m: int, r: int, A: int, Q: int) -> int:
    """Stage r's most bytes kept for backward at the end of an action, as 05b's order
    runs: A for each microbatch forwarded and not yet through B, Q for each through B
    and not yet through W (zb1). For m >= p (and Q <= A): 1F1B (p-r)·A; ZB-H1
    (p-r)·A + r·Q, the same on stage 0, r·Q more on stage r."""
    return sched.peak_kept(schedule, p, m, 1, r, (A,), Q)[0]


# ------------------------------------------------------------------------ the demo
def one_linear_check() -> None:
    """ONE linear: dX at B, dW and db at W, bit for bit autograd's (fp32), split the
    naive way (a list of closures), then the real way (the queue)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    x = torch.randn(4, 16, 64, requires_grad=True)  # (b, T, in)
    dy = torch.randn(4, 16, 96)  # (b, T, out): what the next layer sends back
    linear(x).backward(dy)
    ref = [x.grad, linear.weight.grad, linear.bias.grad]
    linear.zero_grad(set_to_none=True)
    x.grad = None
    later = []
    NaiveSplitLinear.apply(x, linear, later).backward(dy)  # B: dX only
    assert linear.weight.grad is None, "B must leave the weight gradient to W"
    naive_weight_pass(later)  # W
    naive = [x.grad, linear.weight.grad, linear.bias.grad]
    assert all(map(torch.equal, naive, ref)), "the naive split differs from autograd"
    linear.zero_grad(set_to_none=True)
    x.grad = None
    queue = WeightGradQueue()
    queue.mb = 0
    with DeferWeightGrads(queue, linear.parameters()):
        y = linear(x)
    y.backward(dy)  # B: dX only
    assert linear.weight.grad is None, "B must leave the weight gradient to W"
    queue.run(0)  # W
    got = [x.grad, linear.weight.grad, linear.bias.grad]
    assert all(map(torch.equal, got, ref)), "the split differs from autograd"
    print("one linear (4, 16, 64) -> 96: B gives dX, W gives dW and db later,")
    print("  each bit for bit autograd's (fp32), naive and real: torch.equal")


def stage_check(config, batch) -> None:
    """One whole stage (p = 1: embeddings, every block, head): B leaves only
    LayerNorm's gradients, W adds the rest, all bit for bit autograd's (fp32)."""
    torch.manual_seed(0)
    model = model_lib.GPT(config)
    _, loss = model(*batch)
    loss.backward()
    ref = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    (chunk,) = pipe.split_model(model, 0, 1)
    split_weight_grads(chunk)
    chunk.weight_grads.mb = 0
    chunk.loss_fn(chunk(batch[0]), batch[1]).backward()  # B
    in_b = [n for n, q in chunk.named_parameters() if q.grad is not None]
    kept = chunk.weight_grads.nbytes()
    chunk.weight_grads.run(0)  # W
    same = all(torch.equal(q.grad, ref[n]) for n, q in chunk.named_parameters())
    assert same, "a deferred weight gradient differs from autograd's"
    kinds = ", ".join(sorted({name.split(".")[-2] for name in in_b}))
    print(f"\nthe GPT as one stage, {len(ref)} weights: {len(in_b)} in B ({kinds}),")
    print(
        f"  {len(ref) - len(in_b)} in W: every gradient bit for bit autograd's (fp32)"
    )
    b, T = batch[0].shape
    formula = w_bytes_formula(config, b, T, config.n_layer, True, True)
    print(f"  kept from B to W: {kept:,} bytes measured, {formula:,} by the formula")
    V = config.padded_vocab_size
    sizes = f"b={b}, T={T}, C={config.n_embd}, L={config.n_layer}, V={V}"
    print(f"    Q = 4·(b·T·16C·L + b·T·(C+V)) + (b·T+T)(4C+8) at {sizes}")
    assert kept == formula, "the queue's bytes differ from w_bytes_formula"


def bubble_rate(timeline) -> float:
    """Idle time over busy time, the paper's bubble rate (bubble / ideal)."""
    events = [e for rank_events in timeline for e in rank_events]
    busy = sum(e.end - e.start for e in events) / len(timeline)
    return (span(timeline) - busy) / busy


def span(timeline) -> float:
    """First start to last end of a step, over every rank."""
    events = [e for rank_events in timeline for e in rank_events]
    return max(e.end for e in events) - min(e.start for e in events)


def bubble_formula(schedule: str, p: int, m: int) -> float:
    """Bubble over ideal time x = f/(1-f), from f, 05b's share of the step (m < p too):
    t_f = t_B = t_W, m >= p: (p-1)/m for 1F1B, (p-1)/(3m) for ZB-H1."""
    f = sched.bubble_formula(p, m, 1, schedule)
    return f / (1 - f)


def measure(schedule: str, model, rank: int, p: int, m: int, batch, embed_group):
    """Two steps of `schedule` on this rank's stage: the first measures the bytes kept
    for backward (KeptBytes), the second is timed. -> (its loss, this rank's gradients,
    every rank's (Events, peak alive, W queue's peak, A, most bytes kept))."""
    (chunk,) = pipe.split_model(model, rank, p)
    if schedule == "zb1":
        split_weight_grads(chunk)
    model.zero_grad(set_to_none=True)
    _, kept = measured_step(chunk, batch, m, schedule, embed_group)
    model.zero_grad(set_to_none=True)
    result = sched.pipeline_step([chunk], batch, m, schedule, embed_group=embed_group)
    grads = {n: q.grad.clone() for n, q in chunk.named_parameters()}
    queue = getattr(chunk, "weight_grads", None)
    w_peak = queue.peak_bytes if queue else 0
    mine = (result.events, result.peak_in_flight, w_peak, kept.first, kept.peak)
    gathered = [None] * p
    dist.all_gather_object(gathered, mine)
    loss = result.loss.clone()
    dist.all_reduce(loss)  # SUM: only the last stage's share is not 0
    return loss, grads, gathered


def compare(rank: int, p: int, m: int, device, embed_group, where: str) -> dict:
    """1F1B and ZB-H1 on one batch of m microbatches, each checked against one
    process, each row printed with the bytes kept beside their formula.
    -> {title: measured timeline}."""
    torch.manual_seed(0)  # the same model on every rank, cut afterwards
    config = dict(n_layer=8, n_head=4, n_embd=256, block_size=64, vocab_size=256)
    model = model_lib.GPT(model_lib.GPTConfig(**config)).to(device)  # 05b's
    (batch,) = model_lib.byte_batches(64, 4 * m, device=device)  # (4m, 64)
    _, ref_loss = model(*batch)  # one process on the whole batch
    ref_loss.backward()
    named = model.named_parameters(remove_duplicate=False)  # lm_head: the tied copy
    ref = {n: q.grad.clone() for n, q in named}
    b = batch[0].size(0) // m
    print0(f"\np={p} stages on {where}; m={m} microbatches of (b, T) = (4, 64), C=256")
    print0(f"{'':6}{'step':>8}{'measured':>9}{'simulated':>10}{'formula':>8}", end="")
    print0("  peak alive    MiB kept for backward per stage")
    cores = os.cpu_count() or p
    if p > cores:  # More ranks than cores: they time-share them.
        print0(f"{p} ranks time-share {cores} cores: the measured columns are not the")
        print0("schedule's; compare simulated and formula")
    timelines = {}
    kept = {}
    for schedule in ("1f1b", "zb1"):
        loss, grads, gathered = measure(schedule, model, rank, p, m, batch, embed_group)
        diff = pipe.max_difference(grads, ref)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        assert abs(loss - ref_loss) < 1e-5, f"{schedule}: the loss differs"
        assert diff < 1e-5, f"{schedule}: gradients differ from one process"
        timeline = [g[0] for g in gathered]
        simulated = bubble_rate(sched.simulate(schedule, p, m)[1])  # t_w = t_b / 2
        text = (
            f"{schedule:<6}{span(timeline) * 1e3:>6.0f}ms{bubble_rate(timeline):>9.0%}"
        )
        text += f"{simulated:>10.1%}{bubble_formula(schedule, p, m):>8.1%}"
        print0(f"{text}  {[g[1] for g in gathered]}  {mib(g[4] for g in gathered)}")
        want = [peak_w_bytes(model.config, b, 64, p, m, r) for r in range(p)]
        zb = schedule == "zb1"
        w_peaks = [g[2] for g in gathered]
        assert w_peaks == (want if zb else [0] * p), "W bytes differ from the formula"
        acts = [g[3] for g in gathered]  # A: the same in both schedules
        kept[schedule] = [g[4] for g in gathered]
        title = f"{schedule}, m={m}: measured on {where}, {span(timeline) * 1e3:.0f} ms"
        timelines[f"{title} (simulated bubble/ideal {simulated:.1%})"] = timeline
    w = [stage_w_bytes(model.config, b, 64, p, r) for r in range(p)]  # a microbatch
    for schedule, measured in kept.items():
        formula = [
            kept_bytes_formula(schedule, p, m, r, acts[r], w[r]) for r in range(p)
        ]
        assert measured == formula, f"{schedule}: bytes kept {measured} != {formula}"
    extra = [z - o for z, o in zip(kept["zb1"], kept["1f1b"])]
    print0(f"a microbatch's A (saved by its forward), MiB: {mib(acts)}")
    print0(f"  its Q (kept from B to W, w_bytes_formula): {mib(w)}")
    print0(f"zb1 - 1f1b: {mib(extra)} MiB = r·Q on stage r (= the formula's, measured)")
    return timelines


def demo(args, rank: int, p: int, device) -> None:
    """The split on one linear, on a whole stage, then 1F1B against ZB-H1."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // p))  # a fair share of cores
    if rank == 0:
        one_linear_check()
        config = dict(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=256)
        stage_check(model_lib.GPTConfig(**config), *model_lib.byte_batches(32, 4))
    embed_group = pipe.embedding_group([list(range(p))])
    cores = os.cpu_count() or p
    where = f"{cores} CPU cores" if device.type == "cpu" else "a GPU each"
    measured = {}
    for m in args.microbatches:
        measured[m] = compare(rank, p, m, device, embed_group, where)
    print0("\nBoth equal one process (loss and every gradient < 1e-5).")
    print0("measured: idle over busy time of the step as it ran, the bubble x over")
    print0("the ideal; simulated: the plan under NCCL's rule, t_f = t_B = t_W;")
    print0("formula: 05b's share of the step f, as x = f/(1-f) (05b's 42.9% for")
    print0("1F1B at p = 4, m = 4 is this 75.0%). peak alive: microbatches forwarded")
    print0("and not yet through W (1F1B: B). MiB kept: what autograd saved and the")
    print0("W queue holds, the most at the end of an action, = the formula 1F1B")
    print0("(p-r)·A, ZB-H1 (p-r)·A + r·Q (m >= p). The last stage's Q holds the")
    head = 4 * 64 * 256 * 4  # the head's dY: (b, T, V) fp32
    gpt2 = 4 * 1024 * 50_304 * 2 / 1e6  # b = 4, T = 1,024, V = 50,304, bf16
    print0(f"head's dY, {head:,} bytes here ({gpt2:,.0f} MB at b = 4 and GPT-2's T")
    print0(f"and V in bf16), for each of the p-1 = {p - 1} waiting for their W.")
    if args.plot and rank == 0:
        print0(f"wrote {plot_simulated(p, max(args.microbatches))}")
        path = Path("out/pipeline") / f"pipeline_zb1_p{p}.png"
        titled = measured[max(measured)]
        if p > cores:
            note = f"; {p} ranks time-share {cores} cores: step times do not compare"
            titled = {title + note: tl for title, tl in titled.items()}
        plot_timelines(titled, path)
        print0(f"wrote {path}")


def plot_simulated(p: int, m: int) -> Path:
    """1F1B above ZB-H1, simulated on one clock (t_f = t_B = t_W = 1, 1F1B's backward
    t_b = 2), as one PNG, each chart titled with its bubble. -> the file's path."""
    titled = {}
    for schedule in ("1f1b", "zb1"):
        timeline = sched.simulate(schedule, p, m)[1]
        x = f"bubble {bubble_rate(timeline):.1%} of the ideal time"
        titled[f"{schedule}: simulated, {span(timeline):.0f} slots, {x}"] = timeline
    path = Path("out/pipeline") / f"pipeline_zb1_simulated_p{p}_m{m}.png"
    xlabel = "time in units of one stage's forward (t_f = t_B = t_W = 1, messages free)"
    plot_timelines(titled, path, 1.0, xlabel)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(ranks=4)  # p: one stage each
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8], help="m")
    parser.add_argument("--plot", action="store_true", help="draw the Gantt charts")


def check(args, p: int) -> None:  # 8 blocks must fill p stages
    for m in args.microbatches:
        sched.check_config("zb1", p, m, n_layer=8)


def main(argv=None) -> None:
    distributed.run_on_ranks(demo, argv, __file__, __doc__, add_arguments, check)


if __name__ == "__main__":
    main()
