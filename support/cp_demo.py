"""08_context_parallel.py's demo plumbing: its command-line flags, the check run before
any rank starts, and the table of what each attention version sends and keeps. It
teaches nothing new: 08 measures every number and checks it against its formulas.
"""

from support.distributed import print0


def add_arguments(parser):
    add = parser.add_argument
    add("--seq-len", type=int, default=64, help="T, divisible by 2cp")
    add("--batch-size", type=int, default=2, help="B")
    add("--heads", type=int, default=4, help="nh of the attention demo")
    add("--head-size", type=int, default=8, help="hs of the attention demo")
    add("--seed", type=int, default=1337, help="the same data on every rank")


def check_args(args, cp: int):
    """Before any rank starts: T must split into 2cp chunks."""
    assert args.seq_len % (2 * cp) == 0, f"--seq-len {args.seq_len}: 2cp={2 * cp} ∤ T"


def print_costs(costs: dict, E: int) -> None:
    """costs: version -> ((forward, backward, kept) bytes, kept's parts), measured equal
    to the formulas; printed with each formula's terms."""
    print0(f"per rank, measured = formula: E = B·T/cp·C = {E:,}, b = a = 4 (fp32)")
    terms = {"all-gather": "(cp-1)·2E·b + (cp-1)·2E·a"}
    terms["ring"] = "(cp-1)·2E·b + (cp-1)·2E·b + cp·2E·a"
    for name, ((forward, backward, kept), parts) in costs.items():
        print0(f"  {name:<10} sends {forward:,} + {backward:,} = {terms[name]}")
        held = " + ".join(f"{part} {n:,}" for part, n in parts.items())
        print0(f"  {'':<10} keeps {kept:,} for the backward = {held}")


ARGS = (add_arguments, check_args)  # what run_on_ranks takes after the docstring
