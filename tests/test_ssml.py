"""The SSML subset (rtts/text/ssml.py): mapping, bounds, XML attacks, streamed pieces.
Pure and synchronous (issue 29)."""

import re
import time

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rtts.text import normalize
from rtts.text.segmenter import Segmenter
from rtts.text.ssml import Piece, SsmlError, SsmlLimits, SsmlReader, _parse_xml, parse, speed_for

TAG = re.compile(r"\[[A-Za-z_]\w*\]", re.ASCII)


def text_of(doc: str) -> str:
    return "".join(p.text for p in parse(doc))


def streamed(doc: str, cuts: list[int]) -> list[Piece]:
    points = sorted({c % (len(doc) + 1) for c in cuts})
    reader = SsmlReader()
    out: list[Piece] = []
    for a, b in zip([0, *points], [*points, len(doc)], strict=True):
        out += reader.feed(doc[a:b])
    return out + reader.end()


# -- mapping -------------------------------------------------------------------------


def test_breaks_map_to_chattts_pause_tokens_by_duration_and_strength():
    assert text_of('<speak>a<break time="20ms"/>b</speak>') == "ab"
    assert text_of('<speak>a<break time="250ms"/>b</speak>') == "a[uv_break]b"
    assert text_of('<speak>a<break time="0.8s"/>b</speak>') == "a[lbreak]b"
    assert text_of('<speak>a<break time="3s"/>b</speak>') == "a" + "[lbreak]" * 3 + "b"
    assert text_of('<speak>a<break time="60s"/>b</speak>') == "a" + "[lbreak]" * 10 + "b"
    assert text_of('<speak>a<break/>b</speak>') == "a[uv_break]b"
    assert text_of('<speak>a<break strength="none"/>b</speak>') == "ab"
    assert text_of('<speak>a<break strength="strong"/>b</speak>') == "a[lbreak]b"
    assert text_of('<speak>a<break strength="x-strong"/>b</speak>') == "a[lbreak][lbreak]b"


def test_prosody_rate_gives_pieces_with_their_rate_and_speed_for_maps_it():
    pieces = parse('<speak>one <prosody rate="slow">two <prosody rate="+100%">three'
                   '</prosody></prosody> <prosody rate="150%">four</prosody></speak>')
    assert [(p.text, p.rate) for p in pieces] == [
        ("one ", 1.0), ("two ", 0.75), ("three", 1.5), (" ", 1.0), ("four", 1.5)]
    # as OpenAI's speed factor maps (2.5 steps per doubling, rounded half to even)
    assert [speed_for(r) for r in (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0)] == [0, 2, 4, 5, 6, 8, 9]
    assert speed_for(2.0, base=2) == 4 and speed_for(2.0, base=3) == 6
    assert [p.rate for p in parse('<prosody rate="x-slow">a</prosody>'
                                  '<prosody rate="1000%">b</prosody>')] == [0.5, 4.0]


def test_say_as_digits_characters_cardinal_ordinal_date_in_english_and_chinese():
    assert text_of('<speak>Call <say-as interpret-as="digits">911</say-as></speak>') == \
        "Call nine one one"
    assert text_of('<speak>Code <say-as interpret-as="characters">ab1</say-as></speak>') == \
        "Code A B one"
    assert text_of('<speak>It is <say-as interpret-as="cardinal">1,234</say-as></speak>') == \
        "It is one thousand two hundred and thirty four"
    assert text_of('<speak>the <say-as interpret-as="ordinal">21st</say-as></speak>') == \
        "the twenty first"
    assert text_of('<speak>号码<say-as interpret-as="digits">110</say-as></speak>') == "号码一一零"
    assert text_of('<speak>第<say-as interpret-as="cardinal">25</say-as>名</speak>') == \
        "第二十五名"
    assert text_of('<speak>排<say-as interpret-as="ordinal">3</say-as></speak>') == "排第三"
    assert text_of('<speak xml:lang="zh-CN"><say-as interpret-as="digits">42</say-as>'
                   '</speak>') == "四二"
    dated = text_of('<speak>On <say-as interpret-as="date" format="mdy">12/4/2026</say-as>'
                    '</speak>')
    assert dated == "On 2026-12-04"
    assert normalize(dated) == "On December fourth, twenty twenty six"
    # content that is not what the kind expects is left as written
    assert text_of('<speak><say-as interpret-as="cardinal">many</say-as></speak>') == "many"
    assert text_of('<speak><say-as interpret-as="telephone">5</say-as></speak>') == "5"


