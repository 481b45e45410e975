"""04_tensor_parallel.py: Megatron-style tensor parallelism (TP), every matrix split over tp ranks.

The idea in one sentence: cut a layer's first matrix by columns and its second by rows, and each
rank computes its share with no communication in between; one all-reduce sums the shares.

The math (Megatron-LM, Shoeybi et al. 2019, arXiv 1909.08053, section 3), an MLP Z = GELU(X A) B:
    column split  A = [A1 | A2]:  Y = GELU(X [A1 | A2]) = [GELU(X A1) | GELU(X A2)] = [Y1 | Y2]
                  as GELU is elementwise (a row split would need GELU(X1 A1 + X2 A2) first)
    row split     B = [B1 ; B2]:  Z = [Y1 | Y2] [B1 ; B2] = Y1 B1 + Y2 B2
Forward: one all-reduce, Z = sum_i Yi Bi (operator g). Backward: one more, as X feeds every
rank's X Ai, so dL/dX sums over ranks (operator f, g's conjugate). Attention splits by heads, the
embedding and tied head by vocabulary: the loss takes three all-reduces of (B, T), never (B, T, V).

    operator (the papers' name)              forward               backward              stands
    CopyToTensorParallel (f)                 identity              all-reduce            entering
    ReduceFromTensorParallel (g)             all-reduce            identity              leaving
    GatherFromSequenceParallel (SP's g)      all-gather along T    reduce-scatter on T   where f was
    ReduceScatterToSequenceParallel (g-bar)  reduce-scatter on T   all-gather along T    where g was

Who holds what at tp = 2 (rows of an nn.Linear weight are its output features):
    c_attn (3C x C)  [q heads 0..nh/2-1 | k same | v same]: rank 0, the other heads: rank 1
    c_fc (4C x C)    rows 0..2C-1: rank 0, rows 2C..4C-1: rank 1            column-parallel
    c_proj           the matching input columns, split the same way         row-parallel
    wte = lm_head    vocabulary rows [0, V/2): rank 0, [V/2, V): rank 1      vocab-parallel
    LayerNorms, wpe, c_proj biases: a full copy on every rank               replicated
    MLP: X (B,T,C) ─f─▶ X A_i (B,T,4C/tp) ─GELU─▶ Y_i ─▶ Y_i B_i (B,T,C), partial ─g─▶ Z (B,T,C)

Sequence parallelism (SP, Korthikanti et al. 2022, arXiv 2205.05198): between g and the next f
every rank repeats the same LayerNorm, dropout and residual add on all of (B, T, C). An all-reduce
is a reduce-scatter then an all-gather, so g becomes a reduce-scatter along T, f an all-gather: the
SP paper names them "ḡ" and "g" (the table's g-bar and SP's g). That work runs on (B, T/tp, C): the
same bytes, tp x less memory there. tp must divide T.

Communication per layer and step, E = B*T*C: 4 all-reduces of E (2 forward g, 2 backward f), a
ring sending 2(tp-1)/tp * E each; with SP 4 all-gathers + 4 reduce-scatters, (tp-1)/tp * E each:
the same bytes. Per step also 2 of E for the embedding (g) and head (f), 3 all-reduces of B*T for
the loss, with SP small ones for replicated gradients. All on the critical path: TP stays in a node.

Run it:  python 04_tensor_parallel.py [--ranks 4]   (relaunches itself under torchrun; 2 ranks)
    or:  torchrun --standalone --nproc_per_node=2 04_tensor_parallel.py
It checks the sharded model, with and without SP, against the whole one; bench/ measures costs.

What changed from 03_ddp.py: DP copies the model and splits the batch, sending gradients once per
step; TP splits every matrix, keeps the whole batch and sends activations in every layer.

Left out on purpose: overlapping the backward all-reduce with the weight-gradient matmul; saving
only X/tp under SP; one coalesced all-reduce of SP's gradients; 2D tensor, context parallelism.
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

from support import distributed

model_lib = importlib.import_module("02_model")

SEQ_DIM = 1  # T in (B, T, C). Megatron keeps (T, B, C) so its gathers are contiguous; we keep 02's
TP_RNG = "tensor_parallel"  # the per-rank dropout stream's name in checkpoints


# --------------------------------------------------------------------------- raw collectives
def _chunks(x: torch.Tensor, group, dim: int):  # x cut into tp equal chunks along dim
    if x.size(dim) % (tp := dist.get_world_size(group)):
        raise ValueError(f"dim {dim} of {tuple(x.shape)}: with SP T must be a multiple of tp={tp}")
    return x.chunk(tp, dim=dim)


def _all_reduce(x, group, op=dist.ReduceOp.SUM):
    dist.all_reduce(x, op=op, group=group)  # in place; a ring sends 2(tp-1)/tp of x per rank
    return x


def _all_gather(x, group, dim):  # every rank's x, concatenated along dim in rank order
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)  # (tp-1)/tp of the result sent per rank
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x, group, dim):  # the sum of every rank's x; this rank keeps its chunk
    parts = [p.contiguous() for p in _chunks(x, group, dim)]  # tp-1 of them sent per rank
    dist.reduce_scatter(out := torch.empty_like(parts[0]), parts, group=group)
    return out


# ------------------ the operators: one autograd.Function per collective, its backward the conjugate
class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward (entering the TP region)."""

    @staticmethod
    def forward(ctx, x, group):  # (B, T, C), the same on every rank
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):  # this rank's share of dL/dX -> the sum over ranks
        # subtle: reduce a copy: autograd may share the incoming gradient with other consumers
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
    """(B, T, V/tp) logit shards -> the full (B, T, V_padded), outside autograd (for sampling)."""
    return _all_gather(logits.detach(), group, -1)


