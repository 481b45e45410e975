"""06 · Memory of one step: compute in 16 bits and keep fewer activations, safely.

The idea in one sentence: run the forward and backward in 16-bit numbers (half the
bytes, and many times fp32's FLOP/s on a GPU's tensor cores), keep what accumulates
small changes (weights, optimizer state, the loss, long sums) in fp32, and for fp16
multiply the loss by a scale S so that small gradients are not flushed to zero.

Bits, sign|exponent|mantissa: fp32 1|8|23; bf16 1|8|7 (fp32's range, 2-3 digits); fp16
1|5|10 (max 65504, smallest normal 6.1e-5, smallest subnormal 6.0e-8; below 3.0e-8: 0).

1. Why fp16 gradients underflow: dL/dlogits = (softmax - onehot)/N is about 1/(V·N) for
   most entries, and gradients shrink on the way down. For the tiny GPT the demo
   prints `median |g| 7.8e-06` for the activation gradients, and in fp16 it prints
   `to fp16 1.20% 77.51% 0%`: 1.2% round to 0, 78% are subnormals (fewer bits), none
   overflow. bf16 has fp32's 8 exponent bits: nothing above 1e-38 vanishes.
2. A static loss scale: backprop is linear, so grad(S·L) = S·grad(L). S = 2^k moves
   every gradient k binades up, past the underflow; divide by S in fp32 before the
   step. With S = 2^16 the demo prints `to fp16 x 2^16 0.05% 0.16% 0%`.
3. A dynamic loss scale: too large an S overflows to inf, and the right S drifts.
   DynamicLossScaler (GradScaler's decisions) skips the step and halves S on an inf or
   NaN, and doubles S after growth_interval clean steps. The demo starts at 2^19 and
   skips steps 0 and 1 (it prints `1 5.3434 5.5266 2^17 True`), then grows to 2^18 and
   backs off to 2^17 again and again.
4. The fp32 master copy: an update lr·g is often below half the gap between w and the
   next 16-bit number, so in 16 bits w + lr·g == w. The optimizer updates an fp32 copy,
   and the 16-bit working copy is rounded from it after each step (MasterWeights):
       master (fp32) --round--> working (16-bit) --forward/backward--> grads of S·L
            ^                                                             | copy up
            +-- optimizer.step (skipped on inf/NaN) <-- /S, check inf/NaN <-+
   torch.autocast works the other way round: the weights stay fp32 (the master copy),
   matmuls cast their inputs to 16 bits, and softmax, norms and losses stay fp32.
   Bytes per parameter before activations, with AdamW: the ZeRO paper (Rajbhandari et
   al. 2019, arXiv 1910.02054) counts mixed precision with fp32 masters as 2 + 2 + 12:
   16-bit weights and gradients, then the fp32 master, m and v. Under autocast the
   weights and gradients are fp32 and the weights are the masters: 4 + 4 + 8. Both make
   16 bytes per parameter, 16Ψ for Ψ parameters. (MasterWeights copies the gradients up
   to fp32 for the step, so while the step runs they take 4 bytes, not 2.)
5. Gradient accumulation: k microbatches must give one batch's gradient of
       L = (1/N) Σ_microbatches Σ_tokens ℓ_t,   N = target tokens in the WHOLE step,
   so each microbatch back-propagates its summed loss / N. The mean of microbatch means
   over-weights short microbatches when token counts differ (Hugging Face's Trainer
   did until 4.46). With data parallelism, N is summed over the ranks, and each rank
   multiplies its loss by dp, because DP averages the ranks' gradients.
6. Recomputation (Chen et al. 2016, arXiv 1604.06174; Korthikanti et al. 2022, arXiv
   2205.05198): what the forward keeps grows as B·T·L; apply_recomputation keeps less
   and redoes the rest in the backward. Below are the bytes per token and layer, with
   dropout 0. A residual-stream number takes r bytes (4, or 2 in "fp16 by hand"), and
   a kept matmul operand a bytes (4 in fp32, 2 in 16 bits). activation_formula lists
   what each mode holds.
       none  2(C+2)r + 14Ca + 4nh    selective  Cr + 10Ca + 4nh    full  Cr
   Full redoes each block's forward, so a token costs 8Ψ FLOPs instead of 6Ψ: hardware
   FLOPs utilisation (HFU) counts the extra 2Ψ, model FLOPs utilisation (MFU) does not.
   Selective redoes only the elementwise ops, but it calls torch's policy in Python
   for every op.
7. The loss without the (B, T, V) logits (Liger-Kernel's fused linear cross-entropy;
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
   microbatch in flight (m copies). Wijmans et al.'s Cut Cross-Entropy kernel
   recomputes the logits in the backward instead, keeping no dW (left out).

Launch:  python 06_mixed_precision.py   (seconds on a CPU; --help): the seven in order,
their demos' code in support/memory_demos.py (it calls this file's functions).

What changed from 05_pipeline.py: its microbatches come back as accumulation steps, and
training gets a dtype; the new collective is the scaler's inf check, a 4-byte MAX over
all ranks (DP, TP and PP ranks must skip the same step). Left out on purpose: fp8,
stochastic rounding, 16-bit optimizer states. Paper: Micikevicius et al., 1710.03740.
"""

