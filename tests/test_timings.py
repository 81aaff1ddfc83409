"""Estimated character timings (rtts.text.timings): pure, synchronous."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rtts.text.timings import char_weight, estimate


def test_durations_add_up_and_starts_increase() -> None:
    t = estimate("Hello, world. 你好！", 1234.4)
    assert t.text == "Hello, world. 你好！"
    assert sum(t.duration_ms) == 1234
    assert t.start_ms[0] == 0 and t.end_ms == 1234
    assert all(b >= a for a, b in zip(t.start_ms, t.start_ms[1:], strict=False))
    assert all(s + d == n for s, d, n in zip(t.start_ms, t.duration_ms, t.start_ms[1:],
                                              strict=False))


def test_weights_follow_the_documented_table() -> None:
    assert char_weight("你") == 1.0 and char_weight("a") == 0.3 and char_weight(" ") == 0.1
    assert char_weight("7") == 0.6 and char_weight("%") == 0.6
    assert char_weight(",") == 1.0 and char_weight("。") == 1.5 and char_weight("(") == 0.05
    # a CJK character takes longer than a Latin letter in the same segment
    t = estimate("a你", 1300)
    assert t.duration_ms == (300, 1000)


def test_shift_and_heard() -> None:
    t = estimate("ab cd", 1000).shifted(500)
    assert t.start_ms[0] == 500 and t.end_ms == 1500
    assert t.heard(0) == 0
    assert t.heard(1500) == 5
    n = t.heard(900)
    assert 0 < n < 5
    assert t.as_dict()["chars"] == list("ab cd")


def test_empty_text() -> None:
    t = estimate("", 500)
    assert t.chars == () and t.end_ms == 0 and t.heard(100) == 0


@given(st.text(min_size=1, max_size=60), st.floats(min_value=0, max_value=60_000))
def test_any_text_any_length(text: str, ms: float) -> None:
    t = estimate(text, ms)
    assert len(t.chars) == len(t.start_ms) == len(t.duration_ms) == len(text)
    assert sum(t.duration_ms) == round(ms)
    assert all(d >= 0 for d in t.duration_ms)
