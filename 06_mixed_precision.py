"""06 · Precision of one step: compute in 16 bits, keep what accumulates in fp32.

The idea in one sentence: run the forward and backward in 16-bit numbers (half the
bytes, and many times fp32's FLOP/s on a GPU's tensor cores), keep what accumulates
small changes (weights, optimizer state, the loss, long sums) in fp32, and for fp16
multiply the loss by a scale S so that small gradients are not flushed to zero.

Bits, sign|exponent|mantissa: fp32 1|8|23; bf16 1|8|7 (fp32's range, 2-3 digits); fp16
1|5|10 (max 65504, smallest normal 6.1e-5, smallest subnormal 6.0e-8; below 3.0e-8: 0).

1. Why fp16 gradients underflow: dL/dlogits = (softmax - onehot)/N is about 1/(V·N) for
   most entries, and gradients shrink on the way down. For the tiny GPT the demo
   prints `median |g| 7.8e-06` for the activation gradients, and in fp16 it prints
   `to fp16 1.06% 77.63% 0%`: 1.1% round to 0, 78% are subnormals (fewer bits), none
   overflow. bf16 has fp32's 8 exponent bits: nothing above 1e-38 vanishes. (The
   gradients are computed in fp64, then rounded: the same shares on any CPU.)
2. A static loss scale: backprop is linear, so grad(S·L) = S·grad(L). S = 2^k moves
   every gradient k binades up, past the underflow; divide by S in fp32 before the
   step. With S = 2^16 the demo prints `to fp16 x 2^16 0.00% 0.07% 0%`.
3. A dynamic loss scale: too large an S overflows to inf, and the right S drifts.
   DynamicLossScaler (GradScaler's decisions) skips the step and halves S on an inf or
   NaN, and doubles S after growth_interval clean steps. The demo starts at 2^19 and
   skips steps 0 and 1 (it prints `1 5.343 5.527 2^17 True`), then grows to 2^18 and
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

Launch:  python 06_mixed_precision.py   (seconds on a CPU; --help): the five in order.

What changed from 05c_zero_bubble.py, the last pipeline lesson: 05's microbatches come
back as accumulation steps, and training gets a dtype and a loss scale (05b's
Microbatches takes them as given); the new collective is the scaler's inf check, a
4-byte MAX over all ranks (DP, TP and PP ranks must skip the same step). Left out on
purpose: fp8, stochastic rounding, 16-bit optimizer states; keeping fewer activations
(recomputation, the chunked loss) is 06b_recompute.py. Paper: Micikevicius et al.,
1710.03740.
"""

import argparse
import contextlib
import importlib
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from support.mixed_precision.precision import GradScalerState
from support.mixed_precision.precision import fp32 as _fp32

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


