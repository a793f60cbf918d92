"""From one input record to what gets tokenised, without a tokenizer: fields, transcripts, labels, values.

A record becomes, per output key, a list of *items* (one, or one per element of `list_field`). An item
is a list of *units*, each encoded on its own and concatenated:

- `TemplateUnit`: a conversation rendered through the chat template; consecutive template sections
  with the same `add_special_tokens` join one conversation (the template places BOS/EOS once);
- `TextUnit`: plain text pieces, each labelled train/mask; consecutive non-template sections with the
  same `add_special_tokens` are joined into one text, so tokens merge across them exactly as in the
  joined string (no spurious SentencePiece word-start markers at section starts);

plus the raw numbers of `action: value` sections. Labels are decided here; token positions in chat.py.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streamprep.sft.config import SectionConfig, SftConfig, label_of_role, layout, section_mode

HH_MARKER = re.compile(r"\n\n(Human|Assistant):")
HH_ROLES = {"Human": "user", "Assistant": "assistant"}


class RecordError(ValueError):
    """A record that cannot be prepared; `.reason` is the short drop reason counted in the stats."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass
class Message:
    role: str            # as in the record (mask lookup uses this first)
    rendered_role: str   # after role_map: what the chat template sees
    content: str
    train: bool


@dataclass
class TemplateUnit:
    messages: list[Message]
    add_special_tokens: bool
    generation_prompt: bool = False


@dataclass
class TextUnit:
    pieces: list[tuple[str, bool]]   # (text, trained)
    add_special_tokens: bool

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.pieces)


@dataclass
class Item:
    units: list[TemplateUnit | TextUnit] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)   # contents, for quality control
    trained: list[str] = field(default_factory=list)  # the contents meant to be trained (`no_trained_text`)


def get_path(obj: Any, path: str, name: str | None = None) -> Any:
    """`a.b.0` into nested mappings / lists; RecordError('schema') when something is missing, naming the field as
    `name` (where `obj` is in the record: `responses[1].text` for a list_field element's `text`), else `path`."""
    cur = obj
    for part in path.split("."):
        if isinstance(cur, Mapping) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            raise RecordError("schema", f"field {name or path!r} is missing")
    return cur


def parse_hh(text: str) -> list[tuple[str, str, str]]:
    """HH-RLHF transcript `"\\n\\nHuman: …\\n\\nAssistant: …"` → [(role, header, content)], roles user/assistant.

    Headers are the markers (`"\\n\\nHuman:"`); contents keep their leading space, so the turns
    concatenate back to the input exactly.
    """
    marks = list(HH_MARKER.finditer(text))
    if not marks or marks[0].start() != 0:
        raise RecordError("schema", "not an HH transcript (must start with '\\n\\nHuman:' or '\\n\\nAssistant:')")
    turns = []
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        turns.append((HH_ROLES[m.group(1)], m.group(0), text[m.end():end]))
    return turns


def _numbers(value: Any, where: str, dtype: str) -> list[float]:
    """The numbers of a value section; each must be finite in `dtype` (`output.value_dtype`) too, checked here,
    before QC: one past its range (1e39 in float32), found only when the shard wrote it, took its valid twin's
    exact-dedup digest and was then dropped, so neither was written. The range is checked on the whole list at once:
    value by value, a list of 2,048 rewards cost 4 ms a record, 6x the rest of the checks."""
    vals = value if isinstance(value, list) else [value]
    out = []
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RecordError("schema", f"{where}: expected a number or a list of numbers, got {type(v).__name__}")
        if not math.isfinite(v):
            raise RecordError("bad_value", f"{where}: {v!r} is not finite")
        out.append(float(v))
    if not out:
        raise RecordError("empty", f"{where}: empty list of values")
    with np.errstate(over="ignore"):  # a finite number past the dtype's range becomes inf there
        held = np.isfinite(np.asarray(out, dtype=dtype))
    if not held.all():
        i = int(np.argmin(held))
        at = f"{where}[{i}]" if isinstance(value, list) else where
        raise RecordError("bad_value", f"{at}: {vals[i]!r} is beyond {dtype}'s range "
                                       f"(±{float(np.finfo(dtype).max):.3g})")
    return out


