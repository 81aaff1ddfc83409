"""A small SSML subset -> text for the segmenter, with ChatTTS tags (pure, no I/O).

Elements (namespace optional; anything else is not read out as a tag but its text is
spoken, as SSML processors do with elements they do not know):

- ``<speak>``: the root (optional for streamed fragments); ``xml:lang`` (``zh``/``en``...)
  sets the language that ``say-as`` reads numbers in until text shows one.
- ``<break time="500ms|2s" strength="none|x-weak|weak|medium|strong|x-strong"/>``: ChatTTS
  has no timed pause, so the duration picks its pause tokens: none under 50 ms,
  ``[uv_break]`` up to 300 ms, ``[lbreak]`` up to 1 s, and one ``[lbreak]`` a second beyond
  that (at most 10 s). ``strength`` without ``time``: none/x-weak nothing, weak/medium
  ``[uv_break]``, strong ``[lbreak]``, x-strong two.
- ``<prosody rate="x-slow|slow|medium|fast|x-fast|N%|+N%|-N%|1.5">``: a rate multiplier
  (x-slow 0.5, slow 0.75, fast 1.5, x-fast 2; relative ones multiply the enclosing rate),
  turned into ChatTTS's speed 0..9 by :func:`speed_for`: ``base + 2.5 * log2(rate)``,
  two and a half steps per doubling around the context's speed (the mapping of OpenAI's
  and ElevenLabs' speed factor, ``rtts.core.voicenames.speed_from_factor``). ``pitch``
  and ``volume`` are not supported and are ignored.
- ``<say-as interpret-as="...">``: ``characters``/``spell-out``/``verbatim`` letter by
  letter (``A B C``, digits one by one), ``digits`` digit by digit, ``cardinal`` and
  ``ordinal`` as number words, ``date`` (``format`` ``ymd``/``mdy``/``dmy``) rewritten as
  ``YYYY-MM-DD`` for the normalizer to read; other kinds, and content that is not what the
  kind expects, are left as written (the normalizer reads them as ordinary text).
- ``<sub alias="...">``: the alias is said instead of the content.
- ``<p>``, ``<s>``: a line break on each side (a sentence end: the segmenter cuts there).

Safety: the text is bounded and scanned before any parser sees it (an element left open,
or a prolog, longer than ``max_buffer_chars``; nesting deeper than ``max_depth``; more than
``max_elements`` elements), ``<!DOCTYPE``, ``<!ENTITY`` and ``<![CDATA[`` are refused by the
scanner, and each piece is then parsed by :mod:`defusedxml` with DTDs forbidden, so no
entity is ever declared or expanded (billion laughs, quadratic blowup, external entities).
Every failure is an :class:`SsmlError` with a message for the client.

Streaming: :class:`SsmlReader` takes the text in any pieces. Text outside elements is
given out as soon as it arrives (up to a tag or an entity reference not yet complete);
an element other than the root ``<speak>`` is held until it closes, then parsed whole.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal
from xml.etree.ElementTree import Element, ParseError

import defusedxml
import defusedxml.ElementTree as SafeET

from rtts.text.normalize import (
    _digit_by_digit,
    _en_number,
    _en_ordinal,
    _zh_number,
    last_script,
)

__all__ = ["INLINE_CHARS", "Piece", "SsmlError", "SsmlLimits", "SsmlReader", "parse",
           "speed_for"]

# Reading costs up to ~0.5 us a character (more with many elements): a caller on an event
# loop reads SSML longer than this in a worker thread.
INLINE_CHARS = 2000

Lang = Literal["zh", "en"]

_RATES = {"x-slow": 0.5, "slow": 0.75, "medium": 1.0, "default": 1.0, "fast": 1.5,
          "x-fast": 2.0}
_STRENGTH = {"none": 0, "x-weak": 0, "weak": 300, "medium": 300, "strong": 1000,
             "x-strong": 2000}
_TIME = re.compile(r"\s*(\d{1,6}(?:\.\d{1,3})?)\s*(ms|s)\s*\Z")
_RATE = re.compile(r"\s*([+-]?)(\d{1,4}(?:\.\d{1,3})?)\s*(%?)\s*\Z")
_MIN_RATE, _MAX_RATE = 0.25, 4.0
_MAX_BREAK_MS = 10_000
_SPACE = re.compile(r"\s+")
_NAME = re.compile(r"</?\s*([A-Za-z_][\w.:-]*)")
# a tag from its "<": unquoted text and quoted values, up to its ">" (or a stray "<")
_TAG_END = re.compile(r"<[^<>\"']*(?:(?:\"[^\"]*\"|'[^']*')[^<>\"']*)*([<>])")
_SPECIAL = re.compile(r"[<&]")
_DECLARATION = re.compile(r"<!(?!--)")  # anything but a comment: DOCTYPE, ENTITY, CDATA
_TAIL_SETTLE = 1024  # characters given out before their script is settled anyway
_TAIL_KEEP = 40  # kept after that: longer than any ChatTTS tag, which may still be arriving
_TAG_REMNANT = re.compile(r"^\w*\]")  # the end of a tag whose start was dropped from the tail
_MAX_ROOT_TAG = 1000  # characters of the <speak ...> start tag (it wraps every piece)


class SsmlError(ValueError):
    """Bad or refused SSML; ``str(exc)`` is the message for the client."""


@dataclass(frozen=True, slots=True)
class SsmlLimits:
    max_buffer_chars: int = 10_000  # an open element (or the prolog) held before parsing
    max_depth: int = 16
    max_elements: int = 2_000  # in one stream


@dataclass(frozen=True, slots=True)
class Piece:
    """Text for the segmenter (ChatTTS tags included) and the prosody rate it is said at."""

    text: str
    rate: float = 1.0


def speed_for(rate: float, base: int = 5) -> int:
    """ChatTTS speed (0..9) for a prosody rate multiplier, around the context's own speed
    (``base``; 5 is ChatTTS's normal): two and a half steps per doubling."""
    return max(0, min(9, round(base + 2.5 * math.log2(rate))))


def parse(document: str, limits: SsmlLimits | None = None) -> list[Piece]:
    """A whole SSML document (or fragment) -> its pieces. Raises :class:`SsmlError`."""
    reader = SsmlReader(limits)
    return _merge(reader.feed(document) + reader.end())


def _merge(pieces: list[Piece]) -> list[Piece]:
    out: list[Piece] = []
    for p in pieces:
        if out and out[-1].rate == p.rate:
            out[-1] = Piece(out[-1].text + p.text, p.rate)
        elif p.text:
            out.append(p)
    return out


def _parse_xml(text: str) -> Element:
    """Parse with defusedxml, DTDs (and so all entity declarations) forbidden."""
    try:
        return SafeET.fromstring(text, forbid_dtd=True, forbid_entities=True,
                                 forbid_external=True)
    except defusedxml.DTDForbidden:
        raise SsmlError("SSML with a DTD (<!DOCTYPE>) is refused") from None
    except defusedxml.EntitiesForbidden:
        raise SsmlError("SSML entity declarations are refused") from None
    except defusedxml.ExternalReferenceForbidden:
        raise SsmlError("SSML external references are refused") from None
    except ParseError as exc:
        raise SsmlError(f"malformed SSML: {exc}") from None


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1].lower()


