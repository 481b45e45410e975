"""train.py's configuration: its flags and the checks needing no lesson.

Every field of TrainConfig is a command-line flag (`batch_size` is `--batch-size`); its
help text says what it does and why its default. The checks here raise ConfigError, one
line per bad flag, before any process group exists or any file is written. The checks
that need the model, the pipeline or the data loader stay in train.py, which passes in
the lessons' own lists of choices.
"""

import json
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from support.plan.shape import SHAPE, shape_problem

# What `python 01_data.py --tokenizer T` writes, per T: the default --data-dir,
# prepared if it is missing.
DEFAULT_DATA = {
    "bpe": "data/stdlib-bpe4096",
    "gpt2": "data/stdlib-gpt2",
    "char": "data/stdlib-char",
}


class ConfigError(ValueError):
    """A bad flag: reported as one line, before any process group exists."""


def flag(default, help: str):
    """A config field whose help text (what it does) feeds --help."""
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    """Every flag of train.py: its help text, and above it its default's reason."""

    # The parallel layout: one process by default, so a laptop runs it as it is.
    dp: int = flag(1, "data-parallel replicas, each on a share of the batch (03)")
    tp: int = flag(1, "tensor-parallel ranks splitting every matrix, in a node (04)")
    pp: int = flag(1, "pipeline stages; the only split that crosses nodes (05)")
    # Long sequences only: CP pays when activations of T tokens, not weights, fill memory.
    cp: int = flag(
        1,
        "context-parallel ranks, each holding 2 zigzag chunks of every sequence (08), "
        "for long --block-size: 2·cp must divide it; needs --dropout 0",
    )
    # 1F1B keeps at most pp microbatches' activations alive, GPipe all of them.
    schedule: str = flag("1f1b", "pipeline schedule: gpipe, 1f1b, interleaved or zb1")
    virtual_stages: int = flag(1, "model chunks per pipeline rank (> 1: interleaved)")
    sequence_parallel: bool = flag(False, "with --tp: shard LayerNorm by tokens (04b)")
    zero: int = flag(0, "ZeRO (07): 0 off, 1 AdamW's state, 2 + gradients, 3 + weights")
    grad_compression: str = flag("none", "DP's gradients: none, fp16, bf16, powersgd")
    powersgd_rank: int = flag(4, "powersgd: sketch rank r, (m + n)·r numbers a matrix")
    # Early training is the most sensitive to a sketched gradient.
    powersgd_warmup_steps: int = flag(10, "powersgd: exact all-reduces first")
    # 32 sequences of 128 tokens: a step a CPU takes in well under a second.
    batch_size: int = flag(32, "global batch: sequences per optimizer step, all ranks")
    micro_batch_size: int = flag(8, "sequences per microbatch per DP rank")
    # The preset's context: a shorter one would leave positions untrained. A longer one
    # sizes the learned position table (wpe) to it: check_block_size.
    block_size: int = flag(
        0,
        "tokens per sequence, the model's context; 0: the preset's. More than the "
        "preset's positions sizes wpe to it (--init-from copies the checkpoint's rows "
        "first; refused with --lora-rank if the checkpoint has fewer)",
    )
    # The small preset (4 layers of 128) trains on a CPU in minutes.
    model: str = flag("small", "02_model.py's preset (not given: --init-from's shape)")
    # The shape beside the preset (a Megatron-style one, say): 0 takes --model's.
    n_layer: int = flag(0, "number of blocks, L; 0: the preset's")
    n_head: int = flag(0, "attention heads, nh (--tp must divide it); 0: the preset's")
    n_embd: int = flag(0, "the width C, a multiple of nh; 0: the preset's")
    vocab_size: int = flag(
        0,
        "rows of wte, V (then padded to 64·tp); 0: the data's tokenizer's. More than "
        "the tokenizer's ids: rows no input holds, never sampled",
    )
    init_from: str = flag(
        "", "fine-tune a Hugging Face GPT-2: its folder (config.json, the weights)"
    )
    lora_rank: int = flag(0, "LoRA (02): train rank-r factors only; 0: off")
    # A fixed alpha roughly keeps the best learning rate as the rank changes.
    lora_alpha: float = flag(16.0, "LoRA: the update is (alpha / r)·B·A")
    # Pretraining on plenty of data needs no dropout.
    dropout: float = flag(0.0, "dropout probability")
    recompute: str = flag("none", "activations redone in the backward (06b)")
    # No GPU measurement favours chunked yet (issue 31.4): plain, the simple one.
    loss: str = flag(
        "plain",
        "plain, or chunked: 06b's lm_head + loss with no (B, T, V) logits kept; "
        "plain until a GPU measurement favours chunked",
    )
    # bf16 where the GPU has it; fp32 on a CPU, where 16 bits would be slower.
    dtype: str = flag(
        "auto", "fp32, bf16 or fp16 (06's loss scaler); auto: bf16 on a GPU that has it"
    )
    # Compiling costs minutes of first steps; it pays on a GPU only.
    compile: bool = flag(False, "torch.compile each model chunk")
    # 500 steps of 4,096 tokens: the CPU job in about 5 minutes.
    max_steps: int = flag(500, "optimizer steps, the LR schedule's length")
    # Small models take large learning rates; GPT-2 used 6e-4.
    lr: float = flag(3e-3, "peak learning rate")
    warmup_steps: int = flag(50, "steps of linear warm-up (--lr at step N - 1)")
    lr_schedule: str = flag("cosine", "then: cosine, wsd, cyclic or constant")
    # A tenth of the peak, as Chinchilla.
    min_lr: float = flag(3e-4, "the LR at the end of the decay, a cycle's bottom")
    decay_fraction: float = flag(0.2, "wsd: the share of the run that decays")
    cycle_steps: int = flag(100, "cyclic: steps from --lr to --min-lr and back")
    # On matrices only (embeddings too, as nanoGPT), never on biases and gains.
    weight_decay: float = flag(0.1, "AdamW's weight decay")
    grad_clip: float = flag(1.0, "clip to this global L2 norm over all shards; 0: off")
    eval_interval: int = flag(100, "steps between validation losses (and at the end)")
    eval_steps: int = flag(10, "validation batches per evaluation (the same each time)")
    log_interval: int = flag(10, "steps between log lines and rows of metrics.jsonl")
    sample_tokens: int = flag(200, "tokens sampled at the end; 0: no sample")
    out_dir: str = flag("out/run", "metrics.jsonl, loss.png, checkpoints/, model.pt")
    data_dir: str = flag(
        "",
        "01_data.py's shards and meta.json; empty: data/stdlib-bpe4096 (-gpt2, -char)",
    )
    # Empty: bpe's data, or whatever --data-dir was prepared with.
    tokenizer: str = flag(
        "",
        "bpe, gpt2 or char: the default data's (made if missing); empty: --data-dir's, or bpe",
    )
    ckpt_interval: int = flag(
        250, "steps between checkpoints; 0: only at the end and on a preemption signal"
    )
    keep_checkpoints: int = flag(3, "how many complete checkpoints to keep")
    resume: bool = flag(False, "continue from the newest complete checkpoint")
    # For time-limited jobs: the LR schedule still runs to --max-steps.
    steps_this_run: int = flag(
        0, "stop after this many steps, with a checkpoint; 0: all"
    )
    seed: int = flag(1337, "seed of the model's init, the data order and dropout")
    # A vote is an all-reduce and a sync. At 0.1-0.5 s a step on GPUs, 10 steps keep a
    # signal's wait under ~5 s, far inside Slurm's usual warning of a minute or more;
    # slower steps vote more often (support/train/checkpoint.Preemption: ~10 s apart at most).
    vote_interval: int = flag(
        10,
        "most steps between the ranks' votes on a preemption signal (fewer when a step is "
        "slow: votes ~10 s apart at most); a signal is acted on at the next vote, or at "
        "once during an evaluation",
    )
    # Rank 0 alone writes checkpoint metadata, maybe on slow storage.
    timeout_minutes: float = flag(10.0, "a collective waiting this long is an error")


