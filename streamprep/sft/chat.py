"""Tokenizer + chat template, and the token-level loss mask of each unit.

Masks are computed on characters and mapped to tokens through the encoder's offsets:

- A `TextUnit` is encoded once; its pieces give the character labels.
- A `TemplateUnit` is rendered once (text T) and encoded once. Each message's span in T is found by
  rendering prefixes: the end of message k is the longest common prefix of T with renderings of
  messages[:k] followed by something else (nothing, a dummy user turn, a dummy assistant turn); the
  smallest such prefix is taken (it can only overshoot), then moved back to the start of the token it
  falls in. The content start is where a sentinel content appears when message k is rendered last
  with the sentinel in place of its content (or, for a message a template shows only with the turn after it,
  a system prompt merged into the first user turn, with that turn after it; its end is then where the
  dummy turns after it part from T). Before the content: the role header (always masked);
  from the content to the end of the span: content + the template's end-of-turn text (labelled by
  role). Text after the last message (e.g. phi-3's final `<|endoftext|>`, or the generation prompt)
  is masked.
- Verified per record: every message's content sits at its content start inside its span (else the
  record is dropped as `template_unverified`), and encoding the message spans separately and
  concatenating gives the full rendering's tokens (else it is counted as `template_split_mismatch`;
  the mask still comes from the single full encoding).

A token is trained only when every character it covers is trained, so a token that straddles a
train/mask boundary is masked; except, in a template conversation, one whose masked characters are only the
template's whitespace right before a trained content (Llama-2's `[/INST] ` + `Blue`: `▁Blue`), which the model has
to produce. Zero-width tokens (special tokens added by the post-processor) take
the label of the token before them (or after, at the start).
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from streamprep import backends
from streamprep.config import ConfigError
from streamprep.sft.config import SINGLE_KEY
from streamprep.sft.records import RecordError, TemplateUnit, TextUnit
from streamprep.tokenizer import source_file, tokenizer_config

SENTINEL = "\ue000\ue001"   # private-use characters: never produced by a template, and rare in real text
# where a conversation's sentinel is taken from when its messages hold SENTINEL's characters (`_sentinel`)
PRIVATE_USE = (range(0xE000, 0xF900), range(0xF0000, 0xFFFFE), range(0x100000, 0x10FFFE))
TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass
class ChatTokenizer:
    """A `transformers.PreTrainedTokenizerFast` built from tokenizer.json exactly as written (so the run's
    tokenizer fingerprint, the file's SHA-256, describes the encoding) plus its chat template."""

    hf: Any
    backend: Any               # tokenizers.Tokenizer (encodes with offsets)
    chat_template: str | None
    vocab_size: int
    path: str
    id_bound: int              # one past the highest token id (backends.id_bound): what `sft.output.dtype` must hold

    def render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        if self.chat_template is None:
            raise ValueError(f"{self.path}: the tokenizer has no chat_template (tokenizer_config.json or "
                             "chat_template.jinja); sections with template: true need one")
        try:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as exc:  # jinja2 errors, raise_exception() in templates
            raise RecordError("template_error", f"{type(exc).__name__}: {exc}"[:300]) from None

    def encode(self, text: str, add_special_tokens: bool) -> tuple[list[int], np.ndarray]:
        """(ids, offsets). A text HF tokenizers panics on ("AddedVocabulary bad split", a BaseException that failed
        the job on every resume) is a RecordError `empty`, as the pretraining path drops it
        (backends.ShardEncoder.encode_or_drop)."""
        try:
            enc = self.backend.encode(text, add_special_tokens=add_special_tokens)
        except BaseException as exc:  # a panic is a BaseException only
            if not backends.is_panic(exc):
                raise
            raise RecordError("empty", f"the tokenizer cannot encode it ({backends.panic_message(exc)})") from None
        return enc.ids, np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)


def _token_value(v: Any) -> Any:
    return v.get("content") if isinstance(v, dict) else v


def _special_tokens(tcfg: dict[str, Any]) -> dict[str, str]:
    """The special tokens tokenizer_config.json names (`bos_token`…, a string or an AddedToken's dict), as the
    chat template sees them."""
    return {k: v for k in TOKEN_KEYS if isinstance(v := _token_value(tcfg.get(k)), str)}


