"""Spoken form of written text, Chinese and English: numbers, dates, money, units, symbols.

ChatTTS's own normalizer deletes every character outside CJK, Latin letters and
``，。、,. `` (after mapping a few marks), so "Call 911 now!" reaches the model as
"Call  now.". :func:`normalize` writes such text out as words first::

    normalize("The meeting is at 3:30 and costs $12.50.")
    -> "The meeting is at three thirty and costs twelve dollars and fifty cents."
    normalize("价格是12.5元，增长了20%。") -> "价格是十二点五元，增长了百分之二十。"

num2words spells English numbers (cardinals, ordinals, years), cn2an Chinese ones; the
rest here is the glue: finding the expressions, choosing the language, and the forms the
libraries do not have (times, dates, money, units, phone numbers, ranges, symbols).

**Language.** A number is read in Chinese if the nearest letter before or after it, within
its clause, is a CJK character; else in English if one is a Latin letter. A clause with no
letters takes the language of the nearest letter before it in the text, else ``lang_hint``,
else English. Clauses end at the marks where :mod:`rtts.text.segmenter` may cut, so a chunk
normalizes exactly as it does inside the whole text; :class:`SpokenText` carries the
"letter before it" across the chunks of one context.

Pure: no I/O, no state outside :class:`SpokenText`.
"""

from __future__ import annotations

import contextvars
import functools
import re
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from decimal import Decimal
from typing import Literal

import cn2an
from num2words import num2words

__all__ = ["Lang", "SpokenText", "normalize", "spoken_text", "trace"]

Lang = Literal["zh", "en"]

# -- library calls, traced (tests count which library handled what) -----------------------

_TRACE: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("rtts_norm_trace",
                                                                      default=None)


def trace(text: str, lang_hint: Lang | None = None) -> tuple[str, set[str]]:
    """:func:`normalize`, plus the names of the libraries it called (``num2words``, ``cn2an``)."""
    used: set[str] = set()
    token = _TRACE.set(used)
    try:
        return normalize(text, lang_hint), used
    finally:
        _TRACE.reset(token)


def _note(lib: str) -> None:
    used = _TRACE.get()
    if used is not None:
        used.add(lib)


def _n2w(value: int | Decimal, to: str = "cardinal") -> str:
    _note("num2words")
    return _n2w_cached(value, to)


@functools.lru_cache(maxsize=4096)
def _n2w_cached(value: int | Decimal, to: str) -> str:
    # (num2words costs ~10 us a call: "3-5 3-5 ..." repeats the same few numbers)
    words: str = num2words(value, to=to)
    # "twenty-one", "one thousand, two hundred": ChatTTS turns "-" into a pause
    return words.replace("-", " ").replace(",", "")


def _an2cn(digits: str) -> str:
    _note("cn2an")
    return _an2cn_cached(digits)


@functools.lru_cache(maxsize=4096)
def _an2cn_cached(digits: str) -> str:
    words: str = cn2an.an2cn(digits, "low")
    return words


# -- primitives -------------------------------------------------------------------------------

_EN_DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_ZH_DIGITS = "零一二三四五六七八九"


def _plain(num: str) -> str:
    return num.replace(",", "")


def _en_digits(digits: str) -> str:
    return " ".join(_EN_DIGITS[int(d)] for d in digits if d.isdigit())


def _zh_digits(digits: str, phone: bool = False) -> str:
    out = "".join(_ZH_DIGITS[int(d)] for d in digits if d.isdigit())
    return out.replace("一", "幺") if phone else out


def _digit_by_digit(text: str, lang: Lang) -> str:
    """Last resort: digits one by one, everything else as it was."""
    if lang == "zh":
        return "".join(_ZH_DIGITS[int(ch)] if "0" <= ch <= "9" else ch for ch in text)
    return " ".join(_EN_DIGITS[int(ch)] if "0" <= ch <= "9" else ch for ch in text)


def _en_number(num: str) -> str:
    """Cardinal or decimal: "1,234.50" -> "one thousand two hundred thirty four point five zero"."""
    whole, _, frac = _plain(num).partition(".")
    words = _n2w(int(whole))
    return f"{words} point {_en_digits(frac)}" if frac else words


def _zh_number(num: str) -> str:
    words = _an2cn(_plain(num))
    if len(words) > 1 and words[0] == "二" and words[1] in "百千万亿":
        words = "两" + words[1:]  # 两千, 两万: how it is said
    return words


def _en_year(year: int) -> str:
    return _n2w(year, "year")


def _en_ordinal(n: int) -> str:
    return _n2w(n, "ordinal")


def _long_digit_string(num: str) -> bool:
    """Read digit by digit: leading zeros (007, 0571) or 9+ unformatted digits (ids)."""
    return "," not in num and "." not in num and len(num) > 1 and (
        num[0] == "0" or len(num) >= 9)


def _year_like(num: str) -> bool:
    return len(num) == 4 and num.isdigit() and 1100 <= int(num) <= 2099


def _strip_zeros(num: str) -> str:
    num = _plain(num)
    if "." in num:
        num = num.rstrip("0").rstrip(".")
    return num


def _en_plural(noun: str) -> str:
    if noun.endswith("y") and not noun.endswith(("ay", "ey", "oy")):
        return noun[:-1] + "ies"
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    return noun + "s"


