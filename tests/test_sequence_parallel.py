"""04b_sequence_parallel.py: 04's proofs again with sequence parallelism on top (each
layer, the whole GPT, LoRA, subgroups, training, replicated gradients, bad configs,
communication, the gradient norm: tests/test_tensor_parallel.py's cases, run with
sp=True), and SP's own: the simple version (one LayerNorm and an MLP on T/tp tokens),
dropout masks of each rank's own on token shards, T not a multiple of tp, and the
activation bytes SP saves against its formula.

One world per world size runs every case (`CASES`, in order), as in
test_tensor_parallel.py, whose shapes and tolerances these reuse."""

import copy
import importlib

import pytest
import torch
import torch.nn as nn

from support.tensor_parallel.activations import saved_activation_bytes
from tests import test_tensor_parallel as tp_tests
from tests.distributed import run_ranks

tp_lib = importlib.import_module("04_tensor_parallel")
sp_lib = importlib.import_module("04b_sequence_parallel")
model_lib = importlib.import_module("02_model")
sharding = importlib.import_module("support.tensor_parallel.sharding")  # count_comm
B = tp_tests.B
T = tp_tests.T
close = tp_tests.close
gather = tp_tests.gather
tiny = tp_tests.tiny


def case_sublayer(rank, tp, group, sp):
    """The simple version: a LayerNorm and 02's MLP on this rank's T/tp tokens equal the
    whole pair on those tokens (output, dX, every gradient), with one all-gather and one
    reduce-scatter of (B, T, C) forward where f and g stood, and the same backward."""
    torch.manual_seed(6)
    ln = nn.LayerNorm(32)
    mlp = model_lib.MLP(tiny())
    x = torch.randn(B, T, 32, requires_grad=True)
    upstream = torch.randn(B, T, 32)
    (mlp(ln(x)) * upstream).sum().backward()
    sp_ln = sp_lib.SequenceParallelLayerNorm(copy.deepcopy(ln), group)
    fc = sp_lib.to_sequence_parallel(tp_lib.ColumnParallelLinear(mlp.c_fc, group))
    proj = sp_lib.to_sequence_parallel(tp_lib.RowParallelLinear(mlp.c_proj, group))
    x_mine = x.detach().chunk(tp, 1)[rank].clone().requires_grad_()
    with sharding.count_comm() as forward:
        z = proj(mlp.gelu(fc(sp_ln(x_mine))))  # (B, T/tp, C)
    with sharding.count_comm() as backward:
        (z * upstream.chunk(tp, 1)[rank]).sum().backward()
    E = B * T * 32 * 4  # bytes of one fp32 (B, T, C)
    assert forward == [("all_gather", E), ("reduce_scatter", E)], forward
    big = [op for op, n in backward if n == E]  # f's sums of copies' gradients: small
    assert big == ["all_gather", "reduce_scatter"], backward
    close(z, mlp(ln(x)).detach().chunk(tp, 1)[rank], "sublayer: output")
    close(x_mine.grad, x.grad.chunk(tp, 1)[rank], "sublayer: input grad")
    close(sp_ln.weight.grad, ln.weight.grad, "sublayer: LayerNorm dw (replicated)")
    close(sp_ln.bias.grad, ln.bias.grad, "sublayer: LayerNorm db (replicated)")
    close(fc.weight.grad, mlp.c_fc.weight.grad.chunk(tp, 0)[rank], "sublayer: c_fc dW")
    close(proj.weight.grad, mlp.c_proj.weight.grad.chunk(tp, 1)[rank], "c_proj dW")
    close(proj.bias.grad, mlp.c_proj.bias.grad, "sublayer: c_proj db (replicated)")


def case_token_dropout(rank, tp, group, sp):
    """Every dropout on token shards draws masks of its rank's own, also an attention
    switched by to_sequence_parallel alone (not through apply_sequence_parallel)."""
    _, tpm = tp_tests.gpt_pair(group, sp, dropout=0.5)
    attn = model_lib.CausalSelfAttention(tiny(dropout=0.5))
    rng = tp_lib.RNGStateTracker("cpu", seed=100 + rank)
    direct = sp_lib.to_sequence_parallel(tp_lib.ParallelSelfAttention(attn, group, rng))
    drops = {"a ParallelSelfAttention's resid_dropout": direct.resid_dropout}
    drops["transformer.drop"] = tpm.transformer.drop
    for i, block in enumerate(tpm.transformer.h):
        drops[f"h.{i}.attn.resid_dropout"] = block.attn.resid_dropout
        drops[f"h.{i}.mlp.dropout"] = block.mlp.dropout
    # the default stream, alike on every rank: a mask from it would be too
    torch.manual_seed(9)
    for name, drop in drops.items():
        masks = gather(drop.train()(torch.ones(64)), group)
        assert len({tuple(m.tolist()) for m in masks}) == tp, (
            f"SP: {name} masks alike on ranks"
        )


