"""07 · ZeRO: shard what every data-parallel rank holds N times (the FSDP idea).

The idea in one sentence: between the reduce-scatter and the all-gather of 03's ring
all-reduce, rank r needs only slice r of the mean gradient, so it needs to keep and step
only 1/N of the optimizer state, then of the gradients, then of the weights.

The math (Rajbhandari et al. 2019, arXiv 1910.02054). With AdamW in fp32, a step's model
states take 16 bytes per parameter: 4 for the weight, 4 for its gradient and 8 for m and
v (with 06's mixed precision also 16: 2 + 2 + 12 for the fp32 master, m and v). That is
16Ψ bytes for Ψ parameters, on every rank.
A unit (a block; or the root, the GPT itself, holding what no block owns) becomes one flat
1-D buffer of its parameters, padded to N·S elements (S = ⌈numel/N⌉), and rank r owns
slice r. Per rank, fp32 AdamW, N = 2 ([##  ]: rank 0's half); sent: elements per step.

              weights  grads    m, v     bytes per rank      sent        collectives
    DP (03)   [####]   [####]   [####]   16Ψ                 2(N-1)/N·Ψ  all-reduce
    ZeRO-1    [####]   [####]   [##  ]   8Ψ + 8Ψ/N           2(N-1)/N·Ψ  RS + AG
    ZeRO-2    [####]   [##  ]   [##  ]   4Ψ + 12Ψ/N          2(N-1)/N·Ψ  RS + AG
    ZeRO-3    [##  ]   [##  ]   [##  ]   16Ψ/N + gathered   ≤3(N-1)/N·Ψ  RS + AG, AG
    (RS: reduce-scatter, rank r gets the sum of slice r; AG: all-gather of the slices)

ZeRO-1: at the step, reduce-scatter the gradients (rank r gets the mean of slice r), step
slice r, all-gather the weights. ZeRO-2: the reduce-scatters run from gradient hooks
during backward, unit by unit, up to K at once (in_flight), each full gradient freed
once its reduce-scatter is done. ZeRO-3: the weights too;
a unit is all-gathered just before its forward (the next one prefetched), freed after it,
and gathered again for its backward (not the root, which stays gathered: FSDP2's choice).
The traffic is the same as DP's up to ZeRO-2: a ring all-reduce is an RS and an AG.

Launch:  python 07_zero.py [--ranks N]                         (runs torchrun for you)
         torchrun --standalone --nproc_per_node=2 07_zero.py   (or 4; gloo or NCCL)
It checks every stage against one process and prints the bytes per rank beside the
formula. Step times against FSDP2, GPT-2's sizes: bench/bench_ddp.py.

What changed from 06b_recompute.py: 06b kept fewer activations; here the model states
(06's 16Ψ bytes) are divided among the DP ranks; 03's DataParallel stays stage 0. Simple
first: SimpleZero1, ZeRO-1 in one flat buffer (reduce-scatter, step the slice,
all-gather), then ZeroOptimizer, the same at stage 1 for any units, param groups and
dtypes, then ZeroDataParallel, which adds the hooks of stages 2 and 3.

Left out on purpose: CPU and NVMe offload (ZeRO-Offload, ZeRO-Infinity), ZeRO++'s
quantised collectives, FSDP2's DTensor shards and bf16 gathers (under autocast, ZeRO-3
keeps autocast's 16-bit weight copies to backward), gradient compression under ZeRO.
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
ddp = importlib.import_module("03_ddp")

SUM = dist.ReduceOp.SUM  # never AVG: gloo does not have it
nbytes = ddp.nbytes


# ------------- simple first: ZeRO-1 with one flat buffer
class SimpleZero1:
    """ZeRO-1 at its simplest: every parameter (one dtype and device) a view into one flat
    buffer padded to N·S, and optimizer_cls over this rank's slice r only. step():
    reduce-scatter the gradients (rank r gets slice r's sum), divide by N, step slice r,
    all-gather the weights. A plain module, any training loop."""

    def __init__(self, params, optimizer_cls, group=None, **kw):
        self.params = [p for p in params if p.requires_grad]
        self.group = ddp.default_group(group)
        self.world = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        self.numel = sum(p.numel() for p in self.params)  # Ψ
        self.S = -(-self.numel // self.world)  # ⌈Ψ / N⌉
        self.flat = self.params[0].new_zeros(self.world * self.S)  # (N·S,)
        views = ddp.split_like(self.flat[: self.numel], self.params)
        for p, view in zip(self.params, views):
            view.copy_(p.detach())
            p.data = view  # p keeps its identity; its data now lives in the buffer
        # Slice r is a view too: stepping it writes into the buffer.
        self.shard = nn.Parameter(self.flat[rank * self.S : (rank + 1) * self.S])
        self.opt = optimizer_cls([self.shard], **kw)  # state for S elements, not Ψ

    @torch.no_grad()
    def step(self) -> None:
        grads = self.flat.new_zeros(self.flat.shape)  # (N·S,): the padding stays 0
        torch.cat([p.grad.reshape(-1) for p in self.params], out=grads[: self.numel])
        mine = grads.new_empty(self.S)  # (S,)
        distributed.reduce_scatter_tensor(mine, grads, op=SUM, group=self.group)
        self.shard.grad = mine.div_(self.world)  # SUM / N: the mean of slice r
        self.opt.step()
        distributed.all_gather_tensor(self.flat, self.shard.detach(), group=self.group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


# ------------- the real thing: units, param groups and dtypes; stages 1, 2 and 3
class FlatParameter:
    """Parameters (one unit, param group and dtype) as views into one flat buffer
    `full`, padded to N·S. Rank r steps `shard` = full[r·S:(r+1)·S]: a view (ZeRO-1/2) or its
    own copy (ZeRO-3, whose full buffer is freed between uses)."""

    def __init__(self, params: list, unit, rank: int, world: int, shard_params: bool):
        self.params = params
        self.unit = unit
        self.numels = [p.numel() for p in params]
        self.offset = {p: sum(self.numels[:i]) for i, p in enumerate(params)}
        self.S = (sum(self.numels) + world - 1) // world  # ⌈numel / N⌉
        self.full = params[0].new_zeros(world * self.S)  # (N·S,)
        for p, o in self.offset.items():
            self.full[o : o + p.numel()].copy_(p.detach().reshape(-1))
            # p keeps its identity and autograd state; its data moves into the buffer
            p.data = self.full[o : o + p.numel()].view_as(p)
        self.lo = rank * self.S  # this rank's slice: [lo, lo + S)
        mine = self.full[self.lo : self.lo + self.S]  # (S,)
        self.shard = nn.Parameter(mine.clone() if shard_params else mine)
        self.grad = None  # (N·S,): the full gradient, while backward fills it
        self.ready = 0  # how many of params have moved their gradient in
        self.work = None  # an all-gather in flight (ZeRO-3's prefetch)
        self.gathered = True
        if shard_params:
            self.free()

    def free(self) -> None:
        """ZeRO-3: free the full weights (a prefetch in flight is waited for first). The
        views stay; what autograd saved of them sees the next gather (FSDP's trick)."""
        if self.work is not None:
            self.work.wait()
        self.full.untyped_storage().resize_(0)
        self.work = None
        self.gathered = False

    def take_grad(self, p) -> None:
        """Move p.grad into the flat gradient, adding (no_sync() passes add up here)."""
        if self.grad is None:
            self.grad = self.full.new_zeros(self.full.shape)  # the padding stays 0
        self.grad.narrow(0, self.offset[p], p.numel()).add_(p.grad.reshape(-1))
        p.grad = None
        self.ready += 1


class ZeroOptimizer(torch.optim.Optimizer):
    """optimizer_cls stepping this rank's shard of every FlatParameter: 1/N of its state.
    One flat per param group (its weight decay, LR schedule) and unit (a module, less
    earlier units). Alone it is ZeRO-1: step() reduce-scatters the gradients backward
    left in p.grad, steps the shards, and all-gathers the weights."""

    def __init__(self, params, optimizer_cls, group=None, *, units=None, stage=1, **kw):
        super().__init__(params, kw)
        self.group = ddp.default_group(group)
        self.stage = stage
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        # Every collective goes through comm, for one workaround: gloo's worker thread
        # can hold the last reference to a finished collective, and freeing it at
        # interpreter exit aborted 1 in ~15 ZeRO-2 exits on torch 2.13.0 in our CI
        # (commits 898a44c, 58afab9). comm keeps handles a while (support/ddp/gloo_exit.py).
        self.comm = Collectives(self, self.group)
        groups = [
            [p for p in g["params"] if p.requires_grad] for g in self.param_groups
        ]
        everything = [set(sum(groups, []))]
        members = [set(u.parameters()) for u in units] if units else everything
        self.flats = []
        shards = [[] for _ in groups]
        taken = set()
        for unit, unit_params in zip(units or [None], members):
            for i, ps in enumerate(groups):
                kinds = {}  # a flat buffer holds one dtype on one device
                for p in ps:
                    if p in unit_params and p not in taken:
                        kinds.setdefault((p.dtype, p.device), []).append(p)
                        taken.add(p)
                for kind in kinds.values():
                    flat = FlatParameter(kind, unit, self.rank, self.world, stage == 3)
                    self.flats.append(flat)
                    shards[i].append(flat.shard)
        assert len(taken) == sum(map(len, groups)), "every parameter must be in a unit"
        shard_groups = [{**g, "params": s} for g, s in zip(self.param_groups, shards)]
        self.local = optimizer_cls(shard_groups, **kw)
        for g, local_g in zip(self.param_groups, self.local.param_groups):
            g.update({**local_g, **g})  # optimizer_cls's defaults, seen by schedulers
        self.state = self.local.state  # this rank's shards' state only
        self.stats = {"reduce_scatter_calls": 0, "reduce_scatter_bytes": 0}
        self.stats.update(all_gather_calls=0, all_gather_bytes=0)
        self._reduced = False
        numels = [f.numels for f in self.flats]  # what a checkpoint's shards must fit
        self._layout = dict(stage=stage, dp_rank=self.rank, dp_size=self.world)
        self._layout["flats"] = numels

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "local"):  # the buffers are cut once (start a group at lr=0)
            raise NotImplementedError(
                "add_param_group: give every group to ZeroOptimizer(...)"
            )
        super().add_param_group(param_group)

    def _all_gather(self, flat: FlatParameter):
        """Start gathering the shards into flat.full (ZeRO-3: its memory first)."""
        full = flat.full
        full.untyped_storage().resize_(nbytes(full))
        work = self.comm.all_gather(full, flat.shard.detach())
        self.stats["all_gather_calls"] += 1
        self.stats["all_gather_bytes"] += nbytes(full)  # each rank sends (N-1)/N of it
        return work

    def _reduce_scatter(self, flat: FlatParameter) -> tuple:
        """Start summing every rank's slice r onto rank r: (work, flat, slice r)."""
        for p in flat.params:
            if p.grad is not None:  # ZeRO-1: still in p.grad; ZeRO-2/3: moved by hooks
                flat.take_grad(p)
        if flat.grad is None:  # no gradient here: zeros, as every rank must take part
            flat.grad = flat.full.new_zeros(flat.full.shape)
        out = flat.grad.new_empty(flat.S)  # (S,): rank r's slice of the sum
        self.stats["reduce_scatter_calls"] += 1
        self.stats["reduce_scatter_bytes"] += nbytes(flat.grad)
        return self.comm.reduce_scatter(out, flat.grad), flat, out

    def _finish(self, pending: list, keep: int = 0) -> None:
        """Wait for the oldest reduce-scatters in pending until `keep` are left: each full
        gradient (and the handle that holds it) is freed once its own is done."""
        while len(pending) > keep:
            work, flat, out = pending.pop(0)
            work.wait()
            flat.shard.grad = out.div(self.world)  # SUM / N: the ranks' mean
            flat.grad = None

    def reduce_gradients(self) -> None:
        """ZeRO-1: reduce-scatter the gradients in flat order, once per zero_grad()."""
        if self.stage == 1 and not self._reduced:
            self._finish([self._reduce_scatter(f) for f in self.flats])
            self._reduced = True

    def grad_pieces(self) -> list:
        """(p, offset, piece) for each p that overlaps this rank's [lo, lo + S). piece is
        a view of f.shard.grad: the mean gradient of p.view(-1)[offset:][:len(piece)].
        The gradient norm sums all ranks' squares of the pieces; clipping scales them
        in place. ZeRO-1 reduces first, so every rank must call it."""
        self.reduce_gradients()
        pieces = []
        for f in self.flats:
            if f.shard.grad is None:
                continue
            for p, o in f.offset.items():
                a = max(o, f.lo)  # p ∩ [lo, lo + S) is [a, b)
                b = min(o + p.numel(), f.lo + f.S)
                if a < b:
                    pieces.append((p, a - o, f.shard.grad[a - f.lo : b - f.lo]))
        return pieces

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "ZeroOptimizer.step does not take a closure"
        self.reduce_gradients()
        for g, local_g in zip(self.param_groups, self.local.param_groups):
            local_g.update({k: v for k, v in g.items() if k != "params"})  # a new lr
        self.local.step()  # only this rank's shards move
        self.gather_weights()

    def gather_weights(self) -> None:
        """ZeRO-1/2: every weight (ZeRO-3 gathers a unit when a forward needs it)."""
        if self.stage == 3:
            return
        works = [self._all_gather(f) for f in self.flats]
        for work in works:
            work.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=True)  # the gradients live in the shards: freed
        self._reduced = False  # subtle: here, not in step(), which a scaler may skip
        for f in self.flats:
            f.grad = None
            f.shard.grad = None

    def state_dict(self) -> dict:
        """A sharded checkpoint: this rank's shards of the state and of the weights."""
        hyper = [
            {k: v for k, v in g.items() if k != "params"} for g in self.param_groups
        ]
        shards = [f.shard.detach().clone() for f in self.flats]
        return {
            "layout": {**self._layout},
            "param_groups": hyper,
            "shards": shards,
            "local": self.local.state_dict(),
        }

    def load_state_dict(self, state_dict: dict, gather: bool = True) -> None:
        """Shards, state and weights (ZeRO-1/2 then all-gather: every rank calls it).
        gather=False leaves the all-gather to gather_weights(), for a caller whose ranks
        first agree that the checkpoint fits every one of them (train.py's resume)."""
        # Its shards fit only the layout they were saved under: else a ValueError.
        check_layout(state_dict.get("layout"), self._layout)
        for f, shard in zip(self.flats, state_dict["shards"]):
            f.shard.data.copy_(shard)
        for g, saved_g in zip(self.param_groups, state_dict["param_groups"]):
            g.update(saved_g)
        self.local.load_state_dict(state_dict["local"])
        if gather:
            self.gather_weights()


