"""08_context_parallel.py: ring attention and the context-parallel GPT equal one process.

A worked example of the zigzag split first: T = 8 tokens at cp = 2 are cut into 2cp = 4
chunks of 2, [0 1 | 2 3 | 4 5 | 6 7]; rank 0 holds chunks 0 and 3, positions [0 1 6 7],
rank 1 chunks 1 and 2, positions [2 3 4 5]. Causal attention over those ranks costs, in
blocks of (T/cp)^2 = 16 scores, 1 (the diagonal) + 1/2 (half a block from the other
rank) = 1.5 on each rank, where the contiguous split costs rank 0 one block and rank 1
two.

Then the proofs. In one process, a ring of threads (support/context_parallel/ring.ThreadRing) runs the
lesson's own ring loops in fp64 and must give F.scaled_dot_product_attention(is_causal=
True)'s output and gradients for both splits, while the blocks and bytes each thread
computes and sends are counted against the formulas. On gloo, one world of 2 and one of 4
ranks run every case in CASES once: the ring and the all-gather versions against SDPA,
the GPT's logits, loss and every parameter's gradient against one process (gradients
averaged over the CP ranks, as DP averages), a rank whose targets are all ignored, all of
it again under tests/distributed.nccl_p2p_rules, the bytes of a GPT step per layer, CP
on a tensor-parallel model (cp 2 x tp 2, with and without SP) and on 05's pipeline
(cp 2 x pp 2, 1F1B), and PyTorch's own context_parallel where it runs.
"""

import copy
import functools
import importlib
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from support.context_parallel.ring import (
    ThreadRing,
    attention_kept_bytes,
    attention_on_ranks,
)
from support.tensor_parallel.activations import saved_activation_bytes
from tests.distributed import case_results, nccl_p2p_rules, run_cases, run_ranks

cp_lib = importlib.import_module("08_context_parallel")
model_lib = importlib.import_module("02_model")

B = 2
T = 16  # divisible by 2cp for cp = 1, 2, 4, 8
SPLITS = ("zigzag", "contiguous")
NAMES = ("out", "dq", "dk", "dv")


def close(actual, expected, what, fp64=False):
    """fp64: the ring adds the same products in another order than SDPA's kernel, so
    results differ by ~1e-15 relative per addition; 1e-10 is far above that and far
    below any bug. fp32: rounding ~1e-7 per addition, a few additions deep (observed
    below 2e-6 on O(1) values); atol 1e-5 of the tensor's largest entry and rtol 1e-4
    are well above it and far below a real bug (a missing block, a wrong mask, a
    gradient summed on the wrong rank), which is off by the size of the values."""
    scale = expected.detach().abs().max().item()
    tol = 1e-10 if fp64 else 1e-5
    torch.testing.assert_close(
        actual,
        expected,
        rtol=tol if fp64 else 1e-4,
        atol=tol * max(scale, 1e-12),
        msg=lambda m: f"{what}: {m}",
    )


