import pytest

from rtts.api.native.protocol import (
    CancelMessage,
    EndMessage,
    FlushMessage,
    StartMessage,
    TextMessage,
    parse_client_message,
)
from rtts.api.native.session import (
    CancelContext,
    SendEvent,
    Session,
    SessionLimits,
    StartContext,
    Synthesize,
)
from rtts.core.params import SynthParams
from rtts.errors import ErrorCode, ProtocolError


def start(cid="a", **kw):
    return StartMessage(cid, SynthParams(), chunk_schedule=(4,), **kw)


def events(actions, kind):
    return [a.event for a in actions if isinstance(a, SendEvent) and a.event["type"] == kind]


def test_text_before_start_is_an_error():
    s = Session()
    with pytest.raises(ProtocolError) as info:
        s.receive(TextMessage("a", "hi"))
    assert info.value.code == ErrorCode.UNKNOWN_CONTEXT


def test_full_lifecycle_with_flush_and_done():
    s = Session()
    acts = s.receive(start(), now=0.0)
    assert isinstance(acts[0], StartContext)
    acts = s.receive(TextMessage("a", "Hello world. More"), now=0.1)
    syn = [a for a in acts if isinstance(a, Synthesize)]
    assert [a.chunk.text for a in syn] == ["Hello world."] and syn[0].index == 0
    acts = s.receive(FlushMessage("a"), now=0.2)
    syn = [a for a in acts if isinstance(a, Synthesize)]
    assert [(a.index, a.chunk.text) for a in syn] == [(1, "More")]
    assert not events(acts, "flushed")  # waits for the audio
    started = s.segment_started("a", 0, syn[0].chunk)
    assert started is not None and started.event["stream"] == 1
    s.segment_done("a", 0, syn[0].chunk, samples=24000, frames=10)
    acts = s.segment_done("a", 1, syn[0].chunk, samples=12000, frames=5)
    assert events(acts, "flushed")
    acts = s.receive(EndMessage("a"))
    done = events(acts, "done")
    assert done and done[0]["segments"] == 2 and done[0]["audio_ms"] == 1500.0
    assert "a" not in s.contexts


def test_segment_done_carries_alignment_offsets():
    s = Session()
    s.receive(start(sample_rate=16000))
    syn = [a for a in s.receive(TextMessage("a", "One two. Three four. ")) if
           isinstance(a, Synthesize)]
    e0 = events(s.segment_done("a", 0, syn[0].chunk, 16000, 10), "segment_done")[0]
    e1 = events(s.segment_done("a", 1, syn[1].chunk, 8000, 5), "segment_done")[0]
    assert (e0["audio_start_ms"], e0["duration_ms"]) == (0.0, 1000.0)
    assert (e1["audio_start_ms"], e1["duration_ms"]) == (1000.0, 500.0)
    assert (e1["text_start"], e1["text_end"]) == (9, 20)


def test_cancel_removes_context_and_reports():
    s = Session()
    s.receive(start("a"))
    s.receive(start("b"))
    acts = s.receive(CancelMessage("a"))
    assert isinstance(acts[0], CancelContext) and acts[0].stream == 1
    assert events(acts, "cancelled")[0]["context_id"] == "a"
    assert set(s.contexts) == {"b"}
    with pytest.raises(ProtocolError):
        s.receive(TextMessage("a", "late"))


def test_limits():
    s = Session(SessionLimits(max_contexts=1, max_text_chars_per_context=10))
    s.receive(start("a"))
    with pytest.raises(ProtocolError) as info:
        s.receive(start("b"))
    assert info.value.code == ErrorCode.TOO_MANY_CONTEXTS
    with pytest.raises(ProtocolError) as info:
        s.receive(start("a"))
    assert info.value.code == ErrorCode.CONTEXT_EXISTS
    s.receive(TextMessage("a", "x" * 10))
    with pytest.raises(ProtocolError) as info:
        s.receive(TextMessage("a", "y"))
    assert info.value.code == ErrorCode.TEXT_TOO_LONG


def test_no_text_after_end():
    s = Session()
    s.receive(start())
    s.receive(TextMessage("a", "Hello"))
    s.receive(EndMessage("a"))  # one segment pending, context still open
    with pytest.raises(ProtocolError):
        s.receive(TextMessage("a", "more"))