def chat_template_of(tok_file: Path, tcfg: dict[str, Any] | None = None) -> str | None:
    """The chat template beside a tokenizer.json (`chat_template_source`); None without one."""
    return chat_template_source(tok_file, tcfg)[0]


def chat_template_source(tok_file: Path, tcfg: dict[str, Any] | None = None) -> tuple[str | None, Path]:
    """The chat template beside a tokenizer.json and the file it is read from: tokenizer_config.json's (`tcfg`, when
    read already; its `default` when named), else chat_template.jinja; (None, chat_template.jinja) without one."""
    template = (tokenizer_config(tok_file.parent) if tcfg is None else tcfg).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None:
        return template, tok_file.parent / "tokenizer_config.json"
    jinja_file = tok_file.parent / "chat_template.jinja"
    if not jinja_file.is_file():
        return None, jinja_file
    try:
        return jinja_file.read_text(encoding="utf-8"), jinja_file
    except UnicodeDecodeError as exc:  # else a bare UnicodeDecodeError naming no file, exit 1
        raise ConfigError(f"config: 'tokenizer.path': {jinja_file} is not UTF-8 text ({exc.reason} at byte "
                          f"{exc.start})") from None


def check_chat_template(cfg: Mapping[str, Any]) -> None:
    """A `template: true` section needs the run's tokenizer to have a chat template that compiles: without one, every
    record failed (at the first shard, or each as `template_error` in a run that completed with 0 tokens) and
    re-running could not fix it (the config check refuses a changed `tokenizer.path`). Runs after the tokenizer's
    own check, which found its tokenizer.json."""
    sources = ((cfg.get("sft") or {}).get("input") or {}).get("sources") or {}
    single = list(sources) == [SINGLE_KEY]  # most likely written as `input.sections`, which validates to this
    used = next((f"sft.input.{'' if single else f'sources.{key}.'}sections[{i}].template"
                 for key, src in sources.items() for i, sec in enumerate(src["sections"]) if sec["template"]), None)
    path = cfg["tokenizer"]["path"]
    # every SFT run's load_chat_tokenizer reads the template: one it cannot read is refused here, not mid-run
    template, where = chat_template_source(source_file(Path(path))) \
        if path is not None and cfg.get("sft") else (None, None)
    if used is None:
        return
    if template is None:
        named = tokenizer_config(where.parent).get("chat_template") if path is not None else None
        if isinstance(named, list):  # transformers, too, refuses named templates without a default
            entries = [t for t in named if isinstance(t, dict)]
            listed = f"the chat_template list in {where.parent / 'tokenizer_config.json'}"
            default = next((t for t in reversed(entries) if t.get("name") == "default"), None)  # the last, as read
            if default is not None:  # its template null or absent: not an entry that is missing
                got = "null" if "template" in default else "missing"
                raise ConfigError(f"config: '{used}': needs a chat template, and the entry named 'default' in {listed} "
                                  f"has no template string ('template' is {got})")
            names = ", ".join(str(t.get("name")) for t in entries) or "none"
            raise ConfigError(f"config: '{used}': needs a chat template, and {listed} has no entry named 'default' "
                              f"(named: {names})")
        what = "a tokenizer the run trains has" if path is None else \
            f"the tokenizer at {path} has (tokenizer_config.json or chat_template.jinja beside its tokenizer.json)"
        raise ConfigError(f"config: '{used}': needs a chat template, and {what} none")
    if not isinstance(template, str):
        raise ConfigError(f"config: '{used}': the chat template in {where} is not a string, got "
                          f"{type(template).__name__} {template!r:.60}")
    if not template.strip():  # compiles, then renders every record to (nearly) nothing: a run of 0 tokens
        raise ConfigError(f"config: '{used}': the chat template in {where} is empty")
    import jinja2
    try:  # the compiler (and sandbox, extensions, filters) apply_chat_template renders with, cached there by text
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a private name: a transformers without it leaves the template to the first render
        return
    try:
        compiled = _compile_jinja_template(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"config: '{used}': the chat template in {where} does not compile: {exc.message} "
                          f"(line {exc.lineno})") from None
    # one that renders none of a conversation (comments only, a BOM) drops every record as `empty` or
    # `no_trained_tokens`, a run of 0 tokens: a probe of digits (which upper, lower, trim, tojson keep) must show
    # a message of every role the config names (`sft.mask`, a section's `role_map`), beside user and assistant: a
    # template that renders only its own roles (`human`, `gpt`) shows one of them
    tcfg = tokenizer_config(where.parent)
    tokens = _special_tokens(tcfg)
    roles = dict.fromkeys(["user", "assistant", *((cfg.get("sft") or {}).get("mask") or {}),
                           *(r for src in sources.values() for sec in src["sections"]
                             for r in (sec.get("role_map") or {}).values())])
    probe = [{"role": role, "content": f"{7319046285 + 1000003 * i}"} for i, role in enumerate(roles)]
    try:
        rendered = compiled.render(messages=probe, add_generation_prompt=False, **tokens)
    except Exception:  # noqa: BLE001 - it may need what a probe lacks (a system turn, tools): left to the run
        return
    if not any(m["content"] in rendered for m in probe):
        raise ConfigError(f"config: '{used}': the chat template in {where} renders none of the conversation's "
                          f"messages (a conversation of a message of each role, {', '.join(roles)}, rendered as "
                          f"{rendered!r:.60})")


