"""06b's chunked linear + cross-entropy against the plain loss (02's lm_head, then its
cross_entropy_loss): the same loss and every gradient, the bytes it keeps equal to 06b's
formula, no (B, T, V) tensor kept, and apply_chunked_loss through 02's and 05's seam.

A worked example of what the chunked forward forms: one token, V = 2 logits (0, ln 3),
target 1. softmax = (1/4, 3/4), so the loss is -ln(3/4) = 0.2877 and dL/dlogits =
softmax - onehot = (1/4, -1/4); with x = (1, 2) and W = [[0, 0], [ln 3, 0]] that gives
dX = (1/4, -1/4) @ W = (-ln 3/4, 0) and dW = (1/4, -1/4)^T (1, 2).
"""

import collections
import functools
import importlib
import math

import pytest
import torch
import torch.nn.functional as F

rc = importlib.import_module("06b_recompute")  # the chunked loss, its formula
mp = importlib.import_module("06_mixed_precision")
model_lib = importlib.import_module("02_model")
pipeline = importlib.import_module("05_pipeline")
# 250 real ids padded to 256 columns: six padding columns the loss must never pick.
PADDED = model_lib.GPTConfig.from_preset("tiny", vocab_size=250, pad_vocab_multiple=64)
# fp32, the same sums in another order (the loss chunk by chunk, dW over chunks): an
# entry of dW is a sum of up to 48 terms of size <= 3 (reduction "sum"), so reordering
# moves it by a few ulps of 3 (eps 1.2e-7: about 1e-6 measured), below atol 1e-5, which
# is also assert_close's fp32 default. A missing mask or scale moves whole terms, 1e-2
# and more.
FP32 = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: extra threads only spin on a shared 2-core machine. Restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def batch(B=3, T=16, seed=0, ignored=True):
    """Ids and targets below 250; with `ignored`, the first 7 targets (a whole chunk of
    7, and half of another of 16's) and every fifth one are -1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 250, (B, T), generator=g)
    y = torch.randint(0, 250, (B, T), generator=g)
    if ignored:
        y.view(-1)[:7] = mp.IGNORE
        y.view(-1)[::5] = mp.IGNORE
    return x, y


def plain_and_chunked(x, weight, bias, y, vocab_size, chunk, reduction):
    """(loss, dx, dW, db) of the plain path and of the chunked one, from the same leaves."""
    out = []
    for chunked in (False, True):
        leaves = [t.detach().clone().requires_grad_() for t in (x, weight)]
        leaves.append(None if bias is None else bias.detach().clone().requires_grad_())
        if chunked:
            args = (*leaves[:3], y, vocab_size, chunk, reduction, True)
            loss = rc.ChunkedLinearCrossEntropy.apply(*args)
        else:
            logits = F.linear(*leaves)  # (N, V)
            loss = model_lib.cross_entropy_loss(
                logits, y, reduction, vocab_size=vocab_size
            )
        (loss * 2.5).backward()  # an incoming gradient: the backward must scale by it
        out.append((loss, *[None if t is None else t.grad for t in leaves]))
    return out


def test_the_worked_example():
    """The docstring's numbers, by hand: one token, two columns, target 1."""
    x = torch.tensor([[1.0, 2.0]], requires_grad=True)
    w = torch.tensor([[0.0, 0.0], [math.log(3), 0.0]], requires_grad=True)
    loss = rc.ChunkedLinearCrossEntropy.apply(
        x, w, None, torch.tensor([1]), 2, 1, "sum", True
    )
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(-math.log(0.75)))
    torch.testing.assert_close(x.grad, torch.tensor([[-math.log(3) / 4, 0.0]]))
    torch.testing.assert_close(w.grad, torch.tensor([[0.25, 0.5], [-0.25, -0.5]]))


