"""train.py · everything together: 3D-parallel (DP x TP x PP) GPT training, launched by torchrun.

The idea in one sentence: build the same GPT on every rank, cut it with tensor parallelism (04)
inside a node and pipeline parallelism (05) across nodes, replicate the result with data
parallelism (03), train it in mixed precision (06), and make every step checkpointed, resumable
bit for bit, evaluated, logged and measured.

The grid (DESIGN §4): rank = (pp_rank * dp + dp_rank) * tp + tp_rank, i.e.
torch.arange(world).view(pp, dp, tp). TP is fastest-varying, so TP peers share a node and its
NVLink; PP is slowest, so only pipeline sends cross nodes. For --dp 2 --tp 2 --pp 2 on 8 GPUs:

                   tp_rank 0        tp_rank 1
    pp 0, dp 0  |  rank 0         rank 1    |  embeddings + first half of the blocks,
    pp 0, dp 1  |  rank 2         rank 3    |  each rank with half of every matrix
    pp 1, dp 0  |  rank 4         rank 5    |  second half of the blocks + head + loss
    pp 1, dp 1  |  rank 6         rank 7    |
    TP groups: rows {0,1} {2,3} {4,5} {6,7}; DP groups: {0,2} {1,3} {4,6} {5,7};
    PP groups: {0,4} {1,5} {2,6} {3,7}.

Batch semantics (as Megatron): --batch-size B is the global batch in sequences per optimizer step;
each step runs m = B / (micro_batch_size * dp) microbatches per DP rank, which are gradient
accumulation steps without PP and the pipeline's microbatches with it. Any (dp, tp, pp, micro)
with the same B gives the same loss curve as one process (fp32, up to rounding): the tests prove
it.

Launch:
    python train.py                                          # laptop: prepares data, ~5 min CPU
    torchrun --standalone --nproc_per_node=8 train.py --dp 2 --tp 2 --pp 2
    torchrun --nnodes=N --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 \\
        train.py --model gpt2 --dp N --tp 8 ...              # a cluster (README: Slurm)
    python train.py --export out/run                         # one file from a sharded checkpoint
    python train.py --sample out/run/model.pt                # sample from an exported model

What changed from 06: nothing new is taught; it composes 01-06 and adds what a real run needs
(an LR schedule, clipping by the true global norm, evaluation, checkpoints, logging, plots).
"""

import argparse
import importlib
import json
import math
import os
import random
import resource
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

data_lib = importlib.import_module("01_data")
model_lib = importlib.import_module("02_model")
ddp_lib = importlib.import_module("03_ddp")
tp_lib = importlib.import_module("04_tensor_parallel")
pp_lib = importlib.import_module("05_pipeline")
mp_lib = importlib.import_module("06_mixed_precision")

# what `python 01_data.py --tokenizer T` writes, per T; the default --data-dir, prepared if missing
DEFAULT_DATA = {"bpe": "data/stdlib-bpe4096", "gpt2": "data/stdlib-gpt2",
                "char": "data/stdlib-char"}  # fmt: skip
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------------------------------------
# Config: one dataclass, filled by argparse, validated before any process group exists
# ---------------------------------------------------------------------------------------------
def opt(default, help: str):
    """A config field whose help text (what it does, and why its default) feeds --help."""
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    # parallelism (world_size must equal dp * tp * pp)
    dp: int = opt(1, "data-parallel size: replicas, each on its share of the batch (03)")
    tp: int = opt(
        1,
        "tensor-parallel size: every matrix split over this many ranks; keep it inside a node (04)",
    )
    pp: int = opt(
        1,
        "pipeline-parallel size: blocks cut into this many stages; the only "
        "dimension that should cross nodes (05)",
    )
    schedule: str = opt(
        "1f1b",
        "pipeline schedule: gpipe, 1f1b (at most pp microbatches of "
        "activations alive) or interleaved",
    )
    virtual_stages: int = opt(1, "model chunks per pipeline rank; > 1 needs interleaved")
    sequence_parallel: bool = opt(
        False, "with --tp: also shard LayerNorm/dropout activations along the sequence (04)"
    )
    zero: bool = opt(False, "ZeRO-1: shard the AdamW state over the data-parallel group (03)")
    # batch (DESIGN §4)
    batch_size: int = opt(
        32,
        "global batch in sequences per optimizer step, all DP ranks "
        "together (32 x 128 = 4,096 tokens on the CPU job)",
    )
    micro_batch_size: int = opt(8, "sequences per microbatch per DP rank")
    block_size: int = opt(
        0,
        "sequence length in tokens, and the model's context (it has no other positions: "
        "untrained ones would be garbage); 0 = the preset's context",
    )
    # model
    model: str = opt(
        "small",
        "02_model.py preset: "
        + ", ".join(model_lib.PRESETS)
        + " (small = 4 layers x 128 wide, for a CPU)",
    )
    n_layer: int = opt(0, "number of blocks; 0 = the preset's")
    dropout: float = opt(0.0, "dropout probability (pretraining on plenty of data needs none)")
    dtype: str = opt(
        "auto",
        "fp32, bf16 or fp16 (fp16 adds 06's dynamic loss scaler); auto = "
        "bf16 on a bf16-capable GPU, else fp32",
    )
    compile: bool = opt(False, "torch.compile each model chunk (GPU speed; slow first steps)")
    # optimizer: AdamW, linear warm-up, cosine decay
    max_steps: int = opt(
        500,
        "optimizer steps in the whole run, the LR schedule's length "
        "(500 x 4,096 tokens: the CPU job in about 5 minutes)",
    )
    lr: float = opt(3e-3, "peak learning rate (small models take large ones; GPT-2 used 6e-4)")
    warmup_steps: int = opt(50, "steps of linear warm-up from 0 to --lr")
    min_lr: float = opt(
        3e-4, "learning rate at the end of the cosine decay (a tenth, as Chinchilla)"
    )
    weight_decay: float = opt(
        0.1,
        "AdamW decay on matrices (embeddings too, as nanoGPT), not on biases or LayerNorm gains",
    )
    grad_clip: float = opt(1.0, "clip to this global L2 norm over all shards; 0 = off")
    # evaluation and logging
    eval_interval: int = opt(100, "steps between validation losses (and one at the end)")
    eval_steps: int = opt(10, "validation batches per evaluation (the same ones every time)")
    log_interval: int = opt(10, "steps between log lines and rows of metrics.jsonl")
    sample_tokens: int = opt(200, "tokens sampled at the end; 0 = no sample")
    # files
    out_dir: str = opt("out/run", "where metrics.jsonl, loss.png, checkpoints/, model.pt go")
    data_dir: str = opt(
        "",
        "train.bin/val.bin/meta.json from 01_data.py; empty = data/stdlib-bpe4096, -gpt2 or "
        "-char by --tokenizer, prepared automatically when missing",
    )
    tokenizer: str = opt(
        "",
        "the tokenizer of the data: bpe (4,096 tokens, trained on the corpus by 01_data.py), "
        "gpt2 or char; empty = bpe for the default data, else whatever --data-dir was made with",
    )
    ckpt_interval: int = opt(
        250, "steps between checkpoints; 0 = only at the end and on SIGTERM/SIGUSR1"
    )
    keep_checkpoints: int = opt(3, "how many complete checkpoints to keep")
    resume: bool = opt(False, "continue from the newest complete checkpoint in --out-dir")
    steps_this_run: int = opt(
        0,
        "stop after this many steps with a checkpoint, for "
        "time-limited jobs (the LR schedule still follows --max-steps)",
    )
    seed: int = opt(1337, "seed for the model init, the data order and dropout")