# -- tables -----------------------------------------------------------------------------------

# symbol: (English singular, English plural, Chinese)
_UNITS: dict[str, tuple[str, str, str]] = {
    "km/h": ("kilometer per hour", "kilometers per hour", "公里每小时"),
    "m/s": ("meter per second", "meters per second", "米每秒"),
    "kWh": ("kilowatt hour", "kilowatt hours", "千瓦时"),
    "mph": ("mile per hour", "miles per hour", "英里每小时"),
    "Gbps": ("gigabit per second", "gigabits per second", "千兆比特每秒"),
    "Mbps": ("megabit per second", "megabits per second", "兆比特每秒"),
    "km": ("kilometer", "kilometers", "公里"),
    "cm": ("centimeter", "centimeters", "厘米"),
    "mm": ("millimeter", "millimeters", "毫米"),
    "kg": ("kilogram", "kilograms", "千克"),
    "mg": ("milligram", "milligrams", "毫克"),
    "ml": ("milliliter", "milliliters", "毫升"),
    "mL": ("milliliter", "milliliters", "毫升"),
    "°C": ("degree Celsius", "degrees Celsius", "摄氏度"),
    "℃": ("degree Celsius", "degrees Celsius", "摄氏度"),
    "°F": ("degree Fahrenheit", "degrees Fahrenheit", "华氏度"),
    "℉": ("degree Fahrenheit", "degrees Fahrenheit", "华氏度"),
    "°": ("degree", "degrees", "度"),
    "TB": ("terabyte", "terabytes", "TB"),
    "GB": ("gigabyte", "gigabytes", "GB"),
    "MB": ("megabyte", "megabytes", "MB"),
    "KB": ("kilobyte", "kilobytes", "KB"),
    "kB": ("kilobyte", "kilobytes", "KB"),
    "GHz": ("gigahertz", "gigahertz", "吉赫兹"),
    "MHz": ("megahertz", "megahertz", "兆赫兹"),
    "kHz": ("kilohertz", "kilohertz", "千赫兹"),
    "Hz": ("hertz", "hertz", "赫兹"),
    "kW": ("kilowatt", "kilowatts", "千瓦"),
    "W": ("watt", "watts", "瓦"),
    "V": ("volt", "volts", "伏"),
    "ms": ("millisecond", "milliseconds", "毫秒"),
    "min": ("minute", "minutes", "分钟"),
    "hr": ("hour", "hours", "小时"),
    "h": ("hour", "hours", "小时"),
    "s": ("second", "seconds", "秒"),
    "m": ("meter", "meters", "米"),
    "g": ("gram", "grams", "克"),
    "L": ("liter", "liters", "升"),
    "lbs": ("pound", "pounds", "磅"),
    "lb": ("pound", "pounds", "磅"),
    "ft": ("foot", "feet", "英尺"),
    "mi": ("mile", "miles", "英里"),
    "oz": ("ounce", "ounces", "盎司"),
}

# currency sign or code: (English singular, English plural, English minor unit(s), Chinese)
_MONEY: dict[str, tuple[str, str, tuple[str, str] | None, str]] = {
    "$": ("dollar", "dollars", ("cent", "cents"), "美元"),
    "US$": ("US dollar", "US dollars", ("cent", "cents"), "美元"),
    "HK$": ("Hong Kong dollar", "Hong Kong dollars", ("cent", "cents"), "港元"),
    "€": ("euro", "euros", ("cent", "cents"), "欧元"),
    "£": ("pound", "pounds", ("penny", "pence"), "英镑"),
    "¥": ("yuan", "yuan", None, "元"),
    "￥": ("yuan", "yuan", None, "元"),
    "USD": ("US dollar", "US dollars", ("cent", "cents"), "美元"),
    "HKD": ("Hong Kong dollar", "Hong Kong dollars", ("cent", "cents"), "港元"),
    "EUR": ("euro", "euros", ("cent", "cents"), "欧元"),
    "GBP": ("pound", "pounds", ("penny", "pence"), "英镑"),
    "CNY": ("yuan", "yuan", None, "元人民币"),
    "RMB": ("yuan", "yuan", None, "元人民币"),
    "JPY": ("yen", "yen", None, "日元"),
}

_SCALE: dict[str, tuple[str, str]] = {  # written multiplier: (English, Chinese)
    "k": ("thousand", "千"), "K": ("thousand", "千"), "thousand": ("thousand", "千"),
    "million": ("million", "百万"), "billion": ("billion", "十亿"),
    "trillion": ("trillion", "万亿"), "万": ("ten thousand", "万"),
    "百万": ("million", "百万"), "千万": ("ten million", "千万"), "亿": ("hundred million", "亿"),
}

_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
           "September", "October", "November", "December")

_SYMBOLS: dict[str, tuple[str, str]] = {  # (English, Chinese)
    "&": ("and", "和"), "+": ("plus", "加"), "=": ("equals", "等于"), "@": ("at", "艾特"),
    "#": ("hash", "井号"), "×": ("times", "乘"), "÷": ("divided by", "除以"),
}

# Chinese measure words after which 2 is read 两
_LIANG_NEXT = tuple("个只本张位次件条台辆种岁把头匹双对名支颗棵所间门首篇份架艘倍点斤块元千万百亿米"
                    ) + ("小时", "分钟", "周", "天", "年", "公里", "千克", "公斤", "克", "升")

