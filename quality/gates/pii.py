"""Personal data: e-mail addresses, phone numbers, IP addresses and card numbers, as a share of the text.

Each kind is searched only in bounded windows where it can occur: e-mails around each "@", the
numeric kinds (one alternation: card | IPv4 | phone) inside runs of digits and separators, IPv6
only in texts with a colon-separated run of hex groups. A text is tested for the numeric kinds only when
it holds 7 consecutive chars of the run class (one `bytes.translate` of the text's Latin-1 view, else a
codec error handler, and a substring test), which prose without such numbers never does; a text with a
view is first asked by one Hyperscan pass whether it holds a run at all, and the IPv6 cue. Matches are validated
(Luhn for cards, digit counts and country codes for phones) and counted by the chars they add to those of earlier matches (a match
inside earlier ones, like the phone that is an e-mail's local part, is no hit); the scan stops as soon as the
matched length certainly exceeds the allowed density, so a PII-heavy text costs only the prefix needed to reject it.
"""
from __future__ import annotations

import codecs
import re
import unicodedata
from collections.abc import Iterator
from functools import lru_cache

import hyperscan

from quality.figures import shown
from quality.gates.base import Doc, Gate, most_within, ratio
from quality import hs
from quality.hs import database
from quality.normalize import latin1_view

# Letters of the scripts written without spaces between words (Thai, Lao, Tibetan, Myanmar, Khmer, Han, kana,
# Hangul, Yi; their digits left out): PII glued to them ("卡号4111…", "โทร555-123-4567ครับ") is not part of a word
_UNSPACED = (r"\u0e00-\u0e4f\u0e5a-\u0ecf\u0eda-\u0f1f\u0f2a-\u0fff\u1000-\u103f\u104a-\u108f\u109a-\u109f"
             r"\u1100-\u11ff\u1780-\u17df\u17ea-\u17ff\u19e0-\u19ff\u2e80-\u2fdf\u3000-\u9fff\ua000-\ua4cf"
             r"\ua960-\ua97f\ua9e0-\ua9ef\ua9fa-\ua9ff\uaa60-\uaadf\uac00-\ud7ff\uf900-\ufaff\uff66-\uffdc"
             r"\U0001b000-\U0001b2ff\U00020000-\U0003ffff")
# a word char that makes digits or an address beside it part of a word or code ("abc4111…", "cardé4111…"): a
# letter or digit of any other script, or "_" (each edge of a match was `\w`, which the letters above are too)
_WORD = rf"[^\W{_UNSPACED}]"
_LOCAL_CHAR = rf"(?:{_WORD}|[.+-])"  # a char of an address's local part
_DOMAIN = rf"@[\w-]{{1,63}}(?:\.[\w-]{{1,63}})*\.[a-z]{{2,24}}(?!{_WORD}|-)"  # its "@" and domain
EMAIL_RE = re.compile(rf"(?<!{_LOCAL_CHAR}){_LOCAL_CHAR}{{1,64}}{_DOMAIN}", re.IGNORECASE)
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
NUMBER_RE = re.compile(
    rf"""
    (?P<card>(?<![.-])(?<!{_WORD})\d(?:[ -]?\d){{12,18}}(?!{_WORD}|-))
  | (?P<ip>(?<!\.)(?<!{_WORD}){_OCTET}(?:\.{_OCTET}){{3}}(?!\.?{_WORD}))                     # not 1.2.3.4.5
  | (?P<phone>(?<!\+)(?<!{_WORD})
        (?:\+\d{{1,3}}(?:[ .-]?(?:\(\d{{1,4}}\)[ .-]?)?\d{{1,5}}(?:[ .-]\d{{2,8}}){{1,4}}  # +44 20 7946 0958, +49 30 1234567
                       |[ .-]?\d{{7,12}}(?!\d))                                           # +14155552671
        |(?:1[ .-])?(?:\(\d{{3}}\)[ .-]?|\d{{3}}[ .-])\d{{3}}[ .-]\d{{4}})                 # (555) 123-4567
        (?!{_WORD}|-))
    """,
    re.VERBOSE,
)
IPV6_RE = re.compile(rf"(?<!:)(?<!{_WORD})(?:[0-9a-f]{{1,4}}:){{7}}[0-9a-f]{{1,4}}(?!{_WORD}|:)", re.IGNORECASE)
_NUMBER_RUN = re.compile(r"[\d+(][\d .()+-]{5,}\d")  # the only places a card, IPv4 or phone can be
# A run is >= 7 chars of [\d .()+-]: in the text's run-class bytes (b"d" for those chars) it is b"ddddddd".
_RUN_CLASS = bytes(100 if chr(c) in "0123456789 .()+-" else 120 for c in range(128)) + b"x" * 128
_RUN_CUE = b"d" * 7
_DIGIT = re.compile(r"\d")
_NON_ASCII_BUDGET = 64  # extra UTF-8 bytes past which scanning for runs is cheaper than classifying chars
_IPV6_CUE = re.compile(r":(?:[0-9a-f]{1,4}:){6}", re.IGNORECASE)  # the inner part of every full-form IPv6
_LOCAL_REACH = 64  # chars before an "@" its address can start (EMAIL_RE's local part)
_LOCAL_RUN = re.compile(f"{_LOCAL_CHAR}*", re.IGNORECASE)  # matched on the reach of an "@" read backwards
_LOCAL_EDGE = re.compile(_LOCAL_CHAR, re.IGNORECASE)
_DOMAIN_RE = re.compile(_DOMAIN, re.IGNORECASE)