class SsmlReader:
    """Incremental SSML: :meth:`feed` pieces of the text, :meth:`end` at its end; each
    returns the :class:`Piece` s that are complete. Raises :class:`SsmlError`."""

    def __init__(self, limits: SsmlLimits | None = None, lang: Lang | None = None) -> None:
        self.limits = limits or SsmlLimits()
        self.lang: Lang | None = lang  # of the last letter given out (say-as numbers)
        self._buf = ""
        self._pos = 0  # scanned up to here
        self._depth = 0  # open elements, the root not counted
        self._elements = 0
        self._started = False  # anything but whitespace seen
        self._root: str | None = None  # the root's start tag, once read
        self._root_closed = False
        self._prolog = False  # reading "<?xml ...?>" and "<speak ...>"
        self._rates: list[float] = [1.0]
        self._final = False  # end(): nothing more will arrive
        self._space = True  # the last text given out ended in whitespace (or none yet)
        # the text given out since the language was last settled (its script is looked at
        # only when a say-as needs it, or when it grows past _TAIL_SETTLE characters)
        self._tail = ""

    def feed(self, text: str) -> list[Piece]:
        if self._root_closed and text.strip():
            raise SsmlError("text after </speak>")
        self._buf += text
        if not self._started:
            head = self._buf.lstrip()
            if not head:
                return []
            self._started = True
            self._prolog = head.startswith("<?") or head.startswith("<speak") or (
                len(head) < 6 and "<speak".startswith(head))
        out: list[Piece] = []
        if self._prolog:
            if not self._read_prolog():
                self._check_size()
                return []
        safe = self._scan()
        if safe > 0:
            fragment, self._buf = self._buf[:safe], self._buf[safe:]
            self._pos -= safe
            out = self._pieces(fragment)
        if self._root_closed and self._buf.strip():
            raise SsmlError("text after </speak>")
        self._check_size()
        return out

    def end(self) -> list[Piece]:
        self._final = True
        out = self.feed("")
        if self._prolog:
            raise SsmlError("SSML ended inside its <speak> start tag")
        if self._depth:
            raise SsmlError("SSML ended inside an element (every element must be closed)")
        if self._buf.strip():
            raise SsmlError("SSML ended inside a tag")
        if self._root is not None and not self._root_closed:
            raise SsmlError("SSML ended without </speak>")
        return out

    # -- scanning (bounds and safe cut points, before any parser) ------------------------

    def _check_size(self, size: int | None = None) -> None:
        if (len(self._buf) if size is None else size) > self.limits.max_buffer_chars:
            raise SsmlError(f"an SSML element may hold at most "
                            f"{self.limits.max_buffer_chars} characters")

    def _read_prolog(self) -> bool:
        """Wait for the root's start tag; check it (and any XML declaration) with the
        parser. True once read."""
        buf = self._buf
        if _DECLARATION.search(buf):
            raise SsmlError("SSML with a DTD (<!DOCTYPE>) or entity declarations is refused")
        i = buf.find("<speak")
        if i < 0:
            if len(buf.lstrip()) >= 6 and not buf.lstrip().startswith("<?"):
                self._prolog = False  # not a document after all: a fragment
                return True
            return False
        end = self._tag_end(buf, i)
        if end is None:
            return False
        start_tag = buf[i:end]
        if len(start_tag) > _MAX_ROOT_TAG:
            raise SsmlError(f"the <speak> start tag may be at most {_MAX_ROOT_TAG} characters")
        if start_tag.endswith("/>"):
            raise SsmlError("an empty <speak/> says nothing")
        _parse_xml(buf[:end] + "</speak>")  # the declaration and the root, checked
        self._root = start_tag
        root = _parse_xml(start_tag + "</speak>")
        lang = (root.get("{http://www.w3.org/XML/1998/namespace}lang") or "").lower()
        if lang[:2] in ("zh", "en") and self.lang is None:
            self.lang = "zh" if lang.startswith("zh") else "en"
        self._buf = buf[end:]
        self._pos = 0
        self._prolog = False
        return True

    @staticmethod
    def _tag_end(buf: str, i: int) -> int | None:
        """Index after the ``>`` that ends the tag at ``buf[i]`` (quotes respected); None
        if it has not all arrived. (A regular expression: linear, and not a Python loop
        over the characters, since a tag still arriving is looked at again each piece.)"""
        match = _TAG_END.match(buf, i)
        if match is None:
            return None
        if match.group(1) == "<":
            raise SsmlError("malformed SSML: '<' inside a tag")
        return match.end()

    def _scan(self) -> int:
        """Scan on from ``_pos``; return the last index where no element (but the root) is
        open and no tag or entity reference is cut (0: none yet)."""
        buf = self._buf
        n = len(buf)
        safe = 0
        i = self._pos
        while i < n:
            ch = buf[i]
            if ch == "&":
                semi = buf.find(";", i, i + 34)
                if semi < 0:
                    if n - i < 34 and not self._final:
                        break  # an entity reference still arriving
                    i += 1  # not one: the parser will say so
                    continue
                i = semi + 1
            elif ch == "<":
                if buf.startswith("<!--", i):
                    close = buf.find("-->", i + 4)
                    if close < 0:
                        break
                    i = close + 3
                    if self._depth == 0:
                        safe = i
                    continue
                if "<!--".startswith(buf[i:i + 4]) and not self._final:
                    break  # "<", "<!", "<!-": a comment or a tag still arriving
                if buf.startswith("<!", i):
                    raise SsmlError("SSML with a DTD, entity declarations or CDATA is refused")
                end = self._tag_end(buf, i)
                if end is None:
                    break
                tag = buf[i:end]
                if tag.startswith("<?"):
                    raise SsmlError("processing instructions are not accepted in SSML")
                match = _NAME.match(tag)
                if match is None:
                    raise SsmlError(f"malformed SSML tag {tag[:40]!r}")
                if tag.startswith("</"):
                    if self._depth == 0:
                        if self._root is not None and _local(match.group(1)) == "speak":
                            self._root_closed = True
                            self._buf = buf[:i] + buf[end:]  # the close is not in a piece
                            self._pos = i
                            return i
                        raise SsmlError(f"unexpected {tag[:40]!r}")
                    self._depth -= 1
                    if self._depth == 0 and end - safe > self.limits.max_buffer_chars:
                        self._check_size(end - safe)  # (safe: where the element began)
                elif not tag.endswith("/>"):
                    self._depth += 1
                    if self._depth > self.limits.max_depth:
                        raise SsmlError(f"SSML may nest at most {self.limits.max_depth} deep")
                self._elements += 1
                if self._elements > self.limits.max_elements:
                    raise SsmlError(f"SSML may have at most {self.limits.max_elements} elements")
                i = end
            else:
                special = _SPECIAL.search(buf, i)  # plain text: on to the next "<" or "&"
                i = n if special is None else special.start()
            if self._depth == 0:
                safe = i
        self._pos = i
        return safe

    # -- mapping ---------------------------------------------------------------------

    def _pieces(self, fragment: str) -> list[Piece]:
        if not fragment:
            return []
        if "<" not in fragment and "&" not in fragment:
            return self._text(_SPACE.sub(" ", fragment))
        root = _parse_xml((self._root or "<speak>") + fragment + "</speak>")
        out: list[Piece] = []
        self._children(root, out)
        return out

    def _text(self, text: str) -> list[Piece]:
        if text.startswith(" ") and self._space:
            text = text[1:]  # whitespace is collapsed across pieces too
        if not text:
            return []
        self._space = text[-1].isspace()
        self._tail += text
        if len(self._tail) > _TAIL_SETTLE:
            self._language()
        return [Piece(text, self._rates[-1])]

    def _language(self) -> Lang | None:
        """The script of the last letter given out (the language say-as reads in), outside
        ``[tags]``: the text is looked at joined, since a tag may have been given out in two
        pieces (``你好[la`` then ``ugh]``), and ``ugh]`` alone reads as Latin. After a look,
        only the last :data:`_TAIL_KEEP` characters are kept (a tag still arriving); a kept
        tail that starts inside a tag has that remnant masked."""
        seen = last_script(_TAG_REMNANT.sub(" ", self._tail))
        if seen is not None:
            self.lang = seen
        self._tail = self._tail[-_TAIL_KEEP:]
        return self.lang

    def _children(self, elem: Element, out: list[Piece]) -> None:
        out += self._text(_SPACE.sub(" ", elem.text or ""))
        for child in elem:
            self._element(child, out)
            out += self._text(_SPACE.sub(" ", child.tail or ""))

    def _element(self, elem: Element, out: list[Piece]) -> None:
        name = _local(elem.tag) if isinstance(elem.tag, str) else ""
        if name == "break":
            out += self._text(_break(elem.get("time"), elem.get("strength")))
        elif name == "prosody":
            self._rates.append(_rate(elem.get("rate"), self._rates[-1]))
            try:
                self._children(elem, out)
            finally:
                self._rates.pop()
        elif name == "say-as":
            content = _SPACE.sub(" ", "".join(elem.itertext())).strip()
            out += self._text(self._say_as(content, (elem.get("interpret-as") or "").lower(),
                                           (elem.get("format") or "").lower()))
        elif name == "sub":
            alias = elem.get("alias")
            if alias is None:
                raise SsmlError("<sub> needs an alias attribute")
            out += self._text(_SPACE.sub(" ", alias))
        elif name in ("p", "s"):
            out += self._text("\n")
            self._children(elem, out)
            out += self._text("\n")
        elif name == "speak":
            raise SsmlError("<speak> may only be the root element")
        else:
            self._children(elem, out)  # an element not in the subset: its text is said

    def _say_as(self, content: str, kind: str, fmt: str) -> str:
        lang: Lang = self._language() or "en"
        if kind in ("characters", "spell-out", "verbatim"):
            letters = [_digit_by_digit(ch, lang) if ch.isdigit() else ch.upper()
                       for ch in content if not ch.isspace()]
            return ("" if lang == "zh" and all(not ch.isascii() for ch in content)
                    else " ").join(letters)
        if kind == "digits":
            return _digit_by_digit(content, lang)
        number = content.replace(",", "").replace(" ", "")
        if kind == "cardinal" and re.fullmatch(r"-?\d{1,15}(?:\.\d{1,6})?", number):
            neg = number.startswith("-")
            words = (_zh_number if lang == "zh" else _en_number)(number.lstrip("-"))
            return (("负" if lang == "zh" else "minus ") if neg else "") + words
        if kind == "ordinal":
            match = re.fullmatch(r"(\d{1,12})(?:st|nd|rd|th)?", number)
            if match:
                n = match.group(1)
                return "第" + _zh_number(n) if lang == "zh" else _en_ordinal(int(n))
        if kind == "date":
            return _date(content, fmt or "ymd")
        return content


