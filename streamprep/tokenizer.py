"""The run's tokenizer: loaded offline from `tokenizer.path`, or a byte-level BPE trained on kept text.

Either way it is saved to RUN_DIR/tokenizer/tokenizer.json with `fingerprint.json` (SHA-256 of that
file, vocab size, EOD id, and the encoding backend chosen for it by streamprep.backends.select with its
identity check). A resumed run finds the saved copy and reuses it instead of retraining; a copy changed or damaged
since (`_copy_fault`) is made again, as a missing one is, from `tokenizer.path` only while that is still the tokenizer
the run recorded (`_check_source`).
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import orjson
from tokenizers import Tokenizer

from streamprep import atomic, backends, logs
from streamprep.config import ConfigError, DatasetConfig, TokenizerConfig, json_kind
from streamprep.layout import TOKENIZER_SIDE_FILES, RunLayout, completed_receipt, read_json
from streamprep.sources.local import check_path

log = logs.get("tokenizer")
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<unk>", "<mask>"]
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")
SIDE_FILES = TOKENIZER_SIDE_FILES
Selector = Callable[[str, Path, Sequence[str]], dict[str, Any]]  # backends.select(requested, path, texts)
# check_config's identity check of a forced gigatoken, by (backend, fingerprint): the run's tokenizer, a copy of
# the same bytes, takes it instead of loading gigatoken and checking again (same inputs, same record)
_validated: dict[tuple[str, str], dict[str, Any]] = {}
_id_bounds: dict[str, int] = {}  # backends.id_bound by fingerprint (~20 ms): the config check's file and the run's copy


def _id_bound(tok: Tokenizer, fingerprint: str) -> int:
    if fingerprint not in _id_bounds:
        _id_bounds[fingerprint] = backends.id_bound(tok)
    return _id_bounds[fingerprint]


@dataclass(frozen=True)
class TokenizerInfo:
    path: Path            # RUN_DIR/tokenizer/tokenizer.json
    fingerprint: str      # "sha256:<hex>"
    vocab_size: int       # len(tokenizer), added tokens included (Megatron's dtype rule uses this)
    eod_id: int | None
    eod_token: str | None
    backend: Mapping[str, Any] = field(default_factory=lambda: {"name": "hf"})  # backends.select's record
    id_bound: int = 0     # one past the highest token id (backends.id_bound): what the shards' dtype must hold

    @property
    def backend_name(self) -> str:
        """The backend shard tasks load: "hf", "gigatoken" (forced), or "auto" (gigatoken that passed the
        run's identity check; each worker checks its first texts of each dataset again and may still fall back to HF)."""
        if self.backend.get("name") != "gigatoken":
            return "hf"
        return "gigatoken" if self.backend.get("requested") == "gigatoken" else "auto"

    def to_json(self) -> dict[str, Any]:
        """fingerprint.json, and the manifest's `tokenizer`: the backend is not in it (same bytes whichever ran)."""
        return {"fingerprint": self.fingerprint, "vocab_size": self.vocab_size, "eod_id": self.eod_id,
                "eod_token": self.eod_token}


def source_file(path: Path) -> Path:
    """The tokenizer.json `tokenizer.path` names: the file itself, or the one in that folder."""
    if path.is_file():
        return path
    if (path / "tokenizer.json").is_file():
        return path / "tokenizer.json"
    raise ConfigError(f"config: 'tokenizer.path': no tokenizer.json in {path}")


def tokenizer_config(folder: Path) -> dict[str, Any]:
    """The tokenizer_config.json in `folder` ({} without one): its `eos_token`, the SFT side's chat template and
    special tokens. One that is not a JSON object is a config error naming it."""
    cfg_file = folder / "tokenizer_config.json"
    if not cfg_file.is_file():
        return {}
    try:
        tcfg = orjson.loads(cfg_file.read_bytes())
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"config: 'tokenizer.path': {cfg_file} is not JSON ({exc})") from None
    if not isinstance(tcfg, dict):
        raise ConfigError(f"config: 'tokenizer.path': {cfg_file} is {json_kind(tcfg)}, not an object")
    return tcfg


