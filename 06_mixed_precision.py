"""06 · Mixed precision and gradient accumulation: 16-bit math, fp32 memory, exact big batches.

The idea in one sentence: run the forward and backward in 16-bit numbers (half the bytes, and on
a GPU's tensor cores many times fp32's FLOP/s), keep what accumulates small changes (weights,
optimizer state, the loss, long sums) in fp32, and for fp16 multiply the loss by a scale S so
that small gradients are not flushed to zero.

The formats (sign|exponent|mantissa bits; the demo prints them from torch.finfo):
    fp32  1|8|23   max 3.4e38   eps 1.2e-7   smallest subnormal 1.4e-45
    tf32  1|8|10   fp32 in memory; Ampere+ tensor cores round matmul inputs to 10 mantissa bits
                   and accumulate in fp32 (torch.set_float32_matmul_precision("high"))
    bf16  1|8|7    max 3.4e38   eps 7.8e-3   smallest subnormal 9.2e-41
    fp16  1|5|10   max 65504    eps 9.8e-4   smallest subnormal 6.0e-8 = 2^-24
    fp8   e4m3 (max 448), e5m2 (max 57344) on H100+, with per-tensor scales: left out
eps is the gap after 1.0. Below the smallest normal number (fp16: 2^-14) values keep fewer bits
(subnormals); below half the smallest subnormal they round to 0.

Why fp16 gradients underflow and bf16's don't: dL/dlogits = (softmax - onehot)/N is ~1/(V·N) for
most entries, and gradients shrink further on the way down: of the tiny GPT's activation
gradients about three quarters are fp16 subnormals and a few % round to 0 (the demo counts).
bf16 has fp32's 8 exponent bits, so nothing above 1e-38 vanishes; it pays in precision (2-3
digits), which is why weights and updates stay fp32.

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
op casts its inputs. Matmuls run in 16 bits (autocast caches a 16-bit copy of each weight for the
backward: 2 bytes/parameter more); on CUDA softmax, log_softmax, layer_norm, sums, exp/log and
the losses run in fp32, as they add many terms (a 16-bit sum of V probabilities drops the small
ones) or exponentiate (exp overflows fp16 past 11.1). CPU autocast's fp32 list is shorter, but
our residual stream is fp32 anyway (fp32 embeddings + 16-bit branches = fp32), so LayerNorm reads
fp32, and 02 computes the loss on fp32 logits.

Gradient accumulation: k microbatches must give one batch's gradient of
    L = (1/N) Σ_microbatches Σ_tokens ℓ_t,   N = target tokens in the WHOLE step (all DP ranks),
so each microbatch back-propagates its summed loss / N. The mean of microbatch means,
(1/k) Σ_i (1/n_i) Σ_t ℓ_t, over-weights short microbatches when the n_i differ (padding, masks).
The 2024 trap: in October 2024 Unsloth showed that Hugging Face Transformers' Trainer normalised
per microbatch; transformers 4.46 fixed it by passing the step's token count (num_items_in_batch).
With DP, N is all-reduced (SUM) over DP ranks and, as DP averages gradients, each rank multiplies
its loss by dp. no_sync() on all but the last microbatch: one all-reduce round per step, not k.

Launch: python 06_mixed_precision.py     (about 30 s on a 2-core CPU; --help for flags)

What changed from 05: 05 cut batches into microbatches to fill a pipeline; here they come back as
accumulation steps, and training gets a dtype. The one new collective is the scaler's inf check,
a 4-byte all-reduce (MAX) over all ranks: DP, TP and PP ranks hold different gradients and must
skip the same step (a rank stepping alone would desync replicas or hang ZeRO's broadcasts).
Left out on purpose: fp8 training, stochastic rounding, 16-bit optimizer states, per-layer loss
scales. Paper: Micikevicius et al., "Mixed Precision Training", ICLR 2018, arXiv 1710.03740.
"""

import argparse
import contextlib
import importlib
import math
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

model_lib = importlib.import_module("02_model")

IGNORE = -1  # 02's cross_entropy_loss ignores targets == -1 (padding, masked prompts)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# --------------------------------------------------------------------------- the formats


def smallest_subnormal(dtype: torch.dtype) -> float:
    """The smallest positive number of a float dtype: min normal x eps = 2^(emin - mantissa)."""
    return torch.finfo(dtype).tiny * torch.finfo(dtype).eps  # exact: both are powers of two


