"""06b · Activation memory: keep fewer of the forward's tensors, and never the logits.

The idea in one sentence: what the forward keeps for the backward grows as B·T·L and,
at the loss, as B·T·V; keep less and redo the rest in the backward (recomputation), and
form the loss's gradient chunk by chunk of tokens so no (B, T, V) tensor ever lives.

1. Recomputation (Chen et al. 2016, arXiv 1604.06174; Korthikanti et al. 2022, arXiv
   2205.05198). apply_recomputation(model, mode) wraps each of 02's Blocks in torch's
   checkpoint from outside; the replay rewinds the random state, so dropout draws the
   same masks. Bytes per token and layer, with dropout 0: a residual-stream number
   takes r bytes (4, or 2 in 06's "fp16 by hand"), a kept matmul operand a bytes (4 in
   fp32, 2 in 16 bits); activation_formula lists what each mode holds.
       none  2(C+2)r + 14Ca + 4nh    selective  Cr + 10Ca + 4nh    full  Cr
   What a block keeps for its backward (the rest is redone there):
       none       x ln1 qkv att lse x2 ln2 fc gelu   the inputs every op saved
       selective  x     qkv att lse proj   fc proj   matmul and attention outputs
       full       x                                  the block's input alone
   Bytes held are counted by autograd's saved-tensors hooks (saved_activation_bytes)
   beside the formula: for 2 blocks of C = 32 in fp32 the demo prints `none 1362.3
   1362.3 2,072 2,072 True` (KB held and formula, then a layer's bytes a token, and
   the gradients under dropout 0.1 equal none's). Full redoes each block's forward, so
   a token costs 8Ψ FLOPs instead of 6Ψ: hardware FLOPs utilisation (HFU) counts the
   extra 2Ψ, model FLOPs utilisation (MFU) does not. Selective redoes only the
   elementwise ops (LayerNorm, GELU, dropout, adds), but it asks torch's policy, in
   Python, about every op.
2. The loss without the (B, T, V) logits (Liger-Kernel's fused linear cross-entropy;
   Wijmans et al. 2024, arXiv 2411.09009): 02's loss keeps the fp32 log-softmax, V
   numbers a token (201 KB at GPT-2's V = 50,304: 6.6 GB at B = 32, T = 1,024), and
   the logits and their gradient are as big. ChunkedLinearCrossEntropy runs lm_head
   and the loss over chunks of tokens, forming each chunk's gradient in the forward,
       dlogits = (softmax - onehot(target))·scale    dX = dlogits W    dW += dlogits^T X
   so only dX (B, T, C) and dW (V, C) wait for the backward. apply_chunked_loss puts
   it in a GPT through 02's head/loss_fn seam. At V = 4,032 the demo prints `plain
   5138.3 5138.3 4066.0 8064.0` KB (held, formula, the loss's, logits and dlogits), and
   `chunked 1608.2 1608.2 536.0 0.0`: its dX and dW, and nothing of size (B, T, V).
   dW is V·C·4 bytes whatever B, kept until the backward: under GPipe once per
   microbatch in flight (m copies).

Launch:  python 06b_recompute.py   (seconds on a CPU; --help): both, in order.

What changed from 06_mixed_precision.py: 06 made a step's numbers smaller (16 bits) and
its batch larger (accumulation); here the same step keeps fewer of them. Its precision
modes name the bytes: "fp32", "bf16 autocast", "fp16 by hand". Left out on purpose:
offloading activations to the CPU, Cut Cross-Entropy's kernel (it recomputes the logits
in the backward and keeps no dW), and splitting activations over ranks (04b, 08).
"""

import argparse
import contextlib
import dataclasses
import functools
import importlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt

from support.tensor_parallel.activations import note_kept

# Re-exported (the "as"): tests and bench/ count the bytes kept through 06b's name.
from support.tensor_parallel.activations import (
    saved_activation_bytes as saved_activation_bytes,
)

model_lib = importlib.import_module("02_model")
mp_lib = importlib.import_module("06_mixed_precision")  # IGNORE: the padding target

IGNORE = mp_lib.IGNORE  # 02's cross_entropy_loss ignores targets == -1