def luhn_valid(digits: str) -> bool:
    """The card-number checksum: rules out most digit runs that merely look like cards. `digits` may be of any
    script (the card pattern's `\\d` is any Unicode decimal digit: fullwidth, Arabic-Indic, ...), each by its value."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48 if ch < "\x80" else unicodedata.decimal(ch)
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


# The assigned ITU-T E.164 country calling codes, by the lengths of their national numbers that a 10-15 digit
# "+" number can have (libphonenumber's metadata, phonenumbers 9.0.43: each code's possible lengths, all its
# regions together). Codes are prefix-free, so a bare "+" number begins with at most one. Codes whose numbers
# are all shorter (+290 St Helena, +500 Falklands, +298 Faroes, ...) are left out: no bare 10+ digit number is one.
_NATIONAL_LENGTHS = {
    "7": "238 239 246 248 269 291 297 592 597 673 674 676 677 678 680 683 688 690 691 692",
    "7 8": "241 386 599 670 675 853 961 965 975",
    "7 8 9": "231 252 355 385 967 968",
    "7 8 9 10": "243 254 353 880",
    "7 8 9 10 11": "352 375 595 886",
    "7 8 9 10 11 12": "358 381 598 882 971 972",
    "7 8 9 11": "852 974",
    "7 8 9 12": "359",
    "7 8 10": "230 267 372",
    "7 8 10 11": "507",
    "7 8 11": "503",
    "7 9": "220 245 265 354 421 423",
    "7 9 10": "263",
    "7 10": "685 960",
    "7 11": "501 679",
    "8": "45 47 216 222 223 226 227 228 232 235 236 253 257 266 350 356 357 370 371 373 374 389 505 509 686 800 808 "
         "973 993",
    "8 9": "32 36 51 213 224 233 237 250 258 264 268 376 377 382 387 591 689 962 963",
    "8 9 10": "20 27 48 60 64 84 95 855 856 964 970 976",
    "8 9 10 11": "31 55 593",
    "8 9 10 11 12": "39 86 92 383 883",
    "8 9 10 11 12 13": "43 49 62 63 81 82 91",
    "8 9 10 12": "46 61",
    "8 9 10 13": "66",
    "8 10": "53 378 506 850",
    "8 10 11": "57 65 977",
    "8 11": "502 504",
    "9": "33 34 40 93 94 211 212 218 221 240 242 244 249 251 255 256 260 261 262 351 508 590 594 596 681 979 992 994 "
         "995 998",
    "9 10": "44 380 881 966 996",
    "9 10 11": "56",
    "9 10 11 12": "420",
    "9 12": "41 870",
    "10": "1 52 58 98 225 229",
    "10 11": "54",
    "10 11 12": "30 234",
    "10 12 13": "90",
    "10 14": "7",
    "11": "888",
    "12": "878",
}
_COUNTRY_CODES = {code: frozenset(map(int, lengths.split()))
                  for lengths, codes in _NATIONAL_LENGTHS.items() for code in codes.split()}
_DIGIT_GROUP = re.compile(r"\d+")


def _e164(number: str) -> bool:
    """Whether a "+" and these digits, written without separators, is an international phone number: it begins
    with an assigned country code and the rest has a length of that country's national numbers (+3545511234,
    Iceland, 7; +4722123456, Norway, 8), which a signed number seldom does (+2147483647: no code +2, +21, +214;
    +1500000000: +1 numbers have 10 digits after the code)."""
    return any(len(number) - n in _COUNTRY_CODES.get(number[:n], ()) for n in (1, 2, 3))


def _phone_valid(span: str) -> bool:
    """Whether a phone match (ASCII digits) is one: 10-15 digits, and a "+" number that could be a signed one is
    read as such. A "." right after the digits led by "+" is a decimal point when one or two digit groups follow it,
    unless only "." parts them (`+1.25 45678901`, `+3.1415926535`: a price change then a volume, a number;
    `+1.415.555.2671`, `+1.415-555-2671`, `+44.20 7946 0958`: phones); a "+" and digits alone is a phone only as
    `_e164` reads it."""
    digits = sum(c.isdigit() for c in span)
    if not 10 <= digits <= 15:
        return False
    if span[0] != "+":
        return True
    lead = span[1:].lstrip("0123456789")
    if lead[:1] == ".":
        return len(_DIGIT_GROUP.findall(lead)) > 2 or lead.count(".") > 1 and lead.replace(".", "").isdigit()
    return bool(lead) or _e164(span[1:])


def _digit_class(err: UnicodeError) -> tuple[str, int]:
    """Codec error handler: a non-ASCII char becomes "0" when the run regex counts it as a digit."""
    assert isinstance(err, UnicodeEncodeError)
    return "".join("0" if _DIGIT.match(c) else "?" for c in err.object[err.start:err.end]), err.end


codecs.register_error("streamprep.digit_class", _digit_class)


def _number_runs(text: str, view: bytes | None) -> Iterator[re.Match[str]]:
    """`_NUMBER_RUN.finditer(text)`, scanning only the maximal stretches of >= 7 digits and " .()+-" chars
    (a run holds only those, so it never crosses a stretch's edge); one class byte per char finds them.
    `view` is `latin1_view(text)`: no char past ASCII in it is a digit, its standin included."""
    if view is not None:
        classes = view.translate(_RUN_CLASS)
    elif len(text.encode("utf-8", "surrogatepass")) - len(text) > _NON_ASCII_BUDGET:
        yield from _NUMBER_RUN.finditer(text)
        return
    else:
        classes = text.encode("ascii", "streamprep.digit_class").translate(_RUN_CLASS)
    at = classes.find(_RUN_CUE)
    while at != -1:
        start = classes.rfind(b"x", 0, at) + 1
        end = classes.find(b"x", at)
        end = len(classes) if end == -1 else end
        yield from _NUMBER_RUN.finditer(text, start, end)
        at = classes.find(_RUN_CUE, end)


def _emails(text: str) -> Iterator[tuple[str, int, int]]:
    """`EMAIL_RE.finditer(text)`, each "@" tried once, from the one place an address through it can start: the
    start of the run of local-part chars before it, read backwards from it (no further than the "@" or address
    before it, or 64 chars; a run reaching past that, EMAIL_RE's lookbehind refuses). Searching EMAIL_RE over the
    whole reach of each "@" tried ~190 starts a char on text dense in "@" (~12 µs a char); searching the reach for
    the run's start cost 64 tries an "@"."""
    pos, floor = 0, 0  # the end of the last address; the char after the last "@"
    at = text.find("@")
    while at != -1:
        lo = max(pos, floor, at - _LOCAL_REACH)
        start = at - _LOCAL_RUN.match(text[lo:at][::-1]).end()  # type: ignore[union-attr]  # `*` always matches
        m = None
        if start < at and (start > lo or not lo or not _LOCAL_EDGE.match(text, lo - 1)):
            m = _DOMAIN_RE.match(text, at)  # (the domain ends at the first char not in one)
        if m is None:
            floor, at = at + 1, text.find("@", at + 1)
        else:
            yield "email", start, m.end()
            pos = floor = m.end()
            at = text.find("@", pos)


class _AsciiDigits(dict[int, int]):
    """`str.translate` table: each Unicode decimal digit (`\\d`) to the ASCII digit of its value, any other char
    kept (filled in as chars are met)."""

    def __missing__(self, c: int) -> int:
        self[c] = 48 + unicodedata.decimal(chr(c)) if _DIGIT.match(chr(c)) else c
        return self[c]


_ASCII_DIGITS = _AsciiDigits()


def _numbers(text: str, view: bytes | None) -> Iterator[tuple[str, int, int]]:
    """NUMBER_RE's matches in the number runs, validated. A run (with the char before it and the two after, all its
    lookarounds see) holding a char past ASCII is matched with its digits as ASCII ones of their values, so the
    pattern's digit values (an IPv4 octet's 25[0-5], a phone's leading 1) hold for digits of any script."""
    for run in _number_runs(text, view):
        at, end = max(run.start() - 1, 0), run.end() + 2  # +2: let the lookaheads see the next chars
        window = text[at:end]
        if not window.isascii():
            window = window.translate(_ASCII_DIGITS)
        for m in NUMBER_RE.finditer(window, run.start() - at):
            kind, span = m.lastgroup or "", m.group()
            if kind == "card":
                digits = "".join(c for c in span if c.isdigit())
                if not luhn_valid(digits) or not int(digits):
                    continue
            elif kind == "phone" and not _phone_valid(span):
                continue
            yield kind, at + m.start(), at + m.end()


def _ipv6(text: str, cue: bool | None = None) -> Iterator[tuple[str, int, int]]:
    """IPv6 matches, searched for when the text has the cue (`cue`: whether it has, when already known)."""
    if cue if cue is not None else text.count(":") >= 7 and _IPV6_CUE.search(text):
        for m in IPV6_RE.finditer(text):
            yield "ip", m.start(), m.end()


@lru_cache(maxsize=1)
def _cues_db() -> hyperscan.Database:
    # `_NUMBER_RUN` and `_IPV6_CUE` as they read a Latin-1 view: no char past ASCII there is a digit, and
    # IGNORECASE folds no Latin-1 char into [0-9a-f] but A-F
    return database([rb"[0-9+(][0-9 .()+\-]{5,}[0-9]", rb":(?:[0-9a-fA-F]{1,4}:){6}"], hyperscan.HS_FLAG_SINGLEMATCH)


def _cues(view: bytes) -> tuple[bool, bool]:
    """(`_NUMBER_RUN` matches, `_IPV6_CUE` matches) in the text whose Latin-1 view this is, by one Hyperscan
    pass (~1.3 µs on a C4 text, where the run classes and the colon count cost ~4): most texts have
    neither and skip both scans."""
    found = [False, False]
    hs.scan(_cues_db(), view, hs.flag_match, found)
    return found[0], found[1]


def find_pii(text: str) -> Iterator[tuple[str, int, int]]:
    """(kind, start, end) of each validated PII match: e-mails, then numbers, then IPv6."""
    return _find(text, latin1_view(text))


def _find(text: str, view: bytes | None, cues: tuple[bool, bool] | None = None) -> Iterator[tuple[str, int, int]]:
    """`find_pii` with the text's Latin-1 view given (a `Doc` computes it once for the byte-scanning gates),
    and `_cues(view)` when known."""
    yield from _emails(text)
    if view is None:
        yield from _numbers(text, None)
        yield from _ipv6(text)
        return
    runs, ipv6 = cues or _cues(view)
    if runs:
        yield from _numbers(text, view)
    yield from _ipv6(text, ipv6)


class PiiGate(Gate):
    """Rejects when matched PII chars (each char once, however many matches hold it) / text chars exceeds
    `pii_max_density`.

    `pii_density` is exact for kept texts; for rejected ones it is the density found when the scan
    stopped, which already exceeds the limit (a lower bound).
    """

    text_only = True
    name = failed_check = "pii"

    def __init__(self, max_density: float):
        self.max_density, self._most = max_density, most_within(max_density)

    def check(self, doc: Doc) -> str | None:
        text, view = doc.text, doc.latin1
        cues = None if view is None else _cues(view)
        if cues == (False, False) and "@" not in text:  # nothing any kind could match: density 0
            doc.meta["pii_density"] = 0.0
            return None
        limit = self._most(len(text))
        matched = 0
        kinds: dict[str, int] = {}
        # the chars counted so far: the kinds are searched one after another, so their matches can overlap (the
        # phone that is an e-mail's local part); a char counts once, and a match adding none is no hit
        counted = bytearray(len(text))
        for kind, start, end in _find(text, view, cues):
            new = counted.count(0, start, end)
            if not new:
                continue
            counted[start:end] = b"\x01" * (end - start)
            matched += new
            kinds[kind] = kinds.get(kind, 0) + 1
            if matched > limit:
                break
        density = matched / len(text) if text else 0.0
        doc.meta["pii_density"] = ratio(density)
        if not kinds:
            return None
        found = dict(sorted(kinds.items()))
        doc.meta["pii"] = found
        if matched > limit:
            kinds_found = ", ".join(f"{k} {n}" for k, n in found.items())
            return f"pii density {shown(density, self.max_density)} > {self.max_density:g} ({kinds_found})"
        return None