def case_sequence_length(rank, tp, group, sp):
    """T not a multiple of tp cannot be split by tokens: a clear error on every rank,
    before any collective runs."""
    _, tpm = tp_tests.gpt_pair(group, sp)  # built before the trap: apply runs a checksum
    with tp_tests.no_collectives():
        with pytest.raises(ValueError, match="T must be a multiple of tp"):
            tpm(torch.zeros(B, tp + 1, dtype=torch.long))


def case_activation_memory(rank, tp, group, sp):
    """The bytes a rank keeps for the backward (autograd's saved tensors), TP against
    TP + SP: SP saves exactly ln_saved_bytes, every LayerNorm's input and statistics
    for T - T/tp tokens. Integers, so the comparison is exact."""
    kept = {}
    for sequence_parallel in (False, True):
        _, tpm = tp_tests.gpt_pair(group, sequence_parallel)
        idx, targets = tp_tests.batch(5)
        _, kept[sequence_parallel] = saved_activation_bytes(lambda: tpm(idx, targets))
    formula = sp_lib.ln_saved_bytes(tiny(), B, T, tp)
    assert kept[False] - kept[True] == formula, (kept, formula)


CASES = [
    tp_tests.case_column_linear,
    tp_tests.case_row_linear,
    tp_tests.case_vocab_embedding,
    tp_tests.case_attention,
    case_sublayer,
    tp_tests.case_gpt,
    tp_tests.case_lora,
    tp_tests.case_gpt_in_subgroups,
    tp_tests.case_training,
    tp_tests.case_replicated_grads_identical,
    case_token_dropout,
    tp_tests.case_bad_config,
    case_sequence_length,
    tp_tests.case_comm_volume,
    tp_tests.case_grad_norm,
    case_activation_memory,
]


@pytest.fixture(scope="module", params=tp_tests.WORLD_SIZES, ids=lambda n: f"tp{n}")
def world(request):
    n = request.param
    return n, run_ranks(tp_tests.run_cases, n, CASES, True, timeout=120)


def verdict(world, case):
    return tp_tests.verdict(world, case)


def test_column_parallel_linear_gathers_tokens(world):
    verdict(world, tp_tests.case_column_linear)


def test_row_parallel_linear_scatters_tokens(world):
    verdict(world, tp_tests.case_row_linear)


def test_vocab_parallel_embedding_scatters_tokens(world):
    verdict(world, tp_tests.case_vocab_embedding)


def test_attention_on_token_shards(world):
    verdict(world, tp_tests.case_attention)


def test_layernorm_and_mlp_simple_version(world):
    verdict(world, case_sublayer)


def test_gpt_equals_unsharded(world):
    verdict(world, tp_tests.case_gpt)


def test_lora_factors_split_with_their_weights(world):
    verdict(world, tp_tests.case_lora)


def test_gpt_in_tp_subgroups_of_a_bigger_world(world):
    verdict(world, tp_tests.case_gpt_in_subgroups)


def test_training_steps_match_one_process(world):
    verdict(world, tp_tests.case_training)


def test_replicated_grads_identical_across_ranks(world):
    verdict(world, tp_tests.case_replicated_grads_identical)


def test_dropout_masks_differ_on_token_shards(world):
    verdict(world, case_token_dropout)


def test_bad_config_fails_before_any_collective(world):
    verdict(world, tp_tests.case_bad_config)


def test_a_length_tp_cannot_split_fails_before_any_collective(world):
    verdict(world, case_sequence_length)


def test_communication_volume_matches_formula(world):
    verdict(world, tp_tests.case_comm_volume)


def test_grad_norm_counts_replicated_params_once(world):
    verdict(world, tp_tests.case_grad_norm)


def test_activation_bytes_saved_match_formula(world):
    verdict(world, case_activation_memory)


def test_offline_merge_of_rank_state_dicts(world):
    """train.py --export merges SP ranks' saved state dicts as TP ones: the same keys."""
    shards = verdict(world, tp_tests.case_gpt)
    torch.manual_seed(0)
    full = model_lib.GPT(tiny(tie_embeddings=False))
    merged = tp_tests.merge_shards(shards)
    assert merged.keys() == full.state_dict().keys()
    for k, v in full.state_dict().items():
        torch.testing.assert_close(merged[k], v, rtol=0, atol=0)


def test_a_bad_rank_count_fails_before_any_rank_starts(monkeypatch, capsys):
    """`python 04b_sequence_parallel.py --ranks 3` cannot split the demo's 4 heads: a
    usage error (exit code 2) before anything is relaunched under torchrun."""
    distributed = importlib.import_module("support.distributed")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    launched = []
    monkeypatch.setattr(
        distributed, "relaunch_with_torchrun", lambda *a: launched.append(a)
    )
    with pytest.raises(SystemExit) as exit_:
        sp_lib.main(["--ranks", "3"])
    assert exit_.value.code == 2
    assert "n_head=4 is not divisible by tp=3" in capsys.readouterr().err
    assert launched == []