# --------------------------------------------------------------------------- randomness
class RNGStateTracker:
    """This rank's own dropout stream (Megatron's CudaRNGStatesTracker, one stream). The default
    stream is alike on every TP rank: copies get the same mask. Shards (heads; with SP, tokens) need
    their own: `with tracker.fork():` swaps it into the default generator and back, advanced."""

    def __init__(self, device, seed: int):
        self.device = torch.device(device)
        self.state = torch.Generator(device=self.device).manual_seed(seed).get_state()

    def _swap(self, state):  # install `state` in the device's default generator; return the old
        if self.device.type == "cuda":
            old = torch.cuda.get_rng_state(self.device)
            torch.cuda.set_rng_state(state, self.device)
        else:
            old = torch.get_rng_state()
            torch.set_rng_state(state)
        return old

    @contextlib.contextmanager
    def fork(self):
        outside = self._swap(self.state)
        try:
            yield
        finally:
            self.state = self._swap(outside)

    def state_dict(self) -> dict:  # for checkpoints, next to torch's own RNG state
        return {TP_RNG: self.state.clone()}

    def load_state_dict(self, states: dict):
        self.state = states[TP_RNG].clone()


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
            whole = kind == ("lora_A" if dim == 0 else "lora_B") or (dim == 1 and kind == "bias")
            return None if whole else (dim, chunks)  # LoRA: B cut like W's rows, A like columns


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
    p = nn.Parameter(shard_tensor(t.detach(), dim, chunks, rank, tp), t.requires_grad)
    p.tensor_parallel = True
    return p


