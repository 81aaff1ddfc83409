import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rtts.api.native.protocol import (
    SUPPORTED_FORMATS,
    CancelMessage,
    EndMessage,
    FlushMessage,
    FrameHeader,
    StartMessage,
    TextMessage,
    pack_frame,
    parse_client_message,
    unpack_frame,
)
from rtts.errors import ErrorCode, ProtocolError


def parse(obj):
    return parse_client_message(json.dumps(obj))


def code_of(data) -> ErrorCode:
    with pytest.raises(ProtocolError) as info:
        parse_client_message(data)
    return info.value.code


def test_start_with_all_params():
    msg = parse({"type": "start", "context_id": "c1", "voice": "seed:7", "seed": 42,
                 "temperature": 0.5, "top_P": 0.8, "top_K": 10, "speed": 3, "refine": True,
                 "format": "pcm16", "sample_rate": 16000, "chunk_schedule": [5, 50],
                 "max_chunk_chars": 100, "idle_flush_ms": 0})
    assert isinstance(msg, StartMessage)
    assert msg.context_id == "c1" and msg.sample_rate == 16000
    assert msg.params.voice == "seed:7" and msg.params.seed == 42
    assert msg.params.temperature == 0.5 and msg.params.top_P == 0.8
    assert msg.params.top_K == 10 and msg.params.speed == 3 and msg.params.refine
    assert msg.chunk_schedule == (5, 50) and msg.max_chunk_chars == 100
    assert msg.idle_flush_ms == 0


def test_defaults_and_default_context():
    msg = parse({"type": "start"})
    assert isinstance(msg, StartMessage)
    assert msg.context_id == "default" and msg.sample_rate == 24000
    assert msg.params.voice is None and msg.params.temperature == 0.3
    assert msg.normalize is True
    off = parse({"type": "start", "normalize": False})
    assert isinstance(off, StartMessage) and off.normalize is False
    assert parse({"type": "text", "text": "hi"}) == TextMessage("default", "hi")
    assert parse({"type": "flush", "context_id": "x"}) == FlushMessage("x")
    assert parse({"type": "cancel", "context_id": "x"}) == CancelMessage("x")
    assert parse({"type": "end"}) == EndMessage("default")


@pytest.mark.parametrize("data,code", [
    ("not json", ErrorCode.INVALID_JSON),
    ("[1,2]", ErrorCode.INVALID_MESSAGE),
    ('{"text": "no type"}', ErrorCode.INVALID_MESSAGE),
    ('{"type": "dance"}', ErrorCode.UNKNOWN_TYPE),
    ('{"type": "text", "text": 5}', ErrorCode.INVALID_MESSAGE),
    ('{"type": "text", "text": "x", "context_id": "bad id!"}', ErrorCode.INVALID_MESSAGE),
    ('{"type": "start", "temperature": "hot"}', ErrorCode.INVALID_PARAMS),
    ('{"type": "start", "temperature": 9}', ErrorCode.INVALID_PARAMS),
    ('{"type": "start", "top_K": 0}', ErrorCode.INVALID_PARAMS),
    ('{"type": "start", "top_K": true}', ErrorCode.INVALID_PARAMS),
    ('{"type": "start", "speed": 10}', ErrorCode.INVALID_PARAMS),
    ('{"type": "start", "sample_rate": 12345}', ErrorCode.INVALID_PARAMS),
    ('{"type": "start", "format": "vorbis"}', ErrorCode.INVALID_PARAMS),
    ('{"type": "start", "format": "mulaw", "sample_rate": 16000}', ErrorCode.INVALID_PARAMS),
    ('{"type": "start", "format": "opus", "sample_rate": 44100}', ErrorCode.INVALID_PARAMS),
    ('{"type": "start", "voice": ""}', ErrorCode.INVALID_PARAMS),
    ('{"type": "start", "voice": "seed:abc"}', ErrorCode.INVALID_PARAMS),
    ('{"type": "start", "refine": "yes"}', ErrorCode.INVALID_PARAMS),
    ('{"type": "start", "normalize": "no"}', ErrorCode.INVALID_PARAMS),
    ('{"type": "start", "normalize": 0}', ErrorCode.INVALID_PARAMS),
    ('{"type": "start", "chunk_schedule": [0]}', ErrorCode.INVALID_PARAMS),
    ('{"type": "start", "seed": -1}', ErrorCode.INVALID_PARAMS),
    ('{"type": "start", "temperature": NaN}', ErrorCode.INVALID_JSON),
])
def test_rejections(data, code):
    assert code_of(data) == code


def test_text_length_limit():
    with pytest.raises(ProtocolError) as info:
        parse_client_message(json.dumps({"type": "text", "text": "x" * 11}), max_text_chars=10)
    assert info.value.code == ErrorCode.TEXT_TOO_LONG


def test_frame_roundtrip():
    header = FrameHeader(stream=3, segment=7, sequence=65536)
    frame = pack_frame(header, b"\x01\x00\xff\x7f")
    assert len(frame) == 12 + 4
    assert unpack_frame(frame) == (header, b"\x01\x00\xff\x7f")
    with pytest.raises(ValueError):
        unpack_frame(b"\x01\x00")
    with pytest.raises(ValueError):
        unpack_frame(b"\x09" + frame[1:])


@given(st.text(max_size=200) | st.binary(max_size=200))
def test_parser_never_raises_anything_but_protocol_error(data):
    try:
        parse_client_message(data)
    except ProtocolError as exc:
        assert isinstance(exc.code, ErrorCode)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=10,
)


@given(st.sampled_from(["start", "text", "flush", "cancel", "end"]),
       st.dictionaries(st.sampled_from(["context_id", "text", "voice", "seed", "temperature",
                                        "top_P", "top_K", "speed", "refine", "sample_rate",
                                        "format", "chunk_schedule", "idle_flush_ms"]),
                       json_values, max_size=6))
def test_structured_fuzz(kind, fields):
    try:
        msg = parse({"type": kind, **fields})
    except ProtocolError:
        return
    assert type(msg).__name__.lower().startswith(kind)


def test_formats_match_the_codecs_and_take_their_own_rate():
    from rtts.audio.codecs import CODECS, output_rate

    assert set(SUPPORTED_FORMATS) == set(CODECS)
    for fmt in SUPPORTED_FORMATS:
        msg = parse_client_message(json.dumps({"type": "start", "format": fmt}))
        # the context's sample_rate is the rate the encoder really writes
        assert msg.sample_rate == output_rate(CODECS[fmt], msg.sample_rate), fmt
    assert parse_client_message('{"type": "start", "format": "mulaw"}').sample_rate == 8000
