"""train.py's Run: everything one training step needs, built once, and its summary line.

A plain container: train.build_run fills it from the lessons (the model chunks, the
optimizer, the loss scaler, the loaders); support/train/checkpoint.py saves and restores it.
"""

from dataclasses import dataclass

import torch

from support.plan.shape import shape_text
from support.train.config import TrainConfig
from support.train.grid import Grid


@dataclass
class Run:
    """Everything one training step needs, built once."""

    cfg: TrainConfig
    grid: Grid
    gpt_config: object  # 02_model.GPTConfig
    device: torch.device
    dtype: torch.dtype
    chunks: list  # This rank's model chunk(s), DP-wrapped when dp > 1.
    optimizer: torch.optim.Optimizer
    scaled: object  # What the scaler unscales and steps: the optimizer, ZeRO's shards.
    scaler: object  # 06's DynamicLossScaler, enabled for fp16 only.
    train: object  # 01's DataLoaders.
    val: object
    T: int  # Tokens per sequence.
    m: int  # Microbatches per step per DP rank.

    def modules(self):
        """The model chunks without their DP wrappers."""
        return [getattr(c, "module", c) for c in self.chunks]


def describe(run: Run) -> str:
    """The run's first lines: the layout, the batch, what trains; the model's shape."""
    cfg = run.cfg
    params = [p for m in run.modules() for p in m.parameters() if p.requires_grad]
    world = run.grid.world
    sizes = f"dp {cfg.dp} x cp {cfg.cp} x tp {cfg.tp} x pp {cfg.pp}"
    layout = f"world {world} = {sizes} on {run.device}"
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    dtype = names[run.dtype]  # The flag's name, as the lessons write it.
    model = f"GPT, {dtype}, {run.m} microbatches"
    batch = f"of {cfg.micro_batch_size} x {run.T} per DP rank"
    trains = f"{sum(p.numel() for p in params):,} parameters train on rank 0"
    shape = f"model: {shape_text(run.gpt_config)}"
    return f"{layout}; {model} {batch}, recompute {cfg.recompute}; {trains}\n{shape}"


def adamw_groups(chunks, tied: list, weight_decay: float) -> list[dict]:
    """AdamW's parameter groups: decay on matrices (embeddings too, as nanoGPT), none
    on biases and gains, and the tied matrix (05's copies, `tied`) in a group of its own.
    Frozen parameters (LoRA's base) are not the optimizer's."""
    params = [p for c in chunks for p in c.parameters() if p.requires_grad]
    tied = [t for t in tied if t is not None and t.requires_grad]
    matrices = [p for p in params if p.dim() >= 2 and all(p is not t for t in tied)]
    # subtle: ZeRO flattens each group apart, so alone in its group the tied matrix is
    # cut alike on the first and last stage: their shards' gradients add (train_step).
    return [
        {"params": matrices, "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        {"params": tied, "weight_decay": weight_decay},
    ]
