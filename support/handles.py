"""Waited collective handles, dropped later, not at once: a gloo exit-time workaround.

The trap. On gloo, a collective started inside backward (from a gradient hook or the
end-of-backward callback) copies backward's thread-local state, which holds a Python
object. gloo's worker thread keeps its own reference to the work for a moment after the
work completes, so `wait()` can return while that thread still holds it. If Python drops
its own reference first, the worker thread drops the last one, and it needs the GIL to
free that Python object. Normally it waits its turn; while the interpreter is
finalising, the thread is ended inside a C++ destructor, and the process aborts with
"terminate called without an active exception" (SIGABRT). tests/ddp_exit_job.py runs the
race many times, and tests/test_ddp.py records how often it struck.

The workaround. The lessons hand every waited handle to retire() instead of dropping it.
A handle is dropped only after RETIRED_MAX later ones were retired (by then the worker
thread let go long ago), or when the interpreter exits, by the main thread. So no handle
dies with a wrapper freed right after its last backward. What is retired must hold no
memory, since it may outlive its wrapper by many steps. A handle refers to the tensors
it sent: the lessons empty (resize to 0) a storage made only to be sent once it is
used; a wrapper's buckets and flat buffers, sent in place, are emptied when the wrapper
is freed (empty_when_freed); and a Then (03) drops its finishing closure once called.

Why PyTorch's DDP never aborts (reducer.cpp): it launches each bucket from C++ and
keeps only the work's future, waited for in finalize_backward, until the next backward
replaces it. The work itself may well die on gloo's thread, but the flat bucket it sent
was made in C++ and never had a Python object, so freeing it needs no GIL. Every tensor
the lessons send was made in Python, so its last reference must end on the main thread:
retire(). On torch 2.13 the abort did not reproduce even with retire() disabled (0 of
100 jobs under load, bench/bench_exit.py); older releases aborted (tests/test_ddp.py).
"""

import collections
import weakref

import torch.distributed as dist

from support import distributed

RETIRED_MAX = 256  # handles kept; a step retires a few (one per bucket or flat buffer)
_RETIRED = collections.deque(maxlen=RETIRED_MAX)


def retire(*handles) -> None:
    """Keep waited collective handles (dist.Work, or objects holding one) a while."""
    _RETIRED.extend(handles)


def weak_hook(owner, method: str, *bound):
    """Like `lambda *a: owner.method(*bound, *a)`, without keeping owner alive."""
    ref = weakref.ref(owner)

    def hook(*args):
        alive = ref()
        return None if alive is None else getattr(alive, method)(*bound, *args)

    return hook


def empty_when_freed(owner, params, buffers) -> None:
    """When owner is freed, resize each buffer's storage to 0 bytes: a retired handle
    may still refer to it. A parameter that lives on keeps a copy of a gradient that
    was a view of one of the buffers."""
    weakref.finalize(owner, _empty, params, buffers)


def _empty(params, buffers) -> None:
    storages = {b.untyped_storage().data_ptr() for b in buffers}
    for p in params:
        if p.grad is not None and p.grad.untyped_storage().data_ptr() in storages:
            p.grad = p.grad.clone()
    for b in buffers:
        b.untyped_storage().resize_(0)


def reduce_scatter_kept(full, lo: int, size: int, group, backend: str):
    """Start a SUM reduce-scatter of full: -> (work, rank r's slice full[lo:lo + size]
    once done). subtle: gloo's reduce-scatter is an all-reduce of a copy, which its
    retired handle would keep alive, so on gloo full is all-reduced in place and the
    slice taken: the same sums."""
    kw = dict(op=dist.ReduceOp.SUM, group=group, async_op=True)
    if backend == "gloo":
        return dist.all_reduce(full, **kw), full[lo : lo + size]
    out = full.new_empty(size)  # (S,)
    return distributed.reduce_scatter_tensor(out, full, **kw), out
