"""04_tensor_parallel.py: each layer, and the whole GPT, sharded over tp = 2 and 4 gloo
ranks, must compute what the unsharded layer or model computes: outputs, loss, and every
gradient, each shard against the matching slice of the full gradient.

Starting a rank costs a second or two, so one world per world size runs every case
(`CASES`, in order) and the tests below read its per-case verdicts. Shapes are tiny:
L=2, nh=4, C=32, T=16, vocab 100 padded to 128 (so padding rows exist and split evenly
over 2 and 4 ranks). Each case takes `sp`: tests/test_sequence_parallel.py runs the
same cases (and its own) with 04b's sequence parallelism on top of 04's split."""

import contextlib
import copy
import importlib
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from support import distributed
from tests.distributed import run_ranks

tp_lib = importlib.import_module("04_tensor_parallel")
sp_lib = importlib.import_module("04b_sequence_parallel")
model_lib = importlib.import_module("02_model")
sharding = importlib.import_module("support.tensor_parallel.sharding")  # count_comm, comm_formula
GPT = model_lib.GPT
GPTConfig = model_lib.GPTConfig

B = 2
T = 16
WORLD_SIZES = [2, 4]


def tiny(**overrides):
    base = dict(
        n_layer=2,
        n_head=4,
        n_embd=32,
        block_size=T,
        vocab_size=100,
        pad_vocab_multiple=64,
    )
    return GPTConfig(**{**base, **overrides})


def close(actual, expected, what):
    """fp32, same math, different summation order: the sharded model adds per-rank partial
    sums (then all-reduces them) where the full model adds in one kernel, so results
    differ by rounding, ~1e-7 relative per addition and a few additions deep (observed:
    <= ~1e-6 of the tensor's scale). atol is 1e-5 of the tensor's largest entry and rtol
    1e-4: well above that rounding, and far below any real bug (a wrong slice, a missing
    or doubled reduction), which is an error of the order of the values themselves."""
    scale = expected.detach().abs().max().item()
    torch.testing.assert_close(
        actual,
        expected,
        rtol=1e-4,
        atol=1e-5 * max(scale, 1e-12),
        msg=lambda m: f"{what}: {m}",
    )


# The parameters apply_tensor_parallel slices (the others are copies).
SHARDED = (
    "c_attn.weight",
    "c_attn.bias",
    "c_fc.weight",
    "c_fc.bias",
    "c_proj.weight",
    "wte.weight",
    "lm_head.weight",
)


def shard_of(name, full, rank, tp):
    """The slice of a full tensor that `rank` should hold, written out here independently
    of 04's own table: [q|k|v] rows cut per part (whole heads), output features and
    vocabulary rows cut by rows, row-parallel weights cut by input columns, everything
    else replicated."""
    if name.endswith("c_attn.lora_B"):  # LoRA (02): B cut as its weight's rows, A whole
        return torch.cat([part.chunk(tp, 0)[rank] for part in full.chunk(3, 0)])
    if name.endswith("c_fc.lora_B"):
        return full.chunk(tp, 0)[rank]
    # row-parallel: A cut as its weight's columns, B whole
    if name.endswith("c_proj.lora_A"):
        return full.chunk(tp, 1)[rank]
    if name.endswith(("c_attn.weight", "c_attn.bias")):
        return torch.cat([part.chunk(tp, 0)[rank] for part in full.chunk(3, 0)])
    if name.endswith(("wte.weight", "lm_head.weight", "c_fc.weight", "c_fc.bias")):
        return full.chunk(tp, 0)[rank]
    if name.endswith("c_proj.weight"):
        return full.chunk(tp, 1)[rank]
    return full


def compare_grads(full_model, tp_model, rank, tp, what):
    """Every parameter's gradient: the shard against the matching slice of the full
    gradient."""
    full = dict(full_model.named_parameters())
    names = [name for name, _ in tp_model.named_parameters()]
    assert sorted(names) == sorted(full), f"{what}: parameter names changed"
    for name, p in tp_model.named_parameters():
        assert p.grad is not None, f"{what}: {name} got no gradient"
        close(
            p.grad, shard_of(name, full[name].grad, rank, tp), f"{what}: grad of {name}"
        )


def batch(seed, vocab=100, t=T):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (B, t), generator=gen)
    targets = torch.randint(0, vocab, (B, t), generator=gen)
    targets[0, :3] = -1  # ignored positions take no part in the loss
    return idx, targets


def apply(model, group, sp):
    """04's apply_tensor_parallel, or with sp 04b's apply_sequence_parallel (built on
    it)."""
    if sp:
        return sp_lib.apply_sequence_parallel(model, group)
    return tp_lib.apply_tensor_parallel(model, group)


