"""`SftMode`: the SFT/DPO/GRPO side of streamprep.modes (see there for what a mode decides)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import orjson

from streamprep import backends, logs
from streamprep.layout import RunLayout
from streamprep.modes import Mode
from streamprep.sft.chat import load_chat_tokenizer
from streamprep.sft.config import SftConfig
from streamprep.sft.prepare import config_digest, prepare_part
from streamprep.sft.records import qc_check
from streamprep.sources.base import REJECT_EXCERPT, BadRecord, excerpt_of

log = logs.get("sft")


class SftMode(Mode):
    """QC judges `qc_text(record)`; kept rows carry the original record; shards are sequences + loss masks."""

    name = "sft"
    appends_eod = False
    text_exports = False   # SFT shards are listed by their receipts; Parquet/blend are for pretraining text

    def __init__(self, sft_cfg: SftConfig):
        self.cfg = sft_cfg  # the typed `sft:` section

    @classmethod
    def of(cls, sft: SftConfig | Mapping[str, Any]) -> SftMode:
        """The mode of a run's SftConfig or of the validated dict a shard task carries (registry.MODES)."""
        return cls(sft if isinstance(sft, SftConfig) else SftConfig.from_dict(sft))

    def screen(self, items: list[tuple[Any, Any]], text_field: str) -> tuple[list[tuple[Any, Any]], list[Any]]:
        """A record that does not fit `sft:` becomes a BadRecord (check "schema"); QC judges the text
        `qc_check` extracts, under `text_field`."""
        out, judged = [], []
        for rec, pos in items:
            if not isinstance(rec, BadRecord):
                text, why = qc_check(rec, self.cfg)
                if text is None:
                    rec = BadRecord(f"sft: {why}", _excerpt(rec, text_field), check="schema")
                else:
                    judged.append({**rec, text_field: text})
            out.append((rec, pos))
        return out, judged

    def kept_row(self, text: str, meta: dict[str, Any], record: Any) -> dict[str, Any]:
        return {"text": text, "meta": meta, "record": record}

    def plan_key(self) -> dict[str, Any]:
        return {"sft": config_digest(self.cfg)}

    def fixed_backend(self, requested: str) -> dict[str, Any]:
        """Always hf: loss masks need character offsets, which gigatoken lacks (so its selection and identity check
        would be wasted); recorded as chosen, with the reason, from the start of the run."""
        return {"requested": requested, "name": "hf", "version": backends.installed_version("hf"),
                "reason": "sft: loss masks need character offsets, which only hf gives"}

    def shard_prefix(self, layout: RunLayout, dataset: str, part: str) -> Path:
        return layout.sft_prefix(dataset, part)

    def load_tokenizer(self, tokenizer_path: str, backend: str = "hf") -> Any:
        """The chat tokenizer: tokenizer.json + its template, from the run's tokenizer dir. Always HF
        `tokenizers`, whatever `backend` says: loss masks need character offsets, which gigatoken lacks."""
        return load_chat_tokenizer(str(Path(tokenizer_path).parent))

    def tokenize(self, task: Any, tokenizer: Any) -> tuple[dict[str, Any], dict[str, Path]]:
        """Sequences + loss masks per output key (streamprep.sft.prepare); the receipt lists every file."""
        prefix = Path(task.prefix)
        st = prepare_part(task.input_path, prefix, tokenizer, self.cfg, task.tokenizer_fingerprint)
        if st["dropped"]:  # kept by QC, in no shard: counted in the receipt, named here and in the audit's examples
            first = st["dropped_records"][0]
            log.warning("sft shards dropped records", dataset=task.dataset, part=task.part, dropped=st["dropped"],
                        first_line=first["line"], first_reason=f"{first['reason']}: {first['detail']}")
        keys = st.get("keys", {})
        shard_stats = {"num_documents": st["documents"], "num_tokens": sum(k["tokens"] for k in keys.values()),
                       "num_input_records": st["records"], "dropped_empty": [], "tokens_hist": {},
                       "sft": {k: v for k, v in st.items() if k not in ("files", "seconds")},
                       "seconds": st.get("seconds", 0.0)}
        return shard_stats, {f: prefix.parent / f for f in st["files"]}


def _excerpt(rec: Any, text_field: str) -> str:
    """What the reject line shows: the record itself, as JSON (a post-training record has no text field: its
    excerpt read "None")."""
    if isinstance(rec, dict) and isinstance(rec.get(text_field), str):
        return excerpt_of(rec, text_field)
    return orjson.dumps(rec, default=repr, option=orjson.OPT_NON_STR_KEYS).decode()[:REJECT_EXCERPT]
