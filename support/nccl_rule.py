"""Which p2p operations pair up, for 05_pipeline.py's run of a plan under NCCL's rule.

A plan is one list of ticks per rank. A tick has `.actions` (run first, in order), then
`.sends` and `.recvs`, tuples of (peer rank, message): the ONE group the rank posts and
waits for, named (rank, tick index). 05's `nccl_timeline` runs the plan; this module
only finds, for each group, the groups that hold its operations' partners.
"""

from collections import defaultdict

import torch.distributed as dist


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


def group_partners(plan) -> dict:
    """group (rank, tick index) -> the groups holding its operations' partners."""
    partners = defaultdict(list)
    for g, h in send_recv_pairs(plan):
        partners[g].append(h)
        partners[h].append(g)
    return partners


def run(plan, completes_at, input_message, n_stages, durations) -> list[list[tuple]]:
    """Each rank's (action, start, end)s as the plan runs under a p2p rule; raises
    RuntimeError naming the groups that hang.

    A rank runs its tick's actions, each `durations[action.op]` long, posts its group and
    asks `completes_at(group, partners, posted)` when the group completes (None: it
    blocks; `posted` maps each group posted so far to when). An action at global stage
    s (chunk·p + rank) may run only once `input_message(action, s, n_stages)` has
    arrived (None: no message); it then holds its own output (op, microbatch, s)."""
    p = len(plan)
    partners = group_partners(plan)
    at = [0] * p  # each rank's next tick
    clock = [0.0] * p
    posted = {}  # group -> when its rank posted it
    have = [set() for _ in range(p)]  # the messages each rank holds
    timeline = [[] for _ in range(p)]
    while any(at[r] < len(plan[r]) for r in range(p)):
        before = (sum(at), len(posted))
        for r in range(p):  # each rank runs until it blocks on a group, or ends
            while at[r] < len(plan[r]):
                g = (r, at[r])
                tick = plan[r][at[r]]
                if g not in posted:  # run the tick's actions, then post its group
                    for a in tick.actions:
                        need = input_message(a, a.chunk * p + r, n_stages)
                        assert need in have[r] | {None}, f"rank {r}: {a} before {need}"
                        have[r].add((a.op, a.mb, a.chunk * p + r))
                        start = clock[r]
                        clock[r] += durations[a.op]
                        timeline[r].append((a, start, clock[r]))
                    posted[g] = clock[r]
                done = completes_at(g, partners[g], posted)
                if done is None:
                    break  # blocked: this rank waits, and every later tick with it
                clock[r] = done
                have[r].update(msg for _, msg in tick.recvs)
                at[r] += 1
        if (sum(at), len(posted)) == before:
            hung = [(r, at[r]) for r in range(p) if at[r] < len(plan[r])]
            raise RuntimeError(f"deadlock under NCCL's rule: groups {hung} hang")
    return timeline


def blocking_p2p(ops, group=None) -> None:
    """Post (op, tensor, rank in group)s as ONE batch_isend_irecv group; wait on all."""
    world = group or dist.group.WORLD  # P2POp takes global ranks: map the group's
    ops = [dist.P2POp(op, t, dist.get_global_rank(world, q), group) for op, t, q in ops]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