# --------------------------------------------------------------------------- the layers
class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i, built from a full nn.Linear: this rank's out/tp output features. Input
    (B, T, in), replicated, through f; with SP (B, T/tp, in), all-gathered. Out: (B, T, out/tp)."""

    def __init__(self, linear: nn.Linear, group, sequence_parallel=False, chunks=1):
        super().__init__()
        self.weight = _shard_param(linear.weight, 0, chunks, group)  # (out/tp, in)
        self.bias = None if linear.bias is None else _shard_param(linear.bias, 0, chunks, group)
        self.group, self.sequence_parallel = group, sequence_parallel
        if hasattr(linear, "lora_A"):  # LoRA (02): A (r, in) whole, B cut as the weight's rows
            self.lora_A, self.scale = linear.lora_A, linear.scale
            self.lora_B = _shard_param(linear.lora_B, 0, chunks, group)  # (out/tp, r)

    def forward(self, x):  # (B, T, in) or (B, T/tp, in)
        enter = GatherFromSequenceParallel if self.sequence_parallel else CopyToTensorParallel
        x = enter.apply(x, self.group)  # (B, T, in): SP's g, or f
        y = F.linear(x, self.weight, self.bias)  # (B, T, out/tp)
        if not hasattr(self, "lora_A"):
            return y
        a = CopyToTensorParallel.apply(self.lora_A, self.group)  # f on a weight: dA summed
        return y + x @ a.T @ self.lora_B.T * self.scale  # + (x A^T) B_i^T, this rank's features


class RowParallelLinear(nn.Module):
    """Z = sum_i Y_i B_i from a full nn.Linear: this rank's in/tp input features. (B, T, in/tp) ->
    (B, T, out) through g, or (B, T/tp, out) through SP's g-bar; the replicated bias added after."""

    def __init__(self, linear: nn.Linear, group, sequence_parallel=False):
        super().__init__()
        self.weight = _shard_param(linear.weight, 1, 1, group)  # (out, in/tp)
        self.bias = linear.bias  # replicated: the same Parameter
        self.group, self.sequence_parallel = group, sequence_parallel
        if hasattr(linear, "lora_A"):  # LoRA (02): A cut as the weight's columns, B (out, r) whole
            self.lora_A, self.scale = _shard_param(linear.lora_A, 1, 1, group), linear.scale
            self.lora_B = linear.lora_B

    def forward(self, x):  # (B, T, in/tp)
        y = F.linear(x, self.weight)  # (B, T, out): this rank's partial sum Y_i B_i
        if hasattr(self, "lora_A"):  # + (x_i A_i^T) B^T, partial too; dB is partial: f sums it
            b = CopyToTensorParallel.apply(self.lora_B, self.group)  # (out, r)
            y = y + x @ self.lora_A.T @ b.T * self.scale
        if not self.sequence_parallel:
            y = ReduceFromTensorParallel.apply(y, self.group)  # (B, T, out), g
            return y if self.bias is None else y + self.bias
        y = ReduceScatterToSequenceParallel.apply(y, self.group)  # (B, T/tp, out), g-bar
        # subtle: the bias meets this rank's T/tp tokens only: f sums its partial gradient
        return y if self.bias is None else y + CopyToTensorParallel.apply(self.bias, self.group)


class VocabParallelEmbedding(nn.Module):
    """wte split by vocabulary: rank r holds ids [r V/tp, (r+1) V/tp). It looks up the ids it owns,
    writes zeros for the others, and g sums over ranks: (B, T) ids -> (B, T, C), or (B, T/tp, C)."""

    def __init__(self, emb: nn.Embedding, group, sequence_parallel=False):
        super().__init__()
        self.weight = _shard_param(emb.weight, 0, 1, group)  # (V/tp, C)
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, idx):  # (B, T)
        local = idx - dist.get_rank(self.group) * (rows := self.weight.size(0))  # rows: V/tp
        outside = (local < 0) | (local >= rows)  # ids another rank owns
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, C)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)  # zeros (and zero gradient) there
        op = ReduceScatterToSequenceParallel if self.sequence_parallel else ReduceFromTensorParallel
        return op.apply(x, self.group)  # g-bar: (B, T/tp, C), or g: (B, T, C)


