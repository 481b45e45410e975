"""Reading an exported model.pt and sampling from it: train.py's `--sample`, and the sample at the
end of a run. Plumbing, kept out of train.py's lesson (DESIGN §2); `train.export` writes the file.

model.pt holds the model's config and state dict (02_model.GPT), the step, and the tokenizer: a
name ("gpt2", "char") or a trained BPE's vocabulary, merges and specials, so it samples anywhere.
"""

import importlib

import torch

data_lib = importlib.import_module("01_data")
model_lib = importlib.import_module("02_model")


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