def sdpa_reference(q, k, v, dout):
    """Full causal attention by PyTorch, and its three input gradients."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves]


# ------------------------------------------------------------ one process
def test_zigzag_worked_example():
    x = torch.arange(8).view(1, 8)
    assert cp_lib.zigzag_split(x, 0, 2).tolist() == [[0, 1, 6, 7]]
    assert cp_lib.zigzag_split(x, 1, 2).tolist() == [[2, 3, 4, 5]]
    assert cp_lib.zigzag_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert cp_lib.zigzag_positions(8, 3, 4).tolist() == [3, 4]
    for cp in (1, 2, 4):
        parts = [cp_lib.zigzag_split(x, r, cp) for r in range(cp)]
        assert torch.equal(cp_lib.zigzag_merge(parts, cp), x)
    with pytest.raises(AssertionError, match="divisible by 2cp"):
        cp_lib.zigzag_split(torch.zeros(1, 6), 0, 2)


def test_formulas_by_hand():
    """blocks_per_rank and ring_bytes_per_layer against numbers derived here."""
    assert cp_lib.blocks_per_rank(4, "contiguous") == [1, 2, 3, 4]
    assert cp_lib.blocks_per_rank(4, "zigzag") == [2.5] * 4
    assert cp_lib.blocks_per_rank(1, "zigzag") == [1.0]
    # B=2, T=16, C=8, cp=4: K or V of a rank's 4 tokens is 2*4*8 = 64 elements. Forward:
    # 3 steps x (K and V) x 64 x 2 bytes (bf16) = 768. Backward: 768 again, plus dK and
    # dV (fp32 accumulators) sent 4 times: 4 x 2 x 64 x 4 = 2048.
    assert cp_lib.ring_bytes_per_layer(2, 16, 8, 4, 2) == (768, 768 + 2048)
    assert cp_lib.ring_bytes_per_layer(2, 16, 8, 1, 4) == (0, 0)
    # The all-gather, same shapes: its forward sends what the ring's does, 768; its
    # reduce-scatter sends 3 of 4 pieces of the fp32 dK, dV: 3 x 2 x 64 x 4 = 1536.
    assert cp_lib.allgather_bytes_per_layer(2, 16, 8, 4, 2) == (768, 1536)
    # Kept for the backward, fp32, B=2, T=16, nh=2, hs=4, cp=4: E = 2*4*8 = 64. q and O
    # 2 x 64 x 4 bytes, the lse 2*2*4 = 16 numbers x 4: 576. K, V of its 4 tokens: 512;
    # of all 16: 2048, and the (4, 16) bool mask 64 bytes.
    ring = attention_kept_bytes(2, 16, 2, 4, 4, "ring")
    assert ring == {"q, O, lse": 576, "K, V of T/cp": 512}
    gathered = attention_kept_bytes(2, 16, 2, 4, 4, "all-gather")
    assert gathered == {"q, O, lse": 576, "K, V of all T": 2048, "mask": 64}


def simulate(cp, split, q, k, v, dout):
    """The lesson's ring loops on cp threads: (out, dq, dk, dv, lse) merged, the measured
    blocks of (T/cp)^2 scores and the bytes each thread sent forward and backward."""
    n = q.size(2) // cp
    parts = [
        [cp_lib.split_sequence(t, r, cp, split, 2) for t in (q, k, v, dout)]
        for r in range(cp)
    ]
    scores = [0] * cp
    attend = cp_lib.attend
    me = threading.local()  # which rank this thread plays

    def counting(q_b, k_b, v_b, mask=None):  # the scores each block computes
        scores[me.rank] += q_b.size(2) * k_b.size(2)
        return attend(q_b, k_b, v_b, mask)

    def forward(rank, pass_on):
        me.rank = rank
        return cp_lib.ring_forward(*parts[rank][:3], rank, cp, split, pass_on)

    ring = ThreadRing(cp)
    cp_lib.attend = counting
    try:
        results = ring.run(forward)
    finally:
        cp_lib.attend = attend
    sent_forward = [sum(s) for s in ring.sent]

    def backward(rank, pass_on):
        out, lse = results[rank]
        return cp_lib.ring_backward(
            *parts[rank][:3], out, lse, parts[rank][3], rank, cp, split, pass_on
        )

    ring = ThreadRing(cp)
    grads = ring.run(backward)
    merged = [cp_lib.merge_sequence([r[0] for r in results], cp, split, 2)]
    for i in range(3):
        merged.append(cp_lib.merge_sequence([g[i] for g in grads], cp, split, 2))
    merged.append(cp_lib.merge_sequence([r[1] for r in results], cp, split, 2))
    blocks = [s / n**2 for s in scores]
    return merged, blocks, sent_forward, [sum(s) for s in ring.sent]


@pytest.mark.parametrize("split", SPLITS)
def test_ring_simulated_in_fp64_equals_sdpa(split):
    """cp threads run ring_forward and ring_backward; the merged output and the three
    gradients are SDPA's, the blocks each rank computed are blocks_per_rank, and the
    bytes each sent are ring_bytes_per_layer (fp64: 8 bytes, accumulators 8 too)."""
    g = torch.Generator().manual_seed(0)
    nh = 2
    hs = 4
    q, k, v, dout = (
        torch.randn(B, nh, T, hs, dtype=torch.float64, generator=g) for _ in range(4)
    )
    out_want, grads_want = sdpa_reference(q, k, v, dout)
    for cp in (1, 2, 4, 8):
        merged, blocks, sent_f, sent_b = simulate(cp, split, q, k, v, dout)
        for name, got, want in zip(
            ("out", "dq", "dk", "dv"), merged, [out_want, *grads_want]
        ):
            close(got, want, f"cp={cp} {split} {name}", fp64=True)
        assert blocks == cp_lib.blocks_per_rank(cp, split), (cp, split, blocks)
        formula = cp_lib.ring_bytes_per_layer(B, T, nh * hs, cp, 8)
        assert sent_f == [formula[0]] * cp, (cp, sent_f, formula)
        assert sent_b == [formula[1]] * cp, (cp, sent_b, formula)


def test_blocks_stay_fp32_under_bf16_autocast():
    """train.py runs the forward under bf16 autocast, the backward outside it. The blocks
    must still compute their scores and lse in fp32: under autocast the forward's out and
    lse equal the ones without it, bit for bit (the same fp32 ops). Were the scores
    rounded to bf16 (8 bits of mantissa), the lse would be off by ~1e-2 and the backward's
    p = exp(s - lse), recomputed in fp32, would not sum to 1 per row."""
    torch.manual_seed(0)
    q, k, v = (4 * torch.randn(2, 3, 16, 8).bfloat16() for _ in range(3))
    want = cp_lib.ring_forward(q, k, v, 0, 1, "zigzag", None)  # cp 1: one causal block
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = cp_lib.ring_forward(q, k, v, 0, 1, "zigzag", None)
    assert got[1].dtype == torch.float32
    for name, a, b in zip(("out", "lse"), got, want):
        assert torch.equal(a, b), f"{name} changed under autocast"


def test_query_tiles_equal_sdpa_in_fp64(monkeypatch):
    """attend and attend_backward over several query tiles, the last one shorter: a
    tile of 3 rows cuts cp 1's 16 queries into 3+3+3+3+3+1 and zigzag's half blocks of
    4 (cp 2) into 3+1, so every tile boundary and the partial last tile run. Still
    SDPA's output and gradients, to fp64's tolerance (close's comment)."""
    monkeypatch.setattr(cp_lib, "QUERY_TILE", 3)
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (
        torch.randn(B, 2, T, 4, dtype=torch.float64, generator=g) for _ in range(4)
    )
    out_want, grads_want = sdpa_reference(q, k, v, dout)
    for cp in (1, 2, 4):
        for split in SPLITS:
            merged, *_ = simulate(cp, split, q, k, v, dout)
            for name, got, want in zip(NAMES, merged, [out_want, *grads_want]):
                close(got, want, f"tile 3, cp={cp} {split} {name}", fp64=True)


def test_ring_in_bf16_accumulates_in_fp32():
    """What GPUs run: bf16 q, k, v and dO. The ring must equal fp32 SDPA on the same
    (bf16) inputs, rounded ONCE to bf16 at the end: its out and lse accumulators, its dq
    and its dK, dV accumulators (which travel the ring) stay fp32. Accumulated in bf16,
    each merge would round again and lse (~log T, ulp 2^-6 at 2..4) would be off by
    ~1% in every p = exp(s - lse) of the backward."""
    g = torch.Generator().manual_seed(0)
    nh = 2
    hs = 16
    n_tokens = 64  # more tokens than T: more blocks to merge, more rounding to catch
    shape = (B, nh, n_tokens, hs)
    q, k, v, dout = (torch.randn(shape, generator=g).bfloat16() for _ in range(4))
    out_want, grads_want = sdpa_reference(*(t.float() for t in (q, k, v, dout)))
    s = q.float() @ k.float().transpose(-2, -1) / hs**0.5  # the scores, in fp32
    causal = torch.ones(n_tokens, n_tokens, dtype=torch.bool).tril()
    lse_want = torch.logsumexp(s.masked_fill(~causal, -torch.inf), dim=-1)
    # Rounding to bf16 once is within half an ulp, at most 2^-8 relative: rtol 2^-7 (one
    # ulp) leaves room for fp32's ~1e-7 noise crossing a rounding boundary, atol 1e-6
    # for values near 0 (observed: out is fp32's rounded in every element). dq, dk: D =
    # rowsum(dO * O) uses the bf16 O the forward returned (FlashAttention keeps it so),
    # which adds up to 0.6 x 2^-8 of the tensor's largest value (observed): atol 2^-8 of
    # it. Merged in bf16, 30-60% of out's elements are off fp32's rounded, some by 100%
    # of a value near 0, and dq, dk, dv by 1e-2 of their largest: both breaks (out and
    # lse in bf16; dK, dV accumulated in bf16) fail here.
    ulp = 2.0**-7
    for cp in (2, 4, 8):
        for split in SPLITS:
            merged, _, sent_f, sent_b = simulate(cp, split, q, k, v, dout)
            *results, lse = merged
            what = f"bf16 cp={cp} {split}"
            for name, got, want in zip(NAMES, results, [out_want, *grads_want]):
                assert got.dtype == torch.bfloat16, (what, name, got.dtype)
                scale = want.abs().max().item()
                atol = ulp / 2 * scale if name in ("dq", "dk") else 1e-6
                torch.testing.assert_close(
                    got.float(),
                    want,
                    rtol=ulp,
                    atol=atol,
                    msg=lambda m, where=f"{what} {name}": f"{where}: {m}",
                )
            close(lse.float(), lse_want, f"{what} lse")  # fp32 tolerance: fp32 sums
            assert lse.dtype == torch.float32, (what, lse.dtype)
            # K, V travel in bf16 (b = 2); the dK, dV accumulators in fp32 (a = 4).
            formula = cp_lib.ring_bytes_per_layer(B, n_tokens, nh * hs, cp, 2)
            assert sent_f == [formula[0]] * cp, (what, sent_f, formula)
            assert sent_b == [formula[1]] * cp, (what, sent_b, formula)


def test_zigzag_balances_the_work():
    """Zigzag: the same work on every rank; contiguous: the last rank does cp times the
    first's. Measured by the simulation above, at cp = 4."""
    q = torch.randn(1, 1, T, 4, dtype=torch.float64)
    _, zigzag, _, _ = simulate(4, "zigzag", q, q, q, q)
    _, contiguous, _, _ = simulate(4, "contiguous", q, q, q, q)
    assert max(zigzag) == min(zigzag) == 2.5
    assert contiguous[-1] == 4 * contiguous[0]


# ------------------------------------------------------------ gloo worlds
def tiny(**overrides):
    base = dict(n_layer=2, n_head=4, n_embd=32, block_size=T, vocab_size=64)
    return model_lib.GPTConfig(**{**base, **overrides})


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 64, (B, T), generator=g)
    targets = torch.randint(0, 64, (B, T), generator=g)
    targets[0, :3] = -1  # ignored positions take no part in the loss
    return idx, targets


