"""train.py · everything together: 3D-parallel (DP x TP x PP) GPT training, launched by torchrun.

The idea: build the same GPT on every rank, cut it with tensor parallelism (04) inside a node and
pipeline parallelism (05) across nodes, replicate that with data parallelism (03; --zero 1-3
shards the replicas' optimizer state, gradients, weights), train it in mixed precision with
--recompute (06), checkpoint (resumable bit for bit), evaluate, log and measure each step. Or
fine-tune GPT-2's weights (--init-from), all of them or LoRA's factors only (--lora-rank, 02).

The grid: rank = (pp_rank * dp + dp_rank) * tp + tp_rank, i.e. torch.arange(world).view(pp, dp,
tp). TP varies fastest, so TP peers share a node and its NVLink; PP slowest, so only pipeline
sends cross nodes. For --dp 2 --tp 2 --pp 2 on 8 GPUs:

                   tp_rank 0        tp_rank 1
    pp 0, dp 0  |  rank 0         rank 1    |  embeddings + first half of the blocks,
    pp 0, dp 1  |  rank 2         rank 3    |  each rank with half of every matrix
    pp 1, dp 0  |  rank 4         rank 5    |  second half of the blocks + head + loss
    pp 1, dp 1  |  rank 6         rank 7    |
    groups: TP {0,1} {2,3} {4,5} {6,7}; DP {0,2} {1,3} {4,6} {5,7}; PP {0,4} {1,5} {2,6} {3,7}

Batch semantics (as Megatron): --batch-size B is the global batch in sequences per optimizer step;
each step runs m = B / (micro_batch_size * dp) microbatches per DP rank: accumulation steps without
PP, the pipeline's microbatches with it. Any (dp, tp, pp, micro) with the same B gives the loss
curve of one process (fp32, up to rounding), as the tests prove.

Launch:  python train.py                                      # laptop: prepares data, ~4 min CPU
         torchrun --standalone --nproc_per_node=8 train.py --dp 2 --tp 2 --pp 2
         torchrun --nnodes=N --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 \\
             train.py --model gpt2 --dp N --tp 8 ...           # a cluster (docs/cluster.md: Slurm)
         python train.py --init-from gpt2-hf --model gpt2 --tokenizer gpt2 --lora-rank 8  # fine-tune
         python train.py --export out/run                      # one file from a sharded checkpoint
         python train.py --sample out/run/model.pt             # sample from an exported model

What changed from 06: nothing new is taught; 01-06 composed, plus what a real run needs (an LR
schedule, global-norm clipping, evaluation, checkpoints, logs, a plot, MFU, export, fine-tuning).
"""

import argparse
import contextlib
import importlib
import json
import math
import os
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from support import distributed

data_lib = importlib.import_module("01_data")
model_lib = importlib.import_module("02_model")
ddp_lib = importlib.import_module("03_ddp")
tp_lib = importlib.import_module("04_tensor_parallel")
pp_lib = importlib.import_module("05_pipeline")
mp_lib = importlib.import_module("06_mixed_precision")
run_log = importlib.import_module("bench.run_log")  # metrics.jsonl (loss, MFU, ETA), loss.png
sampling = importlib.import_module("bench.sampling")  # model.pt: write, read, sample (--sample)

# what `python 01_data.py --tokenizer T` writes, per T; the default --data-dir, prepared if missing
DEFAULT_DATA = dict(bpe="data/stdlib-bpe4096", gpt2="data/stdlib-gpt2", char="data/stdlib-char")


# ----------------------------------------------------------- config: a dataclass filled by argparse
def flag(default, help: str):
    """A config field whose help text (what it does, and why its default) feeds --help."""
    return field(default=default, metadata={"help": help})