def check_layout(saved: dict | None, here: dict) -> None:
    """A ZeRO shard fits only the layout it was saved under (stage, dp rank and size, the
    flats' sizes): raise a ValueError naming every key whose saved value differs."""
    saved = saved or {}
    diff = [k for k, v in here.items() if saved.get(k) != v]
    if diff:
        pairs = [f"{k} {saved.get(k)!s:.24}, here {here[k]!s:.24}" for k in diff]
        raise ValueError(f"this ZeroOptimizer shard was saved with {'; '.join(pairs)}")


def zero_units(module: nn.Module) -> list:
    """FSDP's units of a GPT (or of 05's pipeline chunk): the blocks, last first, then
    the root."""
    h = getattr(getattr(module, "transformer", None), "h", [])
    blocks = list(h.values() if isinstance(h, nn.ModuleDict) else h)
    return [*reversed(blocks), module]


class ZeroDataParallel(nn.Module):
    """ZeRO-1, 2 or 3 (optimizer.stage) around a module the optimizer has flattened,
    with the hooks of ZeRO-2 and 3 (see the top). The root's weights stay gathered until
    the end of backward (as FSDP2's). A missing gradient counts as zero: every rank must use the
    same parameters, as every rank reduces every flat in one order. no_sync(): whole
    gradients (4Ψ) until the synced pass. in_flight = K: at most K reduce-scatters at
    once, so besides the flats backward is filling, at most K full (N·S) gradients wait
    on the network: K flats' worth. K = 1 waits for each before the next starts: once a
    reduce-scatter outlasts a unit's backward (across nodes), backward stalls behind it."""

    forward = ddp.DataParallel.forward
    no_sync = ddp.DataParallel.no_sync

    def __init__(self, module: nn.Module, optimizer: ZeroOptimizer, in_flight: int = 2):
        super().__init__()
        assert in_flight >= 1, f"in_flight={in_flight}: at least one reduce-scatter"
        self.in_flight = in_flight
        self.module = module
        self.opt = optimizer
        self.stage = optimizer.stage
        self.stats = optimizer.stats
        units = zero_units(module)
        self.flats = [f for f in optimizer.flats if any(f.unit is u for u in units)]
        # Pipeline chunks, one optimizer, a wrapper each: ZeRO-3 would re-gather all
        # units for every microbatch.
        if self.stage == 3 and len(self.flats) < len(optimizer.flats):
            raise ValueError(
                "ZeRO-3 with several pipeline chunks per rank is refused: use ZeRO-2"
            )
        self._unit_flats = {u: [f for f in self.flats if f.unit is u] for u in units}
        self._sync = True
        self._in_backward = False
        self._next = 0  # the next flat to reduce-scatter in this backward
        self._pending = []  # the reduce-scatters in flight, oldest first
        # The hooks hold the wrapper weakly and are removed when it is freed, as 03's: a
        # dropped wrapper stops sending. (eager: torch.compile cannot trace resize_().)
        hooks = Collectives(self, optimizer.group)
        for f in self.flats if self.stage >= 2 else []:
            for p in f.params:
                hooks.hook(p.register_post_accumulate_grad_hook, "_grad_hook", f)
        # The units are [h3, h2, h1, h0, root]; forward runs root, h0 .. h3.
        fwd_order = [module, *units[-2::-1]]
        bwd_order = [module, *units[:-1]]  # root (its head first), h3 .. h0
        # After each unit's forward (or backward), the unit to prefetch.
        self._after = dict(zip(fwd_order, [*fwd_order[1:], None]))
        self._before = dict(zip(bwd_order, [*bwd_order[1:], None]))
        for u in units if self.stage == 3 else []:
            after = self._after[u]
            hooks.hook(u.register_forward_pre_hook, "_gather", u, after, eager=True)
            hooks.hook(u.register_forward_hook, "_post_forward", u, eager=True)

    @contextlib.contextmanager
    def gathered(self):
        """Full weights in self.module inside (export, evaluation): all ranks enter."""
        units = [
            u for u, fs in self._unit_flats.items() if not all(f.gathered for f in fs)
        ]
        for u in units:
            self._gather(u)
        try:
            yield self.module
        finally:
            for u in units:
                self._free(u)

    def _gather(self, unit, prefetch=None, *_) -> None:
        """ZeRO-3: this unit's weights now, and the next one's in the background."""
        for u in (unit, prefetch):
            for f in self._unit_flats.get(u, []):
                if not f.gathered and f.work is None:
                    f.work = self.opt._all_gather(f)
        for f in self._unit_flats[unit]:
            if f.work is not None:
                f.work.wait()
            f.work = None
            f.gathered = True

    def _free(self, unit) -> None:
        for f in self._unit_flats[unit]:
            f.free()

    def _post_forward(self, unit, module, args, output) -> None:
        grad = torch.is_grad_enabled()
        for t in output if isinstance(output, tuple) else (output,):
            # The hook runs just before this output's backward.
            if grad and torch.is_tensor(t) and t.requires_grad:
                t.register_hook(lambda _, u=unit: self._start_backward(u))
        # (In backward this forward is activation recomputation: backward frees it.)
        if not self._in_backward and (unit is not self.module or not grad):
            self._free(unit)

    def _start_backward(self, unit=None) -> None:
        if not self._in_backward:  # the first hook of this backward pass
            self._in_backward = True
            self._next = 0
            for f in self.flats:
                f.ready = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        # ZeRO-3, from a hook on the unit's output: its backward comes next.
        if unit is not None:
            self._gather(unit, prefetch=self._before[unit])

    def _grad_hook(self, flat: FlatParameter, p: torch.Tensor) -> None:
        self._start_backward()
        flat.take_grad(p)  # the full per-parameter gradient is freed
        if self.stage == 3 and flat.unit is not self.module:
            if all(f.ready == len(f.params) for f in self._unit_flats[flat.unit]):
                self._free(flat.unit)  # its backward is over
        self._launch()

    def _launch(self, everything: bool = False) -> None:
        """Reduce-scatter the flats whose gradients are complete (no_sync(): none)."""
        # subtle: flat order, not hook order: the same collectives, in one order, on
        # every rank
        while self._sync and self._next < len(self.flats):
            flat = self.flats[self._next]
            if not everything and flat.ready < len(flat.params):
                return
            # At most in_flight (K flats' full gradients): the oldest is waited for first.
            self.opt._finish(self._pending, keep=self.in_flight - 1)
            self._pending.append(self.opt._reduce_scatter(flat))
            self._next += 1

    def _end_backward(self) -> None:
        self._in_backward = False
        self._launch(everything=True)  # the rest (no_sync(): none, and none pending)
        self.opt._finish(self._pending)
        for u in self._unit_flats if self.stage == 3 else []:
            self._free(u)


