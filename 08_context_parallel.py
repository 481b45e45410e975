"""08 · Context parallelism: every sequence is split over the cp ranks, in every layer.

The idea: a layer's activations grow with T, TP's sequence split stops at tp, and
recomputation only trades that memory for compute. Context parallelism (CP) gives each
of cp ranks T/cp tokens of every sequence, from the embedding to the loss. Only
attention mixes positions, so only attention talks. Every weight is a full copy on each
CP rank, so CP is data parallelism over tokens: gradients are averaged over DP x CP.

The simple version (AllGatherAttention) all-gathers every rank's K and V, attends its
queries to all T keys and reduce-scatters dK, dV to their owners. Its forward sends what
the ring's does, (cp-1) 2E b (E, b and a below), its backward (cp-1) 2E a. But each rank
holds K and V of all T tokens (kept in every layer until the backward) and a (T/cp x T)
mask, and no attention starts before the all-gather ends. The ring (Liu et al.
2023, arXiv 2310.01889) keeps the queries at home and passes K and V around the ranks:
a rank holds K, V and scores of T/cp tokens at a time, and each transfer hides behind a
block's compute; its backward sends K and V again. The demo prints both versions' costs.

The math (the online softmax: Milakov & Gimelshein 2018; FlashAttention, 2205.14135).
A query row q against one block j of keys and values:
    s_j = q k_j^T / sqrt(hs)    lse_j = log sum exp(s_j)    o_j = softmax(s_j) v_j
Two blocks merge exactly, in any order, with the log-sum-exp rule (kept in fp32):
    lse = log(exp(lse_1) + exp(lse_2))
    o   = exp(lse_1 - lse) o_1 + exp(lse_2 - lse) o_2
so a rank's output is the merge of the blocks its queries see. The backward needs only
the final lse: p_j = exp(s_j - lse) is block j's exact share of the softmax, and with
D = rowsum(dO * O), dS_j = p_j * (dO v_j^T - D) (FlashAttention-2's rule, 2307.08691).
As flash attention tiles, a block's scores are computed QUERY_TILE query rows at a time
(a row's softmax, lse and dq are its own; dk, dv add up over tiles), so they take
nh x tile x n_k, not nh x n_q x n_k; keys stay whole per block (one merge per block).

The causal imbalance. Cut T into cp contiguous chunks and rank r's queries see chunks
0..r: the last rank computes cp blocks of (T/cp)^2 scores, the first one. The zigzag
split cuts T into 2cp chunks and gives rank r chunks r and 2cp-1-r, an early and a late
one: every rank computes (cp+1)/2 blocks (blocks_per_rank). The T x T scores of cp = 2
in chunks c0..c3, each cell marked rNsK: computed by rank N at ring step K (a diagonal
block is computed whole: a marked cell right of the diagonal is masked away):

    contiguous: rank 0 holds c0 c1             zigzag: rank 0 holds c0 c3
                rank 1 holds c2 c3                     rank 1 holds c1 c2
    keys:   c0   c1   c2   c3                  keys:   c0   c1   c2   c3
    c0    r0s0 r0s0    .    .                  c0    r0s0    .    . r0s0
    c1    r0s0 r0s0    .    .                  c1    r1s1 r1s0 r1s0    .
    c2    r1s1 r1s1 r1s0 r1s0                  c2    r1s1 r1s0 r1s0    .
    c3    r1s1 r1s1 r1s0 r1s0                  c3    r0s0 r0s1 r0s1 r0s0
    rank 0: 4 cells, rank 1: 8                 rank 0: 6 cells, rank 1: 6

At ring step s a rank holds the K/V that rank (r - s) mod cp started with (ring_block
says which part its queries see): each cell left of the diagonal is computed once.

Bytes each rank sends per layer (ring_bytes_per_layer), E = B (T/cp) C elements (one of
K or V of its tokens), b bytes each, a = max(b, 4) for the fp32 gradient accumulators:
    forward   (cp-1) 2E b              K and V move on, cp-1 times
    backward  (cp-1) 2E b + cp 2E a    K and V again; dK, dV on a second ring, home
Each transfer (2E b = 2B n C b bytes, n = T/cp) is posted before a step's compute, a
whole block's 4B n^2 C FLOPs, or half that at zigzag's later steps, which bind: at F
FLOP/s and W bytes/s on the link the ring hides when 2B n^2 C / F >= 2B n C b / W, i.e.
n >= F b / W (~4,400 tokens a rank: H100, 989 TFLOP/s bf16, NVLink 450 GB/s one way).

Run it:  python 08_context_parallel.py [--ranks 4]   (relaunches itself under torchrun)
    or:  torchrun --standalone --nproc_per_node=2 08_context_parallel.py

What changed from 07_zero.py: DP, TP, PP and ZeRO split the batch, the weights, the
layers and the optimizer's state; CP splits each sequence. Left out on purpose (see
docs/context_parallel.md): Ulysses (all-to-all over heads, 2309.14509), grouped-query
attention, attention dropout in the ring, packed documents, and a fused kernel.
"""