# --loss: 02's loss of the whole (B, T, V) logits, or 06b's chunked linear + loss.
LOSSES = ("plain", "chunked")

# The numeric flags that must be > 0; every other number must be >= 0.
POSITIVE = (
    "dp",
    "tp",
    "pp",
    "cp",
    "virtual_stages",
    "batch_size",
    "micro_batch_size",
    "max_steps",
    "lr",
    "eval_steps",
    "log_interval",
    "keep_checkpoints",
    "cycle_steps",
    "powersgd_rank",
    "lora_alpha",
    "vote_interval",
    "timeout_minutes",
)


def flag_name(name: str) -> str:
    """A TrainConfig field's flag: batch_size -> --batch-size."""
    return "--" + name.replace("_", "-")


def check_numbers(cfg: TrainConfig) -> None:
    """Sizes and rates: POSITIVE's > 0, every other number >= 0.

    The checks are written with `not`, so that NaN fails them too.
    """
    for f in fields(TrainConfig):
        value = getattr(cfg, f.name)
        if f.type not in (int, float):
            continue
        if f.name in POSITIVE and not value > 0:
            raise ConfigError(f"{flag_name(f.name)} must be > 0, got {value}")
        if f.name not in POSITIVE and not value >= 0:
            raise ConfigError(f"{flag_name(f.name)} must be >= 0, got {value}")
    if not 0 <= cfg.dropout < 1:
        raise ConfigError(f"--dropout {cfg.dropout}: a probability, in [0, 1)")
    if cfg.min_lr > cfg.lr and cfg.lr_schedule != "constant":
        raise ConfigError(
            f"--min-lr {cfg.min_lr} exceeds --lr {cfg.lr}: the decay would climb"
        )
    if not 0 < cfg.decay_fraction <= 1:
        fraction = cfg.decay_fraction
        raise ConfigError(
            f"--decay-fraction {fraction}: a fraction of the run, in (0, 1]"
        )