def test_sub_p_s_entities_whitespace_and_unknown_elements():
    assert text_of('<speak><sub alias="World Wide Web">WWW</sub></speak>') == "World Wide Web"
    assert text_of("<speak><p><s>One.</s><s>Two.</s></p></speak>") == "\n\nOne.\n\nTwo.\n\n"
    assert text_of("<speak>Tom &amp; Jerry &lt;3</speak>") == "Tom & Jerry <3"
    assert text_of("<speak>\n   a\n\n   b   </speak>") == "a b "
    assert text_of('<speak>a <emphasis level="strong">big</emphasis> deal</speak>') == \
        "a big deal"
    assert text_of('<speak xmlns="http://www.w3.org/2001/10/synthesis">a<break time="1s"/>'
                   "</speak>") == "a[lbreak]"
    # ChatTTS tags written in the SSML pass through
    assert text_of("<speak>ha [laugh] ha</speak>") == "ha [laugh] ha"
    assert text_of('<?xml version="1.0" encoding="UTF-8"?>\n<!-- a note -->\n<speak>a<!-- x -->'
                   "b</speak>") == "ab"
    # a fragment without <speak> (the ElevenLabs way: tags inline in the text)
    assert text_of('Hello <break time="1s"/> there') == "Hello [lbreak] there"


@pytest.mark.parametrize(("doc", "words"), [
    ('<speak><break time="soon"/></speak>', "duration"),
    ('<speak><break strength="loud"/></speak>', "strength"),
    ('<speak><prosody rate="quick">a</prosody></speak>', "rate"),
    ('<speak><prosody rate="-100%">a</prosody></speak>', "above zero"),
    ("<speak><sub>x</sub></speak>", "alias"),
    ("<speak>a & b</speak>", "malformed"),
    ("<speak><p>a</speak>", "malformed"),
    ("<speak>a", "without </speak>"),
    ("<p>a", "inside an element"),
    ("<speak>a</speak> b", "after </speak>"),
    ("a </p>", "unexpected"),
    ("<speak><speak>a</speak></speak>", "root"),
    ("<speak/>", "says nothing"),
    ("<speak>a <br", "inside a tag"),
    ("<speak><?php x ?></speak>", "processing instructions"),
])
def test_bad_ssml_is_an_ssml_error_with_a_clear_message(doc, words):
    with pytest.raises(SsmlError, match=re.escape(words)):
        parse(doc)


# -- attacks: refused, never expanded --------------------------------------------------

BILLION_LAUGHS = """<?xml version="1.0"?>
<!DOCTYPE lolz [
 <!ENTITY lol "lol">
 <!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
 <!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">
 <!ENTITY lol4 "&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;">
 <!ENTITY lol5 "&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;">
 <!ENTITY lol6 "&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;">
 <!ENTITY lol7 "&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;">
 <!ENTITY lol8 "&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;">
 <!ENTITY lol9 "&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;">
]>
<speak>&lol9;</speak>"""
EXTERNAL_ENTITY = """<?xml version="1.0"?>
<!DOCTYPE speak [<!ENTITY xxe SYSTEM "file:///etc/passwd">]>
<speak>&xxe;</speak>"""
EXTERNAL_DTD = '<?xml version="1.0"?><!DOCTYPE speak SYSTEM "http://127.0.0.1:9/x.dtd"><speak/>'
QUADRATIC = ('<?xml version="1.0"?><!DOCTYPE speak [<!ENTITY a "' + "x" * 5000 + '">]>'
             "<speak>" + "&a;" * 2000 + "</speak>")
ATTACKS = {"billion laughs": BILLION_LAUGHS, "external entity": EXTERNAL_ENTITY,
           "external dtd": EXTERNAL_DTD, "quadratic blowup": QUADRATIC}


@pytest.mark.parametrize("name", ATTACKS)
def test_xml_attacks_are_refused_fast_by_the_scanner_and_by_defusedxml(name):
    doc = ATTACKS[name]
    limits = SsmlLimits(max_buffer_chars=len(doc) + 10)  # the size bound is not what stops it
    t0 = time.perf_counter()
    with pytest.raises(SsmlError, match="refused") as caught:
        parse(doc, limits)
    assert "passwd" not in str(caught.value) and "root:" not in str(caught.value)
    with pytest.raises(SsmlError, match="refused"):  # fed in pieces, too
        streamed(doc, [5, 17, 40, 200])
    # and the parser under the scanner refuses the DTD on its own
    with pytest.raises(SsmlError, match="refused"):
        _parse_xml(doc)
    assert time.perf_counter() - t0 < 1.0  # nothing was expanded (a bound, not a benchmark)