def needs_loss_scaling(dtype: torch.dtype) -> bool:
    """Only fp16 needs a loss scaler: its 5 exponent bits flush small gradients to zero. bf16 has
    fp32's exponent range (and fp32 has nothing to scale), so their scalers are disabled."""
    return dtype == torch.float16


def print_formats():
    """The formats' range and precision, from torch.finfo (fp8 where this torch has it)."""
    print(f"{'format':<14} {'bits':>4} {'max':>9} {'eps':>9} {'min normal':>10} {'subnormal':>9}")
    for name in ("float32", "tf32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"):
        dtype = getattr(torch, name, torch.float32)  # tf32 is not a dtype: fp32 in memory
        info, sub = torch.finfo(dtype), f"{smallest_subnormal(dtype):.3g}"
        bits, eps, sub = (19, 2.0**-10, "-") if name == "tf32" else (info.bits, info.eps, sub)
        if name == "tf32" or hasattr(torch, name):
            print(f"{name:<14} {bits:>4} {info.max:>9.3g} {eps:>9.3g} {info.tiny:>10.3g} {sub:>9}")
    print("tf32: fp32 storage; Ampere+ tensor cores round matmul inputs to 10 mantissa bits and")
    print("accumulate in fp32 (torch.set_float32_matmul_precision('high')).\n")


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
    either one can load. enabled=False (bf16, fp32) turns every method into a pass-through.
    """

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
        assert all(g.dtype != torch.float16 for g in grads), (
            "unscaling fp16 gradients in fp16 would flush the small ones to zero: keep fp32 "
            "parameters (torch.autocast) or copy the gradients up first (MasterWeights)"
        )
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
    """The scaler for a training dtype: enabled for fp16 only (bf16, fp32: a pass-through)."""
    return DynamicLossScaler(enabled=needs_loss_scaling(dtype), group=group, **kwargs)


def autocast_context(dtype: torch.dtype, device_type: str):
    """torch.autocast for bf16/fp16 (weights stay fp32), nothing for fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


# --------------------------------------------------------------------------- fp32 master weights


class MasterWeights:
    """Mixed precision by hand (Micikevicius et al. 2018, §3.1): an fp32 master copy of every
    parameter for the optimizer, and the model itself turned into the 16-bit working copy.

        mw = MasterWeights(model, torch.float16)        # model is now fp16; mw.master is fp32
        opt = torch.optim.AdamW(mw.parameters())        # the optimizer only sees fp32
        scaler.scale(model(x, y)[1]).backward()         # 16-bit forward and backward
        mw.grads_to_master(); scaler.step(opt); scaler.update(); mw.master_to_model()
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.float16):
        params = list(model.parameters())  # a tied weight (wte = lm_head) appears once
        assert all(p.dtype == torch.float32 for p in params), "MasterWeights wants an fp32 model"
        self.model, self.dtype = model, dtype
        self.master = [nn.Parameter(p.detach().clone()) for p in params]  # fp32, before the cast
        model.to(dtype)  # in place: the same Parameter objects, now 16-bit
        self.working = list(model.parameters())
        assert len(self.working) == len(self.master), "the model's parameters changed under .to()"

    def parameters(self) -> list[nn.Parameter]:
        return self.master

    def grads_to_master(self) -> None:
        """fp32 copies of the 16-bit gradients (exact: every 16-bit number is an fp32 number);
        the 16-bit ones are freed. The master grads still carry the loss scale S."""
        for w, m in zip(self.working, self.master):
            m.grad, w.grad = (None if w.grad is None else w.grad.float()), None

    @torch.no_grad()
    def master_to_model(self) -> None:
        """Round the fp32 masters to the nearest 16-bit numbers: the next forward's weights."""
        torch._foreach_copy_(self.working, self.master)


# --------------------------------------------------------------------------- gradient accumulation


def count_tokens(targets: torch.Tensor) -> torch.Tensor:
    """Target tokens that count in the loss (not IGNORE), as a 0-dim int64 tensor."""
    return (targets != IGNORE).sum()


