from hypothesis import given, settings
from hypothesis import strategies as st

from rtts.text.segmenter import Segmenter, is_speakable


def feed(seg: Segmenter, pieces):
    out = []
    for p in pieces:
        out += seg.push(p)
    return out


def test_first_chunk_is_short_then_longer():
    seg = Segmenter(schedule=(8, 40), max_chars=200)
    chunks = feed(seg, ["Hello there, ", "how are you ", "doing today? ", "I am fine. " * 5])
    assert chunks[0].text == "Hello there,"  # first chunk cut at a clause once >= 8 chars
    assert all(len(c.text) >= 40 for c in chunks[1:])


def test_nothing_before_minimum_and_flush_emits_rest():
    seg = Segmenter(schedule=(20,))
    assert seg.push("Hi. Yo.") == []
    assert [c.text for c in seg.flush()] == ["Hi. Yo."]
    assert seg.flush() == []


def test_chinese_punctuation_is_a_boundary():
    seg = Segmenter(schedule=(4,))
    chunks = feed(seg, list("你好，世界！今天天气很好。"))
    # "你好，" is under the 4-char minimum, so the first cut is at the first "！" past it
    assert [c.text for c in chunks] == ["你好，世界！", "今天天气很好。"]


def test_decimal_point_and_thousands_are_not_boundaries():
    seg = Segmenter(schedule=(4,))
    chunks = feed(seg, ["Pi is 3.", "14 and ", "we have 1,", "000 apples. Next"])
    assert [c.text for c in chunks] == ["Pi is 3.14 and we have 1,000 apples."]
    assert [c.text for c in seg.flush()] == ["Next"]


def test_period_at_end_waits_for_next_char():
    seg = Segmenter(schedule=(4,))
    assert seg.push("It is done.") == []
    assert [c.text for c in seg.push(" More")] == ["It is done."]


def test_closing_quotes_stay_with_sentence():
    seg = Segmenter(schedule=(4,))
    chunks = feed(seg, ['He said "stop!" and left. ', "「好的。」然后"])
    assert [c.text for c in chunks] == ['He said "stop!"', "and left.", "「好的。」"]


def test_hard_cut_without_punctuation():
    seg = Segmenter(schedule=(8,), max_chars=20)
    chunks = seg.push("一" * 45)
    assert [len(c.text) for c in chunks] == [20, 20]
    assert [len(c.text) for c in seg.flush()] == [5]


def test_long_english_without_punctuation_cuts_at_whitespace():
    seg = Segmenter(schedule=(8,), max_chars=30)
    chunks = seg.push("word " * 20)
    assert chunks and all(len(c.text) <= 30 and not c.text.endswith("wor") for c in chunks)


def test_punctuation_only_is_dropped_but_offsets_count():
    seg = Segmenter(schedule=(1,))
    chunks = feed(seg, ["... ", "!!! ", "Hi. ", "there."]) + seg.flush()
    assert [c.text for c in chunks] == ["Hi.", "there."]
    assert chunks[0].start == 8


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet=st.sampled_from(list("ab 你好,.!?。，\n3")), max_size=15),
                max_size=25),
       st.lists(st.integers(1, 60), min_size=1, max_size=4), st.integers(8, 80))
def test_chunks_cover_all_speakable_text_in_order(pieces, schedule, max_chars):
    seg = Segmenter(schedule=tuple(schedule), max_chars=max_chars)
    chunks = feed(seg, pieces) + seg.flush()
    full = "".join(pieces)
    pos = 0
    for c in chunks:
        assert 0 < len(c.text) <= max_chars
        assert full[c.start:c.end] == c.text  # offsets point at the text
        assert c.start >= pos
        pos = c.end
        assert is_speakable(c.text)
    # every speakable character ends up in exactly one chunk
    covered = "".join(c.text for c in chunks)
    assert [ch for ch in full if ch.isalnum()] == [ch for ch in covered if ch.isalnum()]


# -- numbers are never cut while they may still grow (issue 13) ----------------------------


def test_number_split_across_messages_is_held_until_it_ends():
    seg = Segmenter(schedule=(2,))
    assert seg.push("价格是12") == []
    assert [c.text for c in seg.push(".5%。好的")] == ["价格是12.5%。"]
    seg = Segmenter(schedule=(2,))
    assert seg.push("It costs 12,") == []
    assert [c.text for c in seg.push("500 dollars, ok")] == ["It costs 12,500 dollars,"]


def test_comma_between_numbers_with_a_space_is_not_a_boundary():
    seg = Segmenter(schedule=(4,))
    assert seg.push("On May 5,") == []
    assert seg.push(" ") == []  # may still be "May 5, 2026"
    assert [c.text for c in seg.push("2026, we met")] == ["On May 5, 2026,"]
    assert [c.text for c in seg.flush()] == ["we met"]


def test_abbreviations_are_not_sentence_ends():
    seg = Segmenter(schedule=(4,))
    chunks = feed(seg, ["Ask Dr. Smith at ext. 204 on Jan. 5. Then ", "go"])
    assert [c.text for c in chunks] == ["Ask Dr. Smith at ext. 204 on Jan. 5."]


