"""The `sft:` config section: defaults and validation; every error names its dotted key.

    sft:
      input:
        sections: [...]            # one output, key "text"        (exactly one of sections / sources)
        sources:                   # several outputs, aligned by document
          <key>: {sections: [...], list_field: <field> | null, mask_key: loss_mask | <name> | false}
      mask: {<role>: train | mask}  # how template / transcript messages are labelled, by role
      mask_default: mask            # roles not listed in `mask`
      preprocessing: {max_seq_len, overlong: truncate | drop, min_chars, max_chars, max_items}
      output: {dtype, mask_dtype, value_dtype, domain_key, max_tokens_per_shard}

A section: {field, action: train | mask | value | <role>, template, add_special_tokens, parse, role_map,
role_key, content_key, train_turns: all | last, generation_prompt}. See docs/sft.md.

`validate_sft_config` is idempotent: validating its own output returns an equal dict. `SftConfig.from_dict`
turns that dict into frozen, typed objects (`load_sft_config` does both); `to_dict()` gives the dict back
exactly, which is the wire form shard tasks carry and the plan hash digests.
"""
from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from streamprep.config import SPEC, ConfigError, FrozenSection, printable

ACTIONS = ("train", "mask", "value")
LABELS = ("train", "mask")
PARSERS = ("hh",)
TRAIN_TURNS = ("all", "last")
OVERLONG = ("truncate", "drop")
SEQ_DTYPES = ("auto", "uint16", "int32", "int64")
MASK_DTYPES = ("uint8", "bool")          # bool is stored as uint8 0/1: Megatron has no bool dtype code
VALUE_DTYPES = ("float32", "float64")
DEFAULT_MASK = {"assistant": "train"}
DEFAULT_MASK_KEY = "loss_mask"
SINGLE_KEY = "text"                      # output key of the single-output form (input.sections)
RESERVED_KINDS = ("sequence", "value")   # file kinds; a mask_key may not take these names

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]*\Z")   # output keys, mask keys (used in file names)
ROLE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*\Z")
FIELD_RE = re.compile(r"^[^.\s][^\s]*\Z")

SECTION_DEFAULTS: dict[str, Any] = {
    "field": None,
    "action": None,               # null: by message role (template / parse), else train
    "template": False,
    "add_special_tokens": False,
    "parse": None,
    "role_map": {},
    "role_key": "role",
    "content_key": "content",
    "train_turns": "all",
    "generation_prompt": False,
}
SOURCE_DEFAULTS: dict[str, Any] = {"sections": None, "list_field": None, "mask_key": DEFAULT_MASK_KEY}
PREPROCESSING_DEFAULTS: dict[str, Any] = {
    "max_seq_len": None, "overlong": "truncate", "min_chars": 0, "max_chars": None, "max_items": None,
}
OUTPUT_DEFAULTS: dict[str, Any] = {
    "dtype": "int32", "mask_dtype": "uint8", "value_dtype": "float32", "domain_key": None,
    "max_tokens_per_shard": None,
}
TOP_KEYS = ("input", "mask", "mask_default", "preprocessing", "output")


