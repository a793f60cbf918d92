"""The domain gate of `domain: code`: does the text look like source code?

score = 0.45 × indentation + 0.30 × punctuation + 0.25 × keywords, each part in [0, 1]:
- indentation: share of non-blank lines that start with a tab or two spaces;
- punctuation: share of non-space chars that are structural ({}()[];=<>), saturating at
  `PUNCT_FULL` (typical code sits at 0.08-0.20, prose below 0.01);
- keywords: share of identifier tokens that are keywords, builtins or common library names of
  Python, C/C++, Java, JavaScript, Go and Rust, saturating at `KEYWORD_FULL`.
Computed on a bounded prefix. Indentation and punctuation are cheap counts; when they leave the
threshold out of reach even if every token were a keyword (prose: no indentation, hardly any
structural punctuation), the text is rejected without tokenising it.
"""
from __future__ import annotations

import re

from quality.figures import shown
from quality.gates.base import Doc, Gate, ratio
from quality.language import bounded_sample

WEIGHTS = (0.45, 0.30, 0.25)
PUNCT_FULL = 0.08
KEYWORD_FULL = 0.25
STRUCTURAL = "{}()[];=<>"
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
KEYWORDS = frozenset("""
    def elif lambda yield self None True False import from return print range len isinstance kwargs args
    assert pass raise except finally nonlocal global async await with
    include define ifdef ifndef endif int void char bool float double const struct nullptr std cout cin endl
    printf scanf malloc free sizeof typedef unsigned signed long short namespace template typename vector
    size_t auto static_cast
    public private protected static final class extends implements interface new throws throw try catch
    System String ArrayList HashMap List Map Integer boolean println instanceof abstract synchronized
    function var let console undefined null typeof prototype document this
    func package fmt nil chan defer go make append
    fn mut impl pub use Vec Some Ok Err match usize isize i32 i64 u8 u32 u64 f32 f64 unwrap iter collect
    if else for while do switch case break continue default enum true false
""".split())


def code_score(sample: str, min_score: float = 0.0) -> tuple[float, dict[str, float]]:
    """(score, parts). Stops early, returning an upper bound, once `min_score` is out of reach."""
    lines = [line for line in sample.split("\n") if line and not line.isspace()]
    indent = sum(line.startswith(("\t", "  ")) for line in lines) / len(lines) if lines else 0.0
    structural = sum(map(sample.count, STRUCTURAL))
    chars = len(sample) - sample.count(" ") - sample.count("\n") - sample.count("\t")
    punct = min(1.0, structural / chars / PUNCT_FULL) if chars else 0.0
    w_indent, w_punct, w_kw = WEIGHTS
    partial = w_indent * indent + w_punct * punct
    parts = {"indent": ratio(indent), "punct": ratio(punct)}
    if partial + w_kw < min_score:
        return partial + w_kw, parts
    idents = _IDENT.findall(sample)
    kw = min(1.0, sum(map(KEYWORDS.__contains__, idents)) / len(idents) / KEYWORD_FULL) if idents else 0.0
    parts["keywords"] = ratio(kw)
    return partial + w_kw * kw, parts


class CodeGate(Gate):
    text_only = True
    name = failed_check = "domain"

    def __init__(self, min_score: float, sample_chars: int):
        self.min_score, self.sample_chars = min_score, sample_chars

    def check(self, doc: Doc) -> str | None:
        score, parts = code_score(bounded_sample(doc.text, self.sample_chars), self.min_score)
        doc.meta["code_score"] = ratio(score)
        if score >= self.min_score:
            return None
        if "keywords" not in parts:
            return (f"code score <= {shown(score, self.min_score)} < {self.min_score:g} "
                    f"(indentation {parts['indent']:g}, punctuation {parts['punct']:g})")
        return f"code score {shown(score, self.min_score)} < {self.min_score:g}"
