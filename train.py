"""train.py · everything together: 3D-parallel (DP x TP x PP) GPT training, launched by torchrun.

The idea in one sentence: build the same GPT on every rank, cut it with tensor parallelism (04)
inside a node and pipeline parallelism (05) across nodes, replicate the result with data
parallelism (03), train it in mixed precision (06), and make every step checkpointed, resumable
bit for bit, evaluated, logged and measured.

The grid: rank = (pp_rank * dp + dp_rank) * tp + tp_rank, i.e.
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
each step runs m = B / (micro_batch_size * dp) microbatches per DP rank: gradient accumulation
steps without PP, the pipeline's microbatches with it. Any (dp, tp, pp, micro) with the same B
gives the same loss curve as one process (fp32, up to rounding), as the tests prove.

Launch:
    python train.py                                          # laptop: prepares data, ~4 min CPU
    torchrun --standalone --nproc_per_node=8 train.py --dp 2 --tp 2 --pp 2
    torchrun --nnodes=N --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 \\
        train.py --model gpt2 --dp N --tp 8 ...              # a cluster (docs/cluster.md: Slurm)
    python train.py --export out/run                         # one file from a sharded checkpoint
    python train.py --sample out/run/model.pt                # sample from an exported model

What changed from 06: nothing new is taught; it composes 01-06 and adds what a real run needs
(an LR schedule, clipping by the true global norm, evaluation, checkpoints, logging, plots), and
the machinery only it uses: the GPUs' peak FLOP/s behind MFU, and export's merge of TP shards.
"""

import argparse
import importlib
import json
import math
import os
import random
import re
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


# ----------------------------------------------------------- config: a dataclass filled by argparse
def flag(default, help: str):
    """A config field whose help text (what it does, and why its default) feeds --help."""
    return field(default=default, metadata={"help": help})


# fmt: off
@dataclass
class TrainConfig:
    # parallelism (world_size must equal dp * tp * pp)
    dp: int = flag(1, "data-parallel size: replicas, each on its share of the batch (03)")
    tp: int = flag(1, "tensor-parallel size: every matrix split over this many ranks; keep it inside a node (04)")
    pp: int = flag(1, "pipeline-parallel size: blocks cut into this many stages; the only dimension that "
                      "should cross nodes (05)")
    schedule: str = flag("1f1b", "pipeline schedule: gpipe, 1f1b (at most pp microbatches of activations alive) "
                                 "or interleaved")
    virtual_stages: int = flag(1, "model chunks per pipeline rank; > 1 needs interleaved")
    sequence_parallel: bool = flag(False, "with --tp: also shard LayerNorm/dropout activations along the sequence (04)")
    zero: bool = flag(False, "ZeRO-1: shard the AdamW state over the data-parallel group (03)")
    # batch (as Megatron: the global batch, in sequences)
    batch_size: int = flag(32, "global batch in sequences per optimizer step, all DP ranks together "
                               "(32 x 128 = 4,096 tokens on the CPU job)")
    micro_batch_size: int = flag(8, "sequences per microbatch per DP rank")
    block_size: int = flag(0, "sequence length in tokens, and the model's context (it has no other positions: "
                              "untrained ones would be garbage); 0 = the preset's context")
    # model
    model: str = flag("small", f"02_model.py preset: {', '.join(model_lib.PRESETS)} (small = 4 layers x 128 wide, "
                               "for a CPU)")
    n_layer: int = flag(0, "number of blocks; 0 = the preset's")
    dropout: float = flag(0.0, "dropout probability (pretraining on plenty of data needs none)")
    dtype: str = flag("auto", "fp32, bf16 or fp16 (fp16 adds 06's dynamic loss scaler); auto = bf16 on a "
                              "bf16-capable GPU, else fp32")
    compile: bool = flag(False, "torch.compile each model chunk (GPU speed; slow first steps)")
    # optimizer: AdamW, linear warm-up, cosine decay
    max_steps: int = flag(500, "optimizer steps in the whole run, the LR schedule's length (500 x 4,096 tokens: "
                               "the CPU job in about 5 minutes)")
    lr: float = flag(3e-3, "peak learning rate (small models take large ones; GPT-2 used 6e-4)")
    warmup_steps: int = flag(50, "steps of linear warm-up from 0 to --lr")
    min_lr: float = flag(3e-4, "learning rate at the end of the cosine decay (a tenth, as Chinchilla)")
    weight_decay: float = flag(0.1, "AdamW decay on matrices (embeddings too, as nanoGPT), not on biases or "
                                    "LayerNorm gains")
    grad_clip: float = flag(1.0, "clip to this global L2 norm over all shards; 0 = off")
    # evaluation and logging
    eval_interval: int = flag(100, "steps between validation losses (and one at the end)")
    eval_steps: int = flag(10, "validation batches per evaluation (the same ones every time)")
    log_interval: int = flag(10, "steps between log lines and rows of metrics.jsonl")
    sample_tokens: int = flag(200, "tokens sampled at the end; 0 = no sample")
    # files
    out_dir: str = flag("out/run", "where metrics.jsonl, loss.png, checkpoints/, model.pt go")
    data_dir: str = flag("", "train.bin/val.bin/meta.json from 01_data.py; empty = data/stdlib-bpe4096, -gpt2 "
                             "or -char by --tokenizer, prepared automatically when missing")
    tokenizer: str = flag("", "the tokenizer of the data: bpe (4,096 tokens, trained on the corpus by 01_data.py), "
                              "gpt2 or char; empty = bpe for the default data, else whatever --data-dir was made with")
    ckpt_interval: int = flag(250, "steps between checkpoints; 0 = only at the end and on SIGTERM/SIGUSR1")
    keep_checkpoints: int = flag(3, "how many complete checkpoints to keep")
    resume: bool = flag(False, "continue from the newest complete checkpoint in --out-dir")
    steps_this_run: int = flag(0, "stop after this many steps with a checkpoint, for time-limited jobs (the LR "
                                  "schedule still follows --max-steps)")
    seed: int = flag(1337, "seed for the model init, the data order and dropout")
