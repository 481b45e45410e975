"""04b · Sequence parallelism: what 04 keeps whole between g and f is split by tokens.

The idea: between g and the next f (04), every TP rank repeats the same LayerNorm,
dropout and residual add on the whole (B, T, C). Give each rank T/tp of the tokens
instead: that work, and what it keeps for the backward, shrinks tp times.

The math (Korthikanti et al. 2022, arXiv 2205.05198, section 4.2): an all-reduce is a
reduce-scatter then an all-gather, so 04's two operators become
    g (all-reduce forward, identity backward)  ->  reduce-scatter along T forward,
                                   all-gather backward:  (B, T, C) -> (B, T/tp, C)
    f (identity forward, all-reduce backward)  ->  all-gather along T forward,
                                   reduce-scatter backward:  (B, T/tp, C) -> (B, T, C)
each one's backward the other's forward. The SP paper names the all-gather g and the
reduce-scatter ḡ; here they keep 04's places: the all-gather (where f stood) and the
reduce-scatter (where g stood), as g and f keep 04's meaning.
Per layer and step, with E = B*T*C: 4 all-gathers and 4 reduce-scatters each sending
(tp-1)/tp * E per rank on a ring, where 04 had 4 all-reduces of 2(tp-1)/tp * E: the
same bytes. What SP buys is memory: each LayerNorm keeps its input and two statistics
per token for the backward, now for T/tp tokens:
    saved per rank = (2 L + 1) LayerNorms * B * T * (C + 2) * 4 bytes * (tp - 1)/tp
A copy that meets only this rank's tokens (LayerNorm's weight and bias, wpe's rows, a
row-parallel bias) gets a gradient from T/tp tokens: f sums it over the ranks, or the
copies drift apart. Dropout on token shards draws each rank's own masks (04's tracker).

Who holds what at tp = 2, one block (weights split as in 04):
    rank 0: tokens [0, T/2) of the residual stream, rank 1: [T/2, T)
    x_r (B,T/2,C) ─LN─▶ ─all-gather─▶ (B,T,C) ─attention on nh/2 heads─▶ partial (B,T,C)
        ─reduce-scatter─▶ (B,T/2,C) ─dropout, + x_r─▶ ─LN─▶ ─all-gather─▶ MLP ─▶ ...

Run it:  python 04b_sequence_parallel.py [--ranks 4]   (relaunches itself under torchrun)
    or:  torchrun --standalone --nproc_per_node=2 04b_sequence_parallel.py

What changed from 04_tensor_parallel.py: each layer's `enter` (f) becomes an all-gather
and its `leave` (g) a reduce-scatter; the LayerNorms, position embedding and dropouts
between them run on T/tp tokens. Left out on purpose: keeping only the T/tp shard of a
column-parallel layer's input for its backward (Megatron gathers it again there, which
saves the rest of the activations); overlapping the all-gather with the matmul.
"""

import copy
import importlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from support.distributed import print0, run_on_ranks
from support.tensor_parallel import sharding
from support.tensor_parallel.activations import saved_activation_bytes
from support.tensor_parallel.sharding import relative_diff

model_lib = importlib.import_module("02_model")
tp_lib = importlib.import_module("04_tensor_parallel")

# T is dim 1 of 02's (B, T, C); Megatron keeps (T, B, C), so its gathers need no copy.
SEQ_DIM = 1


class GatherFromSequenceParallel(torch.autograd.Function):
    """The all-gather, where f stood: along T forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group):  # (B, T/tp, C): this rank's tokens -> (B, T, C)
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)  # a ring sends tp-1 parts
        return torch.cat(parts, dim=SEQ_DIM)  # every rank's tokens, in rank order

    @staticmethod
    def backward(ctx, grad):  # (B, T, C), this rank's share -> (B, T/tp, C), summed
        return ReduceScatterToSequenceParallel.forward(ctx, grad, ctx.group), None


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """The reduce-scatter, where g stood: along T forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):  # (B, T, C) partial sums -> (B, T/tp, C), own tokens
        ctx.group = group
        chunks = sharding.chunk_for_ranks(x, group, SEQ_DIM)  # tp x (B, T/tp, C)
        parts = [chunk.contiguous() for chunk in chunks]
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, group=group)  # rank r gets the sum of chunk r
        return out

    @staticmethod
    def backward(ctx, grad):  # (B, T/tp, C) -> (B, T, C): the all-gather above
        return GatherFromSequenceParallel.forward(ctx, grad, ctx.group), None


