"""A GPT's shape as flags: --n-layer, --n-head, --n-embd, --vocab-size and --block-size
beside --model (02's preset, which sets the sizes no flag gives), in 09_plan.py and in
train.py (and its recipes). Their one check, one line naming the flags, and the shape's
line in a plan's and a run's report. Plumbing: 02 and 04 assert the same rules.
"""

# A GPT's shape: GPTConfig's sizes, each a flag of 09 and of train.py beside --model.
SHAPE = ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")


def shape_text(config) -> str:
    """A GPTConfig's shape as its flags name it, for a plan's or a run's first line."""
    return ", ".join(f"{k} {getattr(config, k)}" for k in SHAPE)


def shape_problem(presets: dict, model: str, given: dict, tp: int = 1) -> str | None:
    """What keeps --model's preset with the shape flags `given` (name -> value) from
    being built, in one line naming the flags (a value not given: "--model X's"), or
    None. 02 asks for positive sizes and whole heads (C a multiple of nh: each head
    has C/nh dims); 04 for whole heads on every TP rank. Neither asks more of the
    head size: 02 has no rotary embedding, and SDPA takes any head size (the fused
    flash kernel needs hs a multiple of 8 up to 256, else another kernel runs)."""
    shape = {**presets[model], **given}

    def name(key: str) -> str:
        value = f"--{key.replace('_', '-')} {shape[key]}"
        return value if key in given else f"{value} (--model {model}'s)"

    for key in given:  # A preset's own sizes are fine.
        if not (isinstance(given[key], int) and given[key] >= 1):
            return f"{name(key)}: a size, a positive integer"
    if shape["n_embd"] % shape["n_head"]:
        whole = "the width must be a multiple of the heads (02: C/nh dims a head)"
        return f"{name('n_embd')} does not split into {name('n_head')} heads: {whole}"
    if shape["n_head"] % tp:
        why = "a TP rank holds whole heads (04)"
        return f"--tp {tp} does not divide {name('n_head')}: {why}"
    return None