class SftConfigError(ValueError):
    """A bad `sft:` value. `.key` is the dotted key (`sft.input.sections[1].action`), `.reason` the problem;
    str(e) is `"<key>: <reason>"`, one line."""

    def __init__(self, key: str, reason: str):
        key, reason = printable(key), printable(reason)
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _mapping(key: str, v: Any) -> Mapping[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise SftConfigError(key, f"must be a mapping, got {type(v).__name__}")
    return v


def _known(key: str, given: Mapping[str, Any], allowed: Any) -> None:
    for k in given:
        if k not in allowed:
            raise SftConfigError(f"{key}.{k}", "unknown key")


def _choice(key: str, v: Any, choices: tuple[str, ...]) -> str:
    if v not in choices:
        raise SftConfigError(key, f"must be one of {', '.join(choices)}, got {v!r}")
    return v


def _flag(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise SftConfigError(key, f"must be true or false, got {v!r}")
    return v


def _count(key: str, v: Any, lo: int, nullable: bool = True) -> int | None:
    if v is None and nullable:
        return None
    if not _is_int(v) or v < lo:
        raise SftConfigError(key, f"must be an integer >= {lo}{' or null' if nullable else ''}, got {v!r}")
    return v


def _field(key: str, v: Any, nullable: bool) -> str | None:
    if v is None and nullable:
        return None
    if not isinstance(v, str) or not FIELD_RE.match(v) or v.endswith(".") or ".." in v:
        what = "a field name or dotted path such as 'messages' or 'meta.domain'"
        raise SftConfigError(key, f"must be {what}{' or null' if nullable else ''}, got {v!r}")
    return v


def _role(key: str, v: Any) -> str:
    if not isinstance(v, str) or not ROLE_RE.match(v):
        raise SftConfigError(key, f"must be a role name (letters, digits, _ -), got {v!r}")
    return v


def _section(key: str, raw: Any, in_list: bool) -> dict[str, Any]:
    if not isinstance(raw, Mapping):
        raise SftConfigError(key, f"must be a mapping with at least 'field' or 'action', got {type(raw).__name__}")
    _known(key, raw, SECTION_DEFAULTS)
    s = {k: copy.deepcopy(raw.get(k, d)) for k, d in SECTION_DEFAULTS.items()}
    s["field"] = _field(f"{key}.field", s["field"], nullable=True)
    if s["field"] is None and not in_list:
        raise SftConfigError(f"{key}.field", "is required (it may be left out only in a source with list_field, "
                                             "where it means the list element itself)")
    action = s["action"]
    if action is not None:
        if not isinstance(action, str) or not action:
            raise SftConfigError(f"{key}.action", f"must be train, mask, value or a role name, got {action!r}")
        if action not in ACTIONS:
            _role(f"{key}.action", action)
    for flag in ("template", "add_special_tokens", "generation_prompt"):
        _flag(f"{key}.{flag}", s[flag])
    if s["parse"] is not None:
        _choice(f"{key}.parse", s["parse"], PARSERS)
    _choice(f"{key}.train_turns", s["train_turns"], TRAIN_TURNS)
    rm = _mapping(f"{key}.role_map", s["role_map"])
    s["role_map"] = {_role(f"{key}.role_map", k): _role(f"{key}.role_map.{k}", v) for k, v in rm.items()}
    for k in ("role_key", "content_key"):
        if not isinstance(s[k], str) or not s[k]:
            raise SftConfigError(f"{key}.{k}", f"must be a non-empty string, got {s[k]!r}")
    if action == "value":
        for k in ("template", "add_special_tokens", "generation_prompt"):
            if s[k]:
                raise SftConfigError(f"{key}.{k}", "must be false for action: value (raw numbers are not tokenised)")
        if s["parse"] is not None:
            raise SftConfigError(f"{key}.parse", "must be null for action: value")
    if s["generation_prompt"] and not s["template"]:
        raise SftConfigError(f"{key}.generation_prompt", "needs template: true")
    if not (s["template"] or s["parse"]):  # a plain section reads no message: these would do nothing
        for k in ("role_map", "role_key", "content_key", "train_turns"):
            if s[k] != SECTION_DEFAULTS[k]:
                raise SftConfigError(f"{key}.{k}", "applies to messages only: set template: true or parse")
    if s["parse"] is not None and action not in (None, "train", "mask"):
        raise SftConfigError(f"{key}.action", f"a parsed transcript is labelled by its turns' roles: leave action "
                                              f"out (or train / mask for all turns), got {action!r}")
    return s


def _source(key: str, raw: Any) -> dict[str, Any]:
    raw = _mapping(key, raw)
    _known(key, raw, SOURCE_DEFAULTS)
    src = {k: copy.deepcopy(raw.get(k, d)) for k, d in SOURCE_DEFAULTS.items()}
    src["list_field"] = _field(f"{key}.list_field", src["list_field"], nullable=True)
    mk = src["mask_key"]
    if mk is None:
        mk = src["mask_key"] = DEFAULT_MASK_KEY
    if mk is not False:
        if not isinstance(mk, str) or not NAME_RE.match(mk):
            raise SftConfigError(f"{key}.mask_key", f"must be a name (letters, digits, _ -) or false, got {mk!r}")
        if mk.casefold() in RESERVED_KINDS:  # case-insensitive: the kinds name files, on such file systems too
            raise SftConfigError(f"{key}.mask_key", f"must not be {mk!r} (used for the sequence/value files)")
    sections = src["sections"]
    if not isinstance(sections, list) or not sections:
        raise SftConfigError(f"{key}.sections", "must be a non-empty list of sections")
    src["sections"] = [_section(f"{key}.sections[{i}]", s, src["list_field"] is not None)
                       for i, s in enumerate(sections)]
    return src


def _distinct_files(sources: Mapping[str, dict[str, Any]]) -> None:
    """Each output key's files (`<key>_sequence`, `<key>_value`, `<key>_<mask_key>`) are its own, ignoring case:
    `chosen` and `Chosen` are one file on a case-insensitive file system, and a key `a` with mask_key `b_sequence`
    wrote key `a_b`'s sequence file."""
    owner: dict[str, tuple[str, str]] = {}
    for name, src in sources.items():
        for kind in RESERVED_KINDS + ((src["mask_key"],) if src["mask_key"] else ()):
            stem = f"{name}_{kind}"
            first, its = owner.setdefault(stem.casefold(), (name, stem))
            if first != name:
                raise SftConfigError(f"sft.input.sources.{name}", f"its file {stem}.bin would be output key "
                                     f"'{first}''s {its}.bin (file names compare ignoring case); rename one")


def check_output_dtype(cfg: Mapping[str, Any]) -> None:
    """The run-level keys an `sft:` run would ignore without a word: its token ids take `sft.output.dtype`, so a
    pretraining `output.dtype` set beside it is an error rather than a setting that does nothing."""
    if cfg.get("sft") is not None and cfg["output"]["dtype"] != "auto":
        raise ConfigError(f"config: 'output.dtype' is the pretraining shards' dtype; an sft: run writes its token ids "
                          f"in 'sft.output.dtype' (set {cfg['output']['dtype']} there)")


def check_valid_fraction(cfg: Mapping[str, Any]) -> None:
    """`output.valid_fraction` splits blend.json's data, and an `sft:` run writes no blend.json (nor any split): set
    beside it, it would do nothing, so it is an error."""
    if cfg.get("sft") is not None and cfg["output"]["valid_fraction"] > 0:
        raise ConfigError(f"config: 'output.valid_fraction' ({cfg['output']['valid_fraction']}) splits blend.json's "
                          f"data, and an sft: run writes no blend.json nor a validation split (leave it out)")


def check_parquet(cfg: Mapping[str, Any]) -> None:
    """An `sft:` run writes no Parquet/TSV export, so an `output.parquet` key, or `output.num_shards_multiple_of`
    (its shard count), set to other than its default would do nothing: an error naming it, as for `output.dtype`."""
    if cfg.get("sft") is None:
        return
    out = cfg["output"]
    keys = [(f"parquet.{key}", out["parquet"][key], spec[1]) for key, spec in SPEC["output"]["parquet"].items()]
    keys.append(("num_shards_multiple_of", out["num_shards_multiple_of"], SPEC["output"]["num_shards_multiple_of"][1]))
    for key, value, default in keys:
        if value != default:
            raise ConfigError(f"config: 'output.{key}' sets the pretraining Parquet/TSV export, and an sft: run "
                              f"writes none (leave it out)")


def validate_sft_config(section: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return the `sft:` section with every default filled, or raise SftConfigError naming the first bad key."""
    if section is None:
        raise SftConfigError("sft", "section is empty (it needs at least input.sections or input.sources)")
    sec = _mapping("sft", section)
    _known("sft", sec, TOP_KEYS)

    inp = _mapping("sft.input", sec.get("input"))
    _known("sft.input", inp, ("sections", "sources", "list_field", "mask_key"))
    if ("sections" in inp) == ("sources" in inp):
        raise SftConfigError("sft.input", "needs exactly one of 'sections' (one output) or 'sources' (several)")
    sources: dict[str, Any] = {}
    if "sections" in inp:
        sources[SINGLE_KEY] = _source("sft.input", inp)
    else:
        for k in ("list_field", "mask_key"):
            if k in inp:
                raise SftConfigError(f"sft.input.{k}", "belongs inside a source with 'sources' (sft.input.sources.<key>)")
        raw_sources = _mapping("sft.input.sources", inp["sources"])
        if not raw_sources:
            raise SftConfigError("sft.input.sources", "must name at least one output key")
        for name, raw in raw_sources.items():
            if not isinstance(name, str) or not NAME_RE.match(name):
                raise SftConfigError(f"sft.input.sources.{name}", "output key must be a name (letters, digits, _ -)")
            sources[name] = _source(f"sft.input.sources.{name}", raw)
        _distinct_files(sources)

    mask_raw = sec.get("mask", DEFAULT_MASK)
    mask = {}
    for role, label in _mapping("sft.mask", mask_raw).items():
        _role(f"sft.mask.{role}", role)
        mask[role] = _choice(f"sft.mask.{role}", label, LABELS)
    mask_default = _choice("sft.mask_default", sec.get("mask_default", "mask"), LABELS)

    pre_raw = _mapping("sft.preprocessing", sec.get("preprocessing"))
    _known("sft.preprocessing", pre_raw, PREPROCESSING_DEFAULTS)
    pre = {k: pre_raw.get(k, d) for k, d in PREPROCESSING_DEFAULTS.items()}
    pre["max_seq_len"] = _count("sft.preprocessing.max_seq_len", pre["max_seq_len"], 1)
    _choice("sft.preprocessing.overlong", pre["overlong"], OVERLONG)
    pre["min_chars"] = _count("sft.preprocessing.min_chars", pre["min_chars"], 0, nullable=False)
    pre["max_chars"] = _count("sft.preprocessing.max_chars", pre["max_chars"], 1)
    if pre["max_chars"] is not None and pre["max_chars"] < pre["min_chars"]:
        raise SftConfigError("sft.preprocessing.max_chars", f"must be >= min_chars ({pre['min_chars']}), got {pre['max_chars']}")
    pre["max_items"] = _count("sft.preprocessing.max_items", pre["max_items"], 1)
    if pre["max_items"] is not None and all(src["list_field"] is None for src in sources.values()):
        raise SftConfigError("sft.preprocessing.max_items", "applies to sources with list_field only, and none has "
                                                            "one (it would do nothing)")

    out_raw = _mapping("sft.output", sec.get("output"))
    _known("sft.output", out_raw, OUTPUT_DEFAULTS)
    out = {k: out_raw.get(k, d) for k, d in OUTPUT_DEFAULTS.items()}
    _choice("sft.output.dtype", out["dtype"], SEQ_DTYPES)
    _choice("sft.output.mask_dtype", out["mask_dtype"], MASK_DTYPES)
    _choice("sft.output.value_dtype", out["value_dtype"], VALUE_DTYPES)
    out["domain_key"] = _field("sft.output.domain_key", out["domain_key"], nullable=True)
    out["max_tokens_per_shard"] = _count("sft.output.max_tokens_per_shard", out["max_tokens_per_shard"], 1)

    cfg = {"input": {"sources": sources}, "mask": mask, "mask_default": mask_default,
           "preprocessing": pre, "output": out}
    return cfg


# ---- typed, frozen view of a validated section ------------------------------------------------------------
# Fields follow the key order validate_sft_config emits (the *_DEFAULTS dicts), so to_dict() reproduces its
# dict exactly. Defaults are NOT repeated here: they live only in the *_DEFAULTS dicts above.


@dataclass(frozen=True)
class SectionConfig(FrozenSection):
    """One section of a source: where a field goes and how it is labelled (see SECTION_DEFAULTS)."""

    field: str | None
    action: str | None
    template: bool
    add_special_tokens: bool
    parse: str | None
    role_map: Mapping[str, str]
    role_key: str
    content_key: str
    train_turns: str
    generation_prompt: bool


@dataclass(frozen=True)
class SourceConfig(FrozenSection):
    """One output key: its sections, the optional list field, and the mask's name (False: none)."""

    sections: tuple[SectionConfig, ...]
    list_field: str | None
    mask_key: str | bool

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SourceConfig:
        return cls(**{**d, "sections": tuple(SectionConfig.from_dict(s) for s in d["sections"])})


@dataclass(frozen=True)
class InputConfig(FrozenSection):
    sources: Mapping[str, SourceConfig]   # output key -> source, in config order

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> InputConfig:
        return cls(MappingProxyType({k: SourceConfig.from_dict(v) for k, v in d["sources"].items()}))


@dataclass(frozen=True)
class PreprocessingConfig(FrozenSection):
    max_seq_len: int | None
    overlong: str
    min_chars: int
    max_chars: int | None
    max_items: int | None


@dataclass(frozen=True)
class SftOutputConfig(FrozenSection):
    dtype: str
    mask_dtype: str
    value_dtype: str
    domain_key: str | None
    max_tokens_per_shard: int | None


@dataclass(frozen=True)
class SftConfig(FrozenSection):
    """The validated `sft:` section, typed and frozen; picklable (it pickles as its plain dict)."""

    input: InputConfig
    mask: Mapping[str, str]               # role -> train | mask
    mask_default: str
    preprocessing: PreprocessingConfig
    output: SftOutputConfig


def load_sft_config(section: Mapping[str, Any] | None) -> SftConfig:
    """Validate a raw `sft:` section once (SftConfigError names the bad key) and return it typed."""
    return SftConfig.from_dict(validate_sft_config(section))


def section_mode(section: SectionConfig) -> str:
    """`value` | `messages` (template or parsed transcript, labelled by role) | `text` (one plain string)."""
    if section.action == "value":
        return "value"
    if section.template or section.parse:
        return "messages"
    return "text"


def layout(cfg: SftConfig, key: str) -> dict[str, Any]:
    """Which files one output key writes: a token sequence, a loss mask (and its name), values.

    A mask is written unless every token section is a plain `train` section (no template, no transcript):
    pretraining-style text needs none. `mask_key: false` suppresses it explicitly.
    """
    src = cfg.input.sources[key]
    token_sections = [s for s in src.sections if section_mode(s) != "value"]
    needs_mask = any(section_mode(s) == "messages" or (s.action or "train") != "train" for s in token_sections)
    mask_name = src.mask_key if (token_sections and needs_mask and src.mask_key is not False) else None
    can_train = any(_section_can_train(cfg, s) for s in token_sections)
    return {"sequence": bool(token_sections), "mask": mask_name, "can_train": can_train,
            "value": any(section_mode(s) == "value" for s in src.sections)}


def _section_can_train(cfg: SftConfig, s: SectionConfig) -> bool:
    action = s.action or ("roles" if section_mode(s) == "messages" else "train")
    if action == "train":
        return True
    if action == "mask":
        return False
    if action == "roles":
        return "train" in cfg.mask.values() or cfg.mask_default == "train"
    # labelled as records._conversation labels the turn: by its role, else by the role it is rendered as
    return label_of_role(cfg, action, s.role_map.get(action)) == "train"


def label_of_role(cfg: SftConfig, role: str, rendered_role: str | None = None) -> str:
    """`mask[role]`, else `mask[rendered_role]` (after role_map), else `mask_default`."""
    if role in cfg.mask:
        return cfg.mask[role]
    if rendered_role is not None and rendered_role in cfg.mask:
        return cfg.mask[rendered_role]
    return cfg.mask_default
