"""03b · Gradient compression: communication hooks that send fewer bytes than 4Ψ.

The idea in one sentence: 03's DataParallel hands each full bucket of gradients to one
function, its communication hook (DDP's register_comm_hook), and a hook may send that
bucket in fewer bytes, as long as every rank ends with the same estimate of the mean.

Why. A ring all-reduce of fp32 gradients makes each rank send about 2·4Ψ bytes a step
(03). Across nodes on Ethernet that can take longer than the step's compute.

The math, two hooks, each given one bucket of this rank's gradients:
- fp16/bf16 (torch's fp16_compress_hook, op for op): cast the bucket, divide by N (the
  sum cannot overflow), all-reduce, cast back: 2 bytes a number instead of 4 (2Ψ in
  all), and 11 or 8 significant bits kept.
- PowerSGD (Vogels et al. 2019, arXiv 1905.13727) sends a rank-r sketch of each gradient
  matrix M (m×n: p.grad as (len(p), the rest)); vectors go whole. M̄ is the mean of
  the ranks' M.
      M += e    P = orthonormal(all-reduce(M·orthonormal(Q)))  (m×r)
      Q = all-reduce(Mᵀ P) / N  (n×r)    update = P Qᵀ = P Pᵀ M̄    e = M - update
  It sends (m + n)·r numbers instead of m·n, so a step all-reduces
      4·(Σ_matrices (m + n)·r + Σ_vectors numel)  bytes   (r capped at min(m, n)).
  Q is warm-started (gradients drift slowly), and the error feedback e keeps it
  converging: what a sketch misses is sent later, not lost.

Who holds what, N = 2, one m×n gradient matrix, PowerSGD at rank r:

             holds                        M = g + e   sends
    rank 0   g₀, e₀ (m×n), Q (n×r)        M₀          M₀·Q (m×r), then M₀ᵀP (n×r)
    rank 1   g₁, e₁ (m×n), Q (n×r)        M₁          M₁·Q (m×r), then M₁ᵀP (n×r)
    both     P = orthonormal(M₀Q + M₁Q),  Q = (M₀ᵀP + M₁ᵀP)/N,  gradient = P Qᵀ
    (Q, P and the rank-r update are the same on every rank, e is each rank's own;
    fp16 instead sends each rank's whole bucket, 2 bytes a number)

Launch:  python 03b_compression.py [--ranks N]                     (runs torchrun for you)
         torchrun --standalone --nproc_per_node=2 03b_compression.py    (or 4)
It trains 02's small GPT for 10 steps with each hook and prints the bytes all-reduced in
a step beside the formula, and the loss on held-out rows. Each hook on the main job
(train.py --grad-compression) and the link bandwidth below which each pays are measured
by bench/bench_compression.py, its numbers in docs/results.md.

What changed from 03_ddp.py: nothing in DataParallel; a hook is passed as comm_hook=.
Simple first: HalfPrecision, a cast around 03's all-reduce; then PowerSGD, two rounds of
all-reduces and a residual kept per matrix.

Left out on purpose: overlapping PowerSGD's first round (its hook waits for it), a
residual for the vectors (torch keeps each rank's deviation, which sums to zero),
compressing ZeRO's reduce-scatters (07), quantisation below 16 bits (1-bit Adam).
"""

import importlib

import torch
import torch.distributed as dist

from support import distributed
from support.distributed import print0

model_lib = importlib.import_module("02_model")
ddp = importlib.import_module("03_ddp")


class Then:
    """A started collective and what finishes it once done (torch's future.then)."""

    def __init__(self, work, then):
        self.work = work
        self.then = then

    def wait(self) -> None:
        self.work.wait()  # on a GPU: makes the current stream wait, not the host
        self.then()


# ------------- simple first: send the bucket in 16 bits
class HalfPrecision:
    """fp16 or bf16 compression, torch's fp16_compress_hook op for op: cast, / N, SUM,
    cast back into the bucket. Half the bytes; every gradient rounded to 16 bits."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __call__(self, dp, bucket):
        sent = bucket.buffer.to(self.dtype).div_(dp.world)  # order: cast, then / N
        work = dp.all_reduce(sent)  # counted by 03's DataParallel: 2 bytes a number
        return Then(work, lambda: bucket.buffer.copy_(sent))


# ------------- the real thing: a low-rank sketch with error feedback
def orthonormal(a: torch.Tensor) -> torch.Tensor:
    """(k, r), r <= k: an orthonormal basis of the span of a's columns."""
    return torch.linalg.qr(a).Q  # Householder: a zero column still gives a unit vector