def layer(module, sp):
    """A layer as 04 builds it, or with sp switched to 04b's sequence parallelism."""
    return sp_lib.to_sequence_parallel(module) if sp else module


def gpt_pair(group, sp, tied=True, dropout=0.0, seed=0):
    """The same GPT twice: whole, and sharded by `apply` (built identically first)."""
    torch.manual_seed(seed)
    full = GPT(tiny(tie_embeddings=tied, dropout=dropout))
    return full, apply(copy.deepcopy(full), group, sp)


def seq(t, rank, tp, sp):
    """With sequence parallelism a rank holds tokens [rank T/tp, (rank+1) T/tp) of dim 1."""
    return t.chunk(tp, 1)[rank] if sp else t


def gather(t, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def merge_shards(state_dicts):
    """train.py's export: the TP ranks' state dicts, in tp_rank order -> 02's full state
    dict."""
    export = importlib.import_module("support.train.export")
    return export.merge_shards(state_dicts, tp_lib.tp_layout, tp_lib.merge_tensors)


def consolidate_state_dict(model, group) -> dict:
    """The full state dict of a TP model on every rank: every rank's state dict, gathered
    on the CPU, merged as train.py's export merges saved ones. Loads into GPT(config),
    strict=True."""
    mine = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    state_dicts = [None] * dist.get_world_size(group)
    dist.all_gather_object(state_dicts, mine, group=group)
    return merge_shards(state_dicts)


# --------------------------------------------------------------------------------------
# the cases, run inside each world
# --------------------------------------------------------------------------------------
def case_mlp(rank, tp, group, sp):
    """The simple version, 02's MLP with f and g written out: output, dX and every
    gradient equal the whole MLP's (each shard against its slice), with exactly one
    all-reduce of (B, T, C) forward (g) and one backward (f)."""
    torch.manual_seed(0)
    full = model_lib.MLP(tiny())
    x = torch.randn(B, T, 32, requires_grad=True)
    upstream = torch.randn(B, T, 32)  # a fixed dL/dZ: L = sum(Z * upstream)
    (full(x) * upstream).sum().backward()
    mlp = tp_lib.TensorParallelMLP(copy.deepcopy(full), group)
    x_tp = x.detach().clone().requires_grad_()
    with sharding.count_comm() as forward:
        z = mlp(x_tp)
    with sharding.count_comm() as backward:
        (z * upstream).sum().backward()
    E = B * T * 32 * 4  # bytes of one fp32 (B, T, C)
    assert forward == [("all_reduce", E)], f"forward: g once, got {forward}"
    assert backward == [("all_reduce", E)], f"backward: f once, got {backward}"
    close(z, full(x).detach(), "MLP: output")
    close(x_tp.grad, x.grad, "MLP: input grad")
    close(mlp.fc_weight.grad, full.c_fc.weight.grad.chunk(tp, 0)[rank], "MLP: c_fc dW")
    close(mlp.fc_bias.grad, full.c_fc.bias.grad.chunk(tp, 0)[rank], "MLP: c_fc db")
    close(
        mlp.proj_weight.grad,
        full.c_proj.weight.grad.chunk(tp, 1)[rank],
        "MLP: c_proj dW",
    )
    close(mlp.proj_bias.grad, full.c_proj.bias.grad, "MLP: c_proj db (replicated)")


def case_column_linear(rank, tp, group, sp):
    """Y_i = X A_i: the rank's output columns, and f's all-reduce makes dX the full dX
    (SP: the all-gather's reduce-scatter gives this rank's tokens of it)."""
    torch.manual_seed(1)
    full = nn.Linear(8, 4 * tp)
    x = torch.randn(B, 2 * tp, 8, requires_grad=True)
    upstream = torch.randn(B, 2 * tp, 4 * tp)  # a fixed dL/dY: L = sum(Y * dY)
    (full(x) * upstream).sum().backward()
    col = layer(tp_lib.ColumnParallelLinear(full, group), sp)
    x_local = seq(x.detach(), rank, tp, sp).clone().requires_grad_()
    y = col(x_local)  # (B, T, out/tp)
    close(y, full(x).detach().chunk(tp, -1)[rank], f"column sp={sp}: output")
    (y * upstream.chunk(tp, -1)[rank]).sum().backward()
    close(x_local.grad, seq(x.grad, rank, tp, sp), f"column sp={sp}: input grad")
    close(col.weight.grad, full.weight.grad.chunk(tp, 0)[rank], f"column sp={sp}: dW")
    close(col.bias.grad, full.bias.grad.chunk(tp, 0)[rank], f"column sp={sp}: db")
    close(
        tp_lib.gather_logits(y, group),
        full(x).detach(),
        f"column sp={sp}: all of Y",
    )


def case_row_linear(rank, tp, group, sp):
    """Z = sum_i Y_i B_i: g sums the partial products; the bias is added once (SP: the
    reduce-scatter leaves this rank's tokens, and f sums the bias's gradient)."""
    torch.manual_seed(2)
    full = nn.Linear(4 * tp, 8)
    x = torch.randn(B, 2 * tp, 4 * tp, requires_grad=True)
    upstream = torch.randn(B, 2 * tp, 8)
    (full(x) * upstream).sum().backward()
    row = layer(tp_lib.RowParallelLinear(full, group), sp)
    x_in = x.detach().clone().requires_grad_()
    z = row(x_in.chunk(tp, -1)[rank])  # (B, T, in/tp): this rank's input columns
    close(z, seq(full(x).detach(), rank, tp, sp), f"row sp={sp}: output")
    (z * seq(upstream, rank, tp, sp)).sum().backward()
    # every rank's slice
    x_grad = torch.cat(gather(x_in.grad.chunk(tp, -1)[rank], group), -1)
    close(x_grad, x.grad, f"row sp={sp}: input grad")
    close(row.weight.grad, full.weight.grad.chunk(tp, 1)[rank], f"row sp={sp}: dW")
    close(row.bias.grad, full.bias.grad, f"row sp={sp}: db (replicated)")


def case_vocab_embedding(rank, tp, group, sp):
    """Each rank looks up the ids it owns; the sum over ranks is the full lookup."""
    torch.manual_seed(3)
    full = nn.Embedding(8 * tp, 6)
    idx = torch.randint(0, 8 * tp, (B, 2 * tp))  # ids from every rank's range
    upstream = torch.randn(B, 2 * tp, 6)
    (full(idx) * upstream).sum().backward()
    emb = layer(tp_lib.VocabParallelEmbedding(full, group), sp)
    out = emb(idx)
    close(out, seq(full(idx).detach(), rank, tp, sp), f"embedding sp={sp}: output")
    (out * seq(upstream, rank, tp, sp)).sum().backward()
    close(
        emb.weight.grad,
        full.weight.grad.chunk(tp, 0)[rank],
        f"embedding sp={sp}: dW",
    )


def case_cross_entropy(rank, tp, group, sp):
    """Three all-reduces give F.cross_entropy's loss and gradient, from vocabulary shards,
    also with a logit of 200 (exp overflows fp32 without the max) and ignored targets.
    """
    torch.manual_seed(4)
    V = 16 * tp
    logits = torch.randn(B, T, V) * 3
    logits[1, 2, 5] = 200.0
    targets = torch.randint(0, V, (B, T))
    targets[0, :4] = -1
    for reduction in ("mean", "sum"):
        full = logits.clone().requires_grad_()
        flat = full.view(-1, V)
        flat_targets = targets.view(-1)
        expected = F.cross_entropy(
            flat, flat_targets, ignore_index=-1, reduction=reduction
        )
        expected.backward()
        local = logits.chunk(tp, -1)[rank].clone().requires_grad_()
        loss = tp_lib.vocab_parallel_cross_entropy(
            local, targets, reduction, group=group
        )
        close(loss, expected.detach(), f"cross-entropy {reduction}: loss")
        loss.backward()
        close(
            local.grad,
            full.grad.chunk(tp, -1)[rank],
            f"cross-entropy {reduction}: grad",
        )
    # the last 5 columns padding (the last rank's), rigged to win: 02's masked loss, and
    # no gradient there (so the vocab-parallel loss masks the same global columns 02
    # does)
    logits[..., V - 5 :] = 50.0
    full = logits.clone().requires_grad_()
    local = logits.chunk(tp, -1)[rank].clone()
    expected = model_lib.cross_entropy_loss(
        full, targets.clamp(max=V - 6), vocab_size=V - 5
    )
    local.requires_grad_()
    loss = tp_lib.vocab_parallel_cross_entropy(
        local, targets.clamp(max=V - 6), group=group, vocab_size=V - 5
    )
    close(loss, expected.detach(), "cross-entropy with padding: loss")
    expected.backward()
    loss.backward()
    close(local.grad, full.grad.chunk(tp, -1)[rank], "cross-entropy with padding: grad")
    assert full.grad[..., V - 5 :].abs().max() == 0, "padding columns got a gradient"
    # the last rank's columns all padding (a tp that splits a small vocabulary finely):
    # 0 * -inf there must not turn the target logit into NaN
    real = 16 * (tp - 1) if tp > 1 else 10
    full = logits.clone().requires_grad_()
    local = logits.chunk(tp, -1)[rank].clone()
    expected = model_lib.cross_entropy_loss(full, targets % real, vocab_size=real)
    local.requires_grad_()
    loss = tp_lib.vocab_parallel_cross_entropy(
        local, targets % real, group=group, vocab_size=real
    )
    close(loss, expected.detach(), "cross-entropy, a rank of padding only: loss")
    expected.backward()
    loss.backward()
    close(
        local.grad,
        full.grad.chunk(tp, -1)[rank],
        "cross-entropy, a rank of padding only: grad",
    )


def case_attention(rank, tp, group, sp):
    """Whole heads per rank: column-parallel [q|k|v], row-parallel c_proj."""
    torch.manual_seed(5)
    full = model_lib.CausalSelfAttention(tiny())
    x = torch.randn(B, T, 32, requires_grad=True)
    upstream = torch.randn(B, T, 32)
    (full(x) * upstream).sum().backward()
    rng = tp_lib.RNGStateTracker("cpu", seed=100 + rank)
    attn = layer(tp_lib.ParallelSelfAttention(full, group, rng), sp)
    x_local = seq(x.detach(), rank, tp, sp).clone().requires_grad_()
    y = attn(x_local)
    close(y, seq(full(x).detach(), rank, tp, sp), f"attention sp={sp}: output")
    (y * seq(upstream, rank, tp, sp)).sum().backward()
    close(x_local.grad, seq(x.grad, rank, tp, sp), f"attention sp={sp}: input grad")
    compare_grads(full, attn, rank, tp, f"attention sp={sp}")


def _check_gpt(rank, tp, group, sp, tied, seed=0):
    full, tpm = gpt_pair(group, sp, tied, seed=seed)
    idx, targets = batch(seed)
    logits_full, loss_full = full(idx, targets)
    loss_full.backward()
    logits, loss = tpm(idx, targets)
    loss.backward()
    what = f"GPT tp={tp} sp={sp} tied={tied}"
    assert logits.shape == (B, T, 128 // tp), (
        f"{what}: logits are this rank's vocab shard"
    )
    close(tp_lib.gather_logits(logits, group), logits_full.detach(), f"{what}: logits")
    close(loss, loss_full.detach(), f"{what}: loss")
    compare_grads(full, tpm, rank, tp, what)
    return full, tpm, idx, targets, loss


def case_gpt(rank, tp, group, sp):
    """The whole GPT, tied and untied; the pieces a pipeline stage calls (embed, blocks,
    head, loss_fn) pass (B, T, C), or (B, T/tp, C) with SP; export rebuilds the full
    weights."""
    for tied in (True, False):
        full, tpm, idx, targets, loss = _check_gpt(rank, tp, group, sp, tied)
        assert type(tpm.transformer.h[0].mlp.c_fc) is tp_lib.ColumnParallelLinear
        x = tpm.embed(idx)
        for block in tpm.transformer.h:
            assert x.shape == (B, T // tp if sp else T, 32), (
                f"sp={sp}: stage shape {x.shape}"
            )
            x = block(x)
        again = tpm.loss_fn(tpm.head(x), targets, "mean")
        # the same ops, in order
        torch.testing.assert_close(again, loss, rtol=0, atol=0)
        sd = consolidate_state_dict(tpm, group)  # the all-gather export
        rebuilt = GPT(tiny(tie_embeddings=tied))
        rebuilt.load_state_dict(sd, strict=True)
        for k, v in full.state_dict().items():  # slicing and concatenation: exact
            torch.testing.assert_close(rebuilt.state_dict()[k], v, rtol=0, atol=0)
    # the untied one's: the parent merges them offline, as train.py --export does
    return {k: v.clone() for k, v in tpm.state_dict().items()}


def case_lora(rank, tp, group, sp):
    """LoRA's factors split with their base weights (column-parallel: A whole, B by rows;
    row-parallel: A by columns, B whole): the logits, the loss and every factor's
    gradient equal one process's; the frozen weights get none. B starts non-zero here,
    so that A's gradient is not 0 (at B = 0 it is, which would hide a missing f on A)."""
    torch.manual_seed(0)
    full = model_lib.apply_lora(GPT(tiny()), rank=4, alpha=8.0)
    with torch.no_grad():
        for name, p in full.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(std=0.05)
    tpm = apply(copy.deepcopy(full), group, sp)
    # LoRA's own sharded wrappers; the head stays plain
    block = tpm.transformer.h[0]
    assert type(block.attn.c_attn) is tp_lib.ColumnParallelLoRA
    assert type(block.mlp.c_proj) is tp_lib.RowParallelLoRA
    assert type(tpm.lm_head) is tp_lib.ColumnParallelLinear
    idx, targets = batch(3)
    logits_full, loss_full = full(idx, targets)
    loss_full.backward()
    logits, loss = tpm(idx, targets)
    loss.backward()
    what = f"LoRA tp={tp} sp={sp}"
    close(
        tp_lib.gather_logits(logits, group), logits_full.detach(), f"{what}: logits"
    )
    close(loss, loss_full.detach(), f"{what}: loss")
    full_params = dict(full.named_parameters())
    trained = []
    for name, p in tpm.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, f"{what}: frozen {name} got a gradient"
            continue
        trained.append(name)
        close(
            p.grad,
            shard_of(name, full_params[name].grad, rank, tp),
            f"{what}: {name}",
        )
    assert len(trained) == 4 * 2 * 2 and all("lora_" in n for n in trained), trained


def case_gpt_in_subgroups(rank, world, group, sp):
    """TP inside a bigger world: two TP groups of world/2 ranks side by side (as under DP),
    each with its own batch. Anything using the world's rank or size instead of the
    group's would slice or reduce wrongly here."""
    half = world // 2
    # every rank calls both
    groups = [dist.new_group(list(range(s, s + half))) for s in (0, half)]
    sub = groups[rank // half]
    _check_gpt(rank % half, half, sub, sp, tied=True, seed=10 + rank // half)


def case_training(rank, tp, group, sp):
    """Four AdamW steps: the sharded run's loss curve and final weights equal one
    process's."""
    full, tpm = gpt_pair(group, sp)
    curves = []
    for model in (full, tpm):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        losses = []
        for step in range(4):
            _, loss = model(*batch(100 + step))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        curves.append(torch.stack(losses))
    close(curves[1], curves[0], f"training sp={sp}: loss curve")
    trained = consolidate_state_dict(tpm, group)
    for k, v in full.state_dict().items():
        got = trained[k]
        # q and v thirds only: the key bias, see below
        if k.endswith("c_attn.bias"):
            got = torch.cat([got[:32], got[64:]])
            v = torch.cat([v[:32], v[64:]])
        # AdamW moves a weight by ~lr = 1e-2 per step whatever its gradient's size
        # (m/sqrt(v) is scale-free), so rounding in a near-zero gradient can become
        # ~1e-4 of a step (observed: 4.5e-6 after 4 steps). atol 4e-5 = 1e-3 of lr
        # per step: ~10x that, and 250x below one step's move, which any wrong
        # gradient would show. The key bias is left out: its true gradient is
        # exactly 0 (q.b_k is the same for every key and softmax ignores constants),
        # so both runs only see rounding noise there, and Adam turns noise into
        # lr-sized steps.
        msg = f"training sp={sp}: {k} after 4 steps"
        torch.testing.assert_close(got, v, rtol=0, atol=4e-5, msg=msg)


def case_replicated_grads_identical(rank, tp, group, sp):
    """Replicated parameters (LayerNorms, wpe, row biases) end backward with the same
    gradient, bit for bit, on every TP rank, also with SP (each rank saw only its
    tokens, so only the reduction by f makes them equal) and with dropout. Exactly the
    sharded ones are flagged."""
    _, tpm = gpt_pair(group, sp, dropout=0.1)
    torch.manual_seed(7)
    tpm.train()
    _, loss = tpm(*batch(1))
    loss.backward()
    for name, p in tpm.named_parameters():
        flagged = getattr(p, "tensor_parallel", False)
        assert flagged == name.endswith(SHARDED), (
            f"{name}: tensor_parallel={flagged}"
        )
        if not flagged:
            grads = gather(p.grad, group)
            assert all(torch.equal(grads[0], gr) for gr in grads), (
                f"sp={sp}: {name} differs"
            )


def case_dropout(rank, tp, group, sp):
    """With dropout on, replicated activations (embedding output, every block's residual
    stream) are identical across TP ranks; the per-rank stream for sharded regions
    (attention's heads) differs by rank. (04b's token shards: test_sequence_parallel.)"""
    _, tpm = gpt_pair(group, sp=False, dropout=0.1)
    seen = []
    for module in [tpm.transformer.drop, *tpm.transformer.h]:
        module.register_forward_hook(lambda mod, inp, out: seen.append(out.detach()))
    torch.manual_seed(8)  # the default stream, the same on every rank
    idx, _ = batch(2)
    tpm.train()
    tpm(idx)
    train_out = seen[-1]
    for i, act in enumerate(seen):
        parts = gather(act, group)
        assert all(torch.equal(parts[0], a) for a in parts), (
            f"activation {i} differs across ranks"
        )
    tpm.eval()
    tpm(idx)
    assert not torch.allclose(seen[-1], train_out), "dropout did nothing in train mode"
    with tpm.tp_rng.fork():
        mine = torch.rand(16)
    default = torch.rand(16)
    mine_all = gather(mine, group)
    default_all = gather(default, group)
    assert all(torch.equal(default_all[0], d) for d in default_all), (
        "default stream differs"
    )
    assert len({tuple(m.tolist()) for m in mine_all}) == tp, (
        "TP streams must differ by rank"
    )
    # attention dropout: inside fork()?
    draws = []
    sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = lambda *a, **k: (
        draws.append(torch.rand(8)),
        sdpa(*a, **k),
    )[1]
    try:
        tpm.train()
        tpm(idx)
    finally:
        F.scaled_dot_product_attention = sdpa
    heads_draws = gather(torch.stack(draws), group)  # what SDPA's dropout would draw
    assert len({tuple(d.flatten().tolist()) for d in heads_draws}) == tp, (
        "heads need own masks"
    )


COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "barrier",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "send",
    "recv",
)


@contextlib.contextmanager
def no_collectives():
    """Inside, any collective raises; after, the list of those that ran must be empty:
    a bad configuration must fail on every rank before any collective runs."""
    ran = []
    saved = {name: getattr(dist, name) for name in COLLECTIVES}

    def trap(name):
        def collective(*args, **kwargs):
            ran.append(name)
            raise AssertionError(f"{name} ran before validation")

        return collective

    try:
        for name in COLLECTIVES:
            setattr(dist, name, trap(name))
        yield ran
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    assert ran == [], f"collectives ran before the error: {ran}"


def case_bad_config(rank, tp, group, sp):
    """Bad configurations fail with a clear message on every rank before any collective
    runs."""
    bad = [
        (dict(n_head=3, n_embd=24), f"n_head=3 is not divisible by tp={tp}"),
        (dict(vocab_size=101, pad_vocab_multiple=1), "pad_vocab_multiple=64"),
    ]
    with no_collectives():
        for overrides, message in bad:
            with pytest.raises(AssertionError, match=message):
                apply(GPT(tiny(**overrides)), group, sp)
        with pytest.raises(ValueError, match="explicitly"):
            apply(GPT(tiny()), None, sp)
    torch.manual_seed(rank)  # a different model on every rank: caught by the checksum
    with pytest.raises(ValueError, match="differ across TP ranks"):
        apply(GPT(tiny()), group, sp)


def case_comm_volume(rank, tp, group, sp):
    """The collectives of one training step, counted (support/tensor_parallel/sharding's count_comm wraps
    torch.distributed's functions), against the lesson's formula (its comm_formula),
    derived here: E = B*T*C fp32 elements. Without SP: the embedding's g, per layer 2 g
    (forward) + 2 f (backward), the head's f = 4L+2 all-reduces of E, plus the loss's 3
    of B*T. With SP each of those becomes an all-gather and a reduce-scatter of E, and f
    sums the replicated gradients: wpe (T*C), per layer 2 LayerNorms x (weight, bias) +
    2 row biases (6C), ln_f (2C)."""
    L = 2
    C = 32
    E = B * T * C * 4
    expected = {
        False: {"all_reduce": (4 * L + 2 + 3, (4 * L + 2) * E + 3 * B * T * 4)},
        True: {
            "all_gather": (4 * L + 2, (4 * L + 2) * E),
            "reduce_scatter": (4 * L + 2, (4 * L + 2) * E),
            "all_reduce": (
                3 + 1 + 6 * L + 2,
                4 * (3 * B * T + T * C + 6 * L * C + 2 * C),
            ),
        },
    }
    _, tpm = gpt_pair(group, sp)
    with sharding.count_comm() as log:
        _, loss = tpm(*batch(3))
        loss.backward()
    counted = {}  # collective -> (calls, payload bytes)
    for op, n in log:
        calls, size = counted.get(op, (0, 0))
        counted[op] = (calls + 1, size + n)
    assert counted == expected[sp], (
        f"sp={sp}: counted {counted}, expected {expected[sp]}"
    )
    formula = sharding.comm_formula(tpm.config, B, T, sp)
    assert formula == {op: n for op, (_, n) in expected[sp].items()}, "comm_formula"


def case_grad_norm(rank, tp, group, sp):
    """grad_norm_squared (train.py's clipping): shards summed over the group, replicated
    parameters counted once, equals the whole model's squared gradient norm."""
    full, tpm = gpt_pair(group, sp)
    for model in (full, tpm):
        _, loss = model(*batch(4))
        loss.backward()
    expected = sum(p.grad.pow(2).sum() for p in full.parameters())
    got = tp_lib.grad_norm_squared(
        [(p, p.grad) for p in tpm.parameters()], group, "cpu"
    )
    close(got, expected, f"sp={sp}: squared grad norm")


CASES = [
    case_mlp,
    case_column_linear,
    case_row_linear,
    case_vocab_embedding,
    case_cross_entropy,
    case_attention,
    case_gpt,
    case_lora,
    case_gpt_in_subgroups,
    case_training,
    case_replicated_grads_identical,
    case_dropout,
    case_bad_config,
    case_comm_volume,
    case_grad_norm,
]


def run_cases(rank, world_size, cases, sp):
    """Every case on this rank, in order; stops at the first failure (the other ranks then
    fail on a collective that never completes, and report it)."""
    group = dist.new_group(list(range(world_size)))
    results = {}
    for case in cases:
        try:
            results[case.__name__] = ("ok", case(rank, world_size, group, sp))
        # reported per case, with the traceback
        except (Exception, pytest.fail.Exception):
            results[case.__name__] = ("failed", traceback.format_exc())
            break
    return results


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"tp{n}")
def world(request):
    return request.param, run_ranks(run_cases, request.param, CASES, False, timeout=120)


def verdict(world, case):
    """The case's result on every rank; fails with its traceback, or, if the world
    stopped before it, with the traceback of the case that failed first."""
    tp, per_rank = world
    for rank, results in enumerate(per_rank):
        missing = ("not run", "")
        for name, (status, detail) in results.items():
            if status == "failed":  # the world stops at its first failure
                missing = ("not run, as an earlier case failed", f"{name}: {detail}")
        status, detail = results.get(case.__name__, missing)
        assert status == "ok", (
            f"tp={tp} rank {rank}: {case.__name__} {status}:\n{detail}"
        )
    return [results[case.__name__][1] for results in per_rank]


def test_mlp_simple_version_f_and_g(world):
    verdict(world, case_mlp)


def test_column_parallel_linear(world):
    verdict(world, case_column_linear)


def test_row_parallel_linear(world):
    verdict(world, case_row_linear)


def test_vocab_parallel_embedding(world):
    verdict(world, case_vocab_embedding)


def test_vocab_parallel_cross_entropy(world):
    verdict(world, case_cross_entropy)


def test_attention_whole_heads(world):
    verdict(world, case_attention)


def test_gpt_equals_unsharded(world):
    verdict(world, case_gpt)


def test_lora_factors_split_with_their_weights(world):
    verdict(world, case_lora)


def test_gpt_in_tp_subgroups_of_a_bigger_world(world):
    verdict(world, case_gpt_in_subgroups)


def test_training_steps_match_one_process(world):
    verdict(world, case_training)


def test_replicated_grads_identical_across_ranks(world):
    verdict(world, case_replicated_grads_identical)


def test_dropout_masks_replicated_vs_sharded(world):
    verdict(world, case_dropout)


def test_bad_config_fails_before_any_collective(world):
    verdict(world, case_bad_config)


def test_communication_volume_matches_formula(world):
    verdict(world, case_comm_volume)


def test_grad_norm_counts_replicated_params_once(world):
    verdict(world, case_grad_norm)


def test_offline_merge_of_rank_state_dicts(world):
    """train.py --export: the ranks' saved state dicts, merged in one process, are the
    model."""
    shards = verdict(world, case_gpt)
    torch.manual_seed(0)
    full = GPT(tiny(tie_embeddings=False))
    merged = merge_shards(shards)
    assert merged.keys() == full.state_dict().keys()
    for k, v in full.state_dict().items():
        torch.testing.assert_close(merged[k], v, rtol=0, atol=0)


# --------------------------------------------------------------------------------------
# single process
# --------------------------------------------------------------------------------------
def test_qkv_is_sliced_by_whole_heads():
    """C=4, nh=2 (hs=2), tp=2. c_attn's 12 output rows are [q0 q0 q1 q1 | k0 k0 k1 k1 | v0
    ...] (q_h = head h's rows of q). Rank 0 must hold head 0 of q, k and v: rows 0,1 |
    4,5 | 8,9; rank 1 rows 2,3 | 6,7 | 10,11. A plain 2-way row split would give rank 0
    all of q and half of k instead."""
    w = torch.arange(12.0).unsqueeze(1)  # row i holds the number i
    shards = [tp_lib.shard_tensor(w, 0, 3, r, 2) for r in (0, 1)]
    assert shards[0].squeeze(1).tolist() == [0, 1, 4, 5, 8, 9]
    assert shards[1].squeeze(1).tolist() == [2, 3, 6, 7, 10, 11]
    torch.testing.assert_close(tp_lib.merge_tensors(shards, 0, 3), w, rtol=0, atol=0)


def test_layout_table_names_the_gpt_shards():
    assert tp_lib.tp_layout("transformer.h.0.attn.c_attn.weight") == (0, 3)
    assert tp_lib.tp_layout("transformer.h.3.mlp.c_fc.bias") == (0, 1)
    assert tp_lib.tp_layout("transformer.h.0.attn.c_proj.weight") == (1, 1)
    # row bias: replicated
    assert tp_lib.tp_layout("transformer.h.0.mlp.c_proj.bias") is None
    assert tp_lib.tp_layout("transformer.wte.weight") == (0, 1)
    assert tp_lib.tp_layout("lm_head.weight") == (0, 1)
    for replicated in (
        "transformer.wpe.weight",
        "transformer.ln_f.bias",
        "h.1.ln_2.weight",
    ):
        assert tp_lib.tp_layout(replicated) is None
    # LoRA (02): B with its column-parallel weight (per q/k/v part), A with its
    # row-parallel one
    assert tp_lib.tp_layout("transformer.h.0.attn.c_attn.lora_B") == (0, 3)
    assert tp_lib.tp_layout("transformer.h.0.mlp.c_fc.lora_B") == (0, 1)
    assert tp_lib.tp_layout("transformer.h.0.mlp.c_proj.lora_A") == (1, 1)
    for whole in (
        "h.0.attn.c_attn.lora_A",
        "h.0.mlp.c_fc.lora_A",
        "h.0.attn.c_proj.lora_B",
    ):
        assert tp_lib.tp_layout(whole) is None


def test_config_validation_messages():
    with pytest.raises(AssertionError, match="n_head=4 is not divisible by tp=3"):
        tp_lib.check_tp_config(tiny(), 3)
    with pytest.raises(
        AssertionError,
        match=r"100 rows .*GPTConfig\(pad_vocab_multiple=64\) -> 128 rows",
    ):
        tp_lib.check_tp_config(tiny(n_head=8, pad_vocab_multiple=1), 8)
    tp_lib.check_tp_config(tiny(), 4)  # 4 heads, 128 rows, 32 and 128 wide: fine


def test_rng_tracker_forks_without_touching_the_default_stream():
    """Inside fork() dropout draws from the tracker's own stream, which continues across
    forks; outside, the default stream is exactly where it would have been without the
    fork."""
    tracker = tp_lib.RNGStateTracker("cpu", seed=7)
    torch.manual_seed(0)
    with tracker.fork():
        a = torch.rand(3)
    outside = torch.rand(3)
    with tracker.fork():
        b = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(outside, torch.rand(3))
    assert torch.equal(
        torch.cat([a, b]), torch.rand(6, generator=torch.Generator().manual_seed(7))
    )
    saved = tracker.state_dict()  # a checkpoint: the stream resumes where it was saved
    with tracker.fork():
        c = torch.rand(3)
    tracker.load_state_dict(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(3), c)


def test_a_bad_rank_count_fails_before_any_rank_starts(monkeypatch, capsys):
    """`python 04_tensor_parallel.py --ranks 3` cannot split the demo's 4 heads, and
    `--ranks 0` is no world: each ends as a usage error (exit code 2) from
    support.distributed.run_on_ranks, before it relaunches anything under torchrun."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    launched = []

    def relaunch(*args):  # what would run torchrun
        launched.append(args)

    monkeypatch.setattr(distributed, "relaunch_with_torchrun", relaunch)
    for ranks, why in (("3", "n_head=4 is not divisible by tp=3"), ("0", ">= 1")):
        with pytest.raises(SystemExit) as exit_:
            tp_lib.main(["--ranks", ranks])
        assert exit_.value.code == 2
        assert why in capsys.readouterr().err
    assert launched == []
    tp_lib.main(["--ranks", "4"])  # 4 heads, 256 rows: fine, so it would relaunch
    assert launched == [(4, ["--ranks", "4"], tp_lib.__file__)]
