"""The run's tokenizer: loaded offline from `tokenizer.path`, or a byte-level BPE trained on kept text.

Either way it is saved to RUN_DIR/tokenizer/tokenizer.json with `fingerprint.json` (SHA-256 of that
file, vocab size, EOD id). A resumed run finds the saved copy and reuses it instead of retraining.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import orjson
from tokenizers import Tokenizer

from streamprep import atomic, logs
from streamprep.config import ConfigError

log = logs.get("tokenizer")
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<unk>", "<mask>"]
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")
SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@dataclass(frozen=True)
class TokenizerInfo:
    path: Path            # RUN_DIR/tokenizer/tokenizer.json
    fingerprint: str      # "sha256:<hex>"
    vocab_size: int       # len(tokenizer), added tokens included (Megatron's dtype rule uses this)
    eod_id: int | None
    eod_token: str | None

    def to_json(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "vocab_size": self.vocab_size, "eod_id": self.eod_id,
                "eod_token": self.eod_token}


def _source_file(path: Path) -> Path:
    if path.is_file():
        return path
    if (path / "tokenizer.json").is_file():
        return path / "tokenizer.json"
    raise ConfigError(f"config: 'tokenizer.path': no tokenizer.json in {path}")


def _eod(tok: Tokenizer, config_dir: Path | None, wanted: str | None) -> tuple[str | None, int | None]:
    names: list[str] = [wanted] if wanted else []
    cfg_file = config_dir / "tokenizer_config.json" if config_dir else None
    if not wanted and cfg_file and cfg_file.is_file():
        eos = orjson.loads(cfg_file.read_bytes()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str):
            names.append(eos)
    names += [] if wanted else list(EOD_CANDIDATES)
    for name in names:
        tid = tok.token_to_id(name)
        if tid is not None:
            return name, tid
    if wanted:
        raise ConfigError(f"config: 'tokenizer.eod_token': {wanted!r} is not in the tokenizer's vocabulary")
    return None, None


def _info(saved: Path, eod_token: str | None) -> TokenizerInfo:
    tok = Tokenizer.from_file(str(saved))
    name, tid = _eod(tok, saved.parent, eod_token)
    digest = hashlib.sha256(saved.read_bytes()).hexdigest()
    return TokenizerInfo(saved, f"sha256:{digest}", tok.get_vocab_size(with_added_tokens=True), tid, name)


def prepare(tok_cfg: dict[str, Any], run_dir: Path, texts: Iterable[str] | None = None) -> TokenizerInfo:
    """Copy (or train, from `texts`) the tokenizer into the run dir once; later calls reuse it."""
    out_dir = run_dir / "tokenizer"
    saved = out_dir / "tokenizer.json"
    fp_file = out_dir / "fingerprint.json"
    if saved.is_file() and fp_file.is_file():
        info = _info(saved, tok_cfg.get("eod_token"))
        recorded = atomic.read_json(fp_file)
        if recorded.get("fingerprint") == info.fingerprint:
            log.info("reusing the run's tokenizer", fingerprint=info.fingerprint, vocab_size=info.vocab_size)
            return _check_eod(info, tok_cfg)
        log.warning("tokenizer copy does not match its fingerprint; recreating it", path=str(saved))
    out_dir.mkdir(parents=True, exist_ok=True)
    if tok_cfg.get("path"):
        src = _source_file(Path(tok_cfg["path"]))
        atomic.write_bytes(saved, src.read_bytes())
        for side in SIDE_FILES:
            if (src.parent / side).is_file():
                atomic.write_bytes(out_dir / side, (src.parent / side).read_bytes())
        log.info("tokenizer loaded", source=str(src))
    else:
        if texts is None:
            raise ValueError("training a tokenizer needs the run's kept texts")
        atomic.write_bytes(saved, train_bpe(texts, **tok_cfg["train"]).to_str().encode("utf-8"))
        log.info("tokenizer trained", vocab_size=tok_cfg["train"]["vocab_size"])
    info = _info(saved, tok_cfg.get("eod_token") or (None if tok_cfg.get("path") else "</s>"))
    atomic.write_json(fp_file, info.to_json())
    return _check_eod(info, tok_cfg)


def check_config(tok_cfg: dict[str, Any]) -> None:
    """Load `tokenizer.path` and find its EOD token at config time: a file that is not a tokenizer, or an
    EOD token it lacks, fails before anything is written rather than after the whole ingest."""
    wanted = tok_cfg.get("eod_token")
    if not tok_cfg.get("path"):
        if wanted and wanted not in SPECIAL_TOKENS:
            raise ConfigError(f"config: 'tokenizer.eod_token': a trained tokenizer has only the special tokens "
                              f"{', '.join(SPECIAL_TOKENS)}, got {wanted!r}")
        return
    src = _source_file(Path(tok_cfg["path"]))
    try:
        tok = Tokenizer.from_file(str(src))
    except Exception as exc:  # tokenizers raises a bare Exception for unparsable files
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]
        raise ConfigError(f"config: 'tokenizer.path': {src} is not a tokenizer.json ({reason})") from None
    name, tid = _eod(tok, src.parent, wanted)
    _check_eod(TokenizerInfo(src, "", tok.get_vocab_size(with_added_tokens=True), tid, name), tok_cfg)


def _check_eod(info: TokenizerInfo, tok_cfg: dict[str, Any]) -> TokenizerInfo:
    if tok_cfg.get("append_eod") and info.eod_id is None:
        raise ConfigError("config: 'tokenizer.append_eod' is true but the tokenizer has no end-of-text token; "
                          "set 'tokenizer.eod_token'")
    return info


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int) -> Tokenizer:
    """Byte-level BPE with the special tokens <s> </s> <pad> <unk> <mask> (ids 0..4), deterministic."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(_chunks(texts), vocab_size=vocab_size, min_frequency=min_frequency,
                            special_tokens=SPECIAL_TOKENS, show_progress=False)
    return bpe._tokenizer


def _chunks(texts: Iterable[str], size: int = 1000) -> Iterator[list[str]]:
    buf: list[str] = []
    for t in texts:
        buf.append(t)
        if len(buf) == size:
            yield buf
            buf = []
    if buf:
        yield buf


def iter_part_texts(parts: Iterable[Path]) -> Iterator[str]:
    for p in parts:
        with open(p, "rb") as fh:
            for line in fh:
                yield orjson.loads(line)["text"]
