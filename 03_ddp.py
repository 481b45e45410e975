"""03 · Data parallelism: every rank holds the whole model and its own slice of the batch.

The idea in one sentence: N replicas that start identical and apply identical updates stay
identical, and averaging gradients makes the update identical to one process on the whole batch.

The math. A global batch of N·B sequences is split into N rank batches of B. The loss is a mean
over tokens and every rank has B·T of them, so it is the mean of the per-rank means; the gradient
is linear:
    L = 1/N · Σ_r L_r     =>     ∇L = 1/N · Σ_r ∇L_r
All-reduce (SUM) the gradients, divide by N (gloo has no AVG), take the same optimizer step.

Who holds what (N = 2, P parameters):
    rank 0:  θ (all P) | rows 0..B-1   -> ∇L_0 ─┐ all-reduce SUM, / N:    ∇L on both ranks,
    rank 1:  θ (all P) | rows B..2B-1  -> ∇L_1 ─┘                          same AdamW step
  with ZeRO-1 the optimizer state (AdamW's m and v: 2 fp32 per parameter) is split instead:
    rank 0:  θ (all P) | ∇L (all P) | m, v for shard 0 -> updates shard 0 -> broadcasts it
    rank 1:  θ (all P) | ∇L (all P) | m, v for shard 1 -> updates shard 1 -> broadcasts it

The cost. A ring all-reduce of S bytes is a reduce-scatter then an all-gather, each N-1 hops of
S/N bytes, so every rank sends (and receives) 2(N-1)/N · S bytes, about 2S whatever N is:
    t ≈ 2(N-1)/N · S / bandwidth + 2(N-1) · latency          (per all-reduce call)
The latency term is paid per call: one call per gradient tensor pays it ~150 times for GPT-2,
so gradients are packed into buckets. Backward makes gradients last layer first, so a bucket
whose gradients are all done can be reduced while backward is still computing the earlier
layers: communication overlaps compute (PyTorch DDP, Li et al. 2020, arXiv 2006.15704).

Three versions, simple first, then the real thing:
    NaiveDataParallel   after backward, the training loop calls all_reduce_gradients(): one
                        blocking all-reduce per gradient tensor, in a plain loop
    DataParallel        flat buckets in backward order; a gradient hook starts a bucket's async
                        all-reduce the moment it is full; the end of backward waits for all
    ZeroOptimizer       ZeRO stage 1 (Rajbhandari et al. 2019, arXiv 1910.02054): optimizer
                        state for 1/N of the parameters per rank; step them; broadcast them

Launch:  python 03_ddp.py [--ranks N]                             (runs torchrun for you)
         torchrun --standalone --nproc_per_node=2 03_ddp.py      (or 4; CPU/gloo or GPUs/NCCL)
It checks naive, bucketed, bucketed + ZeRO-1 and PyTorch's own DistributedDataParallel against
one process, counts collectives and bytes against 2(N-1)/N · S, and prints the optimizer memory
per rank with and without ZeRO next to its formula. Step times, and how much communication the
buckets hide behind backward: bench/bench_ddp.py.

What changed from 02_model.py: nothing inside the GPT. Data parallelism wraps the model, hooks its
parameters' gradients and shards the optimizer; the data comes from 01_data.py's loader with
(dp_rank, dp_size), so ranks read disjoint windows.

Left out on purpose: DDP's find_unused_parameters (an unused parameter is an error here, not a
hang), gradient compression and bf16 communication hooks, bucket rebuilding from the observed
gradient order, ZeRO stages 2 and 3 (sharded gradients and parameters), and the reduce-scatter
form of ZeRO-1, which would make its traffic equal plain DP's (we all-reduce, then broadcast).
"""

import argparse
import contextlib
import importlib
import math
import os
import sys
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

data_lib = importlib.import_module("01_data")
model_lib = importlib.import_module("02_model")

SUM = dist.ReduceOp.SUM  # never AVG: gloo does not have it


