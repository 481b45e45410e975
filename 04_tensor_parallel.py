"""04_tensor_parallel.py: Megatron-style tensor parallelism (TP). Every matrix of every layer is
split over tp ranks; the ranks see the same batch and talk inside every layer.

The idea in one sentence: cut a layer's first matrix by columns and its second by rows, and each
rank computes its share with no communication in between; one all-reduce sums the shares.

The math (Megatron-LM, Shoeybi et al. 2019, arXiv 1909.08053, section 3), an MLP Z = GELU(X A) B:
    column split  A = [A1 | A2]:  Y = GELU(X [A1 | A2]) = [GELU(X A1) | GELU(X A2)] = [Y1 | Y2]
                  (GELU is elementwise, so each rank applies it to its own columns; a row split
                  of A would need a sum first: GELU(X1 A1 + X2 A2) != GELU(X1 A1) + GELU(X2 A2))
    row split     B = [B1 ; B2]:  Z = [Y1 | Y2] [B1 ; B2] = Y1 B1 + Y2 B2
Forward needs one all-reduce, the sum Z = sum_i Yi Bi (operator g); backward one more, because X
feeds every rank's X Ai, so dL/dX = sum_i (dL/dX through rank i) (operator f, g's conjugate).
Attention is the same with heads for columns: heads are independent, so a rank holds whole heads
(its slice of q, k and v in c_attn) and the output projection c_proj is row-parallel.

    operator    forward                   backward                  where
    f           identity                  all-reduce                before a column-parallel linear
    g           all-reduce                identity                  after a row-parallel linear
    g_sp        all-gather along T        reduce-scatter along T    f, with sequence parallelism
    g_bar_sp    reduce-scatter along T    all-gather along T        g, with sequence parallelism
    split_last  keep own chunk of dim -1  all-gather along dim -1   (tests)
    gather_last all-gather along dim -1   keep own chunk            full logits (tests, sampling)
(f and g are Megatron-LM's names; the sequence-parallel paper calls its pair g and g-bar.)

Who holds what at tp = 2 (rows of an nn.Linear weight are its output features):
    c_attn (3C x C)  [q heads 0..nh/2-1 | k same | v same]: rank 0, the other heads: rank 1
    c_fc (4C x C)    rows 0..2C-1: rank 0, rows 2C..4C-1: rank 1            column-parallel
    c_proj           the matching input columns, split the same way         row-parallel
    wte = lm_head    vocabulary rows [0, V/2): rank 0, [V/2, V): rank 1      vocab-parallel
    LayerNorms, wpe, c_proj biases: a full copy on every rank               replicated

    X (B,T,C) ─f─▶ X A_i (B,T,4C/tp) ─GELU─▶ Y_i ─▶ Y_i B_i (B,T,C), partial ─g─▶ Z (B,T,C)

The embedding looks up only the ids in the rank's vocabulary range (zeros elsewhere) and g sums
the lookups. The tied head reuses that shard, so a rank computes (B, T, V/tp) logits, and the
cross-entropy needs three all-reduces of (B, T) numbers (max, sum of exp, the target's logit):
the full (B, T, V) logits never exist anywhere.

Sequence parallelism (SP, Korthikanti et al. 2022, arXiv 2205.05198): between g and the next f
every rank repeats the same LayerNorm, dropout and residual add on the whole (B, T, C) and stores
it. An all-reduce is a reduce-scatter then an all-gather, so g becomes g_bar_sp (each rank gets
the complete sums of T/tp tokens), that work runs on (B, T/tp, C), and g_sp gathers the tokens
before the next column-parallel linear: the same bytes, tp x less memory there. Shapes: model.embed
returns (B, T/tp, C), each block maps (B, T/tp, C) -> (B, T/tp, C) (what a pipeline stage of 05
sends), model.head gathers to (B, T, V/tp) logits. T must be a multiple of tp.

Communication per layer per training step, per rank, E = B*T*C elements (ring algorithms):
    TP:      4 all-reduces of E (2 forward g, 2 backward f), each sending 2(tp-1)/tp * E
    TP + SP: 4 all-gathers + 4 reduce-scatters of E, each (tp-1)/tp * E: the same bytes
plus 2 more for the embedding and head, 3 all-reduces of B*T for the loss and, with SP, small
ones for replicated gradients. It sits on every layer's critical path: TP stays inside a node.

Randomness: the default generator is seeded alike on every TP rank, so dropout on replicated
activations draws the same mask everywhere (they are copies). Sharded regions (attention heads;
with SP, token shards) hold different data and need different masks: RNGStateTracker.fork().

For train.py: sharded parameters carry `param.tensor_parallel = True` (a global grad norm sums
their squares over the TP group and adds the replicated ones once: their gradients are identical
on every TP rank); consolidate_state_dict / merge_shards rebuild 02's full state dict.

Run it:  torchrun --standalone --nproc_per_node=2 04_tensor_parallel.py     (or 4; ~30 s on CPU)
It checks the sharded model against the whole one and prints parameter and activation memory per
rank, the bytes every collective moved next to the formula, and the time per step.

What changed from 03_ddp.py: DP copies the model and splits the batch, sending gradients once per
step; TP splits every matrix, keeps the whole batch and sends activations in every layer.

Left out on purpose: overlapping the backward all-reduce with the weight-gradient matmul; saving
only X/tp under SP and re-gathering it in backward (here the column-parallel linear saves the
gathered (B, T, C)); one coalesced all-reduce of SP LayerNorm gradients after backward (here f on
each parameter does it in the graph, which stays right under gradient accumulation and pipeline
schedules); activation recomputation; 2D tensor and context parallelism.
"""

