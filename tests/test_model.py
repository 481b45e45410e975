"""Tests for 02_model.py, written as worked examples: each docstring derives the expected answer.

All on CPU, single process, a few seconds in total.
"""

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

model_lib = importlib.import_module("02_model")
to_hf_state_dict = importlib.import_module("support.train.export").to_hf_state_dict
meta_lib = importlib.import_module("support.meta")
shapes_only = meta_lib.shapes_only
GPT, GPTConfig = model_lib.GPT, model_lib.GPTConfig


def tiny(**overrides):
    return GPTConfig.from_preset("tiny", **overrides)


def make_model(config=None, seed=0):
    torch.manual_seed(seed)
    return GPT(config or tiny()).eval()


# --------------------------------------------------------------------------- shapes and loss


def test_forward_shapes_and_ignored_targets():
    """Logits are (B, T, V_padded), the loss a scalar, and a target of -1 takes no part.

    With vocab_size 250 padded to a multiple of 64 the head has 256 outputs. Setting the second
    half of the targets to -1 must give exactly the loss over the first half alone."""
    model = make_model(tiny(vocab_size=250, pad_vocab_multiple=64))
    assert model.config.padded_vocab_size == 256
    idx = torch.randint(0, 250, (3, 10))
    targets = torch.randint(0, 250, (3, 10))
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 10, 256)
    assert loss.shape == () and loss.dtype == torch.float32

    logits_only, no_loss = model(idx)
    assert no_loss is None
    torch.testing.assert_close(logits_only, logits, rtol=0, atol=0)

    masked = targets.clone()
    masked[:, 5:] = -1
    _, loss_masked = model(idx, masked)
    real = logits[:, :5, :250].reshape(-1, 250)  # the padding columns take no part (masked)
    expected = F.cross_entropy(real, targets[:, :5].reshape(-1))
    # Same numbers, same fp32 reduction over 15 terms: only summation order can differ.
    torch.testing.assert_close(loss_masked, expected, rtol=1e-6, atol=1e-6)

    _, loss_sum = model(idx, masked, reduction="sum")
    torch.testing.assert_close(loss_sum, expected * 15, rtol=1e-5, atol=1e-5)


def test_dropout_only_in_training():
    """With dropout (embedding, attention probabilities, residual branches) a training forward is
    random and an eval forward is deterministic."""
    model = make_model(tiny(dropout=0.5))
    idx = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(model(idx)[0], model(idx)[0], rtol=0, atol=0)
    model.train()
    assert not torch.equal(model(idx)[0], model(idx)[0])