def _eod(tok: Tokenizer, config_dir: Path | None, wanted: str | None, warn: bool = False
         ) -> tuple[str | None, int | None]:
    """(EOD token, id): `wanted`, else tokenizer_config.json's eos_token, else the first of EOD_CANDIDATES in the
    vocabulary. `warn`: say so when the eos_token is not in it (once a run: for the run's copy, `_info`)."""
    names: list[str] = [wanted] if wanted else []
    eos = None if wanted else _eos_token(config_dir)
    if eos is not None:
        names.append(eos)
    names += [] if wanted else list(EOD_CANDIDATES)
    for name in names:
        tid = tok.token_to_id(name)
        if tid is not None:
            if warn and eos is not None and name != eos:
                # transformers (Megatron's preprocess_data.py) adds such a token and appends its new id instead
                log.warning("tokenizer_config.json's eos_token is not in the vocabulary: another EOD token is used",
                            file=str(config_dir / "tokenizer_config.json"), eos_token=eos, eod_token=name, eod_id=tid)
            return name, tid
    if wanted:
        raise ConfigError(f"config: 'tokenizer.eod_token': {wanted!r} is not in the tokenizer's vocabulary")
    return None, None


def _eos_token(config_dir: Path | None) -> str | None:
    """tokenizer_config.json's eos_token (a string or an AddedToken's dict) in `config_dir`; None without one."""
    eos = tokenizer_config(config_dir).get("eos_token") if config_dir else None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return eos if isinstance(eos, str) else None


def fingerprint_of(tok_file: Path) -> str:
    """A tokenizer.json's fingerprint: "sha256:<hex>" of its bytes."""
    return f"sha256:{hashlib.sha256(tok_file.read_bytes()).hexdigest()}"


def _info(saved: Path, eod_token: str | None, fingerprint: str | None = None) -> TokenizerInfo:
    """`fingerprint`: the copy's, when the caller has just checked it (`saved_tokenizer`), else hashed here."""
    tok = backends.hf_tokenizer(saved)
    name, tid = _eod(tok, saved.parent, eod_token, warn=True)
    fingerprint = fingerprint or fingerprint_of(saved)
    return TokenizerInfo(saved, fingerprint, tok.get_vocab_size(with_added_tokens=True), tid, name,
                         id_bound=_id_bound(tok, fingerprint))


def _copy_fault(saved: Path, fp_file: Path, recorded: Any, src: Path | None) -> str | None:
    """Why the run's tokenizer copy cannot be reused (None: it can). Checked before the copy is loaded, so a damaged
    file is recreated as a changed or missing one is, instead of failing every resume with an error naming no file;
    so is a side file the copy lost that `src` (tokenizer.path's file) has beside it (an SFT run then found no chat
    template at every resume). `recorded`: `fp_file`'s content."""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("fingerprint"), str):
        return f"{fp_file.name} is unreadable"
    if recorded["fingerprint"] != fingerprint_of(saved):
        return f"{saved.name} does not match its fingerprint"
    try:
        tokenizer_config(saved.parent)  # read for the EOD token and the chat template
    except ConfigError:
        return "tokenizer_config.json is not a JSON object"
    lost = [side for side in SIDE_FILES if src is not None and (src.parent / side).is_file()
            and not (saved.parent / side).is_file()]
    return f"{lost[0]} is missing (tokenizer.path has one)" if lost else None


def _side_changes(src_dir: Path, copy_dir: Path) -> list[tuple[str, str, str]]:
    """(name, copy's fingerprint, source's) of each side file (SIDE_FILES) whose bytes at `src_dir` differ from
    the run's copy in `copy_dir` ("missing" for one absent): an edited eos_token or chat template at tokenizer.path
    went unnamed, though the run goes on with its copy's (only tokenizer.json was compared)."""
    def print_of(file: Path) -> str:
        return fingerprint_of(file) if file.is_file() else "missing"

    changes = [(side, print_of(copy_dir / side), print_of(src_dir / side)) for side in SIDE_FILES]
    return [change for change in changes if change[1] != change[2]]


