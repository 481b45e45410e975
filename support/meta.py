"""Modules of shapes only: built on torch's meta device, their weights never drawn.

02's count_params, 09's planner and bench/ build a GPT only to read its parameters' shapes.
On the meta device a tensor has a shape and no memory, so even GPT-2 XL costs nothing.

subtle: drawing a meta tensor's values, as nn.init.normal_ does (nn.Embedding's own init and
02's GPT-2 init), runs torch's Python reference for normal_, whose first call imports
torch._dynamo: 2.5 s on a 2-core VM, in `python 09_plan.py` and `train.py --plan`, which
build no optimizer (torch.optim's optimizers import it when built). A shape needs no values,
so inside shapes_only() normal_ draws nothing. (uniform_, nn.Linear's init, has a compiled
meta kernel and costs nothing.)
"""

import contextlib
import threading

import torch

# Held while normal_ is replaced, so that two threads building at once do not restore it
# out of order. Reentrant: nesting is fine. Another thread's real tensors are still drawn.
_PATCHING = threading.RLock()


_REAL_NORMAL = torch.nn.init.normal_


def _draw_nothing(tensor, *args, **kwargs):
    """normal_ for a meta tensor: nothing. Any other (another thread's) is drawn."""
    if tensor.is_meta:
        return tensor
    return _REAL_NORMAL(tensor, *args, **kwargs)


@contextlib.contextmanager
def shapes_only():
    """Modules built inside live on the meta device; nn.init.normal_ leaves them undrawn."""
    with _PATCHING:
        torch.nn.init.normal_ = _draw_nothing
        try:
            with torch.device("meta"):
                yield
        finally:
            torch.nn.init.normal_ = _REAL_NORMAL
