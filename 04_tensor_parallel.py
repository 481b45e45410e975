"""04 · Tensor parallelism: every weight matrix is split over the tp ranks of a group.

The idea: cut an MLP's first matrix by columns and its second by rows; each rank then
computes its share with no communication, and one all-reduce sums the shares.

The math (Megatron-LM, arXiv 1909.08053, section 3) for an MLP Z = GELU(X A) B:
    column split  A = [A1 | A2]:  GELU(X [A1 | A2]) = [GELU(X A1) | GELU(X A2)] = [Y1 | Y2]
    row split     B = [B1 ; B2]:  Z = [Y1 | Y2] [B1 ; B2] = Y1 B1 + Y2 B2
GELU is elementwise, so the column split needs no sum. The forward's one all-reduce,
Z = sum_i Yi Bi, is the operator g; as X feeds every rank's X Ai, the backward sums
dL/dX over the ranks with one more, the operator f.

Who holds what at tp = 2 (the rows of an nn.Linear weight are its output features):
    X (B,T,C) ─f─▶ X A_i (B,T,4C/tp) ─GELU─▶ Y_i ─▶ Y_i B_i (B,T,C), partial ─g─▶ Z
    c_fc (4C x C)    rows 0..2C-1: rank 0, rows 2C..4C-1: rank 1     column-parallel
    c_proj (C x 4C)  the matching input columns, split the same way  row-parallel
    c_attn (3C x C)  [q | k | v] of heads 0..nh/2-1: rank 0, the rest: rank 1
    wte = lm_head    vocabulary rows [0, V/2): rank 0, [V/2, V): rank 1
    LayerNorms, wpe, row-parallel biases: a full copy on every rank  (replicated)
The loss over vocabulary shards takes three all-reduces of (B, T), never one of (B, T, V).
Per layer and step, with E = B*T*C: 2 g forward and 2 f backward, 4 all-reduces of E,
each sending 2(tp-1)/tp * E per rank on a ring, all on the critical path: TP stays
inside a node.

Dropout: a replicated activation (the residual stream, g's output) must get the same
mask on every rank, so it draws from the default generator, seeded alike; a sharded one
(a rank's heads) gets its own, from a per-rank stream (RNGStateTracker.fork).

LoRA's factors (02's apply_lora trains x A^T B^T beside a frozen W): ColumnParallelLoRA
splits B by rows with W, RowParallelLoRA splits A by columns, and the factor each keeps
whole gets its gradient summed by f. They live here because apply_tensor_parallel must
shard any GPT train.py builds, one wrapped by apply_lora too, and 04 imports no later
file.

Run it:  python 04_tensor_parallel.py [--ranks 4]   (relaunches itself under torchrun)
    or:  torchrun --standalone --nproc_per_node=2 04_tensor_parallel.py

What changed from 03b_compression.py: DP (03, 03b) copies the model and splits the
batch, sending gradients (fewer bytes of them in 03b) once per step; TP splits every
matrix, keeps the whole batch and sends activations in every layer. Left out on purpose:
sequence parallelism (next, 04b_sequence_parallel.py); overlap of the backward
all-reduce with the weight gradient's matmul; 2D TP.
"""

import contextlib
import copy
import importlib
import math
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from support.distributed import print0, run_on_ranks
from support.tensor_parallel import sharding
from support.tensor_parallel.sharding import gather_logits, relative_diff, shard_param

model_lib = importlib.import_module("02_model")
merge_tensors = sharding.merge_tensors  # train.py and the tests call these via 04
shard_tensor = sharding.shard_tensor
tp_layout = sharding.tp_layout


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward (entering the TP region)."""

    @staticmethod
    def forward(ctx, x, group):  # (B, T, C), the same on every rank
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):  # this rank's share of dL/dX -> the sum over ranks
        # subtle: reduce a copy, as autograd may share this gradient elsewhere.
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)  # a ring sends 2(tp-1)/tp of it
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward (leaving the TP region)."""

    @staticmethod
    def forward(ctx, x, group):  # (B, T, C): this rank's partial sum Y_i B_i
        x = x.clone()  # a copy, as x is the caller's tensor
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):  # every term of a sum gets the sum's gradient
        return grad, None