import copy
import functools
import importlib
import math

import torch
import torch.distributed as dist
import torch.nn as nn

from support.context_parallel import ring
from support.distributed import print0, run_on_ranks
from support.tensor_parallel import sharding
from support.tensor_parallel.activations import saved_activation_bytes

model_lib = importlib.import_module("02_model")
mp_lib = importlib.import_module("06_mixed_precision")  # global_token_count

SPLITS = ("zigzag", "contiguous")
SEQ_DIM = 2  # q, k, v: (B, nh, T/cp, hs); the sequence is dim 2 here, dim 1 in (B, T)
NAMES = ("out", "dq", "dk", "dv")  # what the attention demo compares with SDPA's


# ------------------------------------------------------------ the split of a sequence
def split_sequence(x, cp_rank, cp_size, split="zigzag", dim=1):
    """This rank's tokens of x along dim. zigzag: chunks r and 2cp-1-r of 2cp,
    concatenated (balanced); contiguous: chunk r of cp (the simple, unbalanced split)."""
    assert split in SPLITS, f"split must be one of {SPLITS}, got {split!r}"
    n = x.size(dim)
    if split == "contiguous":
        assert n % cp_size == 0, f"T={n} must be divisible by cp = {cp_size}"
        return x.chunk(cp_size, dim)[cp_rank]
    assert n % (2 * cp_size) == 0, f"T={n} must be divisible by 2cp = {2 * cp_size}"
    chunks = x.chunk(2 * cp_size, dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim)


def merge_sequence(parts, cp_size, split="zigzag", dim=1):
    """split_sequence's inverse: every rank's part, in rank order -> the whole x."""
    assert len(parts) == cp_size, f"{len(parts)} parts for cp={cp_size}"
    if split == "contiguous":
        return torch.cat(parts, dim)
    halves = [part.chunk(2, dim) for part in parts]  # each rank's (early, late) chunks
    early = [half[0] for half in halves]  # chunks 0 .. cp-1: ranks 0 .. cp-1
    late = [half[1] for half in reversed(halves)]  # chunks cp .. 2cp-1: ranks cp-1 .. 0
    return torch.cat(early + late, dim)


# The zigzag split under its own names: train.py, bench/ and the tests call these.
def zigzag_split(x, cp_rank: int, cp_size: int, dim: int = 1):
    return split_sequence(x, cp_rank, cp_size, "zigzag", dim)


def zigzag_merge(parts, cp_size: int, dim: int = 1):
    return merge_sequence(parts, cp_size, "zigzag", dim)


def zigzag_positions(T: int, cp_rank: int, cp_size: int, device=None):
    """The true positions (T/cp,) of this rank's tokens: what wpe must look up."""
    return zigzag_split(torch.arange(T, device=device), cp_rank, cp_size, 0)


# ------------------------------------------------------------ one block, by hand
# Query rows whose scores a block computes at once (the docstring's tiling): 1,024 keep
# each matmul large; the tests set it small so that several tiles really run.
QUERY_TILE = 1024