def init_distributed(timeout_s: float = 300.0) -> tuple[int, int, int, torch.device]:
    """Join the torchrun job (env://) and return (rank, local_rank, world_size, device).

    nccl when CUDA is available, else gloo. The device is set *before* init so NCCL binds each
    rank to its own GPU. A finite timeout turns a hang (a rank that skipped a collective) into an
    error. Already initialised (as in the tests' spawned ranks): reuse the existing group.
    Launched without torchrun: a world of one, no process group.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        backend = "nccl" if device.type == "cuda" else "gloo"
        # device_id (NCCL): bind the communicators to this rank's GPU now, so no collective or
        # subgroup ever has to guess the device from the rank
        device_id = device if device.type == "cuda" else None
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), device_id=device_id)
    if dist.is_initialized():
        return dist.get_rank(), local_rank, dist.get_world_size(), device
    return 0, 0, 1, device


def print0(*args, **kwargs) -> None:
    """print on global rank 0 only (or always, when not distributed)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def _dp_group(group):
    assert dist.is_initialized(), "data parallelism needs a process group: launch with torchrun"
    return group if group is not None else dist.group.WORLD


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@torch.no_grad()
def broadcast_from_first_rank(module: nn.Module, group) -> None:
    """Make the replicas identical: every parameter (frozen too) and buffer, from group rank 0."""
    # subtle: broadcast's src is a *global* rank. In a DP subgroup of a 3D grid (ranks {1, 3}, say)
    # the group's first rank is not rank 0 of the world.
    src = dist.get_global_rank(group, 0)
    for t in [*module.parameters(), *module.buffers()]:
        dist.broadcast(t.detach(), src=src, group=group)


# ---------------------------------------------------------------------------------------------
# Simple first: after backward, all-reduce every gradient, one tensor at a time
# ---------------------------------------------------------------------------------------------
class NaiveDataParallel(nn.Module):
    """Broadcast the parameters once; after every backward the training loop calls
    all_reduce_gradients(). Nothing overlaps: communication starts when backward has ended,
    and the optimizer waits for the last tensor. Every trainable parameter needs a gradient.
    With 06's accumulate_gradients or 05's pipeline_step, call it once after they return.

    no_sync() is a no-op kept for loops written for DataParallel: this wrapper communicates
    only inside all_reduce_gradients(), so not calling it is the no-sync. group: as DataParallel.
    """

    def __init__(self, module: nn.Module, group=None):
        super().__init__()
        self.module, self.group = module, _dp_group(group)
        self.world = dist.get_world_size(self.group)
        broadcast_from_first_rank(module, self.group)
        self.params = [p for p in module.parameters() if p.requires_grad]  # tied: once
        self.stats = {"allreduce_calls": 0, "allreduce_bytes": 0, "syncs": 0}

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        yield

    def all_reduce_gradients(self) -> None:
        """Call between backward() and optimizer.step(): p.grad becomes the mean over ranks."""
        for p in self.params:
            if p.grad is None:  # else all_reduce fails with an unnamed TypeError
                name = next(n for n, q in self.module.named_parameters() if q is p)
                raise RuntimeError(f"{name} has no gradient: every trainable parameter needs one")
            dist.all_reduce(p.grad, op=SUM, group=self.group)  # blocking, one tensor per call
            p.grad.div_(self.world)  # SUM / N = the mean of the per-rank gradients
            self.stats["allreduce_calls"] += 1
            self.stats["allreduce_bytes"] += nbytes(p.grad)
        self.stats["syncs"] += 1


# ---------------------------------------------------------------------------------------------
# The real thing: flat buckets, all-reduced asynchronously while backward is still running
# ---------------------------------------------------------------------------------------------
@dataclass
class Bucket:
    params: list  # in backward order
    views: list  # views[i]: params[i]'s slice of buffer, shaped like params[i]
    buffer: torch.Tensor  # (sum of numels,) one dtype, one device
    ready: int = 0  # gradients copied in during this backward


def make_buckets(params, cap_bytes: float) -> list[Bucket]:
    """Pack params, last-registered first (≈ the order backward produces their gradients), into
    buckets of at most cap_bytes (a bigger parameter gets a bucket of its own)."""
    groups, size = [], 0
    for p in reversed(params):
        last = groups[-1][-1] if groups else None
        same_kind = last is not None and (last.dtype, last.device) == (p.dtype, p.device)
        if not same_kind or size + nbytes(p) > cap_bytes:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes(p)
    buckets = []
    for group in groups:
        first = group[0]
        buffer = torch.zeros(sum(p.numel() for p in group), dtype=first.dtype, device=first.device)
        pieces = buffer.split([p.numel() for p in group])
        buckets.append(Bucket(group, [v.view(p.shape) for v, p in zip(pieces, group)], buffer))
    return buckets