class TensorParallelMLP(nn.Module):
    """02's MLP over the ranks of `group`, with f and g in sight (Megatron's Figure 3a).
    This rank keeps c_fc's output rows [r 4C/tp, (r+1) 4C/tp) and the matching input
    columns of c_proj; c_proj's bias is replicated and added once, after g's sum."""

    def __init__(self, mlp, group):
        super().__init__()
        assert mlp.c_fc.bias is not None, "the simple version keeps GPT-2's biases"
        self.fc_weight = shard_param(mlp.c_fc.weight, 0, 1, group)  # (4C/tp, C)
        self.fc_bias = shard_param(mlp.c_fc.bias, 0, 1, group)  # (4C/tp,)
        self.proj_weight = shard_param(mlp.c_proj.weight, 1, 1, group)  # (C, 4C/tp)
        self.proj_bias = mlp.c_proj.bias  # (C,): replicated, the same Parameter
        self.gelu = mlp.gelu
        self.dropout = mlp.dropout  # after g, on a copy: the same mask on every rank
        self.group = group

    def forward(self, x):  # (B, T, C), the same on every rank
        x = CopyToTensorParallel.apply(x, self.group)  # f: dL/dX summed in backward
        y = self.gelu(F.linear(x, self.fc_weight, self.fc_bias))  # (B, T, 4C/tp): Y_i
        z = F.linear(y, self.proj_weight)  # (B, T, C): the partial sum Y_i B_i
        z = ReduceFromTensorParallel.apply(z, self.group)  # g: Z = sum_i Y_i B_i
        return self.dropout(z + self.proj_bias)  # (B, T, C), the same on every rank


# Dropout under TP: a replicated activation (the residual stream, g's output) stays one
# tensor held tp times only if every rank drops the same elements: it draws from the
# default generator, seeded alike. A sharded one (a rank's heads; 04b's token shards) is
# a different piece on each rank, so it draws from a stream of the rank's own.
TP_RNG = "tensor_parallel"  # the name of that stream in checkpoints


class RNGStateTracker:
    """This rank's own dropout stream (Megatron's CudaRNGStatesTracker, one stream).
    `with tracker.fork():` runs the block on it, swapped into the device's default
    generator, which then continues where it was. `.state` is a CPU byte tensor."""

    def __init__(self, device, seed: int):
        self.device = torch.device(device)
        self.state = torch.Generator(device=self.device).manual_seed(seed).get_state()

    def _swap(self, state):
        """Install `state` in the device's default generator; return the old one."""
        if self.device.type == "cuda":
            old = torch.cuda.get_rng_state(self.device)
            torch.cuda.set_rng_state(state, self.device)
        else:
            old = torch.get_rng_state()
            torch.set_rng_state(state)
        return old

    @contextlib.contextmanager
    def fork(self):
        outside = self._swap(self.state)  # the default stream, put aside
        try:
            yield
        finally:
            self.state = self._swap(outside)  # this rank's stream, advanced

    def state_dict(self) -> dict:  # for checkpoints, next to torch's own RNG state
        return {TP_RNG: self.state.clone()}

    def load_state_dict(self, states: dict):
        self.state = states[TP_RNG].clone()


# The layers below cross into and out of the TP region through these two functions, held
# as each layer's `enter` and `leave`: 04b's sequence parallelism swaps in an all-gather
# and a reduce-scatter, and nothing else in a layer changes.
def copy_to_ranks(x, group):
    """f: the input, the same on every rank, enters whole; dL/dX is summed backward."""
    return CopyToTensorParallel.apply(x, group)  # (B, T, in)


