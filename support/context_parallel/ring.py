"""Plumbing for 08's ring: its transfers, counting its messages, a ring of threads, and
its demo's flags.

Transfer is a posted ring step (08's ring_pass returns one). count_p2p() records the
bytes of every send posted through dist.batch_isend_irecv, the call 08's ring makes, so
a lesson can print them beside its formula; count_sent() adds what a ring algorithm
sends of each collective (08's all-gather version calls two). gather() collects every
rank's tensor for a check; attention_on_ranks() runs an attention on this rank's part of
q, k, v and returns the whole results and the bytes counted, for sdpa_reference().

ThreadRing runs cp copies of a ring loop as threads of one process, passing tensors
through queues instead of a network: the same loop, on one CPU, in fp64 or bf16, with no
ranks to start. Unlike NCCL, its sends are buffered: a send returns at once, before its
receive is posted, so an order that deadlocks on GPUs passes here. Only the pairing is
NCCL's: the k-th send on a link meets the k-th receive. NCCL's rule itself is checked on
gloo ranks, under tests/distributed.nccl_p2p_rules.

add_arguments() and check_args() are 08's flags and the check run_on_ranks makes before
any rank starts; 08's demo measures and prints everything itself.
"""

import contextlib
import functools
import queue
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F

from support.tensor_parallel import sharding
from support.tensor_parallel.activations import saved_activation_bytes


def add_arguments(parser):
    add = parser.add_argument
    add("--seq-len", type=int, default=64, help="T, divisible by 2cp")
    add("--batch-size", type=int, default=2, help="B")
    add("--heads", type=int, default=4, help="nh of the attention demo")
    add("--head-size", type=int, default=8, help="hs of the attention demo")
    add("--seed", type=int, default=1337, help="the same data on every rank")


def check_args(args, cp: int):
    """Before any rank starts: T must split into 2cp chunks (08's zigzag split)."""
    assert args.seq_len % (2 * cp) == 0, f"--seq-len {args.seq_len}: 2cp={2 * cp} ∤ T"


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


@contextlib.contextmanager
def count_sent(cp: int):
    """`with count_sent(cp) as sent: step()`: the bytes this rank sent meanwhile, filled
    in at the end: count_p2p's isends, then, for each collective over cp ranks that
    support/tensor_parallel/sharding.count_comm logs, what a ring algorithm sends of its payload:
    (cp-1)/cp of an all-gather's or a reduce-scatter's list, 2(cp-1)/cp of an
    all-reduce's tensor."""
    sent = []
    try:
        with count_p2p() as p2p, sharding.count_comm() as log:
            yield sent
    finally:
        sent.extend(p2p)
        for op, payload in log:
            times = 2 if op == "all_reduce" else 1
            sent.append(times * (cp - 1) * payload // cp)


class Transfer:
    """A posted ring step (08's ring_pass): wait() returns what the previous rank sent."""

    def __init__(self, works, sent, received):
        self.works = works
        self.sent = sent  # kept alive until the send completes
        self.received = received

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


def gather(t, group) -> list:
    """Every rank's t, in rank order (outside autograd: for checks and demos)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return parts


def sdpa_reference(q, k, v, dout) -> list:
    """[out, dq, dk, dv]: causal attention of the whole q, k, v by PyTorch, and the
    gradients of its inputs from dout."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def attention_on_ranks(fn, whole, dout, group, cut, join):
    """fn(q, k, v) (08's ring or all-gather attention) on this rank's part, cut(t), of
    each whole q, k, v, as leaves, then backward from cut(dout). Returns [out, dq, dk,
    dv], each joined whole from every rank's parts, and (bytes sent forward, backward,
    bytes kept for the backward), as count_sent and saved_activation_bytes count."""
    cp = dist.get_world_size(group)
    mine = [cut(t).clone().requires_grad_() for t in whole]
    with count_sent(cp) as sent_forward:
        out, kept = saved_activation_bytes(functools.partial(fn, *mine))
    with count_sent(cp) as sent_backward:
        out.backward(cut(dout))
    joined = [join(gather(t, group)) for t in [out, *(t.grad for t in mine)]]
    return joined, (sum(sent_forward), sum(sent_backward), kept)


def attention_kept_bytes(batch, seq_len, n_head, head_size, cp, version):
    """The bytes attention_on_ranks measures an fp32 attention keeping for the backward,
    by part, its leaf q, k, v (B, nh, T/cp, hs): 08's versions both keep q, O and the
    lse (B nh T/cp); then K and V of this rank's tokens (version "ring") or of all T
    tokens and the (T/cp, T) bool mask (the all-gather)."""
    E = batch * (seq_len // cp) * n_head * head_size
    kept = {"q, O, lse": 4 * (2 * E + batch * n_head * (seq_len // cp))}
    if version == "ring":
        return {**kept, "K, V of T/cp": 4 * 2 * E}
    return {**kept, "K, V of all T": 4 * 2 * E * cp, "mask": seq_len // cp * seq_len}


class _Received:
    """What a thread's pass_on returns: wait() blocks until the tensor arrives."""

    def __init__(self, box: queue.Queue, timeout: float):
        self.box = box
        self.timeout = timeout

    def wait(self) -> torch.Tensor:
        return self.box.get(timeout=self.timeout)


class ThreadRing:
    """cp ranks as threads: pass_on(rank)(t) sends a copy of t to rank + 1 and returns
    the message from rank - 1 (its .wait()). sent[rank] lists the bytes rank sent. The
    send is buffered (it never waits for the receive, as NCCL's would)."""

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