def test_idle_flush_timer():
    s = Session()
    s.receive(StartMessage("a", SynthParams(), chunk_schedule=(50,), idle_flush_ms=500), now=0)
    s.receive(TextMessage("a", "Waiting for more"), now=1.0)
    assert s.next_deadline() == pytest.approx(1.5)
    assert s.poll(now=1.4) == []
    acts = s.poll(now=1.5)
    assert [a.chunk.text for a in acts if isinstance(a, Synthesize)] == ["Waiting for more"]
    assert s.next_deadline() is None


def test_failed_segment_still_completes_context():
    s = Session()
    s.receive(start())
    syn = [a for a in s.receive(TextMessage("a", "Hello")) + s.receive(EndMessage("a"))
           if isinstance(a, Synthesize)]
    assert len(syn) == 1
    acts = s.segment_failed("a", 0, RuntimeError("boom"))
    err = events(acts, "error")[0]
    assert err["segment"] == 0 and err["context_id"] == "a"
    assert events(acts, "done")


# -- text normalization (issue 13) ------------------------------------------------------------


def test_synthesize_carries_the_spoken_text_and_segment_started_shows_it():
    s = Session()
    s.receive(start(), now=0.0)
    acts = s.receive(TextMessage("a", "价格是12"), now=0.1)
    assert not [a for a in acts if isinstance(a, Synthesize)]  # "12" may still grow
    acts = s.receive(TextMessage("a", ".5元，增长了20%。Call 911 now! "), now=0.2)
    syn = [a for a in acts if isinstance(a, Synthesize)]
    assert [(a.chunk.text, a.spoken) for a in syn] == [
        ("价格是12.5元，", "价格是十二点五元，"), ("增长了20%。", "增长了百分之二十。"),
        ("Call 911 now!", "Call nine one one now.")]
    started = s.segment_started("a", 0, syn[0].chunk)
    assert started is not None
    assert started.event["text"] == "价格是12.5元，"
    assert started.event["spoken"] == "价格是十二点五元，"
    s.segment_done("a", 0, syn[0].chunk, samples=100, frames=1)
    assert 0 not in s.contexts["a"].spoken  # forgotten once done


def test_normalize_false_synthesizes_the_text_as_written():
    s = Session()
    s.receive(start(normalize=False), now=0.0)
    acts = s.receive(TextMessage("a", "Call 911 now! "), now=0.1)
    syn = [a for a in acts if isinstance(a, Synthesize)]
    assert [(a.chunk.text, a.spoken) for a in syn] == [("Call 911 now!", "Call 911 now!")]
    started = s.segment_started("a", 0, syn[0].chunk)
    assert started is not None and started.event["spoken"] == "Call 911 now!"


def test_a_clause_without_letters_reads_in_the_language_before_it():
    s = Session()
    s.receive(start(), now=0.0)
    acts = s.receive(TextMessage("a", "答案是："), now=0.1)
    acts += s.receive(TextMessage("a", "42。"), now=0.2) + s.receive(FlushMessage("a"), now=0.3)
    syn = [a for a in acts if isinstance(a, Synthesize)]
    assert [a.spoken for a in syn] == ["答案是，", "四十二。"]  # not "forty two"


# -- SSML (issue 29) --------------------------------------------------------------------


def _ssml_session(*texts, end=True):
    s = Session()
    actions = s.receive(parse_client_message(
        '{"type":"start","context_id":"a","ssml":true,"speed":4}'))
    for text in texts:
        actions += s.receive(TextMessage("a", text))
    if end:
        actions += s.receive(EndMessage("a"))
    return s, actions


def test_ssml_context_cuts_where_the_prosody_rate_changes_and_sends_its_speed():
    _, actions = _ssml_session('<speak>Plain words here <prosody rate="fa',
                               'st">quick words</prosody> plain again.</speak>')
    jobs = [a for a in actions if isinstance(a, Synthesize)]
    assert [(j.chunk.text, j.speed) for j in jobs] == [
        ("Plain words here", None), ("quick words", 5), ("plain again.", None)]


def test_ssml_context_bad_ssml_closes_only_that_context():
    s, actions = _ssml_session("<speak><p>open</speak>", end=False)
    err = events(actions, "error")[0]
    assert err["code"] == "invalid_ssml" and err["context_closed"] is True
    assert any(isinstance(a, CancelContext) for a in actions) and "a" not in s.contexts