class ConfigError(ValueError):
    """A bad flag: reported as one line, before any process group exists."""


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description="Train a GPT with DP x TP x PP, mixed precision, checkpoints and exact resume.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool:
            ap.add_argument(flag, action="store_true", help=f.metadata["help"])
        else:
            ap.add_argument(flag, type=f.type, default=f.default, help=f.metadata["help"])
    ap.add_argument(
        "--export",
        metavar="RUN_DIR",
        help="consolidate the newest checkpoint of "
        "RUN_DIR into RUN_DIR/model.pt (one file, for 02_model.GPT), then exit",
    )
    ap.add_argument("--sample", metavar="MODEL_PT", help="sample from an exported model.pt, exit")
    ap.add_argument("--prompt", default="def ", help="prompt for --sample")
    args = ap.parse_args(argv)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    cfg.data_dir = cfg.data_dir or DEFAULT_DATA.get(cfg.tokenizer or "bpe", "")  # "": validate
    return cfg, args


def resolve_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else torch.float32
    return DTYPES[cfg.dtype]


def model_config(cfg: TrainConfig, vocab_size: int):
    """The GPTConfig: the preset with its context cut to --block-size (a model holds only the
    positions it trains: rows of wpe past T would stay random, and sampling past T would read
    them), and the data's vocabulary padded to 64 (TP splits it evenly)."""
    overrides = {"vocab_size": vocab_size, "dropout": cfg.dropout, "pad_vocab_multiple": 64}
    for name in ("block_size", "n_layer"):  # 0 = the preset's
        if getattr(cfg, name):
            overrides[name] = getattr(cfg, name)
    return model_lib.GPTConfig.from_preset(cfg.model, **overrides)


POSITIVE = ("dp", "tp", "pp", "virtual_stages", "batch_size", "micro_batch_size", "max_steps",
            "lr", "eval_steps", "log_interval", "keep_checkpoints")  # fmt: skip
NOT_NEGATIVE = ("block_size", "n_layer", "warmup_steps", "min_lr", "weight_decay", "grad_clip",
                "eval_interval", "sample_tokens", "ckpt_interval", "steps_this_run")  # fmt: skip


def check_flags(cfg: TrainConfig, world_size: int) -> None:
    """The checks that need no file: they run before anything is read, prepared or written."""
    for name in POSITIVE + NOT_NEGATIVE:
        value, positive = getattr(cfg, name), name in POSITIVE
        if not (value > 0 if positive else value >= 0):  # `not`: NaN fails too
            sign = ">" if positive else ">="
            raise ConfigError(f"--{name.replace('_', '-')} must be {sign} 0, got {value}")
    n = cfg.dp * cfg.tp * cfg.pp
    if n != world_size:
        raise ConfigError(
            f"world_size={world_size} but --dp {cfg.dp} x --tp {cfg.tp} x "
            f"--pp {cfg.pp} = {n}: launch {n} processes or change the sizes"
        )
    if not 0 <= cfg.dropout < 1:
        raise ConfigError(f"--dropout {cfg.dropout}: a probability, in [0, 1)")
    for flag, value, choices in (
        ("dtype", cfg.dtype, ("auto", *DTYPES)),
        ("model", cfg.model, tuple(model_lib.PRESETS)),
        ("schedule", cfg.schedule, ("gpipe", "1f1b", "interleaved")),
        ("tokenizer", cfg.tokenizer, ("", *DEFAULT_DATA)),
    ):
        if value not in choices:
            raise ConfigError(f"--{flag} {value}: use one of {', '.join(filter(None, choices))}")
    for flag, on, dim, size, what in (  # a flag that would silently do nothing is a mistake
        ("--zero", cfg.zero, "--dp", cfg.dp, "shards AdamW's state over the DP replicas"),
        ("--sequence-parallel", cfg.sequence_parallel, "--tp", cfg.tp, "shards over TP ranks"),
        ("--virtual-stages", cfg.virtual_stages > 1, "--pp", cfg.pp, "cuts pipeline ranks"),
    ):
        if on and size == 1:
            raise ConfigError(f"{flag} {what}, but {dim} is 1: it would do nothing")
    if cfg.virtual_stages > 1 and cfg.schedule != "interleaved":
        raise ConfigError(f"--virtual-stages {cfg.virtual_stages} needs --schedule interleaved")
    out = Path(cfg.out_dir)
    if (found := next(p for p in (out, *out.parents) if p.exists())).is_file():
        raise ConfigError(f"--out-dir {cfg.out_dir}: {found} is a file, not a folder")


