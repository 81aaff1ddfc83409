"""The sampling shortcuts of rtts's GPT loop against what they replace, bit for bit.

* ``top_p_filter`` (a value sort and a threshold) against transformers' ``TopPLogitsWarper``
  as ChatTTS runs it (``top_p_filter_sorted``: a sort with indices and a scatter back),
  with ties, ties across the cut, per-row top-P and the 3 codes always kept;
* a seeded row's draw: ChatTTS re-seeds its generator before every one-sample
  ``torch.multinomial``, which is ``argmax(p / q)`` with ``q ~ Exp(1)`` from that generator,
  so ``BatchedGpt`` draws ``q`` once per row. If a torch release changed multinomial, this
  test says so before the exactness tests in test_chattts.py fail less clearly.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from rtts.engines.gpt_loop import (  # noqa: E402
    MIN_TOKENS_TO_KEEP,
    top_p_filter,
    top_p_filter_sorted,
)


def test_top_p_filter_equals_the_sorted_warper_with_and_without_ties():
    gen = torch.Generator().manual_seed(1)
    rnd = random.Random(1)
    for i in range(400):
        rows = rnd.choice([1, 4, 16, 32])
        x = torch.randn(rows, 626, generator=gen) * rnd.choice([0.5, 2.0, 6.0, 20.0])
        if i % 3 == 0:
            x = (x * 4).round() / 4  # many equal values
        if i % 5 == 0:
            x[:, :50] = x[:, 50:100]  # duplicates of a band
        top_p = torch.tensor([[rnd.choice([0.1, 0.5, 0.7, 0.95, 0.999, 1.0])]
                              for _ in range(rows)])
        assert torch.equal(top_p_filter(x, top_p), top_p_filter_sorted(x, top_p)), i


def test_top_p_filter_keeps_at_least_three_and_handles_a_tie_across_the_cut():
    # one dominant code: top-P alone would keep 1, the warper keeps 3
    x = torch.full((1, 626), -10.0)
    x[0, 7], x[0, 9], x[0, 11] = 10.0, 1.0, 0.5
    out = top_p_filter(x, torch.tensor([[0.5]]))
    assert int(torch.isfinite(out).sum()) == MIN_TOKENS_TO_KEEP
    assert torch.equal(out, top_p_filter_sorted(x, torch.tensor([[0.5]])))
    # equal values straddle the cut: the sorted path decides which of them stay
    y = torch.zeros(2, 626)
    y[:, :4] = 3.0
    p = torch.tensor([[0.002], [0.9]])
    assert torch.equal(top_p_filter(y, p), top_p_filter_sorted(y, p))


def test_a_reseeded_one_sample_multinomial_is_argmax_over_fixed_exponential_noise():
    rnd = random.Random(2)
    for seed in range(100):
        logits = torch.randn(4, 626) * rnd.choice([1.0, 4.0])
        logits[:, rnd.randrange(600):] = -torch.inf  # filtered codes, as after top-P/K
        probs = torch.softmax(logits, -1)
        gen = torch.Generator().manual_seed(seed)
        drawn = torch.multinomial(probs, num_samples=1, generator=gen).view(-1)
        noise = torch.empty(4, 626).exponential_(1, generator=gen.manual_seed(seed))
        assert torch.equal(drawn, (probs / noise).argmax(-1)), seed


def test_unseeded_draws_follow_the_probabilities_and_never_take_a_masked_code():
    """Rows without a seed draw through ``gpt_loop._draw`` (argmax(p / q), q = -log U from
    torch.rand): the frequencies match p, a zero-probability code is never drawn, and the
    draws are reproducible under ``torch.manual_seed`` as multinomial's were."""
    from rtts.engines.gpt_loop import _draw

    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0, 0.0])
    torch.manual_seed(1)
    drawn = _draw(p.repeat(40000, 1))
    freq = torch.bincount(drawn, minlength=6).float() / drawn.numel()
    assert torch.allclose(freq, p, atol=0.01)  # 40,000 draws: sd <= 0.0025
    assert int(freq[4:].sum()) == 0
    torch.manual_seed(1)
    assert torch.equal(_draw(p.repeat(40000, 1)), drawn)