def gather_tokens(x, group):
    """A layer's `enter` under SP, where f stood: every rank's T/tp tokens, gathered."""
    return GatherFromSequenceParallel.apply(x, group)  # (B, T/tp, in) -> (B, T, in)


def scatter_tokens(y, bias, group):
    """A layer's `leave` under SP, where g stood: this rank's T/tp tokens of the sum.
    The replicated bias then meets those tokens only, so f sums its gradient."""
    y = ReduceScatterToSequenceParallel.apply(y, group)  # (B, T, out) -> (B, T/tp, out)
    if bias is None:
        return y
    return y + tp_lib.CopyToTensorParallel.apply(bias, group)


class ParallelDropout(nn.Dropout):
    """Dropout on this rank's tokens: a mask of its own, from 04's per-rank stream."""

    def __init__(self, p: float, rng):
        super().__init__(p)
        self.rng = rng  # 04's RNGStateTracker

    def forward(self, x):  # (B, T/tp, C)
        with self.rng.fork():
            return super().forward(x)


class SequenceParallelLayerNorm(nn.Module):
    """LayerNorm on this rank's (B, T/tp, C) tokens: the replicated weight's gradient
    covers them only, so f sums it (forget f and the copies drift: the classic SP bug)."""

    def __init__(self, ln: nn.LayerNorm, group):
        super().__init__()
        self.weight = ln.weight  # the same Parameters, under the same keys
        self.bias = ln.bias
        self.shape = ln.normalized_shape
        self.eps = ln.eps
        self.group = group

    def forward(self, x):  # (B, T/tp, C)
        w = tp_lib.CopyToTensorParallel.apply(self.weight, self.group)  # f: dw summed
        b = None
        if self.bias is not None:
            b = tp_lib.CopyToTensorParallel.apply(self.bias, self.group)
        return F.layer_norm(x, self.shape, w, b, self.eps)  # (B, T/tp, C)


class SequenceParallelPositionEmbedding(nn.Module):
    """wpe's rows for this rank's T/tp positions; f sums the (T, C) gradient."""

    def __init__(self, emb: nn.Embedding, group):
        super().__init__()
        self.weight = emb.weight  # the same Parameter
        self.group = group

    def forward(self, pos):  # (T,)
        rows = F.embedding(pos, self.weight)  # (T, C)
        rows = tp_lib.CopyToTensorParallel.apply(rows, self.group)
        mine = sharding.chunk_for_ranks(rows, self.group, 0)
        return mine[dist.get_rank(self.group)]  # (T/tp, C)


def to_sequence_parallel(module):
    """Every 04 layer in `module` (itself too), in place: an all-gather where f stood, a
    reduce-scatter where g stood; an attention's residual dropout, which now meets token
    shards, draws from the rank's own stream. Returns the module."""
    for m in list(module.modules()):
        if isinstance(m, tp_lib.ColumnParallelLinear):  # c_attn, c_fc, lm_head
            m.enter = gather_tokens
        if isinstance(m, (tp_lib.RowParallelLinear, tp_lib.VocabParallelEmbedding)):
            m.leave = scatter_tokens
        if isinstance(m, tp_lib.ParallelSelfAttention):
            m.resid_dropout = ParallelDropout(m.resid_dropout.p, m.rng)
    return module


