"""03 · Data parallelism: every rank holds the whole model, reads its own slice of the batch, and
the ranks average their gradients before every optimizer step.

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
    NaiveDataParallel   after backward, one blocking all-reduce per gradient tensor
    DataParallel        flat buckets in backward order; a gradient hook starts a bucket's async
                        all-reduce the moment it is full; the end of backward waits for all
    ZeroOptimizer       ZeRO stage 1 (Rajbhandari et al. 2019, arXiv 1910.02054): optimizer
                        state for 1/N of the parameters per rank; step them; broadcast them

Launch:  torchrun --standalone --nproc_per_node=2 03_ddp.py      (or 4; CPU/gloo or GPUs/NCCL)
         python 03_ddp.py [--ranks 4]                             (runs torchrun for you)
It checks all variants against one process, times naive vs bucketed vs PyTorch's own
DistributedDataParallel side by side, counts collectives and bytes against 2(N-1)/N · S, and
prints the optimizer memory per rank with and without ZeRO.

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
import statistics
import sys
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

data_lib = importlib.import_module("01_data")
model_lib = importlib.import_module("02_model")

SUM = dist.ReduceOp.SUM  # never AVG: gloo does not have it (DESIGN §4)


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


def ring_allreduce_bytes(size_bytes: int, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of size_bytes over n ranks."""
    return 2 * (n - 1) / n * size_bytes


@torch.no_grad()
def broadcast_from_first_rank(module: nn.Module, group) -> None:
    """Make the replicas identical: every parameter (frozen too) and buffer, from group rank 0."""
    # subtle: broadcast's src is a *global* rank. In a DP subgroup of a 3D grid (ranks {1, 3}, say)
    # the group's first rank is not rank 0 of the world.
    src = dist.get_global_rank(group, 0)
    for t in [*module.parameters(), *module.buffers()]:
        dist.broadcast(t.detach(), src=src, group=group)


def _weak_hook(wrapper_ref):
    """A gradient hook that calls wrapper_ref()._hook, without keeping the wrapper alive."""

    def hook(p: torch.Tensor) -> None:
        if (wrapper := wrapper_ref()) is not None:
            wrapper._hook(p)

    return hook


def _remove_hooks(handles) -> None:
    for handle in handles:
        handle.remove()


# ---------------------------------------------------------------------------------------------
# Simple first: all-reduce every gradient, one tensor at a time, after backward
# ---------------------------------------------------------------------------------------------
class NaiveDataParallel(nn.Module):
    """Wrap a replica: parameters broadcast from the group's first rank, then after each backward
    every gradient is all-reduced (SUM, then / N), one blocking call per tensor.

    The end of backward is found the way PyTorch's DDP finds it: the first gradient hook of a
    backward pass queues a callback that autograd runs when that pass is done. So a training loop
    needs no extra call, and no user can forget to synchronise before optimizer.step().
    group: the data-parallel group (default: the world). In a 3D grid it is the ranks that hold
    the same shard of the model; the module may be a pipeline stage with tensor-parallel shards.

    Lifetime: the hooks hold the wrapper only weakly, and a dropped wrapper takes its hooks with
    it, so `model = DataParallel(model.module)` leaves one wrapper communicating, not two (as
    torch DDP, whose reducer removes its hooks when freed). close() detaches it at once, for a
    wrapper something still references.
    """

    def __init__(self, module: nn.Module, group=None):
        super().__init__()
        self.module, self.group = module, _dp_group(group)
        self.world = dist.get_world_size(self.group)
        broadcast_from_first_rank(module, self.group)
        self.names = {p: name for name, p in module.named_parameters()}  # a tied tensor: once
        self.params = [p for p in module.parameters() if p.requires_grad]  # frozen: skipped
        self.stats = {"allreduce_calls": 0, "allreduce_bytes": 0, "syncs": 0}
        self._sync, self._queued = True, False
        # subtle: the handles of the last two synchronised passes' collectives. A collective
        # copies the thread-local state it is launched in, and inside backward that holds a
        # Python object (autograd stashes a contextvars.Context). Dropped right after wait(),
        # the last reference may be the gloo worker thread's, still finishing up; if it lets go
        # while Python is exiting, it cannot take the GIL to free that object and the process
        # aborts ("terminate called without an active exception"). So we free them, on our own
        # thread, a whole pass later, when the worker is long done (freeing them as the next
        # pass starts still aborted 7 of 240 amplified jobs in tests/ddp_exit_job.py; this, 0 of
        # 210). Cost: the naive wrapper's handles keep up to two passes' gradients alive after
        # zero_grad(set_to_none=True); the bucketed one's hold its buckets, which live anyway.
        self._works, self._previous_works = [], []
        # subtle: a bound method in the hook would keep this wrapper alive as long as the
        # parameters; a weak reference does not (weakref.finalize then removes the hooks).
        hook = _weak_hook(weakref.ref(self))
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
        self._grad_ready(p)

    def _grad_ready(self, p: torch.Tensor) -> None:
        pass  # naive: wait for the end of backward

    def _missing_grad_error(self, params) -> RuntimeError | None:
        missing = [self.names[p] for p in params if p.grad is None]
        if not missing:
            return None
        return RuntimeError(
            f"{type(self).__name__}: {len(missing)} parameter(s) got no gradient in this "
            f"backward pass: {', '.join(missing)}. Every rank all-reduces every trainable "
            "parameter, so a parameter without a gradient would leave the other ranks waiting "
            "forever. Make it take part in the loss on every rank, or freeze it with "
            "requires_grad_(False) before wrapping."
        )

    def _all_reduce(self, t: torch.Tensor):
        """Start a SUM all-reduce of t, counted, its handle kept (see _works in __init__)."""
        work = dist.all_reduce(t, op=SUM, group=self.group, async_op=True)
        self._works.append(work)
        self.stats["allreduce_calls"] += 1
        self.stats["allreduce_bytes"] += nbytes(t)
        return work

    def _finish_backward(self) -> None:
        self._queued = False
        if error := self._missing_grad_error(self.params):
            raise error
        for p in self.params:
            self._all_reduce(p.grad).wait()  # one at a time, blocking: nothing overlaps
            p.grad.div_(self.world)  # SUM / N = the mean of the per-rank gradients
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
    work: object = None  # the async all-reduce in flight


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


