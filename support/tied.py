"""The tied embedding across pipeline stages (05_pipeline.py, train.py).

GPT-2's token embedding wte and its output layer lm_head are one matrix. Cut into
stages, the first stage holds it as wte and the last as lm_head: two copies on two
ranks. Each step their gradients are summed over the two ranks (Megatron's "embedding
group"), so both copies take the same optimizer step and stay equal.
A chunk here is anything with .config.tie_embeddings, .is_first, .is_last,
.transformer.wte and .lm_head (05's PipelineChunk).
"""

import torch.distributed as dist


def tied_parameter(chunk):
    """The chunk's copy of the tied wte/lm_head matrix, or None."""
    if chunk.config.tie_embeddings and (chunk.is_first or chunk.is_last):
        return chunk.transformer.wte.weight if chunk.is_first else chunk.lm_head.weight


def embedding_group(pp_groups_ranks):
    """Megatron's embedding group: {first, last} rank of *this rank's* pipeline.

    subtle: new_group is a world collective, so EVERY rank passes EVERY PP group's
    global ranks, in the same order."""
    mine = None
    for ranks in pp_groups_ranks:
        pair = sorted({ranks[0], ranks[-1]})
        group = dist.new_group(pair) if len(pair) > 1 else None  # p = 1: one copy
        mine = group if dist.get_rank() in pair else mine
    return mine


def allreduce_tied_grads(chunks, embed_group):
    """wte and lm_head are one matrix: its gradient is the SUM of both copies'."""
    for param in (tied_parameter(chunk) for chunk in chunks):
        if param is not None and param.grad is not None:
            dist.all_reduce(param.grad, group=embed_group)  # SUM over {first, last}