def _messages(value: Any, s: SectionConfig, where: str) -> list[tuple[str, str]]:
    if not isinstance(value, list) or not value:
        raise RecordError("schema", f"{where}: expected a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping):
            raise RecordError("schema", f"{where}[{i}]: a message must be a mapping")
        role, content = m.get(s.role_key), m.get(s.content_key)
        if not isinstance(role, str) or not role or not isinstance(content, str):
            # a missing or null content is no empty turn: its question (or a tool call's arguments, which are not
            # rendered) would be gone and the turn around it trained as is
            key, value = (s.role_key, role) if not isinstance(role, str) or not role else (s.content_key, content)
            got = "missing" if key not in m else "null" if value is None else f"{type(value).__name__} {value!r:.40}"
            raise RecordError("schema", f"{where}[{i}]: needs a string {s.role_key!r} and {s.content_key!r}, "
                                        f"{key!r} is {got}")
        out.append((role, content))
    return out


def _label(cfg: SftConfig, s: SectionConfig, role: str, rendered: str) -> bool:
    if s.action in ("train", "mask"):
        return s.action == "train"
    return label_of_role(cfg, role, rendered) == "train"


def _last_only(flags: list[bool]) -> list[bool]:
    last = max((i for i, f in enumerate(flags) if f), default=None)
    return [i == last for i in range(len(flags))]


def build_item(cfg: SftConfig, sections: tuple[SectionConfig, ...], obj: Any, at: str | None = None) -> Item:
    """One item of a source; `at` names `obj` in the record (`responses[2]`, a `list_field` element) for the reject
    messages. Whether anything trained is left is the source's question (`build_record`), not one element's."""
    item = Item()
    trained = item.trained
    for s in sections:
        where = ".".join(p for p in (at, s.field) if p)  # a section without `field` is in a list_field source
        value = obj if s.field is None else get_path(obj, s.field, where)
        mode = section_mode(s)
        if mode == "value":
            item.values.extend(_numbers(value, where, cfg.output.value_dtype))
            continue
        if mode == "text":
            if not isinstance(value, str):
                raise RecordError("schema", f"{where}: expected a string, got {type(value).__name__}")
            action = s.action or "train"
            train = action == "train" if action in ("train", "mask") else label_of_role(cfg, action) == "train"
            item.texts.append(value)
            if train:
                trained.append(value)
            _add_text(item, [(value, train)], s.add_special_tokens)
            continue
        # messages: a chat template conversation and/or a parsed transcript
        pairs, rendered, flags, headers = _conversation(cfg, s, value, where)
        contents = [c.strip() if headers is not None else c for _, c in pairs]
        item.texts.extend(contents)
        trained += [c for (_, c), f in zip(pairs, flags) if f]
        if s.template:
            _add_template(item, s, [Message(r, rr, c, f) for (r, _), rr, c, f in zip(pairs, rendered, contents, flags)])
        else:  # raw transcript: the text exactly as given; headers masked, contents by role
            pieces: list[tuple[str, bool]] = []
            for h, (_, c), f in zip(headers or [], pairs, flags):
                pieces += [(h, False), (c, f)]
            _add_text(item, pieces, s.add_special_tokens)
    return item


def _conversation(cfg: SftConfig, s: SectionConfig, value: Any, where: str
                  ) -> tuple[list[tuple[str, str]], list[str], list[bool], list[str] | None]:
    """A messages section's (role, content) pairs, rendered roles, train flags and (parsed transcript)
    headers; RecordError('schema') when the field does not fit the section."""
    headers: list[str] | None = None
    if s.parse == "hh":
        if not isinstance(value, str):
            raise RecordError("schema", f"{where}: expected a transcript string, got {type(value).__name__}")
        turns = parse_hh(value)
        pairs = [(r, c) for r, _, c in turns]
        headers = [h for _, h, _ in turns]
    elif isinstance(value, str):
        if s.action in (None, "train", "mask"):
            raise RecordError("schema", f"{where}: a string in a template section needs action: <role>")
        pairs = [(s.action, value)]
    else:
        if s.action not in (None, "train", "mask"):
            raise RecordError("schema",
                              f"{where}: action {s.action!r} needs a string field, got {type(value).__name__}")
        pairs = _messages(value, s, where)
    rendered = [s.role_map.get(r, r) for r, _ in pairs]
    if isinstance(value, str) and s.parse is None:
        flags = [label_of_role(cfg, s.action, rendered[0]) == "train"]
    else:
        flags = [_label(cfg, s, r, rr) for (r, _), rr in zip(pairs, rendered)]
    if s.train_turns == "last":
        flags = _last_only(flags)
    return pairs, rendered, flags, headers


def _add_template(item: Item, s: SectionConfig, msgs: list[Message]) -> None:
    """Messages join the previous template unit when its special-token setting matches (one conversation)."""
    prev = item.units[-1] if item.units else None
    if isinstance(prev, TemplateUnit) and prev.add_special_tokens == s.add_special_tokens \
            and not prev.generation_prompt:
        prev.messages.extend(msgs)
        prev.generation_prompt = s.generation_prompt
    else:
        item.units.append(TemplateUnit(msgs, s.add_special_tokens, s.generation_prompt))


def _add_text(item: Item, pieces: list[tuple[str, bool]], add_special: bool) -> None:
    prev = item.units[-1] if item.units else None
    if isinstance(prev, TextUnit) and prev.add_special_tokens == add_special:
        prev.pieces.extend(pieces)
    else:
        item.units.append(TextUnit(list(pieces), add_special))


@dataclass
class SourceData:
    items: list[Item]
    truncated_items: int   # list elements dropped by preprocessing.max_items


def build_record(cfg: SftConfig, record: Any) -> dict[str, SourceData]:
    """Every output key's items for one record; RecordError when the record does not fit the schema."""
    if not isinstance(record, Mapping):
        raise RecordError("schema", f"record must be a JSON object, got {type(record).__name__}")
    max_items = cfg.preprocessing.max_items
    out: dict[str, SourceData] = {}
    list_lengths: dict[str, int] = {}
    for key, src in cfg.input.sources.items():
        if src.list_field is None:
            out[key] = SourceData([build_item(cfg, src.sections, record)], 0)
            _check_trained(cfg, key, None, out[key].items)
            continue
        elements = get_path(record, src.list_field)
        if not isinstance(elements, list):
            raise RecordError("schema", f"{src.list_field!r}: expected a list, got {type(elements).__name__}")
        if not elements:
            raise RecordError("empty", f"{src.list_field!r}: empty list")
        list_lengths[key] = len(elements)
        cut = len(elements) - max_items if max_items and len(elements) > max_items else 0
        kept = elements[:len(elements) - cut]
        out[key] = SourceData([build_item(cfg, src.sections, e, f"{src.list_field}[{i}]") for i, e in enumerate(kept)],
                              cut)
        _check_trained(cfg, key, src.list_field, out[key].items)
    if len(set(list_lengths.values())) > 1:
        raise RecordError("list_length_mismatch", "list fields are parallel and must have equal lengths: "
                          + ", ".join(f"{k}={n}" for k, n in list_lengths.items()))
    return out


def _check_trained(cfg: SftConfig, key: str, list_field: str | None, items: list[Item]) -> None:
    """RecordError('no_trained_text') when the source means to train something and all of it, over every item (all
    responses of a group), is blank: one blank response among others is a sequence like any other. Also when a
    masked source that can train has an item with no part to train (a chat of user turns only): its sequence has no
    trained token, which the shards drop the record for (`no_trained_tokens`); here, before QC, it is a reject that
    takes no exact-dedup digest from a trainable twin."""
    trained = [t for item in items for t in item.trained]
    if trained and not any(t.strip() for t in trained):
        raise RecordError("no_trained_text", f"{key}: every part to be trained is empty or blank")
    lay = layout(cfg, key)
    if lay["mask"] and lay["can_train"]:
        for i, item in enumerate(items):
            if not item.trained:
                where = f"{list_field}[{i}]" if list_field is not None else key
                raise RecordError("no_trained_text", f"{where}: nothing to train (no turn or section that trains)")


def record_text(data: dict[str, SourceData]) -> str:
    """The text quality control judges: every content, in source/section order, joined by blank lines."""
    return "\n\n".join(t for sd in data.values() for item in sd.items for t in item.texts if t)


def qc_text(record: Any, sft_cfg: SftConfig) -> str | None:
    """Text for quality control, or None when the record does not fit the `sft.input` schema (a reject)."""
    return qc_check(record, sft_cfg)[0]


def qc_check(record: Any, sft_cfg: SftConfig) -> tuple[str | None, str | None]:
    """(text, None), or (None, "<reason>: <detail>") for a reject message; reasons as in prepare's stats
    (schema, empty, bad_value, list_length_mismatch, no_trained_text)."""
    try:
        return record_text(build_record(sft_cfg, record)), None
    except RecordError as exc:
        return None, str(exc)