def gather(t, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def world_group(world_size):
    return dist.new_group(list(range(world_size)))


FORMULAS = {  # each version's (bytes formula, name in attention_kept_bytes)
    "ring_attention": (cp_lib.ring_bytes_per_layer, "ring"),
    "allgather_attention": (cp_lib.allgather_bytes_per_layer, "all-gather"),
}


def check_attention(rank, cp, group, fns):
    """fns' outputs and dq, dk, dv, merged over the ranks, against SDPA (fp32); the
    bytes each rank sent forward and backward and kept for the backward against the
    formulas (count_sent: isends, plus (cp-1)/cp of each collective's list)."""
    g = torch.Generator().manual_seed(1)
    nh = 4
    hs = 8
    q, k, v, dout = (torch.randn(B, nh, T, hs, generator=g) for _ in range(4))
    out_want, grads_want = sdpa_reference(q, k, v, dout)
    for fn in fns:
        bytes_formula, version = FORMULAS[fn.__name__]
        kept = attention_kept_bytes(B, T, nh, hs, cp, version)
        formula = (*bytes_formula(B, T, nh * hs, cp, 4), sum(kept.values()))
        for split in SPLITS:
            at = dict(split=split, dim=2)
            cut = functools.partial(
                cp_lib.split_sequence, cp_rank=rank, cp_size=cp, **at
            )
            join = functools.partial(cp_lib.merge_sequence, cp_size=cp, **at)
            run = functools.partial(fn, group=group, split=split)
            got, measured = attention_on_ranks(run, (q, k, v), dout, group, cut, join)
            for name, whole, want in zip(
                ("out", "dq", "dk", "dv"), got, [out_want, *grads_want]
            ):
                close(whole, want, f"{fn.__name__} {split} {name}")
            assert measured == formula, (fn.__name__, split, measured, formula)
    return True


def case_attention(rank, world_size):
    group = world_group(world_size)
    return check_attention(
        rank, world_size, group, [cp_lib.ring_attention, cp_lib.allgather_attention]
    )


def case_attention_nccl(rank, world_size):
    group = world_group(world_size)
    with nccl_p2p_rules():
        return check_attention(rank, world_size, group, [cp_lib.ring_attention])


def one_process(targets, seed=0, **config):
    """The whole GPT on the whole batch: logits, mean loss, every gradient."""
    torch.manual_seed(seed)
    model = model_lib.GPT(tiny(**config))
    idx, _ = batch()
    logits, loss = model(idx, targets)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return model, logits.detach(), loss.detach(), grads


def owner_of_tokens(cp, split):
    """(B, T): the CP rank that holds each token."""
    parts = [torch.full((B, T // cp), r) for r in range(cp)]
    return cp_lib.merge_sequence(parts, cp, split)


def check_gpt(rank, cp, group, split, targets):
    """apply_context_parallel's GPT on this rank's chunks, stepped as cp_step does
    (SUM / N over the CP ranks, backward x cp, gradients averaged): logits, loss and
    every gradient against one process."""
    full, logits_want, loss_want, grads_want = one_process(targets)
    model = cp_lib.apply_context_parallel(copy.deepcopy(full), group, split)
    model.zero_grad(set_to_none=True)
    idx, _ = batch()
    x = cp_lib.split_sequence(idx, rank, cp, split)
    y = cp_lib.split_sequence(targets, rank, cp, split)
    logits, loss = cp_lib.cp_step(model, x, y, group)
    assert torch.isfinite(loss), f"rank {rank}: loss {loss}"
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    close(total, loss_want, f"{split} loss")
    whole = cp_lib.merge_sequence(gather(logits.detach(), group), cp, split)
    close(whole, logits_want, f"{split} logits")
    names = [n for n, _ in model.named_parameters()]
    assert sorted(names) == sorted(grads_want), "the state-dict names changed"
    for name, p in model.named_parameters():
        close(p.grad, grads_want[name], f"{split} grad of {name}")
    return loss.item()


def case_gpt(rank, world_size):
    group = world_group(world_size)
    _, targets = batch()
    shares = {}
    for split in SPLITS:
        shares[split] = check_gpt(rank, world_size, group, split, targets)
        # Megatron-LM #1764: every target on rank 0 ignored: no NaN, the same model.
        ignored = targets.masked_fill(owner_of_tokens(world_size, split) == 0, -1)
        shares[split + " rank 0 ignored"] = check_gpt(
            rank, world_size, group, split, ignored
        )
    return shares


def case_gpt_nccl(rank, world_size):
    group = world_group(world_size)
    with nccl_p2p_rules():
        return check_gpt(rank, world_size, group, "zigzag", batch()[1])


def case_token_count(rank, world_size):
    """cp_token_count: N over the group as a 0-dim tensor (no host read), clamped to 1
    when every target of the group is ignored, so that step is loss 0 and zero
    gradients, as 06's global_token_count: no 0/0, no error."""
    group = world_group(world_size)
    _, targets = batch()
    n = cp_lib.cp_token_count(cp_lib.zigzag_split(targets, rank, world_size), group)
    assert torch.is_tensor(n) and n.dim() == 0, f"not a 0-dim tensor: {n!r}"
    assert n.item() == B * T - 3, n  # batch() ignores 3 of the B*T targets
    idx, _ = batch()
    x = cp_lib.zigzag_split(idx, rank, world_size)
    y = torch.full_like(x, -1)  # every target of every rank ignored
    assert cp_lib.cp_token_count(y, group).item() == 1
    torch.manual_seed(0)  # the same weights on every rank
    model = cp_lib.apply_context_parallel(model_lib.GPT(tiny()), group)
    _, loss = cp_lib.cp_step(model, x, y, group)
    assert loss.item() == 0.0, loss
    for name, p in model.named_parameters():
        assert torch.count_nonzero(p.grad) == 0, f"{name}'s gradient is not zero"
    return n.item()


def case_blocks_and_bytes(rank, world_size):
    """On real ranks: the blocks each rank computes (attend counted) and the bytes of a
    GPT step's isends per layer (batch_isend_irecv counted), against the formulas."""
    cp = world_size
    group = world_group(world_size)
    scores = []
    attend = cp_lib.attend

    def counting(q_b, k_b, v_b, mask=None):
        scores.append(q_b.size(2) * k_b.size(2))
        return attend(q_b, k_b, v_b, mask)

    blocks = {}
    cp_lib.attend = counting
    try:
        for split in SPLITS:
            scores.clear()
            q = torch.randn(1, 1, T // cp, 4)
            cp_lib.ring_attention(q, q, q, group, split)
            blocks[split] = sum(scores) / (T // cp) ** 2
    finally:
        cp_lib.attend = attend
    for split in SPLITS:
        assert blocks[split] == cp_lib.blocks_per_rank(cp, split)[rank], (split, blocks)
    torch.manual_seed(0)
    config = tiny()
    model = cp_lib.apply_context_parallel(model_lib.GPT(config), group)
    idx, targets = batch()
    sent = []
    real = dist.batch_isend_irecv

    def counting_p2p(ops):
        sent.extend(
            op.tensor.numel() * op.tensor.element_size()
            for op in ops
            if op.op is dist.isend
        )
        return real(ops)

    dist.batch_isend_irecv = counting_p2p
    try:
        x = cp_lib.zigzag_split(idx, rank, cp)
        y = cp_lib.zigzag_split(targets, rank, cp)
        cp_lib.cp_step(model, x, y, group)
    finally:
        dist.batch_isend_irecv = real
    formula = sum(cp_lib.ring_bytes_per_layer(B, T, config.n_embd, cp, 4))
    assert sum(sent) == config.n_layer * formula, (sum(sent), formula)
    # The memory CP saves: a rank keeps 1/cp of what one process keeps for the backward
    # (06b's activation_formula), except the loss's 4-byte count, which every rank keeps.
    recompute_lib = importlib.import_module("06b_recompute")
    one = recompute_lib.activation_formula(config, B, T, "fp32")
    _, kept = saved_activation_bytes(lambda: model(x, y, reduction="sum"))
    assert kept == (one - 4) // cp + 4, (kept, one, cp)
    return blocks


def case_cp_tp(rank, world_size):
    """cp 2 x tp 2, grid arange(4).view(cp, tp): TP groups {0,1} {2,3}, CP groups {0,2}
    {1,3}. 04 shards the model first (with and without SP), then CP wraps its attention
    and positions: the logits, the loss and every gradient shard equal one process's."""
    if world_size != 4:
        return "4 ranks only"
    tp_lib = importlib.import_module("04_tensor_parallel")
    sp_lib = importlib.import_module("04b_sequence_parallel")
    sharding = importlib.import_module("support.tensor_parallel.sharding")
    tp_rank = rank % 2
    cp_rank = rank // 2
    tp_groups = [dist.new_group(r) for r in ([0, 1], [2, 3])]
    cp_groups = [dist.new_group(r) for r in ([0, 2], [1, 3])]
    tp_group = tp_groups[cp_rank]
    cp_group = cp_groups[tp_rank]
    idx, targets = batch()
    full, logits_want, loss_want, grads_want = one_process(targets)
    for apply in (tp_lib.apply_tensor_parallel, sp_lib.apply_sequence_parallel):
        sp = apply is sp_lib.apply_sequence_parallel
        model = apply(copy.deepcopy(full), tp_group)
        model = cp_lib.apply_context_parallel(model, cp_group)
        x = cp_lib.zigzag_split(idx, cp_rank, 2)
        y = cp_lib.zigzag_split(targets, cp_rank, 2)
        logits, loss = cp_lib.cp_step(model, x, y, cp_group)
        total = loss.detach().clone()
        dist.all_reduce(total, group=cp_group)
        close(total, loss_want, f"sp={sp} loss")
        vocab = sharding.gather_logits(logits.detach(), tp_group)  # (B, T/cp, V)
        whole = cp_lib.zigzag_merge(gather(vocab, cp_group), 2)
        close(whole[..., :64], logits_want[..., :64], f"sp={sp} logits")
        for name, p in model.named_parameters():
            want = grads_want[name]
            layout = tp_lib.tp_layout(name)
            if layout:
                want = tp_lib.shard_tensor(want, *layout, tp_rank, 2)
            close(p.grad, want, f"sp={sp} grad of {name}")
    return True


def case_cp_pp(rank, world_size):
    """cp 2 x pp 2, grid arange(4).view(pp, cp): CP groups {0,1} {2,3}, PP groups {0,2}
    {1,3}. 05 cuts the context-parallel model into stages and 05b runs 1F1B under NCCL's
    rule, n_tokens counted over the CP ranks and dp_size = cp (CP averages as DP does)."""
    if world_size != 4:
        return "4 ranks only"
    pp_lib = importlib.import_module("05_pipeline")
    sched_lib = importlib.import_module("05b_schedules")
    cp_rank = rank % 2
    pp_rank = rank // 2
    cp_groups = [dist.new_group(r) for r in ([0, 1], [2, 3])]
    pp_ranks = [[0, 2], [1, 3]]
    pp_groups = [dist.new_group(r) for r in pp_ranks]
    embed_group = pp_lib.embedding_group(pp_ranks)
    cp_group = cp_groups[pp_rank]
    idx, targets = batch()
    full, _, loss_want, grads_want = one_process(targets)
    model = cp_lib.apply_context_parallel(copy.deepcopy(full), cp_group)
    chunks = pp_lib.split_model(model, pp_rank, 2)
    x = cp_lib.zigzag_split(idx, cp_rank, 2)
    y = cp_lib.zigzag_split(targets, cp_rank, 2)
    n = cp_lib.cp_token_count(y, cp_group)
    with nccl_p2p_rules():
        result = sched_lib.pipeline_step(
            chunks,
            (x, y),
            2,
            "1f1b",
            pp_groups[cp_rank],
            embed_group=embed_group,
            n_tokens=n,
            dp_size=2,
        )
    for chunk in chunks:
        cp_lib.average_gradients(chunk, cp_group)
    total = result.loss.detach().clone()
    dist.all_reduce(total, group=cp_group)
    if pp_rank == 1:  # the last stage holds the loss
        close(total, loss_want, "cp x pp loss")
    seen = []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            # lm_head.weight: the last stage's copy of wte, with wte's gradient.
            tied = name == "lm_head.weight"
            want = grads_want["transformer.wte.weight" if tied else name]
            close(p.grad, want, f"cp x pp grad of {name}")
            seen.append(name)
    return seen


def case_torch_context_parallel(rank, world_size):
    """PyTorch's own CP, torch.distributed.tensor.experimental.context_parallel, on the
    same q, k, v. In torch 2.13 it does not run on CPU: SDPA dispatches there to
    aten._scaled_dot_product_flash_attention_for_cpu, for which CP registers no sharding
    strategy (it has the CUDA flash, efficient and cuDNN kernels only), so the call raises
    NotImplementedError. Should a later torch run it, its head-tail load balancer is our
    zigzag split, and its output must equal this rank's zigzag chunks of SDPA's."""
    if world_size != 2:
        return "2 ranks only"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, 4, T, 8, generator=g) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    buffers = [q.clone(), k.clone(), v.clone()]  # sharded in place by the context
    try:
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(*buffers, is_causal=True)
    except NotImplementedError as e:
        return f"unsupported: {e}"
    close(out, cp_lib.zigzag_split(want, rank, world_size, 2), "torch's CP")
    return "ran"


CASES = {
    "attention": case_attention,
    "attention_nccl": case_attention_nccl,
    "gpt": case_gpt,
    "gpt_nccl": case_gpt_nccl,
    "token_count": case_token_count,
    "blocks_and_bytes": case_blocks_and_bytes,
    "cp_tp": case_cp_tp,
    "cp_pp": case_cp_pp,
    "torch_cp": case_torch_context_parallel,
}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"cp{n}")
def world(request):
    return request.param, run_ranks(run_cases, request.param, CASES, timeout=180)


def test_ring_and_allgather_attention_equal_sdpa(world):
    case_results(world[1], "attention")


def test_ring_attention_under_nccl_rules(world):
    case_results(world[1], "attention_nccl")


def test_gpt_equals_one_process(world):
    """Both splits, and with every target of rank 0 ignored (its share of the loss is
    then exactly 0, not NaN)."""
    shares = case_results(world[1], "gpt")
    for split in SPLITS:
        assert shares[0][split + " rank 0 ignored"] == 0.0


def test_gpt_under_nccl_rules(world):
    case_results(world[1], "gpt_nccl")


def test_token_count_is_a_tensor_clamped_to_one(world):
    assert case_results(world[1], "token_count") == [B * T - 3] * world[0]


def test_measured_blocks_and_bytes_match_the_formulas(world):
    cp, per_rank = world
    blocks = case_results(per_rank, "blocks_and_bytes")
    assert [b["zigzag"] for b in blocks] == [(cp + 1) / 2] * cp
    assert [b["contiguous"] for b in blocks] == list(range(1, cp + 1))


def test_cp_times_tp_with_and_without_sp(world):
    if world[0] != 4:
        pytest.skip("cp 2 x tp 2 needs the 4-rank world")
    case_results(world[1], "cp_tp")


def test_cp_times_pp_1f1b(world):
    if world[0] != 4:
        pytest.skip("cp 2 x pp 2 needs the 4-rank world")
    seen = case_results(world[1], "cp_pp")
    names = {name for per_rank in seen for name in per_rank}
    one = dict(model_lib.GPT(tiny()).named_parameters())
    assert names - {"lm_head.weight"} == set(one), "some parameter is on no stage"


def test_against_torch_context_parallel(world):
    if world[0] != 2:
        pytest.skip("compared in the 2-rank world")
    verdicts = case_results(world[1], "torch_cp")
    if verdicts[0].startswith("unsupported"):
        assert "for_cpu" in verdicts[0], verdicts[0]  # the reason the docstring gives
        pytest.skip(f"torch's context_parallel does not run on CPU: {verdicts[0]}")
    assert verdicts == ["ran", "ran"]
