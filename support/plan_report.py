"""09_plan.py's report: why the best layout wins, what would make another fit, and
the printed table. Plumbing: it reads Plan and Layout objects and teaches nothing new.
"""

import dataclasses

from support.gpu_specs import GPUS

GIB = 2**30


def differs_in(a, b, name: str) -> bool:
    """b is a with `name` changed (and dp with tp or pp, as the world is fixed)."""
    free = {name, "dp"} if name in ("tp", "pp") else {name}
    if name == "pp":
        free |= {"schedule", "virtual_stages"}
    if name == "tp":
        free.add("sequence_parallel")
    same = all(
        getattr(a, f.name) == getattr(b, f.name)
        for f in dataclasses.fields(a)
        if f.name not in free
    )
    return same and getattr(a, name) != getattr(b, name)


def why_best(plans: list) -> list[str]:
    """For each choice of the best plan: the best rival that differs only there, and
    why it loses (it does not fit, or the step part that grows most)."""
    best = plans[0]
    reasons = []
    for name in ("tp", "pp", "zero", "recompute", "micro_batch", "schedule"):
        rivals = [p for p in plans[1:] if differs_in(best.layout, p.layout, name)]
        if not rivals:
            continue
        rival = min(rivals, key=lambda p: (not p.fits, -p.tokens_per_s))
        mine = f"{name} {getattr(best.layout, name)}"
        theirs = f"{name} {getattr(rival.layout, name)}"
        if not rival.fits:
            need = rival.memory["total"] / GIB
            reasons.append(f"{mine} fits ({theirs} needs {need:.1f} GiB)")
            continue
        parts = [k for k in best.time if k != "total"]
        worse = max(parts, key=lambda k: rival.time[k] - best.time[k])
        slower = 1 - rival.tokens_per_s / best.tokens_per_s
        if slower < 0.005:  # a tie: the ranking took the simpler, then the smaller
            smaller = best.memory["total"] < rival.memory["total"]
            why = "needs less memory" if smaller else "is simpler"
            reasons.append(f"{mine}: {theirs} is as fast, {mine} {why}")
            continue
        reasons.append(f"{mine}: {theirs} is {slower:.0%} slower (more {worse})")
    return reasons


def fix_for(bad, plans: list) -> str:
    """The fastest fitting plan one choice away from a plan that does not fit."""
    for p in plans:
        if not p.fits:
            break
        for name in ("zero", "recompute", "micro_batch", "tp", "pp"):
            if differs_in(bad.layout, p.layout, name):
                return f"{name} {getattr(p.layout, name)} would fit"
    return "no single change fits"


def gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def describe(p) -> list[str]:
    """Two lines: memory (GiB) and step time (ms) broken down, then the rates."""
    m = p.memory
    mem = "+".join(gib(m[k]) for k in ("weights", "grads", "optimizer"))
    mem += f" +act {gib(m['activations'])} +logits {gib(m['logits'])}"
    t = p.time
    ms = " ".join(
        f"{k} {1e3 * t[k]:.0f}" for k in ("compute", "bubble", "tp", "pp", "dp")
    )
    head = f"{str(p.layout):<42} {gib(m['total']):>5} GiB"
    rate = f"{p.tokens_per_s:>10,.0f} tok/s MFU {p.mfu:.0%}"
    return [f"{head} {rate}", f"GiB {mem}; ms {ms}"]


def print_search(plans: list, args, fit_share: float) -> None:
    """The fitting layouts, fastest first; why the best wins; two that do not fit and
    what would make them fit; the best one's hours, GPU-hours, energy and cost."""
    fit = [p for p in plans if p.fits]
    gpu = GPUS[args.gpu.lower()]
    what = f"{args.model} on {args.gpus} x {args.gpu} ({args.gpus_per_node} a node)"
    print(f"\n{what}, batch {args.batch_size} x {args.seq_len or 'T'}, {args.dtype}:")
    share = f"{fit_share:.0%} of {gib(gpu.memory)} GiB"
    print(f"{len(plans)} layouts, {len(fit)} fit in {share}; the fastest:")
    for i, p in enumerate(fit[: args.top]):
        lines = describe(p)
        print(f"{i + 1:>2}. {lines[0]}\n    {lines[1]}")
    print("why the best wins:")
    for reason in why_best(plans):
        print(f"  {reason}")
    for p in [p for p in plans if not p.fits][:2]:
        over = (p.memory["total"] - p.capacity) / GIB
        print(f"does not fit: {p.layout}: {over:.1f} GiB over")
        print(f"  {fix_for(p, plans)}")
    cost = fit[0].budget(args.tokens, args.price)
    hours = f"{cost['hours']:.1f} h, {cost['gpu_hours']:,.0f} GPU-hours"
    print(f"the best on {args.tokens:.3g} tokens: {hours}")
    if cost["kwh"] is not None:
        print(f"  energy {cost['kwh']:,.0f} kWh at {gpu.watts:.0f} W ({gpu.name} TDP)")
    if cost["cost"] is not None:
        print(f"  cost ${cost['cost']:,.0f} at ${args.price}/GPU-hour")
