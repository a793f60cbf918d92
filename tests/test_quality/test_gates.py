"""Unit tests of the quality package with exact expected outputs (no shared corpora needed)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import pickle
import random
from pathlib import Path

import numpy as np
import orjson
import pytest

from quality import (QUALITY_DEFAULTS, DedupIndex, NearDedupSettings, QualityConfigError, QualityControl,
                     QualitySettings, Verdict, load_quality_settings, validate_quality_config)
from quality.dedup import digest_words
from quality.gates.base import Doc
from quality.gates.code import code_score
from quality.gates import pii
from quality.gates.pii import PiiGate, find_pii, luhn_valid
from quality.gates.profanity import ProfanityGate
from quality.language import bounded_sample, normalize_code
from quality.normalize import normalize_text

# Gates that would reject the short synthetic texts below for unrelated reasons are relaxed here.
OPEN = {"min_chars": 0, "expected_language": None, "pii_max_density": 1.0, "profanity_max_density": 1.0,
        "reject_copyright": False}
PROSE = ("The committee met on Tuesday to review the annual budget and agreed to fund the new library wing, "
         "the park renovation and two additional bus routes serving the northern districts of the city. ")


# Chars past U+00FF that have standins in a Latin-1 view: ellipsis, bullet, euro, trade mark, zero-width space,
# emoji, arrow, a CJK ideograph, Cyrillic and Greek letters (upper case too), fullwidth A, a private-use char,
# precomposed letters (a with ogonek, short i, e with circumflex and acute) and l with stroke.
STANDINS = "\u2026\u2022\u20ac\u2122\u200b\U0001f642\u2192\u4e2d\u0416\u0436\u03bb\u039b\uff21\ue000\u0105\u0439\u1ebf\u0142"


def open_qc(**overrides) -> QualityControl:
    return QualityControl({**OPEN, **overrides})


# ---- normalisation -----------------------------------------------------------------------------
@pytest.mark.parametrize("raw, expected", [
    ("Cafe\u0301 cre\u0300me", "Caf\u00e9 cr\u00e8me"),                                   # NFC
    ("\u201cHi,\u201d she said \u2014 it\u2019s \u2018fine\u2019 \u2013 ok", "\"Hi,\" she said - it's 'fine' - ok"),
    ("a\x00b\x07c\td\ne\x1b", "abc\td\ne"),                                                  # controls out, \t \n kept
    ("l\x92Ecole co\x96op", "l'Ecole co-op"),                                                # C1 = Windows-1252
    ("  a  b\u00a0\u00a0c \n\t d  \n\n e  ", "a b c\nd\n\ne"),                               # spaces, line edges
    ("one\r\ntwo\rthree", "one\ntwo\nthree"),
    ("\ufeffBOM", "BOM"),
    ("cafe\x00\u0301", "caf\u00e9"), ("cafe\ufeff\u0301", "caf\u00e9"),                  # NFC after removal too
    ("e\x1b\u0308 \u1100\x00\u1161", "\u00eb \uac00"), ("\x8a\u0323", "\u1e62\u030c"),  # a C1 letter composes
    ("a\u0301\x00\u0323", "\u1ea1\u0301"),                                                 # marks reordered
])
def test_normalize_prose(raw: str, expected: str) -> None:
    assert normalize_text(raw) == expected


@pytest.mark.parametrize("prose", [True, False])
def test_char_pass_latin1_shortcut_equals_the_table(prose: bool) -> None:
    """The regex pass runs only where the Hyperscan pass over the Latin-1 view sees a table key: every
    Latin-1 character, alone, beside CR LF, beside a standin, and next to a wide one (no view) comes out as
    the table says."""
    from quality.normalize import _CODE_CHARS, _PROSE_CHARS, _char_map, latin1_view, view_flags

    table, char_pass = _char_map(prose), (_PROSE_CHARS if prose else _CODE_CHARS)
    for code in range(256):
        for text in (f"x{chr(code)}y", f"a\r\n{chr(code)}\r", f"\u2019{chr(code)}\u00e9", f"{chr(code)}\u2026\u20ac",
                     f"\u0100{chr(code)}", STANDINS + chr(code)):
            expected = "".join(table.get(ch, ch) for ch in text.replace("\r\n", "\n"))
            view = latin1_view(text)
            key = view is None or view_flags(view, prose)[0]
            assert (char_pass(text) if key else text) == expected, (code, text)


def test_latin1_text_is_nfc() -> None:
    """Why a text with a Latin-1 view skips the NFC check: no pair of its chars (standins included) changes."""
    import unicodedata

    chars = [chr(c) for c in range(256)] + list(STANDINS)
    for a in chars:
        assert unicodedata.is_normalized("NFC", a + "".join(chars)), a
        for b in chars:
            assert unicodedata.is_normalized("NFC", a + b), (a, b)


def plain_normalize(text: str, code: bool = False) -> str:
    """`normalize_text` as its docstring says it, one plain step after another (no shortcut)."""
    import re
    import unicodedata

    from quality.normalize import _char_map

    table = _char_map(prose=not code)
    text = "".join(table.get(ch, ch) for ch in unicodedata.normalize("NFC", text).replace("\r\n", "\n"))
    text = unicodedata.normalize("NFC", text)  # a removed control char may have parted a base and its mark
    if code:
        return re.sub("[ \t]+(?=\n)|[ \t]+$", "", text).rstrip("\n")
    return re.sub("[ \t]+\n[ \t]*|\n[ \t]+", "\n", re.sub(" {2,}", " ", text)).strip(" \t\n")


# Curly quotes and dashes go before NFC (and a text ASCII after that skips it): beside combining marks, CR LF,
# C1 bytes, Unicode spaces, tabs, surrogate pairs, other table characters and text that stays non-ASCII.
FUSED_CASES = ["plain ASCII text", "caf\u00e9 \u2026 ok", "\u2019", "\u2018tis \u2026\u20ac", "\u2019\u0301", "e\u2019\u0301\u201c\u0338", "\u2014\u0308a", "\u201ccaf\u00e9\u201d", "\u2018\r\n\u2019",
               "a\x92b\u2019c", "\u2013\u00a0\u2014  \t\n \u2019", "\u201c\U0001f642\u201d", "\u2019\u3000x\u2019",
               "\u2019\u2019\u2019", " \u2014 ", "\u2018\u2212\u2019\u2011", "\ufeff\u201cq\u201d\x85", "\u2019e\u0301\u2019",
               "A\u030a\u2019\u212b", "\u2019\t\u2019\n\n\u201c \u201d", "\u1100\u2019\u1161", "cafe\x00\u0301", "\u2019e\ufeff\u0301\u2019", "\x8a\u0323\u2014", "x" * 70 + "\u2013\n" * 70]


@pytest.mark.parametrize("text", FUSED_CASES)
def test_normalize_equals_the_plain_steps(text: str) -> None:
    from quality.normalize import latin1_view, normalize_with_view

    for code in (False, True):
        assert normalize_text(text, code) == plain_normalize(text, code)
        normalized, view = normalize_with_view(text, code)
        assert view is None or view == latin1_view(normalized)


SPACING_CASES = ["a  b", "a \nb", "a\t\nb", "a\n b", "a\n\tb", "a\nb", "a\u00a0\nb", " ", "  ", "\n", "\n ", " \n", "",
                 "x\u2026 \u2026\n", "caf\u00e9\u3000\n", "a \t b\n\nc", "\n".join(["line"] * 80) + " \nz", "a\r\n b"]


@pytest.mark.parametrize("text", SPACING_CASES)
def test_spacing_pass_equals_the_substring_checks(text: str) -> None:
    """One Hyperscan pass over the view answers both spacing checks; collapsing spaces keeps the line edges."""
    from quality.normalize import _collapse_spaces, _has_line_edge, latin1_view, utf8_flags, view_flags

    view = latin1_view(text)
    if view is not None:
        assert view_flags(view)[1:] == ("  " in text, _has_line_edge(text))
    assert utf8_flags(text)[1:] == ("  " in text, _has_line_edge(text))
    assert _has_line_edge(_collapse_spaces(text)) == _has_line_edge(text)
    assert normalize_text(text) == plain_normalize(text)


# Characters the normalisation treats apart: spacing, line ends, controls, C1, table keys past Latin-1 (curly
# quotes, Unicode spaces, the BOM), standins (precomposed letters too), combining marks, wide text, a surrogate
# pair, a lone surrogate.
TRICKY = [" ", " ", " ", "\t", "\n", "\n", "\r", "a", "Z", "\x00", "\x85", "\x92", "\u00a0", "\u00e9", "\u2019",
          "\u201c", "\u2014", "\u2212", "\u3000", "\u2009", "\ufeff", "\u2026", "\u0301", "\u0338", "\u4e2d",
          "\u0439", "\u0436", "\u0105", "\U0001f642", "\ud800"]


def test_fast_steps_equal_the_plain_ones_on_random_text() -> None:
    """The shortcuts on random strings of the characters that matter: the UTF-8 flags pass answers the three
    questions as the plain checks do, the space and line-edge steps equal their regexes, and the whole
    normalisation equals the plain steps (prose and code)."""
    import re

    from quality.normalize import _char_map, _collapse_spaces, _has_line_edge, _strip_line_edges, utf8_flags

    keys = {prose: set(_char_map(prose)) for prose in (True, False)}
    rng = random.Random(7)
    for _ in range(20_000):
        text = "".join(rng.choices(TRICKY, k=rng.randrange(0, 24)))
        for prose in (True, False):
            key, double, edge = utf8_flags(text, prose)
            assert key == any(c in keys[prose] for c in text), (prose, text)
            assert (double, edge) == (("  " in text, _has_line_edge(text)) if prose else (False, False)), text
        assert _collapse_spaces(text) == re.sub(" {2,}", " ", text), text
        assert _strip_line_edges(text).strip(" \t\n") == re.sub("[ \t]+\n[ \t]*|\n[ \t]+", "\n", text).strip(" \t\n")
        if "\ud800" not in text:  # NFC of a lone surrogate is left to the schema gate, which rejects it first
            for code in (False, True):
                assert normalize_text(text, code) == plain_normalize(text, code), (code, text)


def test_collapse_spaces_equals_the_regex_on_texts_with_many_runs() -> None:
    """`_collapse_spaces` finds the first RUNS_FOUND runs one by one and replaces the rest: the same text as the
    regex on either side of the switch, a run at the cut included, in ASCII and wider strings."""
    import re

    from quality.normalize import RUNS_FOUND, _collapse_spaces

    rng = random.Random(11)
    texts = ["a  " * n for n in (RUNS_FOUND - 1, RUNS_FOUND, RUNS_FOUND + 1, 3 * RUNS_FOUND)]
    texts += [" " * 5 + "b    " * RUNS_FOUND + "   ", "\u2014  " * (RUNS_FOUND + 2) + "x"]
    texts += ["".join(rng.choices(" a\u00e9\u2014\U0001F600\n", weights=(6, 3, 1, 1, 1, 1), k=rng.randrange(600)))
              for _ in range(3_000)]
    assert sum(len(re.findall(" {2,}", t)) > RUNS_FOUND for t in texts) > 100  # the switch is exercised
    for text in texts:
        assert _collapse_spaces(text) == re.sub(" {2,}", " ", text), text


def _wide(text: str) -> int:
    """How many chars of `text` lie past U+00FF (each needs a standin for a view)."""
    return len(text) - len(text.encode("latin-1", "ignore"))


def _with_standins() -> list[str]:
    """Every char past U+00FF that has a standin in a Latin-1 view."""
    from quality.normalize import _standin

    return [chr(cp) for cp in range(0x100, 0x110000) if _standin(chr(cp))]


@pytest.mark.slow
def test_standins_are_nfc_inert_and_read_alike() -> None:
    """What lets a text with a view skip NFC and be read byte by byte, for every char that has a standin: NFC
    alone, no combining class, and never the second char of a canonical composition (from every
    decomposition in the Unicode data, and the Hangul jamo that compose by rule); no digit or space; its
    lower case one char, past ASCII, of its standin's word-char class."""
    import re
    import unicodedata

    from quality.normalize import _standin

    seconds = set()
    for cp in range(0x110000):
        parts = unicodedata.decomposition(chr(cp)).split()
        if len(parts) == 2 and not parts[0].startswith("<"):
            seconds.add(chr(int(parts[1], 16)))
    seconds |= {chr(cp) for cp in [*range(0x1161, 0x1176), *range(0x11A8, 0x11C3)]}
    chars = _with_standins()
    assert len(chars) > 100_000 and not seconds & set(chars)
    word, digit = re.compile(r"\w"), re.compile(r"\d")
    for c in chars:
        assert unicodedata.normalize("NFC", c) == c and unicodedata.combining(c) == 0, hex(ord(c))
        assert not digit.match(c) and not c.isspace() and len(c.lower()) == 1 and not c.lower().isascii()
        assert bool(word.match(c.lower())) == (_standin(c) == "\u00aa"), hex(ord(c))
    rng = random.Random(5)
    hangul = [c for c in chars if 0xAC00 <= ord(c) <= 0xD7A3]
    composed = [c for c in chars if unicodedata.decomposition(c)[:1] not in ("", "<")]  # "\u0105", "\u0439"
    assert "\u0105" in composed and "\u0439" in composed
    for _ in range(3_000):  # and a text of them beside Latin-1 is NFC
        pool = hangul if rng.random() < 0.2 else composed if rng.random() < 0.3 else chars
        text = "".join(rng.choice(pool) if rng.random() < 0.5 else chr(rng.randrange(256)) for _ in range(12))
        assert unicodedata.is_normalized("NFC", text), text


