"""03 · Data parallelism: every rank holds the whole model and its own slice of the batch.

The idea in one sentence: N replicas that start identical and apply identical updates stay
identical, and averaging gradients makes the update identical to one process on the whole batch.

The math. A global batch of N·B sequences is split into N rank batches of B. The loss is a mean
over tokens, and every rank has B·T of them, so it is the mean of the per-rank means; the
gradient is linear:     L = 1/N · Σ_r L_r     =>     ∇L = 1/N · Σ_r ∇L_r
All-reduce (SUM) the gradients, divide by N (gloo has no AVG), take the same optimizer step. A ring
all-reduce of S bytes is a reduce-scatter (RS: rank r ends with the sum of slice r of everyone's)
then an all-gather (AG: every rank gets every slice), each N-1 hops of S/N bytes:
    t ≈ 2(N-1)/N · S / bandwidth + 2(N-1) · latency          (per call; ~2S sent, whatever N)
The latency is per call, so gradients travel in buckets, each reduced while backward (last layer
first) computes the earlier layers (PyTorch DDP, Li et al. 2020, arXiv 2006.15704).

ZeRO (Rajbhandari et al. 2019, arXiv 1910.02054): in fp32 with AdamW a parameter costs 4 bytes of
weight, 4 of gradient and 8 of state (m, v): 16Ψ for Ψ of them, on every rank. Between the
reduce-scatter and the all-gather a rank needs only its slice of the mean gradient, so it need
keep and step only 1/N of the state. A unit (a block; or the root: the GPT itself, holding what no
block owns) is one flat 1-D buffer of its parameters, padded to N·S elements (S = ⌈numel/N⌉), and
rank r owns slice r (N = 2; [##  ]: rank 0's half). Sent: elements per rank and step.
              weights  grads    m, v     bytes per rank        sent      collectives
    DP (0)    [####]   [####]   [####]   16Ψ                  2(N-1)/N·Ψ  all-reduce (= RS + AG)
    ZeRO-1    [####]   [####]   [##  ]   8Ψ + 8Ψ/N            2(N-1)/N·Ψ  RS grads + AG weights
    ZeRO-2    [####]   [##  ]   [##  ]   4Ψ + 12Ψ/N           2(N-1)/N·Ψ  RS grads + AG weights
    ZeRO-3    [##  ]   [##  ]   [##  ]   16Ψ/N + gathered    ≤3(N-1)/N·Ψ  RS + AG fwd + AG bwd
ZeRO-1: at the step, reduce-scatter the gradients (rank r gets the mean of slice r), step slice r,
all-gather the weights. ZeRO-2: the reduce-scatters run from gradient hooks during backward, unit
by unit, each full gradient freed at once. ZeRO-3: weights too; a unit is all-gathered just before
its forward (the next one prefetched), freed, gathered again for its backward (not the root).

Gradient compression: DP sends ~2·4Ψ bytes per rank and step; across nodes on Ethernet that is
the step. fp16/bf16 (torch's fp16_compress_hook, op for op): cast each bucket, / N (the sum then
cannot overflow), all-reduce, cast back: half the bytes, gradients rounded to 11 or 8 bits.
PowerSGD (Vogels et al. 2019, arXiv 1905.13727) sends a rank-r sketch of each gradient matrix M
(m×n: p.grad as (len(p), the rest)); vectors go whole (a sketch of m×1 costs m + 1). M̄: the mean.
    M += e    P = orthonormal(all-reduce(M·orthonormal(Q))) (m×r)    Q = all-reduce(Mᵀ P)/N (n×r)
    update = P Qᵀ = P Pᵀ M̄ (rank r)     e = M - update (m×n)     sent: (m + n)·r, not m·n
One power-iteration step per training step: Q is warm-started (gradients drift slowly), and
orthonormal columns make P Pᵀ a projection. Error feedback (e, 4 bytes per weight more) keeps it
converging: what a sketch misses is sent later, not lost (the updates add up to the gradients
less one residual). The first steps, whose gradients change fastest, are exact.

Launch:  python 03_ddp.py [--ranks N]                             (runs torchrun for you)
         torchrun --standalone --nproc_per_node=2 03_ddp.py      (or 4; CPU/gloo or GPUs/NCCL)
It checks every variant against one process, prints bytes per rank for stages 0-3 next to the
formulas, and each compression's bytes and loss. Step times, traffic, torch DDP, FSDP2, GPT-2's
sizes: bench/bench_ddp.py; compression's loss and break-even bandwidth: bench/bench_compression.py.

What changed from 02_model.py: nothing inside the GPT; rank r trains it on its own rows (01's
loader). Simple first: NaiveDataParallel, then DataParallel (buckets overlap the backward);
ZeroOptimizer (ZeRO-1), then ZeroDataParallel (ZeRO-2/3); then DataParallel(compression=...).

Left out on purpose: DDP's find_unused_parameters (unused: an error here), bucket rebuilding,
PowerSGD in backward (it runs after) or under ZeRO, ZeRO's CPU/NVMe offload, ZeRO++, FSDP2's DTensor
shards and bf16 gathers (under autocast, ZeRO-3 keeps autocast's 16-bit weight copies to backward).
"""