_YEAR_WORDS = frozenset(
    "in since by until till from of year circa during before after around early late mid "
    "between through summer winter spring autumn fall".split()) | frozenset(
        m.lower() for m in _MONTHS)

# -- patterns ---------------------------------------------------------------------------------

_NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
_MONTH_RE = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|"
             r"Aug(?:ust)?|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)")
_UNIT_RE = "|".join(re.escape(u) for u in sorted(_UNITS, key=len, reverse=True))
_MONEY_SIGN_RE = r"US\$|HK\$|[$€£¥￥]"
_CODE_RE = r"USD|HKD|EUR|GBP|CNY|RMB|JPY"
_SCALE_RE = r"[kK](?![A-Za-z])|thousand|million|billion|trillion|千万|百万|万|亿"
_NEG = r"(?<![A-Za-z0-9.])[-−]"

_PATTERNS: list[tuple[str, str]] = [
    ("tag", r"\[[A-Za-z_]\w*\]"),
    # a list item's number: "1. 首先" or "2、其次" at the start of the text, a line, a clause
    # or a sentence ("Done. 1. 首先": where the segmenter starts a new chunk, so a streamed
    # text reads it the same as the whole)
    ("item", r"(?:(?<![\s\S])|(?<=[\n。！？!?；;…，、：,:—－])|(?<=\.[ \t]))"
             r"[ \t]*(?P<item_n>\d{1,3})(?:\.|、)(?=[ \t]*[^\s\d])"),
    ("ver", r"(?<![A-Za-z0-9])[vV](?P<ver_n>\d+(?:\.\d+)*)"),
    ("iso", r"(?<![\d.])(?P<iso_y>\d{4})(?P<iso_sep>[-/.])(?P<iso_m>0?[1-9]|1[0-2])(?P=iso_sep)"
            r"(?P<iso_d>[12]\d|3[01]|0?[1-9])(?!\d)(?!\.\d)"),
    ("mdy", r"(?<![\d.])(?P<mdy_m>0?[1-9]|1[0-2])/(?P<mdy_d>[12]\d|3[01]|0?[1-9])/"
            r"(?P<mdy_y>\d{4})(?!\d)"),
    ("dots", r"(?<![\d.])\d+(?:\.\d+){2,}"),
    ("zhyear", r"(?<![\d.,])\d{4}(?=[ \t]*年)"),
    ("md", rf"(?<![A-Za-z])(?P<md_m>{_MONTH_RE})\.?[ \t]+(?P<md_d>[12]\d|3[01]|0?[1-9])"
           r"(?:st|nd|rd|th)?(?![\d:])"
           r"(?:,?[ \t]+(?P<md_y>\d{4})(?!\d))?"),
    ("dm", rf"(?<![\d.])(?P<dm_d>[12]\d|3[01]|0?[1-9])(?:st|nd|rd|th)?[ \t]+(?P<dm_m>{_MONTH_RE})\b"
           r"(?:,?[ \t]+(?P<dm_y>\d{4})(?!\d))?"),
    ("phone", r"\+\d{1,3}(?:[ -]\(?\d{1,4}\)?){2,4}(?!\d)"
              r"|\(\d{3}\)[ \t]?\d{3}-\d{4}(?!\d)"
              r"|(?<![\d.])1[3-9]\d-\d{4}-\d{4}(?!\d)"
              r"|(?<![\d.])\d{3}-\d{3}-\d{4}(?!\d)"
              r"|(?<![\d.])0\d{2,3}-\d{7,8}(?!\d)"
              r"|(?<![\d.,])1[3-9]\d{9}(?![\d.])"
              r"|(?<![\d.,-])[2-9]\d{2}-\d{4}(?![\d.-])"),
    ("time", r"(?<![\d:.])(?P<t_h>[01]?\d|2[0-4]):(?P<t_m>[0-5]\d)(?::(?P<t_s>[0-5]\d))?(?![\d:])"
             r"(?:[ \t]*(?P<t_ap>[AaPp])(?:\.[Mm]\.?|[Mm])(?![A-Za-z]))?"),
    ("hap", r"(?<![\d.:])(?P<hap_h>1[0-2]|0?[1-9])[ \t]*(?P<hap_ap>[AaPp])(?:\.[Mm]\.?|[Mm])"
            r"(?![A-Za-z])"),
    ("ext", r"(?P<ext_w>(?<![A-Za-z])(?:[Ee]xt|EXT)\.?|(?<![A-Za-z])[Ee]xtension|分机号?)"
            r"[ \t]*(?P<ext_n>\d{1,6})(?!\d)"),
    ("kw", r"(?P<kw_w>(?<![A-Za-z])(?:[Cc]all|CALL|[Dd]ial|PIN|[Cc]ode)(?![A-Za-z])"
           r"|拨打|报警电话|急救电话|热线|号码|"
           r"电话|验证码|编号|工号|尾号)[ \t]*(?:是|为|is[ \t]+)?(?P<kw_n>\d{2,})(?![\d.,-])"),
    ("e911", r"(?<![\d.,])911(?![\d.,%])"),
    ("rng", rf"(?<![\d.,])(?P<r_a>{_NUM})(?P<r_ap>[%％])?(?P<r_sep>[ \t]*[~～〜][ \t]*|[-–])"
            rf"(?P<r_b>{_NUM})(?P<r_bp>[%％])?(?:[ \t]?(?P<r_u>{_UNIT_RE})(?![A-Za-z]))?"),
    ("cur", rf"(?P<cur_neg>{_NEG})?(?P<cur_s>{_MONEY_SIGN_RE})[ \t]?(?P<cur_n>{_NUM})"
            rf"(?:[ \t]?(?P<cur_m>{_SCALE_RE}))?"),
    ("codep", rf"(?<![A-Za-z])(?P<codep_c>{_CODE_RE})[ \t]?(?P<codep_n>{_NUM})"
              rf"(?:[ \t]?(?P<codep_m>{_SCALE_RE}))?"),
    ("codes", rf"(?<![\d.,])(?P<codes_n>{_NUM})(?:[ \t]?(?P<codes_m>{_SCALE_RE}))?[ \t]?"
              rf"(?P<codes_c>{_CODE_RE})(?![A-Za-z])"),
    ("pct", rf"(?P<pct_neg>{_NEG})?(?P<pct_n>{_NUM})[ \t]?(?P<pct_s>[%％‰])"),
    ("ord", r"(?<![\d.,])(?P<ord_n>\d+)(?:st|nd|rd|th)(?![A-Za-z])"),
    ("frac", r"(?<![\d/.])(?P<fr_a>\d{1,3})/(?P<fr_b>\d{1,3})(?![\d/])"),
    ("dec", r"(?<![\d.,])(?P<dec_n>1\d{2}0|20\d0)s(?![A-Za-z])"),
    ("unit", rf"(?P<u_neg>{_NEG})?(?P<u_n>{_NUM})[ \t]?(?P<u_u>{_UNIT_RE})(?![A-Za-z])"),
    ("hashn", r"#(?P<hashn_n>\d+)"),
    ("no", r"(?<![A-Za-z])No\.[ \t]?(?P<no_n>\d+)"),
    ("num", rf"(?P<num_neg>{_NEG})?(?P<num_n>{_NUM})"),
    ("sym", r"[&+=@#×÷]"),
    ("hy", r"(?<=[A-Za-z])-(?=[A-Za-z0-9])"),
    ("punct", r"\.{3,}|[?？!！;；:：…]+|[()（）【】「」『』《》]|[\"“”]|[—–－~]+|[/*^|_\\<>`{}]"),
]
# ASCII: \d is 0-9 (fullwidth digits are mapped first; others are left alone) and CJK
# characters are not \w, so \b works beside them
_MASTER = re.compile("|".join(f"(?P<{name}>{pat})" for name, pat in _PATTERNS), re.ASCII)
_FULLWIDTH = str.maketrans("０１２３４５６７８９", "0123456789")
_TAG = re.compile(r"\[[A-Za-z_]\w*\]")