def test_too_long_input_is_a_clear_error():
    model = make_model()
    with pytest.raises(AssertionError, match="exceeds block_size=32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_initial_loss_is_ln_vocab():
    """At init the model knows nothing, so its prediction is close to uniform: loss ~ ln V.

    Why close: ln_f output has unit variance per channel and lm_head weights have std 0.02, so
    each logit has std s ~ 0.02 * sqrt(C). For near-uniform logits the expected cross-entropy
    is ln V + s^2 / 2. With C = 128: s ~ 0.23, a shift of ~0.03 above ln 256 = 5.545. The
    per-token spread is ~s, averaged over 8 x 64 = 512 tokens, about 0.01. So 0.1 is a safe
    bound, and a broken init (say std 1 weights: logits of std sqrt(C) ~ 11) would be far off."""
    config = tiny(n_embd=128, n_head=4, block_size=64)
    model = make_model(config, seed=1)
    idx = torch.randint(0, 256, (8, 64))
    targets = torch.randint(0, 256, (8, 64))
    _, loss = model(idx, targets)
    assert abs(loss.item() - math.log(256)) < 0.1, loss.item()


def test_causal_future_tokens_do_not_change_the_past():
    """Logit t may depend on tokens 0..t only. Change token 7: positions 0..6 must not move
    (to the last bit: masked scores contribute exp(-inf) = 0 exactly); positions 7.. must."""
    model = make_model()
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 256
    before, _ = model(idx)
    after, _ = model(changed)
    torch.testing.assert_close(after[:, :7], before[:, :7], rtol=0, atol=0)
    assert not torch.allclose(after[:, 7:], before[:, 7:])


# --------------------------------------------------------------------------- counting


@pytest.mark.parametrize(
    "preset, published",
    [
        ("gpt2", 124_439_808),
        ("gpt2-medium", 354_823_168),
        ("gpt2-large", 774_030_080),
        ("gpt2-xl", 1_557_611_200),
    ],
)
def test_gpt2_parameter_counts(preset, published):
    """GPT-2 small has 124,439,808 parameters (Hugging Face's count, tied embeddings).

    By hand, per block (C = 768, every Linear and LayerNorm with a bias):
        ln_1, ln_2     2 x (C + C)          =     3,072
        attn.c_attn    C*3C + 3C            = 1,771,776
        attn.c_proj    C*C + C              =   590,592
        mlp.c_fc       C*4C + 4C            = 2,362,368
        mlp.c_proj     4C*C + C             = 2,360,064
        block total    12 C^2 + 13 C        = 7,087,872
    12 blocks = 85,054,464; wte 50257 x 768 = 38,597,376 (lm_head is the same tensor);
    wpe 1024 x 768 = 786,432; ln_f 1,536. Sum: 124,439,808. Non-embedding drops wpe only.
    The model is built on the meta device: real modules, no memory."""
    config = GPTConfig.from_preset(preset)
    C, L, V, T = config.n_embd, config.n_layer, config.vocab_size, config.block_size
    by_hand = L * (12 * C * C + 13 * C) + V * C + T * C + 2 * C
    assert by_hand == published
    with torch.device("meta"):
        model = GPT(config)
    assert model.num_params() == published
    assert model.num_params(non_embedding=True) == published - T * C
    assert model_lib.count_params(config) == published


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tie", [True, False])
def test_count_params_matches_the_module(bias, tie):
    """count_params (the module on the meta device) and the real module agree with the count by
    hand in every combination: per block 12 C^2 weights and 13 C biases and gains (4 LayerNorm
    vectors, 9 C of Linear biases) or 2 C without biases; wte V_padded x C, wpe T x C, ln_f, and
    an untied lm_head. Untied, the lookup table wte is not non-embedding but lm_head is."""
    config = tiny(bias=bias, tie_embeddings=tie, vocab_size=250, pad_vocab_multiple=64)
    C, L, V, T = 32, 2, 256, 32
    by_hand = L * (12 * C * C + (13 if bias else 2) * C) + V * C + T * C + (2 if bias else 1) * C
    by_hand += 0 if tie else V * C
    model = make_model(config)
    assert model.num_params() == model_lib.count_params(config) == by_hand
    non_embedding = by_hand - T * C - (0 if tie else V * C)
    assert model.num_params(True) == model_lib.count_params(config, True) == non_embedding
    if not tie:
        assert model.num_params(True) == model.num_params() - (256 + 32) * 32


def test_flops_per_token_hand_count():
    """tiny: C = 32, L = 2, nh = 2, hs = 16, V = 256, T = 32, biases, tied embeddings.

    N (non-embedding) = L (12 C^2 + 13 C) + ln_f 2C + head V C
                      = 2 (12,288 + 416) + 64 + 8,192 = 33,664
    6N                = 201,984     (2N forward + 4N backward: one multiply-add per weight)
    12 L H Q T        = 12 * 2 * 2 * 16 * 32 = 24,576   (q k^T and att @ v, fwd + bwd)
    total             = 226,560 FLOPs per token; at T = 8 the attention part is 6,144."""
    config = tiny()
    assert model_lib.flops_per_token(config) == 201_984 + 24_576 == 226_560
    assert model_lib.flops_per_token(config, seq_len=8) == 201_984 + 6_144
    assert make_model(config).num_params(non_embedding=True) == 33_664


def test_recomputed_flops_hand_count():
    """HFU's extra FLOPs (02's recompute_flops_per_token, for train.py's log). Full recomputation redoes each
    block's forward: its matmuls, 2 FLOPs per weight, 12 C^2 weights a block, and attention's
    q k^T and att @ v, 2·T·hs each per head. tiny: C = 32, L = 2, nh = 2, hs = 16, T = 32:
        2 (2 * 12 * 32^2 + 4 * 2 * 16 * 32) = 2 (24,576 + 4,096) = 57,344 FLOPs per token,
    about a third of the blocks' 6N; selective redoes no weight's matmul: 0; none: 0."""
    redo = model_lib.recompute_flops_per_token
    for mode, extra in (("none", 0), ("selective", 0), ("full", 57_344)):
        assert redo(tiny(), 32, mode) == extra, mode
    # with dropout, selective redoes attention (no kept output may skip a random draw): 2 x 4,096
    assert redo(tiny(dropout=0.1), 32, "selective") == 8_192


def test_peak_flops_and_mfu():
    """Dense (not 2:4 sparse) datasheet peaks; unknown devices and dtypes are None, not guesses.
    The table and mfu() live in support/gpus.py (train.py's logs and the benchmarks read them).

    MFU by hand: 400,000 tokens/s x 1e9 FLOPs/token on 2 GPUs of 1e15 FLOP/s = 4e14 / 2e15 = 0.2."""
    gpus = importlib.import_module("support.gpus")
    peak = gpus.peak_flops
    assert peak("NVIDIA H100 80GB HBM3", "bf16") == 989.5e12  # 1979 "with sparsity" / 2
    assert peak("NVIDIA H100 PCIe", "bf16") == 756.5e12  # the more specific key wins
    assert peak("NVIDIA A100-SXM4-40GB", "tf32") == 156e12
    assert peak("NVIDIA L4", "bf16") == 121e12
    assert peak("Tesla T4", "bf16") is None  # Turing has no bf16 tensor cores
    assert peak("NVIDIA L40S", "bf16") is None  # "L4" must not match "L40S"
    assert peak("NVIDIA H100 NVL", "bf16") is None  # a different card: do not borrow SXM's
    assert peak("NVIDIA GeForce RTX 3090 Ti", "bf16") is None
    assert peak("Some Future Accelerator", "bf16") is None

    assert gpus.mfu(4e5, 1e9, 2, 1e15) == pytest.approx(0.2)
    assert gpus.mfu(4e5, 1e9, 2, peak("cpu", "fp32")) is None


# --------------------------------------------------------------------------- training


def test_byte_batches_are_shifted_windows_of_the_frozen_corpus():
    """byte_batches(T=16, B=3, steps=2): two (x, y) pairs of (3, 16) int64 byte values, y = x
    moved one byte on (so x[:, 1:] == y[:, :-1]), each row a window of support/frozen_corpus.txt,
    a frozen text: editing a lesson (02 itself included) never changes the demos' batches.
    Every tensor has its own storage of exactly B*T*8 bytes, even at B = 1 (where a slice of
    the rows would have been contiguous already); the same seed gives the same batches."""
    batches = model_lib.byte_batches(16, 3, steps=2, seed=5)
    source = model_lib.DEMO_CORPUS.read_bytes()
    assert model_lib.DEMO_CORPUS.parent.name == "support"
    assert len(batches) == 2
    for x, y in batches:
        assert x.shape == y.shape == (3, 16) and x.dtype == y.dtype == torch.long
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row, target in zip(x, y):
            assert bytes(row.tolist()) + bytes(target[-1:].tolist()) in source
    again = model_lib.byte_batches(16, 3, steps=2, seed=5)
    assert all(torch.equal(a, b) for pair, same in zip(batches, again) for a, b in zip(pair, same))
    assert not torch.equal(model_lib.byte_batches(16, 3, seed=6)[0][0], batches[0][0])
    one = model_lib.byte_batches(16, 1, steps=2)
    storages = {t.untyped_storage().data_ptr() for pair in one for t in pair}
    assert len(storages) == 4 and all(t.untyped_storage().nbytes() == 16 * 8 for t in one[0])
    # the lesson's own bytes are not the source any more: a window of 02_model.py is absent
    lesson = open(model_lib.__file__, "rb").read()
    assert not any(bytes(x[0].tolist()) in lesson for x, _ in batches)


def test_tiny_model_overfits_one_batch():
    """A model that can learn must memorise one small batch: 4 rows of 32 random tokens, every
    target fixed. From ln 256 = 5.5 the loss must fall below 0.1 within 60 AdamW steps (it gets
    there in about 35; `python 02_model.py` prints such a curve). Random tokens cannot be
    predicted from statistics, only memorised, so position and attention must carry information."""
    model = make_model(seed=0).train()
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (4, 33), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(60):
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.1, loss.item()


def test_init_statistics():
    """GPT-2's init: weights N(0, 0.02), the residual projections N(0, 0.02 / sqrt(2L)), zero
    biases, LayerNorm weight 1, and lm_head is wte itself (tied), not a copy."""
    config = tiny(n_layer=8, n_embd=64)
    model = make_model(config)
    attn = model.transformer.h[0].attn
    assert model.lm_head.weight is model.transformer.wte.weight
    # 64*192 = 12,288 samples: the sample std is within ~1% of the true std.
    assert attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual = torch.cat([b.mlp.c_proj.weight.flatten() for b in model.transformer.h])
    assert residual.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert torch.all(attn.c_attn.bias == 0) and torch.all(model.transformer.ln_f.weight == 1)


# --------------------------------------------------------------------------- Hugging Face


def hf_state_dict(C=32, L=2, V=61, T=16, prefix="transformer.", seed=0):
    """A GPT-2 state dict in Hugging Face's layout, random numbers: Conv1D weights as (in, out),
    the causal-mask buffers attn.bias (1, 1, T, T) and attn.masked_bias, lm_head = wte.
    The numbers are float32 values stored as float64: loading them into a float32 model is then
    exact, and .double() gives the model the very same numbers as the reference."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    sd = {f"{prefix}wte.weight": rand(V, C), f"{prefix}wpe.weight": rand(T, C)}
    for i in range(L):
        h = f"{prefix}h.{i}."
        sd[h + "ln_1.weight"], sd[h + "ln_1.bias"] = 1 + rand(C), rand(C)
        sd[h + "attn.bias"] = torch.tril(torch.ones(T, T)).view(1, 1, T, T)
        sd[h + "attn.masked_bias"] = torch.tensor(-1e4)
        sd[h + "attn.c_attn.weight"], sd[h + "attn.c_attn.bias"] = rand(C, 3 * C), rand(3 * C)
        sd[h + "attn.c_proj.weight"], sd[h + "attn.c_proj.bias"] = rand(C, C), rand(C)
        sd[h + "ln_2.weight"], sd[h + "ln_2.bias"] = 1 + rand(C), rand(C)
        sd[h + "mlp.c_fc.weight"], sd[h + "mlp.c_fc.bias"] = rand(C, 4 * C), rand(4 * C)
        sd[h + "mlp.c_proj.weight"], sd[h + "mlp.c_proj.bias"] = rand(4 * C, C), rand(C)
    sd[f"{prefix}ln_f.weight"], sd[f"{prefix}ln_f.bias"] = 1 + rand(C), rand(C)
    sd = {k: v.double() for k, v in sd.items()}
    sd["lm_head.weight"] = sd[f"{prefix}wte.weight"]
    return sd


def hf_reference_forward(sd, idx, n_head, prefix="transformer."):
    """GPT-2's forward as Hugging Face's modeling_gpt2 computes it, written out independently:
    Conv1D is x @ W + b with W (in, out); attention masks with the attn.bias buffer; the MLP
    uses gelu_new, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""

    def p(name):
        return sd[prefix + name]

    def conv1d(x, name):
        return x @ p(name + ".weight") + p(name + ".bias")

    def layer_norm(x, name):
        return F.layer_norm(x, x.shape[-1:], p(name + ".weight"), p(name + ".bias"), eps=1e-5)

    def gelu_new(x):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    B, T = idx.shape
    C = p("wte.weight").shape[1]
    hs = C // n_head
    x = p("wte.weight")[idx] + p("wpe.weight")[:T]
    n_layer = sum(1 for k in sd if k.endswith("ln_1.weight"))
    for i in range(n_layer):
        h = f"h.{i}."
        q, k, v = conv1d(layer_norm(x, h + "ln_1"), h + "attn.c_attn").split(C, dim=2)
        q, k, v = (t.view(B, T, n_head, hs).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(hs)
        mask = p(h + "attn.bias")[:, :, :T, :T].bool()
        att = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + conv1d(y, h + "attn.c_proj")
        x = x + conv1d(
            gelu_new(conv1d(layer_norm(x, h + "ln_2"), h + "mlp.c_fc")), h + "mlp.c_proj"
        )
    return layer_norm(x, "ln_f") @ sd["lm_head.weight"].T


@pytest.mark.parametrize("prefix", ["transformer.", ""])
def test_hf_state_dict_loads_and_matches_hf_math(prefix):
    """Load a HF-layout GPT-2 (with or without the "transformer." prefix that GPT2LMHeadModel
    adds over GPT2Model) and get Hugging Face's logits.

    The config is read off the shapes (V = 61, C = 32, L = 2, block_size = 16); n_head = 4 must
    be passed: 4 heads of 8 and 2 heads of 16 have the same weight shapes. Everything runs in
    float64, where rounding is ~1e-16: agreement to 1e-10 leaves no room for a real difference
    (a transposed weight or a wrong head split is off by O(1))."""
    sd = hf_state_dict(prefix=prefix)
    model = GPT.from_hf_state_dict(sd, n_head=4).double().eval()
    c = model.config
    assert (c.vocab_size, c.n_embd, c.n_layer, c.block_size, c.n_head) == (61, 32, 2, 16, 4)
    assert c.bias and c.tie_embeddings and model.lm_head.weight is model.transformer.wte.weight

    idx = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(1))
    logits, _ = model(idx)
    expected = hf_reference_forward(hf_state_dict(prefix="transformer."), idx, n_head=4)
    torch.testing.assert_close(logits, expected, rtol=1e-10, atol=1e-10)


def test_hf_state_dict_round_trips_exactly():
    """to_hf_state_dict inverts from_hf_state_dict bit for bit (transposing twice is exact),
    minus the mask buffers, which are not weights; and a model survives the trip both ways."""
    sd = hf_state_dict()
    back = to_hf_state_dict(GPT.from_hf_state_dict(sd, n_head=4).double())
    weights = {k: v for k, v in sd.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    assert back.keys() == weights.keys()
    for key, value in weights.items():
        torch.testing.assert_close(back[key], value, rtol=0, atol=0, msg=key)

    model = make_model(tiny(vocab_size=250, pad_vocab_multiple=64))
    hf = to_hf_state_dict(model)
    assert hf["transformer.wte.weight"].shape == (250, 32)  # padding rows are not HF's
    assert hf["transformer.h.0.mlp.c_fc.weight"].shape == (32, 128)  # Conv1D: (in, out)
    again = GPT.from_hf_state_dict(hf, n_head=2)
    idx = torch.randint(0, 250, (2, 32))
    torch.testing.assert_close(again(idx)[0][..., :250], model(idx)[0][..., :250], rtol=0, atol=0)


def test_load_pretrained_bin_file_and_folder(tmp_path):
    """A .bin checkpoint (torch.save of the state dict) loads through torch.load(weights_only=True);
    n_head defaults to GPT-2's convention C // 64, here 128 // 64 = 2. Given the folder of a
    Hugging Face snapshot instead, n_head comes from its config.json."""
    sd = {k: v.float() for k, v in hf_state_dict(C=128, prefix="").items()}
    torch.save(sd, tmp_path / "pytorch_model.bin")
    model = GPT.load_pretrained(tmp_path / "pytorch_model.bin")
    assert model.config.n_head == 2 and model.config.n_embd == 128
    (tmp_path / "config.json").write_text('{"n_head": 4}')
    assert GPT.load_pretrained(tmp_path).config.n_head == 4
    with pytest.raises(ValueError, match="unknown checkpoint format"):
        GPT.load_pretrained(tmp_path / "weights.npz")


def test_load_pretrained_safetensors(tmp_path):
    """.safetensors loads when the optional safetensors package is installed; without it the
    error says how to fix it (the package is not a dependency of this course)."""
    path = tmp_path / "model.safetensors"
    try:
        from safetensors.torch import save_file
    except ImportError:
        path.write_bytes(b"")
        with pytest.raises(ImportError, match="pip install safetensors"):
            GPT.load_pretrained(path)
        return
    sd = {k: v.float().contiguous() for k, v in hf_state_dict().items() if k != "lm_head.weight"}
    save_file(sd, str(path))  # safetensors refuses shared tensors: HF files omit lm_head too
    assert GPT.load_pretrained(path, n_head=4).config.n_layer == 2


def test_attention_reads_its_head_count_from_the_tensor():
    """For tensor parallelism (04) a rank keeps some heads: the q, k and v rows of c_attn for
    those heads, and the matching input columns of c_proj. The unchanged forward must then run
    and give that rank's share: the two halves' outputs (without c_proj's bias) sum to the
    whole. (Megatron-LM, arXiv 1909.08053, section 3: heads split across ranks.)"""
    config = tiny(n_head=4)
    attn = make_model(config).transformer.h[0].attn
    x = torch.randn(2, 8, 32)
    full = attn(x) - attn.c_proj.bias
    C, hs, parts = 32, 8, []
    for rank in range(2):
        heads = slice(rank * 2 * hs, (rank + 1) * 2 * hs)  # 2 heads of 8 channels per rank
        shard = model_lib.CausalSelfAttention(config)
        rows = torch.cat([torch.arange(C)[heads] + j * C for j in range(3)])  # q, k, v rows
        shard.c_attn.weight.data = attn.c_attn.weight.data[rows]
        shard.c_attn.bias.data = attn.c_attn.bias.data[rows]
        shard.c_proj.weight.data = attn.c_proj.weight.data[:, heads]
        shard.c_proj.bias.data = torch.zeros(C)
        parts.append(shard(x))  # (B, T, C) partial sum from nh/2 heads
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- generation


def test_generate_shapes_greedy_and_context_crop():
    """generate appends max_new_tokens ids; temperature 0 is argmax, hence deterministic, and its
    first id is the argmax of forward's last logits. A prompt already block_size long works:
    the context is cropped to the last 32 ids."""
    model = make_model()
    prompt = torch.randint(0, 256, (2, 32))
    out = model.generate(prompt, 5, temperature=0.0)
    assert out.shape == (2, 37) and torch.equal(out[:, :32], prompt)
    assert torch.equal(out, model.generate(prompt, 5, temperature=0.0))
    logits, _ = model(prompt)
    assert torch.equal(out[:, 32], logits[:, -1].argmax(-1))

    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = model.generate(prompt, 5, temperature=1.0, top_k=10, generator=g1)
    b = model.generate(prompt, 5, temperature=1.0, top_k=10, generator=g2)
    assert torch.equal(a, b)


def test_generate_never_emits_padding_ids():
    """vocab_size 250 padded to 256: ids 250..255 are not tokens. Rig the head so they have the
    highest logits by far (head is an overridable piece); greedy and sampling must still pick
    only real ids < 250, since generate drops the padded columns before choosing."""
    model = make_model(tiny(vocab_size=250, pad_vocab_multiple=64))
    original_head = model.head
    bonus = torch.zeros(256)
    bonus[250:] = 1e4
    model.head = lambda x: original_head(x) + bonus
    prompt = torch.randint(0, 250, (4, 3))
    assert model(prompt)[0][:, -1].argmax(-1).min() >= 250  # the trap is set
    for temperature in (0.0, 1.0, 2.0):
        out = model.generate(prompt, 20, temperature=temperature)
        assert out.max() < 250


def test_padding_columns_take_no_probability_in_the_loss():
    """vocab_size 250 padded to 256, the padding columns' logits rigged to win (GPT-2's real
    logits sit far below 0, so a padding row left near 0 would): the loss and every real
    gradient equal those of the same weights with 250 rows and no padding, to fp32 rounding,
    and the padding rows get no gradient. Unmasked, the loss is off by more than 1."""
    padded, exact = (make_model(tiny(vocab_size=250, pad_vocab_multiple=m)) for m in (64, 1))
    with torch.no_grad():
        for name, p in exact.named_parameters():  # the same real weights in both
            p.copy_(dict(padded.named_parameters())[name][: p.size(0)])
    head, bonus = padded.head, torch.zeros(256)
    bonus[250:] = 10.0
    padded.head = lambda x: head(x) + bonus  # (B, T, 256): the padding columns + 10
    idx, targets = torch.randint(0, 250, (4, 32)), torch.randint(0, 250, (4, 32))
    (logits, loss), (_, loss_exact) = padded(idx, targets), exact(idx, targets)
    # subtle: 1e-6 covers logsumexp over the same 250 finite values with 6 -inf added
    torch.testing.assert_close(loss, loss_exact, rtol=1e-6, atol=1e-6)
    unmasked = model_lib.cross_entropy_loss(logits, targets)  # the padding columns counted
    assert (unmasked - loss).item() > 1.0, (unmasked.item(), loss.item())
    loss.backward()
    loss_exact.backward()
    for name, p in exact.named_parameters():
        g = dict(padded.named_parameters())[name].grad
        torch.testing.assert_close(g[: p.size(0)], p.grad, rtol=1e-5, atol=1e-7)
    assert padded.transformer.wte.weight.grad[250:].abs().max() == 0


# --------------------------------------------------------------------------- config


def test_config_validation_and_presets():
    """Invalid configs fail at construction, with a message that says what is wrong."""
    with pytest.raises(ValueError, match="n_embd=30 must be divisible by n_head=4"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="n_layer must be a positive integer"):
        GPTConfig(n_layer=0)
    with pytest.raises(ValueError, match="dropout"):
        GPTConfig(dropout=1.0)
    with pytest.raises(
        ValueError, match=r"unknown preset 'gpt3'; valid presets: tiny, small, gpt2"
    ):
        GPTConfig.from_preset("gpt3")

    assert GPTConfig(pad_vocab_multiple=64).padded_vocab_size == 50304  # GPT-2's speed trick
    small = GPTConfig.from_preset("small", vocab_size=4096)
    assert (small.n_layer, small.n_embd, small.block_size, small.vocab_size) == (4, 128, 128, 4096)
    assert GPTConfig.from_preset("gpt2") == GPTConfig()  # the defaults are GPT-2 small


def test_shapes_only_draws_nothing_on_meta_and_still_draws_real_tensors():
    """support/meta.py: inside shapes_only a GPT is built on the meta device with no draw
    (which would import torch._dynamo), while a real tensor, say another thread's, is
    still drawn; afterwards nn.init.normal_ is torch's again."""
    real = torch.zeros(1000)
    with shapes_only():
        model = GPT(GPTConfig.from_preset("tiny"))
        torch.nn.init.normal_(real)
    assert all(p.is_meta for p in model.parameters())
    assert real.std() > 0.5, "a real tensor went undrawn inside shapes_only"
    assert torch.nn.init.normal_ is meta_lib._REAL_NORMAL