def load_chat_tokenizer(path: str | Path) -> ChatTokenizer:
    """Load once per process from a directory (tokenizer.json [+ tokenizer_config.json, chat_template.jinja])
    or a tokenizer.json path; local files only. Reuse the object across parts."""
    from transformers import PreTrainedTokenizerFast

    p = Path(path)
    tok_file = p / "tokenizer.json" if p.is_dir() else p
    if not tok_file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {p}")
    tcfg = tokenizer_config(tok_file.parent)
    template = chat_template_of(tok_file, tcfg)
    kwargs = _special_tokens(tcfg)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_file), chat_template=template,
                                 clean_up_tokenization_spaces=False, **kwargs)
    backend = hf.backend_tokenizer
    backend.no_truncation()  # the file's own: `backends.hf_tokenizer` says why
    backend.no_padding()
    return ChatTokenizer(hf, backend, template, backend.get_vocab_size(with_added_tokens=True), str(tok_file),
                         backends.id_bound(backend))


def _lcp(a: str, b: str) -> int:
    """Length of the longest common prefix (slice comparisons in C, binary search)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def token_labels(offsets: np.ndarray, char_train: np.ndarray, char_lead: np.ndarray | None = None
                 ) -> tuple[np.ndarray, int]:
    """Per-token 0/1 from per-character 0/1: trained iff every covered character is, or is a `char_lead` one (the
    template's whitespace just before a trained content) and at least one is trained. Returns (labels, number of
    tokens that straddle a train/mask boundary otherwise, which are masked)."""
    n = len(offsets)
    if n == 0:
        return np.zeros(0, dtype=np.uint8), 0
    s, e = offsets[:, 0], offsets[:, 1]
    width = e - s
    covered = _covered(char_train, s, e)
    allowed = covered if char_lead is None else covered + _covered(char_lead, s, e)
    labels = ((width > 0) & (covered > 0) & (allowed == width)).astype(np.uint8)
    straddles = int(((covered > 0) & (allowed < width)).sum())
    zero = np.flatnonzero(width <= 0)
    if len(zero):
        nz = np.flatnonzero(width > 0)
        for i in zero:
            j = nz[np.searchsorted(nz, i) - 1] if len(nz) and nz[0] < i else (nz[0] if len(nz) else None)
            labels[i] = labels[j] if j is not None else 0
    return labels, straddles


def _covered(chars: np.ndarray, s: np.ndarray, e: np.ndarray) -> np.ndarray:
    """How many of the characters [s, e) of each token are set in `chars` (0/1)."""
    cs = np.concatenate(([0], np.cumsum(chars, dtype=np.int64)))
    return cs[e] - cs[s]


@dataclass
class Encoded:
    ids: list[int]
    mask: np.ndarray                   # uint8 per token
    diag: dict[str, int] = field(default_factory=dict)


def _bump(diag: dict[str, int], key: str, n: int = 1) -> None:
    if n:
        diag[key] = diag.get(key, 0) + n


def encode_text_unit(tok: ChatTokenizer, unit: TextUnit) -> Encoded:
    text = unit.text
    char_train = np.zeros(len(text), dtype=np.uint8)
    pos = 0
    for piece, train in unit.pieces:
        if train:
            char_train[pos:pos + len(piece)] = 1
        pos += len(piece)
    ids, offsets = tok.encode(text, unit.add_special_tokens)
    labels, straddles = token_labels(offsets, char_train)
    diag: dict[str, int] = {}
    _bump(diag, "straddling_tokens_masked", straddles)
    return Encoded(ids, labels, diag)


def _snap_down(c: int, offsets: np.ndarray) -> int:
    """Move a character boundary that falls inside a token back to that token's start."""
    inside = np.flatnonzero((offsets[:, 0] < c) & (offsets[:, 1] > c))
    return int(offsets[inside[0], 0]) if len(inside) else c