def _recorded_in_receipts(layout: RunLayout) -> dict[str, Any] | None:
    """The tokenizer a completed shard's receipt names (its `eod_id` only when one was appended): what the run
    recorded once its fingerprint.json is lost. None: no shard yet."""
    for path in sorted(layout.receipts_dir.glob("*/*.json")):
        try:
            rec = completed_receipt(path)
        except ValueError:  # a damaged receipt: its shard is redone anyway
            continue
        if rec is not None and isinstance(rec.get("tokenizer_fingerprint"), str):
            eod = rec.get("eod_id")
            return {"fingerprint": rec["tokenizer_fingerprint"], **({"eod_id": eod} if eod is not None else {})}
    return None


def _check_source(src: Path, tok_cfg: TokenizerConfig, layout: RunLayout, recorded: Any, fault: str) -> None:
    """Refuse to recreate the run's copy (`fault`: why it cannot be reused) from `src` when that is no longer the
    tokenizer the run recorded (`recorded`, fingerprint.json's content, else a shard's receipt): the run would
    switch tokenizer or EOD id at the resume and redo its shards with it, where a changed `tokenizer.path` is
    otherwise only a warning (a new tokenizer needs a new run dir). A fresh run has nothing recorded."""
    was = recorded if isinstance(recorded, dict) and isinstance(recorded.get("fingerprint"), str) \
        else _recorded_in_receipts(layout)
    if was is None:
        return
    if (now := fingerprint_of(src)) != was["fingerprint"]:
        differs = f"{src} is no longer the run's tokenizer (recorded {was['fingerprint']}, now {now})"
    elif "eod_id" in was and (eod := _eod(backends.hf_tokenizer(src), src.parent, tok_cfg.eod_token)[1]) \
            != was["eod_id"]:
        differs = f"the files at {src.parent} give EOD id {eod}, not the {was['eod_id']} recorded"
    else:
        return
    raise ConfigError(f"config: 'tokenizer.path': the run's tokenizer copy ({layout.tokenizer_dir}) cannot be reused "
                      f"({fault}) and {differs}; restore the run's tokenizer files at tokenizer.path, or use a new "
                      f"run dir")


def saved_tokenizer(tok_cfg: TokenizerConfig, run_dir: Path, select: Selector = backends.select) -> TokenizerInfo | None:
    """The run's tokenizer copy when it is intact (same fingerprint as recorded, readable side files), else None
    (`prepare` makes it again); ConfigError when it would be made again from a `tokenizer.path` that is no longer
    the run's tokenizer (`_check_source`)."""
    layout = RunLayout(run_dir)
    saved, fp_file = layout.tokenizer_json, layout.tokenizer_fingerprint
    src = source_file(Path(tok_cfg.path)) if tok_cfg.path else None
    recorded = read_json(fp_file)
    if not (saved.is_file() and fp_file.is_file()):
        if src is not None:
            _check_source(src, tok_cfg, layout, recorded, f"{fp_file.name if saved.is_file() else saved.name} "
                                                          f"is missing")
        return None
    if (fault := _copy_fault(saved, fp_file, recorded, src)) is None:
        info = _info(saved, tok_cfg.eod_token, recorded["fingerprint"])  # `_copy_fault` has just hashed it
        if (was := recorded.get("eod_id")) != info.eod_id:  # an edited tokenizer_config.json
            fault = f"its side files give EOD id {info.eod_id}, not the {was} recorded"
    if fault is not None:
        if src is not None:
            _check_source(src, tok_cfg, layout, recorded, fault)
        log.warning("tokenizer copy is changed or damaged; recreating it", path=str(saved.parent), reason=fault)
        return None
    log.info("reusing the run's tokenizer", fingerprint=info.fingerprint, vocab_size=info.vocab_size)
    if src is not None and (now := fingerprint_of(src)) != info.fingerprint:
        log.warning("tokenizer.path's file changed since the run copied it; the run goes on with its copy (a new "
                    "tokenizer needs a new run dir)", path=str(src), copy=info.fingerprint, now=now)
    for side, copy, now in _side_changes(src.parent, saved.parent) if src is not None else ():
        log.warning("tokenizer.path's side file differs from the run's copy; the run goes on with its copy (a new "
                    "tokenizer needs a new run dir)", path=str(src.parent / side), copy=copy, now=now)
    backend = read_json(layout.tokenizer_backend)
    return _with_backend(_check_eod(info, tok_cfg), tok_cfg, layout.tokenizer_backend, select, backend)


