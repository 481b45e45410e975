"""Bytes kept for the backward: the measuring tool behind 04b's SP savings, 06b's
recomputation numbers and 08's ring.

saved_activation_bytes(fn) runs fn under autograd's saved-tensors hooks and adds up the
distinct storages that autograd keeps for the backward. Inside torch's checkpoint, the
checkpoint's own hooks take the place of ours, so 06b's selective policy reports the
outputs it keeps by calling note_kept.
"""

import torch
import torch.nn as nn

# One dict of storages for each saved_activation_bytes call still running.
_counting: list[dict] = []


def _add(kept: dict, tensors) -> None:
    """Note each tensor's storage, unless it is a parameter's (or a view of one)."""
    for t in tensors if isinstance(tensors, (tuple, list)) else [tensors]:
        base = getattr(t, "_base", None)  # A view's storage owner.
        weight = isinstance(t if base is None else base, nn.Parameter)
        if isinstance(t, torch.Tensor) and not weight:  # Weights live on anyway.
            kept[t.untyped_storage().data_ptr()] = t


def note_kept(ctx) -> None:
    """Count the outputs that a selective checkpoint keeps for its backward.

    `ctx` is the context torch hands a checkpoint policy (06b's _policy); its op_output
    is what the policy keeps. Nothing is noted unless saved_activation_bytes is running.
    """
    if _counting:
        _add(_counting[-1], ctx.op_output)


def saved_activation_bytes(fn):
    """fn()'s result, and the bytes of the distinct storages kept for its backward.

    Autograd hands each tensor it saves to a saved-tensors hook (the batch's ids and
    targets too). The parameters' storages are left out, since they live on anyway.
    """
    kept = {}
    _counting.append(kept)

    def pack(t):
        _add(kept, t)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
    finally:
        _counting.pop()
    return out, sum(t.untyped_storage().nbytes() for t in kept.values())