def _sentinel(msgs: list[dict[str, str]]) -> str:
    """SENTINEL, or when a message holds one of its characters two private-use characters none holds: a sentinel
    found in an earlier message (or in a role) would be taken for where message k's content starts."""
    joined = "".join(m["role"] + m["content"] for m in msgs)
    if not any(ch in joined for ch in SENTINEL):
        return SENTINEL
    used = set(joined)
    free = (chr(c) for block in PRIVATE_USE for c in block if chr(c) not in used)
    pair = "".join(itertools.islice(free, 2))
    if len(pair) < 2:
        raise RecordError("template_error", "the messages hold every private-use character: no sentinel is left")
    return pair


def _shown_with_next(tok: ChatTokenizer, text: str, probe_msgs: list[dict[str, str]], sentinel: str, content: str,
                     prev_end: int, followed: list[int | None], offsets: np.ndarray) -> tuple[int, int] | None:
    """(content start, end) of a message a template renders only together with the turn after it (a system prompt
    merged into the first user turn): the sentinel in `probe_msgs` (the message, its sentinel content, then the real
    next message) must sit where T has the content, and its end is the smallest common prefix of T with the
    renderings that follow it with a dummy turn (`followed`, None where one did not render) among those that show
    all of its content (Gemma's moves it into a dummy assistant turn's header). None when that does not hold: the
    message is counted as not rendered, as before (a template that moves it elsewhere, e.g. into the last user turn,
    or drops it)."""
    try:
        probe = tok.render(probe_msgs, False)
    except RecordError:
        return None
    at = probe.find(sentinel)
    if at < 0 or _lcp(text, probe) < at or not prev_end <= at:
        return None
    shown = content if text.startswith(content, at) else content.strip()
    ok = [c for c in followed if c is not None and c >= at + len(shown)]
    if not text.startswith(shown, at) or not ok:
        return None
    end = _snap_down(min(ok), offsets)
    return (at, end) if at + len(shown) <= end else None