import argparse
import contextlib
import functools
import importlib
import math
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt

from support import memory_demos
from support.activations import note_kept, replaying_stream

# Re-exported (the "as"): tests and bench/ count the bytes kept through 06's name.
from support.activations import saved_activation_bytes as saved_activation_bytes
from support.precision import GradScalerState
from support.precision import fp32 as _fp32

model_lib = importlib.import_module("02_model")

IGNORE = -1  # 02's cross_entropy_loss ignores targets == -1 (padding, masked prompts)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ------------------------------------------------------------ a static loss scale first
def static_scale_example(S: float = 2.0**16):
    """Four gradients in fp16 as they are, and scaled by S then /S in fp32."""
    g = torch.tensor([1e-3, 1e-6, 1e-8, 1e-9])  # fp32: the true gradients
    plain = g.half().float()  # 1e-8 and 1e-9 are below 3e-8: they round to 0
    scaled = (g * S).half().float() / S  # S·g in fp16 (as backward makes it), /S fp32
    print(f"{'gradient':>10} {'in fp16':>10} {'x S, fp16, /S':>16}")
    for row in zip(g.tolist(), plain.tolist(), scaled.tolist()):
        print(f"{row[0]:>10.1e} {row[1]:>10.3e} {row[2]:>16.3e}")
    print(f"too large an S overflows: 1e-3 x 2^30 in fp16 = {(g[0] * 2**30).half()}\n")


# -------------------------------------------------------- the dynamic loss scaler
class DynamicLossScaler(GradScalerState):
    """torch.amp.GradScaler's algorithm, the inf check all-reduced over `group`:

        scaler.scale(loss).backward()   # gradients of S·L
        scaler.unscale_(optimizer)      # /S in place; found_inf: inf/NaN on ANY rank
        clip_grad_norm_(params, 1.0)    # clip the true gradients, after unscale_
        scaler.step(optimizer)          # skipped when found_inf
        scaler.update()                 # inf: S *= backoff; growth_interval clean
                                        # steps in a row: S *= growth

    It makes GradScaler's decisions; its getters and state_dict keys are GradScaler's
    (support/precision.py). With enabled=False (for bf16 and fp32) it does nothing:
    scale() returns the loss as it is, and step() simply steps."""

    def __init__(
        self,
        init_scale=2.0**16,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=2000,
        enabled=True,
        group=None,
    ):
        assert init_scale > 0, f"init_scale must be > 0, got {init_scale}"
        assert growth_factor > 1.0, f"growth_factor must be > 1, got {growth_factor}"
        assert 0.0 < backoff_factor < 1.0, f"backoff_factor {backoff_factor}: in (0, 1)"
        assert growth_interval >= 1, f"growth_interval must be >= 1: {growth_interval}"
        self.enabled = enabled
        self.group = group
        self._scale = _fp32(init_scale)  # a Python float holding an fp32 value
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._growth_tracker = 0  # clean steps in a row
        self._per_optimizer: dict[int, dict] = {}  # id(optimizer) -> stage, found_inf
        self.skipped_steps = 0  # statistics for logs, not state
        self.last_step_skipped = False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """loss * S: the gradients of the result are S times the true ones."""
        return loss * self._scale if self.enabled else loss

    def _state(self, optimizer) -> dict:  # "ready" -> "unscaled" -> "stepped"
        new = {"stage": "ready", "found_inf": None}
        return self._per_optimizer.setdefault(id(optimizer), new)

    def unscale_(self, optimizer) -> None:
        """Divide the gradients by S in place; found_inf: any inf or NaN on any rank.

        Call it before clipping. A second call does nothing (GradScaler's raises), so
        that step() can call it again safely."""
        if not self.enabled or self._state(optimizer)["stage"] == "unscaled":
            return
        state = self._state(optimizer)
        assert state["stage"] == "ready", "unscale_() after step(): call update() first"
        params = [p for g in optimizer.param_groups for p in g["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        msg = "fp16 grads: /S would flush them; use autocast or MasterWeights"
        assert all(g.dtype != torch.float16 for g in grads), msg
        # A rank without gradients still needs the flag on its GPU: NCCL reduces only
        # CUDA tensors.
        gpu = "cuda" if torch.cuda.is_available() else "cpu"
        found_inf = torch.zeros((), device=grads[0].device if grads else gpu)
        for g in grads:  # checked before dividing, as GradScaler's kernel does
            found_inf = torch.maximum(found_inf, (~torch.isfinite(g)).any().float())
        if grads:  # subtle: 1/S in double, rounded to fp32, as GradScaler: bit-equal
            torch._foreach_mul_(grads, _fp32(1.0 / self._scale))
        # subtle: MAX over every rank of the group (None: the world): all skip together.
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.group)
        state["found_inf"] = found_inf
        state["stage"] = "unscaled"

    def step(self, optimizer, *args, **kwargs):
        """unscale_ (if not done yet), then optimizer.step() unless an inf was found."""
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        state = self._state(optimizer)
        assert state["stage"] != "stepped", "step() already called since update()"
        self.unscale_(optimizer)
        state["stage"] = "stepped"
        self.last_step_skipped = bool(state["found_inf"].item())  # the host must know
        self.skipped_steps += self.last_step_skipped
        return None if self.last_step_skipped else optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | None = None) -> None:
        """Back off after an overflow, grow after growth_interval clean steps:
        GradScaler's rule (products in double, rounded to fp32, never grown to inf)."""
        if not self.enabled:
            return
        if new_scale is not None:
            self._scale = _fp32(float(new_scale))
        else:
            flags = [s["found_inf"] for s in self._per_optimizer.values()]
            flags = [f for f in flags if f is not None]
            assert flags, "no inf checks before update(): call step() first"
            if any(bool(f.item()) for f in flags):
                self._scale = _fp32(self._scale * self._backoff_factor)
                self._growth_tracker = 0
            elif self._growth_tracker + 1 == self._growth_interval:
                grown = _fp32(self._scale * self._growth_factor)
                self._scale = grown if math.isfinite(grown) else self._scale
                self._growth_tracker = 0
            else:
                self._growth_tracker += 1
        self._per_optimizer = {}