# Where rtts.text.segmenter may cut: sentence ends, clause marks, "." before a space or the end.
_SEPARATORS = frozenset("。！？!?；;…\n，、：,:—－")
_CLOSERS = frozenset("\"'”’」』）)]】》")


def _script(ch: str) -> Lang | None:
    if "\u4e00" <= ch <= "\u9fff" or "\u3400" <= ch <= "\u4dbf":
        return "zh"
    if ch.isascii() and ch.isalpha():
        return "en"
    return None


def _is_separator(text: str, i: int) -> bool:
    ch = text[i]
    if ch in _SEPARATORS:
        return True
    return ch == "." and (i + 1 >= len(text) or text[i + 1].isspace() or text[i + 1] in _CLOSERS)


def last_script(text: str) -> Lang | None:
    """Script of the last letter (CJK or Latin) of ``text`` outside ``[tags]``."""
    masked = _TAG.sub(lambda m: " " * len(m.group()), text)
    for ch in reversed(masked):
        if (s := _script(ch)) is not None:
            return s
    return None


_LETTER = re.compile(r"[A-Za-z\u3400-\u4dbf\u4e00-\u9fff]")
_CJK_LETTER = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff]")
_WORD_START = re.compile(r"(?<![A-Za-z])[A-Za-z]")
_SEPARATOR = re.compile("[" + re.escape("".join(sorted(_SEPARATORS))) + "]"
                        r"|\.(?=\s|[" + re.escape("".join(sorted(_CLOSERS))) + r"]|\Z)")


def _count(positions: list[int], lo: int, hi: int) -> int:
    """How many of the sorted ``positions`` lie in ``[lo, hi)``."""
    return max(0, bisect_left(positions, hi) - bisect_left(positions, lo)) if hi > lo else 0


