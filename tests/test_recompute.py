"""06b_recompute.py's recomputation: the bytes each mode keeps for the backward, counted by
autograd's saved-tensors hooks, equal the formula to the byte in every precision of 06; the
replay draws the same dropout masks (gradients equal bit for bit); the policy keeps what it
should, and redoes attention whenever attention draws random numbers."""

import importlib

import pytest
import torch

from tests.test_mixed_precision import random_batches

mp = importlib.import_module("06_mixed_precision")  # MasterWeights, autocast: the precisions
rc = importlib.import_module("06b_recompute")
model_lib = importlib.import_module("02_model")
TINY = model_lib.GPTConfig.from_preset("tiny")  # 2 layers, C = 32, T = 32, V = 256: 35K params


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: extra threads only spin on a shared 2-core machine. Restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# activation memory: measured == formula
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recompute", rc.RECOMPUTE)
@pytest.mark.parametrize(
    "mode", ["fp32", "bf16 autocast", "fp16 autocast + scaler", "fp16 by hand"]
)
def test_held_activations_equal_the_formula(mode, recompute):
    """The bytes kept for the backward, counted by saved_activation_bytes (autograd's saved
    tensors and selective recomputation's kept outputs, the parameters left out), equal
    activation_formula to the byte, in all and per layer (3 layers' less 2 layers'), for
    every precision and recomputation: the tiny GPT at B = 3, T = 32 and a wider one (4 heads,
    C = 64) on a sequence shorter than its context (T = 12 < 16). A term the formula misses or
    miscounts is off by whole multiples of B·T (the GELU output alone is B·T·4C·2 bytes a layer
    in 16 bits), never by rounding: the counts are exact integers. Under full recomputation a
    layer holds only its input, C fp32 numbers a token; selective keeps the matmuls' outputs.
    Under autocast a layer's 16-bit weight copies (12C² numbers) are saved only without
    recomputation: a recomputed block casts its weights again in the backward."""
    wider = dict(n_head=4, n_embd=64, block_size=16)
    held = {}
    for name, T, layers in (("tiny", 32, 2), ("wider", 12, 3), ("wider", 12, 2)):
        extra = wider if name == "wider" else {}
        config = model_lib.GPTConfig.from_preset("tiny", n_layer=layers, **extra)
        torch.manual_seed(0)
        model = rc.apply_recomputation(model_lib.GPT(config), recompute)
        if mode == "fp16 by hand":
            mp.MasterWeights(model, torch.float16)  # the model itself becomes the fp16 copy
        autocast = {"bf16 autocast": torch.bfloat16, "fp16 autocast + scaler": torch.float16}
        x, y = random_batches(1, B=3, T=T)[0]
        with mp.autocast_context(autocast.get(mode, torch.float32), "cpu"):
            _, held[name, layers] = rc.saved_activation_bytes(lambda m=model, x=x, y=y: m(x, y))
        formula = rc.activation_formula(config, 3, T, mode, recompute)
        assert held[name, layers] == formula, (name, layers, held[name, layers], formula)
    one_layer = held["wider", 3] - held["wider", 2]  # B·T = 3·12 tokens, C = 64, nh = 4
    C, nh, a, r = 64, 4, 4 if mode == "fp32" else 2, 2 if mode == "fp16 by hand" else 4
    per_token = {"none": 2 * (C + 2) * r + 14 * C * a + 4 * nh,  # as 06b's table: 64C + 16 + 4nh
                 "selective": C * r + 10 * C * a + 4 * nh, "full": C * r}  # fmt: skip
    copied = "autocast" in mode and recompute == "none"
    weight_copies = 2 * 12 * C * C if copied else 0  # a layer's weights, 16-bit
    assert one_layer == 3 * 12 * per_token[recompute] + weight_copies


