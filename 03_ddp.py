"""03 · Data parallelism: every rank holds the whole model and its own rows of a batch.

The idea in one sentence: N replicas that start identical and take identical steps stay
identical, and averaging their gradients makes each step the step of one process that
saw the whole batch.

The math. A global batch of N·B sequences is split into N rank batches of B. The loss is
a mean over tokens and every rank has B·T of them, so it is the mean of the ranks'
means; the gradient is linear:
    L = 1/N · Σ_r L_r        =>        ∇L = 1/N · Σ_r ∇L_r
All-reduce (SUM) the gradients, divide by N (gloo has no AVG), take the same step. A
ring all-reduce of S bytes is a reduce-scatter then an all-gather, N-1 hops of S/N each:
    t ≈ 2(N-1)/N · S / bandwidth + 2(N-1) · latency    (per call; each rank sends ~2S)
The latency is paid per call, so gradients travel in buckets, each reduced while
backward (last layer first) still computes the earlier layers (DDP, arXiv 2006.15704):

    rank 0   [whole GPT]  rows 0..B-1     backward:  h3   h2   h1   h0   embeddings
                                          sends:          [b0] [b1]  [b2]  [b3]
    rank 1   [whole GPT]  rows B..2B-1    backward:  h3   h2   h1   h0   embeddings
                                          sends:          [b0] [b1]  [b2]  [b3]
    (each bucket is all-reduced, its mean on both ranks, as soon as it is full; each
    rank holds all Ψ weights, all Ψ gradients and all the optimizer state)

DataParallel hands each full bucket to one function that sends it, its communication
hook (comm_hook=, DDP's register_comm_hook); the default all-reduces the bucket's mean.
03b_compression.py writes hooks that send fewer bytes.

Launch:  python 03_ddp.py [--ranks N]                           (runs torchrun for you)
         torchrun --standalone --nproc_per_node=2 03_ddp.py    (or 4; gloo or NCCL)
It checks the naive and the bucketed wrapper against one process, and counts their
all-reduces and bytes against the ring formula. Timings against torch DDP:
bench/bench_ddp.py.

What changed from 02_model.py: nothing inside the GPT; rank r trains it on its own rows.
Simple first: NaiveDataParallel (an all-reduce per gradient after backward), then
DataParallel (buckets overlapped with backward, sent by a hook).

Left out on purpose: DDP's find_unused_parameters (an unused parameter is an error
here), bucket rebuilding, compressing what a bucket sends (03b_compression.py).
Sharding the weights, gradients and optimizer state instead of copying them is ZeRO, a
later lesson.
"""

import contextlib
import importlib

import torch
import torch.distributed as dist
import torch.nn as nn

from support import distributed
from support.ddp.gloo_exit import Collectives
from support.distributed import print0

model_lib = importlib.import_module("02_model")

SUM = dist.ReduceOp.SUM  # never AVG: gloo does not have it


def default_group(group):
    assert dist.is_initialized(), "data parallelism needs a process group: use torchrun"
    return group if group is not None else dist.group.WORLD


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def split_like(flat: torch.Tensor, tensors: list) -> list:
    """The pieces of flat, each shaped as the matching tensor."""
    pieces = flat.split([x.numel() for x in tensors])
    return [piece.view_as(x) for piece, x in zip(pieces, tensors)]


@torch.no_grad()
def broadcast_from_first_rank(module: nn.Module, group) -> None:
    """Make the replicas identical: every parameter (frozen too) and every buffer."""
    # subtle: src is a *global* rank; a DP subgroup ({1, 3} of a grid) starts at rank 1.
    src = dist.get_global_rank(group, 0)
    for t in [*module.parameters(), *module.buffers()]:
        dist.broadcast(t.detach(), src=src, group=group)


# ------------- simple first: after backward, all-reduce each gradient in turn
class NaiveDataParallel(nn.Module):
    """Broadcast the parameters once; the training loop calls all_reduce_gradients()
    after backward, once per optimizer step (after the last of several backward passes
    that add up their gradients). Nothing overlaps the communication."""

    # Not calling all_reduce_gradients() is the no-sync.
    no_sync = contextlib.nullcontext

    def __init__(self, module: nn.Module, group=None):
        nn.Module.__init__(self)  # not super(): DataParallel.__init__ runs this one too
        self.module = module
        self.group = default_group(group)
        self.world = dist.get_world_size(self.group)
        broadcast_from_first_rank(module, self.group)
        # A tied tensor appears once in parameters(); frozen ones take no part.
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.stats = {"allreduce_calls": 0, "allreduce_bytes": 0, "syncs": 0}

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def all_reduce_gradients(self) -> None:
        """Call between backward() and the step: p.grad becomes the ranks' mean."""
        for p in self.params:
            if p.grad is None:  # else all_reduce fails with an unnamed TypeError
                name = next(n for n, q in self.module.named_parameters() if q is p)
                raise RuntimeError(f"{name} has no gradient: every parameter needs one")
            dist.all_reduce(p.grad, op=SUM, group=self.group)  # one tensor per call
            p.grad.div_(self.world)  # SUM / N: the mean of the ranks' gradients
            self.stats["allreduce_calls"] += 1
            self.stats["allreduce_bytes"] += nbytes(p.grad)
        self.stats["syncs"] += 1