def reduce_from_ranks(y, bias, group):
    """g: the ranks' partial sums are summed; then the replicated bias, added once."""
    y = ReduceFromTensorParallel.apply(y, group)  # (B, T, out)
    return y if bias is None else y + bias


class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i from a full nn.Linear: (B, T, in) -> this rank's (B, T, out/tp).
    The replicated input enters through f, so no sum is needed forward."""

    def __init__(self, linear: nn.Linear, group, chunks=1):
        super().__init__()
        self.weight = shard_param(linear.weight, 0, chunks, group)  # (out/tp, in)
        self.bias = shard_param(linear.bias, 0, chunks, group)  # (out/tp,), or None
        self.group = group
        self.enter = copy_to_ranks  # f

    def forward(self, x):  # (B, T, in)
        x = self.enter(x, self.group)  # (B, T, in), the same on every rank
        return F.linear(x, self.weight, self.bias)  # (B, T, out/tp)


class RowParallelLinear(nn.Module):
    """Z = sum_i Y_i B_i from a full nn.Linear: (B, T, in/tp) -> (B, T, out) through g;
    the replicated bias is added after the sum."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        self.weight = shard_param(linear.weight, 1, 1, group)  # (out, in/tp)
        self.bias = linear.bias  # replicated: the same Parameter
        self.group = group
        self.leave = reduce_from_ranks  # g

    def forward(self, x):  # (B, T, in/tp)
        y = F.linear(x, self.weight)  # (B, T, out): the partial sum Y_i B_i
        return self.leave(y, self.bias, self.group)  # (B, T, out): the sum, plus b


class VocabParallelEmbedding(nn.Module):
    """wte by vocabulary: rank r looks up its ids [r V/tp, (r+1) V/tp), writes zeros for
    the others, and g sums over the ranks: (B, T) -> (B, T, C)."""

    def __init__(self, emb: nn.Embedding, group):
        super().__init__()
        self.weight = shard_param(emb.weight, 0, 1, group)  # (V/tp, C)
        self.group = group
        self.leave = reduce_from_ranks  # g

    def forward(self, idx):  # (B, T)
        rows = self.weight.size(0)  # V/tp
        local = idx - dist.get_rank(self.group) * rows
        outside = (local < 0) | (local >= rows)  # the ids another rank owns
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, C)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)  # zeros, and no gradient, there
        return self.leave(x, None, self.group)  # (B, T, C): the rows of every rank


class ParallelSelfAttention(nn.Module):
    """02's CausalSelfAttention on nh/tp whole heads: c_attn column-, c_proj row-parallel."""

    def __init__(self, attn, group, rng):
        super().__init__()
        # chunks=3: the fused [q|k|v] is cut per part, so a rank holds whole heads.
        self.c_attn = parallel_linear(ColumnParallelLinear, attn.c_attn, group, 3)
        self.c_proj = parallel_linear(RowParallelLinear, attn.c_proj, group)
        self.resid_dropout = attn.resid_dropout  # after g, on a copy: one mask
        self.head_dim = attn.head_dim
        self.dropout = attn.dropout
        self.rng = rng

    def forward(self, x):  # (B, T, C)
        qkv = self.c_attn(x)  # (B, T, 3C/tp): [q | k | v] of this rank's heads
        B, T, _ = qkv.shape
        parts = qkv.chunk(3, -1)
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in parts)
        p = self.dropout if self.training else 0.0  # q, k, v: (B, nh/tp, T, hs)
        with self.rng.fork():  # this rank's heads get their own attention-dropout masks
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C/tp)
        return self.resid_dropout(self.c_proj(y))  # (B, T, C)