class PowerSGD:
    """Rank-r PowerSGD with error feedback (see the top), a hook for DataParallel. The
    first warmup_steps synced passes all-reduce exactly (torch's start_powerSGD_iter)."""

    def __init__(self, params, rank: int = 4, warmup_steps: int = 10, seed: int = 0):
        assert rank >= 1, f"the PowerSGD rank must be >= 1, got {rank}"
        assert warmup_steps >= 0, f"warmup_steps must be >= 0, got {warmup_steps}"
        self.rank = rank
        self.warmup_steps = warmup_steps
        self.seed = seed
        self.steps = 0  # synced passes so far
        params = [p for p in params if p.requires_grad]
        # The matrices are sketched as (len(p), the rest); the vectors go whole.
        self.matrices = [p for p in params if p.dim() >= 2]
        self.index = {p: i for i, p in enumerate(self.matrices)}
        # The residuals e, (m, n) each.
        self.errors = [torch.zeros_like(p).view(len(p), -1) for p in self.matrices]
        self.qs = []  # Q (n, r) per matrix: drawn at the first sketch, then reused

    @property
    def active(self) -> bool:
        """True once the warm-up is over: the hook sketches, no longer exact."""
        return self.steps >= self.warmup_steps

    def __call__(self, dp, bucket):
        if self.active:
            sent = self.sketch(dp, bucket)
        else:
            sent = ddp.all_reduce_hook(dp, bucket)
        if bucket.is_last:
            self.steps += 1
        return sent

    def _draw_qs(self) -> None:
        """The first Qs: the same random ones on every rank (from the seed)."""
        g = torch.Generator().manual_seed(self.seed)
        for p, e in zip(self.matrices, self.errors):
            q = torch.randn(e.shape[1], min(self.rank, *e.shape), generator=g)
            self.qs.append(q.to(p))

    def sketch(self, dp, bucket):
        """Replace this rank's gradients in the bucket with the sketch of the ranks'
        mean: the first all-reduce (the Ps) is waited for here, the second is not."""
        if not self.qs:
            self._draw_qs()
        pairs = list(zip(bucket.params, bucket.views))
        idx = [self.index[p] for p, _ in pairs if p.dim() >= 2]
        Ms = [v.view(len(p), -1) for p, v in pairs if p.dim() >= 2]  # (m, n) each
        vectors = [v for p, v in pairs if p.dim() < 2]  # sent whole, with the Ps
        for M, i in zip(Ms, idx):
            M.add_(self.errors[i])  # error feedback: what the last sketch missed
        ps = [M @ orthonormal(self.qs[i]) for M, i in zip(Ms, idx)]  # (m, r) each
        flat = torch.cat([t.reshape(-1) for t in ps + vectors])
        work = dp.all_reduce(flat)
        work.wait()
        sums = ddp.split_like(flat, ps + vectors)  # Σ_ranks M Q, and the vectors' sums
        # No / N here: P is orthonormalised anyway.
        ps = [orthonormal(p) for p in sums[: len(ps)]]
        for v, total in zip(vectors, sums[len(ps) :]):
            v.copy_(total).div_(dp.world)
        qs = [M.T @ p for M, p in zip(Ms, ps)]  # (n, r) each
        if not qs:  # a bucket of vectors only: they are done
            return Then(work, lambda: None)
        flat = torch.cat([q.reshape(-1) for q in qs])

        def update() -> None:
            means = ddp.split_like(flat.div_(dp.world), qs)  # (n, r) each
            for M, p, q, i in zip(Ms, ps, means, idx):
                self.qs[i] = q.clone()  # Mᵀ P of the ranks' mean M: the warm start
                self.errors[i].copy_(M)
                torch.matmul(p, q.T, out=M)  # the update P Qᵀ = P Pᵀ M̄, rank <= r
                # The residual: what this rank had, less the update.
                self.errors[i].sub_(M)

        return Then(dp.all_reduce(flat), update)

    def state_dict(self) -> dict:
        """Training state a resume must continue (torch.save copies the tensors)."""
        return {"steps": self.steps, "qs": self.qs, "errors": self.errors}

    def load_state_dict(self, state: dict) -> None:
        """Any step's state. subtle: saved in the warm-up, qs is [] (none drawn yet), and
        the first sketch draws the seed's, as the run that never stopped does."""
        self.steps = state["steps"]
        pairs = zip(state["errors"], self.matrices, strict=True)
        # A copy: on a CPU, to() would keep the checkpoint's memory-mapped file open.
        self.errors = [e.to(p.device, copy=True) for e, p in pairs]
        pairs = zip(state["qs"], self.matrices, strict=bool(state["qs"]))
        self.qs = [q.to(p.device, copy=True) for q, p in pairs]