# ------------------------------------------------------------ activation recomputation
# torch's checkpoint drops what a block saved for its backward and runs it again there.
# A policy makes it selective: keep the matmuls' and flash attention's outputs (costly
# to redo; no T x T scores), redo LayerNorm, GELU, dropout and adds.
RECOMPUTE = ("none", "selective", "full")
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def apply_recomputation(model: nn.Module, mode: str) -> nn.Module:
    """Wrap each 02 Block's forward from outside, in place ("none": unwrap). Blocks are
    found by type: a GPT, 04's sharded one or a stage of 05's pipeline."""
    if mode not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {mode!r}")
    for block in (m for m in model.modules() if isinstance(m, model_lib.Block)):
        block.__dict__.pop("forward", None)  # back to Block.forward
        if mode != "none":  # an instance attribute: module.__call__ finds it first
            block.forward = functools.partial(_recomputed, block, mode)
    return model


def _recomputed(block, mode: str, x: torch.Tensor) -> torch.Tensor:
    """Block.forward under torch's checkpoint: its replay rewinds torch's generators."""
    run = functools.partial(type(block).forward, block)
    if not torch.is_grad_enabled():  # evaluation, sampling: nothing to recompute
        return run(x)
    # Attention with dropout is redone: a kept output would skip its draws (and shift
    # every later mask).
    keep_attention = block.attn.dropout == 0 or not block.training
    policy = functools.partial(_policy, keep_attention)
    selective = functools.partial(ckpt.create_selective_checkpoint_contexts, policy)
    contexts = selective if mode == "selective" else None
    # A per-rank stream (a module's `rng` with a `.state`: 04's RNGStateTracker) is
    # rewound here, only if it draws (torch.compile traces torch's generators only).
    stream = next((m.rng for m in block.modules() if hasattr(m, "rng")), None)
    if stream is not None and block.attn.dropout > 0:
        contexts = functools.partial(replaying_stream, contexts, stream)
    kwargs = {"context_fn": contexts} if contexts else {}
    return ckpt.checkpoint(run, x, use_reentrant=False, **kwargs)


def replaying_stream(contexts, stream):
    """A checkpoint's context_fn that also rewinds a per-rank random stream (an object
    with a `.state`, as 04's RNGStateTracker) for the replay: called as the forward
    starts, so the stream's state now is the one the recomputation must draw from
    again. `contexts`: another context_fn (selective recomputation's) or None."""
    forward, redo = contexts() if contexts else (contextlib.nullcontext(),) * 2
    return forward, _replaying(redo, stream, stream.state)


@contextlib.contextmanager
def _replaying(inner, stream, state):
    """Replay from `state` (04's fork replaces .state: a reference is a snapshot)."""
    now = stream.state
    stream.state = state
    try:
        with inner:
            yield
    finally:
        stream.state = now


def _policy(keep_attention, ctx, op, *args, **kwargs):
    """Keep matmuls and attention (flash, cuDNN, efficient, CPU) outputs; redo the rest."""
    attention = op.name().startswith("aten::_scaled_dot_product")
    keep = op in MATMULS or (keep_attention and attention)
    if keep:
        # Noted only while saved_activation_bytes is counting (its hooks are off
        # inside torch's checkpoint, whose own hooks keep these outputs).
        note_kept(ctx)
        return ckpt.CheckpointPolicy.MUST_SAVE
    return ckpt.CheckpointPolicy.PREFER_RECOMPUTE


def activation_formula(
    config, B: int, T: int, mode: str, recompute="none", loss="plain"
) -> int:
    """Bytes held for the backward of 02's GPT (dropout 0) in `mode` ("fp32", "bf16
    autocast", "fp16 autocast + scaler" or "fp16 by hand"). A layer: none keeps the
    LayerNorms' inputs, means and rstds, c_attn's input C, q|k|v 3C, attention's output
    C and log-sum-exp per head, c_fc's input C, GELU's input and output 8C; selective
    the block's input and the matmuls' and attention's outputs (3C, C, 4C, C, C); full
    the block's input. Then ln_f and the int64 ids a token, the T positions a batch,
    under autocast the 16-bit weights matmuls saved (a recomputed block casts again),
    and what lm_head and the loss keep (loss_formula)."""
    C = config.n_embd
    L = config.n_layer
    nh = config.n_head
    a = 4 if mode == "fp32" else 2  # matmul operands: 16-bit under autocast and by hand
    r = 2 if mode == "fp16 by hand" else 4  # residual stream: fp32 unless by hand
    layer = {
        "none": 2 * (C + 2) * r + 14 * C * a + 4 * nh,
        "selective": C * r + 10 * C * a + 4 * nh,
        "full": C * r,
    }[recompute]
    per_token = L * layer + (C + 2) * r + 8
    copies = 2 * L * 12 * C * C if "autocast" in mode and recompute == "none" else 0
    return B * T * per_token + 8 * T + copies + loss_formula(config, B, T, mode, loss)