def check_choices(cfg: TrainConfig, choices: dict) -> None:
    """Each named flag's value is one of its choices ("" may be one, left unlisted)."""
    for name, allowed in choices.items():
        value = getattr(cfg, name)
        if value not in allowed:
            listed = ", ".join(filter(None, allowed))
            raise ConfigError(f"{flag_name(name)} {value}: use one of {listed}")


def check_combinations(cfg: TrainConfig) -> None:
    """Flags that would silently do nothing, or that cannot work together."""
    compressed = cfg.grad_compression != "none"
    # Each row: the flag, whether it is on, the size it needs above 1, what it does.
    needs = (
        ("--zero", cfg.zero, "--dp x --cp", cfg.dp * cfg.cp, "shards over DP x CP"),
        (
            "--grad-compression",
            compressed,
            "--dp x --cp",
            cfg.dp * cfg.cp,
            "compresses DP's all-reduce",
        ),
        (
            "--sequence-parallel",
            cfg.sequence_parallel,
            "--tp",
            cfg.tp,
            "shards over TP ranks",
        ),
        (
            "--virtual-stages",
            cfg.virtual_stages > 1,
            "--pp",
            cfg.pp,
            "cuts pipeline ranks",
        ),
        (
            "--schedule zb1",
            cfg.schedule == "zb1",
            "--pp",
            cfg.pp,
            "splits PP's backward",
        ),
    )
    for name, on, dim, size, what in needs:
        if on and size == 1:
            raise ConfigError(f"{name} {what}, but {dim} is 1: it would do nothing")
    if compressed and cfg.zero:  # 03 compresses DataParallel's all-reduce only.
        raise ConfigError(
            f"--grad-compression with --zero {cfg.zero}: ZeRO reduce-scatters"
        )
    powersgd = cfg.grad_compression == "powersgd"
    for name in ("powersgd_rank", "powersgd_warmup_steps"):
        if getattr(cfg, name) != getattr(TrainConfig, name) and not powersgd:
            raise ConfigError(f"{flag_name(name)} needs --grad-compression powersgd")
    if cfg.lora_alpha != TrainConfig.lora_alpha and not cfg.lora_rank:
        raise ConfigError(
            "--lora-alpha scales LoRA's update, but --lora-rank is 0: LoRA is off"
        )
    if powersgd and cfg.lora_rank:  # A factor's sketch, (m + r)·r, is no smaller.
        raise ConfigError(
            "--grad-compression powersgd with --lora-rank: the factors are low-rank"
        )
    if powersgd and cfg.dtype == "fp16":
        why = "an overflowed step's inf would stay in its residuals: use bf16 or fp32"
        raise ConfigError(f"--grad-compression powersgd with --dtype fp16: {why}")
    if cfg.loss == "chunked" and cfg.tp > 1:  # 06b refuses 04's vocab-parallel loss.
        why = "a rank holds V/tp logit columns, whose max and sum need an all-reduce"
        raise ConfigError(f"--loss chunked with --tp {cfg.tp}: {why}")
    if cfg.cp > 1 and cfg.dropout:  # 08's ring computes no attention dropout.
        why = "the ring attention (08) has no dropout on attention weights"
        raise ConfigError(f"--dropout {cfg.dropout} with --cp {cfg.cp}: {why}")
    if cfg.zero > 3:
        raise ConfigError(f"--zero {cfg.zero}: a stage is 0 to 3")
    if cfg.zero == 3 and cfg.pp > 1:  # 03 refuses several chunks on one rank.
        why = "a stage re-gathers every block for every microbatch"
        raise ConfigError(f"--zero 3 with --pp: {why}")
    if cfg.schedule == "zb1":
        check_zero_bubble(cfg)