import argparse
import contextlib
import copy
import functools
import importlib
import math
import os
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

model_lib = importlib.import_module("02_model")
ddp_lib = importlib.import_module("03_ddp")  # init_distributed, print0

SEQ_DIM = 1  # T in (B, T, C). Megatron keeps (T, B, C) so its gathers are contiguous; we keep 02's
TP_RNG = "tensor_parallel"  # the tracker's per-rank dropout stream

# --------------------------------------------------------------------------- raw collectives
_COMM_LOG = None  # while count_comm() runs: one (op, payload bytes) per collective call


@contextlib.contextmanager
def count_comm():
    """`with count_comm() as log: step()` records [(op, payload bytes)] of every collective."""
    global _COMM_LOG
    _COMM_LOG, outer = [], _COMM_LOG
    try:
        yield _COMM_LOG
    finally:
        _COMM_LOG = outer


def _log(op: str, tensor: torch.Tensor, copies: int = 1):
    if _COMM_LOG is not None:
        _COMM_LOG.append((op, tensor.numel() * tensor.element_size() * copies))


def _tp(group) -> int:
    return dist.get_world_size(group)


def _check_divisible(x: torch.Tensor, dim: int, tp: int):
    if x.size(dim) % tp:
        raise ValueError(
            f"dim {dim} of a {tuple(x.shape)} tensor is not divisible by tp={tp}: with sequence "
            f"parallelism T must be a multiple of tp (each rank holds T/tp tokens)"
        )


def _all_reduce(x, group, op=dist.ReduceOp.SUM):
    _log("all_reduce", x)  # payload S: a ring sends 2(tp-1)/tp * S per rank
    dist.all_reduce(x, op=op, group=group)
    return x


def _all_gather(x, group, dim):
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_tp(group))]
    _log("all_gather", x, len(parts))  # payload: the gathered S; (tp-1)/tp * S per rank
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x, group, dim):
    _check_divisible(x, dim, _tp(group))
    parts = [p.contiguous() for p in x.chunk(_tp(group), dim=dim)]
    out = torch.empty_like(parts[0])
    _log("reduce_scatter", x)  # payload: the input S; (tp-1)/tp * S per rank
    dist.reduce_scatter(out, parts, group=group)
    return out


def _split(x, group, dim):
    _check_divisible(x, dim, _tp(group))
    return x.chunk(_tp(group), dim=dim)[dist.get_rank(group)].contiguous()


# --------------------------------------------------------------------------- the operators
def _identity(x, group, dim):
    return x


def _sum(x, group, dim):
    # subtle: reduce a copy. A backward must never modify its incoming gradient in place: autograd
    # may share that tensor with other consumers (torch 2.13 happens to hand over a private one).
    return _all_reduce(x.clone(), group)


def _operator(name: str, forward, backward, dim, what: str):
    """One autograd.Function per collective: forward(x, group, dim), backward(grad, group, dim)."""

    def fwd(ctx, x, group):
        ctx.group = group
        return forward(x, group, dim)

    def bwd(ctx, grad):
        return backward(grad, ctx.group, dim), None

    doc = f"{name}: {what}."
    methods = dict(forward=staticmethod(fwd), backward=staticmethod(bwd), __doc__=doc)
    return type(name, (torch.autograd.Function,), methods).apply