def rounding_shares(flat: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """Shares of |flat| · scale that round to 0, a subnormal and inf in `dtype`."""
    q = (flat * scale).to(dtype)
    zero = (q == 0).float().mean()
    subnormal = ((q != 0) & (q.abs() < torch.finfo(dtype).tiny)).float().mean()
    return zero, subnormal, q.isinf().float().mean()


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
    (support/mixed_precision/precision.py). With enabled=False (for bf16 and fp32) it does nothing:
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


# ------------------------------------------------------------------------ the demos
def fp64_cross_entropy(logits, targets, reduction="mean"):
    """02's loss without its cast to fp32, for a GPT in fp64: (B, T, V), (B, T)."""
    flat = logits.flatten(0, 1)  # (B*T, V)
    flat_targets = targets.flatten()  # (B*T,)
    return F.cross_entropy(flat, flat_targets, ignore_index=IGNORE, reduction=reduction)


def underflow_demo(config, batches, args):
    """After 50 training steps, every Linear output's |grad| (the activation gradients)
    and every parameter's, rounded to 16 bits without and with S: how many are 0?
    subtle: the claim is about rounding given values to 16 bits, so the values come
    from fp64 (weights, training, loss), then fp32 as a run would hold them. In fp32
    the 50 AdamW steps would amplify the sums' rounding, which the CPU's vector width
    (ATEN_CPU_CAPABILITY) and threads order, so the shares would differ by CPU."""
    assert config.padded_vocab_size == config.vocab_size, "02's loss masks padding"
    torch.manual_seed(args.seed)
    model = model_lib.GPT(config).to(args.device, torch.float64)
    model.loss_fn = fp64_cross_entropy
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    no_scale = make_scaler(torch.float64)  # disabled: fp64 needs no loss scale
    for x, y in batches[:-1]:  # torch.float32 below: no autocast
        train_step(model, optimizer, no_scale, None, torch.float32, x, y)
    outputs = []  # every Linear's output: their gradients are the activation gradients
    for linear in (m for m in model.modules() if isinstance(m, nn.Linear)):
        linear.register_forward_hook(lambda module, inputs, out: outputs.append(out))
    _, loss = model(*batches[-1])
    g = torch.autograd.grad(loss, outputs + list(model.parameters()))
    n = len(outputs)
    S = args.init_scale
    cases = (("fp16", 1.0), (f"fp16 x 2^{math.log2(S):.0f}", S), ("bf16", 1.0))
    steps = f"{len(batches) - 1} steps (fp64)"
    print(f"gradients after {steps}, rounded      0  subnormal  inf")
    grads = {}  # The non-zeros, returned so that a caller can plot them.
    for name, ts in (("activation grads", g[:n]), ("parameter grads", g[n:])):
        flat = torch.cat([t.abs().flatten() for t in ts])  # fp64
        # subtle: a gradient that is 0 in exact arithmetic (the first query's: its
        # softmax over one key is 1 whatever the score; the key bias's, which shifts a
        # whole row of scores) leaves fp64's sums as a residue under 1e-18 whose size
        # the order decides. The real ones here are 1e-13 and up; below 1e-16 is 0.
        flat = grads[name] = flat[flat > 1e-16].float().cpu()  # as fp32 holds them
        for label, s in cases:
            zero, sub, inf = rounding_shares(flat, DTYPES[label[:4]], s)
            print(f"{name:<17} to {label:<12} {zero:>7.2%} {sub:>10.2%} {inf:>4.0%}")
        print(f"({name}: median |g| {flat.median():.1e})")
    return grads


def fp16_training_demo(config, batches, args):
    """fp16 by hand under the scaler, started too high on purpose, beside fp32."""
    print("\nfp16 by hand: MasterWeights + DynamicLossScaler(2^19, growth_interval=3)")
    print("step  loss fp32  loss fp16  scale after  skipped")
    runs = []
    for dtype in (torch.float32, torch.float16):
        torch.manual_seed(args.seed)
        model = model_lib.GPT(config).to(args.device)
        master = MasterWeights(model, dtype) if dtype != torch.float32 else None
        optimizer = torch.optim.AdamW((master or model).parameters(), lr=args.lr)
        scaler = make_scaler(dtype, init_scale=2.0**19, growth_interval=3)
        runs.append([])
        for x, y in batches[: args.fp16_steps]:
            loss = train_step(model, optimizer, scaler, master, torch.float32, x, y)
            runs[-1].append((loss, scaler.get_scale(), scaler.last_step_skipped))
    # Three decimals: fp16's sums round as the CPU's vector width (ATEN_CPU_CAPABILITY)
    # orders them, which moved a loss here by up to 4e-5 in ten steps (fp32's: 5e-7).
    for step, (fp32, fp16) in enumerate(zip(*runs)):
        scale = f"2^{math.log2(fp16[1]):.0f}"
        print(f"{step:>4} {fp32[0]:>10.3f} {fp16[0]:>10.3f} {scale:>12} {fp16[2]!s:>8}")
    print("(a skipped step changes no weight: fp16 has had that many fewer updates)\n")


def accumulation_demo(config, args):
    """k microbatches against one batch, then with T/(i+1) targets in microbatch i."""
    k = args.accum
    b = args.batch_size // k
    T = config.block_size
    torch.manual_seed(args.seed)
    model = model_lib.GPT(config).to(args.device)
    [(x, y)] = model_lib.byte_batches(T, k * b, 1, args.seed + 1, args.device)
    padded = y.clone()  # (k·b, T)
    for i in range(k):
        padded[i * b : (i + 1) * b, T // (i + 1) :] = IGNORE

    def grads(fn) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        fn()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    print(f"{k} microbatches of {b} rows vs one batch of {k * b}, max |g - g_batch|")
    print("/ max |g_batch|:      token-normalised  mean of means  tokens each")
    for label, targets in (("equal tokens", y), ("unequal tokens", padded)):
        micro = list(zip(x.split(b), targets.split(b)))
        one_batch = grads(lambda t=targets: model(x, t)[1].backward())
        n = global_token_count(micro)
        normalised = grads(lambda m=micro, n=n: accumulate_gradients(model, m, n))
        mean_of_means = grads(lambda m=micro: accumulate_mean_of_means(model, m))
        top = one_batch.abs().max()
        ours = (normalised - one_batch).abs().max() / top
        trap = (mean_of_means - one_batch).abs().max() / top
        counts = [int(count_tokens(t)) for _, t in micro]
        print(f"{label:<20} {ours:>17.1e} {trap:>14.1e}  {counts}")


def main(argv=None):
    formatter = argparse.ArgumentDefaultsHelpFormatter
    description = __doc__.split("\n")[0]
    parser = argparse.ArgumentParser(description=description, formatter_class=formatter)
    add = parser.add_argument
    add("--batch-size", type=int, default=8, help="rows per step; 2 per microbatch")
    add("--steps", type=int, default=50, help="training steps before the gradients")
    add("--fp16-steps", type=int, default=10, help="steps of the fp16 training demo")
    add("--lr", type=float, default=3e-3, help="AdamW's; high for a short run")
    add("--init-scale", type=float, default=2.0**16, help="S, the static loss scale")
    add("--accum", type=int, default=4, help="microbatches; 4 token counts")
    add("--seed", type=int, default=1337, help="init and batch seed: runs repeat")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    add("--device", default=device, help="where it runs; a GPU when there is one")
    add("--chunk-tokens", type=int, help=argparse.SUPPRESS)  # moved to 06b
    args = parser.parse_args(argv)
    if args.chunk_tokens is not None:
        parser.error("the chunked loss moved: python 06b_recompute.py --chunk-tokens N")
    if args.accum < 1 or args.batch_size % args.accum or args.steps < args.fp16_steps:
        parser.error("--steps >= --fp16-steps, and --batch-size a multiple of --accum")
    torch.set_num_threads(1)  # the tiny model's ops are too small to share
    config = model_lib.GPTConfig.from_preset("tiny")  # V = 256: bytes are the tokens
    batch = (config.block_size, args.batch_size, args.steps + 1, args.seed)
    batches = model_lib.byte_batches(*batch, args.device)
    static_scale_example(args.init_scale)
    underflow_demo(config, batches, args)
    fp16_training_demo(config, batches, args)
    accumulation_demo(config, args)
    print("(recomputation and the chunked loss: python 06b_recompute.py)")


if __name__ == "__main__":
    main()
