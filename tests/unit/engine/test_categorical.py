"""One draw from a row of probabilities (engine/categorical.py): it follows the
distribution, never draws a token of zero mass, repeats itself from the same
seed, and says when a row has no valid mass."""

import pytest
import torch

from pdcluster.services.engine.categorical import draw


def _counts(probs: torch.Tensor, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(probs.numel())
    for _ in range(n):
        counts[draw(probs, g)] += 1
    return counts


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.1, 0.0, 0.25, 0.05, 0.6])
    n = 20_000
    counts = _counts(probs, n)
    assert counts[1] == 0  # zero mass: never
    expected = probs * n
    keep = probs > 0
    chi2 = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    assert chi2 < 16.27, (counts, chi2)  # 3 degrees of freedom, p = 0.001


def test_unnormalised_rows_are_drawn_by_their_share_and_trailing_zeros_never():
    probs = torch.tensor([2.0, 6.0, 0.0, 0.0])
    counts = _counts(probs, 8_000, seed=5)
    assert counts[2] == counts[3] == 0
    assert abs(float(counts[1]) / 8_000 - 0.75) < 0.03


def test_a_vocabulary_row_of_small_probabilities_reaches_its_last_tokens():
    probs = torch.softmax(torch.zeros(49_152), dim=0)  # 2e-5 each: a float32 running sum would drift
    probs[-1] = probs[-2] = 0.0
    counts = _counts(probs, 4_000, seed=9)
    assert counts[-2:].sum() == 0
    assert counts[-1000:-2].sum() > 0  # the tail of the row is reachable


def test_the_same_seed_draws_the_same_tokens():
    probs = torch.softmax(torch.randn(1000, generator=torch.Generator().manual_seed(1)), dim=0)
    a = [draw(probs, torch.Generator().manual_seed(s)) for s in range(50)]
    b = [draw(probs, torch.Generator().manual_seed(s)) for s in range(50)]
    assert a == b and len(set(a)) > 10


@pytest.mark.parametrize("row", [
    [0.0, 0.0, 0.0],
    [0.5, float("nan"), 0.5],
    [0.5, float("inf"), 0.5],
])
def test_a_row_without_valid_mass_draws_nothing(row):
    assert draw(torch.tensor(row), torch.Generator().manual_seed(0)) is None


def test_a_seeded_draw_does_not_move_when_the_logits_move_slightly():
    """The reason for the race over an inverse CDF (engine/categorical.py): a flat row whose
    logits differ by 1e-4 draws the same tokens from the same seeds."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(49_152, generator=gen) * 2
    moved = logits + 1e-4 * torch.randn(49_152, generator=gen)
    a, b = torch.softmax(logits / 1.5, dim=0), torch.softmax(moved / 1.5, dim=0)
    draws = [(draw(a, torch.Generator().manual_seed(s)), draw(b, torch.Generator().manual_seed(s))) for s in range(300)]
    assert all(x == y for x, y in draws)
    assert len({x for x, _ in draws}) > 100  # and they are draws, not one token