# fmt: on

# which numeric flags must be > 0 and which >= 0 (check_flags)
POSITIVE = ("dp", "tp", "pp", "virtual_stages", "batch_size", "micro_batch_size", "max_steps",
            "lr", "eval_steps", "log_interval", "keep_checkpoints")  # fmt: skip
NOT_NEGATIVE = ("block_size", "n_layer", "warmup_steps", "min_lr", "weight_decay", "grad_clip",
                "eval_interval", "sample_tokens", "ckpt_interval", "steps_this_run")  # fmt: skip


class ConfigError(ValueError):
    """A bad flag: reported as one line, before any process group exists."""


def parse_args(argv=None):
    """TrainConfig's fields as flags (help: their metadata), plus the one-shot --export, --sample."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for f in fields(TrainConfig):
        kind = {"action": "store_true"} if f.type is bool else {"type": f.type}
        name = "--" + f.name.replace("_", "-")
        parser.add_argument(name, default=f.default, help=f.metadata["help"], **kind)
    export = (
        "consolidate RUN_DIR's newest checkpoint into one file for 02_model.GPT, RUN_DIR/model.pt"
    )
    parser.add_argument("--export", metavar="RUN_DIR", help=export + ", then exit")
    parser.add_argument(
        "--sample", metavar="MODEL_PT", help="sample from an exported model.pt, exit"
    )
    parser.add_argument("--prompt", default="def ", help="prompt for --sample")
    args = parser.parse_args(argv)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    cfg.data_dir = cfg.data_dir or DEFAULT_DATA.get(cfg.tokenizer or "bpe", "")  # "": validate
    return cfg, args


def resolve_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else torch.float32
    return mp_lib.DTYPES[cfg.dtype]


def model_config(cfg: TrainConfig, vocab_size: int):
    """The GPTConfig: the preset with its context cut to --block-size (a model holds only the
    positions it trains: rows of wpe past T would stay random, and sampling past T would read
    them), and the data's vocabulary padded to 64 (TP splits it evenly)."""
    overrides = {"vocab_size": vocab_size, "dropout": cfg.dropout, "pad_vocab_multiple": 64}
    for name in ("block_size", "n_layer"):  # 0 = the preset's
        if getattr(cfg, name):
            overrides[name] = getattr(cfg, name)
    return model_lib.GPTConfig.from_preset(cfg.model, **overrides)


# -------------------------------------- validation: one line per bad flag, before any process group
def check_flags(cfg: TrainConfig, world_size: int) -> None:
    """The checks that need no file: they run before anything is read, prepared or written."""
    for name in POSITIVE + NOT_NEGATIVE:
        value, sign = getattr(cfg, name), ">" if name in POSITIVE else ">="
        if not (value > 0 if sign == ">" else value >= 0):  # `not`: NaN fails too
            raise ConfigError(f"--{name.replace('_', '-')} must be {sign} 0, got {value}")
    if (n := cfg.dp * cfg.tp * cfg.pp) != world_size:
        sizes = f"--dp {cfg.dp} x --tp {cfg.tp} x --pp {cfg.pp} = {n}"
        raise ConfigError(
            f"world_size={world_size} but {sizes}: launch {n} processes or change the sizes"
        )
    if not 0 <= cfg.dropout < 1:
        raise ConfigError(f"--dropout {cfg.dropout}: a probability, in [0, 1)")
    for name, value, choices in (
        ("dtype", cfg.dtype, ("auto", *mp_lib.DTYPES)),
        ("model", cfg.model, tuple(model_lib.PRESETS)),
        ("tokenizer", cfg.tokenizer, ("", *DEFAULT_DATA)),
    ):
        if value not in choices:
            raise ConfigError(f"--{name} {value}: use one of {', '.join(filter(None, choices))}")
    for name, on, dim, size, what in (  # a flag that would silently do nothing is a mistake
        ("--zero", cfg.zero, "--dp", cfg.dp, "shards AdamW's state over the DP replicas"),
        ("--sequence-parallel", cfg.sequence_parallel, "--tp", cfg.tp, "shards over TP ranks"),
        ("--virtual-stages", cfg.virtual_stages > 1, "--pp", cfg.pp, "cuts pipeline ranks"),
    ):
        if on and size == 1:
            raise ConfigError(f"{name} {what}, but {dim} is 1: it would do nothing")
    check_microbatches(cfg)
    out = Path(cfg.out_dir)
    if (found := next(p for p in (out, *out.parents) if p.exists())).is_file():
        raise ConfigError(f"--out-dir {cfg.out_dir}: {found} is a file, not a folder")


