"""tests/symptoms.py names each way a proof breaks, the way a reader would say it."""

import pytest
import torch

from tests.symptoms import assert_close, diagnose

G = torch.linspace(-1.0, 2.0, 12).reshape(3, 4)  # a "gradient" with a zero crossing


@pytest.mark.parametrize(
    "broken, phrase",
    [
        (2.0 * G, "are 2x the reference's"),  # a missing / N at N = 2
        (0.25 * G, "are 0.25x the reference's"),
        (-G, "the reference's negative"),
        (torch.zeros_like(G), "are all zero"),
        (
            G.clone().index_fill_(0, torch.tensor([1]), float("nan")),
            "hold NaN or inf (4 of 12",
        ),
        (
            G.clone().index_fill_(0, torch.tensor([2]), 0.0),
            "differ in 4 of 12 entries, the first at 8",
        ),
    ],
)
def test_each_breakage_is_named(broken, phrase):
    assert phrase in diagnose(broken, G)


def test_a_scale_blurred_by_later_steps_reads_as_about_k():
    blurred = 1.6 * G + 0.6 * G.abs().mean() * torch.cos(torch.arange(12.0)).reshape(
        3, 4
    )
    assert "are about 1.5x the reference's" in diagnose(blurred, G)


def test_noise_reads_as_a_difference_not_a_scale():
    noisy = G + 0.3 * torch.sin(torch.arange(12.0)).reshape(3, 4)
    assert diagnose(noisy, G).startswith("differ")


def test_the_message_opens_with_the_symptom_and_keeps_torchs():
    with pytest.raises(AssertionError) as failed:
        assert_close(2 * G, G, "rank 1's gradient of wte")
    message = str(failed.value)
    assert message.startswith("rank 1's gradient of wte are 2x one process's")
    assert "not close" in message  # torch's own report follows


def test_equal_tensors_pass():
    assert_close(G.clone(), G, "anything")