def apply_sequence_parallel(model, group, *, seed=None):
    """04's apply_tensor_parallel, then sequence parallelism, in place: the layers
    gather and scatter tokens, and the copies between them (LayerNorms, wpe, dropouts)
    work on this rank's T/tp tokens. model(idx, targets) still takes the whole (B, T)
    batch and returns this rank's (B, T, V/tp) logits and the full mean loss; T must be
    a multiple of tp."""
    tp_lib.apply_tensor_parallel(model, group, seed=seed)
    to_sequence_parallel(model)
    rng = model.tp_rng
    t = model.transformer
    for block in t.h:
        block.ln_1 = SequenceParallelLayerNorm(block.ln_1, group)
        block.ln_2 = SequenceParallelLayerNorm(block.ln_2, group)
        block.mlp.dropout = ParallelDropout(block.mlp.dropout.p, rng)
    t.wpe = SequenceParallelPositionEmbedding(t.wpe, group)
    t.drop = ParallelDropout(t.drop.p, rng)
    t.ln_f = SequenceParallelLayerNorm(t.ln_f, group)
    return model


def demo_sublayer(args, config, group, device):
    """The simple version: one LayerNorm and 02's MLP on T/tp tokens, against whole."""
    rank = dist.get_rank(group)
    tp = dist.get_world_size(group)
    torch.manual_seed(args.seed)  # the same weights, X and dL/dZ on every rank
    ln = nn.LayerNorm(config.n_embd).to(device)
    mlp = model_lib.MLP(config).to(device)
    x = torch.randn(args.batch_size, config.block_size, config.n_embd, device=device)
    dz = torch.randn_like(x)  # a given dL/dZ: the loss is sum(Z * dz)
    x_full = x.clone().requires_grad_()
    (mlp(ln(x_full)) * dz).sum().backward()
    sp_ln = SequenceParallelLayerNorm(copy.deepcopy(ln), group)
    fc = tp_lib.ColumnParallelLinear(copy.deepcopy(mlp.c_fc), group)
    proj = tp_lib.RowParallelLinear(copy.deepcopy(mlp.c_proj), group)
    to_sequence_parallel(fc)  # enter: all-gather
    to_sequence_parallel(proj)  # leave: reduce-scatter
    x_mine = x.chunk(tp, SEQ_DIM)[rank].clone().requires_grad_()  # (B, T/tp, C)
    with sharding.count_comm() as forward:
        z = proj(mlp.gelu(fc(sp_ln(x_mine))))  # (B, T/tp, C): this rank's tokens
    with sharding.count_comm() as backward:
        (z * dz.chunk(tp, SEQ_DIM)[rank]).sum().backward()
    E = x.numel() * x.element_size()  # one (B, T, C)
    ops = [op for op, n in forward]
    assert ops == ["all_gather", "reduce_scatter"], f"forward: {forward}"
    big = [op for op, n in backward if n == E]  # f's all-reduces of copies are small
    assert big == ["all_gather", "reduce_scatter"], f"backward: {backward}"
    d_grad = [relative_diff(x_mine.grad, x_full.grad.chunk(tp, SEQ_DIM)[rank])]
    d_grad.append(relative_diff(sp_ln.weight.grad, ln.weight.grad))
    d_grad.append(relative_diff(proj.bias.grad, mlp.c_proj.bias.grad))
    fc_slice = mlp.c_fc.weight.grad.chunk(tp, 0)[rank]  # this rank's rows of dW
    d_grad.append(relative_diff(fc.weight.grad, fc_slice))
    z_full = mlp(ln(x)).chunk(tp, SEQ_DIM)[rank]
    diffs = {"output": relative_diff(z, z_full), "any gradient": max(d_grad)}
    worst = sharding.equal_over_ranks(diffs, group, "the SP LayerNorm + MLP")
    print0(f"LayerNorm + MLP at tp={tp} on T/tp tokens: 1 all-gather (where f stood)")
    print0("  and 1 reduce-scatter (where g stood) forward, each the other's backward")
    print0(f"  equals the unsharded pair: max relative |diff| {worst}")