def zero_data_parallel(
    module, stage: int, param_groups, optimizer_cls, group=None, bucket_mb=25.0, **kw
):
    """The one place that chooses the stage: -> (model, optimizer). Stage 0 is 03's
    DataParallel with optimizer_cls; 1-3 shard with ZeroOptimizer."""
    assert stage in (0, 1, 2, 3), f"the ZeRO stage must be 0, 1, 2 or 3, got {stage!r}"
    if stage == 0:
        model = ddp.DataParallel(module, bucket_mb, group)
        return model, optimizer_cls(param_groups, **kw)
    broadcast_group = ddp.default_group(group)
    ddp.broadcast_from_first_rank(module, broadcast_group)  # identical, then cut
    units = zero_units(module)
    opt = ZeroOptimizer(
        param_groups, optimizer_cls, group, units=units, stage=stage, **kw
    )
    return ZeroDataParallel(module, opt), opt


def memory_per_rank(module: nn.Module, optimizer) -> dict:
    """Bytes held now, by kind: distinct storages (a view counts with its buffer)."""
    flats = getattr(optimizer, "flats", [])
    params = [*module.parameters(), *(f.shard for f in flats)]
    grads = [p.grad for p in params] + [f.grad for f in flats]
    grads = [g for g in grads if g is not None]
    state = [
        t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    ]
    sizes = {}
    for kind, tensors in {"params": params, "grads": grads, "optimizer": state}.items():
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors
        }
        sizes[kind] = sum(s.nbytes() for s in storages.values())  # each storage once
    return sizes