import argparse
import contextlib
import importlib
import os
import sys
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from support import distributed
from support.distributed import init_distributed, print0, relaunch_with_torchrun

model_lib = importlib.import_module("02_model")

SUM = dist.ReduceOp.SUM  # never AVG: gloo does not have it
# DataParallel(compression=...), the third lesson below: fp16/bf16 send buckets in that dtype
COMPRESSION, HALF = ("none", "fp16", "bf16", "powersgd"), dict(fp16=torch.half, bf16=torch.bfloat16)
eager = torch.compiler.disable


def _dp_group(group):
    assert dist.is_initialized(), "data parallelism needs a process group: launch with torchrun"
    return group if group is not None else dist.group.WORLD


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def split_like(flat: torch.Tensor, tensors: list) -> list:  # flat's pieces, shaped as tensors
    return [t.view_as(x) for t, x in zip(flat.split([x.numel() for x in tensors]), tensors)]


@torch.no_grad()
def broadcast_from_first_rank(module: nn.Module, group) -> None:
    """Make the replicas identical: every parameter (frozen too) and buffer, from group rank 0."""
    # subtle: src is a *global* rank: a DP subgroup of a 3D grid ({1, 3}, say) starts at rank 1
    for t in [*module.parameters(), *module.buffers()]:
        dist.broadcast(t.detach(), src=dist.get_global_rank(group, 0), group=group)


# ------------------------------ simple first: after backward, all-reduce every gradient in turn
class NaiveDataParallel(nn.Module):
    """Broadcast the parameters once; the loop calls all_reduce_gradients() after backward (after
    06's accumulate_gradients or 05's pipeline_step: once). Nothing overlaps the communication."""

    no_sync = contextlib.nullcontext  # a no-op: not calling all_reduce_gradients() is the no-sync

    def __init__(self, module: nn.Module, group=None):
        nn.Module.__init__(self)  # not super(): DataParallel.__init__ runs this one too
        self.module, self.group = module, _dp_group(group)
        self.world = dist.get_world_size(self.group)
        broadcast_from_first_rank(module, self.group)
        self.params = [p for p in module.parameters() if p.requires_grad]  # tied: once; frozen: out
        self.stats = {"allreduce_calls": 0, "allreduce_bytes": 0, "syncs": 0}

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

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


# ----------------- the real thing: flat buckets, all-reduced asynchronously while backward runs
class Bucket:  # parameters (backward order, one dtype and device), their gradients' flat buffer
    def __init__(self, params: list):
        self.params, self.buffer = params, params[0].new_zeros(sum(p.numel() for p in params))
        self.views = split_like(self.buffer, params)  # buffer: (sum of numels,); p's slice, as p


def make_buckets(params, cap_mb: float | None) -> list[Bucket]:
    """Pack params, last-registered first (≈ backward's order), in buckets of ≤ cap_mb (None: ∞)."""
    cap, groups = float("inf") if cap_mb is None else cap_mb * 2**20, []
    for p in reversed(params):
        last = groups[-1] if groups else []
        same_kind = last and (last[-1].dtype, last[-1].device) == (p.dtype, p.device)
        if same_kind and sum(map(nbytes, last)) + nbytes(p) <= cap:
            last.append(p)
        else:
            groups.append([p])
    return [Bucket(group) for group in groups]


def weak_hook(owner, method: str, *bound):
    """Like `lambda *a: owner.method(*bound, *a)`, but does not keep owner alive (or calling)."""
    ref = weakref.ref(owner)
    return lambda *args: None if (o := ref()) is None else getattr(o, method)(*bound, *args)


