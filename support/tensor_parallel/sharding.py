"""The plumbing of tensor parallelism (04_tensor_parallel.py and 04b_sequence_parallel.py),
which teaches nothing new.

Which rows or columns of each GPT weight a rank holds (tp_layout), slicing a full tensor
into a rank's shard (a Parameter, marked) and merging the shards back, a check that the
ranks hold the same weights, chunking along a dimension, the collectives of a step
counted beside their formula, and the demo's comparisons over the ranks. 04 imports
what other code calls through it.
"""

import contextlib
import inspect
import math

import torch
import torch.distributed as dist
import torch.nn as nn


def chunk_for_ranks(x: torch.Tensor, group, dim: int):
    """x cut into tp equal chunks along dim, one per rank of the group."""
    tp = dist.get_world_size(group)
    if x.size(dim) % tp:
        shape = tuple(x.shape)
        raise ValueError(
            f"dim {dim} of {shape}: with SP T must be a multiple of tp={tp}"
        )
    return x.chunk(tp, dim=dim)


def check_same_on_ranks(tensors, group, message: str):
    """ValueError(message) unless every rank of the group holds the same tensors.

    One tiny all-reduce: the max of each tensor's sum and of its negation."""
    sums = torch.stack([t.detach().double().sum() for t in tensors])
    both = torch.cat([sums, -sums])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(both[: len(sums)], -both[len(sums) :]):
        raise ValueError(message)


def padding_hint(config, tp: int) -> str:
    """How a GPTConfig's vocabulary would split tp ways, for check_tp_config's message:
    padded to a multiple of lcm(64, tp)."""
    m = math.lcm(64, tp)
    rows = -(-config.vocab_size // m) * m  # the vocabulary padded to a multiple of m
    now = f"vocab_size={config.vocab_size}, pad_vocab_multiple={config.pad_vocab_multiple}"
    return f"({now}): pad with GPTConfig(pad_vocab_multiple={m}) -> {rows} rows"


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


def shard_param(t: torch.Tensor | None, dim: int, chunks: int, group):
    """A new Parameter of this rank's slice of t (None for None), marked
    `tensor_parallel`: 04's grad_norm_squared sums its squares over the ranks."""
    if t is None:
        return None
    rank = dist.get_rank(group)
    tp = dist.get_world_size(group)
    p = nn.Parameter(shard_tensor(t.detach(), dim, chunks, rank, tp), t.requires_grad)
    p.tensor_parallel = True
    return p


def merge_tensors(shards, dim: int, chunks: int) -> torch.Tensor:
    """Inverse of shard_tensor: the tp ranks' slices, in rank order -> the full tensor."""
    parts = [s.chunk(chunks, dim) for s in shards]  # tp x chunks
    whole = [torch.cat([p[c] for p in parts], dim) for c in range(chunks)]
    return torch.cat(whole, dim)


# A GPT module (a name suffix) -> the (dim, chunks) of its weight's split in 04. dim 0
# is column-parallel (output rows), dim 1 row-parallel (input columns; the bias is then
# replicated). chunks=3 cuts the fused [q|k|v] per part, so a rank holds whole heads.
SHARDED = {
    "wte": (0, 1),
    "lm_head": (0, 1),
    "attn.c_attn": (0, 3),
    "mlp.c_fc": (0, 1),
    "attn.c_proj": (1, 1),
    "mlp.c_proj": (1, 1),
}
# LoRA's factors (02): B (out, r) is cut as its weight's rows, A (r, in) as its columns.
LORA_DIM = {"lora_B": 0, "lora_A": 1}


def tp_layout(key: str):
    """(dim, chunks) along which a GPT state-dict entry is split, or None: replicated."""
    module, _, kind = key.rpartition(".")
    for suffix, (dim, chunks) in SHARDED.items():
        if module != suffix and not module.endswith("." + suffix):
            continue
        if kind in LORA_DIM:
            return (dim, chunks) if LORA_DIM[kind] == dim else None
        row_bias = dim == 1 and kind == "bias"  # replicated
        return None if row_bias else (dim, chunks)
    return None


def grad_shards(model, group) -> dict:
    """Each gradient of an unsharded GPT, or this rank's slice of it (by tp_layout)."""
    rank = dist.get_rank(group)
    tp = dist.get_world_size(group)
    want = {}
    for name, p in model.named_parameters():
        layout = tp_layout(name)
        want[name] = shard_tensor(p.grad, *layout, rank, tp) if layout else p.grad
    return want


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
    """Payload bytes per forward + backward step, by collective (fp32), as 04 counts
    (sp: as 04b counts)."""
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


def check_comm(log, config, B: int, T: int, sp: bool):
    """Assert that a count_comm log of one step adds up to comm_formula, by collective."""
    formula = comm_formula(config, B, T, sp)
    totals = {op: sum(n for o, n in log if o == op) for op in formula}
    assert totals == formula, f"collectives {totals}, not comm_formula's {formula}"


def max_over_ranks(values, group) -> list[float]:
    """The largest of each value over the ranks of the group (a demo's worst case)."""
    values = torch.stack(values).detach()
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return values.tolist()


def equal_over_ranks(diffs: dict, group, what: str) -> str:
    """Assert that each |diff|, at its largest over the ranks, is below 1e-4, and return
    them as 'name 1.2e-07, ...'. The demos compare O(1) values in fp32: sums split over
    ranks round ~1e-7 apart, while a wrong slice or a missing sum is off by ~1."""
    worst = max_over_ranks(list(diffs.values()), group)
    text = ", ".join(f"{name} {d:.1e}" for name, d in zip(diffs, worst))
    assert max(worst) < 1e-4, f"{what} differs from the unsharded one: {text}"
    return text


def same_on_ranks(rows: torch.Tensor, group) -> list[bool]:
    """For each row of `rows`, whether every rank of the group holds the same one."""
    everyone = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, rows.contiguous(), group=group)
    return [all(torch.equal(e[i], rows[i]) for e in everyone) for i in range(len(rows))]


def ring_sent(log, tp: int, size: int) -> tuple[int, int]:
    """(calls, bytes one rank sends) for the collectives in a count_comm log whose
    payload is `size` bytes. A ring sends 2(tp-1)/tp of an all-reduce's payload, and
    (tp-1)/tp of an all-gather's (the gathered list) or a reduce-scatter's (its input)."""
    ring = dict(all_reduce=2 * (tp - 1), all_gather=tp - 1, reduce_scatter=tp - 1)
    calls = [op for op, n in log if n == size]
    return len(calls), sum(ring[op] * size // tp for op in calls)


def gather_logits(logits, group):
    """(B, T, V/tp) logit shards -> the full (B, T, V_padded), outside autograd, for
    tests and checks (the vocabulary-parallel loss never builds the full logits)."""
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits.detach().contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def relative_diff(mine, whole) -> torch.Tensor:
    """max |mine - whole| / max |whole|: fp32 rounding is ~1e-7, a bug ~1."""
    return (mine - whole).abs().max() / whole.abs().max()