# ------------------------------------------------ the loss without the whole logits
# The simple version is 02's: lm_head's (B, T, V) logits, an fp32 copy, its log-softmax
# (kept for the backward), then dL/dlogits, (B, T, V) again. The chunked one
# (Liger-Kernel's fused linear cross-entropy, Hsu et al. 2024: each chunk's gradients
# formed in the forward) never holds more than (chunk, V).
def loss_formula(config, B: int, T: int, mode: str, loss="plain", bias=False) -> int:
    """Bytes lm_head and the loss keep for the backward, from ln_f's output on. plain:
    lm_head's input (C numbers of a bytes), the fp32 log-softmax (V_padded) and the
    int64 targets a token, the loss's 4-byte count, under autocast W's 16-bit copy;
    chunked: dX (C a token), dW (V·C) and the bias's V, in their inputs' dtype. On top,
    not kept by autograd: plain's logits (B·T·V·a) and dL/dlogits (B·T·V·4). dW is held
    from forward to backward: under GPipe once per microbatch in flight (m copies); Cut
    Cross-Entropy recomputes the logits in the backward instead (left out)."""
    C = config.n_embd
    V = config.padded_vocab_size
    a = 4 if mode == "fp32" else 2  # matmul operands, as in activation_formula
    r = 2 if mode == "fp16 by hand" else 4  # ln_f's output and W: fp32 unless by hand
    if loss == "chunked":
        return B * T * C * r + V * C * r + (V * r if bias else 0)
    copies = 2 * V * C if "autocast" in mode else 0
    return B * T * (C * a + 4 * V + 8) + 4 + copies


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Cross-entropy of x @ W^T + b chunk by chunk: the forward makes dX and dW, the
    backward scales them. x (N, C), W (V, C), b (V,) or None, targets (N,); grad: the
    caller's torch.is_grad_enabled() (False: the loss alone)."""

    @staticmethod
    def forward(ctx, x, weight, bias, targets, vocab_size, chunk, reduction, grad):
        device = x.device.type
        autocast = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast else x.dtype  # matmuls'
        # subtle: needs_input_grad is True under torch.no_grad too (forward always runs
        # under no_grad): the caller's torch.is_grad_enabled() comes in as `grad`.
        need_x, need_w, need_b = (grad and need for need in ctx.needs_input_grad[:3])
        w = weight.to(dtype)  # (V, C), as autocast casts it for lm_head
        b = None if bias is None else bias.to(dtype)
        valid = targets != IGNORE  # (N,)
        # "mean" divides by the real targets, as 02's loss: a tensor, no host sync.
        scale = 1.0 / valid.sum() if reduction == "mean" else 1.0
        loss = torch.zeros((), device=x.device)  # fp32, the sum over every chunk
        dx = torch.empty_like(x) if need_x else None  # (N, C)
        dw = torch.zeros(weight.shape, device=x.device) if need_w else None  # fp32
        db = torch.zeros(weight.size(0), device=x.device) if need_b else None
        with torch.autocast(device, enabled=False):  # the dtypes are chosen above
            for start in range(0, x.size(0), chunk):
                rows = slice(start, start + chunk)
                xc = x[rows].to(dtype)  # (n, C)
                logits = F.linear(xc, w, b).float()  # (n, V): fp32 for the softmax
                logits[:, vocab_size:] = -math.inf  # padding columns never win
                lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # (n, 1)
                ok = valid[rows]  # (n,)
                t = targets[rows].clamp(min=0).unsqueeze(1)  # (n, 1): -1 reads col 0
                nll = lse.squeeze(1) - logits.gather(1, t).squeeze(1)  # (n,)
                loss += torch.where(ok, nll, 0.0).sum()
                if not (need_x or need_w or need_b):
                    continue
                g = logits.sub_(lse).exp_()  # softmax, in the logits' own storage
                g.scatter_add_(1, t, torch.full_like(lse, -1.0))  # - onehot(target)
                g.mul_(torch.where(ok, scale, 0.0).unsqueeze(1))  # ignored rows: 0
                g16 = g.to(dtype)
                if need_x:
                    dx[rows] = g16 @ w  # (n, V) @ (V, C)
                if need_w:  # fp32 g and x: a 16-bit partial would round before the sum
                    dw.addmm_(g.T, xc.float())  # (V, n) @ (n, C); a GPU: fp32 GEMM
                if need_b:
                    db += g.sum(dim=0)
        dw = None if dw is None else dw.to(weight.dtype)
        db = None if db is None else db.to(bias.dtype)
        ctx.save_for_backward(dx, dw, db)  # nothing (N, V): the point of it all
        return loss * scale

    @staticmethod
    def backward(ctx, grad_loss):
        """dL/dx = grad_loss · dX, and the same for W and b: the chain rule's last step."""
        grads = [None if g is None else g * grad_loss for g in ctx.saved_tensors]
        return *grads, None, None, None, None, None


