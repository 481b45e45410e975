"""06 · Memory: mixed precision, gradient accumulation and activation recomputation.

The idea in one sentence: run the forward and backward in 16-bit numbers (half the bytes, and on
a GPU's tensor cores many times fp32's FLOP/s), keep what accumulates small changes (weights,
optimizer state, the loss, long sums) in fp32, and for fp16 multiply the loss by a scale S so
that small gradients are not flushed to zero.

The formats, sign|exponent|mantissa bits: fp32 1|8|23; bf16 1|8|7 (fp32's range, 2-3 digits);
fp16 1|5|10 (max 65504, smallest normal 2^-14, smallest subnormal 2^-24); tf32: fp32 in memory,
matmul inputs rounded to 10 mantissa bits on Ampere+ GPUs. Below the smallest normal number
values keep fewer bits (subnormals); below half the smallest subnormal they round to 0.

Why fp16 gradients underflow and bf16's don't: dL/dlogits = (softmax - onehot)/N is ~1/(V·N) for
most entries, and gradients shrink further on the way down: most of the tiny GPT's activation
gradients are fp16 subnormals and about 1% round to 0 (the demo counts). bf16 has fp32's 8
exponent bits, so nothing above 1e-38 vanishes; it pays in precision, which is why weights and
updates stay fp32.

Loss scaling: backprop is linear, so grad(S·L) = S·grad(L): S = 2^k moves every gradient k
binades up, past the underflow; divide by S in fp32 before the step. Too large an S overflows to
inf, so S is dynamic (DynamicLossScaler, the same decisions as torch.amp.GradScaler): on inf/NaN
skip the step and halve S; after growth_interval clean steps double it.

The fp32 master copy: an update lr·g is often below half the gap between w and the next 16-bit
number, so in 16 bits w + lr·g == w. The optimizer updates an fp32 copy, and the 16-bit working
copy is rounded from it after each step (MasterWeights, Micikevicius et al. §3.1):
    master (fp32) --round--> working (16-bit) --forward/backward--> 16-bit grads of S·L
         ^                                                                | copy up to fp32
         +-- optimizer.step (skipped on inf/NaN) <-- /S, check inf/NaN <--+
torch.autocast works the other way round: weights stay fp32 (they are the master copy) and each
op casts its inputs: matmuls to 16 bits (caching a 16-bit copy of each weight), while on CUDA
softmax, layer_norm, sums, exp/log and losses stay fp32 (long sums; exp overflows fp16 past 11.1);
our residual stream and 02's loss are fp32 anyway. Kept matmul operands halve (formula below).

Gradient accumulation: k microbatches must give one batch's gradient of
    L = (1/N) Σ_microbatches Σ_tokens ℓ_t,   N = target tokens in the WHOLE step (all DP ranks),
so each microbatch back-propagates its summed loss / N. The mean of microbatch means,
(1/k) Σ_i (1/n_i) Σ_t ℓ_t, over-weights short microbatches when the n_i differ (padding, masks):
Hugging Face Transformers' Trainer did that until 4.46 (found by Unsloth, October 2024). With
DP, N is all-reduced (SUM) and, as DP averages gradients, each rank multiplies its loss by dp.
no_sync() on all but the last microbatch: one all-reduce round per step, not k.

Recomputation (Chen et al. 2016, arXiv 1604.06174; Korthikanti et al. 2022, arXiv 2205.05198):
what the forward keeps for the backward grows as B·T·L; after ZeRO it is what stops a bigger
batch. 02's GPTConfig.recompute keeps less and redoes the rest in the backward. Bytes per token
and layer with dropout 0 (nh heads; r bytes per residual-stream number: 4, or 2 in "fp16 by hand";
a bytes per kept matmul operand: 4 in fp32, 2 in 16 bits):
  none       2(C+2)r + 14Ca + 4nh   LayerNorm inputs, mean, rstd; c_attn's input C, q|k|v 3C, the
                                    attention output C, c_fc's input C, GELU's input and output 8C;
                                    flash attention's fp32 log-sum-exp per head
  selective  Cr + 10Ca + 4nh        the block's input, its matmuls' outputs (3C, C, 4C, C) and
                                    attention's: LayerNorm, GELU, dropout and adds are redone
  full       Cr                     the block's input: the whole block is redone
Dropout adds its masks, and a CPU then runs attention with a kernel that keeps T x T numbers.
Compute: full redoes each block's forward, 2·12C² + 4·nh·hs·T FLOPs per token and layer: 8N, not
6N, for the blocks' N (not the head's: GPT-2 124M +24%). MFU counts the model's FLOPs; HFU,
hardware FLOPs utilisation, adds the redone ones. Selective redoes elementwise ops (and, with
dropout, attention): no matmul, but torch runs its policy in Python on every op, a cost per op
that shows on a CPU's small ops (bench/bench_mixed_precision.py); torch.compile runs it once.

Launch: python 06_mixed_precision.py   (seconds on a CPU; --help). It prints what underflows in
fp16 without and with S and in bf16, accumulation against one batch, and recomputation's bytes.
bench/bench_mixed_precision.py: the modes side by side, our scaler against GradScaler, figures.

What changed from 05: 05's microbatches come back as accumulation steps, and training gets a
dtype. The one new collective is the scaler's inf check, a 4-byte all-reduce (MAX) over all
ranks: DP, TP and PP ranks hold different gradients and must skip the same step (a rank stepping
alone would desync replicas or hang ZeRO's all-gathers). Left out on purpose: fp8, stochastic
rounding, 16-bit optimizer states. Paper: Micikevicius et al., ICLR 2018, arXiv 1710.03740.
"""