class DataParallel(nn.Module):
    """Bucketed and overlapped, as PyTorch DDP: a gradient hook copies p.grad / N into its bucket,
    a full bucket's all-reduce starts while backward goes on, and a callback at its end waits, then
    sets each p.grad to a view of its bucket. A missing gradient: an error naming it, not a hang.
    The hooks hold the wrapper weakly: `model = DataParallel(model.module)` leaves one; close()."""

    forward = NaiveDataParallel.forward

    def __init__(self, module, bucket_mb=25.0, group=None, compression="none",
                 powersgd_rank=4, powersgd_warmup_steps=10):  # fmt: skip
        ok = bucket_mb is None or (isinstance(bucket_mb, int | float) and bucket_mb > 0)
        assert ok, f"bucket_mb must be a positive number of MB or None (no cap), got {bucket_mb!r}"
        assert compression in COMPRESSION, f"compression: one of {COMPRESSION}, got {compression!r}"
        NaiveDataParallel.__init__(self, module, group)  # module, group, world, params, stats
        self.names = {p: name for name, p in module.named_parameters()}  # a tied tensor: once
        self.buckets = make_buckets(self.params, bucket_mb)
        self._where = {p: (bk, i) for bk in self.buckets for i, p in enumerate(bk.params)}
        self._done, self._sync, self._queued = set(), True, False  # _done: copied in this pass
        # _works: (work, tensor, bucket) per all-reduce. subtle: kept a pass longer: launched in
        # backward, freed by gloo as Python exits, one aborts (tests/ddp_exit_job.py)
        self._works, self._previous_works, self.compression = [], [], compression
        args = self.params, powersgd_rank, powersgd_warmup_steps
        self.powersgd = PowerSGD(*args) if compression == "powersgd" else None
        hook = weak_hook(self, "_hook")
        handles = [p.register_post_accumulate_grad_hook(hook) for p in self.params]
        self._detach = [weakref.finalize(self, handle.remove) for handle in handles]

    def close(self) -> None:
        """Stop synchronising: remove the gradient hooks now, not when the wrapper is freed."""
        for detach in self._detach:
            detach()

    @contextlib.contextmanager
    def no_sync(self):
        """Inside, backward only adds up p.grad. subtle: decided when backward runs (torch DDP: at
        forward), as a pipeline needs: m backward passes, the last one outside no_sync()."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _hook(self, p: torch.Tensor) -> None:
        if not self._sync:
            return
        if not self._queued:  # first gradient of this backward pass: finish when autograd does
            self._queued, self._previous_works, self._works = True, self._works, []  # see __init__
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._copy_in(p)

    def _copy_in(self, p: torch.Tensor) -> None:  # then start the buckets now full
        bucket, i = self._where[p]
        # divide while copying, as DDP: free, and x/N is exact for N = 2^k (compressed: copied
        # whole, / N later, as torch's hooks). p.grad already the view (set_to_none=False): in place
        torch.div(p.grad, self.world if self._mode == "none" else 1, out=bucket.views[i])
        self._done.add(p)
        self._launch_full_buckets()

    @property
    def _mode(self) -> str:  # the compression now: PowerSGD's warm-up steps are "none" (exact)
        return "none" if self.powersgd and not self.powersgd.active else self.compression

    def _launch_full_buckets(self) -> None:
        # subtle: in index order, whatever order gradients finish in (or buckets 2 and 3 mix)
        while len(self._works) < len(self.buckets) and self._mode != "powersgd":
            bucket = self.buckets[len(self._works)]
            if not self._done.issuperset(bucket.params):  # a gradient still to come
                return
            sent = bucket.buffer  # "none": divided by N while copied in; fp16_compress_hook's
            sent = sent if self._mode == "none" else sent.to(HALF[self._mode]).div_(self.world)
            self._all_reduce(sent, bucket)  # order: cast, then / N

    def _all_reduce(self, tensor: torch.Tensor, bucket=None):  # started, counted, kept (__init__)
        work = dist.all_reduce(tensor, op=SUM, group=self.group, async_op=True)
        self._works.append((work, tensor, bucket))
        self.stats["allreduce_calls"] += 1
        self.stats["allreduce_bytes"] += nbytes(tensor)
        return work

    def _finish_backward(self) -> None:
        self._queued = False
        # a parameter whose hook did not fire may hold a gradient from no_sync() passes: reduce it
        late = [p for p in self.params if p not in self._done]
        if not (missing := [self.names[p] for p in late if p.grad is None]):
            for p in late:
                self._copy_in(p)
        for work, sent, bucket in self._works:  # (a missing gradient: none left half-done)
            work.wait()  # on GPU: makes the current stream wait, not the host
            if sent is not bucket.buffer:  # fp16/bf16: back into the gradients; then freed, as
                bucket.buffer.copy_(sent)  # the handle, kept, holds it
                sent.untyped_storage().resize_(0)
        self._done.clear()
        if missing:
            raise RuntimeError(
                f"DataParallel: no gradient in this backward for {', '.join(missing)}: the other "
                "ranks would wait for it forever (use it in every loss, or requires_grad_(False))"
            )
        if self._mode == "powersgd":  # every bucket full, none sent: sketch them
            self.powersgd.reduce({p: bk.views[i] for p, (bk, i) in self._where.items()}, self)
        else:
            assert len(self._works) == len(self.buckets), "every bucket must be launched by now"
        for p, (bucket, i) in self._where.items():  # subtle: the next synced backward
            p.grad = bucket.views[i]  # overwrites this view: clone a gradient to keep it
        self.stats["syncs"] += 1
        if self.powersgd:
            self.powersgd.steps += 1  # synced passes: its warm-up counts these


# -------------- ZeRO: shard what every rank holds N times (Rajbhandari et al. 2019, 1910.02054)
class FlatParameter:
    """Parameters (one unit, param group, dtype) as views into one flat buffer `full`, padded to
    N·S. Rank r steps `shard` = full[r·S:(r+1)·S]: a view (ZeRO-1/2) or its own (3: full freed)."""

    def __init__(self, params: list, unit, rank: int, world: int, shard_params: bool):
        self.params, self.unit, self.numels = params, unit, [p.numel() for p in params]
        self.offset = {p: sum(self.numels[:i]) for i, p in enumerate(params)}  # by identity
        self.S = (sum(self.numels) + world - 1) // world  # ceil(numel / N)
        self.full = params[0].new_zeros(world * self.S)  # (N·S,)
        for p, o in self.offset.items():
            self.full[o : o + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.full[o : o + p.numel()].view_as(p)  # p keeps identity and autograd state
        self.lo = rank * self.S  # this rank's slice: [lo, lo + S)
        mine = self.full[self.lo : self.lo + self.S]  # (S,)
        self.shard = nn.Parameter(mine.clone() if shard_params else mine)
        self.grad, self.ready, self.work, self.gathered = None, 0, None, True  # grad: (N·S,)
        if shard_params:
            self.free()

    def free(self) -> None:  # ZeRO-3 (a prefetch still in flight: waited for): the views stay,
        if self.work is not None:
            self.work.wait()
        self.full.untyped_storage().resize_(0)  # their memory goes (FSDP's trick); what autograd
        self.work, self.gathered = None, False  # saved of them sees the next gather

    def take_grad(self, p) -> None:  # p.grad moves in, adding (no_sync passes accumulate here)
        if self.grad is None:
            self.grad = self.full.new_zeros(self.full.shape)  # the padding stays 0
        self.grad.narrow(0, self.offset[p], p.numel()).add_(p.grad.reshape(-1))
        p.grad = None
        self.ready += 1


class ZeroOptimizer(torch.optim.Optimizer):
    """optimizer_cls stepping this rank's shard of every FlatParameter: 1/N of the state. A flat per
    param group (its weight decay, LR schedule) and unit (a module, less earlier units). Alone it is
    ZeRO-1: step() reduce-scatters the gradients backward left, steps, all-gathers the weights."""

    def __init__(self, params, optimizer_cls, group=None, *, units=None, stage=1, **kwargs):
        super().__init__(params, kwargs)
        self.group, self.stage = _dp_group(group), stage
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.backend = dist.get_backend(self.group)  # "gloo": see _reduce_scatter
        groups = [[p for p in g["params"] if p.requires_grad] for g in self.param_groups]
        members = [set(u.parameters()) for u in units] if units else [set(sum(groups, []))]
        self.flats, shards, taken = [], [[] for _ in groups], set()
        for unit, unit_params in zip(units or [None], members):
            for i, ps in enumerate(groups):
                kinds = {}  # a flat buffer holds one dtype on one device
                for p in (p for p in ps if p in unit_params and p not in taken):
                    kinds.setdefault((p.dtype, p.device), []).append(p)
                    taken.add(p)
                for kind in kinds.values():
                    self.flats.append(FlatParameter(kind, unit, self.rank, self.world, stage == 3))
                    shards[i].append(self.flats[-1].shard)
        assert len(taken) == sum(map(len, groups)), "every parameter must be in one of the units"
        shard_groups = [{**g, "params": s} for g, s in zip(self.param_groups, shards)]
        self.local = optimizer_cls(shard_groups, **kwargs)
        for g, local_g in zip(self.param_groups, self.local.param_groups):
            g.update({**local_g, **g})  # optimizer_cls's defaults, visible to schedulers
        self.state = self.local.state  # this rank's shards' state only
        self.stats = {"reduce_scatter_calls": 0, "reduce_scatter_bytes": 0}
        self.stats.update(all_gather_calls=0, all_gather_bytes=0)
        self._reduced, self._works, self._old_works = False, [], []
        numels = [f.numels for f in self.flats]  # what a checkpoint's shards must fit:
        self._layout = dict(stage=stage, dp_rank=self.rank, dp_size=self.world, flats=numels)

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "local"):  # the buffers are cut once (a group may start at lr=0 instead)
            raise NotImplementedError("add_param_group: give every group to ZeroOptimizer(...)")
        super().add_param_group(param_group)

    def _all_gather(self, flat: FlatParameter):
        """Start gathering the shards into flat.full (ZeRO-3: its memory first; else in place)."""
        full, shard = flat.full, flat.shard.detach()
        full.untyped_storage().resize_(nbytes(full))
        work = distributed.all_gather_tensor(full, shard, group=self.group, async_op=True)
        self.stats["all_gather_calls"] += 1
        self.stats["all_gather_bytes"] += nbytes(full)  # each rank sends (N-1)/N of it
        self._works.append(work)  # kept (see _reduce_scatter): ZeRO-3 gathers in backward too
        return work

    def _reduce_scatter(self, flat: FlatParameter) -> tuple:  # SUM every rank's slice r onto r
        for p in (p for p in flat.params if p.grad is not None):
            flat.take_grad(p)  # ZeRO-1: still in p.grad; ZeRO-2/3: the hooks moved them
        if flat.grad is None:  # no gradient here: zeros, as every rank must take part
            flat.grad = flat.full.new_zeros(flat.full.shape)
        # gloo's reduce-scatter is an all-reduce of a copy, which its handle would keep (below)
        kw = dict(op=SUM, group=self.group, async_op=True)
        if self.backend == "gloo":  # so all-reduce in place, take slice r: same bytes, same sums
            work, out = dist.all_reduce(flat.grad, **kw), flat.grad[flat.lo : flat.lo + flat.S]
        else:
            out = flat.grad.new_empty(flat.S)  # (S,)
            work = distributed.reduce_scatter_tensor(out, flat.grad, **kw)
        self.stats["reduce_scatter_calls"] += 1
        self.stats["reduce_scatter_bytes"] += nbytes(flat.grad)
        # subtle: the handle, launched in backward (ZeRO-2/3), is kept to the zero_grad() after next
        # (see DataParallel._works; dropped once waited, 1 of 15 ZeRO-2 jobs aborted at exit in CI)
        self._works.append(work)  # (_finish empties the tensors it holds: it keeps no memory)
        return work, flat, out

    def _finish(self, pending: list) -> None:
        for work, flat, out in pending:
            work.wait()
            flat.shard.grad = out.div(self.world)  # SUM / N: the mean of the ranks' gradients
            for t in (out, flat.grad):  # freed now (the kept handle refers to them), even if
                t.untyped_storage().resize_(0)  # NCCL still does: the allocator orders it
            flat.grad = None

    def reduce_gradients(self) -> None:
        """ZeRO-1: reduce-scatter the gradients in flat order, once per zero_grad() (2/3: hooks)."""
        if self.stage == 1 and not self._reduced:
            self._finish([self._reduce_scatter(f) for f in self.flats])
            self._reduced = True

    def grad_pieces(self) -> list:
        """(p, offset, piece) per p overlapping this rank's [lo, lo + S): piece is a view of
        f.shard.grad, the mean gradient of p.view(-1)[offset : offset + len(piece)] (norm: all
        ranks' squares; clip: scale in place). ZeRO-1 reduces first: every rank must call it."""
        self.reduce_gradients()
        pieces = []
        for f in (f for f in self.flats if f.shard.grad is not None):
            for p, o in f.offset.items():
                a, b = max(o, f.lo), min(o + p.numel(), f.lo + f.S)  # p ∩ [lo, lo + S)
                if a < b:
                    pieces.append((p, a - o, f.shard.grad[a - f.lo : b - f.lo]))
        return pieces

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "ZeroOptimizer.step does not take a closure"
        self.reduce_gradients()
        for g, local_g in zip(self.param_groups, self.local.param_groups):
            local_g.update({k: v for k, v in g.items() if k != "params"})  # e.g. a new lr
        self.local.step()  # only this rank's shards move
        self._gather_all()

    def _gather_all(self) -> None:  # ZeRO-1/2 (ZeRO-3 gathers a unit when a forward needs it)
        for work in [self._all_gather(f) for f in self.flats] if self.stage < 3 else []:
            work.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=True)  # the gradients live in the shards: freed
        self._reduced = False  # subtle: here, not in step(), which a loss scaler may skip
        self._old_works, self._works = self._works, []  # the handles: dropped a step later
        for f in self.flats:
            f.grad = f.shard.grad = None

    def state_dict(self) -> dict:
        """A sharded checkpoint: this rank's shards of the state and of the weights."""
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        shards, local = [f.shard.detach().clone() for f in self.flats], self.local.state_dict()
        return {"layout": {**self._layout}, "param_groups": hyper, "shards": shards, "local": local}

    def load_state_dict(self, state_dict: dict) -> None:
        """Shard, state and weights (ZeRO-1/2 then all-gather the weights: every rank calls it)."""
        saved, here = state_dict.get("layout") or {}, self._layout
        if diff := [k for k, v in here.items() if saved.get(k) != v]:  # its shards would not fit
            pairs = [f"{k} {saved.get(k)!s:.24}, here {here[k]!s:.24}" for k in diff]
            raise ValueError(f"this ZeroOptimizer shard was saved with {'; '.join(pairs)}")
        for f, shard in zip(self.flats, state_dict["shards"]):
            f.shard.data.copy_(shard)
        for g, saved in zip(self.param_groups, state_dict["param_groups"]):
            g.update(saved)
        self.local.load_state_dict(state_dict["local"])
        self._gather_all()