def global_token_count(microbatches, group=None) -> int:
    """N: real target tokens in this step's microbatches, summed over the DP group (SUM).
    Every DP rank must call it (it is a collective) before its first backward of the step."""
    n = sum(count_tokens(y) for _, y in microbatches)  # 0-dim, on the targets' device
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(n, op=dist.ReduceOp.SUM, group=group)
    assert n.item() > 0, "this step has no target tokens: every target is IGNORE"
    return int(n.item())


def accumulate_gradients(
    model, microbatches, global_tokens: int, dp_size: int = 1, scaler=None, dtype=torch.float32
) -> float:
    """Backward over k microbatches so that .grad = d/dθ [(1/N) Σ_all tokens ℓ_t], exactly the
    gradient of one batch holding all of them, on all DP ranks. global_tokens: N from
    global_token_count. dp_size: DP wrappers average gradients (SUM, then /dp: DDP and 03's
    DataParallel), so each rank's loss is multiplied by dp to make that average a sum. no_sync(),
    where the model has it, covers all but the last microbatch: one all-reduce round, not k.
    Returns this rank's share of the step's mean loss (the DP ranks' shares add up to it)."""
    assert global_tokens > 0, f"global_tokens must be > 0, got {global_tokens}"
    total = 0.0
    for i, (x, y) in enumerate(microbatches):  # x, y: (b, T)
        last = i == len(microbatches) - 1
        sync = (
            contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        )
        with sync:
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


