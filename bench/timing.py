"""bench/timing.py: what every bench script measures with, written once.

- clock(device): the wall clock in seconds, once a GPU's queue has drained (CUDA runs
  ahead of Python: without the wait a timer measures the launches, not the work);
- timed(fn): one call and its seconds;
- alternate(steps) and median_seconds(step): a timed loop after untimed warm-up calls;
  several steps take turns, so drift in the machine's speed hits them alike;
- make_step(model, optimizer): the training step most scripts time (forward under
  autocast, backward, clipping, the optimizer's step);
- machine(): the line that says what a result ran on; throughput(): a step's result
  line (ms, tokens/s, model FLOP/s and MFU where the GPU's peak is known);
- StepPeak: on a CPU, which has no max_memory_allocated, the most bytes a step's own
  tensors hold at once.

bench/ only measures: its scripts import this module, the lessons and support/, never
one another, and nothing outside bench/ imports bench/ (tests/test_house.py).
"""

import contextlib
import os
import platform
import statistics
import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from support import gpus


def clock(device=None) -> float:
    """time.perf_counter(), after waiting for a CUDA device's queue to drain."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def timed(fn, *args, device=None, **kwargs):
    """(fn(*args, **kwargs), its seconds)."""
    start = clock(device)
    out = fn(*args, **kwargs)
    return out, clock(device) - start


def alternate(steps: dict, n_steps: int, n_warmup: int = 0, device=None, before=None):
    """{name: step()}: n_warmup untimed rounds, then n_steps timed ones, every step once
    a round in turn: {name: [seconds of each timed call]}. before(), if given, runs
    untimed ahead of every call (a barrier, so a step's time is not a peer's lateness)."""
    times = {name: [] for name in steps}
    for i in range(n_warmup + n_steps):
        for name, step in steps.items():
            if before is not None:
                before()
            start = clock(device)
            step()
            seconds = clock(device) - start
            if i >= n_warmup:
                times[name].append(seconds)
    return times


def median_seconds(step, n_steps: int, n_warmup: int = 0, device=None, before=None):
    """The median seconds of step() over n_steps calls, after n_warmup untimed ones."""
    times = alternate({"step": step}, n_steps, n_warmup, device, before)
    return statistics.median(times["step"])


def make_step(model, optimizer, dtype=torch.float32, clip: float = 0.0):
    """step(x, y): forward (under autocast unless dtype is fp32), backward, gradient
    clipping to `clip` (0: none), optimizer.step(), gradients set to None."""
    device_type = next(model.parameters()).device.type

    def step(x, y):
        with torch.autocast(device_type, dtype, enabled=dtype != torch.float32):
            _, loss = model(x, y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def machine(*extra: str) -> str:
    """What a result ran on: the GPU's name if there is one, else the CPU's model name;
    the CPU count, torch's version, torch's threads, and `extra`."""
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            found = [line for line in f if line.startswith("model name")]
        name = found[0].split(":", 1)[1].strip() if found else name
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
    threads = f"{torch.get_num_threads()} torch threads"
    cpus = f"{os.cpu_count()} CPUs"
    return ", ".join([name, cpus, f"torch {torch.__version__}", threads, *extra])


def throughput(seconds, tokens, flops_per_token, dtype="bf16", device=None) -> str:
    """A step's result line: ms, tokens/s, the model FLOP/s they make and, on a GPU
    whose dense `dtype` peak support/gpus.py knows, MFU."""
    tokens_per_s = tokens / seconds
    flop_s = tokens_per_s * flops_per_token
    line = f"{seconds * 1e3:8.2f} ms {tokens_per_s:>10,.0f} tok/s"
    line += f" {flop_s / 1e12:7.3f} TFLOP/s"
    if device is not None and torch.device(device).type == "cuda":
        peak = gpus.peak_flops(torch.cuda.get_device_name(device), dtype)
        util = gpus.mfu(tokens_per_s, flops_per_token, 1, peak)
        line += "  MFU n/a" if util is None else f"  MFU {util:.1%}"
    return line


def _storages(tree) -> dict:
    tensors = [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
    return {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}


class StepPeak(TorchDispatchMode):
    """The most bytes alive at once among the tensors allocated inside (after every op:
    forward, backward and optimizer). Each op's new storages (not views of its inputs)
    are watched through weak references, which expire when nothing holds that memory."""

    def __init__(self):
        super().__init__()
        self.made = {}  # address -> (weak reference, bytes) of the latest storage there
        self.peak = 0

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        out = op(*args, **(kwargs or {}))
        inputs = _storages((args, kwargs))
        for address, storage in _storages(out).items():
            if address not in inputs:
                self.made[address] = (StorageWeakRef(storage), storage.nbytes())
        self.made = {a: v for a, v in self.made.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.made.values()))
        return out