# the lesson's table: name -> (forward, backward, dim, what it does); each is called as op(x, group)
# fmt: off
OPERATORS = {
    "f":           (_identity,       _sum,            None,    "identity fwd, all-reduce bwd"),
    "g":           (_sum,            _identity,       None,    "all-reduce fwd, identity bwd"),
    "g_sp":        (_all_gather,     _reduce_scatter, SEQ_DIM, "all-gather T, reduce-scatter bwd"),
    "g_bar_sp":    (_reduce_scatter, _all_gather,     SEQ_DIM, "reduce-scatter T, all-gather bwd"),
    "split_last":  (_split,          _all_gather,     -1,      "own chunk of dim -1, gather bwd"),
    "gather_last": (_all_gather,     _split,          -1,      "all-gather dim -1, own chunk bwd"),
}
# fmt: on
f, g, g_sp, g_bar_sp, split_last, gather_last = (_operator(n, *op) for n, op in OPERATORS.items())
gather_logits = gather_last  # (B, T, V/tp) logit shards -> full (B, T, V_padded) (tests, sampling)


# --------------------------------------------------------------------------- randomness
class RNGStateTracker:
    """Named RNG streams that dropout can borrow (Megatron's CudaRNGStatesTracker, smaller).

    `with tracker.fork():` swaps this rank's TP stream into the device's default generator and
    swaps it back out, advanced, afterwards: the default stream, identical on every TP rank, is
    not consumed."""

    def __init__(self, device):
        self.device, self.states = torch.device(device), {}

    def add(self, name: str, seed: int):
        self.states[name] = torch.Generator(device=self.device).manual_seed(seed).get_state()

    def _swap(self, state):
        """Install `state` in the device's default generator; return the state it replaces."""
        if self.device.type == "cuda":
            old = torch.cuda.get_rng_state(self.device)
            torch.cuda.set_rng_state(state, self.device)
        else:
            old = torch.get_rng_state()
            torch.set_rng_state(state)
        return old

    @contextlib.contextmanager
    def fork(self, name: str = TP_RNG):
        outside = self._swap(self.states[name])
        try:
            yield
        finally:
            self.states[name] = self._swap(outside)

    def state_dict(self) -> dict:  # for checkpoints, next to torch's own RNG state
        return {k: v.clone() for k, v in self.states.items()}

    def load_state_dict(self, states: dict):
        self.states = {k: v.clone() for k, v in states.items()}


class ParallelDropout(nn.Dropout):
    """Dropout on rank-specific data (a shard of heads or tokens): masks from the TP stream."""

    def __init__(self, p: float, rng: RNGStateTracker):
        super().__init__(p)
        self.rng = rng

    def forward(self, x):
        with self.rng.fork():
            return super().forward(x)


# --------------------------------------------------------------------------- slicing
# GPT module (name suffix) -> (dim, chunks) of its weight's split. Row-parallel (dim 1) biases are
# replicated. chunks=3: the fused [q|k|v] is cut per part, so a rank holds whole heads of each.
SHARDED = {"wte": (0, 1), "lm_head": (0, 1), "attn.c_attn": (0, 3), "mlp.c_fc": (0, 1),
           "attn.c_proj": (1, 1), "mlp.c_proj": (1, 1)}  # fmt: skip


def tp_layout(key: str):
    """(dim, chunks) along which a GPT state-dict entry is split, or None when replicated."""
    module, _, kind = key.rpartition(".")
    for suffix, (dim, chunks) in SHARDED.items():
        if module == suffix or module.endswith("." + suffix):
            return None if (dim == 1 and kind == "bias") else (dim, chunks)
    return None


def shard_tensor(t: torch.Tensor, dim: int, chunks: int, rank: int, tp: int) -> torch.Tensor:
    """Rank's slice of a full tensor: each of `chunks` equal parts along dim cut into tp pieces."""
    if t.size(dim) % (chunks * tp):
        raise ValueError(f"size {t.size(dim)} (dim {dim}) is not divisible by {chunks} x tp={tp}")
    return torch.cat([part.chunk(tp, dim)[rank] for part in t.chunk(chunks, dim)], dim).clone()


def merge_tensors(shards, dim: int, chunks: int) -> torch.Tensor:
    """Inverse of shard_tensor: the tp ranks' slices, in rank order -> the full tensor."""
    parts = [s.chunk(chunks, dim) for s in shards]  # tp x chunks
    return torch.cat([torch.cat([p[c] for p in parts], dim) for c in range(chunks)], dim)