def gradients(config, x, y, seed=0, recompute="none"):
    torch.manual_seed(seed)
    model = rc.apply_recomputation(model_lib.GPT(config), recompute)
    torch.manual_seed(seed + 1)  # the dropout masks' stream
    _, loss = model(x, y)
    loss.backward()
    return loss, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_gives_the_same_loss_and_gradients_bit_for_bit(recompute):
    """In fp32 with dropout 0.1 (embeddings, attention probabilities, both residual branches),
    recomputing a block in the backward must draw the very same masks as its first forward:
    torch.equal, not a tolerance, as the same ops run on the same numbers. A replay that did
    not rewind the random state would drop other entries and change most gradients."""
    config = model_lib.GPTConfig.from_preset("tiny", dropout=0.1, n_layer=3)
    x, y = random_batches(1, B=3, T=32)[0]
    loss, grads = gradients(config, x, y)
    loss_r, grads_r = gradients(config, x, y, recompute=recompute)
    assert torch.equal(loss, loss_r)
    assert all(torch.equal(g, h) for g, h in zip(grads, grads_r))


def test_apply_recomputation_wraps_blocks_from_outside_and_checks_its_mode():
    """02's GPT knows nothing of recomputation (no config switch, Block.forward unchanged):
    apply_recomputation sets each Block's forward from outside, "none" takes it off again,
    and an unknown mode is refused with the valid ones named. The keep-what policy runs
    only under "selective": counted here by the ops it was asked about."""
    assert not hasattr(model_lib.GPTConfig(), "recompute")
    model = model_lib.GPT(TINY)
    x, y = random_batches(1, B=2, T=16)[0]
    asked = []
    policy = rc._policy
    rc._policy = lambda *args, **kwargs: asked.append(args[2]) or policy(*args, **kwargs)
    try:
        for mode, wrapped, calls in (("full", 2, 0), ("selective", 2, 1), ("none", 0, 0)):
            rc.apply_recomputation(model, mode)
            blocks = model.transformer.h
            assert sum("forward" in vars(b) for b in blocks) == wrapped, mode
            asked.clear()
            model(x, y)[1].backward()
            assert (len(asked) > 0) == bool(calls), (mode, len(asked))
    finally:
        rc._policy = policy
    with pytest.raises(ValueError, match="recompute must be one of"):
        rc.apply_recomputation(model, "some")


def test_selective_keeps_attention_only_when_it_draws_no_random_numbers():
    """A GPU's attention kernels (flash, cuDNN, memory-efficient) draw their dropout from the
    CUDA generator inside the op. Were such an output kept, the replay would skip the draw and
    shift every later dropout mask: wrong gradients, silently, and only on a GPU (a CPU with
    dropout runs attention as bmm and bernoulli, so no CPU run reaches this). The policy is
    asked directly, with the CUDA ops' names: kept without dropout, redone with it."""
    aten, policy = torch.ops.aten, rc._policy
    keep, redo = (
        torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE,
        torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE,
    )
    kernels = [aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_cudnn_attention.default,
               aten._scaled_dot_product_efficient_attention.default,
               aten._scaled_dot_product_flash_attention_for_cpu.default]  # fmt: skip
    for op in kernels:
        assert policy(True, None, op) == keep, op  # dropout 0: kept, as a matmul's output
        assert policy(False, None, op) == redo, op  # dropout on: redone with its random draws
    for op in (aten.mm.default, aten.addmm.default):
        assert policy(False, None, op) == keep, op
    for op in (aten.native_layer_norm.default, aten.gelu.default, aten.add.Tensor):
        assert policy(True, None, op) == redo, op


def test_selective_decides_to_redo_attention_whenever_dropout_draws():
    """The decision the test above feeds in by hand, taken by 06b's _recomputed on a CPU:
    the keep_attention flag each Block hands the policy. Attention's dropout draws only
    in training with dropout > 0: then False (a kept GPU attention output would skip its
    draws); with dropout 0, or in eval mode with gradients on, True. Breaking the rule
    (keep_attention = True, or `and` for `or`) makes a GPU run silently wrong: here red."""
    flags = []
    policy = rc._policy
    rc._policy = lambda keep, *args, **kwargs: flags.append(keep) or policy(keep, *args, **kwargs)
    x, y = random_batches(1, B=2, T=8)[0]
    try:
        for dropout, training, want in ((0.1, True, False), (0.0, True, True), (0.1, False, True)):
            torch.manual_seed(0)
            config = model_lib.GPTConfig.from_preset("tiny", dropout=dropout)
            model = rc.apply_recomputation(model_lib.GPT(config).train(training), "selective")
            flags.clear()
            model(x, y)[1].backward()
            assert flags and set(flags) == {want}, (dropout, training, set(flags))
    finally:
        rc._policy = policy