# LoRA (02's apply_lora, run before TP) adds x A^T B^T to a frozen W. Its factors split
# with W, and f and g tell which whole factor's gradient needs a sum.
class ColumnParallelLoRA(ColumnParallelLinear):
    """02's LoRALinear, column-parallel: W and B by rows, A whole under f."""

    def __init__(self, lora, group, chunks=1):
        super().__init__(lora, group, chunks)  # W and its bias
        self.lora_A = lora.lora_A  # (r, in): whole, the same Parameter
        self.lora_B = shard_param(lora.lora_B, 0, chunks, group)  # (out/tp, r)
        self.scale = lora.scale

    def forward(self, x):  # (B, T, in)
        x = self.enter(x, self.group)  # (B, T, in): one f for both paths
        # Each rank's dA comes from its own out/tp features only, so f sums it.
        a = CopyToTensorParallel.apply(self.lora_A, self.group)
        update = x @ a.T @ self.lora_B.T * self.scale  # (B, T, r) -> (B, T, out/tp)
        return F.linear(x, self.weight, self.bias) + update


class RowParallelLoRA(RowParallelLinear):
    """02's LoRALinear, row-parallel: W and A by columns, B whole under f."""

    def __init__(self, lora, group):
        super().__init__(lora, group)  # W, and the replicated bias
        self.lora_A = shard_param(lora.lora_A, 1, 1, group)  # (r, in/tp)
        self.lora_B = lora.lora_B  # (out, r): whole, the same Parameter
        self.scale = lora.scale

    def forward(self, x):  # (B, T, in/tp)
        # x_i A_i^T is this rank's partial sum of x A^T, so dB is one too: f sums it.
        b = CopyToTensorParallel.apply(self.lora_B, self.group)
        update = x @ self.lora_A.T @ b.T * self.scale  # (B, T, r) -> (B, T, out)
        y = F.linear(x, self.weight) + update  # (B, T, out): both partial sums
        return self.leave(y, self.bias, self.group)  # one g for both


def parallel_linear(cls, linear, group, *args):
    """cls(linear, group, ...), or cls's LoRA subclass for 02's LoRALinear."""
    if isinstance(linear, model_lib.LoRALinear):
        cls = ColumnParallelLoRA if cls is ColumnParallelLinear else RowParallelLoRA
    return cls(linear, group, *args)