def zero_units(module: nn.Module) -> list:
    """FSDP's units of a GPT (or 05's PipelineChunk): the blocks, last first, then the root."""
    h = getattr(getattr(module, "transformer", None), "h", [])
    return [*reversed(list(h.values() if isinstance(h, nn.ModuleDict) else h)), module]


class ZeroDataParallel(nn.Module):
    """ZeRO-1, 2 or 3 (optimizer.stage) around a module optimizer has flattened, with the hooks of
    ZeRO-2 and 3 (see the top); the root's weights stay gathered until the end of backward (as
    FSDP2's). A missing gradient counts as zero: every rank must use the same parameters, as every
    rank reduces every flat in one order. no_sync(): whole gradients (4Ψ) until the synced pass."""

    forward, no_sync = DataParallel.forward, DataParallel.no_sync

    def __init__(self, module: nn.Module, optimizer: ZeroOptimizer):
        super().__init__()
        self.module, self.opt, self.stage = module, optimizer, optimizer.stage
        units, self.stats = zero_units(module), optimizer.stats
        self.flats = [f for f in optimizer.flats if any(f.unit is u for u in units)]
        # pipeline chunks, one optimizer, a wrapper each: ZeRO-3 re-gathers all units per microbatch
        if self.stage == 3 and len(self.flats) < len(optimizer.flats):
            raise ValueError("ZeRO-3 with several pipeline chunks per rank is refused: use ZeRO-2")
        self._unit_flats = {u: [f for f in self.flats if f.unit is u] for u in units}
        self._sync, self._in_backward, self._next, self._pending = True, False, 0, []
        for f in self.flats if self.stage >= 2 else []:
            for p in f.params:
                p.register_post_accumulate_grad_hook(weak_hook(self, "_grad_hook", f))
        fwd_order = [module, *units[-2::-1]]  # units [h3, h2, h1, h0, root] -> root, h0 .. h3
        bwd_order = [module, *units[:-1]]  # root (its head first), h3 .. h0
        self._after = dict(zip(fwd_order, [*fwd_order[1:], None]))  # the unit to prefetch
        self._before = dict(zip(bwd_order, [*bwd_order[1:], None]))
        for u in units if self.stage == 3 else []:  # eager: torch.compile can't trace resize_()
            u.register_forward_pre_hook(eager(weak_hook(self, "_gather", u, self._after[u])))
            u.register_forward_hook(eager(weak_hook(self, "_post_forward", u)))

    @contextlib.contextmanager
    def gathered(self):
        """Full weights in self.module inside (export, evaluation): every rank must enter it."""
        units = [u for u, fs in self._unit_flats.items() if not all(f.gathered for f in fs)]
        for u in units:
            self._gather(u)
        try:
            yield self.module
        finally:
            for u in units:
                self._free(u)

    def _gather(self, unit, prefetch=None, *_) -> None:
        for u in (unit, prefetch):  # this unit now, the next one's all-gather in the background
            for f in self._unit_flats.get(u, []):
                if not f.gathered and f.work is None:
                    f.work = self.opt._all_gather(f)
        for f in self._unit_flats[unit]:
            if f.work is not None:
                f.work.wait()
            f.work, f.gathered = None, True

    def _free(self, unit) -> None:
        for f in self._unit_flats[unit]:
            f.free()

    def _post_forward(self, unit, module, args, output) -> None:
        grad = torch.is_grad_enabled()
        for t in output if isinstance(output, tuple) else (output,):
            if grad and torch.is_tensor(t) and t.requires_grad:  # fires just before its backward
                t.register_hook(lambda _, u=unit: self._start_backward(u))
        if not self._in_backward and (unit is not self.module or not grad):
            self._free(unit)  # (in backward it is activation recomputation: backward frees it)

    def _start_backward(self, unit=None) -> None:
        if not self._in_backward:  # the first hook of this backward pass
            self._in_backward, self._next = True, 0
            for f in self.flats:
                f.ready = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if unit is not None:  # ZeRO-3, from a hook on the unit's output: its backward is next
            self._gather(unit, prefetch=self._before[unit])

    def _grad_hook(self, flat: FlatParameter, p: torch.Tensor) -> None:
        self._start_backward()
        flat.take_grad(p)  # the full per-parameter gradient is freed
        if self.stage == 3 and flat.unit is not self.module:
            if all(f.ready == len(f.params) for f in self._unit_flats[flat.unit]):
                self._free(flat.unit)  # its backward is over
        self._launch()

    def _launch(self, everything: bool = False) -> None:  # (no_sync(): nothing)
        # subtle: flat order, not hook order: the same collectives in one order on every rank (NCCL)
        while self._sync and self._next < len(self.flats):
            flat = self.flats[self._next]
            if not everything and flat.ready < len(flat.params):
                return
            self.opt._finish(self._pending)  # one in flight: the previous full gradient is freed
            self._pending = [self.opt._reduce_scatter(flat)]
            self._next += 1

    def _end_backward(self) -> None:
        self._in_backward = False
        self._launch(everything=True)  # the rest (no_sync(): none, and none pending)
        self.opt._finish(self._pending)
        self._pending = []
        for u in self._unit_flats if self.stage == 3 else []:
            self._free(u)