def _shard_param(t, dim, chunks, group):
    """A new Parameter holding this rank's slice, marked as sharded (train.py's grad norm)."""
    p = nn.Parameter(shard_tensor(t.detach(), dim, chunks, dist.get_rank(group), _tp(group)))
    p.tensor_parallel = True
    return p


# --------------------------------------------------------------------------- the layers
class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i, built from a full nn.Linear: this rank's out/tp output features. Input
    (B, T, in), replicated, through f; with sequence parallelism (B, T/tp, in) through g_sp.
    Output (B, T, out/tp), or all-gathered (B, T, out) with gather_output=True."""

    def __init__(self, linear: nn.Linear, group, sequence_parallel=False, chunks=1):
        super().__init__()
        self.weight = _shard_param(linear.weight, 0, chunks, group)  # (out/tp, in)
        bias = linear.bias
        self.bias = None if bias is None else _shard_param(bias, 0, chunks, group)  # (out/tp,)
        self.group, self.sequence_parallel, self.gather_output = group, sequence_parallel, False

    def forward(self, x):  # (B, T, in) or (B, T/tp, in)
        x = g_sp(x, self.group) if self.sequence_parallel else f(x, self.group)  # (B, T, in)
        y = F.linear(x, self.weight, self.bias)  # (B, T, out/tp)
        return gather_last(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Z = sum_i Y_i B_i, built from a full nn.Linear: this rank's in/tp input features. Input
    (B, T, in/tp); output (B, T, out) through g, or (B, T/tp, out) through g_bar_sp. The bias is
    replicated and added once, after the sum."""

    def __init__(self, linear: nn.Linear, group, sequence_parallel=False):
        super().__init__()
        self.weight = _shard_param(linear.weight, 1, 1, group)  # (out, in/tp)
        bias = linear.bias  # (out,), replicated
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x):  # (B, T, in/tp)
        y = F.linear(x, self.weight)  # (B, T, out): this rank's partial sum Y_i B_i
        bias = self.bias
        if self.sequence_parallel:
            y = g_bar_sp(y, self.group)  # (B, T/tp, out)
            # subtle: this rank adds the bias to its T/tp tokens only, so its gradient is partial:
            # f sums it over the group (without this, replicated biases silently drift apart).
            bias = None if bias is None else f(bias, self.group)
        else:
            y = g(y, self.group)  # (B, T, out)
        return y if bias is None else y + bias


class VocabParallelEmbedding(nn.Module):
    """wte split by vocabulary: rank r holds ids [r V/tp, (r+1) V/tp). It looks up the ids it owns,
    writes zeros for the others, and g sums over ranks: (B, T) ids -> (B, T, C), or with
    sequence parallelism g_bar_sp -> (B, T/tp, C)."""

    def __init__(self, emb: nn.Embedding, group, sequence_parallel=False):
        super().__init__()
        self.weight = _shard_param(emb.weight, 0, 1, group)  # (V/tp, C)
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, idx):  # (B, T)
        if self.sequence_parallel:  # fail before the collective, on every rank alike
            _check_divisible(idx, SEQ_DIM, _tp(self.group))
        rows = self.weight.size(0)  # V/tp
        local = idx - dist.get_rank(self.group) * rows
        outside = (local < 0) | (local >= rows)  # ids another rank owns
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, C)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)  # zeros (and zero gradient) there
        return g_bar_sp(x, self.group) if self.sequence_parallel else g(x, self.group)


class SequenceParallelLayerNorm(nn.Module):
    """LayerNorm on this rank's (B, T/tp, C) tokens. Its weight and bias are replicated, but each
    rank's gradient covers only its own tokens: f sums them over the TP group (forgetting this is
    the classic sequence-parallel bug: the copies drift apart)."""

    def __init__(self, ln: nn.LayerNorm, group):
        super().__init__()
        self.weight, self.bias = ln.weight, ln.bias  # the same Parameters, the same keys
        self.shape, self.eps, self.group = ln.normalized_shape, ln.eps, group

    def forward(self, x):  # (B, T/tp, C)
        b = None if self.bias is None else f(self.bias, self.group)
        return F.layer_norm(x, self.shape, f(self.weight, self.group), b, self.eps)