# ------------- the demo: each hook's bytes beside its formula, and the loss it reaches
STEPS = 10  # PowerSGD's 5 exact steps, then 5 sketched: the last one sends the sketch.
WARMUP = 5  # PowerSGD's exact steps first
HOOKS = ("none", "fp16", "bf16", "powersgd r=1", "powersgd r=4")


def make_hook(name: str, params):
    """The hook a row of the demo names (None: 03's default all-reduce)."""
    if name.startswith("powersgd"):  # "powersgd r=4"
        return PowerSGD(params, rank=int(name.split("=")[1]), warmup_steps=WARMUP)
    half = {"fp16": torch.half, "bf16": torch.bfloat16}.get(name)
    return None if half is None else HalfPrecision(half)


def sent_formula(params: list, hook) -> tuple[str, int]:
    """The bytes hook all-reduces in a step (after PowerSGD's warm-up): (formula, bytes)."""
    psi = sum(p.numel() for p in params)
    if hook is None:  # 03's all_reduce_hook: every gradient in fp32
        return "4Ψ", 4 * psi
    if isinstance(hook, HalfPrecision):
        return "2Ψ", 2 * psi
    r = hook.rank
    shapes = [(len(p), p[0].numel()) for p in hook.matrices]  # (m, n) each
    sketch = sum((m + n) * min(r, m, n) for m, n in shapes)
    vectors = psi - sum(p.numel() for p in hook.matrices)  # sent whole
    return f"4(Σ(m+n)·{r} + Σv)", 4 * (sketch + vectors)


def run_demo(args, rank: int, world: int, device) -> None:
    preset = ddp.PRESET  # 03's GPT, rows and seed
    config = model_lib.GPTConfig.from_preset(preset, vocab_size=256, block_size=ddp.T)
    rows = world * ddp.B  # (N·B, T) a batch
    batches = model_lib.byte_batches(ddp.T, rows, STEPS, ddp.SEED + 1, device)
    held_out = model_lib.byte_batches(ddp.T, 32, 1, ddp.SEED + 2, device)[0]  # (32, T)
    mine = slice(rank * ddp.B, (rank + 1) * ddp.B)  # this rank's rows of each batch
    backend = dist.get_backend()
    print0(f"\n03b · gradient compression on {world} ranks ({backend}), '{preset}'")
    print0(f"\n{STEPS} AdamW steps a hook (PowerSGD's first {WARMUP} exact); the bytes")
    print0("all-reduced in the last step | the formula; the loss on held-out rows")
    sent = {}
    for name in HOOKS:
        torch.manual_seed(ddp.SEED)  # the same GPT for every hook
        gpt = model_lib.GPT(config).to(device)
        hook = make_hook(name, gpt.parameters())
        model = ddp.DataParallel(gpt, bucket_mb=1.0, comm_hook=hook)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for x, y in batches:
            before = model.stats["allreduce_bytes"]
            ddp.train_step(model, opt, x[mine], y[mine])
        sent[name] = model.stats["allreduce_bytes"] - before
        loss = model(*held_out)[1].item()
        ratio = f"1/{sent['none'] / sent[name]:.0f}"
        text, expected = sent_formula(list(gpt.parameters()), hook)
        measured = f"{name:<13} {sent[name]:>9,} bytes {ratio:>5}"
        print0(f"   {measured} | {text:<17} {expected:>9,}   held-out loss {loss:.3f}")
    params = list(gpt.parameters())
    matrices = [p for p in params if p.dim() >= 2]
    sum_mn = sum(len(p) + p[0].numel() for p in matrices)
    sum_v = sum(p.numel() for p in params if p.dim() < 2)
    psi = sum(p.numel() for p in params)
    print0(f"   Ψ = {psi:,}: {len(matrices)} matrices m×n, Σ(m+n) = {sum_mn:,}, and")
    print0(f"   {len(params) - len(matrices)} vectors, sent whole, Σv = {sum_v:,}")
    verdict = "no verdict on the loss; the main job's: docs/results.md"
    print0(f"   ({STEPS} steps: {verdict})")


def main(argv=None) -> None:
    """`--ranks N` ranks under torchrun (it relaunches itself), each running run_demo."""
    distributed.run_on_ranks(run_demo, argv, __file__, __doc__)


if __name__ == "__main__":
    main()