@pytest.mark.parametrize("chunk", [1, 7, 16, 48, 1000])  # 48 = B·T: one chunk
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_equals_plain_loss_and_gradients(chunk, reduction, bias):
    """N = 48 tokens, C = 32, V = 256 with 6 padding columns, 16 ignored targets (the
    first 7: an all-ignored chunk at chunk 7, which must give 0, never NaN), chunks that
    do (1, 16, 48) and do not (7, 1000) divide N, with and without lm_head's bias (GPT-2
    has none). Padding columns get no gradient: their softmax is exactly 0."""
    torch.manual_seed(0)
    x = torch.randn(48, 32)
    weight = torch.randn(256, 32) * 0.5
    b = torch.randn(256) if bias else None
    y = batch()[1].view(-1)
    plain, chunked = plain_and_chunked(x, weight, b, y, 250, chunk, reduction)
    for want, got in zip(plain, chunked):
        torch.testing.assert_close(got, want, **FP32)
    assert not any(t.isnan().any() for t in chunked if t is not None)
    assert torch.equal(chunked[2][250:], torch.zeros(6, 32)), "padding rows of dW"
    assert torch.equal(chunked[1][:7], torch.zeros(7, 32)), "ignored tokens' dX"


def test_every_target_ignored_gives_torchs_answer():
    """No target counts: "sum" is 0 and "mean" 0/0 = NaN, as torch's cross-entropy, and in
    both the gradients are exactly 0 (a NaN there would poison the whole step)."""
    torch.manual_seed(0)
    y = torch.full((48,), mp.IGNORE)
    for reduction in ("sum", "mean"):
        plain, chunked = plain_and_chunked(
            torch.randn(48, 32), torch.randn(256, 32), None, y, 250, 7, reduction
        )
        torch.testing.assert_close(chunked[0], plain[0], equal_nan=True)
        assert torch.equal(chunked[1], plain[1]) and torch.equal(chunked[2], plain[2])
        assert not chunked[1].any() and not chunked[2].any(), reduction


@pytest.mark.parametrize("tied", [True, False])
def test_a_gpt_with_the_chunked_loss_equals_the_plain_one(tied):
    """A whole GPT (padding columns, ignored targets, chunks of 7 that do not divide
    B·T = 48): the same loss and every parameter's gradient, in both reductions. Tied,
    dW reaches wte (lm_head's weight is wte's), added to the embedding's own gradient.
    Without targets the model returns the real logits, so generate samples the same."""
    config = model_lib.GPTConfig.from_preset(
        "tiny", vocab_size=250, pad_vocab_multiple=64, tie_embeddings=tied
    )
    x, y = batch()
    torch.manual_seed(0)
    plain = model_lib.GPT(config)
    torch.manual_seed(0)
    chunked = rc.apply_chunked_loss(model_lib.GPT(config), chunk_tokens=7)
    assert (chunked.lm_head.weight is chunked.transformer.wte.weight) == tied
    for reduction in ("mean", "sum"):
        losses = []
        for model in (plain, chunked):
            model.zero_grad(set_to_none=True)
            logits, loss = model(x, y, reduction=reduction)
            loss.backward()
            losses.append(loss)
        assert logits is None, "chunked: no logits are made, and none are returned"
        torch.testing.assert_close(losses[1], losses[0], **FP32)
        for (name, p), q in zip(plain.named_parameters(), chunked.parameters()):
            torch.testing.assert_close(q.grad, p.grad, **FP32, msg=name)
    assert torch.equal(chunked(x)[0], plain(x)[0]), "without targets: the real logits"
    prompt = x[:, :4]
    assert torch.equal(chunked.generate(prompt, 8, 0.0), plain.generate(prompt, 8, 0.0))
    with torch.no_grad():  # evaluation: the loss alone, no gradient formed
        torch.testing.assert_close(chunked(x, y)[1], plain(x, y)[1], **FP32)