class SequenceParallelPositionEmbedding(nn.Module):
    """wpe rows for this rank's T/tp positions; f sums the (T, C) gradient over the group."""

    def __init__(self, emb: nn.Embedding, group):
        super().__init__()
        self.weight, self.group = emb.weight, group  # the same Parameter

    def forward(self, pos):  # (T,)
        return _split(f(F.embedding(pos, self.weight), self.group), self.group, 0)  # (T/tp, C)


class ParallelSelfAttention(nn.Module):
    """02's CausalSelfAttention with nh/tp whole heads: column-parallel [q|k|v], row c_proj."""

    def __init__(self, attn, group, sequence_parallel, rng):
        super().__init__()
        self.c_attn = ColumnParallelLinear(attn.c_attn, group, sequence_parallel, chunks=3)
        self.c_proj = RowParallelLinear(attn.c_proj, group, sequence_parallel)
        sp_dropout = ParallelDropout(attn.resid_dropout.p, rng)  # token shards: own masks
        self.resid_dropout = sp_dropout if sequence_parallel else attn.resid_dropout
        self.head_dim, self.dropout, self.rng = attn.head_dim, attn.dropout, rng

    def forward(self, x):  # (B, T, C), or (B, T/tp, C) with sequence parallelism
        qkv = self.c_attn(x)  # (B, T, 3C/tp): [q | k | v] of this rank's heads
        B, T, _ = qkv.shape
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, -1))
        p = self.dropout if self.training else 0.0  # q, k, v: (B, nh/tp, T, hs)
        with self.rng.fork():  # this rank's heads: its own attention-dropout masks
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C/tp)
        return self.resid_dropout(self.c_proj(y))  # (B, T, C), or (B, T/tp, C)


# --------------------------------------------------------------------------- the loss
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over vocab shards: three (N,) all-reduces, never the full (N, V) logits."""

    @staticmethod
    def forward(ctx, logits, targets, group):  # (N, V/tp) this rank's columns, (N,) full ids
        x = logits.float()  # fp32 softmax even under bf16, as 02
        start, rows = dist.get_rank(group) * x.size(-1), x.size(-1)
        m = _all_reduce(x.max(dim=-1).values, group, dist.ReduceOp.MAX)  # 1: global max (N,)
        x = x - m.unsqueeze(-1)  # exp(x - m) <= 1: no overflow
        local = targets - start
        mine = (local >= 0) & (local < rows)  # this rank holds the target's column
        local = local.clamp(0, rows - 1)
        picked = x.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine
        target_logit = _all_reduce(picked, group)  # 2: x[target], from the rank that has it
        exp = x.exp_()  # (N, V/tp); in place, x is not needed any more
        sum_exp = _all_reduce(exp.sum(dim=-1), group)  # 3: the softmax denominator (N,)
        keep = targets != -1  # 02's ignore_index
        loss = torch.where(keep, sum_exp.log() - target_logit, 0.0)  # (N,) -log softmax[target]
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, mine & keep, keep)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):  # (N,)
        softmax, local, hit, keep = ctx.saved_tensors
        grad = softmax.clone()  # d loss_n / d logit_nv = softmax_nv - [v == target_n]
        grad.scatter_add_(-1, local.unsqueeze(-1), -hit.to(grad.dtype).unsqueeze(-1))
        grad *= (grad_loss * keep).unsqueeze(-1)  # no gradient leaves ignored positions
        return grad.to(ctx.dtype), None, None


def vocab_parallel_cross_entropy(logits, targets, reduction="mean", *, group):
    """02's loss, with (B, T, V/tp) logit shards: mean (or sum) of -log softmax[target] over the
    positions whose target is not -1. The same scalar on every rank of `group`."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    flat = logits.reshape(-1, logits.size(-1))  # (B*T, V/tp)
    losses = _VocabParallelCrossEntropy.apply(flat, targets.reshape(-1), group)  # (B*T,)
    return losses.sum() if reduction == "sum" else losses.sum() / (targets != -1).sum()