def check_zero_bubble(cfg: TrainConfig) -> None:
    """--schedule zb1 (05c's B/W split): the flags its split does not support, and why.
    Its W's run from a queue that B fills through F.linear and F.embedding."""
    refused = (
        (
            "--dtype fp16",
            cfg.dtype == "fp16",
            "06's loss scale is not proven with W yet",
        ),
        (
            "--recompute",
            cfg.recompute != "none",
            "a block's recomputed forward runs in B",
        ),
        ("--cp", cfg.cp > 1, "08's ring attention is not proven with the split yet"),
        (
            "--lora-rank",
            cfg.lora_rank > 0,
            "LoRA's factors are no F.linear: W is empty",
        ),
        (
            "--loss chunked",
            cfg.loss == "chunked",
            "06b's loss takes dW in its own pass",
        ),
        ("--compile", cfg.compile, "torch.compile does not trace 05c's function mode"),
        (
            "--sequence-parallel",
            cfg.sequence_parallel,
            "W would keep each column linear's all-gathered input: not proven yet",
        ),
        (
            "--grad-compression",
            cfg.grad_compression != "none",
            "03b's hooks with the sync in the last W are not proven yet",
        ),
    )
    for name, on, why in refused:
        if on:
            raise ConfigError(f"{name} with --schedule zb1: {why}")


def check_world(cfg: TrainConfig, world_size: int) -> None:
    """The grid dp x cp x tp x pp fills the world of processes exactly."""
    n = cfg.dp * cfg.cp * cfg.tp * cfg.pp
    if n != world_size:
        sizes = f"--dp {cfg.dp} x --cp {cfg.cp} x --tp {cfg.tp} x --pp {cfg.pp} = {n}"
        fix = f"launch {n} processes or change the sizes"
        raise ConfigError(f"world_size={world_size} but {sizes}: {fix}")


def check_batch(cfg: TrainConfig) -> None:
    """The global batch splits into whole microbatches on every DP rank."""
    per_step = cfg.micro_batch_size * cfg.dp
    if cfg.batch_size % per_step:
        split = (
            f"--micro-batch-size {cfg.micro_batch_size} x --dp {cfg.dp} = {per_step}"
        )
        what = f"--batch-size {cfg.batch_size} is not divisible into microbatches"
        raise ConfigError(f"{what} of {split}")


