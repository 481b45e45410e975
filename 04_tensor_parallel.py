"""04_tensor_parallel.py: Megatron-style tensor parallelism (TP), every matrix split over tp ranks.

The idea in one sentence: cut a layer's first matrix by columns and its second by rows, and each
rank computes its share with no communication in between; one all-reduce sums the shares. The
ranks see the same batch and talk inside every layer.

The math (Megatron-LM, Shoeybi et al. 2019, arXiv 1909.08053, section 3), an MLP Z = GELU(X A) B:
    column split  A = [A1 | A2]:  Y = GELU(X [A1 | A2]) = [GELU(X A1) | GELU(X A2)] = [Y1 | Y2]
                  (GELU is elementwise, so each rank applies it to its own columns; a row split
                  of A would need a sum first: GELU(X1 A1 + X2 A2) != GELU(X1 A1) + GELU(X2 A2))
    row split     B = [B1 ; B2]:  Z = [Y1 | Y2] [B1 ; B2] = Y1 B1 + Y2 B2
Forward needs one all-reduce, the sum Z = sum_i Yi Bi (operator g); backward one more, because X
feeds every rank's X Ai, so dL/dX = sum_i (dL/dX through rank i) (operator f, g's conjugate).
Attention is the same with heads for columns: a rank holds whole heads (its slice of q, k and v
in c_attn), and c_proj is row-parallel. The embedding and the tied head are split by vocabulary:
a rank computes (B, T, V/tp) logits and the loss needs three all-reduces of (B, T) numbers:
the full (B, T, V) logits never exist (gather_logits builds them for tests and sampling).

    operator (the paper's name)              forward               backward              stands
    CopyToTensorParallel (f)                 identity              all-reduce            entering
    ReduceFromTensorParallel (g)             all-reduce            identity              leaving
    GatherFromSequenceParallel (SP's g)      all-gather along T    reduce-scatter on T   where f was
    ReduceScatterToSequenceParallel (g-bar)  reduce-scatter on T   all-gather along T    where g was
(Named after Megatron's _CopyToModelParallelRegion and kin; SP's paper calls f's successor g.)

Who holds what at tp = 2 (rows of an nn.Linear weight are its output features):
    c_attn (3C x C)  [q heads 0..nh/2-1 | k same | v same]: rank 0, the other heads: rank 1
    c_fc (4C x C)    rows 0..2C-1: rank 0, rows 2C..4C-1: rank 1            column-parallel
    c_proj           the matching input columns, split the same way         row-parallel
    wte = lm_head    vocabulary rows [0, V/2): rank 0, [V/2, V): rank 1      vocab-parallel
    LayerNorms, wpe, c_proj biases: a full copy on every rank               replicated

    X (B,T,C) ─f─▶ X A_i (B,T,4C/tp) ─GELU─▶ Y_i ─▶ Y_i B_i (B,T,C), partial ─g─▶ Z (B,T,C)

Sequence parallelism (SP, Korthikanti et al. 2022, arXiv 2205.05198): between g and the next f
every rank repeats the same LayerNorm, dropout and residual add on the whole (B, T, C) and stores
it. An all-reduce is a reduce-scatter then an all-gather, so g becomes a reduce-scatter along T
(each rank gets the complete sums of T/tp tokens), that work runs on (B, T/tp, C), and f becomes
an all-gather of the tokens before the next column-parallel linear: the same bytes, tp x less
memory there. Blocks then map (B, T/tp, C) -> (B, T/tp, C); T must be a multiple of tp.

Communication per layer per training step, per rank, E = B*T*C elements (ring algorithms):
    TP:      4 all-reduces of E (2 forward g, 2 backward f), each sending 2(tp-1)/tp * E
    TP + SP: 4 all-gathers + 4 reduce-scatters of E, each (tp-1)/tp * E: the same bytes
plus 2 more for the embedding and head, 3 all-reduces of B*T for the loss and, with SP, small
ones for replicated gradients. It sits on every layer's critical path: TP stays inside a node.

Run it:  python 04_tensor_parallel.py [--ranks N]      (starts torchrun with N = 2 ranks, or 4)
    or:  torchrun --standalone --nproc_per_node=2 04_tensor_parallel.py
It checks the sharded model, with and without SP, against the whole one and prints parameter
memory per rank. bench/bench_tensor_parallel.py counts every collective's bytes against the
formula above, and measures activation memory per rank and the time per step.

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
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

model_lib = importlib.import_module("02_model")
ddp_lib = importlib.import_module("03_ddp")  # init_distributed, print0, relaunch_with_torchrun

SEQ_DIM = 1  # T in (B, T, C). Megatron keeps (T, B, C) so its gathers are contiguous; we keep 02's
TP_RNG = "tensor_parallel"  # the tracker's per-rank dropout stream


# --------------------------------------------------------------------------- raw collectives
def _chunks(x: torch.Tensor, group, dim: int):  # x cut into tp equal chunks along dim
    tp = dist.get_world_size(group)
    if x.size(dim) % tp:
        raise ValueError(
            f"dim {dim} of a {tuple(x.shape)} tensor is not divisible by tp={tp}: with sequence "
            f"parallelism T must be a multiple of tp (each rank holds T/tp tokens)"
        )
    return x.chunk(tp, dim=dim)


def _all_reduce(x, group, op=dist.ReduceOp.SUM):
    dist.all_reduce(x, op=op, group=group)  # in place; a ring sends 2(tp-1)/tp of x per rank
    return x


def _all_gather(x, group, dim):  # every rank's x, concatenated along dim in rank order
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)  # (tp-1)/tp of the result sent per rank
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x, group, dim):  # the sum of every rank's x; this rank keeps its chunk
    parts = [p.contiguous() for p in _chunks(x, group, dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)  # (tp-1)/tp of x sent per rank
    return out


# --------------------------------------------------------------------------- the operators
# One autograd.Function per collective: the backward is the forward's conjugate.
class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward (entering the TP region)."""

    @staticmethod
    def forward(ctx, x, group):  # (B, T, C), the same on every rank
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):  # this rank's share of dL/dX -> the sum over ranks
        # subtle: reduce a copy. A backward must never modify its incoming gradient in place:
        # autograd may share that tensor with other consumers (torch 2.13 hands over a private one)
        return _all_reduce(grad.clone(), ctx.group), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward (leaving the TP region)."""

    @staticmethod
    def forward(ctx, x, group):  # (B, T, C): this rank's partial sum Y_i B_i
        return _all_reduce(x.clone(), group)  # a copy: x is the caller's tensor

    @staticmethod
    def backward(ctx, grad):  # every term of a sum gets the sum's gradient
        return grad, None


class GatherFromSequenceParallel(torch.autograd.Function):
    """SP's g, where f stood: all-gather along T forward, reduce-scatter along T backward."""

    @staticmethod
    def forward(ctx, x, group):  # (B, T/tp, C): this rank's tokens -> (B, T, C)
        ctx.group = group
        return _all_gather(x, group, SEQ_DIM)

    @staticmethod
    def backward(ctx, grad):  # (B, T, C), this rank's share -> (B, T/tp, C), summed
        return _reduce_scatter(grad, ctx.group, SEQ_DIM), None


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """SP's g-bar, where g stood: reduce-scatter along T forward, all-gather along T backward."""

    @staticmethod
    def forward(ctx, x, group):  # (B, T, C) partial sums -> (B, T/tp, C) complete, own tokens
        ctx.group = group
        return _reduce_scatter(x, group, SEQ_DIM)

    @staticmethod
    def backward(ctx, grad):  # (B, T/tp, C) -> (B, T, C)
        return _all_gather(grad, ctx.group, SEQ_DIM), None