import argparse
import contextlib
import dataclasses
import gc
import importlib
import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

model_lib = importlib.import_module("02_model")

IGNORE = -1  # 02's cross_entropy_loss ignores targets == -1 (padding, masked prompts)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# --------------------------------------------------------------------------- the loss scaler


def _fp32(x: float) -> float:
    """Round a Python float (a double) to the nearest fp32: GradScaler keeps its scale in fp32."""
    return torch.tensor(x, dtype=torch.float32).item()


class DynamicLossScaler:
    """torch.amp.GradScaler's algorithm, written out, with the inf check all-reduced over `group`.

        scaler.scale(loss).backward()      # gradients of S·L
        scaler.unscale_(optimizer)         # /S in place; found_inf = any inf/NaN on ANY rank
        clip_grad_norm_(params, 1.0)       # clip the true gradients, after unscale_
        scaler.step(optimizer)             # skipped when found_inf
        scaler.update()                    # inf: S *= backoff; growth_interval clean: S *= growth

    The same scale and skip decisions as GradScaler with the same settings, and a state_dict that
    either one can load. enabled=False (bf16, fp32) turns every method into a pass-through."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, enabled=True, group=None):  # fmt: skip
        assert init_scale > 0, f"init_scale must be > 0, got {init_scale}"
        assert growth_factor > 1.0, f"growth_factor must be > 1, got {growth_factor}"
        assert 0.0 < backoff_factor < 1.0, f"backoff_factor must be in (0, 1), got {backoff_factor}"
        assert growth_interval >= 1, f"growth_interval must be >= 1, got {growth_interval}"
        self.enabled, self.group = enabled, group
        self._scale = _fp32(init_scale)  # a Python float holding an fp32 value
        self._growth_factor, self._backoff_factor = growth_factor, backoff_factor
        self._growth_interval, self._growth_tracker = growth_interval, 0  # clean steps in a row
        self._per_optimizer: dict[int, dict] = {}  # id(optimizer) -> stage and found_inf
        self.skipped_steps, self.last_step_skipped = 0, False  # statistics for logs, not state

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """loss * S: the gradients of the result are S times the true ones."""
        return loss * self._scale if self.enabled else loss

    def _state(self, optimizer) -> dict:
        return self._per_optimizer.setdefault(id(optimizer), {"stage": "ready", "found_inf": None})

    def unscale_(self, optimizer) -> None:
        """Divide the optimizer's gradients by S in place and record whether any rank found an
        inf/NaN. Call it before clipping; a second call in the same step is a no-op (GradScaler
        raises instead), so step() may call it again."""
        if not self.enabled or self._state(optimizer)["stage"] == "unscaled":
            return
        state = self._state(optimizer)
        assert state["stage"] == "ready", "unscale_() after step(): call update() first"
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        msg = "fp16 grads: keep fp32 params (autocast) or copy them up first (MasterWeights)"
        assert all(g.dtype != torch.float16 for g in grads), msg  # /S in fp16 flushes small ones
        # nccl needs the flag on the GPU, even on a rank without gradients
        device = grads[0].device if grads else ("cuda" if torch.cuda.is_available() else "cpu")
        found_inf = torch.zeros((), device=device)
        for g in grads:  # checked before dividing, as GradScaler's kernel does
            found_inf = torch.maximum(found_inf, (~torch.isfinite(g)).any().float())
        if grads:  # subtle: 1/S in double, then rounded to fp32, as GradScaler: bit-equal grads
            torch._foreach_mul_(grads, _fp32(1.0 / self._scale))
        # subtle: MAX over every rank of the group (None = the world), so that all skip together;
        # never ReduceOp.AVG (gloo lacks it), and a 0/1 flag's MAX needs no division
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.group)
        state["found_inf"], state["stage"] = found_inf, "unscaled"

    def step(self, optimizer, *args, **kwargs):
        """unscale_ (if not done yet), then optimizer.step() unless an inf/NaN was found."""
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        state = self._state(optimizer)
        assert state["stage"] != "stepped", "step() was already called since the last update()"
        self.unscale_(optimizer)
        state["stage"] = "stepped"
        self.last_step_skipped = bool(state["found_inf"].item())  # the host must know: a sync
        self.skipped_steps += self.last_step_skipped
        return None if self.last_step_skipped else optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | None = None) -> None:
        """Back off after an overflow, grow after growth_interval clean steps: GradScaler's
        _amp_update_scale_ rule (products in double, rounded to fp32, never grown to inf)."""
        if not self.enabled:
            return
        if new_scale is not None:
            self._scale = _fp32(float(new_scale))
        else:
            flags = [s["found_inf"] for s in self._per_optimizer.values()]
            assert any(f is not None for f in flags), "no inf checks before update(): call step()"
            if any(f is not None and bool(f.item()) for f in flags):
                self._scale, self._growth_tracker = _fp32(self._scale * self._backoff_factor), 0
            elif self._growth_tracker + 1 == self._growth_interval:
                grown = _fp32(self._scale * self._growth_factor)
                self._scale = grown if math.isfinite(grown) else self._scale
                self._growth_tracker = 0
            else:
                self._growth_tracker += 1
        self._per_optimizer = {}

    def get_scale(self) -> float:
        return self._scale if self.enabled else 1.0

    def is_enabled(self) -> bool:
        return self.enabled

    def state_dict(self) -> dict:
        """GradScaler's five keys, so either class loads the other's checkpoint ({} if disabled)."""
        if not self.enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self._growth_tracker}  # fmt: skip

    def load_state_dict(self, state_dict: dict) -> None:
        if not self.enabled:
            return
        if not state_dict:
            raise RuntimeError("empty scaler state dict: was it saved from a disabled scaler?")
        self._scale = _fp32(float(state_dict["scale"]))
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])


def make_scaler(dtype: torch.dtype, group=None, **kwargs) -> DynamicLossScaler:
    """The scaler for a dtype: only fp16's 5 exponent bits flush small gradients to zero; for
    bf16 (fp32's exponent range) and fp32 it passes everything through."""
    return DynamicLossScaler(enabled=dtype == torch.float16, group=group, **kwargs)


def autocast_context(dtype: torch.dtype, device_type: str):
    """torch.autocast for bf16/fp16 (weights stay fp32), nothing for fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


# ----------------------------------------------------------- fp32 master weights; one training step


class MasterWeights:
    """Mixed precision by hand (Micikevicius et al. 2018, §3.1): an fp32 master copy of every
    parameter for the optimizer, and the model itself turned into the 16-bit working copy.

        mw = MasterWeights(model, torch.float16)        # model is now fp16; mw.master is fp32
        opt = torch.optim.AdamW(mw.parameters())        # the optimizer only sees fp32
        scaler.scale(model(x, y)[1]).backward()         # 16-bit forward and backward
        mw.grads_to_master(); scaler.step(opt); scaler.update(); mw.master_to_model()"""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.float16):
        params = list(model.parameters())  # a tied weight (wte = lm_head) appears once
        assert all(p.dtype == torch.float32 for p in params), "MasterWeights wants an fp32 model"
        self.master = [nn.Parameter(p.detach().clone()) for p in params]  # fp32, before the cast
        model.to(dtype)  # in place: the same Parameter objects, now 16-bit
        self.working = list(model.parameters())
        assert len(self.working) == len(self.master), "the model's parameters changed under .to()"

    def parameters(self) -> list[nn.Parameter]:
        return self.master

    def grads_to_master(self) -> None:
        """fp32 copies of the 16-bit gradients (exact), which are freed; still scaled by S."""
        for w, m in zip(self.working, self.master):
            m.grad, w.grad = (None if w.grad is None else w.grad.float()), None

    @torch.no_grad()
    def master_to_model(self) -> None:
        """Round the fp32 masters to the nearest 16-bit numbers: the next forward's weights."""
        torch._foreach_copy_(self.working, self.master)


def train_step(model, optimizer, scaler, master, autocast_dtype, x, y, grad_clip=1.0) -> float:
    """One step, the same code for every mode: fp32, autocast (bf16, or fp16 with a scaler) and
    fp16 by hand (master = MasterWeights). A disabled scaler passes everything through, and
    torch.amp.GradScaler can stand in for ours."""
    with autocast_context(autocast_dtype, x.device.type):
        _, loss = model(x, y)  # fp32 in every mode: 02 computes the loss on fp32 logits
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


# --------------------------------------------------------------------------- gradient accumulation


def count_tokens(targets: torch.Tensor) -> torch.Tensor:
    """Target tokens that count in the loss (not IGNORE), as a 0-dim int64 tensor."""
    return (targets != IGNORE).sum()


def global_token_count(microbatches, group=None) -> int:
    """N: real target tokens in this step's microbatches, summed over the DP group: a collective
    every DP rank calls before its first backward of the step."""
    n = sum(count_tokens(y) for _, y in microbatches)  # 0-dim, on the targets' device
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(n, op=dist.ReduceOp.SUM, group=group)
    assert n.item() > 0, "this step has no target tokens: every target is IGNORE"
    return int(n.item())


def accumulate_gradients(
    model, microbatches, global_tokens: int, dp_size: int = 1, scaler=None, dtype=torch.float32
) -> float:
    """Backward over k microbatches so that .grad = d/dθ [(1/N) Σ_all tokens ℓ_t], exactly one
    batch's gradient, on all DP ranks. global_tokens: N from global_token_count. dp_size: DP
    wrappers average gradients (SUM, /dp), so each rank's loss is multiplied by dp to make that a
    sum. Returns this rank's share of the step's mean loss (the DP ranks' shares add up to it)."""
    assert global_tokens > 0, f"global_tokens must be > 0, got {global_tokens}"
    total = 0.0
    for i, (x, y) in enumerate(microbatches):  # x, y: (b, T)
        local = i < len(microbatches) - 1 and hasattr(model, "no_sync")  # no all-reduce yet
        with model.no_sync() if local else contextlib.nullcontext():
            with autocast_context(dtype, x.device.type):
                _, loss_sum = model(x, y, reduction="sum")  # Σ_t ℓ_t over this microbatch
            # subtle: divide by the WHOLE step's N, not by this microbatch's own count
            loss = loss_sum * (dp_size / global_tokens)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        total += loss_sum.item() / global_tokens
    return total


def accumulate_mean_of_means(model, microbatches) -> None:
    """The trap, kept to show it: back-propagate each microbatch's own mean loss / k. Equal to
    accumulate_gradients only when every microbatch holds the same number of target tokens."""
    for x, y in microbatches:
        _, loss = model(x, y)  # mean over this microbatch's n_i tokens
        (loss / len(microbatches)).backward()


# --------------------------------------------------------------------------- activation memory


class _Allocations(TorchDispatchMode):
    """Sees every aten op run inside it (a TorchDispatchMode) and keeps a weak reference to each
    storage an op allocates: a reference that does not keep the memory alive, so once it has
    expired nothing (autograd, a checkpoint, a cache) holds that memory any more."""

    def __init__(self):
        super().__init__()
        self.made = {}  # address -> (weak reference, bytes) of the latest storage there

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        out, inputs = op(*args, **(kwargs or {})), _storages((args, kwargs))
        for address, storage in _storages(out).items():
            if address not in inputs:  # new memory, not a view of an input (a weight's .t())
                self.made[address] = (StorageWeakRef(storage), storage.nbytes())
        return out


def _storages(tree) -> dict:
    tensors = [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
    return {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}


def saved_activation_bytes(fn):
    """fn()'s result, and the bytes its forward allocated that are alive when it returns, less the
    result's: what autograd, a checkpoint or autocast's cache holds for the backward, per storage
    (a saved-tensors hook would miss what selective recomputation keeps: checkpoint stores it)."""
    allocations = _Allocations()
    with allocations:
        out = fn()
    gc.collect()  # what only a reference cycle kept alive is not held for the backward
    returned = _storages(out)
    alive = [(a, n) for a, (ref, n) in allocations.made.items() if not ref.expired()]
    return out, sum(n for address, n in alive if address not in returned)


def activation_formula(config, B: int, T: int, mode: str, recompute: str = "none") -> int:
    """Bytes held for the backward of 02's GPT (dropout 0) in `mode` ("fp32", "bf16 autocast",
    "fp16 autocast + scaler" or "fp16 by hand"): per token, L layers (the table at the top), ln_f
    (C + stats), lm_head's input C, the fp32 log-softmax V; per batch the T int64 positions (wpe's
    backward), the loss's token count and autocast's 16-bit copies of weights and biases."""
    C, L, V, nh = config.n_embd, config.n_layer, config.padded_vocab_size, config.n_head
    a = 4 if mode == "fp32" else 2  # matmul operands: 16-bit under autocast and by hand
    r = 2 if mode == "fp16 by hand" else 4  # residual stream: fp32 unless the model is 16-bit
    layer = {"none": 2 * (C + 2) * r + 14 * C * a + 4 * nh, "full": C * r,
             "selective": C * r + 10 * C * a + 4 * nh}[recompute]  # fmt: skip
    per_token = L * layer + (C + 2) * r + C * a + 4 * V
    biases = 9 * C if config.bias else 0  # c_attn 3C, attn.c_proj C, c_fc 4C, mlp.c_proj C
    weight_copies = 2 * (L * (12 * C * C + biases) + V * C) if "autocast" in mode else 0
    return B * T * per_token + 8 * T + 4 + weight_copies


def recompute_demo(config, args):
    """Each recompute mode on one batch: the bytes held for the backward, in all and per layer
    (L layers' less L - 1 layers'), against the formula; with dropout, the gradients."""
    [(x, y)] = model_lib.byte_batches(config.block_size, args.batch_size, 1, args.seed, args.device)
    (B, T), L, none = x.shape, config.n_layer, None
    print(f"\nrecomputation (02), fp32, B·T = {B * T} tokens, {L} blocks: bytes held for backward")
    print("recompute   held KB  formula   a layer, bytes/token: held formula  same grads, p .1")
    for mode in model_lib.RECOMPUTE:
        held, formula = {}, {}
        for layers, dropout in ((L - 1, 0.0), (L, 0.0), (L, 0.1)):  # last: with dropout masks
            torch.manual_seed(args.seed)
            change = dict(recompute=mode, dropout=dropout, n_layer=layers)  # (model: the last's)
            model = model_lib.GPT(dataclasses.replace(config, **change)).to(args.device)
            (_, loss), bytes_held = saved_activation_bytes(lambda m=model: m(x, y))
            held[layers if dropout == 0 else "dropout"] = bytes_held
            loss.backward()
            formula[layers] = activation_formula(model.config, B, T, "fp32", mode)
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        none = none if none is not None else grads
        one_layer = [(d[L] - d[L - 1]) / (B * T) for d in (held, formula)]  # L - 1 >= 1 blocks
        print(f"{mode:<10} {held[L] / 1024:>8.1f} {formula[L] / 1024:>8.1f} {one_layer[0]:>28,.0f}"
              f" {one_layer[1]:>7,.0f} {str(torch.equal(grads, none)):>17}")  # fmt: skip
    print(f"(fp32: r = a = 4, so none 64C + 16 + 4nh, selective 44C + 4nh, full 4C; C = "
          f"{config.n_embd}, nh = {config.n_head})")  # fmt: skip


# --------------------------------------------------------------------------- the demo


def underflow_demo(config, batches, args):
    """fp32-train on all but the last batch, then take |grad| of every Linear's output (the
    activation gradients) and of every parameter in one more backward: what does rounding them
    to 16 bits make 0, subnormal or inf, without and with the loss scale S?"""
    torch.manual_seed(args.seed)
    model = model_lib.GPT(config).to(batches[0][0].device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for x, y in batches[:-1]:
        train_step(model, optimizer, make_scaler(torch.float32), None, torch.float32, x, y)
    outputs = []  # every Linear's output: their gradients are the activation gradients
    for linear in (m for m in model.modules() if isinstance(m, nn.Linear)):
        linear.register_forward_hook(lambda module, inputs, output: outputs.append(output))
    loss, params = model(*batches[-1])[1], list(model.parameters())
    g, n = torch.autograd.grad(loss, outputs + params), len(outputs)
    grads = {"activation grads": g[:n], "parameter grads": g[n:]}
    grads = {k: torch.cat([t.abs().flatten() for t in ts]).cpu() for k, ts in grads.items()}
    grads = {name: g[g > 0] for name, g in grads.items()}  # the non-zeros
    S, fp16 = args.init_scale, torch.float16
    cases = (("fp16", fp16, 1.0), (f"fp16 x 2^{math.log2(S):.0f}", fp16, S),
             ("bf16", torch.bfloat16, 1.0))  # fmt: skip
    print(f"gradients after {len(batches) - 1} fp32 steps, rounded   -> 0  subnormal  -> inf")
    for name, g in grads.items():
        for label, dtype, s in cases:
            q = (g * s).to(dtype)
            zero, inf = (q == 0).float().mean(), q.isinf().float().mean()
            sub = ((q != 0) & (q.abs() < torch.finfo(dtype).tiny)).float().mean()
            print(f"{name:<17} to {label:<12} {zero:>8.2%} {sub:>10.2%} {inf:>7.2%}")
    median, normal = grads["activation grads"].median(), torch.finfo(fp16).tiny
    flush = normal * torch.finfo(fp16).eps / 2  # half the smallest subnormal: below it, 0
    print(f"(median activation |g| {median:.1e}; fp16: subnormal < {normal:.1e}, 0 < {flush:.1e})")
    print("drawn, with our scaler against GradScaler: python bench/bench_mixed_precision.py\n")
    return grads


def accumulation_demo(config, args):
    """k microbatches of b rows against one batch of k·b rows, with equal and with unequal
    numbers of real target tokens per microbatch (microbatch i keeps T/(i+1) per row)."""
    k, b, T = args.accum, args.batch_size // args.accum, config.block_size
    torch.manual_seed(args.seed)
    model = model_lib.GPT(config).to(args.device)
    [(x, y)] = model_lib.byte_batches(T, k * b, seed=args.seed + 1, device=args.device)  # (k·b, T)
    padded = y.clone()
    for i in range(k):
        padded[i * b : (i + 1) * b, T // (i + 1) :] = IGNORE

    def grads(fn) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        fn()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    print(f"{k} microbatches of {b} rows vs one batch of {k * b}: max |g_accumulated - g_batch|")
    print("/ max |g_batch|     token-normalised  mean of means   tokens per microbatch")
    for label, targets in (("equal tokens", y), ("unequal tokens", padded)):
        micro = list(zip(x.split(b), targets.split(b)))
        one_batch = grads(lambda t=targets: model(x, t)[1].backward())  # mean over all tokens
        n = global_token_count(micro)
        token_normalised = grads(lambda m=micro, n=n: accumulate_gradients(model, m, n))
        mean_of_means = grads(lambda m=micro: accumulate_mean_of_means(model, m))
        top = one_batch.abs().max()
        err = [(g - one_batch).abs().max() / top for g in (token_normalised, mean_of_means)]
        counts = [int(count_tokens(t)) for _, t in micro]
        print(f"{label:<18} {err[0]:>17.1e} {err[1]:>14.1e}   {counts}")


def main(argv=None):
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=formatter)
    parser.add_argument("--batch-size", type=int, default=8, help="rows per step; 2 per microbatch")
    parser.add_argument("--steps", type=int, default=50, help="fp32 steps before the gradients")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's; high for a short run")
    parser.add_argument("--init-scale", type=float, default=2.0**16, help="S, underflow table")
    parser.add_argument("--accum", type=int, default=4, help="microbatches; 4 token counts")
    parser.add_argument("--seed", type=int, default=1337, help="init and batch seed: runs repeat")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=device, help="where it runs; a GPU when there is one")
    args = parser.parse_args(argv)
    if args.accum < 1 or args.batch_size % args.accum or args.steps < 1:
        parser.error("--steps must be >= 1 and --batch-size a multiple of --accum")
    torch.set_num_threads(1)  # the tiny model's ops are too small to share; extra threads only spin
    config = model_lib.GPTConfig.from_preset("tiny")  # V = 256: bytes are the tokens
    T, B = config.block_size, args.batch_size
    batches = model_lib.byte_batches(T, B, args.steps + 1, args.seed, args.device)

    underflow_demo(config, batches, args)
    accumulation_demo(config, args)
    recompute_demo(config, args)


if __name__ == "__main__":
    main()