def make_scaler(dtype: torch.dtype, group=None, **kwargs) -> DynamicLossScaler:
    """Enabled for fp16 only: bf16 has fp32's exponent range, and fp32 is fp32."""
    return DynamicLossScaler(enabled=dtype == torch.float16, group=group, **kwargs)


def autocast_context(dtype: torch.dtype, device_type: str):
    """torch.autocast for bf16/fp16 (weights stay fp32), nothing for fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


# ------------------------------------------------ fp32 master weights; one training step
class MasterWeights:
    """Mixed precision by hand (Micikevicius et al. §3.1): fp32 masters for the
    optimizer (mw.parameters()), the model itself made the 16-bit working copy;
    train_step shows the order of the calls."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.float16):
        params = list(model.parameters())  # a tied weight (wte = lm_head) appears once
        assert all(p.dtype == torch.float32 for p in params), "an fp32 model, please"
        self.master = [nn.Parameter(p.detach().clone()) for p in params]  # fp32
        model.to(dtype)  # in place: the same Parameter objects, now 16-bit
        self.working = list(model.parameters())
        assert len(self.working) == len(self.master), "parameters changed under .to()"

    def parameters(self) -> list[nn.Parameter]:
        return self.master

    def grads_to_master(self) -> None:
        """fp32 copies of the 16-bit gradients (exact), which are freed; still x S."""
        for w, m in zip(self.working, self.master):
            m.grad = None if w.grad is None else w.grad.float()
            w.grad = None

    @torch.no_grad()
    def master_to_model(self) -> None:
        """Round the fp32 masters to the nearest 16-bit numbers: the next weights."""
        torch._foreach_copy_(self.working, self.master)


def train_step(model, optimizer, scaler, master, autocast_dtype, x, y, grad_clip=1.0):
    """One step in any mode: fp32, autocast (fp16 with a scaler) or fp16 by hand
    (master = MasterWeights); torch.amp.GradScaler can stand in for our scaler."""
    with autocast_context(autocast_dtype, x.device.type):
        _, loss = model(x, y)  # fp32 in every mode: 02's loss runs on fp32 logits
    scaler.scale(loss).backward()
    if master:
        master.grads_to_master()  # 16-bit grads of S·L -> fp32
    scaler.unscale_(optimizer)  # /S and the inf/NaN check, before clipping
    params = [p for g in optimizer.param_groups for p in g["params"]]
    torch.nn.utils.clip_grad_norm_(params, grad_clip)  # on the true gradients
    scaler.step(optimizer)  # skipped on inf/NaN
    scaler.update()
    if master:
        master.master_to_model()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()  # a sync: on a GPU the step's time is now real


# ------------------------------------------------------------ gradient accumulation
def count_tokens(targets: torch.Tensor) -> torch.Tensor:
    """Target tokens that count in the loss (not IGNORE), as a 0-dim int64 tensor."""
    return (targets != IGNORE).sum()