def attend(q, k, v, mask=None):
    """One block in fp32 (fp64 stays; autocast off: a bf16 lse would break the backward):
    q (B, nh, n_q, hs), k, v (B, nh, n_k, hs) -> out (B, nh, n_q, hs), lse (B, nh, n_q).
    mask (n_q, n_k): True where a query sees a key; each query sees at least one key."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out = torch.empty((*q.shape[:-1], v.size(-1)), dtype=dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=dtype, device=q.device)
    for start in range(0, q.size(-2), QUERY_TILE):
        rows = slice(start, start + QUERY_TILE)  # the last tile may be shorter
        with torch.autocast(q.device.type, enabled=False):
            s = q[..., rows, :] @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
            if mask is not None:
                s = s.masked_fill(~mask[rows], -math.inf)  # (B, nh, tile, n_k)
            lse[..., rows] = torch.logsumexp(s, dim=-1)
            out[..., rows, :] = torch.exp(s - lse[..., rows].unsqueeze(-1)) @ v
    return out, lse


def attend_backward(q, k, v, mask, lse, dout, delta):
    """attend's (dq, dk, dv) for one block, from the FINAL lse of its queries over all
    blocks and delta = rowsum(dO * O): p = exp(s - lse) is the block's exact share of
    the softmax, so the blocks' gradients (and the query tiles' dk, dv) simply add up."""
    dtype = lse.dtype
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    scale = 1 / math.sqrt(q.size(-1))
    dq = torch.empty(q.shape, dtype=dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=q.device)
    for start in range(0, q.size(-2), QUERY_TILE):
        rows = slice(start, start + QUERY_TILE)
        q_t = q[..., rows, :]
        do_t = dout[..., rows, :]
        s = q_t @ k.transpose(-2, -1) * scale  # (B, nh, tile, n_k)
        if mask is not None:
            s = s.masked_fill(~mask[rows], -math.inf)
        p = torch.exp(s - lse[..., rows].unsqueeze(-1))  # this tile's softmax weights
        dv += p.transpose(-2, -1) @ do_t  # (B, nh, n_k, hs)
        dp = do_t @ v.transpose(-2, -1)  # (B, nh, tile, n_k)
        ds = p * (dp - delta[..., rows].unsqueeze(-1)) * scale  # scale folded in
        dq[..., rows, :] = ds @ k
        dk += ds.transpose(-2, -1) @ q_t
    return dq, dk, dv


def merge(out, lse, rows, out_b, lse_b):
    """The log-sum-exp rule, in place, on the query rows `rows` of (out, lse)."""
    new = torch.logaddexp(lse[..., rows], lse_b)  # -inf (nothing yet) + x = x
    old_share = torch.exp(lse[..., rows] - new).unsqueeze(-1)
    new_share = torch.exp(lse_b - new).unsqueeze(-1)
    out[..., rows, :] = out[..., rows, :] * old_share + out_b * new_share
    lse[..., rows] = new


# ------------------------------------------------------------ the simple version
class AllGatherAttention(torch.autograd.Function):
    """The simple version: all-gather K and V forward, reduce-scatter dK, dV backward."""

    @staticmethod
    def forward(ctx, q, k, v, group, split):  # (B, nh, T/cp, hs) each, this rank's
        rank = dist.get_rank(group)
        cp = dist.get_world_size(group)
        kv = torch.stack([k, v])  # (2, B, nh, T/cp, hs)
        parts = ring.gather(kv, group)  # dist.all_gather: every rank's, cp-1 parts sent
        kv_all = merge_sequence(parts, cp, split, dim=1 + SEQ_DIM)  # (2, B, nh, T, hs)
        T = kv_all.size(1 + SEQ_DIM)
        mine = split_sequence(torch.arange(T, device=q.device), rank, cp, split, 0)
        mask = torch.arange(T, device=q.device) <= mine.unsqueeze(-1)  # (T/cp, T)
        out, lse = attend(q, kv_all[0], kv_all[1], mask)
        # K and V of all T tokens kept for the backward: cp times what the ring keeps.
        ctx.save_for_backward(q, kv_all, mask, out, lse)
        ctx.group = group
        ctx.split = split
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, kv_all, mask, out, lse = ctx.saved_tensors
        cp = dist.get_world_size(ctx.group)
        delta = (dout.to(lse.dtype) * out).sum(-1)
        dq, dk, dv = attend_backward(q, kv_all[0], kv_all[1], mask, lse, dout, delta)
        dkv = torch.stack([dk, dv])  # our queries' share of every token's dK, dV
        pieces = [split_sequence(dkv, r, cp, ctx.split, 1 + SEQ_DIM) for r in range(cp)]
        pieces = [piece.contiguous() for piece in pieces]
        summed = torch.empty_like(pieces[0])  # rank r gets the sum of piece r
        dist.reduce_scatter(summed, pieces, group=ctx.group)
        return dq.to(q.dtype), summed[0].to(q.dtype), summed[1].to(q.dtype), None, None


def allgather_attention(q, k, v, group, split="zigzag"):
    """Causal attention over the CP group, the whole sequence's K and V gathered."""
    return AllGatherAttention.apply(q, k, v, group, split)  # split_sequence checks it