def vocab_parallel_cross_entropy(
    logits, targets, reduction="mean", *, group, vocab_size=None
):
    """02's loss from (B, T, V/tp) logit shards: the mean (or sum), over targets not -1,
    of log sum_exp(x) - x[target], in three all-reduces of (B*T,): the max, the target's
    logit and the sum of exp. No backward to write: g's backward is the identity, so each
    shard's gradient is the softmax exp(x)/sum_exp, less 1 at x[target] on its owner."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    x = logits.float().reshape(-1, logits.size(-1))  # (N, V/tp), N = B*T; fp32, as 02
    cols = x.size(-1)  # V/tp: this rank's columns of the vocabulary
    targets = targets.reshape(-1)
    n = torch.arange(len(x), device=x.device)
    first = dist.get_rank(group) * cols  # the vocabulary id of this rank's first column
    if vocab_size is not None and vocab_size - first < cols:  # padding columns here
        pad = max(vocab_size - first, 0)
        x = x.index_fill(1, torch.arange(pad, cols, device=x.device), -math.inf)
    m = x.detach().max(dim=-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)  # 1: the global max
    x = x - m.unsqueeze(-1)  # exp(x - m) <= 1, so no overflow; a constant, no gradient
    local = targets - first  # (N,) the target ids, in this rank's columns
    mine = (local >= 0) & (local < cols)  # this rank holds the target's column
    picked = torch.where(mine, x[n, local.clamp(0, cols - 1)], 0.0)  # x[n, target_n]
    target_logit = ReduceFromTensorParallel.apply(picked, group)  # 2: from its owner
    sum_exp = ReduceFromTensorParallel.apply(x.exp().sum(dim=-1), group)  # 3: the sum
    keep = targets != -1  # 02's ignore_index
    losses = torch.where(keep, sum_exp.log() - target_logit, 0.0)  # (N,)
    return losses.sum() if reduction == "sum" else losses.sum() / keep.sum()


def grad_norm_squared(grads, group, device) -> torch.Tensor:
    """The whole model's squared gradient norm from this rank's (parameter, gradient)
    pairs, the same on every TP rank (for clipping). A slice (marked `tensor_parallel` by
    shard_param): the ranks' sums of squares add up to the whole's. A copy is alike on
    every rank (f made it so): summed over ranks it would count tp times, so add it once."""
    sharded = torch.zeros((), device=device)
    replicated = torch.zeros((), device=device)
    for p, g in grads:
        if getattr(p, "tensor_parallel", False):
            sharded += g.float().pow(2).sum()
        else:
            replicated += g.float().pow(2).sum()
    dist.all_reduce(sharded, group=group)
    return sharded + replicated


def check_tp_config(config, tp: int):
    """Assert that this GPTConfig splits tp ways, before any collective runs."""
    cannot = f"cannot split this GPT over tp={tp} ranks"
    # A rank holds whole heads; as C = nh * hs, n_head % tp == 0 splits C and 4C too.
    heads = f"n_head={config.n_head} is not divisible by tp={tp} (whole heads)"
    assert config.n_head % tp == 0, f"{cannot}: {heads}"
    V = config.padded_vocab_size
    fix = sharding.padding_hint(config, tp)  # the padding that would split
    assert V % tp == 0, f"{cannot}: the vocabulary has {V} rows {fix}"


def apply_tensor_parallel(model, group, *, seed=None):
    """Shard a 02_model.GPT, built alike on every rank, over the TP `group` in place.
    model(idx, targets) then returns this rank's (B, T, V/tp) logits and the full mean
    loss; 02's state-dict keys, embed, blocks, head and loss_fn still work. Dropout's
    per-rank stream is seeded (seed or torch.initial_seed()) + 1 + world_size + rank,
    apart from seed + 1 ... seed + world_size, which callers may give default streams.
    04b's apply_sequence_parallel starts here."""
    if group is None:
        raise ValueError("pass the TP process group explicitly (dist.new_group(ranks))")
    if getattr(model.loss_fn, "func", None) is not model_lib.cross_entropy_loss:
        raise ValueError("already tensor-parallel, or 06b's chunked loss: not under TP")
    check_tp_config(model.config, dist.get_world_size(group))  # before any collective
    different = "weights differ across TP ranks: torch.manual_seed alike before GPT()"
    sharding.check_same_on_ranks(list(model.parameters()), group, different)
    t = model.transformer
    seed = (torch.initial_seed() if seed is None else seed) + 1 + dist.get_world_size()
    rng = RNGStateTracker(t.wte.weight.device, (seed + dist.get_rank()) % 2**63)
    tied = model.lm_head.weight is t.wte.weight
    t.wte = VocabParallelEmbedding(t.wte, group)
    # The head gives this rank's (B, T, V/tp) logits; a tied one reuses wte's shard.
    model.lm_head = ColumnParallelLinear(model.lm_head, group)
    if tied:
        model.lm_head.weight = t.wte.weight
    for block in t.h:  # the LayerNorms and dropouts between f and g stay copies
        block.attn = ParallelSelfAttention(block.attn, group, rng)
        mlp = block.mlp
        mlp.c_fc = parallel_linear(ColumnParallelLinear, mlp.c_fc, group)
        mlp.c_proj = parallel_linear(RowParallelLinear, mlp.c_proj, group)
    V = model.config.vocab_size
    model.loss_fn = partial(vocab_parallel_cross_entropy, group=group, vocab_size=V)
    model.tp_group = group
    model.tp_rng = rng
    return model


