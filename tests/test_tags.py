"""ChatTTS control tags ([uv_break], [laugh], [break_3], ...) survive segmenting and
normalizing, for any text, any place of the tags and any chunking of the input (issue 29)."""

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from rtts.text import SpokenText, normalize
from rtts.text.segmenter import Chunk, Segmenter

TAG = re.compile(r"\[[A-Za-z_]\w*\]", re.ASCII)
TAGS = ["[uv_break]", "[laugh]", "[lbreak]", "[break_0]", "[break_6]", "[oral_2]",
        "[laugh_1]", "[speed_5]", "[x]"]
ZH = st.text(alphabet=st.sampled_from(list("一二三四五六七八九十你好世界")), min_size=1,
             max_size=30)
EN = st.text(alphabet=st.sampled_from(list("abcdefghij")), min_size=1, max_size=12)
NOISE = st.sampled_from(list(" ，。,.!?\n3") + ["12", "[", "]", "[ab", "[1]", "3.5", "10:30"])


def texts(words: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.lists(st.one_of(words, words, st.sampled_from(TAGS), NOISE),
                    min_size=1, max_size=30).map("".join)


def chunked(text: str, cuts: list[int]) -> list[str]:
    """``text`` split at the given positions (the pieces a client sends)."""
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def segment(pieces: list[str], schedule: tuple[int, ...], max_chars: int) -> list[Chunk]:
    seg = Segmenter(schedule, max_chars)
    out: list[Chunk] = []
    for piece in pieces:
        out += seg.push(piece)
    return out + seg.flush()


def assert_tags_whole(text: str, chunks: list[Chunk], max_chars: int) -> None:
    for c in chunks:
        assert text[c.start:c.end] == c.text
        assert len(c.text) <= max(max_chars, 34)  # a tag that starts a chunk may pass it
    for m in TAG.finditer(text):
        inside = [c for c in chunks if c.start <= m.start() and m.end() <= c.end]
        assert len(inside) == 1, (m.group(), [c.text for c in chunks])
        # and no chunk boundary falls inside it
        assert not any(m.start() < c.start < m.end() or m.start() < c.end < m.end()
                       for c in chunks)


@settings(max_examples=300, deadline=None)
@given(st.one_of(texts(ZH), texts(EN), texts(st.one_of(ZH, EN))),
       st.lists(st.integers(0, 10_000), max_size=12),
       st.lists(st.integers(1, 60), min_size=1, max_size=4), st.integers(8, 60))
def test_no_chunk_boundary_inside_a_tag_in_any_chunking(text, cuts, schedule, max_chars):
    pieces = chunked(text, cuts)
    assert "".join(pieces) == text
    assert_tags_whole(text, segment(pieces, tuple(schedule), max_chars), max_chars)


@settings(max_examples=150, deadline=None)
@given(texts(ZH), st.integers(8, 60))
def test_tags_survive_in_cjk_without_punctuation_fed_one_character_at_a_time(text, max_chars):
    assert_tags_whole(text, segment(list(text), (8, 40), max_chars), max_chars)


def test_the_measured_bug_a_hard_cut_inside_laugh():
    text = "一二三四五六七八九十" * 3 + "一二三四五六七[laugh]八九十" + "一二三四五六七八九十" * 3
    for pieces in ([text], list(text), [text[:39], text[39:]]):  # 39: "…六七[la" | "ugh]…"
        chunks = segment(pieces, (8, 40, 80), 40)
        assert not any("[la" in c.text and "[laugh]" not in c.text for c in chunks)
        assert sum(c.text.count("[laugh]") for c in chunks) == 1


def test_tags_longer_than_max_chars_and_back_to_back_are_kept_whole():
    text = "[uv_break][uv_break][laugh]好"
    chunks = segment(list(text), (8,), 8)
    assert [c.text for c in chunks] == ["[uv_break]", "[uv_break]", "[laugh]好"]


def test_an_unclosed_bracket_is_not_held_forever():
    chunks = segment(["[abc def ghi jkl mno pqr stu vwx yz"], (8,), 8)
    assert "".join(c.text for c in chunks).replace(" ", "") == "[abcdefghijklmnopqrstuvwxyz"


@settings(max_examples=200, deadline=None)
@given(st.one_of(texts(ZH), texts(EN)),
       st.lists(st.integers(0, 10_000), max_size=8), st.integers(8, 60))
def test_the_normalizer_leaves_tags_untouched_whole_and_chunk_by_chunk(text, cuts, max_chars):
    assert TAG.findall(normalize(text)) == TAG.findall(text)
    spoken = SpokenText()
    said = [spoken(c.text) for c in segment(chunked(text, cuts), (8, 40), max_chars)]
    assert TAG.findall("".join(said)) == TAG.findall(text)


def test_the_normalizer_reads_numbers_next_to_tags_and_keeps_the_tags():
    assert normalize("共12元[uv_break]好") == "共十二元[uv_break]好"
    assert normalize("I have 3[laugh] cats[break_4].") == "I have three [laugh] cats[break_4]."
