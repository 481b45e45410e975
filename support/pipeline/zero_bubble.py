"""05c_zero_bubble.py's measuring plumbing: the bytes a pipeline stage keeps for its
backward, read at the end of every action (F, B, W), so that 05c can print them beside
its formulas. It teaches nothing of the split itself; 05c imports it.

What a stage keeps: the tensors autograd saved (counted by saved_tensors_hooks while
autograd keeps them) and what its W queue holds, each tensor once. Parameters are model
state: not counted.
"""

import torch


def view_key(t) -> tuple:
    """One kept tensor: its storage, offset and shape. Two microbatches' ids are views of
    one batch, each kept for its own W: counted by view, not by storage."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))


class Held:
    """A tensor autograd saved: it counts in `live` while autograd keeps this object."""

    def __init__(self, tensor, live: dict):
        self.tensor = tensor
        self.key = view_key(tensor)
        self.live = live
        live.setdefault(self.key, [tensor.nbytes, 0])[1] += 1

    def __del__(self):
        self.live[self.key][1] -= 1
        if not self.live[self.key][1]:
            del self.live[self.key]


class KeptBytes:
    """A stage's bytes kept for backward: .first after its first forward (one
    microbatch's activations, A) and .peak, the most at the end of any action."""

    def __init__(self, chunk):
        self.queue = getattr(chunk, "weight_grads", None)  # 05c's W queue, if split
        self.params = {q.untyped_storage().data_ptr() for q in chunk.parameters()}
        self.live = {}  # view_key -> [bytes, saved copies alive]
        self.first = None
        self.peak = 0

    def hooks(self):
        """Count every tensor autograd saves inside."""
        unpack = lambda held: held.tensor  # noqa: E731
        return torch.autograd.graph.saved_tensors_hooks(self.pack, unpack)

    def pack(self, tensor) -> Held:
        return Held(tensor, self.live)

    def read(self) -> int:
        """The bytes kept now; the first and the most so far are kept."""
        views = {key: n for key, (n, _) in self.live.items()}
        views.update(self.queue.kept() if self.queue else {})
        now = sum(n for key, n in views.items() if key[0] not in self.params)
        self.first = now if self.first is None else self.first
        self.peak = max(self.peak, now)
        return now


class ReadAfterEachAction:
    """Mixed into a step (05b's Microbatches): reads its .kept, a KeptBytes, at the end
    of every F, B and W."""

    def forward(self, mb, inp, chunk=0):
        out = super().forward(mb, inp, chunk)
        self.kept.read()
        return out

    def backward(self, mb, grad, chunk=0, sync=True):
        out = super().backward(mb, grad, chunk, sync)
        self.kept.read()
        return out

    def weight(self, mb, chunk=0, sync=True):
        super().weight(mb, chunk, sync)
        self.kept.read()


def mib(values) -> str:
    """Bytes as MiB, two decimals, one a stage: "34.07 25.55"."""
    return " ".join(f"{v / 2**20:.2f}" for v in values)