class _Pass:
    """One normalization pass over one text: the match callbacks and their context.

    Every question a match asks about its surroundings (the nearest letter, the clause
    around it) is answered from sorted position lists made once per pass, by bisection:
    the cost of a pass is linear in its text, whatever the text (a scan per match made
    ``"3-5 " * 1000`` quadratic).
    """

    def __init__(self, text: str, lang_hint: Lang | None) -> None:
        self.text = text = text.translate(_FULLWIDTH)
        self.masked = masked = _TAG.sub(lambda m: " " * len(m.group()), text)
        self.hint = lang_hint
        self._letters = [m.start() for m in _LETTER.finditer(masked)]
        self._cjk = [m.start() for m in _CJK_LETTER.finditer(masked)]
        self._word_starts = [m.start() for m in _WORD_START.finditer(masked)]
        self._seps = [m.start() for m in _SEPARATOR.finditer(masked)]

    # -- language ---------------------------------------------------------------------------

    def _scan(self, i: int, step: int) -> Lang | None:
        """Script of the nearest letter from ``i`` on in direction ``step``, unless a
        clause separator comes first."""
        masked, letters, seps = self.masked, self._letters, self._seps
        if not 0 <= i < len(masked):
            return None
        if step < 0:
            k = bisect_right(letters, i) - 1
            if k < 0:
                return None
            j = bisect_right(seps, i) - 1
            letter = letters[k]
            return _script(masked[letter]) if j < 0 or seps[j] < letter else None
        k = bisect_left(letters, i)
        if k >= len(letters):
            return None
        j = bisect_left(seps, i)
        letter = letters[k]
        return _script(masked[letter]) if j >= len(seps) or seps[j] > letter else None

    def _before(self, start: int) -> Lang:
        k = bisect_left(self._letters, start) - 1
        if k >= 0:
            s = _script(self.masked[self._letters[k]])
            if s is not None:
                return s
        return self.hint or "en"

    def _clause_majority(self, start: int, end: int) -> Lang | None:
        """zh if the clause around [start, end) has more CJK characters than Latin words."""
        masked, seps = self.masked, self._seps
        n = len(masked)
        j = bisect_right(seps, start - 1) - 1  # the last separator before the match
        lo = seps[j] + 1 if j >= 0 else 0
        k = bisect_left(seps, end - 1)  # the first one from the match's last character on
        hi = min(seps[k] + 1, n) if k < len(seps) else n
        hi = max(hi, end)
        cjk = _count(self._cjk, lo, start) + _count(self._cjk, end, hi)
        words = _count(self._word_starts, lo, start) + _count(self._word_starts, end + 1, hi)
        if end < hi and masked[end].isascii() and masked[end].isalpha():
            words += 1  # a word cut by the match's end still counts from there
        if not cjk and not words:
            return None
        return "zh" if cjk > words else "en"

    def lang(self, start: int, end: int) -> Lang:
        if any(_script(ch) == "zh" for ch in self.masked[start:end]):
            return "zh"  # 拨打110, 2026年
        left = self._scan(start - 1, -1)
        # a match that ends its clause ("at 5 p.m. Then") looks no further right
        right = None if _is_separator(self.masked, end - 1) else self._scan(end, 1)
        if "zh" in (left, right):
            return "zh"
        if left == right == "en":
            return "en"
        if "en" in (left, right):  # one side English, the other the clause's end
            return self._clause_majority(start, end) or "en"
        return self._before(start)

    def lang_left(self, start: int) -> Lang:
        left = self._scan(start - 1, -1)
        return left if left is not None else self._before(start)

    # -- the pass ---------------------------------------------------------------------------

    def run(self) -> str:
        out = _MASTER.sub(self._replace, self.text)
        return _tidy(out)

    def _replace(self, m: re.Match[str]) -> str:
        kind = m.lastgroup
        assert kind is not None
        handler: Callable[[re.Match[str], Lang], str] = getattr(self, f"_{kind}")
        if kind in ("punct", "hy"):
            lang = self.lang_left(m.start())
        elif kind == "item":  # the item's own text says which language it is in
            lang = self._scan(m.end(), 1) or self._before(m.start())
        else:
            lang = self.lang(m.start(), m.end())
        try:
            words = handler(m, lang)
        except Exception:  # noqa: BLE001 - a number too big for a library, say: never fail
            words = _digit_by_digit(m.group(), lang)
        if kind in ("tag", "punct", "hy", "item"):
            return words
        return f" {words} " if lang == "en" else words

    def _after(self, m: re.Match[str]) -> str:
        return self.text[m.end():m.end() + 2].lstrip(" \t")

    def _tail(self, end: int, keep: int) -> str:
        """``text[:end]`` cut to its last ``keep`` characters before its trailing blanks
        (and one newline): enough for a ``word[ \\t]*$`` search, at a cost independent of
        the text before it."""
        text, q = self.text, end
        if q > 0 and text[q - 1] == "\n":
            q -= 1
        while q > 0 and text[q - 1] in " \t":
            q -= 1
        return text[max(0, q - keep):end]

    def _last_words(self, end: int) -> list[str]:
        """``re.split(r"[ \\t]+", text[:end].rstrip(" \\t"))``, but only its last three
        words are complete (all a caller looks at), from a window grown as needed."""
        width = 64
        while True:
            lo = max(0, end - width)
            words = _BLANKS.split(self.text[lo:end].rstrip(" \t"))
            if lo == 0 or len(words) >= 4:
                return words
            width *= 4

    # -- handlers ---------------------------------------------------------------------------

    def _tag(self, m: re.Match[str], lang: Lang) -> str:
        return m.group()

    def _item(self, m: re.Match[str], lang: Lang) -> str:
        n = m.group("item_n")
        lead = m.group()[:m.start("item_n") - m.start()]
        return lead + (_zh_number(n) + "、" if lang == "zh" else _en_number(n) + ",")

    def _ver(self, m: re.Match[str], lang: Lang) -> str:
        parts = m.group("ver_n").split(".")
        said = _VERSION_SAID.search(self._tail(m.start(), 7))
        if lang == "zh":
            return ("" if said else "版本") + "点".join(_zh_number(p) for p in parts)
        return ("" if said else "version ") + " point ".join(_en_number(p) for p in parts)

    def _dots(self, m: re.Match[str], lang: Lang) -> str:
        parts = m.group().split(".")
        if len(parts) == 4 and all(len(p) <= 3 and int(p) <= 255 for p in parts):  # IPv4
            if lang == "zh":
                return "点".join(_zh_digits(p) for p in parts)
            return " dot ".join(_en_digits(p) for p in parts)
        if lang == "zh":
            return "点".join(_zh_number(p) for p in parts)
        return " point ".join(_en_number(p) for p in parts)

    def _date(self, lang: Lang, year: str | None, month: int, day: int) -> str:
        if lang == "zh":
            return (f"{_zh_digits(year)}年" if year else "") + (
                f"{_zh_number(str(month))}月{_zh_number(str(day))}日")
        words = f"{_MONTHS[month - 1]} {_en_ordinal(day)}"
        return f"{words}, {_en_year(int(year))}" if year else words

    def _iso(self, m: re.Match[str], lang: Lang) -> str:
        return self._date(lang, m.group("iso_y"), int(m.group("iso_m")), int(m.group("iso_d")))

    def _mdy(self, m: re.Match[str], lang: Lang) -> str:
        return self._date(lang, m.group("mdy_y"), int(m.group("mdy_m")), int(m.group("mdy_d")))

    @staticmethod
    def _month(name: str) -> int:
        return next(i for i, full in enumerate(_MONTHS, 1) if full.startswith(name[:3]))

    def _md(self, m: re.Match[str], lang: Lang) -> str:
        return self._date(lang, m.group("md_y"), self._month(m.group("md_m")), int(m.group("md_d")))

    def _dm(self, m: re.Match[str], lang: Lang) -> str:
        month, day, year = self._month(m.group("dm_m")), int(m.group("dm_d")), m.group("dm_y")
        if lang == "zh":
            return self._date(lang, year, month, day)
        words = f"the {_en_ordinal(day)} of {_MONTHS[month - 1]}"
        return f"{words}, {_en_year(int(year))}" if year else words

    def _zhyear(self, m: re.Match[str], lang: Lang) -> str:
        return _zh_digits(m.group())

    def _phone(self, m: re.Match[str], lang: Lang) -> str:
        groups = re.findall(r"\+?\d+", m.group())
        words = []
        for g in groups:
            plus = g.startswith("+")
            if lang == "zh":
                words.append(("加" if plus else "") + _zh_digits(g, phone=True))
            else:
                words.append(("plus " if plus else "") + _en_digits(g))
        return "，".join(words) if lang == "zh" else ", ".join(words)

    def _clock(self, lang: Lang, h: int, mi: int, s: int | None, ap: str | None) -> str:
        if lang == "zh":
            prefix = {"a": "上午", "p": "下午"}.get(ap.lower(), "") if ap else ""
            hour = "两" if h == 2 else _zh_number(str(h))
            words = f"{prefix}{hour}点"
            if mi or s:
                words += ("零" if 0 < mi < 10 else "") + _zh_number(str(mi)) + "分"
            if s:
                words += _zh_number(str(s)) + "秒"
            return words
        words = _n2w(h)
        if mi == 0 and not ap and not s:
            words += " o clock"
        elif mi:
            words += " oh " + _n2w(mi) if mi < 10 else " " + _n2w(mi)
        if s:
            words += f" and {_n2w(s)} seconds"
        if ap:
            words += f" {ap.lower()} m"
        return words

    def _ends_sentence(self, m: re.Match[str]) -> str:
        """A full stop if the match took the sentence's own ("at 5 p.m."), else nothing."""
        end = m.end()
        return "." if m.group().endswith(".") and (
            end >= len(self.text) or self.text[end].isspace()) else ""

    def _time(self, m: re.Match[str], lang: Lang) -> str:
        s = m.group("t_s")
        return self._clock(lang, int(m.group("t_h")), int(m.group("t_m")),
                           int(s) if s else None, m.group("t_ap")) + (
            self._ends_sentence(m) if lang == "en" else "")

    def _hap(self, m: re.Match[str], lang: Lang) -> str:
        return self._clock(lang, int(m.group("hap_h")), 0, None, m.group("hap_ap")) + (
            self._ends_sentence(m) if lang == "en" else "")

    def _ext(self, m: re.Match[str], lang: Lang) -> str:
        digits = m.group("ext_n")
        if lang == "zh":
            return "分机" + _zh_digits(digits, phone=True)
        return "extension " + _en_digits(digits)

    def _kw(self, m: re.Match[str], lang: Lang) -> str:
        word, digits = m.group("kw_w"), m.group("kw_n")
        between = m.group()[len(word):m.start("kw_n") - m.start()].strip()
        if lang == "zh":
            return word + between + _zh_digits(digits, phone=True)
        return f"{word} {between} {_en_digits(digits)}".replace("  ", " ")

    def _e911(self, m: re.Match[str], lang: Lang) -> str:
        return _zh_digits("911") if lang == "zh" else _en_digits("911")

    def _rng(self, m: re.Match[str], lang: Lang) -> str:
        a, b = m.group("r_a"), m.group("r_b")
        ap, bp, unit = m.group("r_ap"), m.group("r_bp"), m.group("r_u")
        years = (m.group("r_sep") in "-–" and all(
            len(x) == 4 and x.isdigit() and 1100 <= int(x) <= 2099 for x in (a, b)))
        if lang == "zh":
            if years and self._after(m).startswith("年"):
                left, right = _zh_digits(a), _zh_digits(b)
            else:
                left, right = self._zh_amount(a), self._zh_amount(b)
            if bp:
                left, right = "百分之" + left, "百分之" + right
            words = f"{left}到{right}"
            return words + (_UNITS[unit][2] if unit else "")
        if years:
            return f"{_en_year(int(a))} to {_en_year(int(b))}"
        left = _en_number(a) + (" percent" if ap else "")
        right = _en_number(b) + (" percent" if bp else "")
        words = f"{left} to {right}"
        if unit:
            words += " " + (_UNITS[unit][0] if _plain(b) == "1" else _UNITS[unit][1])
        return words

    def _zh_amount(self, num: str) -> str:
        return "两" if num == "2" else _zh_number(num)

    def _money(self, lang: Lang, key: str, num: str, scale: str | None, neg: bool) -> str:
        one, many, minor, zh = _MONEY[key]
        if lang == "zh":
            words = ("负" if neg else "") + _zh_number(_strip_zeros(num))
            return words + (_SCALE[scale][1] if scale else "") + zh
        sign = "minus " if neg else ""
        if scale:
            return f"{sign}{_en_number(_strip_zeros(num))} {_SCALE[scale][0]} {many}"
        whole, _, frac = _plain(num).partition(".")
        if minor is None or len(frac) != 2:
            amount = _en_number(_strip_zeros(num)) if frac else _n2w(int(whole))
            return f"{sign}{amount} {one if _strip_zeros(num) == '1' else many}"
        words = f"{_n2w(int(whole))} {one if whole == '1' else many}" if int(whole) else ""
        cents = int(frac)
        if cents:
            cent_words = f"{_n2w(cents)} {minor[0] if cents == 1 else minor[1]}"
            words = f"{words} and {cent_words}" if words else cent_words
        return sign + (words or f"zero {many}")

    def _cur(self, m: re.Match[str], lang: Lang) -> str:
        return self._money(lang, m.group("cur_s"), m.group("cur_n"), m.group("cur_m"),
                           bool(m.group("cur_neg")))

    def _codep(self, m: re.Match[str], lang: Lang) -> str:
        return self._money(lang, m.group("codep_c"), m.group("codep_n"), m.group("codep_m"),
                           False)

    def _codes(self, m: re.Match[str], lang: Lang) -> str:
        return self._money(lang, m.group("codes_c"), m.group("codes_n"), m.group("codes_m"),
                           False)

    def _pct(self, m: re.Match[str], lang: Lang) -> str:
        num, neg, per_mille = m.group("pct_n"), bool(m.group("pct_neg")), m.group("pct_s") == "‰"
        if lang == "zh":
            return ("负" if neg else "") + ("千分之" if per_mille else "百分之") + _zh_number(num)
        return ("minus " if neg else "") + _en_number(num) + (
            " per mille" if per_mille else " percent")

    def _ord(self, m: re.Match[str], lang: Lang) -> str:
        n = int(m.group("ord_n"))
        return "第" + _zh_number(str(n)) if lang == "zh" else _en_ordinal(n)

    def _frac(self, m: re.Match[str], lang: Lang) -> str:
        a, b = int(m.group("fr_a")), int(m.group("fr_b"))
        if lang == "zh":
            return f"{_zh_number(str(b))}分之{_zh_number(str(a))}"
        if (a, b) == (24, 7):
            return "twenty four seven"
        if b == 0:
            return f"{_n2w(a)} slash zero"
        if b == 1:
            return f"{_n2w(a)} over one"
        denom = {2: ("half", "halves"), 4: ("quarter", "quarters")}.get(b)
        if denom is None:
            ordinal = _en_ordinal(b)
            denom = (ordinal, _en_plural(ordinal))
        return f"{_n2w(a)} {denom[0] if a == 1 else denom[1]}"

    def _dec(self, m: re.Match[str], lang: Lang) -> str:
        year = m.group("dec_n")
        if lang == "zh":
            return _zh_digits(year) + "年代"
        return _en_plural(_en_year(int(year)))

    def _unit(self, m: re.Match[str], lang: Lang) -> str:
        num, unit, neg = m.group("u_n"), m.group("u_u"), bool(m.group("u_neg"))
        one, many, zh = _UNITS[unit]
        if lang == "zh":
            amount = "两" if num == "2" and unit not in ("°", "°C", "℃", "°F", "℉") else (
                _zh_number(num))
            below = self.text.endswith("零下", 0, m.start())
            sign = "" if below else "零下" if "度" in zh else "负"
            return (sign if neg else "") + amount + zh
        return ("minus " if neg else "") + _en_number(num) + " " + (
            one if _plain(num) == "1" else many)

    def _hashn(self, m: re.Match[str], lang: Lang) -> str:
        n = m.group("hashn_n")
        return _zh_number(n) + "号" if lang == "zh" else "number " + _en_number(n)

    def _no(self, m: re.Match[str], lang: Lang) -> str:
        n = m.group("no_n")
        return "第" + _zh_number(n) + "号" if lang == "zh" else "number " + _en_number(n)

    def _num(self, m: re.Match[str], lang: Lang) -> str:
        num, neg = m.group("num_n"), bool(m.group("num_neg"))
        if _long_digit_string(num):
            return _zh_digits(num) if lang == "zh" else _en_digits(num)
        if lang == "zh":
            after = self.text[m.end():m.end() + 2]
            if (num == "2" and not neg and after.startswith(_LIANG_NEXT)
                    and not self.text.endswith("第", 0, m.start())):
                return "两"
            return ("负" if neg else "") + _zh_number(num)
        if not neg and _year_like(num):
            # words before it on the same line (a newline may be a chunk boundary)
            words = self._last_words(m.start())
            if words and (words[-1].lower().strip("(") in _YEAR_WORDS or (
                    words[-1] in ("to", "and", "until", "through") and len(words) > 1
                    and _year_like(words[-2]) and words[-3:-2] != ["and"])):
                return _en_year(int(num))
        return ("minus " if neg else "") + _en_number(num)

    def _sym(self, m: re.Match[str], lang: Lang) -> str:
        en, zh = _SYMBOLS[m.group()]
        return zh if lang == "zh" else en

    def _hy(self, m: re.Match[str], lang: Lang) -> str:
        return " "

    def _punct(self, m: re.Match[str], lang: Lang) -> str:
        p = m.group()
        zh = lang == "zh"
        if p.startswith(".") or p[0] in "…":
            return "。" if zh else "..."
        if p[0] in "?？!！":
            return "。" if zh else "."
        if p[0] in ";；:：()（）【】「」『』《》—–－":
            return "，" if zh else ", "
        if p[0] in "\"“”":
            return ""
        return " "