def zero_data_parallel(
    module, stage: int, param_groups, optimizer_cls, group=None, bucket_mb=25.0, **kwargs
):
    """The one place that chooses the stage: (model, optimizer); stage 0: DataParallel, no ZeRO."""
    assert stage in (0, 1, 2, 3), f"the ZeRO stage must be 0, 1, 2 or 3, got {stage!r}"
    if stage == 0:
        return DataParallel(module, bucket_mb, group), optimizer_cls(param_groups, **kwargs)
    broadcast_from_first_rank(module, _dp_group(group))  # identical, then cut into shards
    units = zero_units(module)
    opt = ZeroOptimizer(param_groups, optimizer_cls, group, units=units, stage=stage, **kwargs)
    return ZeroDataParallel(module, opt), opt


def memory_per_rank(module: nn.Module, optimizer) -> dict:
    """Bytes held now, by kind: distinct storages (a view counts with its buffer; freed: 0)."""
    flats = getattr(optimizer, "flats", [])
    params = [*module.parameters(), *(f.shard for f in flats)]
    grads = [g for g in [p.grad for p in params] + [f.grad for f in flats] if g is not None]
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    sizes = {}  # each storage once
    for kind, ts in {"params": params, "grads": grads, "optimizer": state}.items():
        sizes[kind] = sum({(s := t.untyped_storage()).data_ptr(): s.nbytes() for t in ts}.values())
    return sizes