class DataParallel(NaiveDataParallel):
    """Bucketed and overlapped data parallelism (PyTorch DDP's design, arXiv 2006.15704).

    A gradient hook copies p.grad / N into its bucket's flat buffer; when the bucket is full, its
    all-reduce (SUM) starts asynchronously, and backward goes on computing earlier layers. The
    end-of-backward callback waits for every bucket, then hands each parameter its averaged
    gradient as a view into the bucket: no copy back (DDP's gradient_as_bucket_view=True).
    bucket_mb=None: no cap, one bucket per dtype and device, launched when backward is done
    with it (little left to overlap; the fewest calls).
    """

    def __init__(self, module: nn.Module, bucket_mb: float | None = 25.0, group=None):
        ok = bucket_mb is None or (isinstance(bucket_mb, int | float) and bucket_mb > 0)
        assert ok, f"bucket_mb must be a positive number of MB or None (no cap), got {bucket_mb!r}"
        super().__init__(module, group)
        cap = math.inf if bucket_mb is None else bucket_mb * 2**20
        self.buckets = make_buckets(self.params, cap)
        self._where = {}  # param -> (bucket index, position in bucket)
        for b, bucket in enumerate(self.buckets):
            for i, p in enumerate(bucket.params):
                self._where[p] = (b, i)
        self._next, self._done = 0, set()  # next bucket to launch; params copied in

    def _grad_ready(self, p: torch.Tensor) -> None:
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
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if bucket.ready < len(bucket.params):
                return
            bucket.work = self._all_reduce(bucket.buffer)
            self._next += 1

    def _finish_backward(self) -> None:
        self._queued = False
        # Parameters whose hook did not fire in this pass may hold a gradient from passes run
        # under no_sync(): reduce it. A parameter with no gradient at all is an error.
        late = [p for b in self.buckets[self._next :] for p in b.params if p not in self._done]
        if error := self._missing_grad_error(late):
            self._wait_and_reset()  # leave none of our collectives half-done behind the error
            raise error
        for p in late:
            self._copy_in(p)
        self._launch_full_buckets()
        assert self._next == len(self.buckets), "every bucket must be launched by now"
        self._wait_and_reset(hand_back=True)
        self.stats["syncs"] += 1

    def _wait_and_reset(self, hand_back: bool = False) -> None:
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()  # on GPU: makes the current stream wait, not the host
            if hand_back:
                # subtle: p.grad now lives in the bucket, which the next synchronised backward
                # overwrites. Keep a gradient across steps? clone it.
                for p, view in zip(bucket.params, bucket.views):
                    p.grad = view
            bucket.ready, bucket.work = 0, None
        self._next = 0
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
        # Refused once built: the split across ranks is decided once, from every parameter, by
        # size. A later group would unbalance it, or re-split it and move optimizer state between
        # ranks (what torch's ZeroRedundancyOptimizer does), and every rank would have to add it
        # at the same step. Optimizer.__init__ calls this for the groups it is given: fine.
        if hasattr(self, "local"):
            raise NotImplementedError(
                "ZeroOptimizer.add_param_group after construction is not supported: pass every "
                "param group to ZeroOptimizer(...) (a group may start with lr=0)"
            )
        super().add_param_group(param_group)

    def shard_numels(self) -> list[int]:
        return [sum(p.numel() for p in shard) for shard in self.shards]

    def state_bytes(self) -> int:
        return optimizer_state_bytes(self.local)

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
# The demo: equal to one process, timed against torch DDP, collectives counted, memory printed
# ---------------------------------------------------------------------------------------------
@dataclass
class DemoConfig:
    preset: str = "small"  # 4 layers, C = 128: ~0.8M parameters, 3.3 MB of fp32 gradients
    block_size: int = 64  # T: half the preset's, so that 4 CPU ranks finish in about a minute
    batch_size: int = 4  # B sequences per rank per step; the global batch is N·B
    bucket_mb: float = 1.0  # at DDP's 25 MB this model is one bucket: nothing left to overlap
    lr: float = 1e-3
    check_steps: int = 3  # AdamW steps of the equality check
    time_steps: int = 10  # timed steps per variant, after 2 warm-up steps
    seed: int = 1337
    data_dir: str = "data/stdlib-char"  # the stdlib corpus, one token per byte (01_data.py)
    # ranks to start when run as plain `python 03_ddp.py`. subtle: not "--nproc", which torchrun
    # would take as an abbreviation of its own --nproc-per-node when passed through to us
    ranks: int = 2