# ------------------------------------------------------------ the ring
def ring_block(rank: int, src: int, n: int, split: str):
    """At the step that brings src's K/V here: (query rows, key rows, causal) that this
    rank computes, or None. n = T/cp tokens a rank; under zigzag, halves of n."""
    if src == rank:
        return slice(None), slice(None), True  # the diagonal: our own tokens, causal
    if split == "contiguous":
        return (slice(None), slice(None), False) if src < rank else None
    if src < rank:  # src's early chunk comes before both of ours, its late one after
        return slice(None), slice(0, n // 2), False
    return slice(n // 2, None), slice(None), False  # only our late chunk sees src's


def ring_pass(t, group) -> ring.Transfer:
    """Send t to the next rank and receive the previous rank's, as ONE batch_isend_irecv
    group. NCCL's rule (a send completes only when its receive is posted): every rank
    posts the same symmetric pair in the same order, so every send meets its receive."""
    rank = dist.get_rank(group)
    cp = dist.get_world_size(group)
    nxt = dist.get_global_rank(group, (rank + 1) % cp)
    prev = dist.get_global_rank(group, (rank - 1) % cp)
    sent = t.contiguous()
    received = torch.empty_like(sent)
    ops = [dist.P2POp(dist.isend, sent, nxt, group)]
    ops.append(dist.P2POp(dist.irecv, received, prev, group))
    return ring.Transfer(dist.batch_isend_irecv(ops), sent, received)


def ring_forward(q, k, v, rank, cp, split, pass_on, work=None):
    """This rank's out (B, nh, n, hs) and fp32 lse (B, nh, n), n = T/cp, in cp ring
    steps. pass_on(t) posts a ring step (ring_pass, or a ThreadRing's). work, a list,
    gets the query-key scores of each block computed."""
    B, nh, n, hs = q.shape
    dtype = torch.promote_types(q.dtype, torch.float32)
    # Laid out (B, T/cp, nh, hs), as flash kernels lay theirs: the caller's reshape to
    # (B, T/cp, C) is then a view, and the backward keeps one copy, not two.
    out = torch.zeros(B, n, nh, hs, dtype=dtype, device=q.device).transpose(1, 2)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=dtype, device=q.device)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    kv = torch.stack([k, v])  # (2, B, nh, n, hs): one message a step
    for step in range(cp):
        src = (rank - step) % cp  # whose K/V we hold now
        transfer = pass_on(kv) if step < cp - 1 else None  # the next one, in flight
        block = ring_block(rank, src, n, split)
        if block is not None:
            rows, cols, diagonal = block
            k_b = kv[0][..., cols, :]
            v_b = kv[1][..., cols, :]
            mask = causal if diagonal else None
            out_b, lse_b = attend(q[..., rows, :], k_b, v_b, mask)
            merge(out, lse, rows, out_b, lse_b)
            if work is not None:
                work.append(out_b.size(SEQ_DIM) * k_b.size(SEQ_DIM))
        if transfer is not None:
            kv = transfer.wait()  # src - 1's K/V, for the next step
    return out.to(q.dtype), lse


def ring_backward(q, k, v, out, lse, dout, rank, cp, split, pass_on):
    """(dq, dk, dv) of this rank's tokens. K/V go around the ring again; beside them
    each block's fp32 dK/dV accumulator collects every rank's share, and one last step
    brings it home. Its transfer overlaps the next block's compute."""
    n = q.size(SEQ_DIM)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # (B, nh, n): D
    dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
    kv = torch.stack([k, v])
    dkv_transfer = None  # the accumulator in flight to the next rank
    for step in range(cp):
        src = (rank - step) % cp
        transfer = pass_on(kv) if step < cp - 1 else None
        mine = torch.zeros(kv.shape, dtype=lse.dtype, device=q.device)  # src's dK, dV
        block = ring_block(rank, src, n, split)
        if block is not None:
            rows, cols, diagonal = block
            mask = causal if diagonal else None
            k_b = kv[0][..., cols, :]
            v_b = kv[1][..., cols, :]
            q_b = q[..., rows, :]
            do_b = dout[..., rows, :]
            lse_b = lse[..., rows]
            grads = attend_backward(q_b, k_b, v_b, mask, lse_b, do_b, delta[..., rows])
            dq[..., rows, :] += grads[0]
            mine[0][..., cols, :] += grads[1]
            mine[1][..., cols, :] += grads[2]
        # src's accumulator, from the previous rank (which held src's K/V a step ago).
        dkv = mine if step == 0 else dkv_transfer.wait() + mine
        dkv_transfer = pass_on(dkv) if cp > 1 else None  # on; after the last step: home
        if transfer is not None:
            kv = transfer.wait()
    if cp > 1:
        dkv = dkv_transfer.wait()  # our own K/V's gradient, summed over every rank
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Ring attention: K/V around the ring forward; K/V, then dK/dV home, backward."""

    @staticmethod
    def forward(ctx, q, k, v, group, split):  # (B, nh, T/cp, hs) each, this rank's
        rank = dist.get_rank(group)
        cp = dist.get_world_size(group)
        pass_on = functools.partial(ring_pass, group=group)
        out, lse = ring_forward(q, k, v, rank, cp, split, pass_on)
        ctx.save_for_backward(q, k, v, out, lse)  # as flash attention keeps: O and lse
        ctx.ring = (rank, cp, split, pass_on)
        return out  # (B, nh, T/cp, hs)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(q, k, v, out, lse, dout, *ctx.ring)
        return dq, dk, dv, None, None


def ring_attention(q, k, v, group, split="zigzag"):
    """allgather_attention's result, with K and V passed around the ring instead."""
    assert split in SPLITS, f"split must be one of {SPLITS}, got {split!r}"
    return RingAttention.apply(q, k, v, group, split)


# ------------------------------------------------------------ formulas
def blocks_per_rank(cp: int, split: str) -> list:
    """Each rank's causal attention work in blocks of (T/cp)^2 scores, a diagonal block
    computed whole: contiguous, rank r: r + 1; zigzag: 1 + (cp-1)/2 on every rank."""
    if split == "contiguous":
        return [r + 1 for r in range(cp)]
    return [(cp + 1) / 2] * cp


def ring_bytes_per_layer(batch, seq_len, n_embd, cp, bytes_per_element):
    """(forward, backward) bytes one rank sends per layer (the docstring's formula);
    n_embd is the width of one rank's K (C, or C/tp under tensor parallelism)."""
    if cp == 1:
        return 0, 0
    E = batch * (seq_len // cp) * n_embd  # one of K or V of a rank's tokens
    forward = (cp - 1) * 2 * E * bytes_per_element
    return forward, forward + cp * 2 * E * max(bytes_per_element, 4)


def allgather_bytes_per_layer(batch, seq_len, n_embd, cp, bytes_per_element):
    """(forward, backward) bytes one rank sends per layer in the all-gather version, as
    a ring all-gather and reduce-scatter send them: (cp-1) 2E b and (cp-1) 2E a."""
    E = batch * (seq_len // cp) * n_embd
    a = max(bytes_per_element, 4)  # the fp32 dK, dV that the reduce-scatter sums
    return (cp - 1) * 2 * E * bytes_per_element, (cp - 1) * 2 * E * a


# ------------------------------------------------------------ the model
class ContextParallelAttention(nn.Module):
    """02's attention (or 04's, on nh/tp heads) with the ring in place of SDPA: the same
    c_attn and c_proj, under the same state-dict keys."""

    def __init__(self, attn, group, split):
        super().__init__()
        assert attn.dropout == 0.0, "the ring has no dropout on attention weights"
        self.c_attn = attn.c_attn
        self.c_proj = attn.c_proj
        self.resid_dropout = attn.resid_dropout
        self.dropout = attn.dropout  # 0.0; 06b's recomputation asks it
        self.head_dim = attn.head_dim
        self.group = group
        self.split = split
        # torch.compile leaves the ring eager; wrapped here, not at import (~3 s a process).
        self.ring = torch.compiler.disable(ring_attention)

    def forward(self, x):  # (B, T/cp, C) this rank's tokens ((B, T/cp/tp, C) with SP)
        qkv = self.c_attn(x)  # (B, T/cp, 3C), or (B, T/cp, 3C/tp) under TP
        B, n, _ = qkv.shape
        heads = (t.view(B, n, -1, self.head_dim) for t in qkv.chunk(3, dim=-1))
        q, k, v = (t.transpose(1, 2) for t in heads)  # 3 x (B, nh, T/cp, hs)
        y = self.ring(q, k, v, self.group, self.split)
        y = y.transpose(1, 2).reshape(B, n, -1)  # (B, T/cp, C)
        return self.resid_dropout(self.c_proj(y))


class TruePositions(nn.Module):
    """wpe at this rank's true positions: GPT-2's learned positions are absolute, and
    02's embed asks for arange(T/cp). The same weight, under the same key."""

    def __init__(self, wpe, group, split):
        super().__init__()
        self.weight = wpe.weight
        self.lookup = wpe.forward  # 02's nn.Embedding, or 04b's SP position embedding
        self.group = group
        self.split = split

    def forward(self, pos):  # (T/cp,): 0 .. T/cp - 1
        cp = dist.get_world_size(self.group)
        T = pos.numel() * cp
        n = self.weight.size(0)
        assert T <= n, f"T={T} (T/cp={pos.numel()}, cp={cp}) exceeds block_size={n}"
        rank = dist.get_rank(self.group)
        positions = torch.arange(T, device=pos.device)  # the true ones, split as x is
        return self.lookup(split_sequence(positions, rank, cp, self.split, 0))


def apply_context_parallel(model, group, split="zigzag"):
    """Make a 02_model.GPT (also one sharded by 04, and so 05's chunks cut from it) run
    on this rank's chunks of every sequence, in place. Feed it split_sequence(idx) and
    split_sequence(targets); the loss is the SUM over its tokens / cp_token_count, and
    the gradients, like DP's, are averaged over the CP (or DP x CP) ranks."""
    if group is None:
        raise ValueError("pass the CP process group explicitly (dist.new_group(ranks))")
    if getattr(model, "cp_group", None) is not None:
        raise ValueError("this model is already context-parallel")
    assert split in SPLITS, f"split must be one of {SPLITS}, got {split!r}"
    different = "weights differ across CP ranks: torch.manual_seed alike before GPT()"
    sharding.check_same_on_ranks(list(model.parameters()), group, different)
    t = model.transformer
    t.wpe = TruePositions(t.wpe, group, split)
    for block in t.h:
        block.attn = ContextParallelAttention(block.attn, group, split)
    model.cp_group = group
    model.cp_split = split
    return model


def cp_token_count(targets, group) -> torch.Tensor:
    """N: the targets that count (not -1) on every rank of `group` (CP, or DP x CP): 06's
    global_token_count of this rank's tokens, a 0-dim tensor never read on the host (no
    sync). Each rank's loss is the SUM over its own tokens / N: a rank whose targets are
    all -1 adds 0 to N and 0 to the loss (no 0/0, no NaN). N is at least 1: a group
    whose targets are all -1 gives loss 0 and zero gradients."""
    return mp_lib.global_token_count([(None, targets)], group)  # one (x, y): ours


def average_gradients(model, group):
    """DP's rule over the CP ranks: SUM every gradient, then divide by the ranks."""
    size = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
            p.grad /= size


def cp_step(model, idx, targets, group):
    """One forward and backward on this rank's chunks (B, T/cp): (logits, loss), the
    loss this rank's share of the one-process mean. Every weight is replicated, so each
    rank back-propagates loss x cp and average_gradients averages: DP's convention."""
    n = cp_token_count(targets, group)  # a 0-dim tensor: no host sync
    logits, loss_sum = model(idx, targets, reduction="sum")
    # d(loss x cp)/d(loss_sum) = cp / N seeds the backward: autograd keeps no N.
    loss_sum.backward(dist.get_world_size(group) / n)
    average_gradients(model, group)
    return logits, loss_sum.detach() / n


# ------------------------------------------------------------ the demo
def demo_attention(args, group, device):
    """Both versions and both splits against SDPA(is_causal=True), on one q, k, v; then
    each version's bytes sent and kept for the backward, measured, beside the formulas."""
    rank = dist.get_rank(group)
    cp = dist.get_world_size(group)
    torch.manual_seed(args.seed)  # the same q, k, v and dO on every rank
    B = args.batch_size
    T = args.seq_len
    shape = (B, args.heads, T, args.head_size)
    q, k, v, dout = (torch.randn(shape, device=device) for _ in range(4))
    want = ring.sdpa_reference(q, k, v, dout)  # [out, dq, dk, dv] of the whole sequence
    C = args.heads * args.head_size
    print0(f"attention, (B, nh, T, hs) = {shape}, fp32, cp = {cp}:")
    versions = {"all-gather": (allgather_attention, allgather_bytes_per_layer)}
    versions["ring"] = (ring_attention, ring_bytes_per_layer)
    costs = {}
    for name, (fn, bytes_formula) in versions.items():
        parts = ring.attention_kept_bytes(B, T, args.heads, args.head_size, cp, name)
        formula = (*bytes_formula(B, T, C, cp, 4), sum(parts.values()))
        costs[name] = (formula, parts)
        for split in SPLITS:
            at = dict(split=split, dim=SEQ_DIM)  # where this rank's tokens are
            cut = functools.partial(split_sequence, cp_rank=rank, cp_size=cp, **at)
            join = functools.partial(merge_sequence, cp_size=cp, **at)
            run = functools.partial(fn, group=group, split=split)
            got, used = ring.attention_on_ranks(run, (q, k, v), dout, group, cut, join)
            diffs = {n: (a - b).abs().max() for n, a, b in zip(NAMES, got, want)}
            worst = sharding.equal_over_ranks(diffs, group, f"{name} attention")
            print0(f"  {name:<10} {split:<10} == SDPA(is_causal=True): max |Δ| {worst}")
            assert used == formula, f"{name} {split}: measured {used} != {formula}"
    E = B * (T // cp) * C  # one of K or V of T/cp tokens
    print0(f"per rank, measured = formula: E = B·T/cp·C = {E:,}, b = a = 4 (fp32)")
    terms = {"all-gather": "(cp-1)·2E·b + (cp-1)·2E·a"}
    terms["ring"] = "(cp-1)·2E·b + (cp-1)·2E·b + cp·2E·a"
    for name, ((forward, backward, kept), parts) in costs.items():
        print0(f"  {name:<10} sends {forward:,} + {backward:,} = {terms[name]}")
        held = " + ".join(f"{part} {n:,}" for part, n in parts.items())
        print0(f"  {'':<10} keeps {kept:,} for the backward = {held}")


def demo_balance(args, group, device):
    """Blocks of (T/cp)^2 scores each rank computed, measured, beside blocks_per_rank."""
    rank = dist.get_rank(group)
    cp = dist.get_world_size(group)
    n = args.seq_len // cp
    shape = (1, 1, n, args.head_size)
    print0("causal work per rank, blocks of (T/cp)^2 scores (measured | formula):")
    for split in SPLITS:
        work = []
        q, k, v = (torch.randn(shape, device=device) for _ in range(3))
        pass_on = functools.partial(ring_pass, group=group)
        ring_forward(q, k, v, rank, cp, split, pass_on, work)
        mine = torch.tensor([sum(work) / n**2], device=device)
        measured = [b.item() for b in ring.gather(mine, group)]
        formula = blocks_per_rank(cp, split)
        assert measured == formula, f"{split}: measured {measured}, formula {formula}"
        cells = " ".join(f"{m:g}|{f:g}" for m, f in zip(measured, formula))
        balance = max(measured) / (sum(measured) / cp)
        print0(f"  {split:<10} ranks 0..{cp - 1}: {cells}   max/mean {balance:.2f}")


def demo_gpt(args, group, device):
    """02's GPT on this rank's zigzag chunks against one process: logits, loss, grad."""
    rank = dist.get_rank(group)
    cp = dist.get_world_size(group)
    torch.manual_seed(args.seed)  # the same GPT on every rank
    config = model_lib.GPTConfig.from_preset("tiny", block_size=args.seq_len)
    full = model_lib.GPT(config).to(device)
    model = apply_context_parallel(copy.deepcopy(full), group)
    B = args.batch_size
    T = args.seq_len
    [(x, targets)] = model_lib.byte_batches(T, B, seed=args.seed, device=device)
    print0(f"GPT 'tiny' (L={config.n_layer}, C={config.n_embd}), (B, T) = ({B}, {T}):")
    # Megatron-LM #1764: NaN when a rank's targets are all ignored; here rank 0's.
    ignored = targets.clone()
    ignored[:, zigzag_positions(T, 0, cp, device)] = -1
    cases = {"all targets": targets, "rank 0's targets all -1": ignored}
    for case, y in cases.items():
        full.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        one = functools.partial(full, x, y)
        (logits_full, loss_full), kept_one = saved_activation_bytes(one)
        loss_full.backward()
        mine = [zigzag_split(t, rank, cp) for t in (x, y)]  # (B, T/cp) each
        step = functools.partial(cp_step, model, *mine, group)
        with ring.count_p2p() as sent:  # backward saves nothing: kept is forward's
            (logits, loss), kept_mine = saved_activation_bytes(step)
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)  # the ranks' shares add up to the mean
        whole = zigzag_merge(ring.gather(logits, group), cp)
        diffs = {"logits": (whole - logits_full).abs().max()}
        diffs["loss"] = (total - loss_full).abs()
        want = dict(full.named_parameters())
        named = model.named_parameters()
        gaps = [(p.grad - want[n].grad).abs().max() for n, p in named]
        diffs["every gradient"] = max(gaps)
        worst = sharding.equal_over_ranks(diffs, group, "the CP GPT")
        print0(f"  {case}: loss {total.item():.4f}, one process {loss_full.item():.4f}")
        print0(f"    rank 0's share {loss.item():.4f}; cp={cp} == one process: {worst}")
    per_layer = sum(sent) / config.n_layer
    formula = sum(ring_bytes_per_layer(B, T, config.n_embd, cp, 4))
    print0(f"  ring bytes per layer and rank {per_layer:,.0f} | formula {formula:,}")
    # What CP is for: activations / cp, bar the loss's 4-byte count (06b's formula).
    kept = f"{kept_mine:,} = (one process {kept_one:,} - 4) / cp + 4"
    assert kept_mine == (kept_one - 4) // cp + 4, kept
    print0(f"  activations kept per rank {kept}")


def demo(args, rank, world_size, device):
    group = dist.new_group(list(range(world_size)))  # the CP group: every rank
    demo_attention(args, group, device)
    demo_balance(args, group, device)
    demo_gpt(args, group, device)


def main(argv=None):
    run_on_ranks(demo, argv, __file__, __doc__, ring.add_arguments, ring.check_args)


if __name__ == "__main__":
    main()