def _remove_hooks(handles) -> None:
    for handle in handles:
        handle.remove()


class DataParallel(nn.Module):
    """Bucketed and overlapped data parallelism (PyTorch DDP's design, arXiv 2006.15704).

    Unlike NaiveDataParallel, the training loop calls nothing. A gradient hook copies p.grad / N
    into its bucket's flat buffer; a full bucket's all-reduce (SUM) starts asynchronously while
    backward computes earlier layers. The first hook of a pass queues a callback that autograd
    runs when the pass ends (as torch DDP does): it waits for every bucket and hands each
    parameter its averaged gradient as a view into the bucket (DDP's gradient_as_bucket_view).
    A parameter without a gradient is an error that names it, not a hang of the other ranks.
    bucket_mb=None: no cap, one bucket per dtype and device (fewest calls, little overlap).
    group: the DP group (default: the world); in a 3D grid, the ranks that hold the same shard
    of the model (a pipeline stage, tensor-parallel shards: any module).

    Lifetime: the hooks hold the wrapper only weakly, and a freed wrapper removes them, so
    `model = DataParallel(model.module)` leaves one wrapper communicating, not two (as torch
    DDP, whose reducer removes its hooks when freed). close() removes them at once.
    """

    def __init__(self, module: nn.Module, bucket_mb: float | None = 25.0, group=None):
        ok = bucket_mb is None or (isinstance(bucket_mb, int | float) and bucket_mb > 0)
        assert ok, f"bucket_mb must be a positive number of MB or None (no cap), got {bucket_mb!r}"
        super().__init__()
        self.module, self.group = module, _dp_group(group)
        self.world = dist.get_world_size(self.group)
        broadcast_from_first_rank(module, self.group)
        self.names = {p: name for name, p in module.named_parameters()}  # a tied tensor: once
        self.params = [p for p in module.parameters() if p.requires_grad]  # frozen: skipped
        self.stats = {"allreduce_calls": 0, "allreduce_bytes": 0, "syncs": 0}
        self.buckets = make_buckets(
            self.params, math.inf if bucket_mb is None else bucket_mb * 2**20
        )
        self._where = {
            p: (b, i) for b, bk in enumerate(self.buckets) for i, p in enumerate(bk.params)
        }
        self._done = set()  # parameters copied into their bucket during this pass
        self._sync, self._queued = True, False
        # _works[b]: bucket b's all-reduce in this pass (buckets start in order). subtle: the
        # previous pass's are kept too. A collective launched inside backward copies a Python
        # object (autograd's contextvars.Context); if a gloo worker thread drops the last
        # reference to it while Python exits, it cannot take the GIL and the process aborts
        # ("terminate called without an active exception"; tests/ddp_exit_job.py). So they are
        # freed on our own thread a whole pass later, when the worker is long done (freed as
        # the next pass started, 7 of 240 amplified jobs still aborted; this, 0 of 210). They
        # hold only the buckets, which live anyway. The naive wrapper all-reduces after
        # backward: no Context, nothing to keep.
        self._works, self._previous_works = [], []
        this = weakref.ref(self)  # a bound method would keep the wrapper alive with the params

        def hook(p: torch.Tensor) -> None:
            if (wrapper := this()) is not None:
                wrapper._hook(p)

        handles = [p.register_post_accumulate_grad_hook(hook) for p in self.params]
        self._detach = weakref.finalize(self, _remove_hooks, handles)

    def close(self) -> None:
        """Stop synchronising: remove the gradient hooks now, not when the wrapper is freed."""
        self._detach()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes run inside skip communication; gradients just add up in p.grad.

        subtle: unlike torch DDP, whose no_sync() is decided by the *forward* pass, this one
        is decided when backward runs, which is what a pipeline schedule needs: it calls
        backward for m microbatches, only the last one outside no_sync().
        """
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _hook(self, p: torch.Tensor) -> None:
        if not self._sync:
            return
        if not self._queued:  # first gradient of this backward pass: finish when autograd does
            self._queued = True
            self._previous_works, self._works = self._works, []  # see __init__
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._copy_in(p)
        self._launch_full_buckets()

    def _copy_in(self, p: torch.Tensor) -> None:
        b, i = self._where[p]
        bucket = self.buckets[b]
        # divide while copying, as DDP does: it costs nothing extra, and a sum of N fp16
        # gradients cannot overflow. (For N = 2^k, x/N is exact: the same as SUM then divide.)
        # When p.grad already is the view (zero_grad(set_to_none=False)), this divides in place.
        torch.div(p.grad, self.world, out=bucket.views[i])
        bucket.ready += 1
        self._done.add(p)

    def _launch_full_buckets(self) -> None:
        # subtle: buckets start strictly in index order. Gradients may finish in a different
        # order on different ranks, but every rank must issue its collectives in the same order,
        # or rank 0's bucket 3 would be summed with rank 1's bucket 2.
        while len(self._works) < len(self.buckets):
            bucket = self.buckets[len(self._works)]
            if bucket.ready < len(bucket.params):
                return
            work = dist.all_reduce(bucket.buffer, op=SUM, group=self.group, async_op=True)
            self._works.append(work)
            self.stats["allreduce_calls"] += 1
            self.stats["allreduce_bytes"] += nbytes(bucket.buffer)

    def _finish_backward(self) -> None:
        self._queued = False
        # Parameters whose hook did not fire in this pass may hold a gradient from passes run
        # under no_sync(): reduce it. A parameter with no gradient at all is an error.
        late = [
            p for b in self.buckets[len(self._works) :] for p in b.params if p not in self._done
        ]
        if missing := [self.names[p] for p in late if p.grad is None]:
            self._wait_and_reset()  # leave none of our collectives half-done behind the error
            raise RuntimeError(
                f"DataParallel: no gradient in this backward for {', '.join(missing)}. Every "
                "rank all-reduces every trainable parameter, so the other ranks would wait "
                "forever: make it take part in the loss on every rank, or freeze it "
                "(requires_grad_(False)) before wrapping."
            )
        for p in late:
            self._copy_in(p)
        self._launch_full_buckets()
        assert len(self._works) == len(self.buckets), "every bucket must be launched by now"
        self._wait_and_reset(hand_back=True)
        self.stats["syncs"] += 1

    def _wait_and_reset(self, hand_back: bool = False) -> None:
        for work in self._works:
            work.wait()  # on GPU: makes the current stream wait, not the host
        for bucket in self.buckets:
            if hand_back:
                # subtle: p.grad now lives in the bucket, which the next synchronised backward
                # overwrites. Keep a gradient across steps? clone it.
                for p, view in zip(bucket.params, bucket.views):
                    p.grad = view
            bucket.ready = 0
        self._done.clear()


# ---------------------------------------------------------------------------------------------
# ZeRO stage 1: shard the optimizer state
# ---------------------------------------------------------------------------------------------
def partition_by_size(params, n: int) -> list[list[int]]:
    """Indices of params for each of n ranks, balanced by numel: biggest first, each to the
    least-loaded rank. Deterministic (ties by index), so every rank computes the same split."""
    shards, loads = [[] for _ in range(n)], [0] * n
    for i in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
        r = min(range(n), key=lambda r: (loads[r], r))
        shards[r].append(i)
        loads[r] += params[i].numel()
    return [sorted(s) for s in shards]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensors in an optimizer's state (AdamW: m, v and a step counter per parameter)."""
    state = optimizer.state.values()
    return sum(nbytes(t) for s in state for t in s.values() if torch.is_tensor(t))