def train_step(model, opt, x, y) -> None:
    _, loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()  # the wrappers all-reduce inside backward, from hooks
    opt.step()


def make_variants(cfg: DemoConfig, config, device) -> dict:
    """name -> (model, AdamW or ZeRO-1 AdamW), every replica built from the same seed."""

    def fresh():
        torch.manual_seed(cfg.seed)
        return model_lib.GPT(config).to(device)

    ids, mb = ([device.index] if device.type == "cuda" else None), cfg.bucket_mb
    models = {
        "naive": NaiveDataParallel(fresh()),
        "bucketed": DataParallel(fresh(), bucket_mb=mb),
        "bucketed + ZeRO-1": DataParallel(fresh(), bucket_mb=mb),
        "torch DDP": nn.parallel.DistributedDataParallel(fresh(), ids, bucket_cap_mb=mb),
    }
    AdamW, kw = torch.optim.AdamW, dict(lr=cfg.lr, weight_decay=0.1)
    opts = {n: AdamW(m.parameters(), **kw) for n, m in models.items()}
    opts["bucketed + ZeRO-1"] = ZeroOptimizer(models["bucketed + ZeRO-1"].parameters(), AdamW, **kw)
    return {n: (m, opts[n]) for n, m in models.items()}


def _grad_vector(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _single_process(cfg, config, loaders, device) -> torch.Tensor:
    """One process on the concatenated batch: [its first gradient | its parameters after
    check_steps | for scale, the first gradient of rank 0's rows alone]."""
    torch.manual_seed(cfg.seed)
    single = model_lib.GPT(config).to(device)
    single(*loaders[0].get_batch(0))[1].backward()
    alone = _grad_vector(single)
    opt, grads = torch.optim.AdamW(single.parameters(), lr=cfg.lr, weight_decay=0.1), []
    for step in range(cfg.check_steps):
        xs, ys = zip(*(loader.get_batch(step) for loader in loaders))  # N·B rows
        train_step(single, opt, torch.cat(xs), torch.cat(ys))
        grads.append(_grad_vector(single))
    params = nn.utils.parameters_to_vector(single.parameters())
    return torch.cat([grads[0], params, alone]).detach()


def check_equality(cfg, config, variants, loaders, rank, device) -> None:
    """Every variant, on every rank, against one process trained on the concatenated batch."""
    grads = {}
    for step in range(cfg.check_steps):
        for name, (model, opt) in variants.items():
            train_step(model, opt, *loaders[rank].get_batch(step))
            if step == 0:  # averaged over the ranks by now; the optimizers do not touch .grad
                grads[name] = _grad_vector(model).clone()
    P = grads["naive"].numel()
    ref = _single_process(cfg, config, loaders, device) if rank == 0 else torch.zeros(3 * P)
    ref = ref.to(device)
    dist.broadcast(ref, src=0)
    ref_grad, ref_params, alone = ref.split(P)
    diffs = torch.tensor(
        [[(grads[n] - ref_grad).abs().max(), (vec(m) - ref_params).abs().max()]
         for n, (m, _) in variants.items()], device=device)  # fmt: skip
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)  # the worst rank
    print0("\n1. equal to one process on the global batch? max |difference| over all ranks:")
    print0(f"   {'':<18} {'gradient, step 1':>17}   params after {cfg.check_steps} AdamW steps")
    for name, (dg, dp) in zip(variants, diffs.tolist()):
        print0(f"   {name:<18} {dg:17.1e} {dp:28.1e}")
    scale = (alone - ref_grad).abs().max()
    print0(f"   For scale: the gradient of rank 0's rows alone is {scale:.1e} away. The rest is")
    print0("   fp32 rounding (sums in another order); AdamW's m/sqrt(v) magnifies it where g ~ 0.")