def test_forced_cuts_do_not_split_a_number_or_a_number_and_its_unit():
    seg = Segmenter(schedule=(50,), max_chars=10)
    assert [c.text for c in seg.push("一二三四五六七八9012345")] == ["一二三四五六七八"]
    assert [c.text for c in seg.flush()] == ["9012345"]
    seg = Segmenter(schedule=(50,), max_chars=10)
    assert [c.text for c in seg.push("run it 5 km and")] == ["run it"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(alphabet=st.sampled_from(list("ab 你,.。，:%12")), max_size=6),
                max_size=30),
       st.lists(st.integers(1, 30), min_size=1, max_size=3), st.integers(8, 40))
def test_no_cut_between_two_digits_unless_the_chunk_is_all_number(pieces, schedule, max_chars):
    seg = Segmenter(schedule=tuple(schedule), max_chars=max_chars)
    chunks = feed(seg, pieces)  # no flush: a flush may cut anywhere, on request
    full = "".join(pieces)
    for c in chunks:
        if c.end < len(full) and full[c.end - 1].isdigit() and full[c.end].isdigit():
            assert all(ch.isdigit() or ch in ".,:%" for ch in c.text), (full, c)


def test_a_list_items_number_goes_with_its_text():
    seg = Segmenter(schedule=(1,))
    chunks = feed(seg, ["1. 首先，", "打开。\n2. Mix it. Then"])
    assert [c.text for c in chunks] == ["1. 首先，", "打开。", "2. Mix it."]
    seg = Segmenter(schedule=(1,))
    assert [c.text for c in feed(seg, ["步骤：1、打开；2、加水。"])] == [
        "步骤：", "1、打开；", "2、加水。"]
    seg = Segmenter(schedule=(1,))
    assert [c.text for c in feed(seg, ["It costs 3. Then"])] == ["It costs 3."]


# -- sentences joined with no space (pipecat sends each sentence of an LLM reply without its
# trailing space: "...the lazy dog." then "Please call me...") -----------------------------

# words that contain a "." that ends no sentence, in any position of a sentence
_TRICKY = ["3.5", "e.g.", "i.e.", "www.example.com", "example.com/Path", "Mr. Smith",
           "Mr.Smith", "Dr. Who", "node.js", "v1.2.3", "ASP.NET", "me@mail.Example.org"]
_WORDS = ["quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "call", "me",
          "soon", "about", "it", "version"]


@st.composite
def _sentence(draw) -> str:
    first = draw(st.sampled_from(["Please", "The", "I", "We", "Version", "Today"]))
    middle = draw(st.lists(st.sampled_from(_WORDS + _TRICKY), min_size=1, max_size=6))
    last = draw(st.sampled_from(_WORDS))  # a sentence ends with an ordinary word
    return " ".join([first, *middle, last]) + "."


@settings(max_examples=300, deadline=None)
@given(st.lists(_sentence(), min_size=1, max_size=5), st.data())
def test_a_sentence_end_followed_by_a_new_sentence_is_a_boundary_in_any_chunking(
        sentences, data):
    joins = [data.draw(st.sampled_from(["", " "])) for _ in sentences[1:]]
    text = sentences[0] + "".join(j + s for j, s in zip(joins, sentences[1:], strict=True))
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    for chunking in (pieces, [text]):
        seg = Segmenter(schedule=(1,), max_chars=400)
        chunks = feed(seg, chunking) + seg.flush()
        # one chunk per sentence: cut at every join, never inside 3.5, e.g., URLs, Mr.
        assert [c.text for c in chunks] == sentences, (chunking, [c.text for c in chunks])
        assert [text[c.start:c.end] for c in chunks] == sentences


def test_pipecat_pieces_are_cut_as_soon_as_the_next_sentence_starts():
    seg = Segmenter(schedule=(8, 40))
    assert seg.push("The quick brown fox jumps over the lazy dog.") == []  # "3." may grow
    chunks = seg.push("Please call me back")
    assert [c.text for c in chunks] == ["The quick brown fox jumps over the lazy dog."]
    assert [c.text for c in seg.flush()] == ["Please call me back"]
    for text in ("Pi is 3.5 today", "See e.g.The list", "Visit example.com now",
                 "Ask Mr.Smith now", "Born in the U.S.Army base", "Use ASP.NET here"):
        seg = Segmenter(schedule=(1,))
        assert [c.text for c in seg.push(text) + seg.flush()] == [text], text


def test_text_without_boundaries_is_scanned_in_c_not_char_by_char(monkeypatch):
    """Issue 31: a 20,000-character text with no punctuation ("3-5 3-5 ...") took ~10 ms of
    the event loop to segment, testing every character for a boundary in Python; the scans
    now jump from one punctuation mark to the next, so such a text tests none."""
    calls = 0
    original = Segmenter._boundary_after

    def counting(*args, **kwargs):
        nonlocal calls
        calls += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(Segmenter, "_boundary_after", staticmethod(counting))
    seg = Segmenter()
    chunks = seg.push("3-5 " * 5000) + seg.flush()
    assert calls == 0
    assert "".join(c.text + " " for c in chunks).split() == ["3-5"] * 5000
    calls = 0
    seg = Segmenter()
    seg.push("word, " * 2000)  # a boundary every 6 characters: about one test each
    assert calls < 2 * 12000 // 6 + 200
