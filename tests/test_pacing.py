import pytest

from rtts.pacing import LeadPacer


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