def test_an_undeclared_entity_is_an_error_not_a_lookup():
    with pytest.raises(SsmlError, match="undefined entity"):
        parse("<speak>&xxe;</speak>")


def test_bounds_are_checked_before_parsing():
    with pytest.raises(SsmlError, match="nest at most 16"):
        parse("<speak>" + "<p>" * 17 + "a" + "</p>" * 17 + "</speak>")
    with pytest.raises(SsmlError, match="at most 5 elements"):
        parse("<speak>" + "<break/>" * 6 + "</speak>", SsmlLimits(max_elements=5))
    with pytest.raises(SsmlError, match="at most 100 characters"):
        parse("<speak><p>" + "a" * 200 + "</p></speak>", SsmlLimits(max_buffer_chars=100))
    # text outside elements is not held, so a long plain document is fine
    assert len(text_of("<speak>" + "a " * 5000 + "</speak>")) == 10_000
    reader = SsmlReader(SsmlLimits(max_buffer_chars=100))
    with pytest.raises(SsmlError, match="at most 100 characters"):
        for _ in range(50):
            reader.feed("<prosody rate='slow'>" if _ == 0 else "word ")


# -- streaming -----------------------------------------------------------------------

WORDS = st.sampled_from(["Hello", "world", "你好", "世界", "42", "3.5", " ", "。", ", ",
                         "&amp;", "&lt;", "[laugh]", "[uv_break]"])


@st.composite
def elements(draw: st.DrawFn, depth: int = 0) -> str:
    kind = draw(st.sampled_from(["text", "text", "break", "prosody", "say-as", "sub", "p",
                                 "s"] if depth < 3 else ["text", "break"]))
    if kind == "text":
        return "".join(draw(st.lists(WORDS, min_size=1, max_size=4)))
    if kind == "break":
        return draw(st.sampled_from(['<break time="500ms"/>', '<break time="2s"/>',
                                     "<break strength='weak'/>", "<break/>"]))
    inner = "".join(draw(st.lists(elements(depth + 1), min_size=1, max_size=3)))
    if kind == "prosody":
        rate = draw(st.sampled_from(["slow", "fast", "80%", "+20%", "-10%", "1.5"]))
        return f'<prosody rate="{rate}">{inner}</prosody>'
    if kind == "say-as":
        how = draw(st.sampled_from(["digits", "characters", "cardinal", "ordinal", "date"]))
        body = draw(st.sampled_from(["123", "abc", "2026-12-04", "7"]))
        return f'<say-as interpret-as="{how}">{body}</say-as>'
    if kind == "sub":
        return '<sub alias="a &gt; b">x</sub>'
    return f"<{kind}>{inner}</{kind}>"


documents = st.builds(
    lambda head, body: head + body + ("</speak>" if head else ""),
    st.sampled_from(["", "<speak>", '<?xml version="1.0"?>\n<speak xml:lang="zh">',
                     '<speak xmlns="http://www.w3.org/2001/10/synthesis">']),
    st.lists(elements(), min_size=1, max_size=6).map("".join))


def merged(pieces: list[Piece]) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    for p in pieces:
        if out and out[-1][1] == p.rate:
            out[-1] = (out[-1][0] + p.text, p.rate)
        elif p.text:
            out.append((p.text, p.rate))
    return out


@settings(max_examples=200, deadline=None)
@given(documents, st.lists(st.integers(0, 10_000), max_size=15))
# found by hypothesis: a tag given out in two pieces ("[la", "ugh]") made say-as read English
@example('你好[laugh]<say-as interpret-as="digits">123</say-as>', [4])
def test_ssml_in_any_pieces_reads_as_the_whole_document(doc, cuts):
    assert merged(streamed(doc, cuts)) == merged(parse(doc))


@settings(max_examples=100, deadline=None)
@given(documents, st.integers(8, 40))
def test_mapped_tags_survive_the_segmenter(doc, max_chars):
    text = text_of(doc)
    seg = Segmenter((8, 20), max_chars)
    chunks = seg.push(text) + seg.flush()
    assert [t for c in chunks for t in TAG.findall(c.text)] == TAG.findall(text)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list("<>/&;=\"' abc!?-[]") + ["<speak>", "</speak>", "<break/>",
                                                              "<p>", "</p>", "<!DOCTYPE",
                                                              "&amp;", "<!--", "-->"]),
               max_size=40).map("".join),
       st.lists(st.integers(0, 100), max_size=5))
def test_any_input_gives_pieces_or_an_ssml_error_never_anything_else(doc, cuts):
    try:
        streamed(doc, cuts)
    except SsmlError as exc:
        assert str(exc)