# --------------------------------------------------------------------------- the demo: memory


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views and tied weights counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def saved_activation_bytes(model, fn):
    """fn()'s result, and the bytes autograd saved for the backward (the activations), not
    counting the parameters themselves (saved by reference, not copied)."""
    saved, params = [], {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, tensor_bytes(saved)


def activation_formula(config, B: int, T: int, mode: str) -> int:
    """Bytes saved for the backward of 02's GPT. Per token and layer: the two LayerNorms' inputs
    2C (the residual stream) with mean and rstd; matmul operands 14C: c_attn input C, q|k|v 3C,
    attention output C (= c_proj's input), c_fc input C, GELU input 4C and output 4C; attention's
    fp32 log-sum-exp per head. Then ln_f (C + stats), lm_head's input C, the fp32 log-softmax V,
    the int64 ids and targets. autocast also keeps a 16-bit copy of every Linear weight."""
    C, L, V, nh = config.n_embd, config.n_layer, config.padded_vocab_size, config.n_head
    a = 4 if mode == "fp32" else 2  # matmul operands: 16-bit under autocast and by hand
    r = 2 if mode == "fp16 by hand" else 4  # residual stream: fp32 unless the model is 16-bit
    per_token = L * (2 * (C + 2) * r + 14 * C * a + 4 * nh) + (C + 2) * r + C * a + 4 * V + 16
    weight_copies = 2 * (L * 12 * C * C + V * C) if "autocast" in mode else 0
    return B * T * per_token + weight_copies


def memory_table(model, optimizer, master, autocast_dtype, x, y, mode) -> dict:
    """{component: (measured bytes, formula bytes)} after training: one more forward/backward
    (no step) measures the parameters, gradients, AdamW state and saved activations."""
    with autocast_context(autocast_dtype, x.device.type):
        (_, loss), activations = saved_activation_bytes(model, lambda: model(x, y))
    loss.backward()
    if master:
        master.grads_to_master()
    params = master.working + master.master if master else list(model.parameters())
    N = sum(p.numel() for p in (master.master if master else params))
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    measured = [tensor_bytes(params), tensor_bytes(p.grad for p in params if p.grad is not None),
                tensor_bytes(state), activations]  # fmt: skip
    optimizer.zero_grad(set_to_none=True)
    formulas = [(2 + 4) * N if master else 4 * N,  # by hand: 16-bit working + fp32 master
                4 * N,  # fp32 grads (by hand: the 16-bit ones are freed once copied up)
                8 * N,  # AdamW's m and v, fp32
                activation_formula(model.config, *x.shape, mode)]  # fmt: skip
    return dict(zip(("params", "grads", "AdamW m,v", "activations"), zip(measured, formulas)))


# --------------------------------------------------------------------------- the demo: training

MODES = ("fp32", "bf16 autocast", "fp16 autocast + scaler", "fp16 by hand")


def text_batches(config, steps: int, batch_size: int, seed: int) -> list:
    """Random windows of this file's own bytes (V = 256): `steps` (x, y) pairs, each (B, T)."""
    data = torch.tensor(list(Path(__file__).read_bytes()), dtype=torch.long)
    g, T = torch.Generator().manual_seed(seed), config.block_size
    starts = torch.randint(len(data) - T - 1, (steps, batch_size), generator=g)
    rows = data[starts[..., None] + torch.arange(T + 1)]  # (steps, B, T+1)
    # (B, T), (B, T): y is x shifted by one; own storage each, so memory counts only the batch
    return [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows]


def build(mode: str, config, args, device):
    """Model, AdamW, scaler, MasterWeights (by hand only) and autocast dtype; the same init."""
    torch.manual_seed(args.seed)
    model = model_lib.GPT(config).to(device)
    dtype = {"fp32": torch.float32, "bf16 autocast": torch.bfloat16}.get(mode, torch.float16)
    master = MasterWeights(model, dtype) if mode == "fp16 by hand" else None
    optimizer = torch.optim.AdamW(master.parameters() if master else model.parameters(), lr=args.lr)
    scaler = make_scaler(dtype, init_scale=args.init_scale, growth_interval=args.growth_interval)
    return model, optimizer, scaler, master, dtype if "autocast" in mode else torch.float32


def train_step(model, optimizer, scaler, master, autocast_dtype, x, y, grad_clip=1.0) -> float:
    """One step, the same code for every mode (a disabled scaler passes everything through)."""
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


def train_all(config, batches, args, device) -> dict:
    """Every mode in lockstep (one step of each in turn, so a busy machine slows all of them
    alike): losses, median step time, scaler statistics, memory measured and by formula."""
    runs = {mode: build(mode, config, args, device) for mode in MODES}
    losses, times = ({mode: [] for mode in MODES} for _ in range(2))
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        for mode, run in runs.items():
            t0 = time.perf_counter()
            losses[mode].append(train_step(*run, x, y))
            times[mode].append(time.perf_counter() - t0)
    results = {}
    for mode, (model, optimizer, scaler, master, ac) in runs.items():
        ms = 1e3 * statistics.median(times[mode][5:] or times[mode])
        memory = memory_table(model, optimizer, master, ac, x, y, mode)
        results[mode] = dict(losses=losses[mode], ms=ms, skipped=scaler.skipped_steps,
                             scale=scaler.get_scale(), memory=memory)  # fmt: skip
    return results


def print_results(results: dict, config, B: int):
    print(f"{'mode':<23} {'ms/step':>8} {'vs fp32':>8} {'last loss':>9} {'skipped':>8} {'scale'}")
    for mode, r in results.items():
        scale = f"2^{math.log2(r['scale']):.0f}" if r["scale"] != 1.0 else "-"
        ratio, loss = r["ms"] / results["fp32"]["ms"], r["losses"][-1]
        print(f"{mode:<23} {r['ms']:>8.2f} {ratio:>7.2f}x {loss:>9.3f} {r['skipped']:>8} {scale}")
    columns = "".join(f"{k:>16}" for k in results["fp32"]["memory"])
    print(f"\n{'KB: measured / formula':<23}{columns}{'sum':>8}")
    for mode, r in results.items():
        cells = "".join(f"{m / 1024:>9.0f} / {f / 1024:<4.0f}" for m, f in r["memory"].values())
        print(f"{mode:<23}{cells}{sum(m for m, _ in r['memory'].values()) / 1024:>8.0f}")
    C, L, V, T = config.n_embd, config.n_layer, config.padded_vocab_size, config.block_size
    N = results["fp32"]["memory"]["params"][0] // 4
    print(f"N = {N:,}: params 4N (by hand 2N working + 4N master), grads 4N, AdamW 8N;\n"
          f"activations ≈ B·T·(L·(2C·r + 14C·a) + C·r + C·a + 4V) + 2·(12LC² + VC) under autocast"
          f" (its weight copies),\na and r = bytes per matmul operand and per residual value, "
          f"B·T = {B}·{T}, C = {C}, L = {L}, V = {V}. The sum is about the peak.")  # fmt: skip


# --------------------------------------------------------------------------- the demo: gradients


def grad_magnitudes(config, batches, args) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32-train the GPT on all but the last batch, then record |grad| of every Linear's output
    (activation gradients) and of every parameter in one more backward. Non-zeros only."""
    model, optimizer, scaler, _, _ = build("fp32", config, args, torch.device("cpu"))
    for x, y in batches[:-1]:
        train_step(model, optimizer, scaler, None, torch.float32, x, y)
    acts = []

    def record(module, inputs, output):
        output.register_hook(lambda g: acts.append(g.detach().abs().flatten()))

    handles = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, nn.Linear)]
    model(*batches[-1])[1].backward()
    for h in handles:
        h.remove()
    acts, params = torch.cat(acts), torch.cat([p.grad.abs().flatten() for p in model.parameters()])
    return acts[acts > 0], params[params > 0]


def underflow_report(acts, params, scale: float):
    """What really becomes 0, subnormal or inf when fp32 gradients are rounded to 16 bits."""
    print(f"{'gradients':<18} {'rounded to':<14} {'-> 0':>7} {'subnormal':>10} {'-> inf':>7}")
    cases = (("fp16", torch.float16, 1.0), (f"fp16 x 2^{math.log2(scale):.0f}", torch.float16,
             scale), ("bf16", torch.bfloat16, 1.0))  # fmt: skip
    for name, g in (("activation grads", acts), ("parameter grads", params)):
        for label, dtype, s in cases:
            q = (g * s).to(dtype)
            zero, inf = (q == 0).float().mean(), q.isinf().float().mean()
            sub = ((q != 0) & (q.abs() < torch.finfo(dtype).tiny)).float().mean()
            print(f"{name:<18} {label:<14} {zero:>7.2%} {sub:>10.2%} {inf:>7.2%}")
    fp16 = torch.finfo(torch.float16)
    print(f"(median |activation grad| {acts.median():.1e}; fp16: smallest subnormal "
          f"{smallest_subnormal(torch.float16):.1e}, smallest normal {fp16.tiny:.1e})")  # fmt: skip


def _plot(nrows, title, paths, draw, **kwargs):
    """A matplotlib figure of nrows shared-x axes, drawn by draw(axes), saved to every path."""
    import matplotlib.pyplot as plt

    plt.switch_backend("Agg")  # files only, no window
    fig, axes = plt.subplots(nrows, 1, figsize=(9, 6), sharex=True, **kwargs)
    draw(axes)
    axes[0].set_title(title)
    for path in paths:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120, bbox_inches="tight")
        print(f"wrote {path}")
    plt.close(fig)


def plot_grad_histogram(acts, params, scale: float, paths):
    bins, k = torch.arange(-50.0, 20.0, 0.5).numpy(), math.log2(scale)
    fp16 = torch.finfo(torch.float16)
    lines = {"fp16 smallest subnormal (below: 0)": smallest_subnormal(torch.float16),
             "fp16 smallest normal": fp16.tiny, "fp16 max": fp16.max}  # fmt: skip

    def draw(axes):
        for ax, (name, g) in zip(axes, (("activation grads", acts), ("parameter grads", params))):
            log2 = g.double().log2().numpy()
            ax.hist(log2, bins=bins, alpha=0.6, label=f"{name}, as computed (fp32)")
            ax.hist(log2 + k, bins=bins, histtype="step", linewidth=1.5, label=f"x S = 2^{k:.0f}")
            for text, x in lines.items():
                ax.axvline(math.log2(x), color="k", linestyle="--", linewidth=1)
                top = ax.get_ylim()[1] * 0.97
                ax.text(math.log2(x) + 0.3, top, text, rotation=90, va="top", fontsize=7)
            ax.set(ylabel="count")
            ax.legend(loc="upper left", fontsize=8)
        axes[-1].set(xlabel="log2 |gradient|")

    _plot(2, "Tiny GPT gradients against fp16's range: loss scaling shifts them right", paths, draw)


def plot_losses(results: dict, paths):
    base = torch.tensor(results["fp32"]["losses"])

    def draw(axes):
        for mode, r in results.items():
            axes[0].plot(r["losses"], label=f"{mode} ({r['ms']:.1f} ms/step)", linewidth=1)
            axes[1].plot((torch.tensor(r["losses"]) - base).numpy(), linewidth=1)
        axes[0].set(ylabel="training loss")
        axes[1].set(xlabel="step", ylabel="loss - fp32 loss")
        axes[0].legend()

    title = "Tiny GPT: fp32 vs bf16 vs fp16, the same init and batches"
    _plot(2, title, paths, draw, height_ratios=(2, 1))


# --------------------------------------------------------------------------- the demo: accumulation


def accumulation_demo(config, args):
    """k microbatches of b rows against one batch of k·b rows, with equal and with unequal
    numbers of real target tokens per microbatch (microbatch i keeps T/(i+1) per row)."""
    k, b = args.accum, args.batch_size // args.accum
    model = build("fp32", config, args, torch.device("cpu"))[0]
    x, y = text_batches(config, 1, k * b, args.seed + 1)[0]  # (k·b, T)
    padded = y.clone()
    for i in range(k):
        padded[i * b : (i + 1) * b, config.block_size // (i + 1) :] = IGNORE

    def grads(fn) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        fn()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    print(f"accumulation: k = {k} microbatches of {b} rows vs one batch of {k * b} rows, max "
          f"|g_accumulated - g_batch| / max |g_batch| (fp32 rounding: ~1e-7)")  # fmt: skip
    print(f"{'':<18} {'token-normalised':>17} {'mean of means':>14}   tokens per microbatch")
    for label, t in (("equal tokens", y), ("unequal tokens", padded)):
        micro = list(zip(x.split(b), t.split(b)))
        big = grads(lambda t=t: model(x, t)[1].backward())  # one batch: mean over all real tokens
        n = global_token_count(micro)
        tok = grads(lambda m=micro, n=n: accumulate_gradients(model, m, n))
        mom = grads(lambda m=micro: accumulate_mean_of_means(model, m))
        tok, mom = ((g - big).abs().max().item() / big.abs().max().item() for g in (tok, mom))
        print(f"{label:<18} {tok:>17.1e} {mom:>14.1e}   {[int(count_tokens(y)) for _, y in micro]}")


# --------------------------------------------------------------------------- main


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150, help="training steps per mode")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per step (B)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--preset", default="tiny", choices=("tiny", "small"), help="GPT size")
    parser.add_argument("--init-scale", type=float, default=2.0**16, help="fp16's first loss scale")
    # GradScaler's default is 2000; 50 lets a short run show the scale grow and back off
    parser.add_argument("--growth-interval", type=int, default=50, help="clean steps per growth")
    parser.add_argument("--accum", type=int, default=4, help="microbatches to accumulate (demo)")
    parser.add_argument("--out-dir", default="out/mixed_precision", help="where figures go")
    parser.add_argument("--docs-dir", default="", help="also write the figures here (README: docs)")
    # 1: the tiny model's ops are too small to share, and spinning OpenMP threads on a busy
    # machine make timings erratic; 0 keeps torch's default
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=1337)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=device, help="cpu or cuda (default: %(default)s)")
    args = parser.parse_args()
    assert args.batch_size % args.accum == 0, f"--batch-size must divide by --accum {args.accum}"
    device, dirs = torch.device(args.device), [Path(d) for d in (args.out_dir, args.docs_dir) if d]
    if args.threads:
        torch.set_num_threads(args.threads)
    config = model_lib.GPTConfig.from_preset(args.preset, vocab_size=256)  # bytes are the tokens

    print_formats()
    batches = text_batches(config, args.steps, args.batch_size, args.seed)
    acts, params = grad_magnitudes(config, batches[:51], args)
    print(f"gradients of the {args.preset} GPT after 50 fp32 steps, rounded to 16 bits:")
    underflow_report(acts, params, args.init_scale)
    plot_grad_histogram(acts, params, args.init_scale, [d / "grad_underflow.png" for d in dirs])

    print(f"\n{args.steps} steps of {args.batch_size}x{config.block_size} tokens per mode on "
          f"{device} (CPU threads: {torch.get_num_threads()}), the same init and batches:")  # fmt: skip
    results = train_all(config, batches, args, device)
    print_results(results, config, args.batch_size)
    if device.type == "cpu":
        print("On this CPU 16-bit is SLOWER than fp32: without 16-bit matmul units its kernels "
              "convert to and from fp32,\nand autocast adds casts. The speed-up is a GPU property "
              "(tensor cores): bench/bench_mixed_precision.py.")  # fmt: skip
    plot_losses(results, [d / "mixed_precision_loss.png" for d in dirs])
    print()
    accumulation_demo(config, args)


if __name__ == "__main__":
    main()