def global_token_count(microbatches, group=None) -> torch.Tensor:
    """N: real target tokens in this step's microbatches, summed over the DP group: a
    collective every DP rank calls before its first backward of the step. A 0-dim tensor
    on the targets' device, never read on the host: reading it would make the CPU wait
    for the GPU (a sync) every step. At least 1: a step whose targets are all IGNORE
    (masked prompts in SFT) gives loss 0 and zero gradients, not a 0/0 (Megatron-LM
    #1764's clamp; a device-side assert would kill the CUDA context)."""
    n = sum(count_tokens(y) for _, y in microbatches)  # 0-dim, on the targets' device
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(n, op=dist.ReduceOp.SUM, group=group)
    return n.clamp(min=1)


def accumulate_gradients(
    model, microbatches, global_tokens, dp_size=1, scaler=None, dtype=torch.float32
) -> torch.Tensor:
    """Backward over k microbatches so that .grad = d/dθ [(1/N) Σ_all tokens ℓ_t], one
    batch's gradient. global_tokens: N (global_token_count's tensor, or an int > 0). DP
    averages gradients, so each rank's loss is x dp_size. Returns this rank's share of
    the step's mean loss as a 0-dim tensor: no .item() per microbatch (a sync each)."""
    total = 0.0
    for i, (x, y) in enumerate(microbatches):  # x, y: (b, T)
        local = i < len(microbatches) - 1 and hasattr(model, "no_sync")  # no sync yet
        with model.no_sync() if local else contextlib.nullcontext():
            with autocast_context(dtype, x.device.type):
                _, loss_sum = model(x, y, reduction="sum")  # Σ_t ℓ_t, this microbatch
            # subtle: divide by the WHOLE step's N, not by this microbatch's own count
            loss = loss_sum * (dp_size / global_tokens)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        total += loss_sum.detach() / global_tokens  # A tensor from the first on.
    return total


def accumulate_mean_of_means(model, microbatches) -> None:
    """The trap, kept to show it: back-propagate each microbatch's own mean loss / k.
    Equal to accumulate_gradients only when every microbatch has as many targets."""
    for x, y in microbatches:
        _, loss = model(x, y)  # the mean over this microbatch's n_i tokens
        (loss / len(microbatches)).backward()


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


def _policy(keep_attention, ctx, op, *args, **kwargs):
    """Keep matmuls and attention (flash, cuDNN, efficient, CPU) outputs; redo the rest."""
    attention = op.name().startswith("aten::_scaled_dot_product")
    keep = op in MATMULS or (keep_attention and attention)
    if keep:
        # Noted only while support/activations' saved_activation_bytes is counting.
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
# (kept for the backward), then dL/dlogits, (B, T, V) again. The chunked one ("Cut Your
# Losses in Large-Vocabulary Language Models") never holds more than (chunk, V).
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


def main(argv=None):
    formatter = argparse.ArgumentDefaultsHelpFormatter
    description = __doc__.split("\n")[0]
    parser = argparse.ArgumentParser(description=description, formatter_class=formatter)
    add = parser.add_argument
    add("--batch-size", type=int, default=8, help="rows per step; 2 per microbatch")
    add("--steps", type=int, default=50, help="fp32 steps before the gradients")
    add("--fp16-steps", type=int, default=10, help="steps of the fp16 training demo")
    add("--lr", type=float, default=3e-3, help="AdamW's; high for a short run")
    add("--init-scale", type=float, default=2.0**16, help="S, the static loss scale")
    add("--accum", type=int, default=4, help="microbatches; 4 token counts")
    add("--chunk-tokens", type=int, default=100, help="tokens per chunk of the loss")
    add("--seed", type=int, default=1337, help="init and batch seed: runs repeat")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    add("--device", default=device, help="where it runs; a GPU when there is one")
    args = parser.parse_args(argv)
    if args.accum < 1 or args.batch_size % args.accum or args.steps < args.fp16_steps:
        parser.error("--steps >= --fp16-steps, and --batch-size a multiple of --accum")
    torch.set_num_threads(1)  # the tiny model's ops are too small to share
    config = model_lib.GPTConfig.from_preset("tiny")  # V = 256: bytes are the tokens
    batch = (config.block_size, args.batch_size, args.steps + 1, args.seed)
    batches = model_lib.byte_batches(*batch, args.device)
    static_scale_example(args.init_scale)
    # The demos (support/memory_demos.py) call this file's code, and support/ imports
    # no numbered file: this module is handed to them.
    lesson = sys.modules[__name__]
    memory_demos.underflow_demo(lesson, config, batches, args)
    memory_demos.fp16_training_demo(lesson, config, batches, args)
    memory_demos.accumulation_demo(lesson, config, args)
    memory_demos.recompute_demo(lesson, config, args)
    memory_demos.chunked_loss_demo(lesson, config, args)


if __name__ == "__main__":
    main()
