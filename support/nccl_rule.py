"""A pure-Python run of a pipeline's p2p plan under NCCL's rule (DESIGN §4).

NCCL has no send buffer: a send completes only once its peer has posted the matching
receive, and a batch_isend_irecv group completes only as a whole. Gloo buffers sends, so
a plan that hangs on GPUs can pass on CPUs; this simulation finds such hangs on paper.

A plan is one list of ticks per rank. A tick has `.actions` (run first, in order), then
`.sends` and `.recvs`, tuples of (peer rank, message): the ONE group the rank posts and
waits for. 05_pipeline.py builds plans and wraps `run` as its `nccl_timeline`.
"""

from collections import defaultdict


def send_recv_pairs(plan) -> list[tuple]:
    """((rank, tick index), (rank, tick index)) of each send and its receive.

    NCCL pairs the k-th send r->q with the k-th receive on q from r, whatever they
    carry, so the messages are checked to agree link by link."""
    sent = defaultdict(list)  # (src, dst) -> [((rank, tick index), message)]
    received = defaultdict(list)
    for r, ticks in enumerate(plan):
        for i, tick in enumerate(ticks):
            for q, msg in tick.sends:
                sent[(r, q)].append(((r, i), msg))
            for q, msg in tick.recvs:
                received[(q, r)].append(((r, i), msg))
    for link in sent.keys() | received.keys():
        out = [msg for _, msg in sent[link]]
        into = [msg for _, msg in received[link]]
        assert out == into, f"{link}: sends {out} but receives {into}"
    pairs = []
    for link in sent:
        for (g, _), (h, _) in zip(sent[link], received[link]):
            pairs.append((g, h))
    return pairs


def run(plan, made, needs, duration) -> list[list[tuple]]:
    """Each rank's (action, start, end)s as the plan runs under NCCL's rule; raises
    RuntimeError naming the groups that hang.

    A rank runs its tick's actions (`duration(action)` each), launches its group and
    blocks until every partner of the group's operations has launched its own. An
    action may run only once the message `needs(rank, action)` has arrived (None: no
    message) and then holds `made(rank, action)` itself."""
    p = len(plan)
    partners = defaultdict(list)  # group (rank, tick index) -> its operations' partners
    for g, h in send_recv_pairs(plan):
        partners[g].append(h)
        partners[h].append(g)
    at = [0] * p  # each rank's next tick
    clock = [0.0] * p
    launched_at = {}  # group -> when its rank launched it
    have = [set() for _ in range(p)]  # the messages each rank holds
    timeline = [[] for _ in range(p)]
    while any(at[r] < len(plan[r]) for r in range(p)):
        progress = False
        for r in range(p):  # each rank runs until it blocks on a group, or ends
            while at[r] < len(plan[r]):
                g = (r, at[r])
                tick = plan[r][at[r]]
                if (
                    g not in launched_at
                ):  # run the tick's actions, then launch its group
                    for a in tick.actions:
                        need = needs(r, a)
                        assert need is None or need in have[r], (
                            f"{r}: {a} before {need}"
                        )
                        have[r].add(made(r, a))
                        start = clock[r]
                        clock[r] += duration(a)
                        timeline[r].append((a, start, clock[r]))
                    launched_at[g] = clock[r]
                    progress = True
                if any(h not in launched_at for h in partners[g]):
                    break  # blocked: each operation waits for its partner's group
                clock[r] = max([clock[r]] + [launched_at[h] for h in partners[g]])
                have[r].update(msg for _, msg in tick.recvs)
                at[r] += 1
                progress = True
        if not progress:
            hung = [(r, at[r]) for r in range(p) if at[r] < len(plan[r])]
            raise RuntimeError(f"deadlock under NCCL's rule: groups {hung} hang")
    return timeline