def demo_mlp(args, config, group, device):
    """The simple version: 02's MLP sharded by hand, against itself whole."""
    rank = dist.get_rank(group)
    tp = dist.get_world_size(group)
    torch.manual_seed(args.seed)  # the same MLP, X and dL/dZ on every rank
    full = model_lib.MLP(config).to(device)
    x = torch.randn(args.batch_size, config.block_size, config.n_embd, device=device)
    dz = torch.randn_like(x)  # a given dL/dZ: the loss is sum(Z * dz)
    x_full = x.clone().requires_grad_()
    z_full = full(x_full)
    (z_full * dz).sum().backward()
    mlp = TensorParallelMLP(copy.deepcopy(full), group)
    x_tp = x.clone().requires_grad_()
    with sharding.count_comm() as forward:  # every collective, with its bytes
        z = mlp(x_tp)
    with sharding.count_comm() as backward:
        (z * dz).sum().backward()
    once = [("all_reduce", x.numel() * x.element_size())]  # one of (B, T, C)
    assert forward == once, f"g all-reduces once forward, not {forward}"
    assert backward == once, f"f all-reduces once backward, not {backward}"
    d_grad = [relative_diff(x_tp.grad, x_full.grad)]
    d_grad.append(relative_diff(mlp.proj_bias.grad, full.c_proj.bias.grad))
    pairs = [(mlp.fc_weight, full.c_fc.weight, 0), (mlp.fc_bias, full.c_fc.bias, 0)]
    pairs.append((mlp.proj_weight, full.c_proj.weight, 1))
    for mine, whole, dim in pairs:  # each shard against its slice of the whole
        d_grad.append(relative_diff(mine.grad, whole.grad.chunk(tp, dim)[rank]))
    diffs = {"output": relative_diff(z, z_full), "any gradient": max(d_grad)}
    worst = sharding.equal_over_ranks(diffs, group, "the TP MLP")
    print0(f"MLP alone at tp={tp}: 1 all-reduce forward (g), 1 backward (f)")
    print0(f"  equals the unsharded MLP: max relative |diff| {worst}")


def step_against_whole(model, full, x, y, group, device):
    """One forward + backward of a sharded GPT, its collectives counted, against the
    whole model's: max |diff| of the logits, the loss, every gradient (each against its
    slice of the whole's) and the gradient norm, as text; the count_comm log; and the
    parameters this rank holds, as a share of the whole's."""
    full.zero_grad(set_to_none=True)
    logits_full, loss_full = full(x, y)
    loss_full.backward()
    want = sharding.grad_shards(full, group)  # each gradient, or this rank's slice
    norm_full = torch.stack([p.grad.norm() for p in full.parameters()]).norm()
    with sharding.count_comm() as log:  # every collective of the step, with bytes
        logits, loss = model(x, y)
        loss.backward()
    grads = [(p, p.grad) for p in model.parameters()]
    norm = grad_norm_squared(grads, group, device).sqrt()
    diffs = {"logits": (gather_logits(logits, group) - logits_full).abs().max()}
    diffs["loss"] = (loss - loss_full).abs()
    params = model.named_parameters()
    diffs["any gradient"] = max((p.grad - want[n]).abs().max() for n, p in params)
    diffs["gradient norm"] = (norm - norm_full).abs()
    worst = sharding.equal_over_ranks(diffs, group, "the sharded GPT")
    n_rank = sum(p.numel() for p in model.parameters())
    share = n_rank / sum(p.numel() for p in full.parameters())
    return worst, log, share