def test_accumulation_with_the_chunked_loss_equals_the_plain_one():
    """06's accumulate_gradients back-propagates each microbatch's summed loss x 1/N (N:
    the whole step's targets): the chunked loss's backward scales its saved dX and dW by
    that incoming 1/N. Three microbatches with unequal target counts, every gradient."""
    x, y = batch(B=3)
    y[1, 4:] = mp.IGNORE
    micro = list(zip(x.split(1), y.split(1)))
    grads = []
    for loss_kind in ("plain", "chunked"):
        torch.manual_seed(0)
        model = model_lib.GPT(PADDED)
        if loss_kind == "chunked":
            rc.apply_chunked_loss(model, chunk_tokens=5)
        mp.accumulate_gradients(model, micro, mp.global_token_count(micro))
        grads.append([p.grad for p in model.parameters()])
    for p, q in zip(*grads):
        torch.testing.assert_close(q, p, **FP32)


def _note_size(sizes: list, t: torch.Tensor) -> torch.Tensor:
    """A saved-tensors pack hook that notes each saved tensor's element count."""
    sizes.append(t.numel())
    return t


def test_bf16_autocast_keeps_the_loss_and_softmax_in_fp32():
    """Under bf16 autocast both paths run lm_head's matmul in bf16 and the softmax in
    fp32. The loss is an fp32 number in both; the gradients differ where bf16 rounds:
    the plain dW is one bf16 matmul over all 48 tokens, rounded to bf16, the chunked one
    is summed in fp32 from fp32 dlogits. bf16 keeps 8 significant bits (eps 2^-7 =
    0.0078), so 3e-2 relative with a floor of 1e-3 of the largest gradient."""
    x, y = batch()
    grads = []
    for loss_kind in ("plain", "chunked"):
        torch.manual_seed(0)
        model = model_lib.GPT(PADDED)
        if loss_kind == "chunked":
            rc.apply_chunked_loss(model, chunk_tokens=7)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, y)
        assert loss.dtype == torch.float32, loss_kind
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
        if loss_kind == "plain":
            want = loss
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)  # the same bf16 logits
    for p, q in zip(*grads):
        top = p.abs().max().item()
        torch.testing.assert_close(q, p, rtol=3e-2, atol=1e-3 * top)


