"""06_mixed_precision.py: the loss scaler against torch.amp.GradScaler (1 and 2 ranks), fp32
master weights against fp32 training, and gradient accumulation against one big batch."""

import importlib
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from tests.distributed import run_ranks

mp = importlib.import_module("06_mixed_precision")
model_lib = importlib.import_module("02_model")
TINY = model_lib.GPTConfig.from_preset("tiny")  # 2 layers, C = 32, T = 32, V = 256: 35K params
INF, NAN = float("inf"), float("nan")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These tensors are tiny: extra threads only add synchronisation, and on a shared 2-core
    machine OpenMP's spinning threads made this file 10x slower. Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_batches(n, B=4, T=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, 256, (B, T), generator=g) for _ in "xy") for _ in range(n)]


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def grads_of(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


# ---------------------------------------------------------------------------------------------
# formats
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, known",
    [(torch.float32, 2.0**-149), (torch.bfloat16, 2.0**-133), (torch.float16, 2.0**-24)],
)
def test_smallest_subnormal_is_the_first_number_after_zero(dtype, known):
    """The smallest subnormal, smallest normal x eps as 06's underflow table computes it. fp16: 5
    exponent bits, emin = -14, 10 mantissa bits: 2^(-14-10) = 2^-24. Anything below half of it
    rounds to 0, which is what happens to small fp16 gradients."""
    sub = torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    zero = torch.zeros((), dtype=dtype)
    assert sub == known == torch.nextafter(zero, torch.ones((), dtype=dtype)).item()
    assert torch.tensor(sub * 0.49, dtype=torch.float64).to(dtype).item() == 0.0


def test_only_fp16_needs_a_loss_scaler():
    """fp16's 5 exponent bits flush small gradients to zero; bf16 has fp32's 8, and fp32 has
    nothing to scale: their scalers pass everything through."""
    assert mp.make_scaler(torch.float16).is_enabled()
    assert not mp.make_scaler(torch.bfloat16).is_enabled()
    assert not mp.make_scaler(torch.float32).is_enabled()