def demo_gpt(args, config, group, device):
    """The whole GPT sharded by apply_tensor_parallel, against the unsharded model."""
    tp = dist.get_world_size(group)
    torch.manual_seed(args.seed)  # the same whole model on every rank, sliced after
    full = model_lib.GPT(config).to(device)
    model = apply_tensor_parallel(copy.deepcopy(full), group)
    B = args.batch_size
    T = config.block_size
    # The same batch on every rank: TP splits the model, not the data.
    [(x, y)] = model_lib.byte_batches(T, B, seed=args.seed, device=device)
    print0(f"GPT '{args.preset}' (nh={config.n_head}), (B, T) = ({B}, {T}), fp32")
    worst, log, share = step_against_whole(model, full, x, y, group, device)
    print0(f"tp={tp}: max |diff| {worst}")
    share = f"{share:.1%} of the whole (1/tp = {1 / tp:.1%})"
    print0(f"  parameters per rank {share}: LayerNorms, wpe, row biases are copies")
    sharding.check_comm(log, config, B, T, sp=False)  # each collective's bytes
    E = B * T * config.n_embd * 4  # the bytes of one (B, T, C) activation in fp32
    calls, sent = sharding.ring_sent(log, tp, E)  # the all-reduces of (B, T, C)
    assert calls == 4 * config.n_layer + 2, f"{calls} all-reduces of (B, T, C)"
    print0(f"  {calls} all-reduces of (B, T, C): {sent:,} bytes sent per rank")
    print0("  (2 g and 2 f a layer, the embedding's g, the head's f)")
    with torch.no_grad():
        logits = model(x)[0]  # this rank's (B, T, V/tp)
        with sharding.count_comm() as log:
            model.loss_fn(logits, y)  # the loss alone, from the logit shards
    assert log == [("all_reduce", 4 * B * T)] * 3, f"the loss's collectives: {log}"
    V = config.padded_vocab_size
    vs = f"{4 * B * T:,} bytes each, not the {4 * B * T * V:,} of (B, T, V)"
    print0(f"the loss over V/tp columns: 3 all-reduces of (B, T), {vs}")


def demo_dropout(args, group, device):
    """Dropout under TP: copies draw one mask on every rank, shards a mask of their own."""
    tp = dist.get_world_size(group)
    torch.manual_seed(args.seed)  # the default stream, alike on every rank
    seed = args.seed + 1 + dist.get_rank()  # this rank's own stream, as in the model
    tracker = RNGStateTracker(device, seed)
    drop = nn.Dropout(0.5)
    ones = torch.ones(1024, device=device)
    copy_mask = drop(ones)  # a replicated region: the default stream
    with tracker.fork():  # a sharded region (a rank's heads): its own stream
        shard_mask = drop(ones)
    # A copy's mask, a shard's, then a copy's again: the fork left the default alone.
    masks = torch.stack([copy_mask, shard_mask, drop(ones)])
    alike = sharding.same_on_ranks(masks, group)  # per mask: every rank drew it?
    assert alike[0] and alike[2], "the ranks drew different masks for a copy"
    assert tp == 1 or not alike[1], "the ranks drew one mask for different shards"
    same = "the same mask on every rank"
    print0(f"dropout: a replicated activation gets {same}: {alike[0] and alike[2]};")
    print0(f"  a sharded one (a rank's heads, under fork()) gets {same}: {alike[1]}")


def add_arguments(parser):
    parser.add_argument("--preset", default="small", help="02's preset; small: 4 heads")
    parser.add_argument("--batch-size", type=int, default=8, help="B, the batch")
    parser.add_argument("--seed", type=int, default=1337, help="model and batch, alike")


def demo_config(args, tp: int):
    """02's preset, bytes as tokens: 256 rows, padded to a multiple of 64 and of tp."""
    sizes = dict(vocab_size=256, pad_vocab_multiple=math.lcm(64, tp), dropout=0.0)
    config = model_lib.GPTConfig.from_preset(args.preset, **sizes)
    check_tp_config(config, tp)  # run_on_ranks checks before any rank starts
    return config


def demo(args, rank, world_size, device):
    """The MLP, then the whole GPT, then dropout, on one TP group of every rank."""
    config = demo_config(args, world_size)
    group = dist.new_group(list(range(world_size)))  # the TP group: every rank
    demo_mlp(args, config, group, device)
    demo_gpt(args, config, group, device)
    demo_dropout(args, group, device)


def main(argv=None):
    run_on_ranks(demo, argv, __file__, __doc__, add_arguments, demo_config)


if __name__ == "__main__":
    main()