_VERSION_SAID = re.compile(r"(?:version|版本)[ \t]*$", re.IGNORECASE)
_BLANKS = re.compile(r"[ \t]+")
_SPACES = re.compile(r"[ \t]{2,}")
# (each starts only where its run starts: "，" * 20000 with no "。" after it is tried once,
# not 20,000 times)
_CJK_SPACE = re.compile(r"(?<=[\u3400-\u9fff，。、])[ \t]+(?=[\u3400-\u9fff，。、])"
                        r"|(?<![ \t])[ \t]+(?=[，。、])")
_SPACE_BEFORE_MARK = re.compile(r"(?<![ \t])[ \t]+(?=[,.])")
_COMMA_THEN_STOP = re.compile(r"(?<![，,、])[，,、]+(?=[。.])")
_STOP_THEN_COMMA = re.compile(r"(?<=[。.])[ \t]*[，,、]+")
_COMMAS = re.compile(r"([，,、])(?:[ \t]*[，,、])+")
_LEADING_COMMA = re.compile(r"^[ \t]*[，,、][ \t]*")


def _tidy(text: str) -> str:
    text = _SPACES.sub(" ", text)
    text = _SPACE_BEFORE_MARK.sub("", text)
    text = _CJK_SPACE.sub("", text)
    text = _COMMA_THEN_STOP.sub("", text)
    text = _STOP_THEN_COMMA.sub("", text)
    text = _COMMAS.sub(r"\1", text)
    text = _LEADING_COMMA.sub("", text)
    return text.strip()