@pytest.mark.parametrize("chunk", [1, 7, 48])
def test_bf16_dw_is_the_fp32_product_of_the_bf16_logits_gradient(chunk):
    """Under bf16 autocast the logits are bf16 (x and W rounded, as lm_head's), the
    softmax fp32. dW must be that fp32 dlogits times x's bf16 values, summed in fp32,
    here by hand over all 48 tokens at once: only the order of fp32 sums differs (about
    1e-6 measured, against entries up to 4: FP32). Rounding each chunk's product to
    bf16 before the sum (as before) is off by 1e-2, and so fails."""
    torch.manual_seed(0)
    x = torch.randn(48, 32)
    weight = (torch.randn(256, 32) * 0.5).requires_grad_()
    y = batch()[1].view(-1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rc.ChunkedLinearCrossEntropy.apply(
            x, weight, None, y, 250, chunk, "sum", True
        ).backward()
    x16 = x.bfloat16().float()  # the values autocast's matmuls see
    logits = F.linear(x16, weight.detach().bfloat16().float()).bfloat16().float()
    logits[:, 250:] = -math.inf  # (48, 256): the padding columns never win
    g = logits.softmax(dim=-1)  # fp32, then - onehot(target), 0 for ignored targets
    ok = y != mp.IGNORE
    g[ok.nonzero().squeeze(1), y[ok]] -= 1
    g[~ok] = 0
    torch.testing.assert_close(weight.grad, g.T @ x16, **FP32)


def test_no_grad_forms_no_gradient():
    """Evaluation under torch.no_grad: the chunked loss makes the logits' matmul alone,
    no dW buffer, no dW or dX product, no dlogits (softmax - onehot). (autograd's
    needs_input_grad is True there too: the loss must ask torch.is_grad_enabled().)
    With gradients on, the same count finds them: the probe can see what it looks for."""
    torch.manual_seed(0)
    x = torch.randn(48, 32, requires_grad=True)
    head = torch.nn.Linear(32, 256, bias=False)
    y = batch()[1].view(-1)
    loss = functools.partial(
        rc.chunked_cross_entropy, lm_head=head, vocab_size=250, chunk_tokens=7
    )
    cpu = [torch.profiler.ProfilerActivity.CPU]
    ops = {}
    for grad in (True, False):
        with torch.set_grad_enabled(grad), torch.profiler.profile(activities=cpu) as p:
            value = loss(x, y)
        ops[grad] = collections.Counter(e.name for e in p.events())
        assert value.requires_grad == grad
    chunks = 7  # 48 tokens in chunks of 7
    # With gradients: dW's fp32 buffer beside the loss's, and one dW product a chunk.
    assert ops[True]["aten::zeros"] == 2 and ops[True]["aten::addmm_"] == chunks
    assert ops[True]["aten::mm"] == 2 * chunks, "the logits and dX, each chunk"
    assert ops[False]["aten::zeros"] == 1, "the loss's 0-dim sum alone: no dW buffer"
    assert ops[True]["aten::scatter_add_"] == chunks, "softmax - onehot, each chunk"
    assert ops[False]["aten::addmm_"] == 0 and ops[False]["aten::scatter_add_"] == 0
    assert ops[False]["aten::mm"] == chunks, "the logits alone, each chunk"
    torch.testing.assert_close(value, loss(x, y), **FP32)


def test_tensor_parallelism_after_the_chunked_loss_is_refused():
    """04's apply_tensor_parallel swaps lm_head and loss_fn but not the chunked loss's
    head (ln_f alone) and forward: the vocab-parallel loss would then take the (B, T, C)
    hidden states as logits, a wrong loss without an error (2.010 against 4.155 seen at
    tp 2). Refused in one line, before anything changed; in the other order 06b refuses.
    A world of one gloo rank in this process: 04 needs a process group."""
    tp = importlib.import_module("04_tensor_parallel")
    dist = torch.distributed
    assert not dist.is_initialized(), "a test left a process group behind"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = rc.apply_chunked_loss(model_lib.GPT(PADDED), chunk_tokens=7)
        with pytest.raises(ValueError, match="chunked loss: not under TP"):
            tp.apply_tensor_parallel(model, dist.group.WORLD)
        assert type(model.lm_head) is torch.nn.Linear, "refused before any change"
        model = tp.apply_tensor_parallel(model_lib.GPT(PADDED), dist.group.WORLD)
        with pytest.raises(ValueError, match="not vocab_parallel_cross_entropy"):
            rc.apply_chunked_loss(model)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["fp32", "bf16 autocast", "fp16 by hand"])
def test_bytes_kept_equal_the_formula_and_no_tensor_is_b_t_v(mode):
    """saved_activation_bytes (autograd's saved-tensors hooks, weights left out) equals
    06b's formula to the byte, for lm_head + loss alone (loss_formula, from ln_f's output
    on) and for the whole GPT (activation_formula), plain and chunked. The plain path
    keeps the fp32 log-softmax, B·T·V numbers; the chunked one keeps no tensor of
    B·T·V elements or more (dW has V·C, fewer since C = 32 < B·T = 48)."""
    x, y = batch()
    B, T = x.shape
    C = PADDED.n_embd
    V = PADDED.padded_vocab_size
    dtype = torch.bfloat16 if "autocast" in mode else torch.float32
    for loss_kind in ("plain", "chunked"):
        torch.manual_seed(0)
        model = model_lib.GPT(PADDED)
        if mode == "fp16 by hand":
            mp.MasterWeights(model, torch.float16)
        if loss_kind == "chunked":
            rc.apply_chunked_loss(model, chunk_tokens=7)
        hidden = torch.randn(B, T, C, dtype=model.lm_head.weight.dtype).requires_grad_()
        head_and_loss = functools.partial(lambda m, h: m.loss_fn(m.head(h), y), model)
        largest = []  # the element count of every tensor autograd saves
        with mp.autocast_context(dtype, "cpu"):
            _, held = rc.saved_activation_bytes(
                functools.partial(head_and_loss, hidden)
            )
            _, held_gpt = rc.saved_activation_bytes(functools.partial(model, x, y))
            pack = functools.partial(_note_size, largest)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                head_and_loss(hidden)
        # ln_f's own input, mean and rstd are part of the hidden path: counted apart.
        ln_f = B * T * (C + 2) * (2 if mode == "fp16 by hand" else 4)
        formula = rc.loss_formula(PADDED, B, T, mode, loss_kind)
        assert held - ln_f == formula, (loss_kind, held - ln_f, formula)
        whole = rc.activation_formula(PADDED, B, T, mode, loss=loss_kind)
        assert held_gpt == whole, (loss_kind, held_gpt, whole)
        if loss_kind == "plain":
            assert max(largest) >= B * T * V, "the plain loss keeps its log-softmax"
        else:
            assert max(largest) < B * T * V, f"a (B, T, V) tensor kept: {max(largest)}"