@pytest.mark.parametrize("pad", [0, 2_000, 60_000])
def test_a_view_takes_up_to_the_budget_of_standins(pad: int) -> None:
    """Up to its budget of chars with standins (STANDIN_BUDGET, or one in STANDIN_SHARE chars of a longer text),
    alone or in runs, a text has a view; one more, or one char without a standin anywhere, and it has none. A
    short text is counted first, a longer one in the error handler, and one of 60 000 chars has a larger budget."""
    from quality.normalize import STANDIN_BUDGET, STANDIN_SHARE, latin1_view

    def budget(text: str) -> int:
        return max(STANDIN_BUDGET, len(text) // STANDIN_SHARE)

    for word in ("\u0436", "\u0436\u0443\u043a", "\U0001f642" * 5):
        n = 1
        while _wide(" ".join([word] * (n + 1))) <= budget("x" * pad + " ".join([word] * (n + 1))):
            n += 1
        text = "x" * pad + " ".join([word] * n)
        assert budget(text) - len(word) < _wide(text) <= budget(text)  # the text sits at its budget
        view = latin1_view(text)
        assert view is not None and view.count(b"\xaa") + view.count(b"\xa4") == _wide(text)
        over = text + " "
        while _wide(over) <= budget(over):
            over += word[0]
        assert latin1_view(over) is None
        assert latin1_view(text[:-1] + "\u0301") is None and latin1_view("\u3000" + text) is None
    assert budget("x" * 60_000) > STANDIN_BUDGET


def test_views_with_standins_read_as_the_text() -> None:
    """Texts that hold chars with standins beside bait for every byte scan: the word lists' counts and cues,
    the number runs and PII, the copyright verdict and the normalisation equal their str-level references."""
    from quality.gates import pii
    from quality.gates.copyright import _NOTICE, CopyrightGate
    from quality.normalize import STANDIN_BUDGET, _standin, latin1_view

    rng = random.Random(11)
    chars = list(STANDINS) + [c for c in (chr(rng.randrange(0x100, 0x30000)) for _ in range(3_000)) if _standin(c)]
    assert all(_standin(c) for c in STANDINS) and len(chars) > 500
    bait = ["fuck", "sh1t", "a$$", "F*CK", "b!tch", "copyright", "(c) 2019", "all rights reserved", "\u00a9",
            "555 123 4567", "4111 1111 1111 1111", "192.168.0.1", "fe80:0:0:0:0:0:0:1", "a@b.com", "  ", " \n ",
            "\u00e9", "x", "1", " ", " ", "\n"]
    gate, copyright_gate = ProfanityGate(0.01), CopyrightGate()

    def check(text: str) -> bool:
        view = latin1_view(text)
        fast = gate.density_by_scan(Doc(None, text=text))  # None: no scan (a long text past its budget)
        hits, tokens = gate.density_by_tokens(Doc(None, text=text))
        assert fast == (hits, tokens) or fast == (0, 0) and hits == 0 or fast is None and view is None, text
        m = _NOTICE.search(text)
        expected = None if m is None else f"copyright notice {m.group()[:40]!r} at char {m.start()}"
        assert copyright_gate.check(Doc(None, text=text)) == expected, text
        assert [m.span() for m in pii._number_runs(text, view)] == [m.span() for m in pii._NUMBER_RUN.finditer(text)]
        assert list(pii._find(text, view)) == list(pii._find(text, None)), text
        assert normalize_text(text) == plain_normalize(text), text
        return view is not None

    pieces = lambda k: [rng.choice(chars) if rng.random() < 0.3 else rng.choice(bait) for _ in range(k)]  # noqa: E731
    assert sum(check("".join(pieces(rng.randrange(1, 14)))) for _ in range(3_000)) > 2_000
    # long pages with more standins than a short text may take (one in STANDIN_SHARE chars), between long words
    long_texts = [" ".join(pieces(rng.randrange(300, 500)) + ["w" * rng.randrange(30, 90) for _ in range(600)])
                  for _ in range(40)]
    assert sum(check(text) for text in long_texts) > 20
    assert max(_wide(t) for t in long_texts if latin1_view(t)) > STANDIN_BUDGET


@pytest.mark.slow
def test_common_punctuation_before_nfc_beside_every_code_point() -> None:
    """Replacing the frequent quotes and dashes before NFC gives NFC's result beside any assigned character
    (unassigned and private-use ones neither compose nor decompose)."""
    import unicodedata

    for cp in range(0x110000):
        c = chr(cp)
        if unicodedata.category(c) in ("Cn", "Co", "Cs"):
            continue
        for text in (f"\u2019{c}\u201c", f"{c}\u2014{c}\u0301", f"{c}\u0338\u201d"):
            assert normalize_text(text) == plain_normalize(text), (hex(cp), text)


def test_normalize_code_keeps_indentation_and_quotes() -> None:
    raw = "def f(x):\r\n    if x:  \r\n\treturn \u201cq\u201d  # two  spaces\r\n\x00\r\n\r\n   \r\n"
    assert normalize_text(raw, code=True) == "def f(x):\n    if x:\n\treturn \u201cq\u201d  # two  spaces"
    assert normalize_text("s = 'cafe\x00\u0301'\x1b\n", code=True) == "s = 'caf\u00e9'"  # NFC after removal


def test_code_domain_keeps_code_layout_in_kept_text() -> None:
    qc = QualityControl({**OPEN, "domain": "code", "code_min_score": 0.0})
    v = qc.evaluate({"text": "int main() {\r\n    return 0;\r\n}\r\n\r\n"})
    assert v.keep and v.text == "int main() {\n    return 0;\n}"


def test_normalize_false_keeps_raw_text_but_hashes_normalised() -> None:
    raw = "  \u201cSame\u201d   text  "
    kept = open_qc(normalize=False).evaluate({"text": raw})
    assert kept.text == raw
    assert kept.digest == hashlib.sha256(b'"Same" text').digest()
    assert open_qc().evaluate({"text": '"Same" text'}).digest == kept.digest


def test_a_removed_control_char_does_not_keep_canonical_twins_apart() -> None:
    """A NUL or BOM between a base and its mark is removed before the text is hashed: the twins share a digest,
    and the kept text is NFC."""
    import unicodedata

    verdicts = [open_qc().evaluate({"text": f"a table at the cafe{gap}\u0301"}) for gap in ("", "\x00", "\ufeff")]
    assert {v.digest for v in verdicts} == {hashlib.sha256("a table at the caf\u00e9".encode()).digest()}
    assert all(v.keep and unicodedata.is_normalized("NFC", v.text) for v in verdicts)


# ---- PII -----------------------------------------------------------------------------------------
def test_luhn() -> None:
    assert luhn_valid("4111111111111111") and luhn_valid("4539148803436467") and luhn_valid("378282246310005")
    assert not luhn_valid("4111111111111112") and not luhn_valid("4539148803436466")


@pytest.mark.parametrize("text, found", [
    ("write to jane.doe+news@example.co.uk today", [("email", "jane.doe+news@example.co.uk")]),
    ("card 4111 1111 1111 1111 ok", [("card", "4111 1111 1111 1111")]),
    ("card 4111-1111-1111-1112 fails Luhn", []),
    ("server 192.168.0.254 and 256.1.1.1", [("ip", "192.168.0.254")]),
    ("v6 2001:0db8:85a3:0000:0000:8a2e:0370:7334 end", [("ip", "2001:0db8:85a3:0000:0000:8a2e:0370:7334")]),
    ("call (555) 123-4567 or +44 20 7946 0958.", [("phone", "(555) 123-4567"), ("phone", "+44 20 7946 0958")]),
    ("in 1990-2000 we sold 1,234,567 units at 3.5 each", []),
    ("an email-like a@b without a domain", []),
])
def test_find_pii(text: str, found: list) -> None:
    assert [(kind, text[start:end]) for kind, start, end in find_pii(text)] == found


@pytest.mark.parametrize("text, found", [
    ("call +14155552671 now", [("phone", "+14155552671")]), ("call +442079460958 now", [("phone", "+442079460958")]),
    ("call +91 98765 43210 now", [("phone", "+91 98765 43210")]), ("call +91 9876543210.", [("phone", "+91 9876543210")]),
    ("call +49 30 1234567 now", [("phone", "+49 30 1234567")]), ("call +4930123456 now", [("phone", "+4930123456")]),
    ("fax +971 4 4508438 or +30-22530-71245", [("phone", "+971 4 4508438"), ("phone", "+30-22530-71245")]),
    ("+44 20 7946 0958 and +1 415 555 2671", [("phone", "+44 20 7946 0958"), ("phone", "+1 415 555 2671")]),
    # fewer than 10 or more than 15 digits are no phone; a card after a "+" is still a card
    ("id +123456789 or +1234567890123456 ok", []), ("card +4111111111111111 ok", [("card", "4111111111111111")]),
])
def test_find_pii_international_phones_in_e164_and_long_groups(text: str, found: list) -> None:
    """`+CC`, 10-15 digits, written without separators (E.164) or with a group past 4 digits (India's 5 + 5,
    Germany's 7-digit numbers) was no phone: the pattern wanted a separator and groups of at most 4 digits."""
    assert [(kind, text[start:end]) for kind, start, end in find_pii(text)] == found


@pytest.mark.parametrize("text, found", [
    ("INT_MAX is +2147483647, the largest", []), ("balance +1500000000 units", []), ("id=+1000000000", []),
    ("AAPL 182.50 +1.25 45678901. MSFT", []), ("GDP +3.1 21427700 million", []), ("+12.50 45678901", []),
    ("pi is +3.1415926535", []),
    # a two-digit country code and 8 digits, 11 or more digits, or dots between all the groups: still phones
    ("call +4722123456 now", [("phone", "+4722123456")]), ("call +12125551234 now", [("phone", "+12125551234")]),
    ("call +1.415.555.2671 now", [("phone", "+1.415.555.2671")]), ("+33.1.23.45.67.89", [("phone", "+33.1.23.45.67.89")]),
])
def test_find_pii_signed_numbers_are_no_international_phones(text: str, found: list) -> None:
    """A "+" and 10 digits with no country code that has 8-digit numbers, and a signed decimal then a number
    (`+1.25 45678901`), were phones since the E.164 and long-group forms: ordinary records were rejected."""
    assert [(kind, text[start:end]) for kind, start, end in find_pii(text)] == found


@pytest.mark.parametrize("number", [
    "+3545511234", "+9611123456", "+5072123456", "+2302123456", "+3726123456", "+6793312345", "+9603312345",
    "+5016123456", "+5922123456", "+9752123456",  # a 3-digit country code and a 7-digit national number
    "+1.415-555-2671", "+44.20 7946 0958", "+1.415.555 2671",  # a "." then groups parted otherwise too
])
def test_find_pii_e164_numbers_of_3_digit_codes_and_mixed_dots_are_phones(number: str) -> None:
    """A bare "+" and 10 digits was a phone only led by a two-digit code, on the premise that a 3-digit code
    leaves 7 digits, which is what Iceland, Lebanon, Panama, ... numbers have; a "." after the code was a phone
    only if "." parted every group. Now the country code's own national lengths decide."""
    text = f"Call the desk on {number} before noon."
    assert [(kind, text[start:end]) for kind, start, end in find_pii(text)] == [("phone", number)]


def test_country_code_table_holds_the_assigned_codes() -> None:
    """The table is prefix-free (a number begins with one code at most) and has the codes a bare number needs."""
    codes = pii._COUNTRY_CODES
    assert not [c for c in codes for d in codes if c != d and d.startswith(c)]
    assert codes["1"] == {10} and codes["354"] >= {7} and codes["44"] >= {9, 10} and "21" not in codes
    assert pii._e164("3545511234") and not pii._e164("2147483647") and not pii._e164("1500000000")


FULLWIDTH = str.maketrans("0123456789", "".join(map(chr, range(0xFF10, 0xFF1A))))
ARABIC_INDIC = str.maketrans("0123456789", "".join(map(chr, range(0x660, 0x66A))))


@pytest.mark.parametrize("text, found", [
    # an IPv4 ending a sentence (the lookahead refused any "." after it); a longer dotted number is none
    ("server 10.0.0.1. ok", [("ip", "10.0.0.1")]), ("at 10.0.0.1.", [("ip", "10.0.0.1")]),
    ("see 10.0.0.1... ok", [("ip", "10.0.0.1")]), ("v 1.2.3.4.5 ok", []), ("v 1.2.3.4.beta ok", []),
    # a phone right after "(" (the lookbehind refused it); the area-code form keeps its "("
    ("call us (555-123-4567) today", [("phone", "555-123-4567")]),
    ("(+44 20 7946 0958)", [("phone", "+44 20 7946 0958")]), ("((555) 123-4567)", [("phone", "(555) 123-4567")]),
    ("call (555) 123-4567 ok", [("phone", "(555) 123-4567")]), ("f(555) 123-4567 ok", []),
    # cards in other digits, checked by the digits' values (each char's code point - 48 was checked)
    ("card " + "5500000000000004".translate(FULLWIDTH) + " ok", [("card", "5500000000000004".translate(FULLWIDTH))]),
    ("card " + "4000000000001050".translate(FULLWIDTH) + " ok", []),  # passed the old check, fails Luhn
    ("card " + "4111111111111111".translate(ARABIC_INDIC) + " ok",
     [("card", "4111111111111111".translate(ARABIC_INDIC))]),
    ("card " + "0" * 16 + " " + "0".translate(FULLWIDTH) * 16, []),
    # IPv4 octets and a phone's leading 1 by value too (192 and 1- were ASCII-only in the pattern: no IPv4 at all,
    # the phone without its "1-")
    ("ip " + "192.168.1.1".translate(ARABIC_INDIC) + " ok", [("ip", "192.168.1.1".translate(ARABIC_INDIC))]),
    ("ip " + "255.250.1.1".translate(FULLWIDTH) + " ok", [("ip", "255.250.1.1".translate(FULLWIDTH))]),
    ("ip " + "256.1.1.1".translate(FULLWIDTH) + " " + "01.2.3.4".translate(ARABIC_INDIC) + " ok", []),
    ("call " + "1-866-943-3427".translate(ARABIC_INDIC) + " now", [("phone", "1-866-943-3427".translate(ARABIC_INDIC))]),
    ("ip ١٩٢.168.١.1 or ١٩٢.168.١.1.5 中", [("ip", "١٩٢.168.١.1")]),  # scripts mixed: each digit by its value
])
def test_find_pii_sentence_ends_parentheses_and_other_digits(text: str, found: list) -> None:
    """Each was a miss (or a Luhn check of the wrong numbers); both ways of finding the runs agree."""
    from quality.gates import pii
    from quality.normalize import latin1_view

    assert [(kind, text[start:end]) for kind, start, end in find_pii(text)] == found
    assert list(pii._find(text, latin1_view(text))) == list(pii._find(text, None))


@pytest.mark.parametrize("text, found", [
    ("卡号4111111111111111，", [("card", "4111111111111111")]), ("电话555-123-4567。", [("phone", "555-123-4567")]),
    ("IP地址192.168.1.1。", [("ip", "192.168.1.1")]), ("邮箱abc@example.com谢谢", [("email", "abc@example.com")]),
    ("โทร555-123-4567ครับ", [("phone", "555-123-4567")]), ("電話は03-1234-5678までカード4111 1111 1111 1111です",
                                                        [("card", "4111 1111 1111 1111")]),
    ("ఫోన్ +44 20 7946 0958", [("phone", "+44 20 7946 0958")]), ("연락처 555-123-4567로", [("phone", "555-123-4567")]),
    ("地址fe80:0:0:0:0:0:0:1的", [("ip", "fe80:0:0:0:0:0:0:1")]),
    # a letter of a spaced script, a digit (Thai ones too) or "_" still makes the digits part of a word or code
    ("abc4111111111111111", []), ("card\u00e94111111111111111", []), ("\u0e51" + "4111111111111111", []),
    ("x_192.168.1.1", []), ("_555-123-4567", []), ("abc@example.com_x", []), ("A55-123-4567", []),
])
def test_find_pii_beside_letters_of_scripts_written_without_spaces(text: str, found: list) -> None:
    """PII glued to Chinese, Japanese, Thai or Korean letters (the normal case there) was never found: each edge of
    a match refused any `\\w` beside it, and these scripts' letters are `\\w`. Both ways of finding runs agree."""
    from quality.gates import pii
    from quality.normalize import latin1_view

    assert [(kind, text[start:end]) for kind, start, end in find_pii(text)] == found
    assert list(pii._find(text, latin1_view(text))) == list(pii._find(text, None))


def test_the_unspaced_letters_hold_no_digit_and_a_chinese_record_with_pii_is_rejected() -> None:
    import re

    from quality.gates import pii

    text = ("我们今天去市场买水果和蔬菜，然后回家做饭。请把货款转到卡号4111111111111111，或者打电话555-123-4567联系我们，"
            "邮箱abc@example.com谢谢。我们明天再去市场买更多的东西。")
    v = QualityControl({**OPEN, "pii_max_density": 0.01}).evaluate({"text": text})
    assert not v.keep and v.meta["reason"] == "pii density 0.1456 > 0.01 (email 1)"  # kept at density 0 before
    v = QualityControl({**OPEN, "pii_max_density": 0.5}).evaluate({"text": text})
    assert v.keep and v.meta["pii"] == {"card": 1, "email": 1, "phone": 1} and v.meta["pii_density"] == 0.4175
    unspaced = re.compile(f"[{pii._UNSPACED}]")  # a digit glued to a card's digits is still part of the number
    assert not [hex(c) for c in range(0x40000) if unspaced.match(chr(c)) and pii._DIGIT.match(chr(c))]


def test_pii_runs_from_the_latin1_view_equal_the_regex() -> None:
    """The run classes from a Latin-1 view: no char past ASCII there is a digit, so runs are the regex's."""
    from quality.gates import pii
    from quality.normalize import latin1_view

    assert not any(pii._DIGIT.match(chr(c)) for c in range(128, 256))
    for text in ["Call (555) 123-4567\u00a0or +44 20 7946 0958 \u2026 555 123 4567\u00b2 ok",
                 "\u00bd 1 2 3 4 5 6 7 \u20ac 4111 1111 1111 1111 \u00e9 192.168.0.1\u2026",
                 STANDINS + "12345678" + "\u2026".join("1234567") + "\u4e2d".join("1234567"), "\u0663" * 8 + " 1234567 \u2026",
                 "fe80:0:0:0:0:0:0:1 and FE80:AB:CD:EF:1:2:3:4\u00e9", "a:b:c:d:e:f:g:h", "+ . . 1", "(( ))- .+1",
                 "1 2 3", "::::::::", "\u00bd1 2 3 4 5 6\u00b2"]:
        view = latin1_view(text)
        assert [m.span() for m in pii._number_runs(text, view)] == [m.span() for m in pii._NUMBER_RUN.finditer(text)]
        assert list(pii._find(text, view)) == list(pii._find(text, None))  # None: the codec handler's classes
        if view is not None:
            assert pii._cues(view) == (bool(pii._NUMBER_RUN.search(text)), bool(pii._IPV6_CUE.search(text)))


def test_pii_density_threshold() -> None:
    email = "jane.doe@example.com"  # 20 chars
    gate = PiiGate(0.01)
    kept = Doc(None, text=email + " " + "x" * 1979)  # 20 / 2000 = 0.01, not above the limit
    assert gate.check(kept) is None and kept.meta == {"pii_density": 0.01, "pii": {"email": 1}}
    rejected = Doc(None, text=email + " " + "x" * 979)
    assert gate.check(rejected) == "pii density 0.02 > 0.01 (email 1)"
    assert rejected.meta["pii_density"] == 0.02


def test_pii_density_counts_a_char_once() -> None:
    """E-mails, numbers and IPv6 are searched one after another, so their matches overlap: a phone that is an
    e-mail's local part doubled its chars and was a second hit (rejected at 0.0136, where a same-length address
    is 0.0088), and a text could reach a density above 1."""
    body = "The quick brown fox jumps over the lazy dog. " * 55 + "Text me at "
    for address in ("jane.doe.smi@vtext.com", "555-123-4567@vtext.com"):
        doc = Doc(None, text=body + address)
        assert PiiGate(0.01).check(doc) is None and doc.meta == {"pii_density": 0.0088, "pii": {"email": 1}}
    text = "4111111111111111+1-800-555-1234\u03a9john.doe@example.com"  # the e-mail holds the card and the phone
    doc = Doc(None, text=text + " 555-123-4567")  # 52 + 12 of 65 chars
    assert PiiGate(0.99).check(doc) is None and doc.meta == {"pii_density": 0.9846, "pii": {"email": 1, "phone": 1}}
    doc = Doc(None, text=text)
    assert PiiGate(0.5).check(doc) == "pii density 1 > 0.5 (email 1)" and doc.meta["pii_density"] == 1.0


def test_a_figure_just_past_its_limit_is_not_shown_equal_to_it() -> None:
    """A reason printed the figure rounded to 4 decimals: 20 / 1999 read "pii density 0.01 > 0.01" (and a code score
    of 0.89618 against 0.8962 "0.8962 < 0.8962"). It takes the decimals that keep it on its side; meta stays at 4."""
    from quality.figures import shown

    rejected = Doc(None, text="jane.doe@example.com " + "x" * 1978)  # 20 / 1999
    assert PiiGate(0.01).check(rejected) == "pii density 0.01001 > 0.01 (email 1)"
    assert rejected.meta["pii_density"] == 0.01
    assert [shown(0.89618, 0.8962), shown(0.899996, 0.9), shown(0.5, 0.9), shown(0.1234567, 0.12345678)] == [
        "0.89618", "0.899996", "0.5", "0.1234567"]


@pytest.mark.parametrize("limit", [0.009, 0.018, 0.036, 0.29, 0.57])
def test_a_density_on_a_limit_whose_product_rounds_low_is_kept(limit: float) -> None:
    """`limit * n` rounds: 0.009 * 3 000 is 26.999999999999996, so 27 PII chars of 3 000 (and 27 profane tokens of
    1 500 at 0.018) were rejected as "0.009 > 0.009". The limit is the decimal written; one more hit is past it."""
    from fractions import Fraction

    for n in range(100, 4000):
        hits = Fraction(repr(limit)) * n
        if hits.denominator != 1 or not 12 < hits < n - 1 or limit * n >= hits:
            continue  # the product is not an integer, or the float product has no error to trip on
        hits = int(hits)
        text = "x" * (n - hits - 1) + " " + "e" * (hits - 12) + "@example.com"
        on = Doc(None, text=text)
        assert len(text) == n and PiiGate(limit).check(on) is None, (limit, n)
        assert PiiGate(limit).check(Doc(None, text="x" * (n - hits - 2) + " " + "e" * (hits - 11) + "@example.com"))
        tokens = " ".join(["word"] * (n - hits) + ["shit"] * hits)
        assert ProfanityGate(limit).check(Doc(None, text=tokens)) is None, (limit, n)
        past = " ".join(["word"] * (n - hits - 1) + ["shit"] * (hits + 1))
        assert ProfanityGate(limit).check(Doc(None, text=past)).endswith(f" > {limit} ({hits + 1} of {n} tokens)")
        return
    pytest.fail(f"no length below 4 000 puts {limit} on a product that rounds low")


def test_cld2_percents_of_one_language_add_up_before_dividing() -> None:
    """zh-Hant 72 % + zh 18 % summed as fractions is 0.8999999999999999, and a text 90 % Chinese was rejected at the
    default min_language_prob 0.9 ("p=0.8999999999999999 < 0.9")."""
    import pycld2

    from quality.language import Cld2Detector

    hans = "我们今天去公园散步，天气很好，孩子们在草地上玩耍，老人们在树下下棋聊天。这个城市的图书馆延长了开放时间，居民们非常高兴。"
    hant = "我們今天去公園散步，天氣很好，孩子們在草地上玩耍，老人們在樹下下棋聊天。這個城市的圖書館延長了開放時間，居民們非常高興。"
    text = hans + " The city council voted to expand the public library hours after residents asked. " + hant * 4 + " ok" * 3
    assert [(c, p) for _, c, p, _ in pycld2.detect(text, True)[2] if c != "un"] == [("zh-Hant", 72), ("zh", 18), ("en", 8)]
    assert Cld2Detector().detect(text).probs["zh"] == 0.9
    verdict = QualityControl({"expected_language": "zh", "min_chars": 0}).evaluate({"text": text})
    assert verdict.keep and verdict.meta["language_prob"] == 0.9


def test_emails_are_the_whole_text_regex_matches_and_cost_little_on_text_dense_in_at_signs() -> None:
    """Each "@" searched EMAIL_RE over its whole reach: ~12 µs a char of "a@a@…" (a record of the default max_chars
    cost ~23 CPU-s), and an address through a later "@" could be cut at an earlier one's reach (found, or found
    shorter, where the regex over the whole text finds it otherwise). Now each "@" is tried from the one start an
    address through it can have."""
    import random
    import time

    from quality.gates.pii import EMAIL_RE, _emails

    rng = random.Random(2)
    for _ in range(3000):
        parts = []
        for _ in range(rng.randint(1, 8)):
            local = "".join(rng.choice("ab.+-_é中ก") for _ in range(rng.choice([1, 5, 63, 64, 65, 70])))
            domain = ".".join("".join(rng.choice("abc-") for _ in range(rng.choice([1, 10, 63, 64])))
                              for _ in range(rng.randint(1, 6)))
            parts.append(local + rng.choice(["@", "@@", " @"]) + domain + rng.choice([".com", ".c", ".org-", ""])
                         + rng.choice([" ", "", ".", "@"]))
        text = "".join(parts)
        assert list(_emails(text)) == [("email", m.start(), m.end()) for m in EMAIL_RE.finditer(text)], text
    long_domain = "mail a@" + ".".join(["b" * 60] * 8) + ".com and more"  # past the 320 chars the windows reached
    assert list(_emails(long_domain)) == [("email", 5, 5 + 2 + 8 * 61 + 3)]
    dense = "Some words. " + "a@" * 100_000
    t0 = time.process_time()
    assert list(_emails(dense)) == []
    assert time.process_time() - t0 < 0.5  # ~0.05 s now; 2.4 s before


def test_pii_reject_through_control() -> None:
    v = QualityControl({**OPEN, "pii_max_density": 0.01}).evaluate({"text": "Call 555-123-4567 now."})
    assert not v.keep and v.meta["failed_check"] == "pii" and v.meta["reason"] == "pii density 0.5455 > 0.01 (phone 1)"


# ---- profanity -------------------------------------------------------------------------------------
@pytest.mark.parametrize("token", ["fuck", "f*ck", "f**k", "fu*k", "sh1t", "sh!t", "$h!t", "a$$", "@$$h0le",
                                   "b!tch", "b1tch", "sh*t", "f#ck", "fuck!", "motherf*cker", "5hit", "a55hole", "5h17",
                                   "a5$", "4ss", "sh1ts", "5h17s"])
def test_profanity_obfuscations(token: str) -> None:
    assert ProfanityGate(0.01).is_profane(token)


@pytest.mark.parametrize("token", ["assess", "class", "scunthorpe", "hello", "2019", "mp3", "***", "a*", "!", "hell",
                                   "a55", "a55!", "sh17", "p155", "a5535", "sh17s", "p15s", "a55s!"])
def test_profanity_innocent(token: str) -> None:
    assert not ProfanityGate(0.01).is_profane(token)


def test_is_profane_equals_the_plain_lookup() -> None:
    """The length and letters-only shortcuts of `is_profane` decide as the two leetspeak lookups do."""
    import re

    from quality.gates.profanity import _LEET

    gate = ProfanityGate(0.01)

    def plain(token: str) -> bool:
        if token in gate.words:
            return True
        if token.isalpha() or token.isdigit():
            return False
        token = token.strip("!|")
        if re.fullmatch(r"[^\W\d_]+[0-9]+s?", token):  # letters then digits, or their plural: a model or road name
            return False
        return any(t in gate.words or ("*" in t and t in gate.masked) for t in (token.translate(x) for x in _LEET))

    rng = random.Random(5)
    chars = "abcfhiklnorstu013457@$*#!|2_\u00e9"
    tokens = [*gate.words, *gate.masked, "!", "|", "!!fuck||", "f\u00fcck", "\u00e9", "sh1t!", "a$$", "mp3", "14th",
              "a55", "!a55|", "a55hole", "\u00e9a55", "sh17", "p155", "5h17", "sh17s", "a55s", "5h17s", "sh1ts"]
    tokens += ["".join(rng.choice(chars) for _ in range(rng.randint(1, 16))) for _ in range(20_000)]
    leet = {"a": "4@", "e": "3", "i": "1!|", "l": "1|", "o": "0", "s": "5$", "t": "7", "u": "*#"}
    tokens += ["".join(rng.choice(leet.get(c, "") + c) for c in w) for w in gate.words for _ in range(5)]
    tokens += [rng.choice("!|") + t + rng.choice(["", "!", "|!"]) for t in list(gate.words)[:40]]
    assert [gate.is_profane(t) for t in tokens] == [plain(t) for t in tokens]
    assert sum(map(gate.is_profane, tokens)) > 200


def test_a_model_name_of_letters_then_digits_is_no_leetspeak() -> None:
    """"Cortex-A55" (and Galaxy A55, the A55 road) was "ass" in leetspeak: one such name in a 34-token record rejected
    it at the default limit. A token of letters then digits is a name or code; leetspeak inside a word still counts."""
    text = ("The phone uses an octa-core layout: two Cortex-A78 cores and six Cortex-A55 cores, clocked at 2.4 GHz, "
            "with a Mali GPU and 8 GB of memory for apps and games.")
    v = QualityControl({**OPEN, "profanity_max_density": 0.01}).evaluate({"text": text})
    assert v.keep and v.meta["profanity_density"] == 0.0
    gate, leet = ProfanityGate(0.01), text.replace("A55", "a55hole")
    # the shared scan (0 tokens reported for a text without hits) and the token list agree
    assert gate.density_by_scan(Doc(None, text=text)) == (0, 0) and gate.density_by_tokens(Doc(None, text=text)) == (0, 34)
    assert gate.density_by_scan(Doc(None, text=leet)) == gate.density_by_tokens(Doc(None, text=leet)) == (1, 34)
    assert gate.check(Doc(None, text=leet)) == "profanity density 0.0294 > 0.01 (1 of 34 tokens)"


@pytest.mark.parametrize("text, hits", [
    ("Trials gave participant information sheets (PISs) and consent forms; PISs were read aloud.", 0),
    ("Routing between autonomous systems (ASs) and across ASs of one provider.", 0),
    # the word itself, in any case, and a capital stem without the plural "s" still count
    ("what a PISS take, piss off", 2), ("Piss off and Pisses", 2), ("the ASS and PIS", 1),
])
def test_acronym_plurals_are_not_the_listed_words(text: str, hits: int) -> None:
    """"(PISs)", participant information sheets, lower-cased to "piss": two of them in a 143-token PubMed abstract
    rejected it (0.014 > 0.01). Capitals then a lower-case "s" are an acronym's plural, not a listed word."""
    gate, doc, tokens = ProfanityGate(0.5), Doc(None, text=text), len(text.split())
    assert gate.check(doc) is None and doc.meta["profanity_density"] == round(hits / tokens, 4)
    assert gate.density_by_tokens(Doc(None, text=text))[0] == hits
    assert gate.density_by_scan(Doc(None, text=text)) == ((hits, tokens) if hits else (0, 0))


@pytest.mark.parametrize("text, hits", [
    ("Shut up you stupid CUNTs, nobody asked for your opinion on this forum anyway so just leave.", 1),
    ("Those KIKEs and NIGGERs should go back where they came from, said the post, shared online.", 2),
    ("I am sick of these MOTHERFUCKERs at work, every single day they push me around here.", 1),
    ("ASSHOLEs and SHITs and FUCKs and TWATs and WANKERs and SLUTs and WHOREs all of them", 7),
])
def test_a_listed_word_in_capitals_then_s_still_counts(text: str, hits: int) -> None:
    """The acronym-plural exemption took every listed word ending in "s": CUNTs, NIGGERs, MOTHERFUCKERs (a
    13-letter stem is no acronym) went uncounted. Only a 2-3 letter stem (PISs, ASs) is an acronym's plural."""
    gate, doc, tokens = ProfanityGate(0.01), Doc(None, text=text), len(text.split())
    assert gate.check(doc) == f"profanity density {round(hits / tokens, 4)} > 0.01 ({hits} of {tokens} tokens)"
    assert gate.density_by_tokens(Doc(None, text=text)) == gate.density_by_scan(Doc(None, text=text)) == (hits, tokens)


def test_a_model_name_s_plural_is_no_leetspeak() -> None:
    """"SH17" was exempt as a model name but "two SH17s" was "shits" in leetspeak: the plural of a name of letters
    then digits is a name too."""
    text = "The fleet runs two SH17s and three P15s on the coastal route this summer, with more planned next year."
    gate, doc = ProfanityGate(0.01), Doc(None, text=text)
    assert gate.check(doc) is None and doc.meta["profanity_density"] == 0.0
    assert not gate.is_profane("sh17s") and gate.is_profane("sh1ts")


def test_profanity_density() -> None:
    gate = ProfanityGate(0.01)
    words = ["word"] * 198
    one = Doc(None, text=" ".join(words + ["F*CK", "ok"]))  # 1 / 200 = 0.005
    assert gate.check(one) is None and one.meta["profanity_density"] == 0.005
    three = Doc(None, text=" ".join(words[:97] + ["sh1t!", "what", "a$$"]))  # 2 / 100
    assert gate.check(three) == "profanity density 0.02 > 0.01 (2 of 100 tokens)"


LATIN1_CASES = ["Caf\u00e9 FUCK \u00e9sh1t \u00bd f*ck\u00c9 \u00dfa$$ \u00b5\u00aa \u00a9 (C) 2019", "\u2026fuck\u2022shit\u20ac\u2122\u200b",
                "\u00c0\u00de\u00d7\u00f7\u00ff \u00a0all\u00a0rights\u0085reserved", "Stra\u00dfe b!tch \u2026 \u0130 fuck",
                "\u212a fuck \u2026", "\u00b2\u00b3\u00b9\u00bc x\u00b2 sh\u00b9t", "shit\u2019s",
                "FUCK Sh1T A$$ |SHIT| F*CK MP3 \u00c9FUCK FUCK\u00c9 COPYRIGHT (C) 2019 ALL RIGHTS RESERVED &COPY;"]


@pytest.mark.parametrize("text", LATIN1_CASES + [chr(b) * 3 + " a" + chr(b) + "ss " for b in range(0x80, 0x100)])
def test_latin1_scan_equals_the_handler_scan(text: str) -> None:
    """The Latin-1 path's bytes are those of `doc.lower` through the codec error handler, so its matches and
    counts are too; and both equal the token list's."""
    from quality.gates.lexicon import LATIN1_RAW, _matches, scan
    from quality.normalize import latin1_view

    gate = ProfanityGate(0.01)
    found = scan(Doc(None, text=text), gate.sorted_words)
    lower = text.lower()
    hits, tokens = gate.density_by_tokens(Doc(None, text=text))
    fast = gate.density_by_scan(Doc(None, text=text))
    assert fast == (hits, tokens) or fast == (0, 0) and hits == 0
    if latin1_view(text) is None:
        assert found is None or found.cues is None  # not Latin-1: the handler path
        return
    raw = lower.encode("ascii", "streamprep.token_class")
    assert found is not None and found.cues is not None
    assert found.data.translate(LATIN1_RAW) == raw
    assert _matches(found.data, gate.sorted_words) == _matches(raw, gate.sorted_words)  # the view as the bytes


# ---- copyright -------------------------------------------------------------------------------------
@pytest.mark.parametrize("notice", ["Copyright 2021 Acme Inc.", "\u00a9 Acme", "(C) 2019 Acme", "(c)2005 Foo",
                                    "ALL RIGHTS  RESERVED.", "&copy; Foo"])
def test_copyright_rejects(notice: str) -> None:
    v = QualityControl({**OPEN, "reject_copyright": True}).evaluate({"text": PROSE + notice})
    assert not v.keep and v.meta["failed_check"] == "copyright"
    assert v.meta["reason"].startswith("copyright notice ") and f"at char {len(PROSE.strip()) + 1}" in v.meta["reason"]


@pytest.mark.parametrize("text", LATIN1_CASES + [
    "rights rights rights", "all\t\n rights reserved", "ALL  RIGHTS  RESERVED", "all rights", "ball rights reserved",
    "rights then Copyright", "(c) later (C) 2019 and copyright", "(c)\u00a02020", "&COPY; x", "(c)19", "rights\u00a9",
    "x" * 300 + " all\u0085\u00a0rights reserved", "rights", "  rights reserved", "al rights reserved",
    "r\u0131ghts then all r\u0131ghts reserved, rights", "COPYR\u0130GHT rights", "\u017fights all rights reserved",
    "\u212a copyright", "all\x1crights reserved", "\u00e9 all rights reserved \u00a9", "\u2026all\u2026rights reserved"])
def test_copyright_at_cues_equals_the_plain_search(text: str) -> None:
    """The notice regex tried only where the scan saw a cue finds what one search of the whole text finds,
    whenever the plain cue test lets the regex run (Unicode case folds and whitespace included)."""
    from quality.gates.copyright import _CUES, _NOTICE, CopyrightGate

    for t in (text, text.upper(), PROSE + text):
        m = _NOTICE.search(t) if any(cue in t.lower() for cue in _CUES) else None
        expected = None if m is None else f"copyright notice {m.group()[:40]!r} at char {m.start()}"
        assert CopyrightGate().check(Doc(None, text=t)) == expected, t


def test_copyright_keeps_lookalikes_and_can_be_off() -> None:
    qc = QualityControl({**OPEN, "reject_copyright": True})
    assert qc.evaluate({"text": PROSE + "Options: (a) red, (b) green, (c) blue. Rights of way apply."}).keep
    assert open_qc().evaluate({"text": PROSE + "Copyright 2021 Acme."}).keep


# ---- schema, metadata and bad input ---------------------------------------------------------------------
BAD_INPUTS = [
    (None, "schema: record is None, not a mapping"),
    (b'{"text": "x"}', "schema: record is bytes, not a mapping"),
    (42, "schema: record is int, not a mapping"),
    (["text", "x"], "schema: record is list, not a mapping"),
    ({"body": "x"}, "schema: no 'text' field"),
    ({"text": b"bytes"}, "schema: text is bytes"),
    ({"text": 7}, "schema: text is int"),
    ({"text": None}, "schema: text is None"),
    ({"text": ""}, "schema: text is empty after normalisation"),
    ({"text": " \n\t\x00 "}, "schema: text is empty after normalisation"),
    # regression: line/paragraph separators and zero-width or format characters alone were kept as a document
    ({"text": "\u2028" * 120}, "schema: text is empty after normalisation"),
    ({"text": " \u2028\n\u2029\t \u2028 " * 40}, "schema: text is empty after normalisation"),
    ({"text": "\u200b\u200c\u2060\u180e\u00ad\ufeff" * 20}, "schema: text is empty after normalisation"),
    # regression: tags, interlinear annotation marks, Hangul fillers, the braille blank were kept as a document
    ({"text": "\U000e0041" * 150}, "schema: text is empty after normalisation"),
    ({"text": "\ufff9\ufffa\ufffb\u3164\u2800\uffa0\U0001d173 " * 30}, "schema: text is empty after normalisation"),
    ({"text": "a" * 3_000_000}, "schema: 3000000 chars > max_chars 2000000"),
    ({"text": PROSE + "\ud83d"}, f"schema: text has an unpaired surrogate at char {len(PROSE)}"),
]


@pytest.mark.parametrize("domain", ["general", "code"])
@pytest.mark.parametrize("text, at", [("\u2019tis \ud800", 5), ("\u201cq\u201d \u2026 \udfff x", 6), ("\u4e2d\U0001f642\ud83d", 2),
                                      ("caf\u00e9 \udc00", 5), ("\ud800", 0), ("\u2019" * 70 + "\ud800\u2019", 70),
                                      ("\u0105\u2014\udbff\u0301", 2)])
def test_a_lone_surrogate_is_found_beside_every_kind_of_text(text: str, at: int, domain: str) -> None:
    """The schema gate looks for a lone surrogate only in a text without a Latin-1 view (of its start of
    normalisation), which every text holding one is: the reject names the char, whatever is around it;
    and the normalise step's result is the same from the gate's start as from its own."""
    from quality.normalize import normalize_with_view, prepare

    v = QualityControl({**OPEN, "domain": domain}).evaluate({"text": text})
    assert (v.keep, v.meta["failed_check"]) == (False, "schema")
    assert v.meta["reason"] == f"schema: text has an unpaired surrogate at char {at}"
    for clean in (text.replace(text[at], "\u00e9"), text.replace(text[at], "\u4e2d")):
        for code in (False, True):
            assert normalize_with_view(clean, code, prepare(clean, code)) == normalize_with_view(clean, code)


def test_only_invisible_characters_count_as_blank() -> None:
    """Every char the emptiness check strips is white space, a format character (Cf) or a blank-looking letter,
    never a prepended concatenation mark (U+0600: a visible sign); and every Cf char of this Unicode is in it."""
    import sys
    import unicodedata

    from quality.gates.schema import _BLANK

    shown_signs = {*range(0x600, 0x606), 0x6DD, 0x70F, 0x890, 0x891, 0x8E2, 0x110BD, 0x110CD}
    fillers = {0x115F, 0x1160, 0x3164, 0xFFA0, 0x2800}
    blank = set(map(ord, _BLANK))
    assert all(unicodedata.category(chr(c)) in ("Cf", "Zs", "Zl", "Zp") or chr(c).isspace() or c in fillers
               for c in blank)
    assert not blank & shown_signs
    if unicodedata.unidata_version == "14.0.0":  # Python 3.11's; a later Unicode may add format characters
        assert {c for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Cf"} - shown_signs <= blank


@pytest.mark.parametrize("record, reason", BAD_INPUTS)
def test_bad_input_is_a_clean_reject(record, reason: str) -> None:
    qc = QualityControl()
    v = qc.evaluate(record)
    assert isinstance(v, Verdict) and v.keep is False and v.text is None
    assert v.meta["failed_check"] == "schema" and v.meta["reason"] == reason
    keep, meta = qc.clean_record(record)
    assert keep is False and meta["failed_check"] == "schema"
    json.dumps(meta)


def test_no_usable_text_means_no_digest() -> None:
    qc = QualityControl()
    assert qc.evaluate({"text": b"x"}).digest is None
    short = qc.evaluate({"text": "short text"})
    assert short.meta["reason"] == "schema: 10 chars < min_chars 100"
    assert short.digest == hashlib.sha256(b"short text").digest()  # usable, just too short


def test_required_fields_and_metadata() -> None:
    qc = QualityControl({**OPEN, "required_fields": ["text", "url"], "required_metadata": ["source"],
                         "allowed_licenses": ["CC-BY-4.0", "MIT"]})
    reasons = [qc.evaluate(r).meta.get("reason") for r in [
        {"text": PROSE},
        {"text": PROSE, "url": "u"},
        {"text": PROSE, "url": "u", "metadata": {"source": "s"}},
        {"text": PROSE, "url": "u", "meta": {"source": "s", "license": "GPL-3.0"}},
        {"text": PROSE, "url": "u", "source": "s", "licence": " cc-by-4.0 "},
    ]]
    assert reasons == ["schema: required field 'url' missing", "metadata: missing 'source'", "metadata: no license",
                       "metadata: license 'GPL-3.0' not in allowed_licenses", None]


def test_text_field_and_length_bounds() -> None:
    qc = QualityControl({**OPEN, "min_chars": 5, "max_chars": 10}, text_field="body")
    assert qc.evaluate({"body": "  abcd  "}).meta["reason"] == "schema: 4 chars < min_chars 5"
    assert qc.evaluate({"body": "abcdefghijk"}).meta["reason"] == "schema: 11 chars > max_chars 10"
    assert qc.evaluate({"body": "abcde", "text": 1}).keep


# ---- config -------------------------------------------------------------------------------------------
def test_config_defaults_and_idempotence() -> None:
    cfg = validate_quality_config(None)
    assert cfg == QUALITY_DEFAULTS and cfg is not QUALITY_DEFAULTS
    assert validate_quality_config(cfg) == cfg
    assert validate_quality_config({"expected_language": "zh-CN"})["expected_language"] == "zh"


@pytest.mark.parametrize("section, key", [
    ({"pii_max_densty": 0.1}, "pii_max_densty"),
    ({"pii_max_density": "0.01"}, "pii_max_density"),
    ({"pii_max_density": 1.5}, "pii_max_density"),
    ({"min_chars": True}, "min_chars"),
    ({"min_chars": -1}, "min_chars"),
    ({"max_chars": 10, "min_chars": 20}, "max_chars"),
    ({"min_chars": 3_000_000}, "min_chars"),  # regression: blamed max_chars, a key not written (its default)
    ({"domain": "legal"}, "domain"),
    ({"language_detector": "fasttext"}, "language_detector"),
    ({"dedup": "fuzzy"}, "dedup"),
    ({"dedup_scope": "global"}, "dedup_scope"),
    ({"normalize": "yes"}, "normalize"),
    ({"required_fields": "text"}, "required_fields"),
    ({"allowed_licenses": [1]}, "allowed_licenses"),
    ({"expected_language": 5}, "expected_language"),
    # regression: each of these rejected every record, exit 0
    ({"expected_language": "english"}, "expected_language"), ({"expected_language": "xx"}, "expected_language"),
    ({"expected_language": "eu", "language_detector": "langdetect"}, "expected_language"),
    ({"allowed_licenses": ["  "]}, "allowed_licenses"), ({"required_fields": [" "]}, "required_fields"),
    ({"required_metadata": ["   "]}, "required_metadata"),
    ({"allowed_licenses": []}, "allowed_licenses"), ({"allowed_licenses": ()}, "allowed_licenses"),
    ([1, 2], "quality"),
])
def test_config_errors_name_the_key(section, key: str) -> None:
    with pytest.raises(QualityConfigError) as info:
        validate_quality_config(section)
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}: ") and "\n" not in str(info.value)
    with pytest.raises(QualityConfigError):
        QualityControl(section)



def test_a_boolean_where_text_is_due_says_to_quote_it() -> None:
    """Regression: `expected_language: no` (Norwegian) said "got False", a value the config never wrote: YAML 1.1 reads
    an unquoted no/off/yes/on as a boolean. The error says so and to quote it; quoted, it is Norwegian."""
    hint = "(YAML reads an unquoted yes/no/on/off as a boolean: quote it)"
    for section, key in [({"expected_language": False}, "expected_language"), ({"dedup": False}, "dedup"),
                         ({"allowed_licenses": ["MIT", True]}, "allowed_licenses")]:
        with pytest.raises(QualityConfigError) as info:
            validate_quality_config(section)
        assert info.value.key == key and str(info.value).endswith(f", got {section[key]!r} {hint}"), str(info.value)
    assert validate_quality_config({"expected_language": "no"})["expected_language"] == "no"
    with pytest.raises(QualityConfigError, match=r"got 5$"):  # no hint where no boolean was read
        validate_quality_config({"expected_language": 5})


def test_an_empty_allowed_licenses_is_refused() -> None:
    """Regression: `allowed_licenses: []` rejected every record ("license 'X' not in allowed_licenses"), exit 0."""
    with pytest.raises(QualityConfigError) as info:
        validate_quality_config({"allowed_licenses": []})
    assert str(info.value) == ("allowed_licenses: must be a non-empty list or null (an empty list rejects every "
                               "record), got []")
    assert validate_quality_config({"allowed_licenses": None})["allowed_licenses"] is None
    assert validate_quality_config({"allowed_licenses": ["MIT"]})["allowed_licenses"] == ["MIT"]


def test_a_min_chars_over_the_default_max_chars_names_min_chars() -> None:
    """Regression: `quality: {min_chars: 3000000}` said "'max_chars': must be >= min_chars (3000000), got 2000000",
    blaming a key the config never wrote."""
    with pytest.raises(QualityConfigError) as info:
        validate_quality_config({"min_chars": 3_000_000})
    assert str(info.value) == "min_chars: must be <= max_chars (2000000, its default), got 3000000; raise max_chars too"
    assert validate_quality_config({"min_chars": 3_000_000, "max_chars": 3_000_000})["min_chars"] == 3_000_000


# Every key set to a non-default value; ints where floats are expected (they must come back as floats).
FULL = {"domain": "medical", "expected_language": "pt-BR", "min_language_prob": 1, "language_detector": "cascade",
        "language_sample_chars": 800, "min_chars": 50, "max_chars": 100_000, "required_fields": ("text", "id"),
        "required_metadata": ["source"], "allowed_licenses": ["cc-by", "MIT"], "pii_max_density": 0,
        "profanity_max_density": 0.02, "reject_copyright": False, "dedup": "none", "dedup_scope": "run",
        "normalize": False, "domain_sample_chars": 3000, "medical_min_hits": 5, "medical_min_density": 0.03,
        "medical_min_categories": 1, "code_min_score": 0.5,
        "near_dedup": {"seed": 9, "num_perm": 40, "rows": 4, "bands": 10, "ngram": 3, "threshold": 1, "enabled": True}}


@pytest.mark.parametrize("section", [None, {}, OPEN, {"required_metadata": [], "expected_language": None}, FULL],
                         ids=["none", "empty", "open", "empty-lists", "full"])
def test_settings_round_trip_is_exact(section) -> None:
    """to_dict gives back validate_quality_config's dict byte for byte (it is hashed into run.json)."""
    validated = validate_quality_config(section)
    settings = QualitySettings.from_dict(validated)
    assert settings == load_quality_settings(section)
    assert settings.to_dict() == validated
    assert orjson.dumps(settings.to_dict()) == orjson.dumps(validated)
    assert pickle.loads(pickle.dumps(settings)) == settings
    assert QualitySettings.from_dict(settings.to_dict()) == settings


def test_settings_are_typed_and_frozen() -> None:
    s = load_quality_settings(FULL)
    assert s.required_fields == ("text", "id") and s.required_metadata == ("source",)
    assert s.allowed_licenses == ("cc-by", "MIT") and s.expected_language == "pt"
    assert s.min_language_prob == 1.0 and type(s.min_language_prob) is float and type(s.pii_max_density) is float
    assert s.near_dedup == NearDedupSettings(enabled=True, threshold=1.0, ngram=3, bands=10, rows=4, seed=9,
                                             num_perm=40)
    assert list(s.to_dict()) == list(QUALITY_DEFAULTS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.min_chars = 0  # type: ignore[misc]
    with pytest.raises(QualityConfigError, match="^near_dedup.num_perm: "):
        load_quality_settings({"near_dedup": {"bands": 2, "rows": 2, "num_perm": 5}})


# ---- dedup ----------------------------------------------------------------------------------------------
def test_dedup_index_round_trip(tmp_path: Path) -> None:
    digests = [hashlib.sha256(str(i).encode()).digest() for i in range(5)]
    log = tmp_path / "d.dedup"
    index = DedupIndex(log, buffer=2)  # spills to the sorted runs every 2 digests
    for d in digests + digests[:2]:
        index.add(d)
    index.flush()
    assert len(index) == 5 and digests[3] in index and b"\0" * 32 not in index
    assert log.read_bytes() == b"".join(digests)
    again = DedupIndex(log)
    assert len(again) == 5 and all(d in again for d in digests)
    assert len(DedupIndex(log, count=3)) == 3 and log.stat().st_size == 96  # a longer log is cut to the count
    with pytest.raises(ValueError):
        index.add(b"short")
    log.write_bytes(b"".join(digests)[:-1])
    with pytest.raises(ValueError):
        DedupIndex(log)


@pytest.mark.parametrize("buffer", [1, 3, 1000])
def test_dedup_prefix_collision_never_drops_a_unique_record(tmp_path: Path, buffer: int) -> None:
    """Digests sharing their first 8 bytes: only the full digest (read back from the log) decides."""
    same = [b"\x07" * 8 + hashlib.sha256(str(i).encode()).digest()[:24] for i in range(6)]
    index = DedupIndex(tmp_path / "d.dedup", buffer=buffer)
    for d in same[:3]:
        index.add(d)
    assert [d in index for d in same] == [True] * 3 + [False] * 3
    for d in same:
        index.add(d)
    assert len(index) == 6
    index.flush()
    reloaded = DedupIndex(tmp_path / "d.dedup")
    assert all(d in reloaded for d in same) and same[0][:31] + b"\0" not in reloaded


def test_dedup_index_matches_a_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Many spills and mid->base merges: membership equals a plain set's, before and after a reload (read
    from the log in several chunks)."""
    monkeypatch.setattr("quality.dedup._LOAD_CHUNK", 100)
    rng = random.Random(7)
    pool = [rng.randbytes(32) for _ in range(3000)]
    index, seen = DedupIndex(tmp_path / "d.dedup", buffer=16), set()
    for d in (rng.choice(pool) for _ in range(5000)):
        assert (d in index) == (d in seen)
        index.add(d)
        seen.add(d)
    index.flush()
    assert len(index) == len(seen) == len(DedupIndex(tmp_path / "d.dedup"))
    reloaded = DedupIndex(tmp_path / "d.dedup")
    assert all((d in reloaded) == (d in seen) for d in pool)


def test_dedup_index_matches_a_set_through_merges_and_filter_rebuilds(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches (`add_many`) and single adds mixed, with a tiny prefix filter remade larger several times and the
    runs merged tier by tier: membership, one by one and at once, equals a plain set's; so does a reload."""
    monkeypatch.setattr("quality.dedup._FILTER_MIN_BITS", 8)
    rng = random.Random(11)
    pool = [rng.randbytes(32) for _ in range(4000)]
    pool += [pool[i][:8] + rng.randbytes(24) for i in range(0, 400, 4)]  # 64-bit prefix collisions
    index, seen = DedupIndex(tmp_path / "d.dedup", buffer=16), set()
    for step in range(60):
        batch = list(dict.fromkeys(d for d in rng.sample(pool, 90) if d not in seen))
        if step % 3:  # every other batch with the order that sorts its prefixes and them, as DedupDecision passes it
            words = digest_words(batch)
            order = np.argsort(words[:, 0])
            index.add_many(words, *((order, words[order, 0]) if step % 3 == 2 else ()))
        else:
            for d in batch:
                index.add_new(d)
        seen.update(batch)
        probe = rng.sample(pool, 200)
        expected = [d in seen for d in probe]
        assert index.contains_many(digest_words(probe)).tolist() == expected == [d in index for d in probe]
    assert len(index._runs) < 60 and index._filter.room > 1 << (8 - 3)  # merged, and the filter was remade
    index.flush()
    reloaded = DedupIndex(tmp_path / "d.dedup")
    assert len(reloaded) == len(seen) and all((d in reloaded) == (d in seen) for d in pool)


def test_prefix_filter_sets_the_bits_of_keys_sharing_a_word() -> None:
    """The filter's buffered `|=` keeps one key's bits per word; the keys sharing a word (many, in a small
    filter) are set again unbuffered. Sorted or not, its words equal `bitwise_or.at` over every key's bits."""
    from quality.dedup import _PrefixFilter

    keys = np.frombuffer(random.Random(5).randbytes(8 * 50_000), np.uint64)
    for run in (np.sort(keys), keys):
        built = _PrefixFilter([(run, np.arange(len(run), dtype=np.uint32))], 1)  # 2^14 words: ~3 keys a word
        expected = np.zeros_like(built._words)
        np.bitwise_or.at(expected, *built._slots(run))
        assert (built._words == expected).all() and built.maybe(run).all()


def test_merged_runs_are_sorted_with_their_ordinals() -> None:
    from quality.dedup import _merge_runs

    rng = np.random.default_rng(2)
    runs = [(np.sort(rng.integers(0, 1 << 20, size, dtype=np.uint64)), rng.permutation(size).astype(np.uint32))
            for size in (5, 300, 300, 1, 7000)]  # small keys: equal ones across runs
    pairs = sorted((int(k), int(o)) for keys, ords in runs for k, o in zip(keys, ords))
    keys, ords = _merge_runs(list(runs))
    assert (np.diff(keys.astype(np.int64)) >= 0).all()
    assert sorted(zip(keys.tolist(), ords.tolist())) == pairs


def test_dedup_index_stays_within_16_bytes_a_document(tmp_path: Path) -> None:
    """Issue 28: exact-dedup memory <= 16 B a kept document. A million random digests added in pieces of 20 000,
    then reloaded from the log: what stays allocated (runs, filter) is measured by tracemalloc."""
    import tracemalloc

    n, piece = 1_000_000, 20_000
    words = np.frombuffer(random.Random(3).randbytes(32 * n), np.uint64).reshape(n, 4)
    tracemalloc.start()
    try:
        index = DedupIndex(tmp_path / "d.dedup")
        for start in range(0, n, piece):
            index.add_many(words[start:start + piece])
        grown = tracemalloc.get_traced_memory()[0]
        index.flush()
        del index
        base = tracemalloc.get_traced_memory()[0]
        reloaded = DedupIndex(tmp_path / "d.dedup")
        loaded = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert grown / n <= 16 and loaded / n <= 16, (grown / n, loaded / n)
    assert len(reloaded) == n and reloaded.contains_many(words[::997]).all()


def test_clean_record_dedup_semantics() -> None:
    index = DedupIndex()
    qc = QualityControl({**OPEN, "required_metadata": ["source"]}, dedup=index)
    first = {"text": "  Hello \u201cworld\u201d  ", "source": "a"}
    assert qc.clean_record(first) == (True, {"domain": "general", "chars": 13,
                                             "sha256": hashlib.sha256(b'Hello "world"').hexdigest()})
    assert first["text"] == 'Hello "world"'  # normalised text written back
    assert len(index) == 1
    # the same normalised text again is a duplicate, even though it would fail the metadata gate
    keep, meta = qc.clean_record({"text": 'Hello "world"'})
    assert not keep and meta["failed_check"] == "duplicate" and meta["reason"] == "exact duplicate of a kept record"
    # a rejected record never enters the index, so its twin is judged on its own
    assert qc.clean_record({"text": "other"})[1]["failed_check"] == "metadata"
    assert qc.clean_record({"text": "other", "source": "b"})[0]
    assert len(index) == 2
    stats = qc.stats
    assert stats["records"] == {"seen": 4, "kept": 2, "rejected": 2}
    assert stats["rejected_by_check"] == {"duplicate": 1, "metadata": 1}
    # per gate: what each gate decided (the duplicate also failed metadata, since evaluate runs first);
    # rejected_by_check: the final outcome, where dedup takes precedence
    assert {k: v["rejected"] for k, v in stats["gates"].items()} == {
        "duplicate": 1, "schema": 0, "normalize": 0, "length": 0, "metadata": 2}
    assert all(v["seconds"] >= 0 for v in stats["gates"].values())


def test_dedup_none_keeps_duplicates() -> None:
    qc = open_qc(dedup="none")
    assert qc.clean_record({"text": "same"})[0] and qc.clean_record({"text": "same"})[0]
    assert len(qc.dedup) == 0 and "duplicate" not in qc.stats["gates"]


# ---- language and code helpers ----------------------------------------------------------------------------
def test_language_helpers() -> None:
    codes = ["zh-cn", "zh-Hant", "iw", "nb", "EN", "pt_BR"]
    assert [normalize_code(c) for c in codes] == ["zh", "zh", "he", "no", "en", "pt"]
    assert bounded_sample("alpha beta gamma", 12) == "alpha beta"
    assert bounded_sample("alpha beta", 12) == "alpha beta"
    assert bounded_sample("x" * 30, 12) == "x" * 12


@pytest.mark.parametrize("detector", ["cld2", "langdetect", "cascade"])
def test_language_gate_outcomes(detector: str) -> None:
    qc = QualityControl({**OPEN, "expected_language": "en", "language_detector": detector})
    en = qc.evaluate({"text": PROSE * 3})
    assert en.keep and en.meta["language"] == "en" and en.meta["language_prob"] >= 0.9
    de = qc.evaluate({"text": "Der Ausschuss trat am Dienstag zusammen, um den Jahreshaushalt zu prüfen, und "
                              "beschloss, den neuen Bibliotheksflügel und zwei zusätzliche Buslinien zu finanzieren."})
    assert not de.keep and de.meta["failed_check"] == "language" and de.meta["language"] == "de"
    for junk in ["12345 67890 ---- 555", "\u2603\u2603\u2603", "x"]:
        v = qc.evaluate({"text": junk})
        assert not v.keep and v.meta["failed_check"] == "language" and v.meta["reason"]


def test_code_score_early_exit() -> None:
    score, parts = code_score("Plain prose with no structure at all\nand a second line", 0.43)
    assert score == 0.25 and "keywords" not in parts
    v = QualityControl({**OPEN, "domain": "code"}).evaluate({"text": "Plain prose, nothing else to see here."})
    assert v.meta["reason"] == "code score <= 0.25 < 0.43 (indentation 0, punctuation 0)"


# ---- determinism and meta ------------------------------------------------------------------------------------
def test_same_input_same_verdict_and_json_meta() -> None:
    records = [{"text": PROSE * 2}, {"text": "Das ist ein kurzer deutscher Satz über das Wetter. " * 3}, None,
               {"text": "mail jane@example.com " + PROSE}]
    a = [QualityControl().evaluate(r) for r in records]
    b = [QualityControl().evaluate(r) for r in records]
    assert a == b
    for v in a:
        assert json.loads(json.dumps(v.meta)) == v.meta


def test_remembered_candidate_tokens_give_the_tables_answer_and_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate remembers the lookup of each obfuscation candidate (`1st`, `sh1t`, `f*ck`): the same counts as the
    token list's on every text, in any order, with at most MEMO_TOKENS remembered."""
    from quality.gates import profanity

    monkeypatch.setattr(profanity, "MEMO_TOKENS", 3)
    gate = ProfanityGate(0.5)
    texts = ["sh1t happens 1st", "f*ck mp3 4x4 you!", "1st sh1t again", "b!tch a$$ 3rd 4th", "mp3 you! 1st"] * 2
    for text in texts:
        hits, tokens = gate.density_by_tokens(Doc(None, text=text))
        assert gate.density_by_scan(Doc(None, text=text)) == ((hits, tokens) if hits else (0, 0)), text
        assert len(gate._memo) <= 3
    assert gate._memo  # it did remember


def test_every_language_a_detector_reports_is_a_valid_expected_language() -> None:
    """The codes `expected_language` is checked against are the detectors' own: langdetect's 55 profiles (Chinese
    once), CLD2's languages without its script-only entries; the cascade knows both."""
    from quality.language import detectable

    assert {"en", "de", "zh", "no", "he"} <= detectable("langdetect") and "eu" not in detectable("langdetect")
    assert {"en", "eu", "zh", "haw"} <= detectable("cld2") and not {"xx", "zzp", "un"} & detectable("cld2")
    assert detectable("cascade") == detectable("cld2") | detectable("langdetect")
    for code in ("EN-us", "pt-BR", "eu"):
        validate_quality_config({"expected_language": code})


def test_a_min_language_prob_the_detector_never_reports_is_refused() -> None:
    """Regression: `min_language_prob: 1.0` rejected every record (CLD2 reports at most 0.99 for English), exit 0.
    Refused only where CLD2's ceiling is 0.99: a language it reads from its own script reaches 1.0, and langdetect
    (so the cascade, on the texts CLD2 is unsure of) reports 0.99999..."""
    from quality.language import Cld2Detector

    with pytest.raises(QualityConfigError) as info:
        validate_quality_config({"min_language_prob": 1.0})
    assert str(info.value) == ("min_language_prob: must be <= 0.99, the most the cld2 detector reports for 'en', "
                               "got 1: every record would be rejected")
    with pytest.raises(QualityConfigError, match="^min_language_prob: must be <= 0.99, .* for 'de', got 0.995"):
        validate_quality_config({"min_language_prob": 0.995, "expected_language": "de"})
    for fine in ({"min_language_prob": 0.99}, {"min_language_prob": 1, "expected_language": "el"},
                 {"min_language_prob": 1, "language_detector": "cascade"},
                 {"min_language_prob": 1, "language_detector": "langdetect"},
                 {"min_language_prob": 1, "domain": "medical"}, {"min_language_prob": 1, "expected_language": None}):
        assert validate_quality_config(fine)["min_language_prob"] == fine["min_language_prob"]
    english = "The committee met on Tuesday to discuss the budget. " * 8
    greek = "Η επιτροπή συνεδρίασε την Τρίτη. " * 8
    assert Cld2Detector().detect(english).probs == {"en": 0.99}
    assert Cld2Detector().detect(greek).probs == {"el": 1.0}


def test_an_expected_language_the_detector_cannot_report_says_which_detector_can() -> None:
    """Regression: the error told a cld2 user (the default) to "use language_detector: cld2 or cascade", whatever the
    code: it names the detectors that report the code, or says none does."""
    with pytest.raises(QualityConfigError, match=r"'eu' is not a language the langdetect detector reports "
                                                 r"\(language_detector: cld2 or cascade reports it\)"):
        validate_quality_config({"expected_language": "eu", "language_detector": "langdetect"})
    with pytest.raises(QualityConfigError, match=r"'english' is not a language the cld2 detector reports \(no detector "
                                                 r"reports it; a typo\? codes are ISO 639-1, such as en, de, zh\)"):
        validate_quality_config({"expected_language": "english"})