def _with_backend(info: TokenizerInfo, tok_cfg: TokenizerConfig, record_file: Path, select: Selector,
                  recorded: Mapping[str, Any] | None = None, texts: Sequence[str] = ()) -> TokenizerInfo:
    """`info` with its backend: the one recorded (`record_file`, bookkeeping beside the checkpoints) when it was
    chosen for the same `tokenizer.backend` and library version, else chosen now by `select` (the identity
    check: `backends.select`, or a job's call of it on a worker) and recorded."""
    if not (isinstance(recorded, Mapping) and recorded.get("requested") == tok_cfg.backend
            and recorded.get("version") == backends.installed_version(recorded.get("name", ""))):
        validated = _validated.pop((tok_cfg.backend, info.fingerprint), None)
        try:
            recorded = validated if validated is not None and not texts else \
                select(tok_cfg.backend, info.path, texts)
        except backends.BackendError as exc:
            raise RuntimeError(str(exc)) from None
        atomic.write_json(record_file, recorded)
    log.info("tokenizer backend", **{k: v for k, v in recorded.items() if k != "check"})
    return replace(info, backend=recorded)


def prepare(tok_cfg: TokenizerConfig, run_dir: Path, texts: Iterable[str] | None = None,
            select: Selector = backends.select) -> TokenizerInfo:
    """Copy (or train, from `texts`) the tokenizer into the run dir once; later calls reuse it. `select` chooses
    the backend (`backends.select`'s signature): a job runs it on a worker, which keeps what it loaded."""
    layout = RunLayout(run_dir)
    out_dir, saved, fp_file = layout.tokenizer_dir, layout.tokenizer_json, layout.tokenizer_fingerprint
    info = saved_tokenizer(tok_cfg, run_dir, select)
    if info is not None:
        return info
    out_dir.mkdir(parents=True, exist_ok=True)
    check_texts: list[str] = []  # the first texts the tokenizer is trained on join the backend's identity check
    if tok_cfg.path:
        src = source_file(Path(tok_cfg.path))
        atomic.write_bytes(saved, src.read_bytes())
        for side in SIDE_FILES:
            if (src.parent / side).is_file():
                atomic.write_bytes(out_dir / side, (src.parent / side).read_bytes())
            else:  # a copy being recreated keeps no side file its source lacks
                (out_dir / side).unlink(missing_ok=True)
        log.info("tokenizer loaded", source=str(src))
    else:
        if texts is None:
            raise ValueError("training a tokenizer needs the run's kept texts")
        for side in SIDE_FILES:  # a trained tokenizer has none
            (out_dir / side).unlink(missing_ok=True)
        bpe = train_bpe(_first_kept(texts, check_texts), tok_cfg.train.vocab_size, tok_cfg.train.min_frequency)
        atomic.write_bytes(saved, bpe.to_str().encode("utf-8"))
        # the trainer stops short of train.vocab_size when the text has fewer merges to learn
        log.info("tokenizer trained", vocab_size=bpe.get_vocab_size(with_added_tokens=True),
                 requested_vocab_size=tok_cfg.train.vocab_size)
    info = _check_eod(_info(saved, tok_cfg.eod_token or (None if tok_cfg.path else "</s>")), tok_cfg)
    # the backend is chosen before fingerprint.json is written: a run killed in between has no fingerprint,
    # redoes this step the same way, and records the same choice (check scope included)
    info = _with_backend(info, tok_cfg, layout.tokenizer_backend, select, texts=check_texts)
    atomic.write_json(fp_file, info.to_json())
    return info


def _first_kept(texts: Iterable[str], keep: list[str]) -> Iterator[str]:
    """`texts`, remembering the first backends.CHECK_DOCS of them in `keep`."""
    for text in texts:
        if len(keep) < backends.CHECK_DOCS:
            keep.append(text)
        yield text


