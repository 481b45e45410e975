"""The gloo exit workaround, one object per wrapper whose hooks start collectives.

The trap. On gloo, a collective started inside backward (from a gradient hook or the
end-of-backward callback) copies backward's thread-local state, which holds a Python
object. gloo's worker thread keeps its own reference to the work for a moment after the
work completes, so `wait()` can return while that thread still holds it. If Python drops
its own reference first, the worker thread drops the last one, and it needs the GIL to
free that Python object. Normally it waits its turn; while the interpreter is
finalising, the thread is ended inside a C++ destructor, and the process aborts with
"terminate called without an active exception" (SIGABRT) after its work is done.

It strikes on the torch CI has pinned since the first commit (torch==2.13.0 in
.ci/constraints.txt; requirements.txt asks >=2.13.0): in CI, ZeRO-2 dropping its reduce-
scatter handles once waited aborted 1 of 15 exits (commit 898a44c), and 03's demo
aborted at exit when its last ZeRO wrapper, freed on return, dropped its handles
(58afab9). Issue 39 removed this workaround after 0 aborts in 100 exit jobs under load
(tests/ddp_exit_count.py, 2026-11-29), a count too small to tell: at a rate of 1% to 7% a
job, 25 ZeRO-2 jobs all exit cleanly with probability 78% to 16%. The earlier counts
(issue 30: about one job in 10 to 20 under load) were on torch 2.13.0 as well. So the
workaround stays, behind one object per wrapper. tests/ddp_exit_job.py runs the race.

What a wrapper does: builds one Collectives(self, group) and launches every collective
through it (all_reduce, all_gather, reduce_scatter: torch's, asynchronous), and
registers its hooks with hook(). That object
- holds the wrapper weakly in every hook, and removes the hooks when the wrapper is
  freed (close() removes them at once): a module may outlive its wrapper, and a dropped
  wrapper must stop sending (torch DDP's reducer does the same);
- on gloo, keeps each waited handle KEEP_S seconds more in a list of this module's (by
  then gloo's thread let go of it long ago), and drops what is left at exit, from the
  main thread, before Python finalises; so no handle dies with a wrapper freed right
  after its last backward. The race is in gloo's worker thread: on NCCL the handles
  are not kept;
- keeps a kept handle from holding memory: gloo's reduce-scatter is an all-reduce of a
  copy of the input, which its handle would keep, so on gloo reduce_scatter all-reduces
  the input in place, copies slice r out once waited and empties the input (resize to
  0); and the buffers named `buffers=` (sent in place) are emptied when the wrapper is
  freed.

Why PyTorch's DDP never aborts (reducer.cpp): it launches each bucket from C++ and keeps
only the work's future until the next backward replaces it; the flat bucket it sent was
made in C++ and never had a Python object, so freeing it needs no GIL.
"""

import atexit
import collections
import time
import weakref

import torch
import torch.distributed as dist

from support import distributed

# Seconds a waited gloo handle is kept (gloo's thread lets go as the work completes).
KEEP_S = 2.0
_KEPT = collections.deque()  # (when waited, work), oldest first
# At exit the main thread drops the rest, while Python is still whole.
atexit.register(_KEPT.clear)


def _keep(work) -> None:
    now = time.monotonic()
    while _KEPT and now - _KEPT[0][0] > KEEP_S:
        _KEPT.popleft()
    _KEPT.append((now, work))


class _Kept:
    """A gloo handle: wait() waits, runs what finishes it, keeps the work a while."""

    def __init__(self, work, then=None):
        self.work = work
        self.then = then

    def wait(self) -> bool:
        self.work.wait()
        if self.then is not None:
            self.then()
            self.then = None  # it holds tensors: run once, then dropped
        _keep(self.work)
        return True


class Collectives:
    """One per wrapper (see the top): its collectives, its hooks, their lifetime."""

    def __init__(self, owner, group, buffers=(), params=()):
        self.group = group
        self.gloo = dist.get_backend(group) == "gloo"
        self.rank = dist.get_rank(group)
        self._owner = weakref.ref(owner)
        self._removers = []
        if buffers:
            weakref.finalize(owner, _empty, list(params), list(buffers))

    def hook(self, register, method: str, *bound, eager: bool = False):
        """register(h): h(*args) calls owner.method(*bound, *args) while the owner
        lives, and is removed when it is freed. eager: never traced by torch.compile
        (a module's forward hooks, which it traces: a weakref, ZeRO-3's resize_())."""
        owner = self._owner

        def h(*args):
            alive = owner()
            return None if alive is None else getattr(alive, method)(*bound, *args)

        handle = register(torch.compiler.disable(h) if eager else h)
        self._removers.append(weakref.finalize(owner(), handle.remove))

    def close(self) -> None:
        """Remove the hooks now, not when the owner is freed."""
        for remove in self._removers:
            remove()

    def _started(self, work):
        return _Kept(work) if self.gloo else work

    def all_reduce(self, tensor):
        """Start a SUM all-reduce of tensor, in place."""
        kw = dict(op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return self._started(dist.all_reduce(tensor, **kw))

    def all_gather(self, full, shard):
        """Start gathering every rank's shard into full, in rank order."""
        kw = dict(group=self.group, async_op=True)
        return self._started(distributed.all_gather_tensor(full, shard, **kw))

    def reduce_scatter(self, out, full):
        """Start a SUM reduce-scatter: out (S,) gets slice r of the ranks' full (N·S,).
        full is consumed: on gloo it is emptied once waited (see the top)."""
        kw = dict(op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        if not self.gloo:
            return distributed.reduce_scatter_tensor(out, full, **kw)
        lo = self.rank * out.numel()

        def slice_out() -> None:
            out.copy_(full[lo : lo + out.numel()])
            full.untyped_storage().resize_(0)  # the kept handle refers to it

        return _Kept(dist.all_reduce(full, **kw), slice_out)


def _empty(params, buffers) -> None:
    """The owner is freed: empty its buffers, which a kept handle may still refer to.
    A parameter that lives on keeps a copy of a gradient that was a view of one."""
    storages = {b.untyped_storage().data_ptr() for b in buffers}
    for p in params:
        if p.grad is not None and p.grad.untyped_storage().data_ptr() in storages:
            p.grad = p.grad.clone()
    for b in buffers:
        b.untyped_storage().resize_(0)
