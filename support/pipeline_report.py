"""The text of 05_pipeline.py's demo table: its header, a row per schedule, the notes."""

from support.distributed import print0


def header(p: int, m: int, where: str) -> None:
    print0(f"p={p} stages on {where}; m={m} microbatches of (b, T) = (4, 64), C=256")
    print0(f"{'':15}{'loss':>8}{'vs 1 proc':>10}{'vs GPipe':>9}{'bubble':>8}", end="")
    print0(f"{'simulated':>10}{'formula':>8}  peak alive (mb, chunk) per stage")


def footer(p: int, cores: int | None) -> None:
    print0("\nEvery row equals one process and naive GPipe (loss, gradients < 1e-5;")
    print0("'-': interleaving puts other layers in a chunk, so no chunk to compare).")
    print0("bubble: 1 - busy/span of one step as it ran; simulated: the same plan")
    print0("under NCCL's rule, t_b = 2 t_f, messages free; formula: (p-1)/(v·m+p-1).")
    if p > (cores or p):  # More ranks than cores: they time-share them.
        print0(f"{p} ranks time-share {cores} cores: measured differs from simulated.")
        print0("Medians over steps, and the measured figure: bench/bench_pipeline.py")


def row(name: str, v: int, loss, diffs, bubbles, peaks) -> None:
    """A schedule's row: its loss, max |Δgrad| from one process and from naive GPipe
    ("-" when v > 1: other layers per chunk), and the bubble (measured, simulated,
    formula)."""
    label = f"{name} v={v}" if v > 1 else name
    gpipe = f"{diffs[1]:.1e}" if v == 1 else "-"
    measured, simulated, formula = bubbles
    text = f"{label:<15}{loss:>8.4f}{diffs[0]:>10.1e}{gpipe:>9}"
    text += f"{measured:>8.1%}{simulated:>10.1%}{formula:>8.1%}"
    print0(f"{text}  {peaks}")