def check_section(cfg: dict[str, Any]) -> None:
    """Config validation (registry.CHECKS): `tokenizer.path` (resolved by config) exists and loads, with its EOD."""
    tok = cfg["tokenizer"]
    if tok["path"] is not None and not Path(tok["path"]).is_dir():  # a folder: `source_file` names what it lacks
        check_path("tokenizer.path", tok["path"])
    bound = check_config(TokenizerConfig.from_dict(tok), select_backend=cfg.get("sft") is None)  # SFT: always hf
    sample_mb = tok["train"]["sample_mb"]
    if tok["path"] is None and sample_mb is not None \
            and not any(sample_shares([DatasetConfig.from_dict(d) for d in cfg["datasets"]], sample_mb).values()):
        # the sample would be empty whatever the datasets keep: a tokenizer of the 256 bytes alone, exit 0
        raise ConfigError(f"config: 'tokenizer.train.sample_mb': {sample_mb:g} MB shared out by the dataset weights "
                          f"gives no dataset a whole byte of training text; make it larger")
    key = "sft.output.dtype" if cfg.get("sft") is not None else "output.dtype"
    dtype = ((cfg.get("sft") or {}).get("output") or {}).get("dtype", "int32") if cfg.get("sft") is not None \
        else cfg["output"]["dtype"]
    if dtype == "uint16" and bound > 1 << 16:  # else found after the whole ingest, at every re-run
        raise ConfigError(f"config: '{key}': uint16 cannot hold the tokenizer's token ids (up to {bound - 1}); "
                          f"use auto or int32")


def check_config(tok_cfg: TokenizerConfig, *, select_backend: bool = True) -> int:
    """Load `tokenizer.path` and find its EOD token at config time: a file that is not a tokenizer, or an
    EOD token it lacks, fails before anything is written rather than after the whole ingest; a forced gigatoken
    is checked too, unless `select_backend` is false (a mode that never loads it). Returns one past
    the highest token id the run's tokenizer can give (`backends.id_bound`; a trained one's `vocab_size`)."""
    wanted = tok_cfg.eod_token
    if not tok_cfg.path:
        if wanted and wanted not in SPECIAL_TOKENS:
            raise ConfigError(f"config: 'tokenizer.eod_token': a trained tokenizer has only the special tokens "
                              f"{', '.join(SPECIAL_TOKENS)}, got {wanted!r}")
        return tok_cfg.train.vocab_size
    src = source_file(Path(tok_cfg.path))
    try:
        tok = backends.hf_tokenizer(src)  # the same load serves the run's fingerprint, backend check and audit
    except BaseException as exc:  # noqa: BLE001 - a bare Exception for unparsable files, a panic for some others
        if not isinstance(exc, Exception) and not backends.is_panic(exc):
            raise
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]
        raise ConfigError(f"config: 'tokenizer.path': {src} is not a tokenizer.json ({reason})") from None
    fingerprint = fingerprint_of(src)
    if dropout := getattr(tok.model, "dropout", None):  # each call samples its own merges: no two runs would agree
        raise ConfigError(f"config: 'tokenizer.path': {src} sets BPE dropout {dropout:g}, which gives other ids at "
                          f"each call; set its model.dropout to null")
    if (fault := _encode_fault(tok)) is not None:
        raise ConfigError(f"config: 'tokenizer.path': {src} loads but cannot encode text ({fault})")
    name, tid = _eod(tok, src.parent, wanted)
    _check_eod(TokenizerInfo(src, "", tok.get_vocab_size(with_added_tokens=True), tid, name), tok_cfg)
    # forced gigatoken: a tokenizer it cannot encode exactly fails here
    if select_backend and tok_cfg.backend == "gigatoken":
        try:
            record = backends.select("gigatoken", src)
        except backends.BackendError as exc:
            raise ConfigError(f"config: 'tokenizer.backend': {exc}") from None
        _validated.clear()
        _validated["gigatoken", fingerprint] = record
    return _id_bound(tok, fingerprint)


def _encode_fault(tok: Tokenizer) -> str | None:
    """Why HF cannot encode the identity check's probe texts (`backends.PROBES`: words, scripts, emoji, control
    characters) with `tok`, its error's first line, else None. A model whose `unk_token` is not in its vocabulary
    (WordLevel, WordPiece, a BPE without byte fallback) raises on every unknown word: the run failed after the
    whole ingest, exit 1, at every re-run. A panic is not its fault: it comes from some texts with some added
    tokens, whose documents are dropped (textshard)."""
    for text in backends.PROBES:
        try:
            tok.encode(text, add_special_tokens=False)
        except BaseException as exc:  # noqa: BLE001 - a panic is a BaseException only
            if backends.is_panic(exc):
                continue
            if not isinstance(exc, Exception):
                raise
            return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]
    return None


