"""The next step's batch, read while this step computes: train.py's input pipeline.

A step's batch is a pure function of (seed, step, dp rank) (01's DataLoader), so it
can be made early without changing which batch a step reads. get_batch(s) returns step
s's batch and at once starts step s+1's on a background thread: read from the memmap,
pinned, and (on a GPU) copied to the device on a side stream, non_blocking, while the
GPU runs step s. The main stream waits for that copy on the device, never the host.
"""

from concurrent.futures import ThreadPoolExecutor

import torch


class Prefetcher:
    """01's DataLoader (on the CPU) with the next step's batch on its way to `device`."""

    def __init__(self, loader, device):
        self.loader = loader
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        # subtle: the thread starts on device 0; pinning and the stream's context would
        # then open a CUDA context on GPU 0 for every rank. Set this rank's device first.
        init = (torch.cuda.set_device, (self.device,)) if cuda else (None, ())
        self.pool = ThreadPoolExecutor(1, "prefetch", init[0], init[1])
        self.ahead = {}  # step -> the future of its (x, y)

    def read(self, step: int):
        """Step `step`'s (x, y) on the device (the background thread runs this)."""
        x, y = self.loader.get_batch(step)  # (B, T) each, from the memmap
        if self.stream is None:
            return x, y
        with torch.cuda.stream(self.stream):  # The copy runs beside the compute.
            x = x.pin_memory().to(self.device, non_blocking=True)
            y = y.pin_memory().to(self.device, non_blocking=True)
        return x, y

    def get_batch(self, step: int):
        """Step `step`'s batch (read now if it was not prefetched); step+1's starts."""
        # One thread makes every batch, in order: the loader's caches see no race.
        future = self.ahead.pop(step, None) or self.pool.submit(self.read, step)
        x, y = future.result()
        if self.stream is not None:  # The compute waits for the copy, on the GPU.
            main = torch.cuda.current_stream(self.device)
            main.wait_stream(self.stream)
            x.record_stream(main)  # Freed memory is reused only after main's use.
            y.record_stream(main)
        self.ahead = {step + 1: self.pool.submit(self.read, step + 1)}
        return x, y

    def position(self, step: int):
        return self.loader.position(step)

    def close(self) -> None:
        """Stop the thread (a prefetched batch nobody will read is dropped)."""
        self.ahead = {}
        self.pool.shutdown(wait=True, cancel_futures=True)