# --------------------------------------------------------------------------- the model
def check_tp_config(config, tp: int):
    """Every reason this GPTConfig cannot be split tp ways, in one ValueError (no collectives)."""
    C, V, problems = config.n_embd, config.padded_vocab_size, []
    if config.n_head % tp:
        problems.append(
            f"n_head={config.n_head} is not divisible by tp={tp}: a rank holds whole heads"
        )
    if V % tp:
        m = math.lcm(64, tp)
        problems.append(
            f"the vocabulary has {V} rows (vocab_size={config.vocab_size}, pad_vocab_multiple="
            f"{config.pad_vocab_multiple}), not divisible by tp={tp}: pad it with GPTConfig("
            f"pad_vocab_multiple={m}) -> {-(-config.vocab_size // m) * m} rows"
        )
    for what, size in (("attention width n_embd", C), ("MLP hidden size 4*n_embd", 4 * C)):
        if size % tp:
            problems.append(f"the {what}={size} is not divisible by tp={tp}")
    if problems:
        raise ValueError(f"cannot split this GPT over tp={tp} ranks: " + "; ".join(problems))


def _check_same_weights(model, group):
    """One tiny all-reduce: slicing is only right if every TP rank built the same model."""
    sums = torch.stack([p.detach().double().sum() for p in model.parameters()])
    both = _all_reduce(torch.cat([sums, -sums]), group, dist.ReduceOp.MAX)  # max, -min
    if not torch.equal(both[: len(sums)], -both[len(sums) :]):
        raise ValueError(
            "the model's weights differ across TP ranks: build it from the same seed on every "
            "rank (torch.manual_seed before GPT(config)), then call apply_tensor_parallel"
        )


def _parallelize_block(block, group, sp, rng):
    block.attn = ParallelSelfAttention(block.attn, group, sp, rng)
    block.mlp.c_fc = ColumnParallelLinear(block.mlp.c_fc, group, sp)  # (B, T, 4C/tp)
    block.mlp.c_proj = RowParallelLinear(block.mlp.c_proj, group, sp)
    if sp:  # these activations are token shards now
        block.mlp.dropout = ParallelDropout(block.mlp.dropout.p, rng)
        block.ln_1 = SequenceParallelLayerNorm(block.ln_1, group)
        block.ln_2 = SequenceParallelLayerNorm(block.ln_2, group)


def apply_tensor_parallel(model, group, sequence_parallel=False, seed=None):
    """Shard a 02_model.GPT over the TP `group` in place, by slicing its full weights; returns it.

    Build the model identically on every rank first (same seed). Afterwards model(idx, targets)
    returns (this rank's (B, T, V/tp) logits, the full mean loss, the same on every TP rank);
    gather_logits() gives the full logits. State-dict keys stay 02's. 05 may call model.embed,
    the blocks, model.head and model.loss_fn separately (shapes: the docstring at the top).
    `seed` (default: torch.initial_seed()) is the run's, the same on every rank. The per-rank
    dropout stream is seed + 1 + world_size + global rank: one per (stage, replica, TP rank), as
    the global rank is (pp_rank * dp + dp_rank) * tp + tp_rank. (Megatron's seed + 2718 +
    tp_rank on a seed offset per stage is a sum of ranks, which can collide.) Keep the default
    stream below seed + 1 + world_size (train.py: seed + 1 + pp_rank * dp + dp_rank), and no
    two streams share a seed."""
    if group is None:
        raise ValueError("pass the TP process group explicitly (dist.new_group(ranks))")
    if getattr(model, "tp_group", None) is not None:
        raise ValueError("this model is already tensor-parallel")
    check_tp_config(model.config, _tp(group))  # before any collective
    _check_same_weights(model, group)
    t, sp = model.transformer, sequence_parallel
    rng = RNGStateTracker(t.wte.weight.device)
    base = torch.initial_seed() if seed is None else seed
    rng.add(TP_RNG, (base + 1 + dist.get_world_size() + dist.get_rank()) % 2**63)  # one per rank
    tied = model.lm_head.weight is t.wte.weight
    t.wte = VocabParallelEmbedding(t.wte, group, sp)
    for block in t.h:
        _parallelize_block(block, group, sp, rng)
    lm_head = ColumnParallelLinear(model.lm_head, group, sp)  # (B, T, V/tp) logits
    if tied:
        lm_head.weight = t.wte.weight  # the tied head reuses the embedding's vocab shard
    model.lm_head = lm_head
    if sp:
        t.wpe = SequenceParallelPositionEmbedding(t.wpe, group)
        t.drop = ParallelDropout(t.drop.p, rng)
        t.ln_f = SequenceParallelLayerNorm(t.ln_f, group)
    model.loss_fn = functools.partial(vocab_parallel_cross_entropy, group=group)
    model.tp_group, model.tp_rng, model.sequence_parallel = group, rng, sp
    return model