# fmt: off
@dataclass
class TrainConfig:
    dp: int = flag(1, "data-parallel size: replicas, each on its share of the batch (03)")
    tp: int = flag(1, "tensor-parallel size: every matrix split over this many ranks; keep it inside a node (04)")
    pp: int = flag(1, "pipeline-parallel size: blocks cut into this many stages; the only split to cross nodes (05)")
    schedule: str = flag("1f1b", "gpipe, 1f1b (at most pp microbatches' activations alive) or interleaved (05)")
    virtual_stages: int = flag(1, "model chunks per pipeline rank; > 1 needs interleaved")
    sequence_parallel: bool = flag(False, "with --tp: also shard LayerNorm/dropout activations along the sequence (04)")
    zero: int = flag(0, "ZeRO stage over the DP group (03): 1 shards AdamW's state, 2 also the gradients, 3 also the weights")
    grad_compression: str = flag("none", "DP's gradients (03): none, fp16 or bf16 (half the bytes) or powersgd (rank-r sketches)")
    powersgd_rank: int = flag(4, "powersgd: the sketch's rank r, (m + n)·r numbers sent per m x n matrix")
    powersgd_warmup_steps: int = flag(10, "powersgd: exact all-reduces first (early training is the most sensitive)")
    batch_size: int = flag(32, "global batch: sequences per optimizer step, all DP ranks (32 x 128 tokens on a CPU)")
    micro_batch_size: int = flag(8, "sequences per microbatch per DP rank")
    block_size: int = flag(0, "tokens per sequence = the model's context (no untrained positions); 0 = the preset's")
    model: str = flag("small", f"02_model.py preset: {', '.join(model_lib.PRESETS)} (small: 4 layers x 128, for a CPU)")
    n_layer: int = flag(0, "number of blocks; 0 = the preset's")
    init_from: str = flag("", "fine-tune a Hugging Face GPT-2 checkpoint (.bin, .safetensors, a snapshot folder): its --model, gpt2 data")
    lora_rank: int = flag(0, "LoRA (02): train rank-r factors B·A beside each block's frozen linears, nothing else; 0 = off")
    lora_alpha: float = flag(16.0, "LoRA: the update is (alpha / r)·B·A; fixing alpha roughly keeps the best LR as r changes")
    dropout: float = flag(0.0, "dropout probability (pretraining on plenty of data needs none)")
    recompute: str = flag("none", "activations redone in the backward (02, 06): selective (LayerNorm, GELU, dropout, and "
                                  "attention when dropout is on) or full (each block's forward: 8N FLOPs, not 6N); none")
    dtype: str = flag("auto", "fp32, bf16 or fp16 (+ 06's loss scaler); auto = bf16 on a GPU that has it, else fp32")
    compile: bool = flag(False, "torch.compile each model chunk (GPU speed; slow first steps)")
    max_steps: int = flag(500, "optimizer steps, the LR schedule's length (500 x 4,096 tokens: the CPU job in ~5 min)")
    lr: float = flag(3e-3, "peak learning rate (small models take large ones; GPT-2 used 6e-4)")
    warmup_steps: int = flag(50, "steps of linear warm-up to --lr (--lr/N at step 0, --lr at step N-1)")
    lr_schedule: str = flag("cosine", "after the warm-up: cosine (to --min-lr at --max-steps), wsd (stable at --lr, then a "
                                      "linear decay: --decay-fraction), cyclic (--cycle-steps) or constant")
    min_lr: float = flag(3e-4, "learning rate at the end of the decay, the bottom of a cycle (a tenth, as Chinchilla)")
    decay_fraction: float = flag(0.2, "wsd: the last fraction of --max-steps over which the LR decays (resumable longer)")
    cycle_steps: int = flag(100, "cyclic: steps per triangle, from --lr down to --min-lr and back")
    weight_decay: float = flag(0.1, "decay on matrices (embeddings too, as nanoGPT), not on biases or LayerNorm gains")
    grad_clip: float = flag(1.0, "clip to this global L2 norm over all shards; 0 = off")
    eval_interval: int = flag(100, "steps between validation losses (and one at the end)")
    eval_steps: int = flag(10, "validation batches per evaluation (the same ones every time)")
    log_interval: int = flag(10, "steps between log lines and rows of metrics.jsonl")
    sample_tokens: int = flag(200, "tokens sampled at the end; 0 = no sample")
    out_dir: str = flag("out/run", "where metrics.jsonl, loss.png, checkpoints/, model.pt go")
    data_dir: str = flag("", "the shards and meta.json of 01_data.py; empty = the default data of --tokenizer")
    tokenizer: str = flag("", "bpe (01_data.py's 4,096-token BPE), gpt2 or char: picks the default data (data/stdlib-bpe4096, "
                              "-gpt2, -char; made if missing); empty: bpe, or --data-dir's own")
    ckpt_interval: int = flag(250, "steps between checkpoints; 0 = only at the end and on SIGTERM/SIGUSR1")
    keep_checkpoints: int = flag(3, "how many complete checkpoints to keep")
    resume: bool = flag(False, "continue from the newest complete checkpoint in --out-dir")
    steps_this_run: int = flag(0, "stop after this many steps, with a checkpoint (time-limited jobs; the LR schedule: --max-steps)")
    seed: int = flag(1337, "seed for the model init, the data order and dropout")
# fmt: on


class ConfigError(ValueError):
    """A bad flag: reported as one line, before any process group exists."""


def parse_args(argv=None):
    """TrainConfig's fields as flags (help: their metadata), plus the one-shot --export, --sample."""
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=formatter)
    for f in fields(TrainConfig):
        kind = {"action": "store_true"} if f.type is bool else {"type": f.type}
        name = "--" + f.name.replace("_", "-")
        parser.add_argument(name, default=f.default, help=f.metadata["help"], **kind)
    export = "merge RUN_DIR's newest checkpoint into RUN_DIR/model.pt, for 02_model.GPT; exit"
    parser.add_argument("--export", metavar="RUN_DIR", help=export)
    parser.add_argument("--sample", metavar="MODEL_PT", help="sample from an exported model; exit")
    parser.add_argument("--prompt", default="def ", help="prompt for --sample")
    args = parser.parse_args(argv)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    cfg.data_dir = cfg.data_dir or DEFAULT_DATA.get(cfg.tokenizer or "bpe", "")  # "": validate
    return cfg, args


def resolve_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()  # for "auto" (not in DTYPES)
    return mp_lib.DTYPES.get(cfg.dtype, torch.bfloat16 if bf16 else torch.float32)