# ------------- the real thing: flat buckets, each sent by a hook while backward runs
class Bucket:
    """Parameters (in backward's order, one dtype and device) and one flat buffer for
    their gradients: what a communication hook is given (torch's GradBucket)."""

    def __init__(self, params: list, index: int, is_last: bool):
        self.params = params
        self.buffer = params[0].new_zeros(sum(p.numel() for p in params))  # (Σ numel,)
        # Each parameter's slice of the buffer, shaped as the parameter.
        self.views = split_like(self.buffer, params)
        self.index = index
        self.is_last = is_last  # the last bucket of a backward pass


def make_buckets(params, cap_mb: float | None) -> list[Bucket]:
    """Pack params, last registered first (about backward's order), in buckets of at
    most cap_mb (None: no cap)."""
    cap = float("inf") if cap_mb is None else cap_mb * 2**20
    groups = []
    for p in reversed(params):
        last = groups[-1] if groups else []
        same_kind = last and (last[-1].dtype, last[-1].device) == (p.dtype, p.device)
        if same_kind and sum(map(nbytes, last)) + nbytes(p) <= cap:
            last.append(p)
        else:
            groups.append([p])
    return [Bucket(g, i, i == len(groups) - 1) for i, g in enumerate(groups)]


class DataParallel(nn.Module):
    """Bucketed and overlapped, as PyTorch DDP. A gradient hook copies p.grad into its
    bucket; once a bucket is full, comm_hook(self, bucket) starts sending it while
    backward goes on (in bucket order on every rank). A callback at the end of backward
    waits for every bucket and sets each p.grad to a view of its bucket. comm_hook
    returns something with wait(), after which the bucket holds the ranks' mean (the
    default: all_reduce_hook, below, which calls self.all_reduce). A missing gradient is
    an error that names it, not a hang. The gradient hooks hold the wrapper weakly:
    `model = DataParallel(model.module)` leaves one wrapper; close() silences one still
    referenced."""

    forward = NaiveDataParallel.forward

    def __init__(self, module, bucket_mb=25.0, group=None, comm_hook=None):
        ok = bucket_mb is None or (isinstance(bucket_mb, int | float) and bucket_mb > 0)
        assert ok, (
            f"bucket_mb must be a positive number of MB or None, got {bucket_mb!r}"
        )
        NaiveDataParallel.__init__(self, module, group)  # module, group, world, params
        self.comm_hook = all_reduce_hook if comm_hook is None else comm_hook
        self.names = {p: name for name, p in module.named_parameters()}
        self.buckets = make_buckets(self.params, bucket_mb)
        self._where = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._done = set()  # the parameters copied into their bucket in this pass
        self._sync = True
        self._queued = False
        self._sent = []  # one handle per bucket launched in this pass
        # Every collective and hook goes through comm, for one workaround: gloo's worker
        # thread can hold the last reference to a finished collective, and freeing it at
        # interpreter exit aborted 1 in ~15 ZeRO-2 exits on torch 2.13.0 in our CI
        # (commits 898a44c, 58afab9; support/ddp/gloo_exit.py). comm keeps handles a while,
        # holds the hooks weakly (a dropped wrapper stops sending) and, once the wrapper
        # is freed, removes them and empties the buckets.
        buffers = [b.buffer for b in self.buckets]
        self.comm = Collectives(self, self.group, buffers, self.params)
        for p in self.params:
            self.comm.hook(p.register_post_accumulate_grad_hook, "_hook")

    def close(self) -> None:
        """Stop synchronising: remove the gradient hooks now, not when freed."""
        self.comm.close()

    @contextlib.contextmanager
    def no_sync(self):
        """Inside, backward only adds into p.grad and sends nothing. subtle: this is
        decided when backward runs (torch DDP decides it at forward), which a pipeline
        needs: its last backward of m runs outside no_sync() and sends the sum."""
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    def all_reduce(self, tensor: torch.Tensor):
        """Start a SUM all-reduce of tensor over the group and count it. The hooks
        below send with it, so that stats counts every byte they send."""
        work = self.comm.all_reduce(tensor)
        self.stats["allreduce_calls"] += 1
        self.stats["allreduce_bytes"] += nbytes(tensor)
        return work

    def _hook(self, p: torch.Tensor) -> None:
        if not self._sync:
            return
        # The first gradient of this pass: finish when autograd does.
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(
                self._finish_backward
            )
        self._copy_in(p)

    def _copy_in(self, p: torch.Tensor) -> None:
        bucket, i = self._where[p]
        bucket.views[i].copy_(p.grad)  # p.grad may be this view already: then a no-op
        self._done.add(p)
        # subtle: in index order, whatever order the gradients finish in, on every rank
        while len(self._sent) < len(self.buckets):
            bucket = self.buckets[len(self._sent)]
            if not self._done.issuperset(bucket.params):  # a gradient still to come
                return
            self._sent.append(self.comm_hook(self, bucket))

    def _finish_backward(self) -> None:
        self._queued = False
        # A parameter whose hook did not fire may hold a gradient from no_sync() passes.
        late = [p for p in self.params if p not in self._done]
        missing = [self.names[p] for p in late if p.grad is None]
        if not missing:
            for p in late:
                self._copy_in(p)
        # Wait for every bucket sent, even when a gradient is missing, so that no
        # collective is left half-done.
        for sent in self._sent:
            sent.wait()
        launched = len(self._sent)
        self._sent = []
        self._done.clear()
        if missing:
            raise RuntimeError(
                f"DataParallel: no gradient in this backward for {', '.join(missing)}: "
                "the other ranks would wait for it forever (use it in every loss, or "
                "requires_grad_(False))"
            )
        assert launched == len(self.buckets), "every bucket must be sent by now"
        # subtle: p.grad becomes a view of its bucket, which the next backward
        # overwrites, so clone a gradient to keep it.
        for p, (bucket, i) in self._where.items():
            p.grad = bucket.views[i]
        self.stats["syncs"] += 1