def zero_memory_formula(stage: int, psi: float, world: int) -> float:
    """Bytes per rank, Ψ fp32 parameters, AdamW: 4Ψ weights + 4Ψ grads + 8Ψ (m, v), sharded / N."""
    N = world
    return [16 * psi, 8 * psi + 8 * psi / N, 4 * psi + 12 * psi / N, 16 * psi / N][stage]


# ------------ gradient compression: fewer bytes in DataParallel's all-reduce (the third lesson)
def orthonormal(a: torch.Tensor) -> torch.Tensor:  # (k, r), r <= k: a basis of its columns' span
    return torch.linalg.qr(a).Q  # (Householder: a zero column still gives a unit vector)


class PowerSGD:
    """Rank-r PowerSGD with error feedback (see the top), run by DataParallel after backward
    once warmup_steps synced passes have all-reduced exactly (torch's start_powerSGD_iter)."""

    def __init__(self, params: list, rank: int = 4, warmup_steps: int = 10, seed: int = 0):
        assert rank >= 1 and warmup_steps >= 0, f"rank {rank} < 1 or warmup {warmup_steps} < 0"
        self.rank, self.warmup_steps, self.seed, self.steps = rank, warmup_steps, seed, 0
        self.matrices = [p for p in params if p.dim() >= 2]  # sketched, as (len(p), the rest)
        self.vectors = [p for p in params if p.dim() < 2]  # biases, LayerNorm: sent whole
        self.errors = [torch.zeros_like(p).view(len(p), -1) for p in self.matrices]  # e (m, n)
        self.qs = []  # Q (n, r) per matrix, drawn at the first sketch, then warm-started

    active = property(lambda self: self.steps >= self.warmup_steps)  # sketching, not exact

    def reduce(self, grads: dict, dp: DataParallel) -> None:
        """grads[p]: this rank's own gradient (not yet / N), replaced by the sketch of the mean."""
        Ms = [grads[p].view(len(p), -1) for p in self.matrices]  # (m, n) each
        if not self.qs:  # the first sketch: the same random Q on every rank (the seed's)
            g = torch.Generator().manual_seed(self.seed)
            self.qs = [torch.randn(M.shape[1], min(self.rank, *M.shape), generator=g) for M in Ms]
            self.qs = [q.to(M) for q, M in zip(self.qs, Ms)]
        for M, e in zip(Ms, self.errors):
            M.add_(e)  # error feedback: what the last sketch missed
        ps = [M @ orthonormal(q) for M, q in zip(Ms, self.qs)]  # (m, r) each
        vectors = [grads[p] for p in self.vectors]  # sent whole, with the Ps
        dp._all_reduce(flat := torch.cat([t.reshape(-1) for t in ps + vectors])).wait()
        sums = split_like(flat, ps + vectors)  # Σ_ranks M Q, (m, r) each, and the vectors' sums
        ps = [orthonormal(p) for p in sums[: len(ps)]]  # (no / N: it is orthonormalised)
        qs = [M.T @ p for M, p in zip(Ms, ps)]  # (n, r) each
        dp._all_reduce(flat := torch.cat([q.reshape(-1) for q in qs])).wait()
        self.qs = split_like(flat.div_(dp.world), qs)  # Mᵀ P of the ranks' mean M: warm start
        for M, p, q, e in zip(Ms, ps, self.qs, self.errors):
            e.copy_(M)
            torch.matmul(p, q.T, out=M)  # the update P Qᵀ = P Pᵀ M̄, of rank <= r
            e.sub_(M)  # the residual: what this rank had, less what is applied
        for v, total in zip(vectors, sums[len(ps) :]):
            v.copy_(total).div_(dp.world)

    def state_dict(self) -> dict:  # training state: a resume must continue it (torch.save copies)
        return {"steps": self.steps, "qs": self.qs, "errors": self.errors}

    def load_state_dict(self, state: dict) -> None:
        to = lambda ts: [t.to(p.device) for t, p in zip(ts, self.matrices, strict=True)]  # noqa
        self.steps, self.qs, self.errors = state["steps"], to(state["qs"]), to(state["errors"])


