"""Text normalization (issue 13): a table of written -> spoken forms, whole and streamed."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import types
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rtts.text import SpokenText, normalize, spoken_text
from rtts.text.normalize import trace
from rtts.text.segmenter import DEFAULT_SCHEDULE, Segmenter

# (written, spoken). Everything is read as written: numbers inside Chinese in Chinese,
# inside English in English; prosody marks mapped to ones ChatTTS keeps.
TABLE: list[tuple[str, str]] = [
    # -- cardinals en
    ('Call 911 now!',
     'Call nine one one now.'),
    ('I have 3 cats and 12 dogs.',
     'I have three cats and twelve dogs.'),
    ('There are 1,000 people here.',
     'There are one thousand people here.'),
    ('The population is 1,234,567.',
     'The population is one million two hundred and thirty four thousand five hundred and sixty seven.'),
    ('She scored 100 points.',
     'She scored one hundred points.'),
    ('He turned 21 yesterday.',
     'He turned twenty one yesterday.'),
    ('We sold 0 units.',
     'We sold zero units.'),
    ('It weighs 105 tons.',
     'It weighs one hundred and five tons.'),
    # -- cardinals zh
    ('我有3只猫和12条狗。',
     '我有三只猫和十二条狗。'),
    ('这里有1,000人。',
     '这里有一千人。'),
    ('全市人口1234567人。',
     '全市人口一百二十三万四千五百六十七人。'),
    ('他考了100分。',
     '他考了一百分。'),
    ('我买了2个苹果。',
     '我买了两个苹果。'),
    ('今年是第2次来北京。',
     '今年是第二次来北京。'),
    ('一共有10000个样本。',
     '一共有一万个样本。'),
    # -- decimals
    ('Pi is about 3.14.',
     'Pi is about three point one four.'),
    ('The rate went up 0.25 points.',
     'The rate went up zero point two five points.'),
    ('It costs 12.5 on average.',
     'It costs twelve point five on average.'),
    ('圆周率约等于3.14。',
     '圆周率约等于三点一四。'),
    ('增长了0.5个百分点。',
     '增长了零点五个百分点。'),
    ('平均分是85.5分。',
     '平均分是八十五点五分。'),
    # -- negatives
    ('The temperature fell to -5 today.',
     'The temperature fell to minus five today.'),
    ('The balance is -200.',
     'The balance is minus two hundred.'),
    ('气温降到了-5度。',
     '气温降到了负五度。'),
    ('结果是-3。',
     '结果是负三。'),
    # -- ordinals
    ('She finished 1st, he was 2nd.',
     'She finished first, he was second.'),
    ('This is our 23rd anniversary.',
     'This is our twenty third anniversary.'),
    ('The 101st time is the charm.',
     'The one hundred and first time is the charm.'),
    ('我们是第3名。',
     '我们是第三名。'),
    ('他排在第21位。',
     '他排在第二十一位。'),
    # -- fractions
    ('Add 1/2 cup of sugar.',
     'Add one half cup of sugar.'),
    ('About 3/4 of voters agree.',
     'About three quarters of voters agree.'),
    ('Only 2/3 of them came.',
     'Only two thirds of them came.'),
    ('We offer 24/7 support.',
     'We offer twenty four seven support.'),
    ('Cut it into 1/8 slices.',
     'Cut it into one eighth slices.'),
    ('大约1/3的人同意。',
     '大约三分之一的人同意。'),
    ('有3/4的学生通过了考试。',
     '有四分之三的学生通过了考试。'),
    # -- percentages
    ('Sales grew 20% last year.',
     'Sales grew twenty percent last year.'),
    ('The rate is 12.5% now.',
     'The rate is twelve point five percent now.'),
    ('Prices fell -3% this week.',
     'Prices fell minus three percent this week.'),
    ('增长了20%。',
     '增长了百分之二十。'),
    ('利率是3.5%。',
     '利率是百分之三点五。'),
    ('下降了-2%。',
     '下降了负百分之二。'),
    # -- currency en
    ('It costs $12.50 today.',
     'It costs twelve dollars and fifty cents today.'),
    ('That is $1 only.',
     'That is one dollar only.'),
    ('I paid $100 for it.',
     'I paid one hundred dollars for it.'),
    ('The ticket was €45.',
     'The ticket was forty five euros.'),
    ('A pint costs £3.20 here.',
     'A pint costs three pounds and twenty pence here.'),
    ('He earned $1.5 million last year.',
     'He earned one point five million dollars last year.'),
    ('The fee is USD 100.',
     'The fee is one hundred US dollars.'),
    ('She sent 200 CNY to her mother.',
     'She sent two hundred yuan to her mother.'),
    ('The budget is $5k.',
     'The budget is five thousand dollars.'),
    ('It was only 99 cents, or $0.99.',
     'It was only ninety nine cents, or ninety nine cents.'),
    # -- currency zh
    ('价格是¥12.5。',
     '价格是十二点五元。'),
    ('我花了￥100买书。',
     '我花了一百元买书。'),
    ('这台电脑卖$999。',
     '这台电脑卖九百九十九美元。'),
    ('门票是€45。',
     '门票是四十五欧元。'),
    ('预算是100万美元，也就是USD 1000000。',
     '预算是一百万美元，也就是一百万美元。'),
    ('他转了200 RMB给我。',
     '他转了两百元人民币给我。'),
    # -- dates
    ('The meeting is on May 5, 2026.',
     'The meeting is on May fifth, twenty twenty six.'),
    ('She was born on January 15, 1990.',
     'She was born on January fifteenth, nineteen ninety.'),
    ('It happened on 5 May 2026.',
     'It happened on the fifth of May, twenty twenty six.'),
    ('Due date: 2026-05-05.',
     'Due date, May fifth, twenty twenty six.'),
    ('The form is dated 12/25/2025.',
     'The form is dated December twenty fifth, twenty twenty five.'),
    ('See you on Jan. 5.',
     'See you on January fifth.'),
    ('今天是2026年5月5日。',
     '今天是二零二六年五月五日。'),
    ('会议定在2026-05-05举行。',
     '会议定在二零二六年五月五日举行。'),
    ('他出生于1990年1月15日。',
     '他出生于一九九零年一月十五日。'),
    ('日期是2026/5/5。',
     '日期是二零二六年五月五日。'),
    # -- times
    ('The meeting is at 3:30.',
     'The meeting is at three thirty.'),
    ('Wake me at 7:05 tomorrow.',
     'Wake me at seven oh five tomorrow.'),
    ('The train leaves at 15:45.',
     'The train leaves at fifteen forty five.'),
    ('Lunch is at 12:00.',
     'Lunch is at twelve o clock.'),
    ('Call me at 5 p.m.',
     'Call me at five p m.'),
    ('The store opens at 9am.',
     'The store opens at nine a m.'),
    ('The show starts at 8:30 PM.',
     'The show starts at eight thirty p m.'),
    ('会议在下午3点30分开始。',
     '会议在下午三点三十分开始。'),
    ('时间是15:45。',
     '时间是十五点四十五分。'),
    ('我们10:05见面。',
     '我们十点零五分见面。'),
    ('现在是2:30。',
     '现在是两点三十分。'),
    # -- years
    ('I was born in 1990.',
     'I was born in nineteen ninety.'),
    ('In 2008, the Olympics came to Beijing.',
     'In two thousand and eight, the Olympics came to Beijing.'),
    ('It lasted from 1939 to 1945.',
     'It lasted from nineteen thirty nine to nineteen forty five.'),
    ('The 1990s were great.',
     'The nineteen nineties were great.'),
    ('The years 2020-2026 were busy.',
     'The years twenty twenty to twenty twenty six were busy.'),
    ('He was born in 2005.',
     'He was born in two thousand and five.'),
    ('2026年是个好年。',
     '二零二六年是个好年。'),
    ('1998年的夏天很热。',
     '一九九八年的夏天很热。'),
    ('我在2010年毕业。',
     '我在二零一零年毕业。'),
    ('二十世纪90年代。',
     '二十世纪九十年代。'),
    # -- phone / digit strings
    ('Call me at (555) 123-4567.',
     'Call me at five five five, one two three, four five six seven.'),
    ('My number is 555-123-4567.',
     'My number is five five five, one two three, four five six seven.'),
    ('Dial +1 555 123 4567 for help.',
     'Dial plus one, five five five, one two three, four five six seven for help.'),
    ('Use extension 204.',
     'Use extension two zero four.'),
    ('Call ext. 31 please.',
     'Call extension three one please.'),
    ('Your PIN is 0042.',
     'Your PIN is zero zero four two.'),
    ('Agent 007 is here.',
     'Agent zero zero seven is here.'),
    ('拨打110报警。',
     '拨打幺幺零报警。'),
    ('急救电话是120。',
     '急救电话是幺二零。'),
    ('请拨打13800138000联系我。',
     '请拨打幺三八零零幺三八零零零联系我。'),
    ('我的电话是138-0013-8000。',
     '我的电话是幺三八，零零幺三，八零零零。'),
    ('总机010-12345678转分机204。',
     '总机零幺零，幺二三四五六七八转分机二零四。'),
    ('验证码是4521。',
     '验证码是四五二幺。'),
    # -- ranges
    ('Take 3-5 tablets a day.',
     'Take three to five tablets a day.'),
    ('Wait 10~20 minutes.',
     'Wait ten to twenty minutes.'),
    ('It takes 2–3 days.',
     'It takes two to three days.'),
    ('Expect 10%-20% growth.',
     'Expect ten percent to twenty percent growth.'),
    ('每天吃3-5片。',
     '每天吃三到五片。'),
    ('等待10～20分钟。',
     '等待十到二十分钟。'),
    ('温度在3～5℃之间。',
     '温度在三到五摄氏度之间。'),
    ('增长10%~20%。',
     '增长百分之十到百分之二十。'),
    # -- units
    ('I ran 5 km today.',
     'I ran five kilometers today.'),
    ('It weighs 2.5 kg.',
     'It weighs two point five kilograms.'),
    ('The file is 16 GB.',
     'The file is sixteen gigabytes.'),
    ('Latency is 20 ms on average.',
     'Latency is twenty milliseconds on average.'),
    ('It is 25°C outside.',
     'It is twenty five degrees Celsius outside.'),
    ('The bulb uses 60 W.',
     'The bulb uses sixty watts.'),
    ('Only 1 km left.',
     'Only one kilometer left.'),
    ('The speed limit is 60 km/h.',
     'The speed limit is sixty kilometers per hour.'),
    ('The CPU runs at 3.2 GHz.',
     'The CPU runs at three point two gigahertz.'),
    ('我跑了5km。',
     '我跑了五公里。'),
    ('重2.5kg。',
     '重二点五千克。'),
    ('内存16GB。',
     '内存十六GB。'),
    ('延迟20ms。',
     '延迟二十毫秒。'),
    ('今天气温25℃。',
     '今天气温二十五摄氏度。'),
    ('限速60km/h。',
     '限速六十公里每小时。'),
    ('零下-10°C。',
     '零下十摄氏度。'),
    ('它有2米高。',
     '它有两米高。'),
    # -- symbols
    ('Rock & roll.',
     'Rock and roll.'),
    ('1 + 1 = 2',
     'one plus one equals two'),
    ('Email me @home.',
     'Email me at home.'),
    ('We are #1 in sales.',
     'We are number one in sales.'),
    ('Tom & Jerry.',
     'Tom and Jerry.'),
    ('C++ is fast.',
     'C plus plus is fast.'),
    ('黑 & 白。',
     '黑和白。'),
    ('3 + 5 = 8',
     'three plus five equals eight'),
    ('我们是#1。',
     '我们是一号。'),
    # -- versions
    ('Install v1.2.3 now.',
     'Install version one point two point three now.'),
    ('Python 3.11 is out.',
     'Python three point one one is out.'),
    ('Upgrade to version 2.0.1.',
     'Upgrade to version two point zero point one.'),
    ('Update to v2.',
     'Update to version two.'),
    ('请升级到v1.2.3。',
     '请升级到版本一点二点三。'),
    ('我用Python 3.11。',
     '我用Python 三点一一。'),
    # -- punctuation / prosody
    ('Really?',
     'Really.'),
    ('Wait... what?',
     'Wait... what.'),
    ('Hello! How are you?',
     'Hello. How are you.'),
    ('真的吗？',
     '真的吗。'),
    ('太好了！',
     '太好了。'),
    ('他说……算了。',
     '他说。算了。'),
    ('你好：世界；再见。',
     '你好，世界，再见。'),
    ('Hyphenated well-known words.',
     'Hyphenated well known words.'),
    ('She said "yes" (finally).',
     'She said yes, finally.'),
    # -- mixed
    ('在2026 Olympics上，iPhone 15发布了。',
     '在两千零二十六 Olympics上，iPhone 十五发布了。'),
    ('我用Python写了100行代码。',
     '我用Python写了一百行代码。'),
    ('The price is 100元 today.',
     'The price is 一百元 today.'),
    ('我们约在3:30 pm见面。',
     '我们约在下午三点三十分见面。'),
    ('这个app有5 stars评分。',
     '这个app有五 stars评分。'),
    ('Version 2.0 很好用。',
     'Version 二点零很好用。'),
    ('他跑了10 km，用了45分钟。',
     '他跑了十公里，用了四十五分钟。'),
    ('I bought 3个苹果.',
     'I bought 三个苹果.'),
    ('答案是：42。',
     '答案是，四十二。'),
    ('The answer is: 42.',
     'The answer is, forty two.'),
    # -- ChatTTS tags
    ('[uv_break]我有3只猫[laugh]。',
     '[uv_break]我有三只猫[laugh]。'),
    ('He has 2 dogs [uv_break] and 1 cat.',
     'He has two dogs [uv_break] and one cat.'),
    # -- long mixed
    ('The meeting is at 3:30 on May 5, 2026, and costs $12.50 (about 20% off).',
     'The meeting is at three thirty on May fifth, twenty twenty six, and costs twelve dollars and fifty cents, about twenty percent off.'),
    ('会议在下午3点30分，价格是12.5元，增长了20%。',
     '会议在下午三点三十分，价格是十二点五元，增长了百分之二十。'),
    ('Our Q3 revenue rose 12% to $4.5 billion, up from $4.0 billion.',
     'Our Q three revenue rose twelve percent to four point five billion dollars, up from four billion dollars.'),
    ('截至2025年12月31日，公司营收增长了15.6%，达到3.2亿元。',
     '截至二零二五年十二月三十一日，公司营收增长了百分之十五点六，达到三点二亿元。'),
    # -- more mixed and edge cases
    ('I watched it in 4K on my iPhone15.',
     'I watched it in four K on my iPhone fifteen.'),
    ('COVID-19 cases rose.',
     'COVID nineteen cases rose.'),
    ('The IP is 192.168.1.1.',
     'The IP is one nine two dot one six eight dot one dot one.'),
    ('Temperatures of -10°C to 5°C.',
     'Temperatures of minus ten degrees Celsius to five degrees Celsius.'),
    ('我12岁，他2岁。',
     '我十二岁，他两岁。'),
    ('从2020年到2024年，增长了2倍。',
     '从二零二零年到二零二四年，增长了两倍。'),
    ('它在2023年第4季度增长了-3.5%。',
     '它在二零二三年第四季度增长了负百分之三点五。'),
    ('At 12:30 a.m. sharp. Then 1:15 p.m.',
     'At twelve thirty a m. sharp. Then one fifteen p m.'),
    ('Version 2.0 ships on 2026-01-15 at 09:00.',
     'Version two point zero ships on January fifteenth, twenty twenty six at nine o clock.'),
    ('Tel: 400-123-4567',
     'Tel, four zero zero, one two three, four five six seven'),
    ('这款5G手机支持4K视频，售价3999元。',
     '这款五G手机支持四K视频，售价三千九百九十九元。'),
    ('他花了2.5小时，跑了42.195公里。',
     '他花了二点五小时，跑了四十二点一九五公里。'),
    # -- list items
    ('1. 首先，打开电源。',
     '一、首先，打开电源。'),
    ('1. Preheat the oven. 2. Mix.',
     'one, Preheat the oven. two, Mix.'),
    ('步骤：1、打开盖子；2、加水。',
     '步骤，一、打开盖子，二、加水。'),
]

SCHEDULES = [DEFAULT_SCHEDULE, (1,), (2, 5), (4, 12, 30)]


def test_table_is_large_enough():
    assert len(TABLE) >= 150
    assert len({written for written, _ in TABLE}) == len(TABLE)


@pytest.mark.parametrize(("written", "spoken"), TABLE, ids=[w[:40] for w, _ in TABLE])
def test_whole_text(written, spoken):
    assert normalize(written) == spoken


def canonical(text: str) -> str:
    """Words in order; pauses (spaces, ，。、,.) all alike: chunk joins add or drop them."""
    return re.sub(r"[\s，。、,.]+", " ", text).strip()


def stream(written: str, sizes: list[int], schedule: tuple[int, ...]) -> str:
    """Feed ``written`` to a segmenter in pieces of ``sizes``, normalize chunk by chunk."""
    seg, hook = Segmenter(schedule), SpokenText()
    chunks, pos, i = [], 0, 0
    while pos < len(written):
        n = sizes[i % len(sizes)] if sizes else len(written)
        chunks += seg.push(written[pos:pos + n])
        pos, i = pos + n, i + 1
    chunks += seg.flush()
    return " ".join(hook(c.text) for c in chunks)


@pytest.mark.parametrize(("written", "spoken"), TABLE, ids=[w[:40] for w, _ in TABLE])
def test_streamed_one_character_at_a_time(written, spoken):
    # schedule (1,): a chunk at every boundary the segmenter allows
    assert canonical(stream(written, [1], (1,))) == canonical(spoken)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(TABLE), st.lists(st.integers(1, 7), min_size=1, max_size=12),
       st.sampled_from(SCHEDULES))
def test_streamed_in_random_pieces_says_the_same(case, sizes, schedule):
    written, spoken = case
    assert canonical(stream(written, sizes, schedule)) == canonical(spoken)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(TABLE), min_size=2, max_size=4),
       st.lists(st.integers(1, 9), min_size=1, max_size=8))
def test_streamed_paragraphs_say_the_same_as_the_whole(cases, sizes):
    # several sentences in one context: clauses without letters take the language before them
    written = " ".join(w for w, _ in cases)
    assert canonical(stream(written, sizes, DEFAULT_SCHEDULE)) == canonical(normalize(written))


# Random text made of the pieces numbers are written with: never fails, leaves no digit,
# and streamed in random pieces says the same words as the whole.
FUZZ_PIECES = [*"0123456789 .,:-/%$€¥年月日点分号个kmgs abAM你好在了，。？！～~()v\n",
               "+1", "C++", "& b", "#1", "@x", "１２", "٣", "May ", "Call ", "ext. ", "in ", "USD",
               "第", "拨打", "°C", "p.m.", "km", "1e5", "99999999999999999999999999999999",
               "1,000,000,000,000,000,000,000,000,000,000,000"]
WORDS = re.compile(r"[A-Za-z']+|[\u3400-\u9fff]")


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(FUZZ_PIECES), max_size=30),
       st.lists(st.integers(1, 7), min_size=1, max_size=8), st.sampled_from(SCHEDULES))
def test_fuzz_never_fails_leaves_no_digit_and_streams_the_same(pieces, sizes, schedule):
    written = "".join(pieces)
    whole = normalize(written)
    assert not re.search(r"[0-9]", whole)
    assert WORDS.findall(stream(written, sizes, schedule)) == WORDS.findall(whole)


# -- what reaches ChatTTS -------------------------------------------------------------------

# ChatTTS/norm.py, Normalizer.reject_pattern: every other character is deleted
CHATTTS_KEEPS = re.compile(r"[^\u4e00-\u9fffA-Za-z，。、,\. ]")
TAG = re.compile(r"\[[\w_]+\]")


def test_output_has_no_digits_and_only_characters_chattts_keeps():
    for written, spoken in TABLE:
        assert not re.search(r"\d", spoken), written
        left = set(CHATTTS_KEEPS.findall(TAG.sub("", spoken))) - {"'"}
        assert not left, (written, spoken, left)


def _chattts_normalizer():
    """ChatTTS's own Normalizer, loaded without importing torch (its package __init__)."""
    spec = importlib.util.find_spec("ChatTTS")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("ChatTTS is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    pkg = types.ModuleType("_rtts_chattts_norm")
    pkg.__path__ = [str(root)]
    sys.modules.setdefault("_rtts_chattts_norm", pkg)
    norm_spec = importlib.util.spec_from_file_location("_rtts_chattts_norm.norm", root / "norm.py")
    assert norm_spec is not None and norm_spec.loader is not None
    module = importlib.util.module_from_spec(norm_spec)
    sys.modules["_rtts_chattts_norm.norm"] = module
    norm_spec.loader.exec_module(module)
    return module.Normalizer(str(root / "res" / "homophones_map.json"))


def test_chattts_normalizer_keeps_every_letter_of_the_output():
    chattts = _chattts_normalizer()
    letters = re.compile(r"[\u4e00-\u9fffA-Za-z]")
    for written, spoken in TABLE:
        kept = chattts(spoken, do_homophone_replacement=False)
        assert letters.findall(TAG.sub("", kept)) == letters.findall(TAG.sub("", spoken)), (
            written, spoken, kept)
    # and without rtts the numbers are lost (issue 13)
    assert not re.search(r"\d", chattts("Call 911 now!", do_homophone_replacement=False))


# -- which library did what (the README quotes these counts) ------------------------------------

def library_counts() -> Counter[str]:
    counts: Counter[str] = Counter()
    for written, _ in TABLE:
        _, used = trace(written)
        counts["+".join(sorted(used)) or "glue only"] += 1
    return counts


def test_library_counts_match_the_readme():
    counts = library_counts()
    readme = (Path(__file__).parent.parent / "docs/text-normalization.md").read_text(encoding="utf-8")
    assert f"the {len(TABLE)} sentences" in readme
    for name, n in counts.items():
        assert f"{name}: {n}" in readme, (name, n, dict(counts))


# -- the hook ---------------------------------------------------------------------------------

def test_hook_can_be_turned_off():
    assert spoken_text("Call 911 now!", enabled=False) == "Call 911 now!"
    assert spoken_text("Call 911 now!") == "Call nine one one now."
    off = SpokenText(enabled=False)
    assert off("价格是12.5元") == "价格是12.5元"


def test_clause_without_letters_takes_the_language_before_it():
    assert normalize("42。") == "forty two。"
    assert normalize("42。", lang_hint="zh") == "四十二。"
    assert normalize("答案是：42。") == "答案是，四十二。"
    hook = SpokenText()
    assert hook("答案是：") == "答案是，"
    assert hook("42。") == "四十二。"  # as in the whole text


def test_tags_pass_through():
    assert normalize("[uv_break]3[laugh]", lang_hint="zh") == "[uv_break]三[laugh]"


def test_empty_and_plain_text_unchanged():
    assert normalize("") == ""
    assert normalize("Hello world, 你好。") == "Hello world, 你好。"
    assert json.dumps(normalize("ok")) == '"ok"'


@pytest.mark.parametrize("size", range(1, 10))
def test_list_item_after_an_english_sentence_streams_as_whole(size):
    # found by hypothesis: streamed, "1." began a chunk and was read as a Chinese list item
    # ("一、"); whole, it followed "oven. " and was read as the English number "one"
    written = "1. Preheat the oven. 1. 首先，打开电源。"
    whole = normalize(written)
    assert "一、首先" in whole
    assert canonical(stream(written, [size], DEFAULT_SCHEDULE)) == canonical(whole)