# ------------- the default communication hook (03b_compression.py has two that send less)
def all_reduce_hook(dp: DataParallel, bucket: Bucket):
    """The default hook: the bucket becomes the ranks' mean (divide, then SUM)."""
    # Divided first, as DDP: x / N is exact for N = 2^k, and the sum stays in range.
    bucket.buffer.div_(dp.world)
    return dp.all_reduce(bucket.buffer)


# ------------- the demo: both wrappers equal one process; all-reduces and bytes
PRESET = "small"  # 02's ~0.8M-parameter GPT on bytes
T = 64
B = 4  # rows per rank
STEPS = 3
SEED = 1337


def train_step(model, opt, x, y) -> torch.Tensor:
    _, loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()  # DataParallel and torch DDP communicate in here, from hooks
    if isinstance(model, NaiveDataParallel):
        model.all_reduce_gradients()  # the simple version: called after backward
    opt.step()
    return loss.detach()


def run_demo(args, rank: int, world: int, device) -> None:
    config = model_lib.GPTConfig.from_preset(PRESET, vocab_size=256, block_size=T)
    batches = model_lib.byte_batches(T, B * world, STEPS, SEED, device)  # (N·B, T) each
    mine = slice(rank * B, (rank + 1) * B)  # this rank's rows of the global batch
    names = ("one process", "naive", "bucketed")
    losses = []
    weights = []
    stats = {}
    for name in names:
        torch.manual_seed(SEED)  # the same GPT, alone (on every rank) or wrapped
        model = model_lib.GPT(config).to(device)
        if name == "naive":
            model = NaiveDataParallel(model)
        elif name == "bucketed":
            model = DataParallel(model, bucket_mb=1.0)  # 1 MB buckets: 4 for this GPT
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        rows = slice(None) if name == "one process" else mine  # all N·B rows, or B
        step_losses = [train_step(model, opt, x[rows], y[rows]) for x, y in batches]
        losses.append(sum(step_losses) / world)
        weights.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        stats[name] = getattr(model, "stats", None)
    losses = torch.stack(losses)
    errors = torch.stack([(w - weights[0]).abs().max() for w in weights])
    dist.all_reduce(losses, op=SUM)  # the mean of the ranks' losses: the batch's loss
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)  # the worst rank
    psi = len(weights[0])
    print0(
        f"\n03 · data parallelism on {world} ranks ({dist.get_backend()}), '{PRESET}'"
    )
    print0(f"\n1. both wrappers == one process after {STEPS} AdamW steps (|Δ| of the")
    print0("   steps' summed losses, max |Δ| of the weights)")
    print0(f"   {'':<9} {'Σ losses':>9} {'weights':>9}")
    for name, loss, error in list(zip(names, losses - losses[0], errors))[1:]:
        print0(f"   {name:<9} {abs(loss):9.1e} {error:9.1e}")
    print0("   fp32 rounding: sums in another order (AdamW magnifies it where g ~ 0)")
    print0(f"\n2. all-reduces per step, and bytes each rank sends (ring); Ψ = {psi:,}")
    ring = 2 * (world - 1) / world * 4 * psi
    for name in names[1:]:
        calls = stats[name]["allreduce_calls"] // STEPS
        size = stats[name]["allreduce_bytes"] // STEPS
        sent = 2 * (world - 1) / world * size
        print0(
            f"   {name:<9} {calls:3} calls, {size:,} bytes reduced, {sent:,.0f} sent"
        )
    print0(
        f"   formula   4Ψ = {4 * psi:,} bytes reduced, 2(N-1)/N · 4Ψ = {ring:,.0f} sent"
    )


def main(argv=None) -> None:
    """`--ranks N` ranks under torchrun (it relaunches itself), each running run_demo."""
    distributed.run_on_ranks(run_demo, argv, __file__, __doc__)


if __name__ == "__main__":
    main()