def _break(time: str | None, strength: str | None) -> str:
    if time is not None:
        match = _TIME.match(time)
        if match is None:
            raise SsmlError(f"<break time={time[:20]!r}>: use a duration like 500ms or 2s")
        ms = float(match.group(1)) * (1000 if match.group(2) == "s" else 1)
    elif strength is not None:
        if strength not in _STRENGTH:
            raise SsmlError(f"<break strength={strength[:20]!r}>: use one of "
                            f"{', '.join(_STRENGTH)}")
        ms = _STRENGTH[strength]
    else:
        ms = _STRENGTH["medium"]
    ms = min(ms, _MAX_BREAK_MS)
    if ms < 50:
        return ""
    if ms <= 300:
        return "[uv_break]"
    return "[lbreak]" * max(1, round(ms / 1000))


def _rate(value: str | None, current: float) -> float:
    if value is None:
        return current
    key = value.strip().lower()
    if key in _RATES:
        return _RATES[key]
    match = _RATE.match(key)
    if match is None:
        raise SsmlError(f"<prosody rate={value[:20]!r}>: use x-slow, slow, medium, fast, "
                        f"x-fast, a percentage (80%, +20%) or a multiplier (1.5)")
    sign, number, percent = match.groups()
    x = float(number) / (100 if percent else 1)
    if sign:
        if not percent:
            raise SsmlError(f"<prosody rate={value[:20]!r}>: a relative rate is a percentage")
        rate = current * (1 + x if sign == "+" else 1 - x)
    else:
        rate = x
    if rate <= 0:
        raise SsmlError(f"<prosody rate={value[:20]!r}>: the rate must be above zero")
    return max(_MIN_RATE, min(_MAX_RATE, rate))


def _date(content: str, fmt: str) -> str:
    parts = re.split(r"[-/. ]+", content.strip())
    order = {"ymd": "ymd", "mdy": "mdy", "dmy": "dmy"}.get(fmt)
    if order is None or len(parts) != 3 or not all(p.isdigit() for p in parts):
        return content
    value = dict(zip(order, parts, strict=True))
    y, m, d = value["y"], int(value["m"]), int(value["d"])
    if len(y) != 4 or not (1 <= m <= 12 and 1 <= d <= 31):
        return content
    return f"{y}-{m:02d}-{d:02d}"
