import pytest

from rtts.api.native.pacing import LeadPacer


def test_no_pacing_when_off():
    p = LeadPacer(None)
    p.sent(100.0, 0.0)
    assert p.delay(0.0) == 0.0


def test_lead_is_bounded_against_a_real_time_clock():
    p = LeadPacer(2.0)
    assert p.delay(0.0) == 0.0
    for _ in range(20):  # 2 s of audio at once
        p.sent(0.1, 0.0)
    assert p.lead(0.0) == pytest.approx(2.0) and p.delay(0.0) == pytest.approx(0.0)
    p.sent(0.5, 0.0)
    assert p.delay(0.0) == pytest.approx(0.5)  # wait until half a second has played
    assert p.delay(0.5) == pytest.approx(0.0)
    assert p.lead(1.0) == pytest.approx(1.5)


def test_client_running_dry_restarts_the_clock():
    p = LeadPacer(1.0)
    p.sent(1.0, 0.0)
    assert p.lead(5.0) == 0.0  # played everything long ago
    p.sent(1.0, 5.0)  # the client resumes at t=5 with this second
    assert p.lead(5.0) == pytest.approx(1.0)
    p.sent(1.0, 5.0)
    assert p.delay(5.0) == pytest.approx(1.0)
    assert p.lead(6.0) == pytest.approx(1.0)


def test_backlog_beyond_the_burst_goes_out_at_ramp_speed():
    p = LeadPacer(2.0, burst_s=0.3, ramp=2.0)
    now = 0.0
    sent_at = []
    while p.lead(now) < 2.0 - 1e-9:  # a 2 s backlog, already synthesized
        now += p.delay(now)
        sent_at.append(now)
        p.sent(0.1, now)
    # the first 0.3 s go at once, then a 100 ms frame every 50 ms
    assert sent_at[:3] == [0.0] * 3 and sent_at[3] > 0
    gaps = [b - a for a, b in zip(sent_at[3:], sent_at[4:], strict=False)]
    assert gaps and all(g == pytest.approx(0.05) for g in gaps)
    assert p.lead(now) == pytest.approx(2.0, abs=0.11)


def test_ramp_off_sends_up_to_the_lead_at_once():
    p = LeadPacer(2.0, ramp=None)
    for _ in range(20):
        assert p.delay(0.0) == 0.0
        p.sent(0.1, 0.0)