def zero_memory_formula(stage: int, psi: float, world: int) -> float:
    """Bytes per rank for Ψ fp32 parameters and AdamW: 4Ψ weights + 4Ψ gradients + 8Ψ
    (m, v). Stage 1 divides m and v by N, stage 2 the gradients too, stage 3 all."""
    N = world
    per_stage = [16 * psi, 8 * psi + 8 * psi / N, 4 * psi + 12 * psi / N, 16 * psi / N]
    return per_stage[stage]


# ------------- the demo: every stage equals one process; bytes per rank vs the formula
PRESET = "small"  # 02's ~0.8M-parameter GPT on bytes
T = 64
B = 4  # rows per rank
STEPS = 3
SEED = 1337
FORMULAS = {
    "DP": "16Ψ",
    "ZeRO-1": "8Ψ + 8Ψ/N",
    "ZeRO-2": "4Ψ + 12Ψ/N",
    "ZeRO-3": "16Ψ/N",
}


def sent_per_step(stats: dict, world: int) -> float:
    """Bytes a rank sent per step: a ring all-reduce sends 2(N-1)/N of its size, a
    reduce-scatter or an all-gather (N-1)/N."""
    reduced = stats.get("allreduce_bytes", 0)
    scattered = stats.get("reduce_scatter_bytes", 0)
    gathered = stats.get("all_gather_bytes", 0)
    return (world - 1) / world * (2 * reduced + scattered + gathered) / STEPS