def validate(cfg: TrainConfig, world_size: int, rank: int = 0):
    """Every check that needs no process group; each failure is one line naming the flag. The
    flags come first, so bad input writes nothing; then the default data is prepared if missing
    and the data, the model and the loader are checked."""
    check_flags(cfg, world_size)
    prepare_default_data(cfg, rank)
    meta = data_meta(cfg)
    made_with = meta["tokenizer"] if meta["tokenizer"] in ("gpt2", "char") else "bpe"  # or a path
    if cfg.tokenizer and cfg.tokenizer != made_with:
        raise ConfigError(
            f"--tokenizer {cfg.tokenizer}, but --data-dir {cfg.data_dir} was prepared with "
            f"{meta['tokenizer']}: pass --tokenizer {made_with}, or another --data-dir"
        )
    context = model_lib.PRESETS[cfg.model]["block_size"]
    if cfg.block_size > context:
        raise ConfigError(
            f"--block-size {cfg.block_size} exceeds the context of --model "
            f"{cfg.model} ({context} positions)"
        )
    try:  # GPTConfig's own checks (n_embd % n_head, ...): one line too
        gcfg = model_config(cfg, meta["vocab_size"])
    except ValueError as e:
        raise ConfigError(f"--model {cfg.model}: {e}") from None
    if gcfg.n_head % cfg.tp:
        raise ConfigError(
            f"--tp {cfg.tp} does not divide n_head={gcfg.n_head} of --model "
            f"{cfg.model}: each TP rank must hold whole attention heads"
        )
    stages = cfg.pp * cfg.virtual_stages
    if gcfg.n_layer < stages:
        raise ConfigError(
            f"n_layer={gcfg.n_layer} is fewer than --pp {cfg.pp} x "
            f"--virtual-stages {cfg.virtual_stages} = {stages} pipeline stages"
        )
    per_step = cfg.micro_batch_size * cfg.dp
    if cfg.batch_size % per_step:
        raise ConfigError(
            f"--batch-size {cfg.batch_size} is not divisible into microbatches of "
            f"--micro-batch-size {cfg.micro_batch_size} x --dp {cfg.dp} = {per_step}"
        )
    m = cfg.batch_size // per_step
    if cfg.schedule == "interleaved" and cfg.pp > 1 and m % cfg.pp:
        raise ConfigError(
            f"the interleaved schedule needs microbatches m={m} divisible by "
            f"--pp {cfg.pp}: change --batch-size or --micro-batch-size"
        )
    T = gcfg.block_size
    if cfg.sequence_parallel and T % cfg.tp:
        raise ConfigError(
            f"--sequence-parallel shards the {T} tokens of a sequence over "
            f"--tp {cfg.tp} ranks: use a --block-size divisible by {cfg.tp}"
        )
    try:  # what 04 and 05 check themselves, before any collective: one line each
        tp_lib.check_tp_config(gcfg, cfg.tp)
        pp_lib.check_config(cfg.schedule, cfg.pp, m, cfg.virtual_stages, gcfg.n_layer)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for split in ("train", "val"):  # the loader's own checks: a batch larger than the data, ...
        try:
            data_lib.DataLoader(cfg.data_dir, split, cfg.batch_size // cfg.dp, T, dp_size=cfg.dp)
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(f"--data-dir {cfg.data_dir}, {split} split: {e}") from None
    if cfg.resume:
        check_resume_layout(cfg)
    elif ckpts := complete_checkpoints(cfg.out_dir):  # never mix two runs in one folder
        raise ConfigError(
            f"--out-dir {cfg.out_dir} already holds checkpoints (newest: "
            f"{ckpts[0].name}): pass --resume to continue that run, or use "
            "another --out-dir"
        )
    return gcfg


def data_meta(cfg: TrainConfig) -> dict:
    path = Path(cfg.data_dir) / "meta.json"
    if not path.is_file():
        raise ConfigError(
            f"--data-dir {cfg.data_dir} has no prepared data (meta.json): run "
            f"`python 01_data.py --out {cfg.data_dir}` (see --help there)"
        )
    return json.loads(path.read_text())


def prepare_default_data(cfg: TrainConfig, rank: int) -> None:
    """The main job works from nothing: the standard library, tokenized as `python 01_data.py
    --tokenizer T` does (bpe: a 4,096-token BPE trained on it first). Rank 0 prepares it before
    any process group exists; the other ranks wait for meta.json."""
    kind = next((k for k, path in DEFAULT_DATA.items() if path == cfg.data_dir), None)
    meta = Path(cfg.data_dir) / "meta.json"
    if kind is None or meta.is_file():
        return
    if rank == 0:
        print(f"{cfg.data_dir} is missing: preparing it (python 01_data.py --tokenizer {kind})")
        try:
            data_lib.main(["--tokenizer", kind])
        except (RuntimeError, ValueError) as e:  # e.g. gpt2's files offline: 01 says what to do
            raise ConfigError(" ".join(str(e).split())) from None
    deadline = time.monotonic() + 600
    while not meta.is_file() and time.monotonic() < deadline:
        time.sleep(1)


# ---------------------------------------------------------------------------------------------
# The process grid (DESIGN §4): torch.arange(world).view(pp, dp, tp)
# ---------------------------------------------------------------------------------------------
@dataclass
class Grid:
    rank: int = 0
    world: int = 1
    dp: int = 1
    tp: int = 1
    pp: int = 1
    dp_rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    dp_group: object = None
    tp_group: object = None
    pp_group: object = None
    embed_group: object = None  # {first, last} pipeline stage, for the tied embeddings

    @property
    def pp_is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def pp_is_last(self) -> bool:
        return self.pp_rank == self.pp - 1


def build_grid(cfg: TrainConfig, rank: int, world: int) -> Grid:
    """Every rank creates every group, in the same order (dist.new_group is a collective over
    the world), and keeps the ones it belongs to."""
    grid = Grid(rank=rank, world=world, dp=cfg.dp, tp=cfg.tp, pp=cfg.pp)
    if world == 1:
        return grid
    g = torch.arange(world).view(cfg.pp, cfg.dp, cfg.tp)
    grid.pp_rank, grid.dp_rank, grid.tp_rank = (int(i) for i in (g == rank).nonzero()[0])

    def mine(rank_lists):
        found = None
        for ranks in rank_lists:
            group = dist.new_group(ranks)
            found = group if rank in ranks else found
        return found

    grid.tp_group = mine([g[p, d, :].tolist() for p in range(cfg.pp) for d in range(cfg.dp)])
    grid.dp_group = mine([g[p, :, t].tolist() for p in range(cfg.pp) for t in range(cfg.tp)])
    pp_lists = [g[:, d, t].tolist() for d in range(cfg.dp) for t in range(cfg.tp)]
    grid.pp_group = mine(pp_lists)
    if cfg.pp > 1:
        grid.embed_group = pp_lib.embedding_group(pp_lists)
    return grid


def all_reduce_sum(t: torch.Tensor, group, size: int) -> torch.Tensor:
    """SUM over a group (a no-op for a group of one). Never ReduceOp.AVG: gloo lacks it."""
    if size > 1:
        dist.all_reduce(t, group=group)
    return t


# ---------------------------------------------------------------------------------------------
# Building: model (02) -> TP shards (04) -> pipeline chunks (05) -> DP wrappers (03)
# ---------------------------------------------------------------------------------------------
@dataclass
class Run:
    """Everything one training step needs, built once."""

    cfg: TrainConfig
    grid: Grid
    gcfg: object  # 02_model.GPTConfig
    device: torch.device
    dtype: torch.dtype
    chunks: list  # this rank's model chunk(s), DP-wrapped when dp > 1
    optimizer: torch.optim.Optimizer
    scaler: object  # 06's DynamicLossScaler, enabled for fp16 only
    train: object  # 01's DataLoaders
    val: object
    T: int  # tokens per sequence
    m: int  # microbatches per step per DP rank

    def modules(self):
        return [getattr(c, "module", c) for c in self.chunks]


def build_chunks(cfg: TrainConfig, gcfg, grid: Grid, device: torch.device) -> list:
    torch.manual_seed(cfg.seed)  # the same full model on every rank, before any sharding
    model = model_lib.GPT(gcfg).to(device)
    if grid.tp > 1:
        tp_lib.apply_tensor_parallel(model, grid.tp_group, cfg.sequence_parallel, seed=cfg.seed)
    chunks = [model]
    if grid.pp > 1:
        chunks = pp_lib.split_model(model, grid.pp_rank, grid.pp, cfg.virtual_stages)
    if cfg.compile:
        for chunk in chunks:
            chunk.compile()  # in place: parameter names (and checkpoints) are unchanged
    if grid.dp > 1:
        chunks = [ddp_lib.DataParallel(c, group=grid.dp_group) for c in chunks]
    # Dropout streams (DESIGN §4), one seed each, none shared: replicated activations draw from
    # the default generator, seeded per (stage, replica) and so alike on TP peers (their copies
    # must stay copies); sharded ones (heads; with SP, token shards) from 04's tracker, seeded
    # seed + 1 + world + global rank, i.e. per (stage, replica, TP rank).
    torch.manual_seed(cfg.seed + 1 + grid.pp_rank * grid.dp + grid.dp_rank)  # < seed + 1 + world
    return chunks


def unique_params(params) -> list:
    """Each parameter once (a tied wte/lm_head inside one chunk is one tensor, two names)."""
    return list({id(p): p for p in params}.values())


def build_optimizer(cfg: TrainConfig, modules, grid: Grid, device: torch.device):
    """AdamW, decay on matrices only; fused on CUDA; ZeRO-1 over the DP group with --zero."""
    params = unique_params(p for m in modules for p in m.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    kwargs = dict(lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    if cfg.zero and grid.dp > 1:
        return ddp_lib.ZeroOptimizer(groups, torch.optim.AdamW, group=grid.dp_group, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def build_run(cfg: TrainConfig, gcfg, grid: Grid, device: torch.device) -> Run:
    T = gcfg.block_size  # the model's context is --block-size (model_config)
    dtype = resolve_dtype(cfg, device)
    chunks = build_chunks(cfg, gcfg, grid, device)
    modules = [getattr(c, "module", c) for c in chunks]
    optimizer = build_optimizer(cfg, modules, grid, device)
    scaler = mp_lib.make_scaler(dtype)  # group None: every rank of the world skips together
    per_rank = cfg.batch_size // cfg.dp
    loaders = [
        data_lib.DataLoader(
            cfg.data_dir, split, per_rank, T, cfg.seed, grid.dp_rank, cfg.dp, device
        )
        for split in ("train", "val")
    ]
    m = per_rank // cfg.micro_batch_size
    return Run(cfg, grid, gcfg, device, dtype, chunks, optimizer, scaler, *loaders, T, m)


# ---------------------------------------------------------------------------------------------
# One step
# ---------------------------------------------------------------------------------------------
def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to lr, then cosine decay to min_lr at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def act_shape(run: Run) -> tuple:
    """One microbatch's activation between pipeline stages (sequence parallel: T/tp rows)."""
    T = run.T // run.grid.tp if run.cfg.sequence_parallel else run.T
    return (run.cfg.micro_batch_size, T, run.gcfg.n_embd)


def forward_backward(run: Run, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Gradients of the step's mean loss in .grad; returns that loss (all ranks agree)."""
    g = run.grid
    # Every microbatch's token losses are SUMmed and divided by the step's token count over all
    # DP replicas (06), with PP or without, so ignored (-1) targets weigh as in one big batch.
    mbs = list(zip(x.split(run.cfg.micro_batch_size), y.split(run.cfg.micro_batch_size)))
    n_tokens = mp_lib.global_token_count(mbs, group=g.dp_group)
    if g.pp == 1:  # accumulation over m microbatches (06)
        share = mp_lib.accumulate_gradients(
            run.chunks[0], mbs, n_tokens, dp_size=g.dp, scaler=run.scaler, dtype=run.dtype
        )
        return all_reduce_sum(torch.tensor(share, device=run.device), g.dp_group, g.dp)
    with mp_lib.autocast_context(run.dtype, run.device.type):  # the pipeline's microbatches (05)
        result = pp_lib.pipeline_step(
            run.chunks,
            (x, y),
            run.m,
            run.cfg.schedule,
            g.pp_group,
            act_shape=act_shape(run),
            embed_group=g.embed_group,
            loss_scale=run.scaler.get_scale(),
            n_tokens=n_tokens,
            dp_size=g.dp,
        )
    loss = all_reduce_sum(result.loss.clone(), g.pp_group, g.pp)  # only the last stage has it
    return all_reduce_sum(loss, g.dp_group, g.dp)  # the replicas' shares add up to the loss


def global_grad_norm(run: Run) -> torch.Tensor:
    """The L2 norm of the whole model's gradient, the same on every rank: squares summed over
    TP shards (replicated parameters once: 04) and over pipeline stages (the tied copy on the
    last stage skipped: it equals the first stage's after 05's embedding all-reduce)."""
    params = []
    for mod in run.modules():
        skip = pp_lib.tied_parameter(mod) if run.grid.pp > 1 and not mod.is_first else None
        params += [p for p in mod.parameters() if p is not skip]
    params = unique_params(params)
    if run.grid.tp > 1:
        sq = tp_lib.grad_norm_squared(params, run.grid.tp_group, run.device)
    else:
        sq = sum(
            (p.grad.float().pow(2).sum() for p in params if p.grad is not None),
            torch.zeros((), device=run.device),
        )
    return all_reduce_sum(sq, run.grid.pp_group, run.grid.pp).sqrt()


def train_step(run: Run, step: int) -> dict:
    cfg = run.cfg
    x, y = run.train.get_batch(step)  # (B/dp, T): this DP rank's share of the global batch
    run.optimizer.zero_grad(set_to_none=True)
    loss = forward_backward(run, x, y)
    run.scaler.unscale_(run.optimizer)  # true gradients before measuring and clipping them
    norm = global_grad_norm(run)
    if cfg.grad_clip > 0:
        coef = torch.clamp(cfg.grad_clip / (norm + 1e-6), max=1.0)  # as clip_grad_norm_
        for p in unique_params(p for m in run.modules() for p in m.parameters()):
            if p.grad is not None:
                p.grad.mul_(coef)
    lr = lr_at(cfg, step)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.scaler.step(run.optimizer)  # skipped (on every rank) when fp16 gradients overflowed
    run.scaler.update()
    return {"loss": loss.item(), "lr": lr, "grad_norm": norm.item()}


@torch.no_grad()
def evaluate(run: Run, stop=lambda: False) -> float | None:
    """Mean validation loss over the same eval_steps batches every time; every rank runs the
    same collectives (the pipeline's sends, the SUMs over PP and DP). `stop` is asked before
    each batch (train() passes Preemption.agreed, a collective, so all ranks leave at the same
    batch): True ends the evaluation at once and returns None, so a preempted job saves in time."""
    for c in run.chunks:
        c.eval()
    total, stopped = torch.zeros((), device=run.device), False
    for i in range(run.cfg.eval_steps):
        if stopped := stop():
            break
        x, y = run.val.get_batch(i)
        with mp_lib.autocast_context(run.dtype, run.device.type):
            if run.grid.pp == 1:
                for xb, yb in zip(
                    x.split(run.cfg.micro_batch_size), y.split(run.cfg.micro_batch_size)
                ):
                    total += run.chunks[0](xb, yb)[1].float() / run.m
            else:
                total += pp_lib.pipeline_step(
                    run.chunks,
                    (x, y),
                    run.m,
                    run.cfg.schedule,
                    run.grid.pp_group,
                    act_shape=act_shape(run),
                    forward_only=True,
                ).loss
    for c in run.chunks:
        c.train()
    if stopped:
        return None  # preempted: train() saves and exits; half an evaluation is no loss
    total = all_reduce_sum(total, run.grid.pp_group, run.grid.pp)
    total = all_reduce_sum(total, run.grid.dp_group, run.grid.dp) / run.grid.dp
    return total.item() / run.cfg.eval_steps


# ---------------------------------------------------------------------------------------------
# Checkpoints (DESIGN §5): a folder per step, one shard per rank, atomic, the last K kept
# ---------------------------------------------------------------------------------------------
def ckpt_root(out_dir) -> Path:
    return Path(out_dir) / "checkpoints"


def complete_checkpoints(out_dir) -> list[Path]:
    """Complete checkpoints, newest first: a folder is renamed from .partial only when every
    rank's shard and meta.json are in it, so a crash mid-save leaves only a .partial behind."""
    root = ckpt_root(out_dir)
    found = [d for d in root.glob("step_*") if d.is_dir() and not d.name.endswith(".partial")]
    return sorted((d for d in found if (d / "meta.json").is_file()), reverse=True)


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def check_resume_layout(cfg: TrainConfig) -> None:
    """--resume continues the same run: shards are found by global rank and shaped by ZeRO and
    the virtual stages, and the batches are a function of the seed and the batch shape."""
    for ckpt in complete_checkpoints(cfg.out_dir):  # nothing to resume: start fresh (said later)
        try:
            saved = json.loads((ckpt / "meta.json").read_text())["config"]
        except (OSError, ValueError, KeyError):
            continue  # a damaged meta.json: load_checkpoint names it and falls back too
        for k in ("dp", "tp", "pp", "virtual_stages", "zero", "seed", "batch_size",
                  "micro_batch_size", "block_size"):  # fmt: skip
            if saved[k] != getattr(cfg, k):
                flag = "--" + k.replace("_", "-")
                raise ConfigError(
                    f"--resume: {ckpt} was written with {flag} {saved[k]}, this run has "
                    f"{flag} {getattr(cfg, k)}; resume with the same {flag} (or a new --out-dir)"
                )
        return


def rng_state(device: torch.device) -> dict:
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    npy = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            npy["keys"].numpy().astype(np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["gauss"],
        )
    )
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def atomic_write(path: Path, write) -> None:
    """`write(tmp)`, fsync, rename over `path`: readers see the old file or the new, never half."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_torch_save(obj, path: Path) -> None:
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def fsync_dir(path: Path) -> None:
    """A directory's entries (new names, renames) reach the disk only when it is fsynced."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def barrier(run: Run) -> None:
    if run.grid.world > 1:
        dist.barrier()


def save_checkpoint(run: Run, step: int) -> Path:
    """Every rank writes its shard into step_N.partial/; rank 0 then adds meta.json and renames
    the folder to step_N: the rename is the commit point."""
    root = ckpt_root(run.cfg.out_dir)
    final, partial = root / f"step_{step:07d}", root / f"step_{step:07d}.partial"
    if run.grid.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    barrier(run)
    mods = run.modules()
    tp_rng = getattr(mods[0], "tp_rng", None)  # 04's per-rank dropout stream
    shard = {
        "model": [m.state_dict() for m in mods],
        "optimizer": run.optimizer.state_dict(),
        "scaler": run.scaler.state_dict(),
        "rng": rng_state(run.device),
        "tp_rng": None if tp_rng is None else tp_rng.state_dict(),
        "step": step,  # the data position too: batches are a pure function of the step
        "data_position": list(run.train.position(step)),
        "config": asdict(run.cfg),
    }
    atomic_torch_save(shard, partial / shard_name(run.grid.rank))
    barrier(run)
    if run.grid.rank == 0:
        meta = {
            "step": step,
            "world": run.grid.world,
            "dp": run.cfg.dp,
            "tp": run.cfg.tp,
            "pp": run.cfg.pp,
            "model_config": asdict(run.gcfg),
            "tokenizer": tokenizer_path(data_meta(run.cfg)["tokenizer"]),
            "config": asdict(run.cfg),
        }
        atomic_write(partial / "meta.json", lambda p: p.write_text(json.dumps(meta, indent=1)))
        fsync_dir(partial)  # every shard's and meta.json's name, before the rename publishes them
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        fsync_dir(final.parent)  # the rename itself
        for old in complete_checkpoints(run.cfg.out_dir)[run.cfg.keep_checkpoints :]:
            shutil.rmtree(old, ignore_errors=True)
    barrier(run)
    return final


def load_checkpoint(run: Run) -> int:
    """Restore the newest checkpoint every rank can read; returns the step to continue from.

    A corrupt or truncated shard or meta.json is reported by name and the previous checkpoint is
    tried: all ranks vote (MIN of an ok flag), so they always agree on which one they load.

    subtle: shards load to the CPU, never to run.device. The RNG states must stay CPU byte
    tensors (torch.cuda.set_rng_state rejects CUDA ones); restore() copies the model and
    optimizer tensors to their parameters' device."""
    names = [d.name for d in complete_checkpoints(run.cfg.out_dir)]
    if run.grid.world > 1:  # rank 0's listing for all: a node with a stale view of a shared
        box = [names]  # filesystem must not cast a different number of votes (that hangs)
        dist.broadcast_object_list(box, src=0)
        names = box[0]
    for ckpt in (ckpt_root(run.cfg.out_dir) / name for name in names):
        path = ckpt / "meta.json"
        try:
            json.loads(path.read_text())["step"]  # export and the layout check need it too
            path = ckpt / shard_name(run.grid.rank)
            shard = torch.load(path, map_location="cpu", weights_only=True)
            ok = 1.0
        except Exception as e:  # noqa: BLE001 - any unreadable file: say which, try older
            print(
                f"[rank {run.grid.rank}] checkpoint file {path} is unreadable "
                f"({type(e).__name__}: {str(e)[:120]}); trying the previous checkpoint"
            )
            ok = 0.0
        if agree(run, ok, dist.ReduceOp.MIN) == 1.0:
            try:  # a shard that reads but does not fit (another model) is no damage: stop
                restore(run, shard)
                ok = 1.0
            except Exception as e:  # noqa: BLE001 - every rank must hear of it, or they hang
                print(f"[rank {run.grid.rank}] {path} does not fit this run: {str(e)[:200]}")
                ok = 0.0
            if agree(run, ok, dist.ReduceOp.MIN) < 1.0:
                raise SystemExit(f"--resume: {ckpt} does not fit this run on some rank (above)")
            ddp_lib.print0(f"resumed from {ckpt} (step {shard['step']})")
            return shard["step"] + 1
    ddp_lib.print0(
        f"--resume: no readable checkpoint in {ckpt_root(run.cfg.out_dir)}; starting from step 0"
    )
    return 0


def agree(run: Run, value: float, op) -> float:
    """`value` reduced over every rank (MIN: all ok; MAX: any asked), on run.device as NCCL
    needs; a world of one has no one to ask."""
    if run.grid.world == 1:
        return value
    t = torch.tensor(value, device=run.device)
    dist.all_reduce(t, op=op)
    return t.item()


def restore(run: Run, shard: dict) -> None:
    """A CPU shard into this rank's state: load_state_dict copies into the parameters (on their
    device), and torch's AdamW (ZeRO's too) casts its state to each parameter's device."""
    for mod, state in zip(run.modules(), shard["model"], strict=True):
        mod.load_state_dict(state)
    run.optimizer.load_state_dict(shard["optimizer"])
    if shard["scaler"]:
        run.scaler.load_state_dict(shard["scaler"])
    if shard["tp_rng"] is not None:
        run.modules()[0].tp_rng.load_state_dict(shard["tp_rng"])  # the tracker 04 attached
    set_rng_state(shard["rng"], run.device)


# ---------------------------------------------------------------------------------------------
# Export and sampling: one file, one process
# ---------------------------------------------------------------------------------------------
def export(run_dir) -> Path:
    """Merge the newest checkpoint's (tp, pp) shards into RUN_DIR/model.pt for 02_model.GPT.
    Only DP rank 0's shards are read: the other replicas hold the same weights. A damaged
    checkpoint (meta.json or a shard) is named and the previous one used, as --resume does."""
    for ckpt in complete_checkpoints(run_dir):
        try:
            meta = json.loads((ckpt / "meta.json").read_text())
            dp, tp, pp = meta["dp"], meta["tp"], meta["pp"]
            stages = []  # [pp_rank][tp_rank]: the model states of grid position (pp, dp=0, tp)
            for p in range(pp):
                files = [ckpt / shard_name(p * dp * tp + t) for t in range(tp)]
                stages.append([torch.load(f, "cpu", weights_only=True)["model"] for f in files])
            break
        except Exception as e:  # noqa: BLE001 - any unreadable file: say which, try older
            print(f"--export: {ckpt} is unreadable ({type(e).__name__}: {str(e)[:120]}); "
                  "trying the previous checkpoint")  # fmt: skip
    else:
        raise SystemExit(f"--export: no complete, readable checkpoint in {ckpt_root(run_dir)}")
    full = {}
    for shards in stages:
        for chunk_states in zip(*shards):  # this stage's chunks, each split over tp ranks
            full.update(tp_lib.merge_shards(list(chunk_states)) if tp > 1 else chunk_states[0])
    model = model_lib.GPT(model_lib.GPTConfig(**meta["model_config"]))
    model.load_state_dict(full, strict=True)  # every weight present, none left over
    out = Path(run_dir) / "model.pt"
    blob = {"model_config": meta["model_config"], "model": model.state_dict(), "step": meta["step"]}
    atomic_torch_save({**blob, "tokenizer": tokenizer_blob(meta["tokenizer"])}, out)
    return out


def tokenizer_path(name: str) -> str:
    """01_data's tokenizer name, with a saved BPE's path made absolute (any cwd can export)."""
    return name if name in ("gpt2", "char") else str(Path(name).resolve())


def tokenizer_blob(name: str):
    """The tokenizer inside model.pt, so that it samples from any directory: a name tiktoken or
    01_data rebuilds anywhere, or a BPE's own vocab (bytes), merges and special tokens, which
    torch.load(weights_only=True) accepts."""
    if name in ("gpt2", "char"):
        return name
    tok = data_lib.get_tokenizer(name)
    return {"vocab": tok.vocab, "merges": tok.merges, "special_tokens": list(tok.special_tokens)}


def load_exported(path) -> tuple:
    blob = torch.load(path, map_location="cpu", weights_only=True)
    model = model_lib.GPT(model_lib.GPTConfig(**blob["model_config"]))
    model.load_state_dict(blob["model"])
    return model, blob


def sample(model_pt, prompt: str, n_tokens: int, seed: int = 0) -> str:
    model, blob = load_exported(model_pt)
    t = blob["tokenizer"]  # a name (an older model.pt: a path), or a BPE's vocab and merges
    tok = data_lib.get_tokenizer(t) if isinstance(t, str) else data_lib.Tokenizer(**t)
    idx = torch.tensor([tok.encode(prompt) or [tok.eot_token]])
    out = model.generate(
        idx, n_tokens, temperature=0.8, top_k=50, generator=torch.Generator().manual_seed(seed)
    )
    return tok.decode(out[0].tolist())


# ---------------------------------------------------------------------------------------------
# Logging, preemption, plots
# ---------------------------------------------------------------------------------------------
class Logger:
    """Rank 0 prints one line per --log-interval and appends the same fields to metrics.jsonl."""

    def __init__(self, run: Run, start_step: int):
        self.run, self.path = run, Path(run.cfg.out_dir) / "metrics.jsonl"
        self.tokens_per_step = run.cfg.batch_size * run.T
        self.t_start, self.step_start = time.perf_counter(), start_step
        self.t_last, self.step_last = self.t_start, start_step - 1
        gpu = run.device.type == "cuda"
        name = torch.cuda.get_device_name(run.device) if gpu else "cpu"
        dtype_name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
        self.peak = model_lib.peak_flops(name, dtype_name[run.dtype]) if gpu else None
        self.flops = model_lib.flops_per_token(run.gcfg, run.T)
        if run.grid.rank == 0:
            self._truncate_after(start_step - 1)

    def _truncate_after(self, step: int) -> None:
        """On resume, drop rows a crashed run logged after its last checkpoint, and a torn line
        (half a row, as a kill mid-write leaves it); replaced atomically, so a kill now loses
        nothing."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.is_file():
            return
        rows = []
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    rows.append(line + "\n")
            except ValueError:  # JSONDecodeError: only a torn write makes one
                print(f"{self.path}: skipping a torn line {line[:60]!r}")
        atomic_write(self.path, lambda tmp: tmp.write_text("".join(rows)))

    def write(self, row: dict) -> None:
        if self.run.grid.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def train_row(self, step: int, stats: dict) -> None:
        now = time.perf_counter()
        tok_s = self.tokens_per_step * (step - self.step_last) / (now - self.t_last)
        self.t_last, self.step_last = now, step
        mfu = model_lib.mfu(tok_s, self.flops, self.run.grid.world, self.peak)
        mem = (
            torch.cuda.max_memory_allocated(self.run.device)
            if self.run.device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        )  # CPU: peak RSS
        eta = (
            (now - self.t_start)
            / (step + 1 - self.step_start)
            * (self.run.cfg.max_steps - step - 1)
        )
        row = {
            "kind": "train",
            "step": step,
            **stats,
            "tokens": (step + 1) * self.tokens_per_step,
            "tokens_per_s": tok_s,
            "tokens_per_s_per_gpu": tok_s / self.run.grid.world,
            "mfu": mfu,
            "peak_mem_gb": mem / 1e9,
            "eta_s": eta,
        }
        self.write(row)
        ddp_lib.print0(
            f"step {step:5d} | loss {stats['loss']:.4f} | lr {stats['lr']:.2e} | "
            f"norm {stats['grad_norm']:.3f} | {tok_s:,.0f} tok/s ({tok_s / self.run.grid.world:,.0f}"
            f"/gpu) | mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | "
            f"mem {mem / 1e9:.2f} GB | eta {eta / 60:.1f} min"
        )

    def val_row(self, step: int, val_loss: float) -> None:
        self.write(
            {
                "kind": "val",
                "step": step,
                "val_loss": val_loss,
                "tokens": (step + 1) * self.tokens_per_step,
            }
        )
        ddp_lib.print0(f"step {step:5d} | val loss {val_loss:.4f}")


class Preemption:
    """SIGTERM/SIGUSR1 (Slurm's warning, a spot instance going away) set a flag; at the next step
    boundary (and after each evaluation batch) the ranks agree (MAX): a signal to any one rank
    stops them all, at the same point, and they save a checkpoint and exit cleanly."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        self.requested = True

    def agreed(self, run: Run) -> bool:
        """A collective: call it at the same point on every rank."""
        return bool(agree(run, float(self.requested), dist.ReduceOp.MAX))


def plot_losses(out_dir) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(r) for r in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, key, style in (("train", "loss", "-"), ("val", "val_loss", "o-")):
        pts = [(r["tokens"], r[key]) for r in rows if r["kind"] == kind]
        if pts:
            ax.plot(*zip(*pts), style, label=f"{kind} loss")
    ax.set(xlabel="tokens seen", ylabel="cross-entropy (nats)", title="training run")
    ax.grid(alpha=0.3)
    ax.legend()
    path = Path(out_dir) / "loss.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------
def train(run: Run) -> None:
    cfg, preempt = run.cfg, Preemption()  # first: a signal during the load is honoured too
    if run.grid.rank == 0:  # a save killed midway leaves step_N.partial/, never to be completed
        for stale in ckpt_root(cfg.out_dir).glob("*.partial"):
            shutil.rmtree(stale, ignore_errors=True)
    start = load_checkpoint(run) if cfg.resume else 0
    log = Logger(run, start)
    stop = (
        cfg.max_steps if not cfg.steps_this_run else min(cfg.max_steps, start + cfg.steps_this_run)
    )
    last_saved, step = None, start - 1
    for step in range(start, stop):
        stats = train_step(run, step)
        if step % cfg.log_interval == 0 or step == stop - 1:
            log.train_row(step, stats)
        if cfg.eval_interval and step % cfg.eval_interval == 0:  # step 0: the baseline
            val = evaluate(run, lambda: preempt.agreed(run))  # None: preempted while evaluating
            if val is not None:
                log.val_row(step, val)
        if cfg.ckpt_interval and (step + 1) % cfg.ckpt_interval == 0:
            last_saved = save_checkpoint(run, step)
        if preempt.agreed(run):
            ddp_lib.print0(f"preemption signal: saving at step {step} and exiting")
            if last_saved is None or not last_saved.name.endswith(f"{step:07d}"):
                save_checkpoint(run, step)
            return
    if step >= start and (last_saved is None or not last_saved.name.endswith(f"{step:07d}")):
        save_checkpoint(run, step)
    if stop == cfg.max_steps and step >= start:
        if (val := evaluate(run, lambda: preempt.agreed(run))) is None:
            return  # preempted during the last evaluation: the checkpoint is saved, exit now
        log.val_row(step, val)
    finish(run, step)


def finish(run: Run, step: int) -> None:
    """Rank 0 exports the final checkpoint, samples from it on one process, and plots."""
    if run.grid.rank != 0:
        return
    out = Path(run.cfg.out_dir)
    model_pt = export(out)
    print(f"exported {model_pt} (step {step}); loss curve: {plot_losses(out)}")
    if run.cfg.sample_tokens:
        text = sample(model_pt, "\n", run.cfg.sample_tokens, seed=run.cfg.seed)
        print(f"--- sample ({run.cfg.sample_tokens} tokens) ---\n{text}\n---")


def main(argv=None) -> None:
    cfg, args = parse_args(argv)
    if args.export:
        print(f"wrote {export(args.export)}")
        return
    if args.sample:
        print(sample(args.sample, args.prompt, cfg.sample_tokens or 200, cfg.seed))
        return
    world = int(os.environ.get("WORLD_SIZE", 1))
    try:  # everything that can be checked, before any process group or file exists
        gcfg = validate(cfg, world, int(os.environ.get("RANK", 0)))
    except ConfigError as e:
        raise SystemExit(f"train.py: error: {e}") from None
    created = not dist.is_initialized()
    rank, _, world, device = ddp_lib.init_distributed()
    try:
        run = build_run(cfg, gcfg, build_grid(cfg, rank, world), device)
        ddp_lib.print0(
            f"world {world} = dp {cfg.dp} x tp {cfg.tp} x pp {cfg.pp} on {device}; "
            f"{run.modules()[0].config.n_layer}-layer GPT, {run.dtype}, "
            f"{run.m} microbatches of {cfg.micro_batch_size} x {run.T} per DP rank"
        )
        train(run)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