# ------------------------ the demo: every variant equals one process; bytes per rank vs formula
PRESET, T, B, STEPS, SEED = "small", 64, 4, 3, 1337  # 02's ~0.8M GPT on bytes; B rows per rank
# Freed on return, a wrapper drops handles of its last backward that a gloo thread may free at
# exit, aborting (tests/ddp_exit_job.py; 1 in 6 demo runs in CI): kept, as a script's model.
WRAPPERS = []
FORMULAS = {"DP": "16Ψ", "ZeRO-1": "8Ψ + 8Ψ/N", "ZeRO-2": "4Ψ + 12Ψ/N", "ZeRO-3": "16Ψ/N"}


def train_step(model, opt, x, y) -> torch.Tensor:
    _, loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()  # DataParallel, torch DDP and ZeRO-2/3 communicate in here, from hooks
    if isinstance(model, NaiveDataParallel):
        model.all_reduce_gradients()  # the simple version: an explicit call after backward
    opt.step()  # ZeRO-1 reduce-scatters in here; ZeRO-1/2 all-gather the weights
    return loss.detach()


def run_demo(rank: int, world: int, device) -> None:
    config = model_lib.GPTConfig.from_preset(PRESET, vocab_size=256, block_size=T)
    batches = model_lib.byte_batches(T, B * world, STEPS, SEED, device)  # each (N·B, T)
    mine = slice(rank * B, (rank + 1) * B)  # this rank's rows of the global batch
    AdamW, kw = torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1)
    names, losses, weights, memory = ("one process", "naive", *FORMULAS), [], [], {}
    for name in names:
        torch.manual_seed(SEED)  # the same GPT, alone (on every rank) or wrapped
        m = model_lib.GPT(config).to(device)
        if name in FORMULAS:  # stage 0: DataParallel, 1 MB buckets (4 for this GPT)
            stage = 0 if name == "DP" else int(name[-1])
            model, opt = zero_data_parallel(m, stage, m.parameters(), AdamW, bucket_mb=1.0, **kw)
        else:
            model, opt = NaiveDataParallel(m) if name == "naive" else m, AdamW(m.parameters(), **kw)
        rows = slice(None) if name == "one process" else mine  # all N·B rows, or its B
        losses.append(sum(train_step(model, opt, x[rows], y[rows]) for x, y in batches) / world)
        with model.gathered() if isinstance(model, ZeroDataParallel) else contextlib.nullcontext():
            weights.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        if name in FORMULAS:  # one more backward: the bytes held then, as before a step
            opt.zero_grad(set_to_none=True)
            model(*(t[mine] for t in batches[-1]))[1].backward()
            memory[name] = memory_per_rank(model.module, opt)
        WRAPPERS.append((model, opt))  # subtle: alive to the exit, as a script's model (below)
    losses, psi = torch.stack(losses), len(weights[0])  # weights: (Ψ,) each
    errors = torch.stack([(w - weights[0]).abs().max() for w in weights])
    dist.all_reduce(losses, op=SUM)  # the mean of the ranks' losses: the global batch's loss
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)  # the worst rank
    print0(f"\n03 · data parallelism on {world} ranks ({dist.get_backend()}), GPT '{PRESET}'")
    print0(f"\n1. every variant == one process, after {STEPS} AdamW steps (max |Δ|)")
    print0(f"   {'':<8} {'Σ losses':>9} {'weights':>9}")
    for name, loss, error in list(zip(names, losses - losses[0], errors))[1:]:
        print0(f"   {name:<8} {abs(loss):9.1e} {error:9.1e}")
    print0("   fp32 rounding: sums in another order (AdamW's m/sqrt(v) magnifies it where g ~ 0)")
    print0(f"\n2. bytes per rank after backward (fp32, AdamW), measured | formula; Ψ = {psi:,}")
    for stage, (name, m) in enumerate(memory.items()):
        cells = f"weights {m['params']:10,} + grads {m['grads']:10,} + state {m['optimizer']:10,}"
        formula = f"{FORMULAS[name]:<13}{zero_memory_formula(stage, psi, world):11,.0f}"
        print0(f"   {name:<6} {cells} = {sum(m.values()):10,} | {formula}")
    print0("   (+ AdamW's 4-byte step count per stepped tensor, + padding to N·S: try --ranks 3)")
    compression_demo(rank, world, config, device)