def run_demo(args, rank: int, world: int, device) -> None:
    config = model_lib.GPTConfig.from_preset(PRESET, vocab_size=256, block_size=T)
    batches = model_lib.byte_batches(T, B * world, STEPS, SEED, device)  # (N·B, T) each
    mine = slice(rank * B, (rank + 1) * B)  # this rank's rows of the global batch
    names = ("one process", "simple", *FORMULAS)
    losses = []
    weights = []
    memory = {}
    sent = {}
    for name in names:
        torch.manual_seed(SEED)  # the same GPT, alone (on every rank) or wrapped
        m = model_lib.GPT(config).to(device)
        kw = dict(lr=1e-3, weight_decay=0.1)
        if name == "one process":
            model = m
            opt = torch.optim.AdamW(m.parameters(), **kw)
        elif name == "simple":  # SimpleZero1 around the plain GPT
            model = m
            opt = SimpleZero1(m.parameters(), torch.optim.AdamW, **kw)
        else:  # stage 0: DataParallel, 1 MB buckets (4 for this GPT)
            stage = 0 if name == "DP" else int(name[-1])
            args = (m, stage, m.parameters(), torch.optim.AdamW)
            model, opt = zero_data_parallel(*args, bucket_mb=1.0, **kw)
        rows = slice(None) if name == "one process" else mine  # all N·B rows, or B
        step_losses = [ddp.train_step(model, opt, x[rows], y[rows]) for x, y in batches]
        losses.append(sum(step_losses) / world)
        if name in FORMULAS:  # counted in this run's STEPS steps
            sent[name] = sent_per_step(model.stats, world)
        full = model.gathered() if isinstance(model, ZeroDataParallel) else None
        with full or contextlib.nullcontext():
            weights.append(torch.cat([p.detach().reshape(-1) for p in m.parameters()]))
        if name in FORMULAS:  # one more backward: the bytes held then, as before a step
            opt.zero_grad(set_to_none=True)
            model(*(t[mine] for t in batches[-1]))[1].backward()
            memory[name] = memory_per_rank(m, opt)
    losses = torch.stack(losses)
    errors = torch.stack([(w - weights[0]).abs().max() for w in weights])
    dist.all_reduce(losses, op=SUM)  # the mean of the ranks' losses: the batch's loss
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)  # the worst rank
    psi = len(weights[0])  # weights: (Ψ,) each
    print0(f"\n07 · ZeRO on {world} ranks ({dist.get_backend()}), GPT '{PRESET}'")
    print0(f"\n1. every stage == one process, after {STEPS} AdamW steps (|Δ| of the")
    print0("   steps' summed losses, max |Δ| of the weights)")
    print0("   (simple: SimpleZero1; ZeRO-1 to 3: ZeroOptimizer, stage 1 to 3)")
    print0(f"   {'':<8} {'Σ losses':>9} {'weights':>9}")
    for name, loss, error in list(zip(names, losses - losses[0], errors))[1:]:
        print0(f"   {name:<8} {abs(loss):9.1e} {error:9.1e}")
    print0("   fp32 rounding: sums in another order (AdamW magnifies it where g ~ 0)")
    simple_vs_1 = (weights[1] - weights[3]).abs().max()
    dist.all_reduce(simple_vs_1, op=dist.ReduceOp.MAX)
    print0(f"   simple == ZeRO-1: weights max |Δ| {simple_vs_1:.1e}")
    print0(f"\n2. bytes per rank after backward, measured | formula; Ψ = {psi:,}")
    for stage, (name, m) in enumerate(memory.items()):
        cells = f"weights {m['params']:10,} + grads {m['grads']:10,}"
        cells += f" + state {m['optimizer']:10,}"
        formula = f"{FORMULAS[name]:<11}{zero_memory_formula(stage, psi, world):11,.0f}"
        print0(f"   {name:<6} {cells} = {sum(m.values()):10,} | {formula}")
    print0("   (+ AdamW's 4-byte step per tensor, + padding to N·S: try --ranks 3)")
    print0(f"\n3. bytes each rank sends per step, measured | formula (N = {world})")
    for name, measured in sent.items():
        # The top table's "sent" column, in fp32 bytes: 4 bytes an element.
        hops = 3 if name == "ZeRO-3" else 2
        formula = f"{'≤' if hops == 3 else ''}{hops}(N-1)/N·4Ψ"
        ring = hops * (world - 1) / world * 4 * psi
        print0(f"   {name:<6} {measured:12,.0f} | {formula:<13}{ring:12,.0f}")
    print0("   (ZeRO-3 keeps the root gathered for backward: less than 3(N-1)/N·4Ψ)")


def main(argv=None) -> None:
    """`--ranks N` ranks under torchrun (it relaunches itself), each running run_demo."""
    distributed.run_on_ranks(run_demo, argv, __file__, __doc__)


if __name__ == "__main__":
    main()