def message_spans(tok: ChatTokenizer, unit: TemplateUnit, limit: int | None = None
                  ) -> tuple[str, list[int], list[int | None], list[int], np.ndarray, dict[str, int]]:
    """Render the conversation; return (text, ends, content starts (None = not rendered), ids, offsets, diag).
    ends[k] is the end of message k (ends[-1] is where the tail after the last message begins).

    Locating message k renders the k messages before it, so a conversation costs the square of its length (~11 s
    for 1,000 messages): with `limit`, the tokens a sequence keeps, the messages after the text those tokens cover
    are neither located nor verified (they are cut anyway), which bounds a record's cost by `max_seq_len`."""
    msgs = [{"role": m.rendered_role, "content": m.content} for m in unit.messages]
    sentinel = _sentinel(msgs)
    gen = unit.generation_prompt
    text = tok.render(msgs, gen)
    ids, offsets = tok.encode(text, unit.add_special_tokens)
    cut = None if limit is None or limit >= len(ids) else int(offsets[:limit, 1].max(initial=0))
    diag: dict[str, int] = {}
    n = len(msgs)
    ends: list[int] = []
    starts: list[int | None] = []
    prev_end = 0
    for k in range(1, n + 1):
        if cut is not None and prev_end >= cut:
            break   # message k starts past the kept tokens
        head = msgs[:k]
        # k < n: messages[:k] alone (then the template's tail); k = n: the other generation-prompt setting
        variants: list[tuple[list[dict[str, str]], bool]] = [(head, False if k < n else not gen)]
        variants += [(head + [{"role": r, "content": sentinel}], False) for r in ("user", "assistant")]
        cands: list[int | None] = []
        for v_msgs, v_gen in variants:
            try:
                cands.append(_lcp(text, tok.render(v_msgs, v_gen)))
            except RecordError:
                cands.append(None)  # e.g. a template that insists on alternating roles
        if not any(c is not None for c in cands):
            raise RecordError("template_error", f"cannot render the conversation up to message {k}")
        end = max(prev_end, _snap_down(min(c for c in cands if c is not None), offsets))
        # content start: render message k last, with a sentinel for its content
        blank = {"role": msgs[k - 1]["role"], "content": sentinel}
        probe = tok.render(msgs[:k - 1] + [blank], False)
        at = probe.find(sentinel)
        content = msgs[k - 1]["content"]
        if at < 0:
            # shown only beside the turn after it (Llama-2 merges the system prompt into the first [INST])?
            joined = _shown_with_next(tok, text, msgs[:k - 1] + [blank] + msgs[k:k + 1], sentinel, content,
                                      prev_end, cands[1:], offsets) if k < n else None
            if joined is None:
                starts.append(None)   # the template does not render this role (e.g. phi-3 and 'tool')
                _bump(diag, "messages_not_rendered")
            else:
                at, end = joined  # its end: where the dummy turns after it part from T, not the lone rendering's
                starts.append(at)
        else:
            shown = content if text.startswith(content, at) else content.strip()
            if _lcp(text, probe) < at or not text.startswith(shown, at) or not prev_end <= at \
                    or at + len(shown) > end:
                raise RecordError("template_unverified",
                                  f"message {k} ({msgs[k - 1]['role']}) is not where the template puts it")
            starts.append(at)
        ends.append(end)
        prev_end = end
    return text, ends, starts, ids, offsets, diag


def encode_template_unit(tok: ChatTokenizer, unit: TemplateUnit, limit: int | None = None) -> Encoded:
    """The unit's ids and mask; with `limit`, the mask is exact on its first `limit` tokens only (message_spans)."""
    text, ends, starts, ids, offsets, diag = message_spans(tok, unit, limit)
    char_train = np.zeros(len(text), dtype=np.uint8)
    char_lead = np.zeros(len(text), dtype=np.uint8)
    for m, span, start, end in zip(unit.messages, [0] + ends, starts, ends):
        if m.train and start is not None:
            char_train[start:end] = 1
            # the header's whitespace right before the content (Llama-2's `[/INST] ` + content): a token it merges
            # into with the content's first word (`▁Blue`) is one the model must produce, so it is trained
            lead = start
            while lead > span and text[lead - 1].isspace():
                lead -= 1
            char_lead[lead:start] = 1
    labels, straddles = token_labels(offsets, char_train, char_lead)
    _bump(diag, "straddling_tokens_masked", straddles)
    _bump(diag, "conversations")
    _bump(diag, "messages", len(unit.messages))
    if not unit.add_special_tokens:   # self-check: the spans tokenise independently to the same ids
        bounds = [0] + ends + [len(text)]
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
        joined = [i for enc in tok.backend.encode_batch(pieces, add_special_tokens=False) for i in enc.ids]
        if joined != list(ids):
            _bump(diag, "template_split_mismatch")
    return Encoded(list(ids), labels, diag)


def encode_units(tok: ChatTokenizer, units: list[TemplateUnit | TextUnit], limit: int | None = None) -> Encoded:
    """The units' ids and mask, one after the other; with `limit` (`max_seq_len`) the mask is exact on the first
    `limit` tokens, all a sequence keeps."""
    ids: list[int] = []
    masks: list[np.ndarray] = []
    diag: dict[str, int] = {}
    for unit in units:
        left = None if limit is None else max(limit - len(ids), 0)
        enc = encode_template_unit(tok, unit, left) if isinstance(unit, TemplateUnit) else encode_text_unit(tok, unit)
        ids += enc.ids
        masks.append(enc.mask)
        for k, v in enc.diag.items():
            _bump(diag, k, v)
    mask = np.concatenate(masks) if masks else np.zeros(0, dtype=np.uint8)
    return Encoded(ids, mask, diag)
