"""Declarative SFT / DPO / GRPO preparation with loss masks (pure core, no Ray). See docs/sft.md.

    cfg = load_sft_config(raw_yaml["sft"])              # a frozen SftConfig; SftConfigError names the dotted key
    text = qc_text(record, cfg)                          # what quality control judges; None = reject
    tok = load_chat_tokenizer(RunLayout(run_dir).tokenizer_dir)  # once per process
    stats = prepare_part(part_jsonl, out_prefix, tok, cfg, fingerprint)
"""
from streamprep.sft.chat import ChatTokenizer, load_chat_tokenizer
from streamprep.sft.config import SftConfig, SftConfigError, layout, load_sft_config, validate_sft_config
from streamprep.sft.prepare import encode_record, prepare_part
from streamprep.sft.records import RecordError, qc_check, qc_text

__all__ = ["ChatTokenizer", "RecordError", "SftConfig", "SftConfigError", "encode_record", "layout",
           "load_chat_tokenizer", "load_sft_config", "prepare_part", "qc_check", "qc_text", "validate_sft_config"]