def chunked_cross_entropy(
    x, targets, reduction="mean", *, lm_head, vocab_size, chunk_tokens
):
    """02's loss_fn, from the hidden states: (B, T, C) x, (B, T) targets -> the loss.
    Columns from vocab_size on are padding, as in 02's cross_entropy_loss."""
    C = lm_head.weight.size(1)
    if x.size(-1) != C:
        msg = f"the chunked loss takes ln_f's (..., {C}) output, got {tuple(x.shape)}"
        raise ValueError(msg + ": apply_chunked_loss to every pipeline chunk too")
    assert reduction in ("sum", "mean"), f"reduction {reduction!r}: 'sum' or 'mean'"
    flat = (x.reshape(-1, C), lm_head.weight, lm_head.bias, targets.reshape(-1))
    grad = torch.is_grad_enabled()  # no_grad (evaluation): the loss alone, no dX or dW
    return ChunkedLinearCrossEntropy.apply(
        *flat, vocab_size, chunk_tokens, reduction, grad
    )


def apply_chunked_loss(model: nn.Module, chunk_tokens: int = 1024) -> nn.Module:
    """Make a GPT, or 05's last pipeline chunk, compute lm_head + loss chunk by chunk,
    in place, through 02's seam: `head` becomes ln_f alone (the (B, T, C) normalised
    hidden states) and `loss_fn` the chunked loss of them. A GPT then returns (None,
    loss) when given targets (no logits are made) and real logits without (generate
    samples as before). Other chunks of 05 have no head: unchanged. 1,024 tokens keep
    the chunk's fp32 (1,024, V) block at 0.2 GB for GPT-2, matmuls big enough for a
    GPU. Refused under 04's tensor parallelism (apply_tensor_parallel comes after)."""
    loss = getattr(model.loss_fn, "func", model.loss_fn)
    if loss not in (model_lib.cross_entropy_loss, chunked_cross_entropy):
        raise ValueError(
            f"apply_chunked_loss replaces 02's cross_entropy_loss, not {loss.__name__}: "
            "04's rank holds V/tp logit columns, whose max and sum need an all-reduce"
        )
    assert chunk_tokens >= 1, f"chunk_tokens must be >= 1, got {chunk_tokens}"
    if model.lm_head is None:  # 05's chunks before the last stage
        return model
    assert type(model.lm_head) is nn.Linear, f"a plain lm_head: {model.lm_head}"
    model.head = model.transformer.ln_f.__call__  # (B, T, C): no logits
    model.loss_fn = functools.partial(
        chunked_cross_entropy,
        lm_head=model.lm_head,
        vocab_size=model.config.vocab_size,
        chunk_tokens=chunk_tokens,
    )
    if isinstance(model, model_lib.GPT):  # 05's chunk hands head's output to loss_fn
        model.forward = functools.partial(_chunked_forward, model)
    return model


def _chunked_forward(model, idx, targets=None, reduction="mean"):
    """GPT.forward -> (None, loss) with targets, (real logits, None) without."""
    hidden, loss = type(model).forward(model, idx, targets, reduction)  # (B, T, C)
    return (model.lm_head(hidden), None) if targets is None else (None, loss)