# ---------------------------------------------------------------------------------------------
# DynamicLossScaler == torch.amp.GradScaler
# ---------------------------------------------------------------------------------------------
def drive(scaler, steps, poison, seed=0, lr=0.05):
    """Train a tiny GPT under fp16 autocast on CPU for `steps` steps. poison[step] = inf or nan
    is written into one gradient element after that step's backward (a real overflow also
    happens on its own when the scale is too large: fp16 activation gradients hit inf).
    Returns the scale after every update, the steps whose optimizer.step() was skipped, and
    the final parameters."""
    torch.manual_seed(seed)
    model = model_lib.GPT(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    stepped = []
    optimizer.register_step_post_hook(lambda *_: stepped.append(True))
    scales, skipped = [], []
    for step, (x, y) in enumerate(random_batches(steps, seed=seed)):
        with torch.autocast("cpu", dtype=torch.float16):
            _, loss = model(x, y)
        scaler.scale(loss).backward()
        if step in poison:
            model.transformer.h[0].mlp.c_fc.weight.grad[step % 7, 3] = poison[step]
        n_stepped = len(stepped)
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # after unscale_: true grads
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
        if len(stepped) == n_stepped:
            skipped.append(step)
    return scales, skipped, flat(model.parameters())


SCRIPTS = {
    # injected inf, NaN and -inf, two in a row, between growths every 3 clean steps
    "injected": (dict(init_scale=2.0**12, growth_interval=3), {2: INF, 6: NAN, 7: INF, 12: -INF}),
    # no injection: a 2^28 scale overflows fp16's backward by itself (d loss/d logits ~ S/64
    # > 65504) until it has backed off enough, then grows every 2 clean steps and overflows again
    "natural overflow": (dict(init_scale=2.0**28, growth_interval=2), {}),
    # factors that are not powers of two: the scale is rounded to fp32 as GradScaler does
    "odd factors": (
        dict(init_scale=1000.0, growth_factor=1.7, backoff_factor=0.3, growth_interval=2),
        {3: INF, 4: NAN},
    ),
}


@pytest.mark.parametrize("name", SCRIPTS)
def test_scaler_makes_gradscalers_decisions(name):
    settings, poison = SCRIPTS[name]
    ours = drive(mp.DynamicLossScaler(**settings), 16, poison)
    theirs = drive(torch.amp.GradScaler("cpu", **settings), 16, poison)
    assert ours[0] == theirs[0], f"scale after each step: ours {ours[0]} vs GradScaler {theirs[0]}"
    assert ours[1] == theirs[1], f"skipped steps: ours {ours[1]} vs GradScaler {theirs[1]}"
    assert torch.equal(ours[2], theirs[2]), "same decisions and same unscaling: bit-equal params"
    # the script must really exercise both directions, or the comparison proves little
    assert ours[1], "no step was skipped"
    assert any(b > a for a, b in zip(ours[0], ours[0][1:])), "the scale never grew"
    if not poison:
        assert ours[1][0] == 0, "a 2^28 scale should overflow fp16's backward on the first step"


def test_scaler_update_rule_edge_cases_match_gradscaler():
    """The update rule alone, on one hand-set gradient per step: a scale that is not an fp32
    number (1000.3), factors that are not powers of two (products rounded to fp32 each time),
    growth every step, and a scale at fp32's top (2^127 x 2 = inf: GradScaler keeps 2^127)."""
    cases = [
        (dict(init_scale=1000.3, growth_factor=1.1, backoff_factor=0.37, growth_interval=1),
         [1.0, 1.0, INF, 1.0, NAN, 1.0, 1.0, 1.0]),
        (dict(init_scale=2.0**126, growth_interval=1), [1.0, 1.0, 1.0, INF, 1.0, 1.0]),
    ]  # fmt: skip
    for settings, grads in cases:
        runs = []
        for scaler in (mp.DynamicLossScaler(**settings), torch.amp.GradScaler("cpu", **settings)):
            p = torch.nn.Parameter(torch.zeros(2))
            optimizer, scales = torch.optim.SGD([p], lr=1.0), []
            for g in grads:
                scaler.scale(p.sum())  # GradScaler creates its scale lazily, here
                p.grad = torch.tensor([g, 1.0])
                scaler.step(optimizer)
                scaler.update()
                scales.append(scaler.get_scale())
            runs.append((scales, p.detach().clone()))
        assert runs[0][0] == runs[1][0], f"{settings}: {runs[0][0]} != {runs[1][0]}"
        assert torch.equal(runs[0][1], runs[1][1])
    assert runs[0][0][2] == 2.0**127, "growing past fp32's max is refused"


def test_scaler_state_round_trips_and_is_gradscalers_format(tmp_path):
    settings, poison = SCRIPTS["injected"]
    first = mp.DynamicLossScaler(**settings)
    drive(first, 8, poison)  # mid-way: tracker and scale are both non-trivial
    state = first.state_dict()
    torch.save(state, tmp_path / "scaler.pt")
    loaded = torch.load(tmp_path / "scaler.pt", weights_only=True)
    resumed = mp.DynamicLossScaler(init_scale=1.0, growth_interval=99)  # wrong on purpose
    resumed.load_state_dict(loaded)
    assert resumed.state_dict() == state
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(state)  # GradScaler reads our checkpoint ...
    assert theirs.state_dict() == state
    back = mp.DynamicLossScaler()
    back.load_state_dict(theirs.state_dict())  # ... and we read its
    later = {s - 8: v for s, v in poison.items() if s >= 8}
    assert drive(resumed, 8, later, seed=1)[:2] == drive(first, 8, later, seed=1)[:2]
    assert drive(back, 8, later, seed=1)[:2] == drive(theirs, 8, later, seed=1)[:2]


def test_unscale_is_idempotent_and_comes_before_clipping():
    """Clipping must see the true gradients: the norm after unscale_ equals the unscaled run's,
    and a second unscale_ in the same step (step() calls it again) changes nothing."""
    torch.manual_seed(0)
    model = model_lib.GPT(TINY)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    (x, y), scaler = random_batches(1)[0], mp.DynamicLossScaler(init_scale=2.0**10)
    model(x, y)[1].backward()
    true = grads_of(model)
    optimizer.zero_grad()
    scaler.scale(model(x, y)[1]).backward()
    scaler.unscale_(optimizer)
    once = grads_of(model)
    scaler.unscale_(optimizer)
    assert all(torch.equal(a, b) for a, b in zip(once, grads_of(model))), "unscaled twice"
    # x 2^10 then / 2^10 is exact in fp32: the unscaled gradients are the true ones
    assert all(torch.equal(a, b) for a, b in zip(once, true))
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    torch.testing.assert_close(norm, torch.linalg.vector_norm(flat(true)))
    scaler.step(optimizer)
    scaler.update()
    with pytest.raises(AssertionError, match="no inf checks"):
        scaler.update()  # update() without a step in between


def test_disabled_scaler_passes_everything_through():
    """bf16/fp32: scale(loss) is loss, step() always steps, state_dict() is {} (as GradScaler)."""
    p = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([p], lr=1.0)
    scaler, theirs = mp.make_scaler(torch.bfloat16), torch.amp.GradScaler("cpu", enabled=False)
    loss = (p * 2).sum()
    assert scaler.scale(loss) is loss and scaler.get_scale() == theirs.get_scale() == 1.0
    p.grad = torch.tensor([1.0, INF, 1.0])
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    assert torch.isinf(p).any(), "a disabled scaler does not check: the step happened"
    assert scaler.state_dict() == theirs.state_dict() == {}


# ---------------------------------------------------------------------------------------------
# fp32 master weights by hand
# ---------------------------------------------------------------------------------------------
TEXT = torch.tensor(list(
    b"Mixed precision training keeps an fp32 master copy of the weights, runs the forward and "
    b"the backward pass in 16-bit numbers, and multiplies the loss by a scale so that the small "
    b"gradients survive. bf16 has the range of fp32 and needs no scale; fp16 has more precision "
    b"and less range. Gradient accumulation divides by the tokens of the whole step. " * 2
))  # fmt: skip


def text_batches(steps, B=4, T=32):
    """Random windows of TEXT: a fixed corpus, so the test does not change when a file does."""
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(len(TEXT) - T - 1, (steps, B), generator=g)
    rows = TEXT[starts[..., None] + torch.arange(T + 1)]  # (steps, B, T+1)
    return list(zip(rows[..., :-1], rows[..., 1:]))


def train(mode, steps=30, lr=0.1):
    """SGD with momentum on the tiny GPT: 'fp32', or MasterWeights with a 16-bit working copy
    and make_scaler's scaler. Returns the losses, the fp32 parameters and the skipped steps."""
    torch.manual_seed(0)
    model = model_lib.GPT(TINY)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[mode]
    master = None if mode == "fp32" else mp.MasterWeights(model, dtype)
    params = master.parameters() if master else model.parameters()
    optimizer, scaler = torch.optim.SGD(params, lr=lr, momentum=0.9), mp.make_scaler(dtype)
    losses = [
        mp.train_step(model, optimizer, scaler, master, torch.float32, x, y)
        for x, y in text_batches(steps)
    ]
    params = flat(master.master if master else model.parameters())
    return torch.tensor(losses), params, scaler.skipped_steps


@pytest.fixture(scope="module")
def fp32_run():
    return train("fp32")[:2], train("fp32", lr=0.0)[1]


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_master_weight_training_matches_fp32(mode, fp32_run):
    (losses32, params32), init = fp32_run
    losses, params, skipped = train(mode)
    assert skipped == 0, "a skipped step: the runs would no longer compare step for step"
    assert losses32[0] - losses32[-1] > 1.0, "the fp32 run must learn for this test to mean much"
    eps = torch.finfo({"fp16": torch.float16, "bf16": torch.bfloat16}[mode]).eps
    # SGD's update is linear in the gradient, so the 16-bit run's weights differ from fp32's
    # only by lr x (gradient errors), which are a fraction of eps: each 16-bit operand is
    # rounded to a relative eps/2 and the many independent roundings mostly cancel. Measured:
    # losses within 0.07·eps and a drift of 0.4-0.5·eps of the update's norm, for both formats
    # (fp16's errors are 8x smaller than bf16's, as its eps). Tolerances: eps and 2·eps. A step
    # that fails to reach the model (no copy back; unscaled twice) misses by far more: the
    # fp32 loss falls from 5.5 to 3.1. (AdamW is a worse witness: m/sqrt(v) turns a gradient
    # that underflowed, or nearly, into a full-size update, so its drift does not scale with eps.)
    torch.testing.assert_close(losses, losses32, rtol=eps, atol=0.0)
    drift = ((params - params32).norm() / (params32 - init).norm()).item()
    assert drift < 2 * eps, f"{mode} master weights drifted {drift:.1e} of the update (eps {eps})"


def test_without_a_master_copy_small_updates_vanish():
    """Why the fp32 copy exists: weights ~0.02 lie in [2^-6, 2^-5), where fp16's numbers are
    2^-16 = 1.5e-5 apart; an update of 5e-6 is below half that gap, so w + update == w."""
    torch.manual_seed(0)
    w16 = (torch.randn(1000) * 0.02).clamp(0.0157, 0.031).half()  # inside [2^-6, 2^-5)
    update = torch.full_like(w16, 0.5e-5)
    assert torch.equal(w16 + update, w16), "fp16 keeps none of the update"
    master = w16.float()
    for _ in range(10):
        master += update.float()
    assert (master - w16.float() - 5e-5).abs().max() < 1e-7, "fp32 accumulated all 10 updates"
    assert (master.half() != w16).all(), "and 5e-5 > one fp16 gap: every working weight moved"


@pytest.mark.parametrize("path", ["by hand", "autocast"])
def test_an_overflowing_step_changes_no_parameter(path):
    """Two clean steps (so AdamW has state), then one whose fp16 backward overflows on its own
    (scale 2^40): no parameter (master or working), no optimizer state may change."""
    torch.manual_seed(0)
    model = model_lib.GPT(TINY)
    master = mp.MasterWeights(model, torch.float16) if path == "by hand" else None
    optimizer = torch.optim.AdamW(master.parameters() if master else model.parameters(), lr=1e-2)
    scaler, autocast = mp.DynamicLossScaler(), torch.float16 if master is None else torch.float32
    batches = random_batches(3)
    for x, y in batches[:2]:
        mp.train_step(model, optimizer, scaler, master, autocast, x, y)
    assert scaler.skipped_steps == 0 and scaler.get_scale() == 2.0**16
    before = [t.clone() for t in list(model.parameters()) + (master.master if master else [])]
    state = [v.clone() for s in optimizer.state.values() for v in s.values()]
    scaler.update(new_scale=2.0**40)
    mp.train_step(model, optimizer, scaler, master, autocast, *batches[2])
    assert scaler.last_step_skipped and scaler.skipped_steps == 1
    assert scaler.get_scale() == 2.0**39, "one backoff"
    after = list(model.parameters()) + (master.master if master else [])
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a skipped step moved a weight"
    after_state = [v for s in optimizer.state.values() for v in s.values()]
    assert all(torch.equal(a, b) for a, b in zip(state, after_state)), "AdamW's state moved"


# ---------------------------------------------------------------------------------------------
# gradient accumulation == one bigger batch
# ---------------------------------------------------------------------------------------------
def padded_batch(k, b, T=16, seed=0):
    """k·b rows; microbatch i keeps T/(i+1) real targets per row, the rest IGNORE."""
    x, y = random_batches(1, B=k * b, T=T, seed=seed)[0]
    for i in range(k):
        y[i * b : (i + 1) * b, T // (i + 1) :] = mp.IGNORE
    return x, y


def backward_grads(model, fn):
    model.zero_grad(set_to_none=True)
    fn()
    return grads_of(model)


# Tolerance for "equal": the two sides add the same terms in a different order (per-microbatch
# partial sums, then the accumulation in .grad). fp32 sums of a few hundred terms of mixed sign
# differ by ~1e-7 relative; rtol 1e-4 with atol 1e-7 (gradients here are ~1e-3) leaves room,
# and mean-of-means misses by ~10% of the gradient.
EQUAL = dict(rtol=1e-4, atol=1e-7)


def test_accumulation_over_k_microbatches_equals_one_batch():
    torch.manual_seed(0)
    model = model_lib.GPT(TINY)
    x, y = random_batches(1, B=8)[0]
    big = backward_grads(model, lambda: model(x, y)[1].backward())
    for k in (1, 2, 4, 8):
        micro = list(zip(x.chunk(k), y.chunk(k)))
        n = mp.global_token_count(micro)
        assert n == y.numel()
        acc = backward_grads(model, lambda m=micro, n=n: mp.accumulate_gradients(model, m, n))
        for (name, _), a, g in zip(model.named_parameters(), acc, big):
            torch.testing.assert_close(a, g, **EQUAL, msg=lambda s, n=name, k=k: f"k={k} {n}: {s}")


def test_unequal_tokens_token_normalised_equals_big_batch_mean_of_means_does_not():
    """Microbatches of 2 rows with 16, 8, 5 and 4 real targets per row: 32, 16, 10 and 8
    tokens. One batch weighs all 66 tokens equally (1/66 each); mean-of-means gives each
    microbatch 1/4 of the weight, 1/(4·n_i) per token, so a token of the last microbatch counts
    32/8 = 4 times as much as one of the first."""
    torch.manual_seed(0)
    model = model_lib.GPT(TINY)
    x, y = padded_batch(k=4, b=2)
    micro = list(zip(x.chunk(4), y.chunk(4)))
    assert [int(mp.count_tokens(t)) for _, t in micro] == [32, 16, 10, 8]
    big = backward_grads(model, lambda: model(x, y)[1].backward())
    n = mp.global_token_count(micro)
    token_normalised = backward_grads(model, lambda: mp.accumulate_gradients(model, micro, n))
    mean_of_means = backward_grads(model, lambda: mp.accumulate_mean_of_means(model, micro))
    for a, g in zip(token_normalised, big):
        torch.testing.assert_close(a, g, **EQUAL)
    scale = flat(big).abs().max()
    err_tok = ((flat(token_normalised) - flat(big)).abs().max() / scale).item()
    err_mom = ((flat(mean_of_means) - flat(big)).abs().max() / scale).item()
    print(
        f"max relative gradient error: token-normalised {err_tok:.1e}, mean of means {err_mom:.1e}"
    )
    assert err_mom > 1e-2 > 1e3 * err_tok, (err_tok, err_mom)
    # with equal token counts the two normalisations agree: the trap needs unequal counts
    x, y = random_batches(1, B=8)[0]
    micro = list(zip(x.chunk(4), y.chunk(4)))
    mean_of_means = backward_grads(model, lambda: mp.accumulate_mean_of_means(model, micro))
    big = backward_grads(model, lambda: model(x, y)[1].backward())
    for a, g in zip(mean_of_means, big):
        torch.testing.assert_close(a, g, **EQUAL)


def test_a_step_with_every_target_ignored_gives_zero_loss_and_zero_gradients():
    """SFT with masked prompts can draw a step whose targets are all IGNORE. N is clamped to 1
    (Megatron-LM #1764): the summed loss 0 over 1 is 0, and every gradient is exactly 0, with no
    NaN and no error (a device-side assert, before, killed the CUDA context). Plain and chunked."""
    x, y = random_batches(1, B=4)[0]
    micro = list(zip(x.chunk(2), torch.full_like(y, mp.IGNORE).chunk(2)))
    n = mp.global_token_count(micro)
    assert n.item() == 1, "no target counts: N clamped to 1"
    for chunked in (False, True):
        torch.manual_seed(0)
        model = model_lib.GPT(TINY)
        if chunked:  # 06b's loss, under 06's token count
            importlib.import_module("06b_recompute").apply_chunked_loss(model, 16)
        loss = mp.accumulate_gradients(model, micro, n)
        assert loss.item() == 0.0, (chunked, loss)
        assert not flat(grads_of(model)).any(), f"chunked={chunked}: a gradient is not 0"


# ---------------------------------------------------------------------------------------------
# two gloo ranks: one world, every case inside it
# ---------------------------------------------------------------------------------------------
@contextmanager
def counting_all_reduces(log: list, forwards: list):
    """Record, for every dist.all_reduce call, how many forwards had run by then."""
    original = dist.all_reduce

    def counted(*args, **kwargs):
        log.append(len(forwards))
        return original(*args, **kwargs)

    dist.all_reduce = counted
    try:
        yield
    finally:
        dist.all_reduce = original


def _scaler_cases(rank, world_size):
    """Ranks hold different models (as TP/PP ranks do) and overflow at different steps.
    ours: each rank's DynamicLossScaler (group = the world); want: GradScaler fed the union of
    all ranks' overflows (the decisions every rank must make); alone: ours with a group of one
    rank, i.e. without the all-reduce."""
    settings = dict(init_scale=2.0**12, growth_interval=3)
    per_rank = [{2: INF, 9: NAN}, {5: INF, 6: -INF}]
    union = {s: v for p in per_rank for s, v in p.items()}
    singles = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    ours = drive(mp.DynamicLossScaler(**settings), 12, per_rank[rank], seed=rank)
    want = drive(torch.amp.GradScaler("cpu", **settings), 12, union, seed=rank)
    alone = drive(mp.DynamicLossScaler(**settings, group=singles[rank]), 12, per_rank[rank], rank)
    return {"ours": ours, "want": want, "alone": alone[:2]}


def _accumulation_case(rank, world_size, wrapper):
    """k = 3 microbatches per rank with unequal token counts across microbatches and ranks,
    under a DP wrapper with no_sync(). Gradients vs one process on the whole global batch, and
    the forward count at each all-reduce (token count, then the gradient buckets)."""
    k, b = 3, 2
    x, y = padded_batch(k=k * world_size, b=b, seed=7)  # the global batch: (k·dp·b, T)
    torch.manual_seed(0)
    reference = model_lib.GPT(TINY)
    want = backward_grads(reference, lambda: reference(x, y)[1].backward())
    torch.manual_seed(0)
    model = model_lib.GPT(TINY)
    rows = slice(rank * k * b, (rank + 1) * k * b)  # this rank's k microbatches
    micro = list(zip(x[rows].chunk(k), y[rows].chunk(k)))
    forwards, calls = [], []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    if wrapper == "ours":
        dp = importlib.import_module("03_ddp").DataParallel(model)
    elif wrapper == "naive":
        dp = importlib.import_module("03_ddp").NaiveDataParallel(model)
    else:
        dp = torch.nn.parallel.DistributedDataParallel(model)
        # DDP all-reduces from C++; this hook is its default one, called through Python's
        # dist.all_reduce so that counting_all_reduces sees it
        dp.register_comm_hook(None, default_hooks.allreduce_hook)
    with counting_all_reduces(calls, forwards):
        n = mp.global_token_count(micro)
        loss = mp.accumulate_gradients(dp, micro, n, dp_size=world_size)
        if wrapper == "naive":  # the explicit loop: after the step's last backward, once
            dp.all_reduce_gradients()
    return {"grads": grads_of(model), "want": want, "calls": calls, "n": n, "loss": loss,
            "stats": dict(getattr(dp, "stats", {}))}  # fmt: skip


def _zero_case(rank, world_size):
    """03's DataParallel + 07's ZeroOptimizer(AdamW) under fp16 autocast with our scaler. Rank 1
    alone finds an inf (written into its gradient after the all-reduce). Both ranks must skip:
    a rank that called ZeroOptimizer.step() alone would wait forever in its broadcasts."""
    ddp = importlib.import_module("03_ddp")
    torch.manual_seed(0)
    model = ddp.DataParallel(model_lib.GPT(TINY))
    zero_lib = importlib.import_module("07_zero")
    optimizer = zero_lib.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    scaler, skipped = mp.DynamicLossScaler(init_scale=2.0**10), []
    for step, (x, y) in enumerate(random_batches(4, seed=rank)):
        with torch.autocast("cpu", dtype=torch.float16):
            _, loss = model(x, y)
        scaler.scale(loss).backward()  # DataParallel all-reduces during this backward
        if (step, rank) == (2, 1):
            model.module.lm_head.weight.grad[0, 0] = INF  # after the all-reduce: rank 1 only
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        skipped.append(scaler.last_step_skipped)
    return {"skipped": skipped, "params": flat(model.parameters()), "scale": scaler.get_scale()}


def _two_rank_world(rank, world_size):
    ddp = importlib.import_module("03_ddp")
    has_ours = hasattr(ddp, "DataParallel")  # (ZeroOptimizer: 07_zero.py)
    wrappers = ["torch DDP"] + (["ours", "naive"] if has_ours else [])
    out = {"scaler": _scaler_cases(rank, world_size), "has_ours": has_ours}
    out.update({w: _accumulation_case(rank, world_size, w) for w in wrappers})
    out["zero"] = _zero_case(rank, world_size) if has_ours else None
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_two_rank_world, 2, timeout=120)


def test_two_ranks_skip_together_when_one_overflows(two_ranks):
    for rank, result in enumerate(two_ranks):
        ours, want, alone = (result["scaler"][k] for k in ("ours", "want", "alone"))
        assert ours[:2] == want[:2], f"rank {rank}: scales/skips {ours[:2]} != {want[:2]}"
        assert torch.equal(ours[2], want[2]), f"rank {rank}: parameters differ from GradScaler's"
    assert two_ranks[0]["scaler"]["ours"][1] == [2, 5, 6, 9], "the union of both ranks' overflows"
    # without the all-reduce each rank skips only its own overflows: the ranks disagree
    alone = [r["scaler"]["alone"][1] for r in two_ranks]
    assert alone == [[2, 9], [5, 6]], alone


@pytest.mark.parametrize("wrapper", ["torch DDP", "ours", "naive"])
def test_dp_accumulation_equals_the_global_batch_with_one_all_reduce_round(two_ranks, wrapper):
    if wrapper not in two_ranks[0]:
        pytest.skip("03_ddp.DataParallel does not exist yet (checked with torch's DDP instead)")
    k = 3
    for rank, result in enumerate(two_ranks):
        r = result[wrapper]
        for a, g in zip(r["grads"], r["want"]):
            torch.testing.assert_close(a, g, **EQUAL)
        # one all-reduce for the token count before any forward, then ONE bucket all-reduce,
        # fired by the last microbatch's backward (no_sync kept the first k-1 local)
        # (the naive loop: one all-reduce per gradient tensor, all after the k-th forward)
        calls = r["calls"] if wrapper != "naive" else sorted(set(r["calls"]))
        assert calls == [0, k], f"rank {rank}: all-reduces at forward counts {r['calls']}"
        if wrapper == "ours":  # and 03's own counters agree: one bucket, one sync
            assert (r["stats"]["allreduce_calls"], r["stats"]["syncs"]) == (1, 1), r["stats"]
        if wrapper == "naive":  # one round of one all-reduce per gradient tensor
            assert r["stats"]["syncs"] == 1 and len(r["calls"]) == 1 + len(r["grads"]), r
    assert two_ranks[0][wrapper]["n"] == two_ranks[1][wrapper]["n"], "N is global"
    total_loss = sum(r[wrapper]["loss"] for r in two_ranks)
    torch.manual_seed(0)
    x, y = padded_batch(k=k * 2, b=2, seed=7)
    # accumulate_gradients returns a 0-dim tensor (no .item() per microbatch: a sync each)
    torch.testing.assert_close(total_loss.item(), model_lib.GPT(TINY)(x, y)[1].item(), rtol=1e-5, atol=0)


def test_zero_optimizer_step_is_skipped_on_every_rank(two_ranks):
    if two_ranks[0]["zero"] is None:
        pytest.skip("03_ddp.DataParallel/ZeroOptimizer do not exist yet")
    for r in two_ranks:
        assert r["zero"]["skipped"] == [False, False, True, False], r["zero"]["skipped"]
    assert torch.equal(two_ranks[0]["zero"]["params"], two_ranks[1]["zero"]["params"])
    assert two_ranks[0]["zero"]["scale"] == two_ranks[1]["zero"]["scale"] == 2.0**9
