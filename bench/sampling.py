"""model.pt, the exported model: written from a checkpoint's shards (`train.export` finds and reads
them), read back, sampled from (train.py's `--sample`, and the sample at the end of a run).
Plumbing, kept out of train.py's lesson (DESIGN §2).

model.pt holds the model's config and state dict (02_model.GPT), the step, and the tokenizer: a
name ("gpt2", "char") or a trained BPE's vocabulary, merges and specials, so it samples anywhere.
"""

import importlib
from dataclasses import asdict

import torch

data_lib = importlib.import_module("01_data")
model_lib = importlib.import_module("02_model")
tp_lib = importlib.import_module("04_tensor_parallel")


def merge_shards(state_dicts) -> dict:
    """TP ranks' state dicts, in tp_rank order -> 02's full one (04's tp_layout: what is split)."""
    full = {}
    for k, v in state_dicts[0].items():
        layout = tp_lib.tp_layout(k)
        full[k] = tp_lib.merge_tensors([sd[k] for sd in state_dicts], *layout) if layout else v
    return full


def write_model_pt(meta: dict, full: dict, out):
    """A checkpoint's meta.json and merged state dict -> model.pt at `out`, for 02_model.GPT."""
    if rank := meta["config"].get("lora_rank"):  # LoRA's factors folded in: W + (alpha / r)·B·A
        full = model_lib.merge_lora(full, meta["config"]["lora_alpha"] / rank)
    model = model_lib.GPT(model_lib.GPTConfig(**meta["model_config"] | {"recompute": "none"}))
    model.load_state_dict(full, strict=True)  # every weight present, none left over
    blob = {"model_config": asdict(model.config), "model": model.state_dict(), "step": meta["step"]}
    # the tokenizer, so model.pt samples anywhere: a name, or a BPE's vocab, merges and specials
    blob["tokenizer"] = tok = meta["tokenizer"]
    if tok not in ("gpt2", "char"):
        tok = data_lib.get_tokenizer(tok)
        specials = list(tok.special_tokens)
        blob["tokenizer"] = {"vocab": tok.vocab, "merges": tok.merges, "special_tokens": specials}
    data_lib.atomic_write(out, lambda tmp: torch.save(blob, tmp))
    return out


def load_exported(path) -> tuple:
    """model.pt -> (02_model.GPT on the CPU, the whole blob)."""
    blob = torch.load(path, map_location="cpu", weights_only=True)
    model = model_lib.GPT(model_lib.GPTConfig(**blob["model_config"]))
    model.load_state_dict(blob["model"])
    return model, blob


def sample(model_pt, prompt: str, n_tokens: int, seed: int = 0) -> str:
    """The prompt and n_tokens sampled after it (temperature 0.8, top 50), decoded."""
    model, blob = load_exported(model_pt)
    t = blob["tokenizer"]  # a name (an older model.pt: a path), or a BPE's vocab and merges
    tok = data_lib.get_tokenizer(t) if isinstance(t, str) else data_lib.Tokenizer(**t)
    idx = torch.tensor([tok.encode(prompt) or [tok.eot_token]])
    generator = torch.Generator().manual_seed(seed)
    out = model.generate(idx, n_tokens, temperature=0.8, top_k=50, generator=generator)
    return tok.decode(out[0].tolist())


def to_hf_state_dict(model) -> dict:
    """The inverse of GPT.from_hf_state_dict: a plain GPT's weights in Hugging Face's GPT-2 layout
    (GPT2LMHeadModel keys, Conv1D weights back to (in, out), wte/lm_head padding rows dropped), for
    --init-from and the tests. No attn.bias mask buffers (HF's newer versions do not save them)."""
    V, sd = model.config.vocab_size, {}
    for key, value in model.state_dict().items():
        value = value.detach()
        if key.endswith(model_lib.GPT._CONV1D):
            value = value.t()
        if key in ("transformer.wte.weight", "lm_head.weight"):
            value = value[:V]
        sd[key] = value.contiguous().clone()
    return sd