# ------------------------------------------------------------------------ the demos
def recompute_demo(config, args):
    """Each mode's bytes held for the backward, in all and a layer (L layers' less
    L - 1's), beside the formula; with dropout 0.1, the gradients against none's."""
    T = config.block_size
    B = args.batch_size
    L = config.n_layer
    [(x, y)] = model_lib.byte_batches(T, B, 1, args.seed, args.device)
    tokens = f"{B * T} tokens, {L} blocks"
    print(f"apply_recomputation, fp32, {tokens}: bytes held for the backward")
    print("mode        held KB  formula  a layer, bytes/token: held formula same grads")
    reference = None
    for mode in RECOMPUTE:
        held = {}
        for layers, dropout in ((L - 1, 0.0), (L, 0.0), (L, 0.1)):  # last: with masks
            torch.manual_seed(args.seed)
            changed = dataclasses.replace(config, dropout=dropout, n_layer=layers)
            model = model_lib.GPT(changed).to(args.device)
            apply_recomputation(model, mode)
            forward = functools.partial(model, x, y)
            (_, loss), held[layers, dropout] = saved_activation_bytes(forward)
        loss.backward()  # the last model's: dropout 0.1
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        reference = grads if reference is None else reference
        same = torch.equal(grads, reference)  # bit for bit: the same masks, same ops
        sizes = [dataclasses.replace(config, n_layer=n) for n in (L - 1, L)]
        formula = [activation_formula(c, B, T, "fp32", mode) for c in sizes]
        layer = (held[L, 0.0] - held[L - 1, 0.0]) / (B * T)
        layer_formula = (formula[1] - formula[0]) / (B * T)
        kb = f"{held[L, 0.0] / 1024:>8.1f} {formula[1] / 1024:>8.1f}"
        print(f"{mode:<11} {kb} {layer:>26,.0f} {layer_formula:>7,.0f} {same!s:>10}")
    print(f"(fp32, r = a = 4: 64C + 16 + 4nh, 44C + 4nh, 4C; C = {config.n_embd})")


def chunked_loss_demo(config, args):
    """The plain loss, then the chunked one, on one batch of a GPT with V >> C as
    GPT-2's (V = 4,000 here): bytes held for the backward (counted, and the formula),
    the loss's part of them, the (B, T, V) logits and dL/dlogits that live besides
    (all in KB), and the loss and the gradients against the plain ones."""
    config = dataclasses.replace(config, vocab_size=4000, pad_vocab_multiple=64)
    T = config.block_size
    B = args.batch_size
    V = config.padded_vocab_size
    [(x, y)] = model_lib.byte_batches(T, B, 1, args.seed, args.device)
    y[0, : T // 2] = IGNORE  # a masked prompt: its targets do not count
    tokens = f"{B * T} tokens, V = {V:,} ({config.vocab_size:,} real)"
    print(f"\nthe loss, fp32, {tokens}, chunks of {args.chunk_tokens} tokens")
    print("loss      held KB  formula the loss  +logits     loss  max|g - g_plain|")
    grads = []
    for loss in ("plain", "chunked"):
        torch.manual_seed(args.seed)
        model = model_lib.GPT(config).to(args.device)
        if loss == "chunked":
            apply_chunked_loss(model, args.chunk_tokens)
        (_, value), held = saved_activation_bytes(functools.partial(model, x, y))
        value.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        formula = activation_formula(config, B, T, "fp32", loss=loss)
        share = loss_formula(config, B, T, "fp32", loss)
        logits = 2 * B * T * V * 4 if loss == "plain" else 0  # logits, dL/dlogits
        kb = "".join(f"{n / 1024:>9.1f}" for n in (held, formula, share, logits))
        off = (grads[-1] - grads[0]).abs().max() / grads[0].abs().max()
        print(f"{loss:<8}{kb} {value.item():>8.4f} {off:>17.1e}")
    print("(+logits: the (B, T, V) logits and dL/dlogits the plain loss holds besides;")
    print(" max|g - g_plain| over every parameter's gradient, / max|g_plain|)")


def main(argv=None):
    formatter = argparse.ArgumentDefaultsHelpFormatter
    description = __doc__.split("\n")[0]
    parser = argparse.ArgumentParser(description=description, formatter_class=formatter)
    add = parser.add_argument
    add("--batch-size", type=int, default=8, help="rows of the batch")
    add("--chunk-tokens", type=int, default=100, help="tokens per chunk of the loss")
    add("--seed", type=int, default=1337, help="init and batch seed: runs repeat")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    add("--device", default=device, help="where it runs; a GPU when there is one")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the tiny model's ops are too small to share
    config = model_lib.GPTConfig.from_preset("tiny")  # V = 256: bytes are the tokens
    recompute_demo(config, args)
    chunked_loss_demo(config, args)


if __name__ == "__main__":
    main()