def check_out_dir_path(cfg: TrainConfig) -> None:
    """--out-dir can be a folder: the nearest path of it that exists is not a file."""
    out_dir = Path(cfg.out_dir)
    found = next(p for p in (out_dir, *out_dir.parents) if p.exists())
    if found.is_file():
        raise ConfigError(f"--out-dir {cfg.out_dir}: {found} is a file, not a folder")


def check_flags(cfg, world_size: int, choices: dict, presets: dict, check_pipeline):
    """Every check that needs no file, in order, each failure one ConfigError line.

    The lessons' own lists come in: `choices` (flag name -> allowed values), 02's
    `presets` (for the preset's n_layer) and, as `check_pipeline`, 05b's
    `check_config(schedule, pp, m, v, n_layer)`, whose asserts fail for a bad
    schedule, virtual stages without interleaving, fewer blocks than stages, and so on.
    """
    check_numbers(cfg)
    check_world(cfg, world_size)
    check_choices(cfg, {**choices, "tokenizer": ("", *DEFAULT_DATA), "loss": LOSSES})
    check_combinations(cfg)
    check_batch(cfg)
    problem = shape_problem(presets, cfg.model, given_shape(cfg), cfg.tp)
    if problem:  # --n-embd against --n-head, --n-head against --tp: one line.
        raise ConfigError(problem)
    n_layer = cfg.n_layer or presets[cfg.model]["n_layer"]
    m = cfg.batch_size // (cfg.micro_batch_size * cfg.dp)
    v = cfg.virtual_stages
    try:
        check_pipeline(cfg.schedule, cfg.pp, m, v, n_layer)
    except (ValueError, AssertionError) as e:
        where = f"--schedule {cfg.schedule} --pp {cfg.pp} --virtual-stages {v}"
        raise ConfigError(f"{where} --n-layer {n_layer}: {e}") from None
    check_out_dir_path(cfg)


def given_shape(cfg: TrainConfig) -> dict:
    """The shape flags given (not 0): GPTConfig's sizes over --model's preset."""
    return {k: getattr(cfg, k) for k in SHAPE if getattr(cfg, k)}


def model_sizes(cfg: TrainConfig, data_vocab: int | None) -> dict:
    """GPTConfig's sizes from the shape flags, over --model's preset: the vocabulary
    --vocab-size's, else the data's (`data_vocab`; None: the preset's). A vocabulary
    smaller than the data's tokenizer could not embed every id it writes."""
    sizes = given_shape(cfg)
    if data_vocab is None:
        return sizes
    if cfg.vocab_size and cfg.vocab_size < data_vocab:
        what = f"the tokenizer of --data-dir {cfg.data_dir} writes {data_vocab} ids"
        raise ConfigError(f"--vocab-size {cfg.vocab_size}: {what}; use at least that")
    return {"vocab_size": data_vocab, **sizes}


def check_block_size(cfg: TrainConfig, context: int) -> str:
    """--block-size against the preset's `context`: the line a run opens with when the
    model gets more positions than its preset, else "".

    More is allowed. GPT-2's positions are a learned table, wpe, one row a position: its
    1,024 rows are GPT-2's choice, not a limit of the architecture (attention has none).
    From scratch the table is simply sized to --block-size and trained like the rest.
    With --init-from, the checkpoint's rows are copied and the rows beyond them keep the
    model's init, so they start untrained: check_init_from refuses that only where they
    would stay so (LoRA freezes wpe). Sampling crops a prompt to the model's positions
    (02's generate), so a longer prompt is never an error.
    """
    if cfg.block_size <= context:
        return ""
    more = f"positions: {cfg.block_size:,} (the preset has {context:,})"
    if not cfg.init_from:
        return f"{more}: wpe holds a learned row for each, from the init"
    return f"{more}: wpe's first rows from --init-from, the others from the init"