def vec(model) -> torch.Tensor:
    return nn.utils.parameters_to_vector(model.parameters()).detach()


def report_counts(variants, world, steps) -> None:
    """The collectives and bytes the wrappers counted, against the formula."""
    params = variants["naive"][0].params
    S = sum(nbytes(p) for p in params)
    print0(f"\n2. collectives per optimizer step. Gradients: S = {S / 1e6:.2f} MB in {len(params)} "
           f"tensors;\n   a ring all-reduce sends 2(N-1)/N·S = "
           f"{ring_allreduce_bytes(S, world) / 1e6:.2f} MB per rank")  # fmt: skip
    for name, key in [("naive", "allreduce"), ("bucketed", "allreduce"), ("ZeRO-1", "broadcast")]:
        model, opt = variants["bucketed + ZeRO-1" if name == "ZeRO-1" else name]
        stats = opt.stats if name == "ZeRO-1" else model.stats
        calls, size = stats[f"{key}_calls"] / steps, stats[f"{key}_bytes"] / steps
        what = "= S" if size == S else "!= S"
        what = "of parameters, after the step" if name == "ZeRO-1" else what
        print0(f"   {name:<10} {calls:4.0f} {key}s  {size / 1e6:.2f} MB {what}")


def _now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def time_steps(variants, x, y, steps, warmup, device) -> dict:
    """name -> (step, compute-only) median seconds of the slowest rank. Variants alternate step
    by step, so drift in the machine's speed hits them alike. The same step under no_sync() does
    the same work without the all-reduces: its time is the compute alone."""
    samples = {name: ([], []) for name in variants}
    for i in range(warmup + steps):
        for name, (model, opt) in variants.items():
            for kind, ctx in enumerate((contextlib.nullcontext, model.no_sync)):
                dist.barrier()  # start together: a step's time is not a peer's lateness
                t0 = _now(device)
                with ctx():
                    train_step(model, opt, x, y)
                if i >= warmup:
                    samples[name][kind].append(_now(device) - t0)
    medians = [[statistics.median(s) for s in samples[n]] for n in variants]
    medians = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(variants, medians.tolist()))


def time_comm_alone(buffers, blocking: bool, device, reps: int = 7) -> float:
    """Median seconds to all-reduce these buffers (one by one, or all in flight at once)."""
    samples = []
    for _ in range(reps):
        dist.barrier()
        t0 = _now(device)
        works = [dist.all_reduce(b, async_op=not blocking) for b in buffers]
        for work in [] if blocking else works:
            work.wait()
        samples.append(_now(device) - t0)
    return statistics.median(samples)