def normalize(text: str, lang_hint: Lang | None = None) -> str:
    """The spoken form of ``text``: numbers, dates, money, units and symbols as words.

    ``lang_hint`` is the language for numbers with no letter before them in ``text`` and
    none in their own clause (``"42。"``); ``None`` means English. ``[tags]`` such as
    ``[uv_break]`` pass through. The result uses only characters that ChatTTS keeps
    (CJK, Latin letters, ``，。、,.``, spaces and apostrophes), plus any letters of other
    scripts that were in the input.
    """
    if not text:
        return text
    return _Pass(text, lang_hint).run()


def spoken_text(text: str, *, enabled: bool = True, lang_hint: Lang | None = None) -> str:
    """Integration hook: what to synthesize for a chunk's ``text`` (unchanged if disabled)."""
    return normalize(text, lang_hint) if enabled else text


class SpokenText:
    """Per-context hook: call it on each chunk in order; it returns the spoken text.

    It remembers the script of the last letter seen, so chunk after chunk normalize as the
    whole text does (a clause without letters, like ``"42。"``, reads in the language of the
    text before it). ``enabled=False`` returns chunks unchanged (the ``normalize: false``
    start parameter).
    """

    def __init__(self, enabled: bool = True, lang_hint: Lang | None = None) -> None:
        self.enabled = enabled
        self.lang_hint: Lang | None = lang_hint

    def __call__(self, text: str) -> str:
        if not self.enabled:
            return text
        out = normalize(text, self.lang_hint)
        seen = last_script(text)
        if seen is not None:
            self.lang_hint = seen
        return out