def ln_saved_bytes(config, B: int, T: int, tp: int) -> int:
    """What SP saves per rank of the bytes kept for backward: every LayerNorm's input
    (C numbers a token) and its mean and 1/std (2), fp32, kept for T/tp tokens, not T."""
    per_token = (2 * config.n_layer + 1) * (config.n_embd + 2) * 4
    return B * T * per_token * (tp - 1) // tp


def demo_gpt(args, config, group, device):
    """The GPT under TP, then TP + SP: equal to the whole, the same bytes sent, and
    what SP saves of the activations kept for backward, beside ln_saved_bytes."""
    tp = dist.get_world_size(group)
    torch.manual_seed(args.seed)  # the same whole model on every rank, sliced after
    full = model_lib.GPT(config).to(device)
    B = args.batch_size
    T = config.block_size
    [(x, y)] = model_lib.byte_batches(T, B, seed=args.seed, device=device)
    print0(f"GPT '{args.preset}' (nh={config.n_head}), (B, T) = ({B}, {T}), fp32")
    E = B * T * config.n_embd * 4  # the bytes of one (B, T, C) activation in fp32
    sent = {}
    kept = {}
    for apply in (tp_lib.apply_tensor_parallel, apply_sequence_parallel):
        sp = apply is apply_sequence_parallel
        model = apply(copy.deepcopy(full), group)
        worst, log, _ = tp_lib.step_against_whole(model, full, x, y, group, device)
        sharding.check_comm(log, config, B, T, sp)  # each collective's bytes
        calls, sent[sp] = sharding.ring_sent(log, tp, E)  # those of (B, T, C)
        _, kept[sp] = saved_activation_bytes(lambda: model(x, y))
    print0(f"tp={tp} + sequence parallel: max |diff| {worst}")
    assert sent[True] == sent[False], f"SP sends other bytes than TP: {sent}"
    kinds = f"{calls} all-gathers and reduce-scatters of (B, T, C)"
    print0(f"  {kinds}: {sent[True]:,} bytes sent per rank, as tp={tp}'s all-reduces")
    saved = kept[False] - kept[True]
    formula = ln_saved_bytes(config, B, T, tp)
    assert saved == formula, f"SP saved {saved:,} bytes, the formula {formula:,}"
    both = f"tp={tp} {kept[False]:,} bytes, + SP {kept[True]:,} bytes"
    print0(f"activations kept for backward per rank: {both}")
    print0(f"  SP saves {saved:,} bytes ({saved / kept[False]:.1%}); the formula")
    print0(f"  (2L+1) LayerNorms x B T (C+2) x 4 bytes x (tp-1)/tp = {formula:,}")


def demo_dropout(args, group, device):
    """Dropout on token shards: each rank draws a mask of its own."""
    tp = dist.get_world_size(group)
    torch.manual_seed(args.seed)  # the default stream, alike on every rank
    seed = args.seed + 1 + dist.get_rank()  # this rank's own stream, as in the model
    drop = ParallelDropout(0.5, tp_lib.RNGStateTracker(device, seed))
    mask = drop(torch.ones(1, 1024, device=device))  # this rank's tokens
    [alike] = sharding.same_on_ranks(mask, group)
    assert tp == 1 or not alike, "the ranks drew one mask for different tokens"
    print0(f"dropout on token shards: the same mask on every rank: {alike}")


def demo(args, rank, world_size, device):
    """LayerNorm + MLP, then the whole GPT, then dropout, on one TP group of every rank."""
    config = tp_lib.demo_config(args, world_size)
    group = dist.new_group(list(range(world_size)))  # the TP group: every rank
    demo_sublayer(args, config, group, device)
    demo_gpt(args, config, group, device)
    demo_dropout(args, group, device)


def main(argv=None):
    check = tp_lib.demo_config  # whole heads, and the vocabulary, split tp ways
    run_on_ranks(demo, argv, __file__, __doc__, tp_lib.add_arguments, check)


if __name__ == "__main__":
    main()