def test_the_bias_adds_its_v_numbers_to_the_bytes_kept():
    """lm_head with a bias (not GPT-2's): dW's V·C and db's V numbers, fp32."""
    torch.manual_seed(0)
    x = torch.randn(48, 32, requires_grad=True)
    head = torch.nn.Linear(32, 256)
    y = batch()[1].view(-1)
    args = (x, head.weight, head.bias, y, 250, 7, "mean", True)
    _, held = rc.saved_activation_bytes(
        lambda: rc.ChunkedLinearCrossEntropy.apply(*args)
    )
    B_T = 48  # the formula's B·T, as one row of 48 tokens
    formula = rc.loss_formula(PADDED, 1, B_T, "fp32", "chunked", bias=True)
    assert held == formula == 48 * 32 * 4 + 256 * 32 * 4 + 256 * 4


def test_apply_chunked_loss_through_05s_pipeline_chunks():
    """05's last stage calls head, then loss_fn(out, y, "sum"): chunked, it hands ln_f's
    (b, T, C) output on and the loss equals the plain stage's, every gradient too. A
    stage without lm_head is left as it was. Applied to the GPT only, before the split,
    the last stage would pass logits to the chunked loss: refused, never a wrong loss."""
    x, y = batch()
    results = []
    for loss_kind in ("plain", "chunked"):
        torch.manual_seed(0)
        model = model_lib.GPT(PADDED)
        first, last = [pipeline.split_model(model, r, 2)[0] for r in (0, 1)]
        if loss_kind == "chunked":
            assert rc.apply_chunked_loss(first, chunk_tokens=7) is first
            assert "head" not in vars(first), "a stage without lm_head: unchanged"
            rc.apply_chunked_loss(last, chunk_tokens=7)
        out = last(first(x))
        assert out.shape[-1] == (32 if loss_kind == "chunked" else 256), out.shape
        loss = last.loss_fn(out, y, "sum")
        loss.backward()
        results.append((loss, [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0], **FP32)
    for p, q in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(q, p, **FP32)
    model = rc.apply_chunked_loss(model_lib.GPT(PADDED))
    last = pipeline.split_model(model, 1, 2)[0]
    with pytest.raises(ValueError, match="every pipeline chunk"):
        last.loss_fn(last(torch.randn(3, 16, 32)), y, "sum")


def test_apply_chunked_loss_refuses_tensor_parallelism():
    """04's vocab-parallel loss takes a rank's V/tp logit columns; the chunked loss
    would need their max and sum all-reduced in every chunk: refused in one line."""
    tp = importlib.import_module("04_tensor_parallel")
    model = model_lib.GPT(PADDED)
    vocab_parallel = tp.vocab_parallel_cross_entropy
    model.loss_fn = functools.partial(vocab_parallel, group=None, vocab_size=250)
    with pytest.raises(ValueError, match="not vocab_parallel_cross_entropy.*V/tp"):
        rc.apply_chunked_loss(model)
    assert "head" not in vars(model), "refused before anything changed"