# -------------------------------------- validation: one line per bad flag, before any process group
def check_flags(cfg: TrainConfig, world_size: int) -> None:
    """The checks that need no file: they run before anything is read, prepared or written."""
    positive = ("dp", "tp", "pp", "virtual_stages", "batch_size", "micro_batch_size", "max_steps",
                "lr", "eval_steps", "log_interval", "keep_checkpoints", "cycle_steps",
                "powersgd_rank", "lora_alpha")  # fmt: skip
    for f in fields(TrainConfig):  # numbers: these > 0, the rest >= 0 (`not`: NaN fails too)
        value, sign = getattr(cfg, f.name), ">" if f.name in positive else ">="
        if f.type in (int, float) and not (value > 0 if sign == ">" else value >= 0):
            raise ConfigError(f"--{f.name.replace('_', '-')} must be {sign} 0, got {value}")
    if (n := cfg.dp * cfg.tp * cfg.pp) != world_size:
        sizes = f"--dp {cfg.dp} x --tp {cfg.tp} x --pp {cfg.pp} = {n}: launch {n} processes"
        raise ConfigError(f"world_size={world_size} but {sizes} or change the sizes")
    if not 0 <= cfg.dropout < 1:
        raise ConfigError(f"--dropout {cfg.dropout}: a probability, in [0, 1)")
    if cfg.min_lr > cfg.lr and cfg.lr_schedule != "constant":
        raise ConfigError(f"--min-lr {cfg.min_lr} exceeds --lr {cfg.lr}: the decay would climb")
    if not 0 < (fraction := cfg.decay_fraction) <= 1:
        raise ConfigError(f"--decay-fraction {fraction}: a fraction of the run, in (0, 1]")
    for name, value, choices in (("dtype", cfg.dtype, ("auto", *mp_lib.DTYPES)),
                                 ("model", cfg.model, tuple(model_lib.PRESETS)),
                                 ("recompute", cfg.recompute, model_lib.RECOMPUTE),
                                 ("lr_schedule", cfg.lr_schedule, LR_SCHEDULES),
                                 ("grad_compression", cfg.grad_compression, ddp_lib.COMPRESSION),
                                 ("tokenizer", cfg.tokenizer, ("", *DEFAULT_DATA))):  # fmt: skip
        if value not in choices:
            flag_name, choices = "--" + name.replace("_", "-"), ", ".join(filter(None, choices))
            raise ConfigError(f"{flag_name} {value}: use one of {choices}")
    compressed = cfg.grad_compression != "none"
    for name, on, dim, size, what in (  # a flag that would silently do nothing is a mistake
        ("--zero", cfg.zero, "--dp", cfg.dp, "shards over the DP replicas"),
        ("--grad-compression", compressed, "--dp", cfg.dp, "compresses DP's all-reduce"),
        ("--sequence-parallel", cfg.sequence_parallel, "--tp", cfg.tp, "shards over TP ranks"),
        ("--virtual-stages", cfg.virtual_stages > 1, "--pp", cfg.pp, "cuts pipeline ranks"),
    ):
        if on and size == 1:
            raise ConfigError(f"{name} {what}, but {dim} is 1: it would do nothing")
    if compressed and cfg.zero:  # (03 compresses DataParallel's all-reduce)
        raise ConfigError(f"--grad-compression with --zero {cfg.zero}: ZeRO reduce-scatters")
    for f in ("powersgd_rank", "powersgd_warmup_steps"):  # (a flag that would do nothing)
        if getattr(cfg, f) != getattr(TrainConfig, f) and cfg.grad_compression != "powersgd":
            raise ConfigError(f"--{f.replace('_', '-')} needs --grad-compression powersgd")
    if cfg.lora_alpha != TrainConfig.lora_alpha and not cfg.lora_rank:
        raise ConfigError("--lora-alpha scales LoRA's update, but --lora-rank is 0: LoRA is off")
    if cfg.grad_compression == "powersgd" and cfg.lora_rank:  # (m + n)·r numbers for m x r: more
        raise ConfigError("--grad-compression powersgd with --lora-rank: the factors are low-rank")
    if cfg.grad_compression == "powersgd" and cfg.dtype == "fp16":
        why = "an overflowed step's inf would stay in its residuals: use bf16 or fp32"
        raise ConfigError(f"--grad-compression powersgd with --dtype fp16: {why}")
    if cfg.zero > 3 or (cfg.zero == 3 and cfg.pp > 1):  # (03: refused for several chunks a rank)
        why = "re-gathers every block for every microbatch" if cfg.zero == 3 else "is 0 to 3"
        raise ConfigError(f"--zero {cfg.zero}{' with --pp' * (cfg.pp > 1)}: a stage {why}")
    B, per_step = cfg.batch_size, cfg.micro_batch_size * cfg.dp
    if B % per_step:  # whole microbatches
        split = f"--micro-batch-size {cfg.micro_batch_size} x --dp {cfg.dp} = {per_step}"
        raise ConfigError(f"--batch-size {B} is not divisible into microbatches of {split}")
    n_layer, v = cfg.n_layer or model_lib.PRESETS[cfg.model]["n_layer"], cfg.virtual_stages
    try:  # 05's checks: a known schedule, virtual stages only interleaved, a block per stage, ...
        pp_lib.check_config(cfg.schedule, cfg.pp, B // per_step, v, n_layer)
    except ValueError as e:
        where = f"--schedule {cfg.schedule} --pp {cfg.pp} --virtual-stages {v} --n-layer {n_layer}"
        raise ConfigError(f"{where}: {e}") from None
    found = next(p for p in (Path(cfg.out_dir), *Path(cfg.out_dir).parents) if p.exists())
    if found.is_file():  # the nearest existing path must be a folder
        raise ConfigError(f"--out-dir {cfg.out_dir}: {found} is a file, not a folder")


def validate(cfg: TrainConfig, world_size: int, rank: int = 0):
    """Flags first (so bad input writes nothing), then the data, model and loader; -> GPTConfig."""
    check_flags(cfg, world_size)
    prepare_default_data(cfg, rank)
    if not (path := Path(cfg.data_dir) / "meta.json").is_file():
        fix = f"run `python 01_data.py --out {cfg.data_dir}` (see --help there)"
        raise ConfigError(f"--data-dir {cfg.data_dir} has no prepared data (meta.json): {fix}")
    meta = json.loads(path.read_text())
    made_with = meta["tokenizer"] if meta["tokenizer"] in ("gpt2", "char") else "bpe"  # or a path
    if cfg.tokenizer and cfg.tokenizer != made_with:
        was = f"--data-dir {cfg.data_dir} was prepared with {meta['tokenizer']}"
        fix = f"pass --tokenizer {made_with}, or another --data-dir"
        raise ConfigError(f"--tokenizer {cfg.tokenizer}, but {was}: {fix}")
    if cfg.block_size > (context := model_lib.PRESETS[cfg.model]["block_size"]):
        preset = f"--model {cfg.model} ({context} positions)"
        raise ConfigError(f"--block-size {cfg.block_size} exceeds the context of {preset}")
    # the preset, its context cut to --block-size (no untrained positions), vocab padded for TP
    sizes = {k: getattr(cfg, k) for k in ("block_size", "n_layer") if getattr(cfg, k)}  # 0: preset
    extra = dict(vocab_size=meta["vocab_size"], dropout=cfg.dropout, pad_vocab_multiple=64,
                 recompute=cfg.recompute)  # fmt: skip
    try:  # GPTConfig's own checks (n_embd % n_head, ...), then 04's (whole heads per TP rank, ...)
        gpt_config = model_lib.GPTConfig.from_preset(cfg.model, **sizes, **extra)
        tp_lib.check_tp_config(gpt_config, cfg.tp)
    except ValueError as e:
        raise ConfigError(f"--model {cfg.model} --tp {cfg.tp}: {e}") from None
    T = gpt_config.block_size
    if cfg.sequence_parallel and T % cfg.tp:
        what = f"--sequence-parallel shards the {T} tokens of a sequence over --tp {cfg.tp} ranks"
        raise ConfigError(f"{what}: use a --block-size divisible by {cfg.tp}")
    for split in ("train", "val"):  # the loader's own checks: a batch larger than the data, ...
        try:
            data_lib.DataLoader(cfg.data_dir, split, cfg.batch_size // cfg.dp, T, dp_size=cfg.dp)
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(f"--data-dir {cfg.data_dir}, {split} split: {e}") from None
    if cfg.init_from:  # GPT-2's weights: its tokenizer, its shape (last: it reads the file)
        check_init_from(cfg, meta, gpt_config)
    if cfg.resume:
        check_resume_layout(cfg)
    elif ckpts := complete_checkpoints(cfg.out_dir):  # never mix two runs in one folder
        fix = f"(newest: {ckpts[0].name}): pass --resume to continue that run, or another --out-dir"
        raise ConfigError(f"--out-dir {cfg.out_dir} already holds checkpoints {fix}")
    return gpt_config


def check_init_from(cfg: TrainConfig, meta: dict, gpt_config) -> None:  # each error: one line
    if (tok := meta["tokenizer"]) != "gpt2":  # GPT-2's weights read GPT-2's token ids only
        raise ConfigError(f"--init-from needs data of --tokenizer gpt2; {cfg.data_dir} is {tok}'s")
    try:  # a missing file, a foreign format, a damaged one
        have = model_lib.GPT.load_pretrained(Path(cfg.init_from).resolve(strict=True)).config
    except Exception as e:  # noqa: BLE001 - whatever the reader raises: one line
        raise ConfigError(f"--init-from {cfg.init_from}: {' '.join(str(e).split())}") from None
    keys = ("n_layer", "n_head", "n_embd", "vocab_size", "bias", "tie_embeddings")
    bad = [f"{k}={getattr(have, k)}" for k in keys if getattr(have, k) != getattr(gpt_config, k)]
    bad += [f"block_size={have.block_size}"] * (have.block_size < gpt_config.block_size)
    if differ := ", ".join(bad):  # (a longer context is fine: wpe is cut to --block-size)
        raise ConfigError(f"--init-from {cfg.init_from} has {differ}: not --model {cfg.model}'s")


def prepare_default_data(cfg: TrainConfig, rank: int) -> None:
    """Rank 0 makes missing default data (as `python 01_data.py --tokenizer T`); the others wait."""
    kind = next((k for k, path in DEFAULT_DATA.items() if path == cfg.data_dir), None)
    if kind is None or (meta := Path(cfg.data_dir) / "meta.json").is_file():
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


def build_grid(cfg: TrainConfig, rank: int, world: int) -> Grid:
    """Every rank creates every group, in order (dist.new_group is a collective); keeps its own."""
    grid = Grid(rank=rank, world=world, dp=cfg.dp, tp=cfg.tp, pp=cfg.pp)
    if world == 1:
        return grid
    ranks = torch.arange(world).view(cfg.pp, cfg.dp, cfg.tp)  # ranks[pp_rank, dp_rank, tp_rank]
    grid.pp_rank, grid.dp_rank, grid.tp_rank = (int(i) for i in (ranks == rank).nonzero()[0])

    def mine(rank_lists):
        groups = [dist.new_group(members) for members in rank_lists]
        return next(g for g, members in zip(groups, rank_lists) if rank in members)

    grid.tp_group = mine(ranks.reshape(-1, cfg.tp).tolist())  # ranks[p, d, :] for every (p, d)
    grid.dp_group = mine(ranks.transpose(1, 2).reshape(-1, cfg.dp).tolist())  # ranks[p, :, t]
    pp_lists = ranks.permute(1, 2, 0).reshape(-1, cfg.pp).tolist()  # ranks[:, d, t]
    grid.pp_group = mine(pp_lists)
    grid.embed_group = pp_lib.embedding_group(pp_lists)  # None at pp = 1: no second copy
    return grid


def all_reduce_sum(t: torch.Tensor, group, size: int) -> torch.Tensor:
    """SUM over a group (a no-op for a group of one). Never ReduceOp.AVG: gloo lacks it."""
    if size > 1:
        dist.all_reduce(t, group=group)
    return t


# --------------- building: model (02) -> TP shards (04) -> pipeline chunks (05) -> DP wrappers (03)
@dataclass
class Run:  # everything one training step needs, built once
    cfg: TrainConfig
    grid: Grid
    gpt_config: object  # 02_model.GPTConfig
    device: torch.device
    dtype: torch.dtype
    chunks: list  # this rank's model chunk(s), DP-wrapped when dp > 1
    optimizer: torch.optim.Optimizer
    scaled: object  # what the scaler unscales and steps: the optimizer (ZeRO: its shards' view)
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
    if cfg.init_from:  # GPT-2's weights (wpe: its first T rows; vocabulary padding: the init)
        pretrained = model_lib.GPT.load_pretrained(cfg.init_from).state_dict()
        for name, t in model.state_dict().items():  # (detached: t shares the parameter's storage)
            t[: len(pretrained[name])].copy_(pretrained[name][: len(t)])
    if cfg.lora_rank:  # the base frozen as loaded; A drawn alike on every rank (this seed)
        model_lib.apply_lora(model, cfg.lora_rank, cfg.lora_alpha)
    if grid.tp > 1:
        tp_lib.apply_tensor_parallel(model, grid.tp_group, cfg.sequence_parallel, seed=cfg.seed)
    chunks = [model]
    if grid.pp > 1:
        chunks = pp_lib.split_model(model, grid.pp_rank, grid.pp, cfg.virtual_stages)
    if cfg.compile:
        for chunk in chunks:
            chunk.compile()  # in place: parameter names (and checkpoints) are unchanged
    # Dropout streams, none shared: replicated activations draw from the default generator, seeded
    # per (stage, replica), so alike on TP peers (their copies must stay copies); sharded ones
    # (heads; with SP, token shards) from 04's tracker, seeded seed + 1 + world + global rank.
    torch.manual_seed(cfg.seed + 1 + grid.pp_rank * grid.dp + grid.dp_rank)  # < seed + 1 + world
    return chunks


def data_parallel(cfg: TrainConfig, chunks: list, grid: Grid, device: torch.device) -> tuple:
    """AdamW (decay on matrices only, fused on CUDA) and, with dp > 1, 03's data parallelism over
    the DP group at --zero's stage: -> (chunks, DP-wrapped; optimizer; what the scaler steps)."""
    params = [p for c in chunks for p in c.parameters() if p.requires_grad]  # LoRA: its factors
    tied = [t for t in map(pp_lib.tied_parameter, chunks) if t is not None] if grid.pp > 1 else []
    tied = [t for t in tied if t.requires_grad]  # (LoRA's frozen embedding: not the optimizer's)
    matrices = [p for p in params if p.dim() >= 2 and all(p is not t for t in tied)]
    # subtle: ZeRO flattens each group apart, so alone in its group the tied matrix is cut alike
    # on the first and last stage: their shards' gradients can be summed (train_step)
    groups = [{"params": matrices, "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
              {"params": tied, "weight_decay": cfg.weight_decay}]  # fmt: skip
    AdamW, kw = torch.optim.AdamW, dict(lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    kw["fused"] = device.type == "cuda"
    if cfg.zero:  # (dp > 1: checked) one ZeroOptimizer over every chunk's units
        for c in chunks:  # (DataParallel does it too) the replicas identical, then cut into shards
            ddp_lib.broadcast_from_first_rank(c, grid.dp_group)
        units = [u for c in chunks for u in ddp_lib.zero_units(c)]
        opt = ddp_lib.ZeroOptimizer(groups, AdamW, grid.dp_group, units=units, stage=cfg.zero, **kw)
        shards = [f.shard for f in opt.flats]  # their .grad: this rank's (reduced) gradients
        scaled = SimpleNamespace(param_groups=[{"params": shards}], step=opt.step)
        return [ddp_lib.ZeroDataParallel(c, opt) for c in chunks], opt, scaled
    if grid.dp > 1:  # (the same PowerSGD seed on every rank: 03's default)
        how = dict(compression=cfg.grad_compression, powersgd_rank=cfg.powersgd_rank,
                   powersgd_warmup_steps=cfg.powersgd_warmup_steps)  # fmt: skip
        chunks = [ddp_lib.DataParallel(c, group=grid.dp_group, **how) for c in chunks]
    return chunks, (opt := AdamW(groups, **kw)), opt


def build_run(cfg: TrainConfig, gpt_config, grid: Grid, device: torch.device) -> Run:
    T, dtype = gpt_config.block_size, resolve_dtype(cfg, device)  # context = --block-size
    wrapped = data_parallel(cfg, build_chunks(cfg, gpt_config, grid, device), grid, device)
    scaler = mp_lib.make_scaler(dtype)  # group None: every rank of the world skips together
    per_rank = cfg.batch_size // cfg.dp  # this DP rank's share of every batch
    loader_args = (per_rank, T, cfg.seed, grid.dp_rank, cfg.dp, device)
    loaders = [data_lib.DataLoader(cfg.data_dir, split, *loader_args) for split in ("train", "val")]
    m = per_rank // cfg.micro_batch_size
    return Run(cfg, grid, gpt_config, device, dtype, *wrapped, scaler, *loaders, T, m)


# ----------------------------------------------------------------------------------------- one step
LR_SCHEDULES = ("cosine", "wsd", "cyclic", "constant")  # docs/lr_schedules.png draws them


def lr_at(cfg: TrainConfig, step: int) -> float:
    """The learning rate at `step`, a pure function of it (a resume continues it exactly). Warm-up:
    hi·(step + 1)/w for step < w = warmup_steps. Then, with hi = lr, lo = min_lr and p the
    fraction of the decay done, capped at 1:
      cosine    lo + (hi - lo)(1 + cos πp)/2, p = (step - w)/(max_steps - w)   (GPT-2, Chinchilla)
      wsd       (warm-up, stable, decay: Hu et al. 2024, arXiv 2404.06395) hi until the decay's
                start s = max_steps - d, d = round(decay_fraction·max_steps), at least 1 (and
                s >= w); then lo + (hi - lo)(1 - p), p = (step - s)/(max_steps - s). Before
                s, a checkpoint can go on with a larger --max-steps: only the decay moves
      cyclic    lo + (hi - lo)|1 - 2q|, q = ((step - w) mod cycle_steps)/cycle_steps (Smith
                2017, arXiv 1506.01186: his triangle, begun at its top to continue the warm-up)
      constant  hi"""
    w, hi, lo, kind = cfg.warmup_steps, cfg.lr, cfg.min_lr, cfg.lr_schedule
    if step < w:
        return hi * (step + 1) / w
    if kind == "cyclic":
        return lo + (hi - lo) * abs(1 - 2 * ((step - w) % cfg.cycle_steps) / cfg.cycle_steps)
    if kind == "constant":
        return hi
    decay_steps = max(1, round(cfg.decay_fraction * cfg.max_steps))  # wsd's d
    start = max(w, cfg.max_steps - decay_steps) if kind == "wsd" else w  # cosine decays from w
    p = min(1.0, max(0, step - start) / max(1, cfg.max_steps - start))
    return lo + (hi - lo) * (1 - p if kind == "wsd" else 0.5 * (1 + math.cos(math.pi * p)))


def pipeline(run: Run, x: torch.Tensor, y: torch.Tensor, **kwargs):
    """05's pipeline_step on this rank's chunks: stages pass (b, T, C), or (b, T/tp, C) with SP."""
    T = run.T // run.grid.tp if run.cfg.sequence_parallel else run.T
    kwargs["act_shape"] = (run.cfg.micro_batch_size, T, run.gpt_config.n_embd)
    args = (run.chunks, (x, y), run.m, run.cfg.schedule, run.grid.pp_group)
    return pp_lib.pipeline_step(*args, **kwargs)


def gradients(run: Run) -> list:
    """(parameter, gradient) pairs; under ZeRO, this rank's pieces of the averaged gradients in
    its shards (03's grad_pieces: ZeRO-1 reduce-scatters there, so every DP rank calls it)."""
    if run.cfg.zero:
        return [(p, piece) for p, _, piece in run.optimizer.grad_pieces()]
    return [(p, p.grad) for m in run.modules() for p in m.parameters() if p.grad is not None]


def global_grad_norm(run: Run, grads) -> torch.Tensor:
    """The whole model's gradient L2 norm, the same on every rank, from (parameter, gradient)
    pairs: squares summed over TP shards (replicated parameters once: 04), stages (not the last
    stage's tied copy: 05 synced it) and, under ZeRO, DP ranks (each holds pieces of the shards)."""
    tied = [pp_lib.tied_parameter(m) for m in run.modules() if run.grid.pp > 1 and not m.is_first]
    grads = [(p, g) for p, g in grads if all(p is not t for t in tied)]
    if run.grid.tp > 1:
        squares = tp_lib.grad_norm_squared(grads, run.grid.tp_group, run.device)
    else:
        squares = sum(
            (g.float().pow(2).sum() for _, g in grads), torch.zeros((), device=run.device)
        )
    if run.cfg.zero:
        squares = all_reduce_sum(squares, run.grid.dp_group, run.grid.dp)
    return all_reduce_sum(squares, run.grid.pp_group, run.grid.pp).sqrt()


def comm_bytes(run: Run) -> int:
    """The gradient bytes this rank gave the DP collectives so far (03's count of each payload)."""
    if run.cfg.zero:
        return run.optimizer.stats["reduce_scatter_bytes"]
    return sum(c.stats["allreduce_bytes"] for c in run.chunks)  # (dp > 1: DataParallel's)


def train_step(run: Run, step: int) -> dict:
    """One optimizer step. Every microbatch's token losses are SUMmed and divided by the step's
    token count over all DP replicas (06), with PP or without, so ignored (-1) targets weigh as in
    one big batch; the loss returned is the step's mean, the same on every rank."""
    cfg, grid, b = run.cfg, run.grid, run.cfg.micro_batch_size
    x, y = run.train.get_batch(step)  # (B/dp, T): this DP rank's share of the global batch
    sent = comm_bytes(run) if grid.dp > 1 else 0
    run.optimizer.zero_grad(set_to_none=True)
    microbatches = list(zip(x.split(b), y.split(b)))
    n_tokens = mp_lib.global_token_count(microbatches, group=grid.dp_group)
    if grid.pp == 1:  # accumulation over m microbatches (06)
        kwargs = dict(dp_size=grid.dp, scaler=run.scaler, dtype=run.dtype)
        share = mp_lib.accumulate_gradients(run.chunks[0], microbatches, n_tokens, **kwargs)
        loss = torch.tensor(share, device=run.device)
    else:  # the pipeline's microbatches (05); only the last stage's loss is not 0
        kwargs = dict(embed_group=grid.embed_group, dp_size=grid.dp, n_tokens=n_tokens)
        with mp_lib.autocast_context(run.dtype, run.device.type):
            loss = pipeline(run, x, y, loss_scale=run.scaler.get_scale(), **kwargs).loss.clone()
        loss = all_reduce_sum(loss, grid.pp_group, grid.pp)
    loss = all_reduce_sum(loss, grid.dp_group, grid.dp)  # the replicas' shares add up to the loss
    grads = gradients(run)
    if cfg.zero >= 2 and grid.embed_group is not None:  # 05 found no p.grad: sum the shards'
        tied = [pp_lib.tied_parameter(m) for m in run.modules()]
        for piece in (g for p, g in grads if any(p is t for t in tied)):
            dist.all_reduce(piece, group=grid.embed_group)  # alike cut on both: data_parallel
    run.scaler.unscale_(run.scaled)  # true gradients before measuring and clipping them
    norm = global_grad_norm(run, grads)
    if cfg.grad_clip > 0:  # clip_grad_norm_'s scaling (never up), by the true global norm
        params = [p for group in run.scaled.param_groups for p in group["params"]]
        torch.nn.utils.clip_grads_with_norm_(params, cfg.grad_clip, norm)
    lr = lr_at(cfg, step)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.scaler.step(run.scaled)  # skipped (on every rank) when fp16 gradients overflowed
    run.scaler.update()
    stats = {"loss": loss.item(), "lr": lr, "grad_norm": norm.item()}
    return stats | ({"comm_bytes": comm_bytes(run) - sent} if grid.dp > 1 else {})


@torch.no_grad()
def evaluate(run: Run, stop=lambda: False) -> float | None:
    """Mean validation loss over the same eval_steps batches every time, the same collectives on
    every rank. `stop` (a collective) is asked before each batch: True returns None at once."""
    chunks = torch.nn.ModuleList(run.chunks).eval()  # one .eval() reaches every chunk
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
    chunks.train()
    if stopped:
        return None  # preempted: train() saves and exits; half an evaluation is no loss
    total = all_reduce_sum(total, run.grid.pp_group, run.grid.pp)
    total = all_reduce_sum(total, run.grid.dp_group, run.grid.dp) / run.grid.dp
    return total.item() / run.cfg.eval_steps


# ---------- checkpoints: a folder per step, one shard per rank, atomic, the last K kept
def ckpt_root(out_dir) -> Path:
    return Path(out_dir) / "checkpoints"


def complete_checkpoints(out_dir) -> list[Path]:
    """Newest first. A save renames step_N.partial/ only once it holds every shard and meta.json."""
    found = [d for d in ckpt_root(out_dir).glob("step_*") if not d.name.endswith(".partial")]
    return sorted((d for d in found if (d / "meta.json").is_file()), reverse=True)


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def check_resume_layout(cfg: TrainConfig) -> None:
    """--resume continues the newest readable checkpoint's run: the same shards (found by global
    rank, shaped by ZeRO and the virtual stages) and batches (the seed and the batch shape)."""
    keys = ("dp", "tp", "pp", "virtual_stages", "zero", "seed", "batch_size", "micro_batch_size",
            "block_size", "grad_compression", "powersgd_rank", "lora_rank", "lora_alpha")  # fmt: skip
    for ckpt in complete_checkpoints(cfg.out_dir):  # nothing to resume: start fresh (said later)
        try:
            saved = json.loads((ckpt / "meta.json").read_text())["config"]
        except (OSError, ValueError, KeyError):
            continue  # a damaged meta.json: load_checkpoint names it and falls back too
        saved = {**asdict(TrainConfig()), **saved}  # a flag newer than the checkpoint: its default
        for k in (k for k in keys if saved[k] != getattr(cfg, k)):
            name, now = "--" + k.replace("_", "-"), getattr(cfg, k)
            was = f"{ckpt} was written with {name} {saved[k]}, this run has {name} {now}"
            raise ConfigError(f"--resume: {was}; resume with the same {name} (or a new --out-dir)")
        return


def agree(run: Run, value: float, op) -> float:
    """`value` reduced over all ranks (MIN: all ok; MAX: any asked), on run.device as NCCL needs."""
    if run.grid.world == 1:  # no one to ask (and run.device may hold no data: the tests' "meta")
        return value
    t = torch.tensor(value, device=run.device)
    dist.all_reduce(t, op=op)
    return t.item()


def save_checkpoint(run: Run, step: int) -> None:
    """Ranks write shards into step_N.partial/; rank 0 adds meta.json, then commits: -> step_N."""
    cfg, rank, root = run.cfg, run.grid.rank, ckpt_root(run.cfg.out_dir)
    final, partial = root / f"step_{step:07d}", root / f"step_{step:07d}.partial"
    barrier = dist.barrier if run.grid.world > 1 else lambda: None
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    barrier()
    tp_rng = getattr(run.modules()[0], "tp_rng", None)  # 04's per-rank dropout stream
    # dropout's generators (python's and numpy's global ones go unused: 01's loader has its own)
    rng = {"torch": torch.get_rng_state()}
    if run.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(run.device)
    models = []  # ZeRO-3 holds 1/N of each weight: gather a chunk, and DP rank 0 copies it to
    for chunk, mod in zip(run.chunks, run.modules()):  # the CPU for --export (resume: the shards)
        with chunk.gathered() if cfg.zero == 3 else contextlib.nullcontext():
            state = mod.state_dict()
            if cfg.zero == 3:
                copy = run.grid.dp_rank == 0
                state = {k: v.to("cpu", copy=True) for k, v in state.items()} if copy else {}
            models.append(state)
    shard = {"model": models,
             "optimizer": run.optimizer.state_dict(), "scaler": run.scaler.state_dict(),
             "rng": rng, "tp_rng": None if tp_rng is None else tp_rng.state_dict(),
             "powersgd": [c.powersgd.state_dict() for c in run.chunks
                          if getattr(c, "powersgd", None)],
             "step": step,  # the data position too: batches are a pure function of the step
             "data_position": list(run.train.position(step)), "config": asdict(cfg)}  # fmt: skip
    data_lib.atomic_write(partial / shard_name(rank), lambda tmp: torch.save(shard, tmp))
    barrier()
    if rank == 0:
        tokenizer = json.loads((Path(cfg.data_dir) / "meta.json").read_text())["tokenizer"]
        if tokenizer not in ("gpt2", "char"):  # a saved BPE's path, made absolute: any cwd exports
            tokenizer = str(Path(tokenizer).resolve())
        meta = {"step": step, "world": run.grid.world, "dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp}
        meta.update(model_config=asdict(run.gpt_config), tokenizer=tokenizer, config=asdict(cfg))
        text = json.dumps(meta, indent=1)
        data_lib.atomic_write(partial / "meta.json", lambda p: p.write_text(text))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)  # every shard's and meta.json's name already on disk
        data_lib.fsync_dir(root)  # the rename itself
        for old in complete_checkpoints(cfg.out_dir)[cfg.keep_checkpoints :]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()


def load_checkpoint(run: Run) -> int:
    """Restore the newest checkpoint every rank can read (a damaged file is named, the previous
    one tried; the ranks vote, MIN of ok, so they agree); returns the step to continue from.
    subtle: shards load to the CPU, as RNG states must stay CPU tensors."""
    names = [[d.name for d in complete_checkpoints(run.cfg.out_dir)]]
    if run.grid.world > 1:  # rank 0's listing for all: a node with a stale view of a shared
        dist.broadcast_object_list(names, src=0)  # filesystem must not cast other votes (a hang)
    who = f"[rank {run.grid.rank}]"
    for ckpt in (ckpt_root(run.cfg.out_dir) / name for name in names[0]):
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
            for mod, state in zip(run.modules(), shard["model"], strict=True):
                if run.cfg.zero < 3:  # (ZeRO-3: the optimizer's shards below are the weights)
                    mod.load_state_dict(state)  # copies into the parameters, on their device
            run.optimizer.load_state_dict(shard["optimizer"])  # casts to each parameter's device
            if shard["scaler"]:
                run.scaler.load_state_dict(shard["scaler"])
            psgd = [c.powersgd for c in run.chunks if getattr(c, "powersgd", None)]
            for p, state in zip(psgd, shard.get("powersgd", []), strict=True):  # Q, residuals
                p.load_state_dict(state)
            if shard["tp_rng"] is not None:
                run.modules()[0].tp_rng.load_state_dict(shard["tp_rng"])  # 04's tracker
            torch.set_rng_state(shard["rng"]["torch"])
            if "cuda" in shard["rng"]:
                torch.cuda.set_rng_state(shard["rng"]["cuda"], run.device)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, or they hang
            print(f"{who} {path} does not fit this run: {str(e)[:200]}")
            ok = 0.0
        if agree(run, ok, dist.ReduceOp.MIN) < 1.0:
            raise SystemExit(f"--resume: {ckpt} does not fit this run on some rank (above)")
        distributed.print0(f"resumed from {ckpt} (step {shard['step']})")
        return shard["step"] + 1
    distributed.print0(f"--resume: no readable checkpoint in {ckpt_root(run.cfg.out_dir)}: from step 0")
    return 0


# ------------------------------------------------------- export and sampling: one file, one process
def export(run_dir) -> Path:
    """Merge the newest checkpoint's (tp, pp) shards into RUN_DIR/model.pt for 02_model.GPT. A
    damaged checkpoint (meta.json or a shard) is named and the previous one used, as --resume."""
    for ckpt in complete_checkpoints(run_dir):
        try:
            meta = json.loads((ckpt / "meta.json").read_text())
            dp, tp, full = meta["dp"], meta["tp"], {}
            for p in range(meta["pp"]):  # stage p's TP ranks at DP rank 0: grid (p, 0, t)
                files = [ckpt / shard_name(p * dp * tp + t) for t in range(tp)]
                shards = [torch.load(f, "cpu", weights_only=True)["model"] for f in files]
                for chunk_states in zip(*shards):  # the stage's chunks, each split over tp ranks
                    full.update(sampling.merge_shards(chunk_states))
            break
        except Exception as e:  # noqa: BLE001 - any unreadable file: say which, try older
            error = f"{type(e).__name__}: {str(e)[:120]}"
            print(f"--export: {ckpt} is unreadable ({error}); trying the previous checkpoint")
    else:
        raise SystemExit(f"--export: no complete, readable checkpoint in {ckpt_root(run_dir)}")
    return sampling.write_model_pt(meta, full, Path(run_dir) / "model.pt")


# -------------------------------------------------------------------------------------- preemption
def watch_preemption():
    """SIGTERM/SIGUSR1 (Slurm's warning, a spot instance going away) set a flag. preempted(run), a
    collective, has the ranks agree (MAX): a signal to any one stops all at the same point."""
    signals = []
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda signum, frame: signals.append(signum))
    return lambda run: bool(agree(run, float(bool(signals)), dist.ReduceOp.MAX))


# ----------------------------------------------------------------------------------------- the loop
def train(run: Run) -> None:
    cfg, preempted = run.cfg, watch_preemption()  # first: a signal during the load counts too
    if run.grid.rank == 0:  # a save killed midway leaves step_N.partial/, never to be completed
        for stale in ckpt_root(cfg.out_dir).glob("*.partial"):
            shutil.rmtree(stale, ignore_errors=True)
    start = load_checkpoint(run) if cfg.resume else 0
    log = run_log.Logger(run, start)
    stop = min(cfg.max_steps, start + cfg.steps_this_run) if cfg.steps_this_run else cfg.max_steps
    saved, step = None, start - 1  # saved: the step of this run's newest checkpoint
    for step in range(start, stop):
        stats = train_step(run, step)
        if step % cfg.log_interval == 0 or step == stop - 1:
            log.train_row(step, stats)
        if cfg.eval_interval and step % cfg.eval_interval == 0:  # step 0: the baseline
            val = evaluate(run, lambda: preempted(run))  # None: preempted while evaluating
            if val is not None:
                log.val_row(step, val)
        if cfg.ckpt_interval and (step + 1) % cfg.ckpt_interval == 0:
            save_checkpoint(run, saved := step)
        if preempted(run):
            distributed.print0(f"preemption signal: saving at step {step} and exiting")
            if saved != step:
                save_checkpoint(run, step)
            return
    if step >= start and saved != step:
        save_checkpoint(run, step)
    if stop == cfg.max_steps and step >= start:
        if (val := evaluate(run, lambda: preempted(run))) is None:
            return  # preempted during the last evaluation: the checkpoint is saved, exit now
        log.val_row(step, val)
    if run.grid.rank == 0:  # one process exports the final checkpoint, plots, and samples
        model_pt = export(cfg.out_dir)
        print(f"exported {model_pt} (step {step}); loss curve: {run_log.plot_losses(cfg.out_dir)}")
        if cfg.sample_tokens:
            text = sampling.sample(model_pt, "\n", cfg.sample_tokens, seed=cfg.seed)
            print(f"--- sample ({cfg.sample_tokens} tokens) ---\n{text}\n---")


def main(argv=None) -> None:
    cfg, args = parse_args(argv)
    if args.export:
        print(f"wrote {export(args.export)}")
        return
    if args.sample:
        print(sampling.sample(args.sample, args.prompt, cfg.sample_tokens or 200, cfg.seed))
        return
    world = int(os.environ.get("WORLD_SIZE", 1))
    try:  # everything that can be checked, before any process group or file exists
        gpt_config = validate(cfg, world, int(os.environ.get("RANK", 0)))
    except ConfigError as e:
        raise SystemExit(f"train.py: error: {e}") from None
    created = not dist.is_initialized()
    rank, _, world, device = distributed.init_distributed()
    try:
        run = build_run(cfg, gpt_config, build_grid(cfg, rank, world), device)
        trains = sum(p.numel() for m in run.modules() for p in m.parameters() if p.requires_grad)
        distributed.print0(f"world {world} = dp {cfg.dp} x tp {cfg.tp} x pp {cfg.pp} on {device}; "
                       f"{run.gpt_config.n_layer}-layer GPT, {run.dtype}, {run.m} microbatches of "
                       f"{cfg.micro_batch_size} x {run.T} per DP rank, recompute {cfg.recompute}; "
                       f"{trains:,} parameters train on rank 0")  # fmt: skip
        train(run)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