def gather_logits(logits, group):
    """(B, T, V/tp) logit shards -> the full (B, T, V_padded) logits, outside autograd (tests, sampling:
    training never needs them, the loss works on the shards)."""
    return _all_gather(logits.detach(), group, -1)


# --------------------------------------------------------------------------- randomness
class RNGStateTracker:
    """Named RNG streams that dropout can borrow (Megatron's CudaRNGStatesTracker, smaller).
    The default stream is alike on every TP rank, so dropout on replicated activations (copies)
    draws the same mask everywhere. Sharded regions (heads; with SP, token shards) need their own
    masks: `with tracker.fork():` swaps this rank's stream into the device's default generator
    and back out, advanced, afterwards; the default stream is not consumed."""

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
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    p = nn.Parameter(shard_tensor(t.detach(), dim, chunks, rank, tp))
    p.tensor_parallel = True
    return p


# --------------------------------------------------------------------------- the layers
class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i, built from a full nn.Linear: this rank's out/tp output features. Input
    (B, T, in), replicated, through f, or with sequence parallelism (B, T/tp, in), all-gathered
    along T. Output (B, T, out/tp)."""

    def __init__(self, linear: nn.Linear, group, sequence_parallel=False, chunks=1):
        super().__init__()
        self.weight = _shard_param(linear.weight, 0, chunks, group)  # (out/tp, in)
        bias = linear.bias
        self.bias = None if bias is None else _shard_param(bias, 0, chunks, group)  # (out/tp,)
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x):  # (B, T, in) or (B, T/tp, in)
        if self.sequence_parallel:  # SP's g, where f stood
            x = GatherFromSequenceParallel.apply(x, self.group)  # (B, T, in)
        else:
            x = CopyToTensorParallel.apply(x, self.group)  # f
        return F.linear(x, self.weight, self.bias)  # (B, T, out/tp)


class RowParallelLinear(nn.Module):
    """Z = sum_i Y_i B_i, built from a full nn.Linear: this rank's in/tp input features. Input
    (B, T, in/tp); output (B, T, out) through g, or (B, T/tp, out) reduce-scattered along T.
    The bias is replicated and added once, after the sum."""

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
            y = ReduceScatterToSequenceParallel.apply(y, self.group)  # (B, T/tp, out), g-bar
            # subtle: this rank adds the bias to its T/tp tokens only, so its gradient is partial:
            # f sums it over the group (without this, replicated biases silently drift apart).
            bias = None if bias is None else CopyToTensorParallel.apply(bias, self.group)
        else:
            y = ReduceFromTensorParallel.apply(y, self.group)  # (B, T, out), g
        return y if bias is None else y + bias


class VocabParallelEmbedding(nn.Module):
    """wte split by vocabulary: rank r holds ids [r V/tp, (r+1) V/tp). It looks up the ids it owns,
    writes zeros for the others, and g sums over ranks: (B, T) ids -> (B, T, C), or with
    sequence parallelism a reduce-scatter along T (g-bar) -> (B, T/tp, C)."""

    def __init__(self, emb: nn.Embedding, group, sequence_parallel=False):
        super().__init__()
        self.weight = _shard_param(emb.weight, 0, 1, group)  # (V/tp, C)
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, idx):  # (B, T)
        if self.sequence_parallel:  # T % tp: fail before any collective, on every rank alike
            _chunks(idx, self.group, SEQ_DIM)
        rows = self.weight.size(0)  # V/tp
        local = idx - dist.get_rank(self.group) * rows
        outside = (local < 0) | (local >= rows)  # ids another rank owns
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, C)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)  # zeros (and zero gradient) there
        if self.sequence_parallel:
            return ReduceScatterToSequenceParallel.apply(x, self.group)  # (B, T/tp, C)
        return ReduceFromTensorParallel.apply(x, self.group)  # (B, T, C)


class SequenceParallelLayerNorm(nn.Module):
    """LayerNorm on this rank's (B, T/tp, C) tokens. Its weight and bias are replicated, but each
    rank's gradient covers only its own tokens: f sums them over the TP group (forgetting this is
    the classic sequence-parallel bug: the copies drift apart)."""

    def __init__(self, ln: nn.LayerNorm, group):
        super().__init__()
        self.weight, self.bias = ln.weight, ln.bias  # the same Parameters, the same keys
        self.shape, self.eps, self.group = ln.normalized_shape, ln.eps, group

    def forward(self, x):  # (B, T/tp, C)
        w = CopyToTensorParallel.apply(self.weight, self.group)  # f: dw summed over ranks
        b = None if self.bias is None else CopyToTensorParallel.apply(self.bias, self.group)
        return F.layer_norm(x, self.shape, w, b, self.eps)


class SequenceParallelPositionEmbedding(nn.Module):
    """wpe rows for this rank's T/tp positions; f sums the (T, C) gradient over the group."""

    def __init__(self, emb: nn.Embedding, group):
        super().__init__()
        self.weight, self.group = emb.weight, group  # the same Parameter

    def forward(self, pos):  # (T,)
        pos_emb = CopyToTensorParallel.apply(F.embedding(pos, self.weight), self.group)  # (T, C)
        return _chunks(pos_emb, self.group, 0)[dist.get_rank(self.group)]  # (T/tp, C)


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
    """Every reason this GPTConfig cannot be split tp ways, in one ValueError (no collectives).
    n_head % tp == 0 is enough for the widths: C = nh * hs and 4C then split evenly too."""
    V, m, problems = config.padded_vocab_size, math.lcm(64, tp), []
    if config.n_head % tp:
        problems.append(
            f"n_head={config.n_head} is not divisible by tp={tp}: a rank holds whole heads"
        )
    if V % tp:
        problems.append(
            f"the vocabulary has {V} rows (vocab_size={config.vocab_size}, pad_vocab_multiple="
            f"{config.pad_vocab_multiple}), not divisible by tp={tp}: pad it with GPTConfig("
            f"pad_vocab_multiple={m}) -> {-(-config.vocab_size // m) * m} rows"
        )
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

    Build the model identically on every rank first (same seed). Then model(idx, targets) returns
    (this rank's (B, T, V/tp) logits, the full mean loss, alike on every TP rank); state-dict keys
    stay 02's; 05 may call model.embed, the blocks, model.head and model.loss_fn apart. The
    per-rank dropout stream's seed is seed (the run's; default torch.initial_seed()) + 1 +
    world_size + global rank: one per (stage, replica, TP rank), never a sum of ranks that could
    collide (as Megatron's seed + 2718 + tp_rank, offset per stage). Keep the default stream below
    seed + 1 + world_size (train.py: seed + 1 + pp_rank * dp + dp_rank)."""
    if group is None:
        raise ValueError("pass the TP process group explicitly (dist.new_group(ranks))")
    if getattr(model, "tp_group", None) is not None:
        raise ValueError("this model is already tensor-parallel")
    check_tp_config(model.config, dist.get_world_size(group))  # before any collective
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


# --------------------------------------------------------------------------- the demo
def check_against_full(full, tp_model, x, y, group) -> list[float]:
    """Max |difference| (over all ranks) of logits, loss and every gradient vs the full model."""
    full.zero_grad(set_to_none=True)  # one full model checks every variant
    (logits_full, loss_full), (logits, loss) = full(x, y), tp_model(x, y)
    loss_full.backward()
    loss.backward()
    grads, d_grad = dict(full.named_parameters()), torch.zeros((), device=x.device)
    for name, p in tp_model.named_parameters():
        expect, layout = grads[name].grad, tp_layout(name)
        if layout is not None:
            expect = shard_tensor(expect, *layout, dist.get_rank(group), dist.get_world_size(group))
        d_grad = torch.maximum(d_grad, (p.grad - expect).abs().max())
    d_logits = (gather_logits(logits.detach(), group) - logits_full).abs().max()
    diffs = torch.stack([d_logits, (loss - loss_full).abs().detach(), d_grad])
    return _all_reduce(diffs, group, dist.ReduceOp.MAX).tolist()


def demo(args, config, group, device):
    tp, print0, MB = dist.get_world_size(group), ddp_lib.print0, 2**20
    torch.manual_seed(args.seed)  # the same whole model on every rank, sliced afterwards
    full = model_lib.GPT(config).to(device)
    B, T = args.batch_size, config.block_size
    [(x, y)] = model_lib.byte_batches(T, B, seed=args.seed, device=device)  # same on every rank
    p_full = sum(p.numel() * p.element_size() for p in full.parameters())
    print0(
        f"GPT '{args.preset}' L={config.n_layer} nh={config.n_head} C={config.n_embd} "
        f"V={config.padded_vocab_size}, (B, T) = ({B}, {T}), fp32, {dist.get_backend(group)} "
        f"on {device.type}; the whole model's parameters: {p_full / MB:.3f} MB"
    )
    for sp in (False, True):
        model = apply_tensor_parallel(copy.deepcopy(full), group, sequence_parallel=sp)
        diffs = check_against_full(full, model, x, y, group)
        # logits, loss and gradients are all O(1) or smaller here; fp32 sums split across ranks
        # round differently, ~1e-7 relative per term: 1e-4 is far above that, far below a bug
        assert max(diffs) < 1e-4, f"TP differs from the unsharded model: {diffs}"
        p = sum(q.numel() * q.element_size() for q in model.parameters())
        print0(
            f"tp={tp}{' + sequence parallel' if sp else ''} equals the unsharded model: max "
            f"|diff| logits {diffs[0]:.1e}, loss {diffs[1]:.1e}, any gradient {diffs[2]:.1e}"
            f"\n  parameters per rank {p / MB:.3f} MB, {p / p_full:.1%} of the whole (1/tp = "
            f"{1 / tp:.1%}; LayerNorms, wpe and row biases are replicated)"
        )
    print0("bytes per collective, activations and time per step: bench/bench_tensor_parallel.py")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2, help="tp, started without torchrun")
    parser.add_argument("--preset", default="small", help="02's preset; small: 4 heads, tp 2 or 4")
    parser.add_argument("--batch-size", type=int, default=8, help="B; reaches every gradient")
    parser.add_argument("--seed", type=int, default=1337, help="model and batch, alike on ranks")
    args = parser.parse_args(argv)
    tp = int(os.environ.get("WORLD_SIZE", args.ranks))
    try:  # bytes as tokens: 256 rows, padded to a multiple of 64 and of tp
        config = model_lib.GPTConfig.from_preset(
            args.preset, vocab_size=256, pad_vocab_multiple=math.lcm(64, tp), dropout=0.0
        )
        check_tp_config(config, tp)  # a bad --ranks fails here, before any process starts
    except ValueError as e:
        parser.error(str(e))
    if "WORLD_SIZE" not in os.environ:
        return ddp_lib.relaunch_with_torchrun(args.ranks, argv, __file__)
    _, _, world_size, device = ddp_lib.init_distributed()
    try:
        group = dist.new_group(list(range(world_size)))  # here the TP group is the whole world
        demo(args, config, group, device)
        dist.barrier()  # subtle: no rank tears gloo down while a peer still uses it
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