def grad_norm_squared(params, group, device) -> torch.Tensor:
    """Squared L2 norm of the whole model's gradient, the same on every TP rank: the shards'
    squares summed over the group, the replicated parameters' (identical everywhere) once."""
    sharded, replicated = torch.zeros((), device=device), torch.zeros((), device=device)
    for p in params:
        if p.grad is not None and getattr(p, "tensor_parallel", False):
            sharded += p.grad.float().pow(2).sum()
        elif p.grad is not None:
            replicated += p.grad.float().pow(2).sum()
    return _all_reduce(sharded, group) + replicated


def merge_shards(state_dicts) -> dict:
    """Export: the TP ranks' state dicts, in tp_rank order -> 02's full state dict."""
    full = {}
    for k, v in state_dicts[0].items():
        layout = tp_layout(k)
        full[k] = merge_tensors([sd[k] for sd in state_dicts], *layout) if layout else v
    return full


def consolidate_state_dict(model, group) -> dict:
    """The full state dict of a TP model on every rank (gathers every rank's state dict on the
    CPU: simple, not fast); loads into 02's GPT(config) with strict=True."""
    mine = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    state_dicts = [None] * _tp(group)
    dist.all_gather_object(state_dicts, mine, group=group)
    return merge_shards(state_dicts)


# --------------------------------------------------------------------------- measuring
def comm_formula(config, B: int, T: int, sp: bool) -> dict:
    """Payload bytes per fwd+bwd step, by collective (fp32), from the lesson's counting."""
    C, L, b = config.n_embd, config.n_layer, int(config.bias)
    E, loss = 4 * B * T * C, 3 * 4 * B * T  # the loss: max, sum of exp, target logit
    if not sp:  # embedding g, per layer 2 g + 2 f, head f
        return {"all_reduce": (4 * L + 2) * E + loss}
    # f on replicated gradients: wpe (T, C); per layer 2 LayerNorms (+ biases), 2 row biases; ln_f
    params = 4 * (T * C + L * (2 * C + b * 4 * C) + (1 + b) * C)
    return dict(
        all_gather=(4 * L + 2) * E, reduce_scatter=(4 * L + 2) * E, all_reduce=loss + params
    )


def saved_activation_bytes(fn, params):
    """Run fn(); return (bytes of the tensors autograd saved for backward, parameters excluded,
    each storage once; fn's result)."""
    skip, seen = {p.untyped_storage().data_ptr() for p in params}, {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


# --------------------------------------------------------------------------- the demo
@dataclass
class DemoConfig:
    n_layer: int = 4  # deep enough that the per-layer traffic dominates embedding and loss
    n_head: int = 8  # divisible by tp = 1, 2, 4, 8
    n_embd: int = 128
    block_size: int = 128  # T; a multiple of tp for sequence parallelism
    batch_size: int = 8
    steps: int = 5  # timed steps per variant, after one warm-up step
    seed: int = 1337


def _batch(cfg, device):
    """(B, T) windows of this file's own bytes, the same on every rank."""
    data = torch.tensor(list(Path(__file__).read_bytes()), dtype=torch.long)
    gen = torch.Generator().manual_seed(cfg.seed)
    starts = torch.randint(len(data) - cfg.block_size - 1, (cfg.batch_size,), generator=gen)
    rows = torch.stack([data[s : s + cfg.block_size + 1] for s in starts.tolist()])
    return rows[:, :-1].to(device), rows[:, 1:].to(device)


def _step(model, x, y):
    """One forward + backward; returns (logits, loss)."""
    model.zero_grad(set_to_none=True)
    logits, loss = model(x, y)
    loss.backward()
    return logits, loss


def _ms_per_step(model, x, y, steps):
    _step(model, x, y)  # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        _step(model, x, y)
    return (time.perf_counter() - t0) / steps * 1e3


def check_against_full(full, tp_model, x, y, group):
    """Max |difference| (over all ranks) of logits, loss and every gradient vs the full model."""
    logits_full, loss_full = _step(full, x, y)
    logits, loss = _step(tp_model, x, y)
    grads, d_grad = dict(full.named_parameters()), torch.zeros((), device=x.device)
    for name, p in tp_model.named_parameters():
        expect, layout = grads[name].grad, tp_layout(name)
        if layout is not None:
            expect = shard_tensor(expect, *layout, dist.get_rank(group), _tp(group))
        d_grad = torch.maximum(d_grad, (p.grad - expect).abs().max())
    d_logits = (gather_logits(logits.detach(), group) - logits_full).abs().max()
    diffs = torch.stack([d_logits, (loss - loss_full).abs().detach(), d_grad])
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX, group=group)
    return diffs.tolist()


