"""The plumbing of tensor parallelism (04_tensor_parallel.py), which teaches nothing new.

All-gather and reduce-scatter along one dimension of a tensor, slicing a full tensor
into a rank's shard and merging the shards back, a check that the ranks hold the same
weights, a per-rank dropout stream, the squared gradient norm over sharded and
replicated parameters, and the collectives of a step counted beside their formula.
04 re-exports what other code calls through it.
"""

import contextlib
import inspect
import math

import torch
import torch.distributed as dist

TP_RNG = "tensor_parallel"  # the name of the per-rank dropout stream in checkpoints


def chunk_for_ranks(x: torch.Tensor, group, dim: int):
    """x cut into tp equal chunks along dim, one per rank of the group."""
    tp = dist.get_world_size(group)
    if x.size(dim) % tp:
        shape = tuple(x.shape)
        raise ValueError(
            f"dim {dim} of {shape}: with SP T must be a multiple of tp={tp}"
        )
    return x.chunk(tp, dim=dim)


def all_gather_along(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Every rank's x, concatenated along dim in rank order.

    A ring sends (tp-1)/tp of the result per rank."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter_along(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """The sum of every rank's x, of which this rank keeps its chunk along dim.

    A ring sends tp-1 of the tp chunks per rank."""
    parts = [p.contiguous() for p in chunk_for_ranks(x, group, dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


def check_tp_config(config, tp: int):
    """Every reason this GPTConfig cannot be split tp ways, in one ValueError, with no
    collective. n_head % tp == 0 suffices for the widths, as C = nh * hs."""
    V = config.padded_vocab_size
    problems = []
    if config.n_head % tp:
        heads = f"n_head={config.n_head}"
        problems.append(f"{heads} is not divisible by tp={tp} (whole heads)")
    if V % tp:
        m = math.lcm(64, tp)
        rows = -(-config.vocab_size // m) * m
        now = f"vocab_size={config.vocab_size}, pad_vocab_multiple={config.pad_vocab_multiple}"
        fix = f"pad with GPTConfig(pad_vocab_multiple={m}) -> {rows} rows"
        split = f"not divisible by tp={tp}"
        problems.append(f"the vocabulary has {V} rows ({now}), {split}: {fix}")
    if problems:
        reasons = "; ".join(problems)
        raise ValueError(f"cannot split this GPT over tp={tp} ranks: {reasons}")


def check_same_on_ranks(tensors, group, message: str):
    """ValueError(message) unless every rank of the group holds the same tensors.

    One tiny all-reduce: the max of each tensor's sum and of its negation."""
    sums = torch.stack([t.detach().double().sum() for t in tensors])
    both = torch.cat([sums, -sums])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(both[: len(sums)], -both[len(sums) :]):
        raise ValueError(message)


def shard_tensor(t: torch.Tensor, dim: int, chunks: int, rank: int, tp: int):
    """Rank's slice of a full tensor: each of `chunks` parts along dim, cut tp ways.

    chunks=3 cuts a fused [q|k|v] weight per part, so that a rank holds whole heads."""
    if t.size(dim) % (chunks * tp):
        size = t.size(dim)
        raise ValueError(
            f"size {size} (dim {dim}) is not divisible by {chunks} x tp={tp}"
        )
    pieces = [part.chunk(tp, dim)[rank] for part in t.chunk(chunks, dim)]
    return torch.cat(pieces, dim).clone()


def merge_tensors(shards, dim: int, chunks: int) -> torch.Tensor:
    """Inverse of shard_tensor: the tp ranks' slices, in rank order -> the full tensor."""
    parts = [s.chunk(chunks, dim) for s in shards]  # tp x chunks
    whole = [torch.cat([p[c] for p in parts], dim) for c in range(chunks)]
    return torch.cat(whole, dim)


class RNGStateTracker:
    """This rank's own dropout stream (Megatron's CudaRNGStatesTracker, one stream).

    The default stream is alike on every TP rank, so copies get the same mask. Shards
    (heads; with SP, tokens) need their own: `with tracker.fork():` swaps this stream
    into the device's default generator, and back again, advanced. `.state` holds the
    stream between forks (a CPU byte tensor, as torch's own RNG states)."""

    def __init__(self, device, seed: int):
        self.device = torch.device(device)
        self.state = torch.Generator(device=self.device).manual_seed(seed).get_state()

    def _swap(self, state):
        """Install `state` in the device's default generator; return the old one."""
        if self.device.type == "cuda":
            old = torch.cuda.get_rng_state(self.device)
            torch.cuda.set_rng_state(state, self.device)
        else:
            old = torch.get_rng_state()
            torch.set_rng_state(state)
        return old

    @contextlib.contextmanager
    def fork(self):
        outside = self._swap(self.state)
        try:
            yield
        finally:
            self.state = self._swap(outside)

    def state_dict(self) -> dict:  # for checkpoints, next to torch's own RNG state
        return {TP_RNG: self.state.clone()}

    def load_state_dict(self, states: dict):
        self.state = states[TP_RNG].clone()


def grad_norm_squared(grads, group, device) -> torch.Tensor:
    """The sum of g² over (parameter, gradient) pairs, the same on every TP rank.

    A parameter marked `tensor_parallel` is a slice: the ranks' squares add up. Any
    other is a copy, alike on every rank, and is counted once."""
    sharded = torch.zeros((), device=device)
    replicated = torch.zeros((), device=device)
    for p, g in grads:
        if getattr(p, "tensor_parallel", False):
            sharded += g.float().pow(2).sum()
        else:
            replicated += g.float().pow(2).sum()
    dist.all_reduce(sharded, group=group)
    return sharded + replicated


# A collective -> the argument that holds its payload (the bytes count_comm records).
PAYLOAD = dict(
    all_reduce="tensor", all_gather="tensor_list", reduce_scatter="input_list"
)


@contextlib.contextmanager
def count_comm():
    """`with count_comm() as log: step()` records (op, payload bytes) of every
    all_reduce, all_gather and reduce_scatter called through torch.distributed meanwhile
    (04 and this file call them as dist.<op>, so the wrappers see every one;
    the collectives still run)."""
    log = []
    saved = {op: getattr(dist, op) for op in PAYLOAD}

    def counting(op):
        def collective(*args, **kwargs):
            bound = inspect.signature(saved[op]).bind(*args, **kwargs)
            payload = bound.arguments[PAYLOAD[op]]
            tensors = payload if isinstance(payload, list) else [payload]
            log.append((op, sum(t.numel() * t.element_size() for t in tensors)))
            return saved[op](*args, **kwargs)

        return collective

    try:
        for op in PAYLOAD:
            setattr(dist, op, counting(op))
        yield log
    finally:
        for op, fn in saved.items():
            setattr(dist, op, fn)


def comm_formula(config, B: int, T: int, sp: bool) -> dict:
    """Payload bytes per forward + backward step, by collective (fp32), as 04 counts."""
    C = config.n_embd
    L = config.n_layer
    b = int(config.bias)
    E = 4 * B * T * C
    loss = 3 * 4 * B * T  # the loss: max, sum of exp, target logit
    if not sp:  # embedding g, per layer 2 g + 2 f, head f
        return {"all_reduce": (4 * L + 2) * E + loss}
    # f on the replicated gradients: wpe (T, C); per layer 2 LayerNorms (and biases) and 2
    # row biases; ln_f.
    params = 4 * (T * C + L * (2 * C + b * 4 * C) + (1 + b) * C)
    gathered = (4 * L + 2) * E
    return dict(all_gather=gathered, reduce_scatter=gathered, all_reduce=loss + params)


def max_over_ranks(values, group) -> list[float]:
    """The largest of each value over the ranks of the group (a demo's worst case)."""
    values = torch.stack(values).detach()
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return values.tolist()
