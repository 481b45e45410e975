"""Plumbing for 08's ring: counting its messages, and a ring of threads in one process.

count_p2p() records the bytes of every send posted through dist.batch_isend_irecv, the
call 08's ring makes, so a lesson can print them beside its formula. ThreadRing runs
cp copies of a ring loop as threads of one process, passing tensors through queues
instead of a network: the same loop, on one CPU, in fp64 if you like, with no ranks to
start. Like NCCL, it pairs the k-th send on a link with the k-th receive.
"""

import contextlib
import queue
import threading

import torch
import torch.distributed as dist


@contextlib.contextmanager
def count_p2p():
    """`with count_p2p() as sent: step()`: the bytes of each isend posted meanwhile
    through dist.batch_isend_irecv, in order (the messages still travel)."""
    sent = []
    real = dist.batch_isend_irecv

    def counting(p2p_op_list):
        for op in p2p_op_list:
            if op.op is dist.isend:
                sent.append(op.tensor.numel() * op.tensor.element_size())
        return real(p2p_op_list)

    dist.batch_isend_irecv = counting
    try:
        yield sent
    finally:
        dist.batch_isend_irecv = real


class _Received:
    """What a thread's pass_on returns: wait() blocks until the tensor arrives."""

    def __init__(self, box: queue.Queue, timeout: float):
        self.box = box
        self.timeout = timeout

    def wait(self) -> torch.Tensor:
        return self.box.get(timeout=self.timeout)


class ThreadRing:
    """cp ranks as threads: pass_on(rank)(t) sends a copy of t to rank + 1 and returns
    the message from rank - 1 (its .wait()). sent[rank] lists the bytes rank sent."""

    def __init__(self, cp: int, timeout: float = 60.0):
        self.cp = cp
        self.timeout = timeout
        self.boxes = [{} for _ in range(cp)]  # rank -> {k: the k-th message to it}
        self.counts = [0] * cp  # messages each rank has sent so far
        self.sent = [[] for _ in range(cp)]
        self.lock = threading.Lock()

    def _box(self, rank: int, k: int) -> queue.Queue:
        with self.lock:
            return self.boxes[rank].setdefault(k, queue.Queue(maxsize=1))

    def pass_on(self, rank: int):
        def send_and_receive(t: torch.Tensor):
            k = self.counts[rank]
            self.counts[rank] += 1
            self.sent[rank].append(t.numel() * t.element_size())
            self._box((rank + 1) % self.cp, k).put(t.clone())
            return _Received(self._box(rank, k), self.timeout)

        return send_and_receive

    def run(self, fn) -> list:
        """[fn(rank, pass_on(rank)) for every rank], each on its own thread."""
        results = [None] * self.cp
        errors = []

        def target(rank):
            try:
                results[rank] = fn(rank, self.pass_on(rank))
            except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller
                errors.append(e)

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.cp)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results