class SequenceParallelLayerNorm(nn.Module):
    """LayerNorm on this rank's (B, T/tp, C) tokens. Its weight and bias are replicated but each
    rank's gradient covers its own tokens only: f sums them (forget it: the copies drift apart)."""

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
        drop = attn.resid_dropout  # on copies: alike masks; with SP, on token shards: their own
        self.resid_dropout = ParallelDropout(drop.p, rng) if sequence_parallel else drop
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
def vocab_parallel_cross_entropy(logits, targets, reduction="mean", *, group, vocab_size=None):
    """02's loss, mean (or sum) of -log softmax[target] where target != -1, from (B, T, V/tp) logit
    shards: log sum_exp - x[target], both pieces summed over ranks (3 all-reduces of (B*T,), the
    max included), so every rank computes the same loss. No backward to write: g's is the
    identity, so d loss/d sum_exp = 1/sum_exp reaches each rank's own sum of exp(x), giving its
    shard exp(x)/sum_exp = softmax, and the target's owner -1 via x[target]: softmax - onehot."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    x = logits.float().reshape(-1, logits.size(-1))  # (N, V/tp), N = B*T; fp32 softmax, as 02
    rows, targets, n = x.size(-1), targets.reshape(-1), torch.arange(len(x), device=x.device)
    first = dist.get_rank(group) * rows  # this rank's first column: vocabulary id
    if vocab_size is not None and (pad := max(vocab_size - first, 0)) < rows:  # padding columns
        x = x.index_fill(1, torch.arange(pad, rows, device=x.device), -math.inf)  # no probability
    m = _all_reduce(x.detach().max(dim=-1).values, group, dist.ReduceOp.MAX)  # 1: global max
    x = x - m.unsqueeze(-1)  # exp(x - m) <= 1: no overflow; a constant shift, no gradient
    local = targets - first  # (N,) target ids, in this rank's columns
    mine = (local >= 0) & (local < rows)  # this rank holds the target's column
    picked = torch.where(mine, x[n, local.clamp(0, rows - 1)], 0.0)  # x[n, target_n] if mine
    target_logit = ReduceFromTensorParallel.apply(picked, group)  # 2: x[target], from its owner
    sum_exp = ReduceFromTensorParallel.apply(x.exp().sum(dim=-1), group)  # 3: the denominator
    keep = targets != -1  # 02's ignore_index
    losses = torch.where(keep, sum_exp.log() - target_logit, 0.0)  # (N,) -log softmax[target]
    return losses.sum() if reduction == "sum" else losses.sum() / keep.sum()


# --------------------------------------------------------------------------- the model
def check_tp_config(config, tp: int):
    """Every reason this GPTConfig cannot be split tp ways, in one ValueError (no collectives).
    n_head % tp == 0 is enough for the widths: C = nh * hs and 4C then split evenly too."""
    V, m, problems = config.padded_vocab_size, math.lcm(64, tp), []
    if config.n_head % tp:
        problems.append(f"n_head={config.n_head} is not divisible by tp={tp} (whole heads)")
    if V % tp:
        now = f"vocab_size={config.vocab_size}, pad_vocab_multiple={config.pad_vocab_multiple}"
        fix = f"pad with GPTConfig(pad_vocab_multiple={m}) -> {-(-config.vocab_size // m) * m} rows"
        problems.append(f"the vocabulary has {V} rows ({now}), not divisible by tp={tp}: {fix}")
    if problems:
        raise ValueError(f"cannot split this GPT over tp={tp} ranks: " + "; ".join(problems))


def apply_tensor_parallel(model, group, sequence_parallel=False, seed=None):
    """Shard a 02_model.GPT over the TP `group` in place, by slicing its full weights; returns it.
    Build the model identically on every rank first (same seed). model(idx, targets) then returns
    this rank's (B, T, V/tp) logits and the full mean loss; state-dict keys stay 02's; 05 may call
    model.embed, the blocks, model.head and model.loss_fn apart. The per-rank dropout stream is
    seeded (seed or torch.initial_seed()) + 1 + world_size + global rank: unique per (stage,
    replica, TP rank); train.py keeps default streams below (seed + 1 + pp_rank * dp + dp_rank)."""
    if group is None:
        raise ValueError("pass the TP process group explicitly (dist.new_group(ranks))")
    if getattr(model, "tp_group", None) is not None:
        raise ValueError("this model is already tensor-parallel")
    check_tp_config(model.config, dist.get_world_size(group))  # before any collective
    # one tiny all-reduce: slicing is only right if every TP rank built the same model
    sums = torch.stack([p.detach().double().sum() for p in model.parameters()])
    both = _all_reduce(torch.cat([sums, -sums]), group, dist.ReduceOp.MAX)  # max, -min
    if not torch.equal(both[: len(sums)], -both[len(sums) :]):
        raise ValueError("weights differ across TP ranks: torch.manual_seed alike before GPT()")
    t, sp, V = model.transformer, sequence_parallel, model.config.vocab_size
    seed = (torch.initial_seed() if seed is None else seed) + 1 + dist.get_world_size()
    rng = RNGStateTracker(t.wte.weight.device, (seed + dist.get_rank()) % 2**63)  # one per rank
    tied = model.lm_head.weight is t.wte.weight
    t.wte = VocabParallelEmbedding(t.wte, group, sp)
    model.lm_head = ColumnParallelLinear(model.lm_head, group, sp)  # (B, T, V/tp) logits
    if tied:  # the tied head reuses the embedding's vocab shard
        model.lm_head.weight = t.wte.weight
    for block in t.h:
        block.attn = ParallelSelfAttention(block.attn, group, sp, rng)
        block.mlp.c_fc = ColumnParallelLinear(block.mlp.c_fc, group, sp)  # (B, T, 4C/tp)
        block.mlp.c_proj = RowParallelLinear(block.mlp.c_proj, group, sp)
        if sp:  # these activations are token shards now: own dropout masks, f on LayerNorms
            block.mlp.dropout = ParallelDropout(block.mlp.dropout.p, rng)
            block.ln_1 = SequenceParallelLayerNorm(block.ln_1, group)
            block.ln_2 = SequenceParallelLayerNorm(block.ln_2, group)
    if sp:
        t.wpe = SequenceParallelPositionEmbedding(t.wpe, group)
        t.drop, t.ln_f = ParallelDropout(t.drop.p, rng), SequenceParallelLayerNorm(t.ln_f, group)
    model.loss_fn = functools.partial(vocab_parallel_cross_entropy, group=group, vocab_size=V)
    model.tp_group, model.tp_rng, model.sequence_parallel = group, rng, sp
    return model


def grad_norm_squared(grads, group, device) -> torch.Tensor:
    """Σ g² over (parameter, gradient) pairs, the same on every TP rank: shards summed, copies once."""
    sq = {True: torch.zeros((), device=device), False: torch.zeros((), device=device)}
    for p, g in grads:  # True: a slice, the ranks' squares add up; False: a copy, counted once
        sq[getattr(p, "tensor_parallel", False)] += g.float().pow(2).sum()
    return _all_reduce(sq[True], group) + sq[False]


# --------------------------------------------------------------------------- the demo
def demo(args, config, group, device):
    tp, rank, print0 = dist.get_world_size(group), dist.get_rank(group), distributed.print0
    torch.manual_seed(args.seed)  # the same whole model on every rank, sliced afterwards
    full = model_lib.GPT(config).to(device)
    sharded = {sp: apply_tensor_parallel(copy.deepcopy(full), group, sp) for sp in (False, True)}
    B, T = args.batch_size, config.block_size
    [(x, y)] = model_lib.byte_batches(T, B, seed=args.seed, device=device)  # same on every rank
    print0(f"GPT '{args.preset}' (nh={config.n_head}), (B, T) = ({B}, {T}), fp32, on {device.type}")
    logits_full, loss_full = full(x, y)
    loss_full.backward()
    want = {}  # each gradient of the whole model, or this rank's slice of it
    for n, p in full.named_parameters():
        want[n] = p.grad if (lay := tp_layout(n)) is None else shard_tensor(p.grad, *lay, rank, tp)
    for sp, model in sharded.items():
        logits, loss = model(x, y)
        loss.backward()
        d_grad = max((p.grad - want[name]).abs().max() for name, p in model.named_parameters())
        d_logits = (gather_logits(logits, group) - logits_full).abs().max()
        diffs = torch.stack([d_logits, (loss - loss_full).abs(), d_grad]).detach()
        diffs = _all_reduce(diffs, group, dist.ReduceOp.MAX).tolist()  # the worst rank's
        # O(1) values; fp32 sums split over ranks round ~1e-7 apart: 1e-4 is far above, below a bug
        assert max(diffs) < 1e-4, f"TP differs from the unsharded model: {diffs}"
        n_rank, n_full = (sum(p.numel() for p in m.parameters()) for m in (model, full))
        worst = "max |diff| logits {:.1e}, loss {:.1e}, any gradient {:.1e}".format(*diffs)
        print0(f"tp={tp}{' + sequence parallel' if sp else ''} equals the unsharded model: {worst}")
        share = f"{n_rank / n_full:.1%} of the whole (1/tp = {1 / tp:.1%})"
        print0(f"  parameters per rank {share}, as LayerNorms, wpe and row biases are replicated")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=formatter)
    parser.add_argument("--ranks", type=int, default=2, help="tp, started without torchrun")
    parser.add_argument("--preset", default="small", help="02's preset; small: 4 heads, tp 2 or 4")
    parser.add_argument("--batch-size", type=int, default=8, help="B; reaches every gradient")
    parser.add_argument("--seed", type=int, default=1337, help="model and batch, alike on ranks")
    args = parser.parse_args(argv)
    tp = int(os.environ.get("WORLD_SIZE", args.ranks))
    sizes = dict(vocab_size=256, pad_vocab_multiple=math.lcm(64, tp), dropout=0.0)
    try:  # bytes as tokens: 256 rows, padded to a multiple of 64 and of tp
        config = model_lib.GPTConfig.from_preset(args.preset, **sizes)
        check_tp_config(config, tp)  # a bad --ranks fails here, before any process starts
    except ValueError as e:
        parser.error(str(e))
    if "WORLD_SIZE" not in os.environ:
        return distributed.relaunch_with_torchrun(args.ranks, argv, __file__)
    _, _, world_size, device = distributed.init_distributed()
    try:
        demo(args, config, dist.new_group(list(range(world_size))), device)  # TP group: all ranks
        dist.barrier()  # subtle: no rank tears gloo down while a peer still uses it
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