def _check_eod(info: TokenizerInfo, tok_cfg: TokenizerConfig) -> TokenizerInfo:
    if tok_cfg.append_eod and info.eod_id is None:
        eos = _eos_token(info.path.parent)  # named: else nothing tells why the eos_token the user sees is not used
        why = f" (its tokenizer_config.json's eos_token {eos!r} is not in the vocabulary)" if eos is not None else ""
        raise ConfigError(f"config: 'tokenizer.append_eod' is true but the tokenizer has no end-of-text token{why}; "
                          "set 'tokenizer.eod_token'")
    return info


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int) -> Tokenizer:
    """Byte-level BPE with the special tokens <s> </s> <pad> <unk> <mask> (ids 0..4), deterministic. Words (the
    pre-tokenizer's pre-tokens) longer than TRAIN_RUN_CHARS are trained on in pieces (`_cut_long_words`)."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    cut = [0]
    pieces = _cut_long_words(texts, bpe.pre_tokenizer.pre_tokenize_str, cut)
    bpe.train_from_iterator(_chunks(pieces), vocab_size=vocab_size, min_frequency=min_frequency,
                            special_tokens=SPECIAL_TOKENS, show_progress=False)
    if cut[0]:
        log.info("tokenizer training: words longer than max_chars were trained on in pieces", words=cut[0],
                 max_chars=TRAIN_RUN_CHARS)
    return bpe._tokenizer


# The longest word (pre-token) BPE training sees whole. tokenizers' trainer applies a merge to a word at
# O(word length) per occurrence, so one long word made training quadratic: a 320 000-char ACGT record
# took 74 s with vocab_size 1 000 (160 KB: 13 s; 1.5 MB: not done in 300 s); in 8 192-char pieces 2 s (1.5 MB:
# 10 s); a run of 200 000 newlines in one record, a word of the pre-tokenizer too, 88 s. A word lies within a run of
# non-whitespace (but for a leading space) or of whitespace, and the shared corpora's and docs/*.md's longest run
# is 5 650 chars (a JSON tool call).
TRAIN_RUN_CHARS = 8192
# whitespace as the pre-tokenizer's regex has it (Python's \s also takes \x1c-\x1f, punctuation to it)
_SPACE, _NOT_SPACE = r"[^\S\x1c-\x1f]", r"[\S\x1c-\x1f]"
_LONG_RUN = re.compile(rf"(?<!{_NOT_SPACE}){_NOT_SPACE}{{{TRAIN_RUN_CHARS + 1},}}"
                       rf"|(?<!{_SPACE}){_SPACE}{{{TRAIN_RUN_CHARS + 1},}}")  # each whole run longer than that


def _cut_long_words(texts: Iterable[str], pre_tokenize: Callable[[str], list[tuple[str, tuple[int, int]]]],
                    cut: list[int]) -> Iterator[str]:
    """`texts`, each word longer than TRAIN_RUN_CHARS cut every TRAIN_RUN_CHARS chars (its text yielded as the
    pieces between the cuts; `cut[0]` counts the words). Words are `pre_tokenize`'s (the trainer's own
    pre-tokenizer), asked only about runs of non-whitespace or of whitespace longer than TRAIN_RUN_CHARS: a word
    lies within one but for a leading space (" word", not counted; a run alone splits as in its text, but that a
    whitespace run's last character may start the next word there, where a cut changes no word). So a text the
    pre-tokenizer splits into words no longer than that (minified JSON, a path) is yielded as it is, the same
    bytes trained."""
    for text in texts:
        cuts: list[int] = []
        for run in _LONG_RUN.finditer(text) if len(text) > TRAIN_RUN_CHARS else ():
            for _, (start, end) in pre_tokenize(run.group()):
                if end - start > TRAIN_RUN_CHARS:
                    cut[0] += 1
                    cuts.extend(range(run.start() + start + TRAIN_RUN_CHARS, run.start() + end, TRAIN_RUN_CHARS))
        if not cuts:
            yield text
            continue
        yield from (text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)]))


def _chunks(texts: Iterable[str], size: int = 1000) -> Iterator[list[str]]:
    buf: list[str] = []
    for t in texts:
        buf.append(t)
        if len(buf) == size:
            yield buf
            buf = []
    if buf:
        yield buf


HOLDOUT_EVERY = 10  # of the training sample, every 10th document is held out to measure the tokenizer


def sample_shares(datasets: Sequence[DatasetConfig], sample_mb: float) -> dict[str, int]:
    """Bytes of kept text each dataset gives the training sample: `sample_mb` split by dataset weight."""
    total_w = sum(d.weight for d in datasets)
    return {d.name: int(sample_mb * 1024 * 1024 * d.weight / total_w) for d in datasets}


def sample_ready(shares: dict[str, int], sealed_text: dict[str, int], done: dict[str, bool]) -> bool:
    """Every dataset's sealed parts hold its share (`IngestState.sealed_text_bytes`), or it finished with less."""
    return all(done.get(n) or sealed_text.get(n, 0) >= share for n, share in shares.items())


def sample_texts(parts: dict[str, list[Path]], shares: dict[str, int]) -> Iterator[str]:
    """The sample, in dataset (config) order then record order: each dataset's first `share` bytes of kept text,
    from its sealed `parts`. A part after the one that completes the share is never opened: it may not exist."""
    for name, share in shares.items():
        taken = 0
        if share <= 0:
            continue
        for text in iter_part_texts(parts.get(name, [])):
            taken += len(text.encode("utf-8"))
            yield text
            if taken >= share:
                break


def prepare_from_sample(tok_cfg: TokenizerConfig, run_dir: Path, texts: Iterable[str],
                        select: Selector = backends.select) -> TokenizerInfo:
    """Train on 9 of every 10 sampled documents; report bytes per token on the 10th (tokenizer/training.json)."""
    held_out: list[str] = []

    def train_part() -> Iterator[str]:
        for i, text in enumerate(texts):
            if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1:
                held_out.append(text)
            else:
                yield text

    info = prepare(tok_cfg, run_dir, train_part(), select)
    if training_report(run_dir) is None:
        if not held_out:  # a reused tokenizer whose report was lost: rebuild the held-out half only
            held_out = [t for i, t in enumerate(texts) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
        tok = backends.hf_tokenizer(info.path)
        n_bytes = sum(len(t.encode("utf-8")) for t in held_out)
        n_tokens = sum(len(e.ids) for e in tok.encode_batch(held_out, add_special_tokens=False))
        atomic.write_json(RunLayout(run_dir).tokenizer_training, {"sample_mb": tok_cfg.train.sample_mb, "held_out_documents": len(held_out),
                                   "held_out_bytes": n_bytes, "held_out_tokens": n_tokens,
                                   "bytes_per_token": round(n_bytes / n_tokens, 4) if n_tokens else None})
    return info


def train_on_parts(tok_cfg: TokenizerConfig, run_dir: Path, parts: list[Path]) -> TokenizerInfo:
    """`prepare` on every kept text of `parts`: a job runs it on a worker, so its driver reads no record."""
    return prepare(tok_cfg, run_dir, iter_part_texts(parts))


def train_on_sample(tok_cfg: TokenizerConfig, run_dir: Path, sealed: dict[str, list[Path]],
                    shares: dict[str, int]) -> TokenizerInfo:
    """`prepare_from_sample` on the sample of the sealed parts (`sample_texts`), on a worker likewise."""
    return prepare_from_sample(tok_cfg, run_dir, sample_texts(sealed, shares))


def training_report(run_dir: Path) -> dict[str, Any] | None:
    """The held-out measurement of a sample-trained tokenizer, if this run trained one that way. One that is not a
    JSON object (a damaged file) is none: the resume writes it again (`prepare_from_sample`), where its
    JSONDecodeError, naming no file, failed every `ingest` and `audit` of the run."""
    report = read_json(RunLayout(run_dir).tokenizer_training)
    return report if isinstance(report, dict) else None


def iter_part_texts(parts: Iterable[Path]) -> Iterator[str]:
    for p in parts:
        with open(p, "rb") as fh:
            for line in fh:
                yield orjson.loads(line)["text"]