def report_times(cfg, variants, loaders, rank, device) -> None:
    timed = {n: variants[n] for n in ("naive", "bucketed", "torch DDP")}
    times = time_steps(timed, *loaders[rank].get_batch(0), cfg.time_steps, 2, device)
    naive, bucketed = timed["naive"][0], timed["bucketed"][0]
    buckets = [torch.zeros_like(b.buffer) for b in bucketed.buckets]
    alone = {
        "naive": time_comm_alone([torch.zeros_like(p) for p in naive.params], True, device),
        "bucketed": time_comm_alone(buckets, False, device),
    }
    print0(f"\n3. time per step, median of {cfg.time_steps}, slowest rank. compute: the same step "
           "under no_sync();\n   exposed = step - compute; comm alone: the same collectives "
           "with no compute.")  # fmt: skip
    print0(
        f"   {'':<10} {'step':>9} {'compute':>9} {'exposed':>9} {'comm alone':>11} {'hidden':>6}"
    )
    for name, (step, compute) in times.items():
        exposed = step - compute
        line = f"   {name:<10} {step * 1e3:6.1f} ms {compute * 1e3:6.1f} ms {exposed * 1e3:6.1f} ms"
        if name in alone:  # torch DDP's buckets are its own business
            line += f" {alone[name] * 1e3:8.1f} ms {max(0.0, 1 - exposed / alone[name]):6.0%}"
        print0(line)
    ratio = times["bucketed"][0] / times["torch DDP"][0]
    speedup = times["naive"][0] / times["bucketed"][0]
    print0(f"   bucketed / torch DDP = {ratio:.2f}x (target <= 1.10x); naive / bucketed = "
           f"{speedup:.2f}x")  # fmt: skip
    print0("   Naive starts communicating after backward: its 'hidden' is measurement noise.")
    if device.type == "cpu":
        print0("   On a CPU gloo's threads need the cores the compute uses, so little can hide;")
        print0("   on GPUs NCCL runs beside the kernels, on its own stream.")


def report_memory(variants, world) -> None:
    plain, per_rank = optimizer_state_bytes(variants["bucketed"][1]), [None] * world
    dist.all_gather_object(per_rank, variants["bucketed + ZeRO-1"][1].state_bytes())
    print0("\n4. optimizer state per rank (AdamW: m and v in fp32, 8 bytes per parameter):")
    print0(f"   without ZeRO  {plain / 1e6:.2f} MB on every rank")
    shards = ", ".join(f"rank {r} {b / 1e6:.2f} MB" for r, b in enumerate(per_rank))
    print0(f"   with ZeRO-1   {shards}  (total/N = {plain / world / 1e6:.2f} MB)")


def run_demo(cfg: DemoConfig, rank, local_rank, world, device) -> None:
    if local_rank == 0:  # one writer per machine; the others wait at the barrier
        data_lib.prepare("stdlib", "char", cfg.data_dir, block_size=cfg.block_size)
    dist.barrier()
    args = (cfg.data_dir, "train", cfg.batch_size, cfg.block_size, cfg.seed)
    loaders = [data_lib.DataLoader(*args, r, world, device) for r in range(world)]  # all ranks'
    V = data_lib.CharTokenizer.n_vocab
    config = model_lib.GPTConfig.from_preset(cfg.preset, vocab_size=V, block_size=cfg.block_size)
    variants = make_variants(cfg, config, device)
    n_params = variants["naive"][0].module.num_params() / 1e6
    print0(f"\n03 · data parallelism, {world} ranks ({dist.get_backend()}, {device.type}): GPT "
           f"'{cfg.preset}', {n_params:.2f}M params, T={cfg.block_size}, V={V};\n   "
           f"{cfg.batch_size} sequences per rank, {cfg.batch_size * world} per step, "
           "stdlib source text from 01_data.py")  # fmt: skip
    check_equality(cfg, config, variants, loaders, rank, device)
    report_counts(variants, world, cfg.check_steps)
    report_times(cfg, variants, loaders, rank, device)
    report_memory(variants, world)


def relaunch_with_torchrun(ranks: int, argv, script: str = __file__) -> None:
    """`python 03_ddp.py` is `torchrun --standalone --nproc_per_node=ranks 03_ddp.py`."""
    from torch.distributed.run import main as torchrun

    args = ["--standalone", f"--nproc_per_node={ranks}", script, *argv]
    print(f"not started by torchrun, so running: torchrun {' '.join(args)}", flush=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default with several ranks
    torchrun(args)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in vars(DemoConfig()).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    cfg = DemoConfig(**vars(parser.parse_args(argv)))
    if "WORLD_SIZE" not in os.environ:
        return relaunch_with_torchrun(cfg.ranks, argv)
    rank, local_rank, world, device = init_distributed()
    try:
        run_demo(cfg, rank, local_rank, world, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