def demo(cfg: DemoConfig, group, device):
    tp, print0, MB = _tp(group), ddp_lib.print0, 2**20
    config = model_lib.GPTConfig(
        n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size,
        vocab_size=256, pad_vocab_multiple=math.lcm(64, tp), dropout=0.0,
    )  # fmt: skip
    check_tp_config(config, tp)  # every rank raises the same error before any collective
    torch.manual_seed(cfg.seed)
    full, (x, y) = model_lib.GPT(config).to(device), _batch(cfg, device)
    p_full = sum(p.numel() * p.element_size() for p in full.parameters())
    act_full, _ = saved_activation_bytes(lambda: full(x, y), full.parameters())
    ms_full = _ms_per_step(full, x, y, cfg.steps) if dist.get_rank(group) == 0 else 0.0
    dist.barrier(group)  # the others wait while rank 0 times the whole model alone
    c = config
    print0(f"GPT L={c.n_layer} nh={c.n_head} C={c.n_embd} V={c.padded_vocab_size}"
           f", batch (B, T) = {tuple(x.shape)}, fp32, {dist.get_backend(group)} on {device.type}\n"
           f"tp=1, one process, the whole model: parameters {p_full / MB:.3f} MB, activations "
           f"(saved for backward) {act_full / MB:.2f} MB, {ms_full:.1f} ms per step "
           "(fwd+bwd)")  # fmt: skip
    for sp in (False, True):
        model = apply_tensor_parallel(copy.deepcopy(full), group, sequence_parallel=sp)
        diffs = check_against_full(full, model, x, y, group)
        # logits, loss and gradients are all O(1) or smaller here; fp32 sums split across ranks
        # round differently, ~1e-7 relative per term: 1e-4 is far above that, far below a bug
        assert max(diffs) < 1e-4, f"TP differs from the unsharded model: {diffs}"
        p = sum(q.numel() * q.element_size() for q in model.parameters())
        act, _ = saved_activation_bytes(lambda m=model: m(x, y), model.parameters())
        with count_comm() as log:
            _step(model, x, y)
        ms = _ms_per_step(model, x, y, cfg.steps)
        print0(f"\ntp={tp}{' + sequence parallel' if sp else ''}: equals the unsharded model, max "
               f"|diff| logits {diffs[0]:.1e}, loss {diffs[1]:.1e}, every gradient {diffs[2]:.1e}\n"
               f"  per rank: parameters {p / MB:.3f} MB ({p / p_full:.0%} of the whole; 1/tp = "
               f"{1 / tp:.0%}), activations {act / MB:.2f} MB ({act / act_full:.0%}), {ms:.1f} ms "
               f"per step")  # fmt: skip
        for op, formula in comm_formula(config, *x.shape, sp).items():
            sizes = [n for o, n in log if o == op]
            ring = (2 if op == "all_reduce" else 1) * (tp - 1) / tp * sum(sizes)
            print0(f"  {op:<15}{len(sizes):>3} calls, payload {sum(sizes) / MB:7.3f} MB (formula "
                   f"{formula / MB:7.3f} MB), sent per rank by a ring {ring / MB:7.3f} MB"
                   )  # fmt: skip
    print0("\nring: an all-reduce sends 2(tp-1)/tp x payload per rank, all-gather/reduce-scatter "
           f"(tp-1)/tp.\n{tp} ranks share this machine's cores over gloo: the times show the "
           "cost of the communication, not a speed-up (that needs one GPU per rank on NVLink)."
           )  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for fld in fields(DemoConfig):
        parser.add_argument("--" + fld.name.replace("_", "-"), type=int, default=fld.default)
    cfg = DemoConfig(**vars(parser.parse_args()))
    if "WORLD_SIZE" not in os.environ:
        print("Tensor parallelism needs several processes. Launch it with torchrun:\n"
              "    torchrun --standalone --nproc_per_node=2 04_tensor_parallel.py   (or 4)"
              )  # fmt: skip
        return
    _, _, world_size, device = ddp_lib.init_distributed()
    try:
        group = dist.new_group(list(range(world_size)))  # here the TP group is the whole world
        demo(cfg, group, device)
        dist.barrier()  # subtle: no rank tears gloo down while a peer still uses it
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