class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 (arXiv 1910.02054): optimizer_cls's state lives on one rank per parameter.

    Every rank holds all parameters and all (already averaged) gradients. Rank r runs
    optimizer_cls only on its shard, 1/N of the parameters by size, so it keeps state only for
    those; then each rank broadcasts its updated shard. param_groups lists every parameter,
    so an LR scheduler (or `group["lr"] = ...`) works as with any optimizer. Every group must be
    given here: add_param_group afterwards is refused.
    """

    def __init__(self, params, optimizer_cls, group=None, **kwargs):
        super().__init__(params, kwargs)
        self.group = _dp_group(group)
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        flat = [p for g in self.param_groups for p in g["params"]]
        self.shards = [[flat[i] for i in s] for s in partition_by_size(flat, self.world)]
        mine = set(self.shards[self.rank])
        self.local = optimizer_cls(
            [{**g, "params": [p for p in g["params"] if p in mine]} for g in self.param_groups],
            **kwargs,
        )
        for g, local_g in zip(self.param_groups, self.local.param_groups):
            for k, v in local_g.items():  # optimizer_cls's defaults, visible to schedulers
                g.setdefault(k, v)
        self.state = self.local.state  # this rank's state only
        self.stats = {"broadcast_calls": 0, "broadcast_bytes": 0}

    def add_param_group(self, param_group: dict) -> None:
        # Refused once built: the split is decided once, from every parameter. A later group
        # would unbalance it, or re-split it and move state between ranks (as torch's
        # ZeroRedundancyOptimizer does). Optimizer.__init__ calls this for the groups given.
        if hasattr(self, "local"):
            raise NotImplementedError(
                "ZeroOptimizer.add_param_group after construction is not supported: pass every "
                "param group to ZeroOptimizer(...) (a group may start with lr=0)"
            )
        super().add_param_group(param_group)

    def shard_numels(self) -> list[int]:
        return [sum(p.numel() for p in shard) for shard in self.shards]

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "ZeroOptimizer.step does not take a closure"
        for g, local_g in zip(self.param_groups, self.local.param_groups):
            local_g.update({k: v for k, v in g.items() if k != "params"})  # e.g. a new lr
        self.local.step()  # only this rank's shard moves
        self._broadcast_shards()

    def _broadcast_shards(self) -> None:
        """Each rank sends its updated shard to all others: one flat broadcast per rank/dtype."""
        pending = []
        for r, shard in enumerate(self.shards):
            kinds = {}
            for p in shard:
                kinds.setdefault((p.dtype, p.device), []).append(p)
            for ps in kinds.values():
                if r == self.rank:
                    flat = torch.cat([p.reshape(-1) for p in ps])
                else:
                    flat = ps[0].new_empty(sum(p.numel() for p in ps))
                src = dist.get_global_rank(self.group, r)
                work = dist.broadcast(flat, src=src, group=self.group, async_op=True)
                pending.append((work, flat, ps, r))
                self.stats["broadcast_calls"] += 1
                self.stats["broadcast_bytes"] += nbytes(flat)
        for work, flat, ps, r in pending:
            work.wait()
            if r != self.rank:
                for p, piece in zip(ps, flat.split([p.numel() for p in ps])):
                    p.copy_(piece.view_as(p))

    def state_dict(self) -> dict:
        """This rank's shard of the state: a sharded checkpoint, each rank saves its own."""
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {
            "dp_rank": self.rank,
            "shard_numels": self.shard_numels(),
            "param_groups": hyper,
            "local": self.local.state_dict(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        expected = (self.rank, self.shard_numels())
        found = (state_dict["dp_rank"], state_dict["shard_numels"])
        assert found == expected, (
            f"this checkpoint shard is (dp_rank, shard sizes) = {found}, but this optimizer is "
            f"{expected}: load each rank's own shard, with the same model and DP size"
        )
        for g, saved in zip(self.param_groups, state_dict["param_groups"]):
            g.update(saved)
        self.local.load_state_dict(state_dict["local"])


# ---------------------------------------------------------------------------------------------
# The demo: equal to one process, collectives counted, memory per rank against the formula
# ---------------------------------------------------------------------------------------------
def train_step(model, opt, x, y) -> None:
    _, loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()  # DataParallel and torch DDP all-reduce in here, from gradient hooks
    if isinstance(model, NaiveDataParallel):
        model.all_reduce_gradients()  # the simple version: an explicit call after backward
    opt.step()


def make_variants(args, config, device) -> dict:
    """name -> (model, AdamW or ZeRO-1 AdamW), every one built from the same seed. The single
    process trains on every rank (each has all ranks' loaders), so no rank waits for it."""

    def fresh():
        torch.manual_seed(args.seed)
        return model_lib.GPT(config).to(device)

    ids, mb = ([device.index] if device.type == "cuda" else None), args.bucket_mb
    models = {
        "one process": fresh(),
        "naive": NaiveDataParallel(fresh()),
        "bucketed": DataParallel(fresh(), bucket_mb=mb),
        "bucketed + ZeRO-1": DataParallel(fresh(), bucket_mb=mb),
        "torch DDP": nn.parallel.DistributedDataParallel(fresh(), ids, bucket_cap_mb=mb),
    }
    AdamW, kw = torch.optim.AdamW, dict(lr=args.lr, weight_decay=0.1)
    opts = {n: AdamW(m.parameters(), **kw) for n, m in models.items()}
    opts["bucketed + ZeRO-1"] = ZeroOptimizer(models["bucketed + ZeRO-1"].parameters(), AdamW, **kw)
    return {n: (m, opts[n]) for n, m in models.items()}


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def check_equality(args, variants, loaders, rank) -> None:
    """Every variant, on every rank, against one process trained on the concatenated batch."""
    single = variants["one process"][0]
    single(*loaders[0].get_batch(0))[1].backward()  # for scale: rank 0's rows alone
    alone, grads = flat(p.grad for p in single.parameters()), {}
    for step in range(args.check_steps):
        xs, ys = zip(*(loader.get_batch(step) for loader in loaders))  # each (B, T)
        for name, (model, opt) in variants.items():
            whole = name == "one process"  # all N·B rows, or this rank's B
            x, y = (torch.cat(xs), torch.cat(ys)) if whole else (xs[rank], ys[rank])
            train_step(model, opt, x, y)
            if step == 0:  # averaged over the ranks by now; the optimizers do not touch .grad
                grads[name] = flat(p.grad for p in model.parameters())
    ref_grad, ref_params = grads.pop("one process"), flat(single.parameters())
    errors = torch.zeros(len(grads), 2, device=ref_grad.device)  # (variant, [grad, params])
    for i, name in enumerate(grads):
        errors[i, 0] = (grads[name] - ref_grad).abs().max()
        errors[i, 1] = (flat(variants[name][0].parameters()) - ref_params).abs().max()
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)  # the worst rank
    print0("\n1. naive == bucketed == torch DDP == one process on the global batch")
    steps = f"params after step {args.check_steps}"
    print0(f"   max |difference| on any rank   gradient, step 1   {steps}")
    for name, (grad_error, param_error) in zip(grads, errors.tolist()):
        print0(f"   {name:<30} {grad_error:16.1e} {param_error:21.1e}")
    scale = (alone - ref_grad).abs().max()
    print0(f"   For scale: the gradient of rank 0's rows alone is {scale:.1e} away. The rest is")
    print0("   fp32 rounding (sums in another order); AdamW's m/sqrt(v) magnifies it where g ~ 0.")


def report_counts(variants, world, steps) -> None:
    """The collectives and bytes the wrappers counted, against the ring formula."""
    params = variants["naive"][0].params
    S, ring = sum(nbytes(p) for p in params), 2 * (world - 1) / world  # sent per byte reduced
    print0(f"\n2. collectives per step; gradients S = {S / 1e6:.2f} MB in {len(params)} tensors")
    print0(
        f"   a ring all-reduce sends 2(N-1)/N·S = {ring * S / 1e6:.2f} MB per rank (N = {world})"
    )
    for name in ("naive", "bucketed"):
        stats = variants[name][0].stats
        calls, size = stats["allreduce_calls"] / steps, stats["allreduce_bytes"] / steps
        what = f"{'= S' if size == S else '!= S'}: {ring * size / 1e6:.2f} MB sent per rank"
        noun = "all-reduce " if calls == 1 else "all-reduces"
        print0(f"   {name:<9} {calls:4.0f} {noun} of {size / 1e6:.2f} MB in all ({what})")
    stats = variants["bucketed + ZeRO-1"][1].stats
    calls, size = stats["broadcast_calls"] / steps, stats["broadcast_bytes"] / steps
    print0(f"   ZeRO-1    {calls:4.0f} broadcasts  of {size / 1e6:.2f} MB, updated parameters")


def report_memory(variants, world) -> None:
    """AdamW state per rank, measured, next to 8 bytes per parameter + 4 per tensor."""
    zero, per_rank = variants["bucketed + ZeRO-1"][1], [None] * world
    dist.all_gather_object(per_rank, optimizer_state_bytes(zero))
    plain = optimizer_state_bytes(variants["bucketed"][1])

    def formula(params) -> int:  # m and v: 2 fp32 per element; the step: 1 fp32 per tensor
        return 8 * sum(p.numel() for p in params) + 4 * len(params)

    total = formula([p for shard in zero.shards for p in shard])
    print0("\n3. optimizer state per rank, measured | formula 8·P + 4·n (AdamW's m, v in fp32 and")
    print0("   a step per tensor; P parameters in n tensors: the model's, or the rank's shard's)")
    print0(f"   without ZeRO   {plain:,} B | {total:,} B on every rank")
    for r, (measured, shard) in enumerate(zip(per_rank, zero.shards)):
        print0(f"   ZeRO-1 rank {r:<2} {measured:,} B | {formula(shard):,} B")
    print0(f"   about 1/N each: total / N = {total / world:,.0f} B")


def run_demo(args, rank, local_rank, world, device) -> None:
    if local_rank == 0:  # one writer per machine; the others wait at the barrier
        data_lib.prepare("stdlib", "char", args.data_dir, block_size=args.block_size)
    dist.barrier()
    loader_args = (args.data_dir, "train", args.batch_size, args.block_size, args.seed)
    loaders = [data_lib.DataLoader(*loader_args, r, world, device) for r in range(world)]
    V = data_lib.CharTokenizer.n_vocab
    config = model_lib.GPTConfig.from_preset(args.preset, vocab_size=V, block_size=args.block_size)
    variants = make_variants(args, config, device)
    n_params, B = variants["naive"][0].module.num_params(), args.batch_size
    print0(
        f"\n03 · data parallelism on {world} ranks ({dist.get_backend()}, {device.type}): GPT "
        f"'{args.preset}', {n_params / 1e6:.2f}M params, T={args.block_size}, V={V};"
    )
    print0(f"   {B} sequences per rank, {B * world} per step, stdlib source text from 01_data.py")
    check_equality(args, variants, loaders, rank)
    report_counts(variants, world, args.check_steps)
    report_memory(variants, world)
    print0("\nStep times, and how much all-reduce the buckets hide: python bench/bench_ddp.py")


def relaunch_with_torchrun(ranks: int, argv, script: str) -> None:
    """`python script ARGS` is `torchrun --standalone --nproc_per_node=ranks script ARGS`."""
    from torch.distributed.run import main as torchrun

    args = ["--standalone", f"--nproc_per_node={ranks}", script, *argv]
    print(f"not started by torchrun, so running: torchrun {' '.join(args)}", flush=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default with several ranks
    torchrun(args)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    # subtle: --ranks, not --nproc, which torchrun would take for its own --nproc-per-node
    parser.add_argument("--ranks", type=int, default=2, help="ranks to start outside torchrun")
    parser.add_argument("--preset", default="small", help="02's GPT size; ~0.8M parameters")
    parser.add_argument("--block-size", type=int, default=64, help="T; 4 CPU ranks in a minute")
    parser.add_argument("--batch-size", type=int, default=4, help="B per rank; global is N·B")
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="cap; 25 = one bucket here")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--check-steps", type=int, default=3, help="AdamW steps compared")
    parser.add_argument("--seed", type=int, default=1337, help="model init and data order")
    parser.add_argument("--data-dir", default="data/stdlib-char", help="01's byte-level shards")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.bucket_mb <= 0 or args.check_steps < 1:
        parser.error("--ranks and --check-steps must be >= 1, --bucket-mb > 0")
    if "WORLD_SIZE" not in os.environ:
        return relaunch_with_torchrun(args.ranks, argv, __file__)
    rank, local_rank, world, device = init_distributed()
    try:
        run_demo(args, rank, local_rank, world, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
