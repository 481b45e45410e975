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
dies with a wrapper freed right after its last backward. What the lessons hand over
holds no memory: a bucket or flat buffer that lives anyway, or a storage already
emptied.

PyTorch's DDP does the same in C++: its reducer keeps each bucket's work until the next
backward replaces it, and the reducer lives as long as the model.
"""

import collections

RETIRED_MAX = 256  # handles kept; a step retires a few (one per bucket or flat buffer)
_RETIRED = collections.deque(maxlen=RETIRED_MAX)


def retire(*handles) -> None:
    """Keep waited collective handles (dist.Work, or objects holding one) a while."""
    _RETIRED.extend(handles)
