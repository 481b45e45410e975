"""The vocabulary's padding rows: a multiple of 64 × tp while training, 64 in model.pt.

wte (and lm_head) get rows past the real vocabulary so that matmuls tile well: 50,257
rows padded to 50,304, a multiple of 64, as nanoGPT. Tensor parallelism (04) gives each
rank V/tp rows, so train.py pads to 64 × tp (Megatron-LM pads to 128 × tp): every tp
that divides the heads then divides the rows, and each rank's share stays a multiple
of 64. The extra rows are padding: never an input, their logits masked to -inf in the
loss, so their gradients are 0 and they stay as they began.

subtle: a GPT built at the larger padding would draw wte's init from more random
numbers, and so every weight drawn after it differently: a tp run would no longer start
from the one-process model. So the model is built at 64 (one process's init), and the
rows TP adds are appended, zero (grow_rows). Export cuts them off again (trim_rows):
model.pt is the same at every tp.
"""

import dataclasses
import math

import torch

MULTIPLE = 64  # One process's padding: 50,257 -> 50,304 (nanoGPT's).
KEYS = ("transformer.wte.weight", "lm_head.weight")  # The state dict's (V, C) tensors.


def tp_multiple(tp: int) -> int:
    """The padding multiple of a run at `tp`: 64 × tp, so V/tp is a multiple of 64."""
    return MULTIPLE * tp


def one_process(config):
    """02's GPTConfig (a dataclass) at one process's padding, 64."""
    return dataclasses.replace(config, pad_vocab_multiple=MULTIPLE)


def padded(vocab_size: int, multiple: int = MULTIPLE) -> int:
    """vocab_size rounded up to a multiple: the rows wte has."""
    return math.ceil(vocab_size / multiple) * multiple


def grow_rows(model, config) -> None:
    """A GPT built at one_process(config) -> config's padding, in place: zero rows
    appended to wte and to an untied lm_head (a tied one stays wte's tensor)."""
    wte = model.transformer.wte
    rows = config.padded_vocab_size - wte.weight.size(0)
    model.config = config
    if rows == 0:
        return
    tied = model.lm_head.weight is wte.weight
    for module in (wte,) if tied else (wte, model.lm_head):
        w = module.weight  # (V_64, C)
        grown = torch.cat([w.detach(), w.new_zeros(rows, w.size(1))])  # (V_64·tp, C)
        module.weight = torch.nn.Parameter(grown, requires_grad=w.requires_grad)
    wte.num_embeddings = wte.weight.size(0)
    model.lm_head.out_features = wte.weight.size(0)
    if tied:
        model.lm_head.weight = wte.weight


def trim_rows(state_dict: dict, model_config: dict) -> tuple[dict, dict]:
    """A merged state dict and its saved config (a dict) at any padding -> the same at
    64: wte's and lm_head's rows past padded(vocab_size) dropped (zero padding).
    Another padding (1: Hugging Face's shapes) is left as it is."""
    if model_config.get("pad_vocab_multiple", 1) % MULTIPLE:
        return state_dict, model_config
    rows = padded(model_config["vocab_size"])
    trimmed = {k: v[:rows] if k in KEYS else v for k, v in state_dict.items()}
    return trimmed, {**model_config, "pad_vocab_multiple": MULTIPLE}