def compression_demo(rank, world, config, device, steps=30, warmup=5) -> None:
    """Bytes sent in a step after the warm-up, and the loss on held-out rows (ranks agree)."""
    batches = model_lib.byte_batches(T, B * world, steps, SEED + 1, device)
    held_out = model_lib.byte_batches(T, 32, 1, SEED + 2, device)[0]  # (x, y), each (32, T)
    mine, sent = slice(rank * B, (rank + 1) * B), {}
    print0(f"\n3. compression: {steps} AdamW steps ({warmup} exact); bytes sent in the last")
    for name in ("none", "fp16", "bf16", "powersgd r=1", "powersgd r=4"):
        torch.manual_seed(SEED)
        kw = dict(powersgd_rank=int(name[-1]) if "=" in name else 4, powersgd_warmup_steps=warmup)
        model = DataParallel(model_lib.GPT(config).to(device), 1.0, None, name.split()[0], **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for x, y in batches:
            before = model.stats["allreduce_bytes"]
            train_step(model, opt, x[mine], y[mine])
        sent[name], loss = model.stats["allreduce_bytes"] - before, model(*held_out)[1].item()
        ratio = f"1/{sent['none'] / sent[name]:.0f}"
        print0(f"   {name:<13} {sent[name]:>9,} bytes {ratio:>7}   held-out loss {loss:.3f}")
        WRAPPERS.append((model, opt))
    print0("   (30 steps: no verdict on the loss; the main job's: bench/bench_compression.py)")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # subtle: --ranks, not --nproc, which torchrun would take for its own --nproc-per-node
    parser.add_argument("--ranks", type=int, default=2, help="ranks to start outside torchrun")
    if (args := parser.parse_args(argv)).ranks < 1:
        parser.error("--ranks must be >= 1")
    if "WORLD_SIZE" not in os.environ:
        return relaunch_with_torchrun(args.ranks, argv, __file__)
    rank, _, world, device = init_distributed()
    try:
        run_demo(rank, world, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