def check_microbatches(cfg: TrainConfig) -> None:
    """The batch splits into m whole microbatches per DP rank, and 05 accepts the pipeline: a
    known schedule, virtual stages only interleaved, m divisible by pp there, a block per stage."""
    if cfg.batch_size % (per_step := cfg.micro_batch_size * cfg.dp):
        split = f"--micro-batch-size {cfg.micro_batch_size} x --dp {cfg.dp} = {per_step}"
        raise ConfigError(
            f"--batch-size {cfg.batch_size} is not divisible into microbatches of {split}"
        )
    n_layer, v = cfg.n_layer or model_lib.PRESETS[cfg.model]["n_layer"], cfg.virtual_stages
    try:
        pp_lib.check_config(cfg.schedule, cfg.pp, cfg.batch_size // per_step, v, n_layer)
    except ValueError as e:
        where = f"--schedule {cfg.schedule} --pp {cfg.pp} --virtual-stages {v} --n-layer {n_layer}"
        raise ConfigError(f"{where}: {e}") from None


def validate(cfg: TrainConfig, world_size: int, rank: int = 0):
    """Every check that needs no process group, in one line naming the flag; returns the
    GPTConfig. The flags come first, so bad input writes nothing; then the default data is
    prepared if missing, and the data, the model and the loader are checked."""
    check_flags(cfg, world_size)
    prepare_default_data(cfg, rank)
    meta = data_meta(cfg)
    made_with = meta["tokenizer"] if meta["tokenizer"] in ("gpt2", "char") else "bpe"  # or a path
    if cfg.tokenizer and cfg.tokenizer != made_with:
        raise ConfigError(
            f"--tokenizer {cfg.tokenizer}, but --data-dir {cfg.data_dir} was prepared with "
            f"{meta['tokenizer']}: pass --tokenizer {made_with}, or another --data-dir"
        )
    if cfg.block_size > (context := model_lib.PRESETS[cfg.model]["block_size"]):
        preset = f"--model {cfg.model} ({context} positions)"
        raise ConfigError(f"--block-size {cfg.block_size} exceeds the context of {preset}")
    try:  # GPTConfig's own checks (n_embd % n_head, ...), then 04's (whole heads per TP rank, ...)
        gpt_config = model_config(cfg, meta["vocab_size"])
        tp_lib.check_tp_config(gpt_config, cfg.tp)
    except ValueError as e:
        raise ConfigError(f"--model {cfg.model} --tp {cfg.tp}: {e}") from None
    T = gpt_config.block_size
    if cfg.sequence_parallel and T % cfg.tp:
        raise ConfigError(
            f"--sequence-parallel shards the {T} tokens of a sequence over --tp {cfg.tp} ranks: "
            f"use a --block-size divisible by {cfg.tp}"
        )
    for split in ("train", "val"):  # the loader's own checks: a batch larger than the data, ...
        try:
            data_lib.DataLoader(cfg.data_dir, split, cfg.batch_size // cfg.dp, T, dp_size=cfg.dp)
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(f"--data-dir {cfg.data_dir}, {split} split: {e}") from None
    if cfg.resume:
        check_resume_layout(cfg)
    elif ckpts := complete_checkpoints(cfg.out_dir):  # never mix two runs in one folder
        fix = "pass --resume to continue that run, or use another --out-dir"
        raise ConfigError(
            f"--out-dir {cfg.out_dir} already holds checkpoints (newest: {ckpts[0].name}): {fix}"
        )
    return gpt_config


def data_meta(cfg: TrainConfig) -> dict:
    path = Path(cfg.data_dir) / "meta.json"
    if not path.is_file():
        fix = f"run `python 01_data.py --out {cfg.data_dir}` (see --help there)"
        raise ConfigError(f"--data-dir {cfg.data_dir} has no prepared data (meta.json): {fix}")
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
        except SystemExit as e:  # 01's one-line error (e.g. gpt2's files offline) says what to do
            raise ConfigError(str(e).removeprefix("01_data.py: error: ")) from None
    deadline = time.monotonic() + 600
    while not meta.is_file() and time.monotonic() < deadline:
        time.sleep(1)


# ----------------------------------------------- the process grid: arange(world).view(pp, dp, tp)
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
    ranks = torch.arange(world).view(cfg.pp, cfg.dp, cfg.tp)  # ranks[pp_rank, dp_rank, tp_rank]
    grid.pp_rank, grid.dp_rank, grid.tp_rank = (int(i) for i in (ranks == rank).nonzero()[0])

    def mine(rank_lists):
        found = None
        for members in rank_lists:
            group = dist.new_group(members)
            found = group if rank in members else found
        return found

    grid.tp_group = mine([ranks[p, d, :].tolist() for p in range(cfg.pp) for d in range(cfg.dp)])
    grid.dp_group = mine([ranks[p, :, t].tolist() for p in range(cfg.pp) for t in range(cfg.tp)])
    pp_lists = [ranks[:, d, t].tolist() for d in range(cfg.dp) for t in range(cfg.tp)]
    grid.pp_group = mine(pp_lists)
    if cfg.pp > 1:
        grid.embed_group = pp_lib.embedding_group(pp_lists)
    return grid


def all_reduce_sum(t: torch.Tensor, group, size: int) -> torch.Tensor:
    """SUM over a group (a no-op for a group of one). Never ReduceOp.AVG: gloo lacks it."""
    if size > 1:
        dist.all_reduce(t, group=group)
    return t


# --------------- building: model (02) -> TP shards (04) -> pipeline chunks (05) -> DP wrappers (03)
@dataclass
class Run:
    """Everything one training step needs, built once."""

    cfg: TrainConfig
    grid: Grid
    gpt_config: object  # 02_model.GPTConfig
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


def build_chunks(cfg: TrainConfig, gpt_config, grid: Grid, device: torch.device) -> list:
    torch.manual_seed(cfg.seed)  # the same full model on every rank, before any sharding
    model = model_lib.GPT(gpt_config).to(device)
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
    # Dropout streams, one seed each, none shared: replicated activations draw from
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
    params = unique_params(p for mod in modules for p in mod.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    kwargs = dict(lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    if cfg.zero and grid.dp > 1:
        return ddp_lib.ZeroOptimizer(groups, torch.optim.AdamW, group=grid.dp_group, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def build_run(cfg: TrainConfig, gpt_config, grid: Grid, device: torch.device) -> Run:
    T, dtype = gpt_config.block_size, resolve_dtype(cfg, device)  # context = --block-size
    chunks = build_chunks(cfg, gpt_config, grid, device)
    optimizer = build_optimizer(cfg, [getattr(c, "module", c) for c in chunks], grid, device)
    scaler = mp_lib.make_scaler(dtype)  # group None: every rank of the world skips together
    per_rank = cfg.batch_size // cfg.dp  # this DP rank's share of every batch
    loader_args = (per_rank, T, cfg.seed, grid.dp_rank, cfg.dp, device)
    loaders = [data_lib.DataLoader(cfg.data_dir, split, *loader_args) for split in ("train", "val")]
    m = per_rank // cfg.micro_batch_size
    return Run(cfg, grid, gpt_config, device, dtype, chunks, optimizer, scaler, *loaders, T, m)


# ----------------------------------------------------------------------------------------- one step
def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to lr, then cosine decay to min_lr at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def pipeline(run: Run, x: torch.Tensor, y: torch.Tensor, **kwargs):
    """05's pipeline_step on this rank's chunks (training and evaluation); only the last stage's
    result holds the loss. Stages pass one microbatch's activation: (b, T, C), T/tp rows with SP."""
    T = run.T // run.grid.tp if run.cfg.sequence_parallel else run.T
    kwargs["act_shape"] = (run.cfg.micro_batch_size, T, run.gpt_config.n_embd)
    return pp_lib.pipeline_step(
        run.chunks, (x, y), run.m, run.cfg.schedule, run.grid.pp_group, **kwargs
    )


def forward_backward(run: Run, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Gradients of the step's mean loss in .grad; returns that loss (all ranks agree)."""
    grid, b = run.grid, run.cfg.micro_batch_size
    # Every microbatch's token losses are SUMmed and divided by the step's token count over all
    # DP replicas (06), with PP or without, so ignored (-1) targets weigh as in one big batch.
    microbatches = list(zip(x.split(b), y.split(b)))
    n_tokens = mp_lib.global_token_count(microbatches, group=grid.dp_group)
    if grid.pp == 1:  # accumulation over m microbatches (06)
        kwargs = dict(dp_size=grid.dp, scaler=run.scaler, dtype=run.dtype)
        share = mp_lib.accumulate_gradients(run.chunks[0], microbatches, n_tokens, **kwargs)
        return all_reduce_sum(torch.tensor(share, device=run.device), grid.dp_group, grid.dp)
    kwargs = dict(embed_group=grid.embed_group, loss_scale=run.scaler.get_scale(), dp_size=grid.dp)
    with mp_lib.autocast_context(run.dtype, run.device.type):  # the pipeline's microbatches (05)
        loss = pipeline(run, x, y, n_tokens=n_tokens, **kwargs).loss.clone()
    loss = all_reduce_sum(loss, grid.pp_group, grid.pp)  # only the last stage had it
    return all_reduce_sum(loss, grid.dp_group, grid.dp)  # the replicas' shares add up to the loss


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
        squares = tp_lib.grad_norm_squared(params, run.grid.tp_group, run.device)
    else:
        grads = (p.grad for p in params if p.grad is not None)
        squares = sum((g.float().pow(2).sum() for g in grads), torch.zeros((), device=run.device))
    return all_reduce_sum(squares, run.grid.pp_group, run.grid.pp).sqrt()


def train_step(run: Run, step: int) -> dict:
    cfg = run.cfg
    x, y = run.train.get_batch(step)  # (B/dp, T): this DP rank's share of the global batch
    run.optimizer.zero_grad(set_to_none=True)
    loss = forward_backward(run, x, y)
    run.scaler.unscale_(run.optimizer)  # true gradients before measuring and clipping them
    norm = global_grad_norm(run)
    if cfg.grad_clip > 0:
        coef = torch.clamp(cfg.grad_clip / (norm + 1e-6), max=1.0)  # as clip_grad_norm_
        for p in unique_params(p for mod in run.modules() for p in mod.parameters()):
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
    total, stopped, b = torch.zeros((), device=run.device), False, run.cfg.micro_batch_size
    for i in range(run.cfg.eval_steps):
        if stopped := stop():
            break
        x, y = run.val.get_batch(i)
        with mp_lib.autocast_context(run.dtype, run.device.type):
            if run.grid.pp > 1:  # the last stage's mean over the m microbatches; 0 elsewhere
                total += pipeline(run, x, y, forward_only=True).loss
            else:
                for xb, yb in zip(x.split(b), y.split(b)):
                    total += run.chunks[0](xb, yb)[1].float() / run.m
    for c in run.chunks:
        c.train()
    if stopped:
        return None  # preempted: train() saves and exits; half an evaluation is no loss
    total = all_reduce_sum(total, run.grid.pp_group, run.grid.pp)
    total = all_reduce_sum(total, run.grid.dp_group, run.grid.dp) / run.grid.dp
    return total.item() / run.cfg.eval_steps


# ---------- checkpoints: a folder per step, one shard per rank, atomic, the last K kept
def ckpt_root(out_dir) -> Path:
    return Path(out_dir) / "checkpoints"


def complete_checkpoints(out_dir) -> list[Path]:
    """Complete checkpoints, newest first: a folder is renamed from .partial only when every
    rank's shard and meta.json are in it, so a crash mid-save leaves only a .partial behind."""
    found = [d for d in ckpt_root(out_dir).glob("step_*") if not d.name.endswith(".partial")]
    return sorted((d for d in found if (d / "meta.json").is_file()), reverse=True)


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


# what a resumed run must share with the checkpoint: shards are found by global rank and shaped
# by ZeRO and the virtual stages, and the batches are a function of the seed and the batch shape
RESUME_KEYS = ("dp", "tp", "pp", "virtual_stages", "zero", "seed", "batch_size",
               "micro_batch_size", "block_size")  # fmt: skip


def check_resume_layout(cfg: TrainConfig) -> None:
    """--resume continues the same run: RESUME_KEYS as the newest readable checkpoint has them."""
    for ckpt in complete_checkpoints(cfg.out_dir):  # nothing to resume: start fresh (said later)
        try:
            saved = json.loads((ckpt / "meta.json").read_text())["config"]
        except (OSError, ValueError, KeyError):
            continue  # a damaged meta.json: load_checkpoint names it and falls back too
        for k in RESUME_KEYS:
            if saved[k] != getattr(cfg, k):
                name = "--" + k.replace("_", "-")
                raise ConfigError(
                    f"--resume: {ckpt} was written with {name} {saved[k]}, this run has "
                    f"{name} {getattr(cfg, k)}; resume with the same {name} (or a new --out-dir)"
                )
        return


def rng_state(device: torch.device) -> dict:
    """Every generator a step draws from, as values torch.load(weights_only=True) accepts."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    keys = torch.from_numpy(keys.astype(np.int64))
    numpy = {"keys": keys, "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)}
    state = {"python": random.getstate(), "torch": torch.get_rng_state(), "numpy": numpy}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    numpy = state["numpy"]
    keys = numpy["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, numpy["pos"], numpy["has_gauss"], numpy["gauss"]))
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def atomic_torch_save(obj, path: Path) -> None:
    data_lib.atomic_write(path, lambda tmp: torch.save(obj, tmp))


def barrier(run: Run) -> None:
    if run.grid.world > 1:
        dist.barrier()


def save_checkpoint(run: Run, step: int) -> None:
    """Every rank writes its shard into step_N.partial/; rank 0 then adds meta.json and renames
    the folder to step_N: the rename is the commit point."""
    cfg, root = run.cfg, ckpt_root(run.cfg.out_dir)
    final, partial = root / f"step_{step:07d}", root / f"step_{step:07d}.partial"
    if run.grid.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    barrier(run)
    modules = run.modules()
    tp_rng = getattr(modules[0], "tp_rng", None)  # 04's per-rank dropout stream
    shard = {
        "model": [mod.state_dict() for mod in modules],
        "optimizer": run.optimizer.state_dict(),
        "scaler": run.scaler.state_dict(),
        "rng": rng_state(run.device),
        "tp_rng": None if tp_rng is None else tp_rng.state_dict(),
        "step": step,  # the data position too: batches are a pure function of the step
        "data_position": list(run.train.position(step)),
        "config": asdict(cfg),
    }
    atomic_torch_save(shard, partial / shard_name(run.grid.rank))  # the folder fsynced after it
    barrier(run)
    if run.grid.rank == 0:
        tokenizer = data_meta(cfg)["tokenizer"]  # a saved BPE's path made absolute: any cwd exports
        tokenizer = tokenizer if tokenizer in ("gpt2", "char") else str(Path(tokenizer).resolve())
        meta = {"step": step, "world": run.grid.world, "dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp}
        meta.update(model_config=asdict(run.gpt_config), tokenizer=tokenizer, config=asdict(cfg))
        data_lib.atomic_write(
            partial / "meta.json", lambda p: p.write_text(json.dumps(meta, indent=1))
        )
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)  # every shard's and meta.json's name already on disk
        data_lib.fsync_dir(root)  # the rename itself
        for old in complete_checkpoints(cfg.out_dir)[cfg.keep_checkpoints :]:
            shutil.rmtree(old, ignore_errors=True)
    barrier(run)


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
    who = f"[rank {run.grid.rank}]"
    for ckpt in (ckpt_root(run.cfg.out_dir) / name for name in names):
        path = ckpt / "meta.json"
        try:
            json.loads(path.read_text())["step"]  # export and the layout check need it too
            path = ckpt / shard_name(run.grid.rank)
            shard, ok = torch.load(path, map_location="cpu", weights_only=True), 1.0
        except Exception as e:  # noqa: BLE001 - any unreadable file: say which, try older
            error = f"{type(e).__name__}: {str(e)[:120]}"
            print(f"{who} checkpoint file {path} is unreadable ({error}); trying the previous one")
            ok = 0.0
        if agree(run, ok, dist.ReduceOp.MIN) < 1.0:
            continue
        try:  # a shard that reads but does not fit (another model) is no damage: stop
            restore(run, shard)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, or they hang
            print(f"{who} {path} does not fit this run: {str(e)[:200]}")
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


# ------------------------------------------------------- export and sampling: one file, one process
def merge_shards(state_dicts) -> dict:
    """The TP ranks' state dicts, in tp_rank order -> 02's full state dict (04's tp_layout says
    which entries are split, and along which dimension)."""
    full = {}
    for k, v in state_dicts[0].items():
        layout = tp_lib.tp_layout(k)
        full[k] = tp_lib.merge_tensors([sd[k] for sd in state_dicts], *layout) if layout else v
    return full


def read_stages(ckpt: Path) -> tuple[dict, list]:
    """meta.json and, per pipeline stage, its TP ranks' model states at DP rank 0 (the other
    replicas hold the same weights): stages[pp_rank][tp_rank]."""
    meta = json.loads((ckpt / "meta.json").read_text())
    dp, tp = meta["dp"], meta["tp"]
    stages = []
    for p in range(meta["pp"]):
        files = [ckpt / shard_name(p * dp * tp + t) for t in range(tp)]  # grid (p, dp=0, t)
        stages.append([torch.load(f, "cpu", weights_only=True)["model"] for f in files])
    return meta, stages


def export(run_dir) -> Path:
    """Merge the newest checkpoint's (tp, pp) shards into RUN_DIR/model.pt for 02_model.GPT. A
    damaged checkpoint (meta.json or a shard) is named and the previous one used, as --resume."""
    for ckpt in complete_checkpoints(run_dir):
        try:
            meta, stages = read_stages(ckpt)
            break
        except Exception as e:  # noqa: BLE001 - any unreadable file: say which, try older
            error = f"{type(e).__name__}: {str(e)[:120]}"
            print(f"--export: {ckpt} is unreadable ({error}); trying the previous checkpoint")
    else:
        raise SystemExit(f"--export: no complete, readable checkpoint in {ckpt_root(run_dir)}")
    full = {}
    for shards in stages:
        for chunk_states in zip(*shards):  # this stage's chunks, each split over tp ranks
            full.update(merge_shards(chunk_states) if meta["tp"] > 1 else chunk_states[0])
    model = model_lib.GPT(model_lib.GPTConfig(**meta["model_config"]))
    model.load_state_dict(full, strict=True)  # every weight present, none left over
    blob = {"model_config": meta["model_config"], "model": model.state_dict(), "step": meta["step"]}
    blob["tokenizer"] = tokenizer_blob(meta["tokenizer"])
    atomic_torch_save(blob, out := Path(run_dir) / "model.pt")
    return out


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
    generator = torch.Generator().manual_seed(seed)
    out = model.generate(idx, n_tokens, temperature=0.8, top_k=50, generator=generator)
    return tok.decode(out[0].tolist())


# -------------------------------------------------------- MFU: the peak FLOP/s each GPU could reach
# Dense peak FLOP/s per GPU (tensor cores; without the 2:4 structured-sparsity doubling that
# datasheets print next to them). Key = a piece of torch.cuda.get_device_name(), e.g.
# "NVIDIA H100 80GB HBM3". fp16/bf16 are with fp32 accumulation, what PyTorch uses. Sources:
# NVIDIA datasheets (V100, A100, H100, H200, L4, T4) and architecture whitepapers (GA102 appendix
# A for the RTX 3090, Ada's for the RTX 4090). subtle: NVIDIA publishes no A10G (AWS G5) datasheet;
# its entry is the commonly quoted 70/35 TFLOP/s, which public bf16 matmul measurements (~69)
# support; it is not the A10's 125. Treat it as the least certain row.
PEAK_FLOPS = {
    "V100-SXM2": {"fp16": 125e12, "fp32": 15.7e12},  # Volta: no bf16, no tf32
    "V100-PCIE": {"fp16": 112e12, "fp32": 14e12},
    "T4": {"fp16": 65e12, "fp32": 8.1e12},  # Turing: no bf16, no tf32
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},  # 40 and 80 GB
    "A10G": {"bf16": 70e12, "fp16": 70e12, "tf32": 35e12, "fp32": 35e12},
    "RTX 3090": {"bf16": 71e12, "fp16": 71e12, "tf32": 35.6e12, "fp32": 35.6e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    "RTX 4090": {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12},
    "H100": {"bf16": 989.5e12, "fp16": 989.5e12, "tf32": 494.5e12, "fp32": 67e12},  # SXM
    "H100 PCIe": {"bf16": 756.5e12, "fp16": 756.5e12, "tf32": 378e12, "fp32": 51e12},
    "H200": {"bf16": 989.5e12, "fp16": 989.5e12, "tf32": 494.5e12, "fp32": 67e12},  # SXM
}
# Words that mark a different card with different peaks ("H100 NVL", "RTX 3090 Ti", "RTX 4090 D",
# a laptop part): a name with one of these only matches a key that names it too.
_VARIANT_WORDS = {"nvl", "ti", "super", "d", "laptop", "mobile", "max"}


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of one `device_name` GPU in `dtype` ("bf16", "fp16", "tf32", "fp32"),
    or None when the card or dtype is not in PEAK_FLOPS: an unknown peak is never guessed."""
    name_words = set(re.findall(r"[a-z0-9]+", device_name.lower()))
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):  # most specific first: "H100 PCIe"
        whole_word = rf"(?<![a-z0-9]){re.escape(key.lower())}(?![a-z0-9])"  # "L4" is not "L40S"
        if not re.search(whole_word, device_name.lower()):
            continue
        key_words = set(re.findall(r"[a-z0-9]+", key.lower()))
        if (name_words - key_words) & _VARIANT_WORDS:
            return None
        return PEAK_FLOPS[key].get(dtype)
    return None


def mfu(tokens_per_s, flops_per_token, n_devices, peak_flops_per_device) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all devices together.

    tokens_per_s is the global throughput (all devices). None when the peak is unknown."""
    if peak_flops_per_device is None:
        return None
    return tokens_per_s * flops_per_token / (n_devices * peak_flops_per_device)


# ----------------------------------------------------------------------- logging, preemption, plots
class Logger:
    """Rank 0 prints one line per --log-interval and appends the same fields to metrics.jsonl."""

    def __init__(self, run: Run, start_step: int):
        self.run, self.path = run, Path(run.cfg.out_dir) / "metrics.jsonl"
        self.tokens_per_step = run.cfg.batch_size * run.T
        self.t_start, self.step_start = time.perf_counter(), start_step
        self.t_last, self.step_last = self.t_start, start_step - 1
        self.peak = None  # on the CPU: unknown, so MFU is None
        if run.device.type == "cuda":
            dtype_name = {v: k for k, v in mp_lib.DTYPES.items()}[run.dtype]
            self.peak = peak_flops(torch.cuda.get_device_name(run.device), dtype_name)
        self.flops = model_lib.flops_per_token(run.gpt_config, run.T)
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
        data_lib.atomic_write(self.path, lambda tmp: tmp.write_text("".join(rows)))

    def write(self, row: dict) -> None:
        if self.run.grid.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def train_row(self, step: int, stats: dict) -> None:
        now, world, cfg = time.perf_counter(), self.run.grid.world, self.run.cfg
        tok_s = self.tokens_per_step * (step - self.step_last) / (now - self.t_last)
        self.t_last, self.step_last = now, step
        util = mfu(tok_s, self.flops, world, self.peak)
        if self.run.device.type == "cuda":
            mem = torch.cuda.max_memory_allocated(self.run.device)
        else:  # the process's peak RSS (Linux reports KiB)
            mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        eta = (now - self.t_start) / (step + 1 - self.step_start) * (cfg.max_steps - step - 1)
        row = {"kind": "train", "step": step, **stats, "tokens": (step + 1) * self.tokens_per_step}
        row.update(tokens_per_s=tok_s, tokens_per_s_per_gpu=tok_s / world, mfu=util)
        self.write({**row, "peak_mem_gb": mem / 1e9, "eta_s": eta})
        mfu_text = "n/a" if util is None else f"{100 * util:.1f}%"
        ddp_lib.print0(
            f"step {step:5d} | loss {stats['loss']:.4f} | lr {stats['lr']:.2e} | "
            f"norm {stats['grad_norm']:.3f} | {tok_s:,.0f} tok/s ({tok_s / world:,.0f}/rank) | "
            f"mfu {mfu_text} | mem {mem / 1e9:.2f} GB | eta {eta / 60:.1f} min"
        )

    def val_row(self, step: int, val_loss: float) -> None:
        tokens = (step + 1) * self.tokens_per_step
        self.write({"kind": "val", "step": step, "val_loss": val_loss, "tokens": tokens})
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
    """The run's one figure, loss.png: train and validation loss against tokens seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(r) for r in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, key, style in (("train", "loss", "-"), ("val", "val_loss", "o-")):
        if pts := [(r["tokens"], r[key]) for r in rows if r["kind"] == kind]:
            ax.plot(*zip(*pts), style, label=f"{kind} loss")
    ax.set(xlabel="tokens seen", ylabel="cross-entropy (nats)", title="training run")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path := Path(out_dir) / "loss.png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------- the loop
def train(run: Run) -> None:
    cfg, preempt = run.cfg, Preemption()  # first: a signal during the load is honoured too
    if run.grid.rank == 0:  # a save killed midway leaves step_N.partial/, never to be completed
        for stale in ckpt_root(cfg.out_dir).glob("*.partial"):
            shutil.rmtree(stale, ignore_errors=True)
    start = load_checkpoint(run) if cfg.resume else 0
    log = Logger(run, start)
    stop = min(cfg.max_steps, start + cfg.steps_this_run) if cfg.steps_this_run else cfg.max_steps
    saved, step = None, start - 1  # saved: the step of this run's newest checkpoint
    for step in range(start, stop):
        stats = train_step(run, step)
        if step % cfg.log_interval == 0 or step == stop - 1:
            log.train_row(step, stats)
        if cfg.eval_interval and step % cfg.eval_interval == 0:  # step 0: the baseline
            val = evaluate(run, lambda: preempt.agreed(run))  # None: preempted while evaluating
            if val is not None:
                log.val_row(step, val)
        if cfg.ckpt_interval and (step + 1) % cfg.ckpt_interval == 0:
            save_checkpoint(run, saved := step)
        if preempt.agreed(run):
            ddp_lib.print0(f"preemption signal: saving at step {step} and exiting")
            if saved != step:
                save_checkpoint(run, step)
            return
    if step >= start and saved != step:
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
        gpt_config = validate(cfg, world, int(os.environ.get("RANK", 0)))
    except ConfigError as e:
        raise SystemExit(f"train.py: error: {e}") from None
    created = not dist.is_initialized()
    rank, _, world, device = ddp_lib.init_distributed()
    try:
        run = build_run(cfg, gpt_config, build_grid(cfg, rank, world), device)
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