def check_data(cfg: TrainConfig, T: int, loader_class) -> None:
    """Sequences of T tokens split over --tp (with SP), and the data holds a batch.

    `loader_class` is 01's DataLoader: building one runs its own checks (a batch larger
    than the data, a missing shard).
    """
    if cfg.cp > 1 and T % (2 * cfg.cp):  # 08's zigzag: 2·cp chunks (r and 2·cp-1-r)
        what = f"--block-size {T}: --cp {cfg.cp} cuts a sequence in {2 * cfg.cp} chunks"
        raise ConfigError(f"{what}; use a multiple of {2 * cfg.cp}")
    if cfg.sequence_parallel and (T // cfg.cp) % cfg.tp:  # A rank's T/cp, with CP.
        what = f"--sequence-parallel shards the {T // cfg.cp} tokens of a sequence"
        fix = f"use a --block-size divisible by {cfg.cp * cfg.tp}"
        raise ConfigError(f"{what} over --tp {cfg.tp} ranks: {fix}")
    for split in ("train", "val"):
        try:
            loader_class(
                cfg.data_dir, split, cfg.batch_size // cfg.dp, T, dp_size=cfg.dp
            )
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(
                f"--data-dir {cfg.data_dir}, {split} split: {e}"
            ) from None


PREPARE_WAIT_S = 600  # How long ranks other than 0 wait for the default data.


def prepare_default_data(cfg: TrainConfig, rank: int, prepare) -> None:
    """Rank 0 makes missing default data with `prepare(argv)`; the others wait.

    `prepare` is 01_data.main, as `python 01_data.py --tokenizer T` runs it.
    """
    kinds = [k for k, path in DEFAULT_DATA.items() if path == cfg.data_dir]
    meta = Path(cfg.data_dir) / "meta.json"
    if not kinds or meta.is_file():
        return
    if rank == 0:
        command = f"python 01_data.py --tokenizer {kinds[0]}"
        print(f"{cfg.data_dir} is missing: preparing it ({command})")
        try:
            prepare(["--tokenizer", kinds[0]])
        except SystemExit as e:
            # 01's one-line error (gpt2's files offline, say) already says what to do.
            raise ConfigError(str(e).removeprefix("01_data.py: error: ")) from None
    deadline = time.monotonic() + PREPARE_WAIT_S
    while not meta.is_file() and time.monotonic() < deadline:
        time.sleep(1)
    if not meta.is_file():  # Rank 0 failed, or wrote to a disk this node cannot see.
        where = "a folder every node shares, or prepare it before the launch"
        raise ConfigError(
            f"rank {rank} waited {PREPARE_WAIT_S} s for {meta}: use {where}"
        )


# --plan's vocabulary before any data exists: 01's default BPE (--vocab-size 4096) and
# GPT-2's. A char vocabulary is its corpus's own, so it needs the prepared data.
KNOWN_VOCAB = {"bpe": 4096, "gpt2": 50257}


def plan_vocab_size(cfg: TrainConfig) -> int:
    """--plan's vocabulary: the prepared data's (meta.json), else --tokenizer's (GPT-2's
    with --init-from); nothing is prepared."""
    if (Path(cfg.data_dir) / "meta.json").is_file():
        return read_data_meta(cfg)["vocab_size"]
    if cfg.vocab_size:  # The model's rows, whatever the tokenizer writes.
        return cfg.vocab_size
    made = [k for k, path in DEFAULT_DATA.items() if path == cfg.data_dir]
    kind = cfg.tokenizer or (made[0] if made else "gpt2" if cfg.init_from else "")
    if kind not in KNOWN_VOCAB:
        why = f"--data-dir {cfg.data_dir} has no meta.json to give the vocabulary"
        raise ConfigError(f"--plan: {why}: prepare it, or pass --tokenizer bpe or gpt2")
    return KNOWN_VOCAB[kind]


def read_data_meta(cfg: TrainConfig) -> dict:
    """--data-dir's meta.json, checked against --tokenizer."""
    path = Path(cfg.data_dir) / "meta.json"
    if not path.is_file():
        fix = f"run `python 01_data.py --out {cfg.data_dir}` (see --help there)"
        raise ConfigError(
            f"--data-dir {cfg.data_dir} has no prepared data (meta.json): {fix}"
        )
    meta = json.loads(path.read_text())
    # A saved BPE is recorded by its path: the data was made with "bpe".
    made_with = meta["tokenizer"] if meta["tokenizer"] in ("gpt2", "char") else "bpe"
    if cfg.tokenizer and cfg.tokenizer != made_with:
        was = f"--data-dir {cfg.data_dir} was prepared with {meta['tokenizer']}"
        fix = f"pass --tokenizer {made_with}, or another --data-dir"
        raise ConfigError(f"--tokenizer {cfg.tokenizer}, but {was}: {fix}")
    return meta


def check_init_from(cfg: TrainConfig, meta: dict, gpt_config, load_pretrained) -> str:
    """--init-from's checkpoint fits: GPT-2's tokenizer, and `gpt_config`'s shape. Returns
    the line a run opens with when the checkpoint has fewer positions, else "".

    `load_pretrained(path)` is 02's GPT.load_pretrained: a model with its `.config`.
    Whatever it raises on a missing, foreign or damaged file becomes one line.
    """
    if meta["tokenizer"] != "gpt2":  # GPT-2's weights read GPT-2's token ids only.
        tokenizer = meta["tokenizer"]
        what = f"{cfg.data_dir} is {tokenizer}'s"
        raise ConfigError(f"--init-from needs data of --tokenizer gpt2; {what}")
    have = read_init_from(cfg, load_pretrained).config
    keys = ("n_layer", "n_head", "n_embd", "vocab_size", "bias", "tie_embeddings")
    bad = [
        f"{k}={getattr(have, k)}"
        for k in keys
        if getattr(have, k) != getattr(gpt_config, k)
    ]
    # Any context: wpe's first rows are the checkpoint's (cut to --block-size, or the
    # rows beyond it keep the init: check_block_size), except under LoRA, which freezes
    # wpe, so those rows would never train.
    if bad:
        differ = ", ".join(bad)
        raise ConfigError(
            f"--init-from {cfg.init_from} has {differ}: not --model {cfg.model}'s"
        )
    if cfg.lora_rank and have.block_size < gpt_config.block_size:
        rows = f"positions {have.block_size:,}..{gpt_config.block_size - 1:,}"
        why = f"--lora-rank freezes wpe, so {rows} would never leave their random init"
        fix = f"use --block-size {have.block_size} or full fine-tuning"
        raise ConfigError(
            f"--init-from {cfg.init_from} has {have.block_size:,} "
            f"positions; {why}: {fix}"
        )
    if have.block_size >= gpt_config.block_size:
        return ""
    rows = f"wpe's rows {have.block_size:,}+ start from the init"
    of = f"{have.block_size:,} of the model's {gpt_config.block_size:,} positions"
    return f"--init-from has {of}: {rows}"


def read_init_from(cfg: TrainConfig, load_pretrained):
    """`load_pretrained(--init-from)`: whatever it raises on a missing, foreign or
    damaged file becomes one line."""
    try:
        return load_pretrained(cfg.init_from)
    except Exception as e:  # noqa: BLE001 - whatever the reader raises: one line.
        raise ConfigError(
            f"--init-from {cfg.init_from}: {' '.join(str(e).split())}"
        ) from None


def shape_of_init_from(cfg: TrainConfig, have, presets: dict) -> None:
    """Without --model: the preset of the checkpoint's width (`have`, its config: n_embd
    and n_head), and its n_layer where the preset's differs (unless --n-layer says)."""
    for name, preset in presets.items():
        if (preset["n_embd"], preset["n_head"]) == (have.n_embd, have.n_head):
            cfg.model = name
            if not cfg.n_layer and preset["n_layer"] != have.n_layer:
                cfg.n_layer = have.n_layer
            return
    shape = f"n_embd={have.n_embd}, n_head={have.n_head}"
    what = f"--init-from {cfg.init_from} has {shape}, which no preset of 02 has"
    flags = f"--n-layer {have.n_layer} --n-head {have.n_head} --n-embd {have.n_embd}"
    raise ConfigError(f"{what}: pass --model and {flags}")
