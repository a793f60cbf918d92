"""SFT / DPO / GRPO preparation (streamprep.sft) on the real chat samples: masks checked against the
rendered template, DPO pairs from HH-RLHF, GRPO groups with rewards, config errors, determinism."""
from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import yaml

from streamprep.binidx import IndexedDataset
from streamprep.sft import (SftConfig, SftConfigError, layout, load_chat_tokenizer, load_sft_config, prepare_part,
                            qc_check, qc_text, validate_sft_config)
from streamprep.sft.records import parse_hh
from helpers import REPO

CONFIGS = REPO / "configs"
PHI3 = "tokenizers/phi-3-mini"
PHI2 = "tokenizers/phi-2/tokenizer.json"
GLAIVE = "chat/glaive_toolcall_en_demo300.messages.jsonl"
HH = "chat/hh_rlhf_harmless_base_test.jsonl.gz"
FP = "sha256:test-fingerprint"


# ---- helpers --------------------------------------------------------------------------------------
def sft_section(name: str) -> dict[str, Any]:
    return yaml.safe_load((CONFIGS / f"{name}.yaml").read_text(encoding="utf-8"))["sft"]


def write_part(path: Path, records: list[Any], cfg: SftConfig) -> Path:
    """An ingest part as the pipeline writes it: {"text", "meta", "record"} per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        for r in records:
            fh.write(orjson.dumps({"text": qc_text(r, cfg) or "", "meta": {}, "record": r}) + b"\n")
    return path


def opened(out_dir: Path, prefix: str) -> IndexedDataset:
    ds = IndexedDataset.open(out_dir / prefix)
    assert ds.check() == []
    return ds


def trained_runs(ids: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    """Maximal runs of consecutive trained tokens."""
    runs, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def read_glaive(shared: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in (shared / GLAIVE).read_bytes().splitlines()]


def read_hh(shared: Path) -> list[dict[str, Any]]:
    with gzip.open(shared / HH, "rb") as fh:
        return [orjson.loads(line) for line in fh]


@pytest.fixture(scope="module")
def phi3(shared_data: Path):
    return load_chat_tokenizer(shared_data / PHI3)


# ---- SFT chat: glaive with phi-3-mini's chat template ----------------------------------------------
@pytest.fixture(scope="module")
def glaive(tmp_path_factory, shared_data: Path, phi3) -> dict[str, Any]:
    raw = sft_section("sft_chat")
    raw["preprocessing"]["max_seq_len"] = None   # every record, untruncated (one has a 6,000-char user turn)
    cfg = load_sft_config(raw)
    records = read_glaive(shared_data)
    root = tmp_path_factory.mktemp("glaive")
    part = write_part(root / "ingest" / "part-00000.jsonl", records, cfg)
    stats = prepare_part(part, root / "sft" / "part-00000", phi3, cfg, FP)
    return {"cfg": cfg, "records": records, "stats": stats, "out": root / "sft"}


@pytest.mark.slow
def test_glaive_masks_match_the_rendered_template(glaive: dict[str, Any], phi3) -> None:
    stats, out, records = glaive["stats"], glaive["out"], glaive["records"]
    assert stats["records"] == stats["documents"] == 300 and stats["dropped"] == {}
    assert stats["diagnostics"] == {"conversations": 300, "messages": 2214}  # no split mismatch, all rendered
    seq = opened(out, "part-00000_s0000_text_sequence")
    mask = opened(out, "part-00000_s0000_text_loss_mask")
    assert seq.dtype == np.int32 and mask.dtype == np.uint8
    assert np.array_equal(seq.lengths, mask.lengths) and len(seq) == 300
    role_map = {"function_call": "assistant", "tool": "user"}
    trained = total = 0
    for i, rec in enumerate(records):
        msgs = [{"role": role_map.get(m["role"], m["role"]), "content": m["content"]} for m in rec["messages"]]
        rendered = phi3.hf.apply_chat_template(msgs, tokenize=False)
        ids, m = seq[i], mask[i]
        # the sequence is exactly the full rendering, encoded without extra special tokens
        assert ids.tolist() == phi3.backend.encode(rendered, add_special_tokens=False).ids
        assert set(np.unique(m).tolist()) <= {0, 1}
        # trained tokens, run by run, are exactly the assistant turns' contents + phi-3's end-of-turn token
        expected = [m_["content"] + "<|end|>" for m_ in rec["messages"] if m_["role"] in ("assistant", "function_call")]
        assert [phi3.decode(r) for r in trained_runs(ids, m)] == expected, rec["id"]
        # role headers, system/user/tool turns and the final <|endoftext|> are masked
        assert m[0] == 0 and ids[-1] == phi3.backend.token_to_id("<|endoftext|>") and m[-1] == 0
        assert not m[ids == phi3.backend.token_to_id("<|assistant|>")].any()
        trained += int(m.sum())
        total += len(ids)
    assert stats["keys"]["text"] == {"documents": 300, "sequences": 300, "tokens": total, "trained_tokens": trained,
                                     "values": 0}
    assert 0.5 < trained / total < 0.75   # 62% on this sample: long assistant answers and JSON calls


@pytest.mark.slow
def test_glaive_meta_and_files(glaive: dict[str, Any]) -> None:
    stats, out = glaive["stats"], glaive["out"]
    assert stats["files"] == ["part-00000_s0000.meta.json",
                              "part-00000_s0000_text_loss_mask.bin", "part-00000_s0000_text_loss_mask.idx",
                              "part-00000_s0000_text_sequence.bin", "part-00000_s0000_text_sequence.idx"]
    meta = json.loads((out / "part-00000_s0000.meta.json").read_text())
    assert meta["documents"] == 300 and meta["tokenizer_fingerprint"] == FP and meta["vocab_size"] == 32011
    assert meta["keys"]["text"]["sequence"] == {"prefix": "part-00000_s0000_text_sequence", "dtype": "int32",
                                                "sequences": 300, "tokens": stats["keys"]["text"]["tokens"]}
    assert meta["keys"]["text"]["loss_mask"]["trained_tokens"] == meta["trained_tokens"] \
        == stats["keys"]["text"]["trained_tokens"]
    assert not list(out.glob(".*tmp*"))   # no temporary file left behind


def test_template_drops_unknown_roles_without_role_map(tmp_path: Path, glaive: dict[str, Any], phi3) -> None:
    """Without role_map phi-3's template renders no function_call/tool turn: counted, and only the
    assistant turns are trained."""
    cfg = load_sft_config({"input": {"sections": [{"field": "messages", "template": True}]}})
    records = glaive["records"][:40]
    stats = prepare_part(write_part(tmp_path / "p.jsonl", records, cfg), tmp_path / "o" / "p", phi3, cfg, FP)
    n_hidden = sum(m["role"] in ("function_call", "tool") for r in records for m in r["messages"])
    assert stats["diagnostics"]["messages_not_rendered"] == n_hidden > 0
    seq, mask = opened(tmp_path / "o", "p_s0000_text_sequence"), opened(tmp_path / "o", "p_s0000_text_loss_mask")
    for i, rec in enumerate(records):
        expected = [m["content"] + "<|end|>" for m in rec["messages"] if m["role"] == "assistant"]
        assert [phi3.decode(r) for r in trained_runs(seq[i], mask[i])] == expected


LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
          "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
          "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
          "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
          "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
          "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\\n\\n' %}"
         "{% set lm = messages[1:] %}{% else %}{% set first = '' %}{% set lm = messages %}{% endif %}{% for m in lm %}"
         "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}{{ '<start_of_turn>' + role + '\\n' + "
         "(first if loop.first else '') + m['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}")
NO_SYSTEM = ("{% for m in messages %}{% if m['role'] != 'system' %}### {{ m['role'] }}:\\n{{ m['content'] }}\\n\\n"
             "{% endif %}{% endfor %}")


def phi3_with_template(tmp_path: Path, shared_data: Path, template: str):
    """phi-3-mini's tokenizer with another chat template."""
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    shutil.copy(shared_data / PHI3 / "tokenizer.json", tok_dir)
    tcfg = json.loads((shared_data / PHI3 / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**tcfg, "chat_template": template}))
    return load_chat_tokenizer(tok_dir)


@pytest.mark.parametrize("template, system_run", [(LLAMA2, "Always answer in French.\n<</SYS>>\n\n"),
                                                   (GEMMA, "Always answer in French.\n\n"), (NO_SYSTEM, None)],
                         ids=["llama2", "gemma", "no_system"])
def test_a_system_prompt_merged_into_the_first_user_turn_is_rendered(tmp_path: Path, shared_data: Path,
                                                                     template: str, system_run: str | None) -> None:
    """Regression: a system message was located by rendering it alone, which Llama-2's and Gemma's templates only show
    together with the user turn after it: it was counted as `messages_not_rendered` (and summed in the audit) though
    the sequence holds it, and `mask: {system: train}` trained none of it. One the template leaves out is still
    counted and untrained; the sequence and the assistant's runs never change."""
    tok = phi3_with_template(tmp_path, shared_data, template)
    msgs = [{"role": "system", "content": "Always answer in French."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "La capitale de la France est Paris."}]
    expected = tok.backend.encode(tok.hf.apply_chat_template(msgs, tokenize=False), add_special_tokens=False).ids
    answers = None
    for mask, out in (({"assistant": "train"}, "a"), ({"assistant": "train", "system": "train"}, "s")):
        cfg = load_sft_config({"input": {"sections": [{"field": "messages", "template": True}]}, "mask": mask})
        stats = prepare_part(write_part(tmp_path / f"{out}.jsonl", [{"messages": msgs}], cfg), tmp_path / out / "p",
                             tok, cfg, FP)
        assert stats["documents"] == 1
        assert stats["diagnostics"].get("messages_not_rendered") == (1 if system_run is None else None)
        seq, lm = opened(tmp_path / out, "p_s0000_text_sequence"), opened(tmp_path / out, "p_s0000_text_loss_mask")
        assert seq[0].tolist() == expected
        runs = [tok.decode(r) for r in trained_runs(seq[0], lm[0])]
        if answers is None:
            answers = runs
            assert len(answers) == 1 and "Paris" in answers[0]
        else:
            assert runs == ([] if system_run is None else [system_run]) + answers


@pytest.mark.parametrize("template, runs", [
    (LLAMA2, ["Blue is one. <|endoftext|>", "Red works too. <|endoftext|>"]),  # phi-3's eos_token
    ("{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n\n{% endfor %}",
     ["Blue is one.\n\n", "Red works too.\n\n"])], ids=["llama2", "newline_header"])
def test_the_first_token_of_an_answer_the_templates_space_merges_into_is_trained(
        tmp_path: Path, shared_data: Path, template: str, runs: list[str]) -> None:
    """Regression: Llama-2's `[/INST]` + ' ' + content puts a space the first word merges with (`▁Blue`): the token
    straddled the header and the content and was masked, so no answer's first token was trained. A token whose
    masked characters are only the template's whitespace right before a trained content is trained now; a token of
    that whitespace alone (a header's `\n`) stays masked."""
    tok = phi3_with_template(tmp_path, shared_data, template)
    msgs = [{"role": "user", "content": "Name a primary colour."}, {"role": "assistant", "content": "Blue is one."},
            {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Red works too."}]
    cfg = load_sft_config({"input": {"sections": [{"field": "messages", "template": True}]}})
    stats = prepare_part(write_part(tmp_path / "p.jsonl", [{"messages": msgs}], cfg), tmp_path / "o" / "p", tok, cfg,
                         FP)
    assert "straddling_tokens_masked" not in stats["diagnostics"]
    seq, lm = opened(tmp_path / "o", "p_s0000_text_sequence"), opened(tmp_path / "o", "p_s0000_text_loss_mask")
    assert seq[0].tolist() == tok.backend.encode(tok.hf.apply_chat_template(msgs, tokenize=False),
                                                 add_special_tokens=False).ids
    assert [tok.decode(r) for r in trained_runs(seq[0], lm[0])] == runs


def test_token_labels_train_a_token_of_leading_whitespace_only_with_trained_text() -> None:
    """A token of trained characters and the template's whitespace before them is trained; one of that whitespace
    alone, or of whitespace and other masked characters, is not (a straddle, counted)."""
    from streamprep.sft.chat import token_labels

    #         text:  "ab" " " " " "Blue"   (chars 0-1 header, 2-3 whitespace before the content, 4-7 content)
    train = np.array([0, 0, 0, 0, 1, 1, 1, 1], dtype=np.uint8)
    lead = np.array([0, 0, 1, 1, 0, 0, 0, 0], dtype=np.uint8)
    offsets = np.array([[0, 2], [2, 3], [3, 6], [6, 8]])
    assert token_labels(offsets, train, lead)[0].tolist() == [0, 0, 1, 1]
    assert token_labels(offsets, train)[0].tolist() == [0, 0, 0, 1]
    straddle = np.array([[0, 1], [1, 6], [6, 8]])
    assert [a.tolist() if isinstance(a, np.ndarray) else a for a in token_labels(straddle, train, lead)] == \
        [[0, 0, 1], 1]


def test_qc_text_and_schema_rejects(glaive: dict[str, Any]) -> None:
    cfg, rec = glaive["cfg"], glaive["records"][0]
    text = qc_text(rec, cfg)
    assert text == "\n\n".join(m["content"] for m in rec["messages"])
    assert qc_text({"id": 1}, cfg) is None
    assert qc_check({"messages": "hello"}, cfg) == (None, "schema: messages: a string in a template section needs action: <role>")
    assert qc_check({"messages": []}, cfg) == (None, "schema: messages: expected a non-empty list of messages")
    assert qc_check({"messages": [{"role": "user", "content": 3}]}, cfg)[1].startswith("schema:")
    dpo = load_sft_config(sft_section("dpo"))
    assert qc_text({"chosen": "no transcript", "rejected": "\n\nHuman: hi\n\nAssistant: yo"}, dpo) is None


def test_chats_whose_text_is_split_into_other_messages_share_their_qc_text() -> None:
    """As sft.md §4 says: the QC text, which exact dedup compares, joins the contents by blank lines with no role
    or message boundary, so the same text split at a blank line into other messages is one text (a duplicate)."""
    cfg = load_sft_config(sft_section("sft_chat"))
    a = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4.\n\nAnything else?"}]
    b = [{"role": "user", "content": "What is 2+2?\n\nIt is 4."}, {"role": "assistant", "content": "Anything else?"}]
    assert qc_text({"messages": a}, cfg) == qc_text({"messages": b}, cfg) == "What is 2+2?\n\nIt is 4.\n\nAnything else?"


def test_a_message_without_content_is_a_schema_reject(tmp_path: Path, phi3) -> None:
    """Regression: a message whose content key was missing (a typo, `text` for `value`) or null read as "", so the
    record was kept and its assistant answer trained after an empty user turn, the question gone, with no reject."""
    cfg = load_sft_config({"input": {"sections": [{"field": "conversations", "template": True, "role_key": "from",
                                                   "content_key": "value",
                                                   "role_map": {"human": "user", "gpt": "assistant"}}]},
                           "mask": {"gpt": "train"}})
    answer = {"from": "gpt", "value": "The capital of Germany is Berlin."}
    recs = [{"conversations": [{"from": "human", "value": "What is the capital of Germany?"}, answer]},
            {"conversations": [{"from": "human", "text": "What is the capital of Germany?"}, answer]},
            {"conversations": [{"from": "human", "value": None}, answer]},
            {"conversations": [{"from": "human", "value": "What is the capital of Germany?"}, {"from": "gpt"}]}]
    why = "schema: conversations[{}]: needs a string 'from' and 'value', 'value' is {}"
    assert [qc_check(r, cfg)[1] for r in recs] == [None, why.format(0, "missing"), why.format(0, "null"),
                                                   why.format(1, "missing")]
    assert qc_check({"conversations": [{"from": "human", "value": 3}]}, cfg)[1] == why.format(0, "int 3")
    stats = prepare_part(write_part(tmp_path / "p.jsonl", recs, cfg), tmp_path / "o" / "p", phi3, cfg, FP)
    assert stats["dropped"] == {"schema": 3} and stats["documents"] == 1


def test_a_record_with_nothing_to_train_is_rejected_before_qc(glaive: dict[str, Any]) -> None:
    """Regression: a chat without a trained turn (user turns only, a system prompt alone) passed QC, took the
    exact-dedup digest, and the shards dropped it (`no_trained_tokens`), so its trainable twin, the same contents
    with the answer as an assistant turn, was rejected as its duplicate: neither was trained. It is a reject at QC
    now, as for a DPO transcript without an assistant turn; a source that trains nothing by config, or writes no
    mask (a GRPO prompt), is kept as before."""
    cfg = glaive["cfg"]
    q, a = "What is the boiling point of water at sea level?", "It boils at 100 degrees Celsius."
    why = "no_trained_text: text: nothing to train (no turn or section that trains)"
    for msgs in ([{"role": "user", "content": q}, {"role": "user", "content": a}],
                 [{"role": "system", "content": q}], [{"role": "user", "content": q}]):
        assert qc_check({"messages": msgs}, cfg) == (None, why)
    assert qc_check({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}, cfg) == \
        (f"{q}\n\n{a}", None)
    dpo = load_sft_config(sft_section("dpo"))
    human = "\n\nHuman: hello there, how are you"
    assert qc_check({"chosen": human, "rejected": f"{human}\n\nAssistant: fine"}, dpo) == \
        (None, "no_trained_text: chosen: nothing to train (no turn or section that trains)")
    assert qc_check({"chosen": f"{human}\n\nAssistant: fine", "rejected": f"{human}\n\nAssistant: bad"}, dpo)[1] is None
    listed = load_sft_config({"input": {"sources": {"chats": {"list_field": "chats", "sections": [
        {"field": "messages", "template": True}]}}}})
    chats = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]},
             {"messages": [{"role": "user", "content": q}]}]
    assert qc_check({"chats": chats}, listed) == \
        (None, "no_trained_text: chats[1]: nothing to train (no turn or section that trains)")
    untrained = load_sft_config({**sft_section("sft_chat"), "mask": {"function_call": "mask"}})
    assert qc_check({"messages": [{"role": "user", "content": q}]}, untrained) == (q, None)
    grpo = load_sft_config(sft_section("grpo"))
    assert qc_check({**grpo_records()[0]}, grpo)[1] is None


def test_sharegpt_keys_give_the_same_trained_tokens(tmp_path: Path, shared_data: Path, glaive: dict[str, Any],
                                                     phi3) -> None:
    """The original ShareGPT file (from/value, human/gpt/function_call/observation) via role_key/content_key
    and role_map: the trained runs equal those of the derived role/content file (only the system turn,
    holding the tools there, differs)."""
    convs = json.loads((shared_data / "chat/glaive_toolcall_en_demo300.sharegpt.json").read_text())[:60]
    cfg = load_sft_config({
        "input": {"sections": [{"field": "conversations", "template": True, "role_key": "from", "content_key": "value",
                                "role_map": {"human": "user", "gpt": "assistant", "function_call": "assistant",
                                             "observation": "user"}}]},
        "mask": {"gpt": "train", "function_call": "train"}})
    stats = prepare_part(write_part(tmp_path / "p.jsonl", convs, cfg), tmp_path / "o" / "p", phi3, cfg, FP)
    assert stats["documents"] == 60 and stats["diagnostics"]["messages"] == sum(len(c["conversations"]) for c in convs)
    seq, mask = opened(tmp_path / "o", "p_s0000_text_sequence"), opened(tmp_path / "o", "p_s0000_text_loss_mask")
    ref_seq = opened(glaive["out"], "part-00000_s0000_text_sequence")
    ref_mask = opened(glaive["out"], "part-00000_s0000_text_loss_mask")
    for i in range(60):
        assert trained_runs(seq[i], mask[i]) == trained_runs(ref_seq[i], ref_mask[i])


# ---- DPO: HH-RLHF harmless-base ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hh(tmp_path_factory, shared_data: Path, phi3) -> dict[str, Any]:
    cfg = load_sft_config(sft_section("dpo"))
    records = read_hh(shared_data)
    root = tmp_path_factory.mktemp("hh")
    stats = prepare_part(write_part(root / "part-00000.jsonl", records, cfg), root / "dpo" / "part-00000", phi3, cfg, FP)
    return {"cfg": cfg, "records": records, "stats": stats, "out": root / "dpo"}


@pytest.mark.slow
def test_hh_dpo_pairs_train_only_the_final_assistant_turn(hh: dict[str, Any], phi3) -> None:
    stats, out, records = hh["stats"], hh["out"], hh["records"]
    # four 'chosen' transcripts end with a blank assistant turn: nothing to train, the pair is dropped
    assert stats["dropped"] == {"no_trained_text": 4}
    dropped = [d["line"] for d in stats["dropped_records"]]
    assert dropped == [86, 516, 925, 1103]
    kept = [r for i, r in enumerate(records) if i not in set(dropped)]
    assert stats["documents"] == len(kept) == 2308
    limit = hh["cfg"].preprocessing.max_seq_len
    files = {}
    for key in ("chosen", "rejected"):
        seq, mask = opened(out, f"part-00000_s0000_{key}_sequence"), opened(out, f"part-00000_s0000_{key}_loss_mask")
        assert len(seq) == len(mask) == len(kept) and np.array_equal(seq.lengths, mask.lengths)
        files[key] = (seq, mask)
        for j, rec in enumerate(kept):
            ids, m = seq[j], mask[j].astype(bool)
            final = parse_hh(rec[key])[-1][2]
            idx = np.flatnonzero(m)
            assert idx.size and (np.diff(idx) == 1).all(), "one contiguous trained run"
            if len(ids) < limit:
                assert idx[-1] == len(ids) - 1, "the run is the end of the transcript"
                assert phi3.decode(ids[m].tolist()).strip() == final.strip()
                assert phi3.decode(ids.tolist()) == rec[key]   # the transcript verbatim, no added BOS/EOS
            else:
                assert final.strip().startswith(phi3.decode(ids[m].tolist()).strip())
    # chosen and rejected share the masked prompt (all turns before the final answer), token for token
    same_prompt = 0
    for j, rec in enumerate(kept):
        pc = rec["chosen"][:rec["chosen"].rindex("\n\nAssistant:")]
        pr = rec["rejected"][:rec["rejected"].rindex("\n\nAssistant:")]
        if pc != pr:
            continue
        same_prompt += 1
        (cs, cm), (rs, rm) = files["chosen"], files["rejected"]
        first_c, first_r = int(np.argmax(cm[j])), int(np.argmax(rm[j]))
        assert cs[j][:first_c].tolist() == rs[j][:first_r].tolist()
    assert same_prompt > 0.95 * len(kept)


def test_hh_through_the_chat_template(tmp_path: Path, shared_data: Path, phi3) -> None:
    """parse: hh + template: true renders the turns as phi-3 user/assistant messages (contents stripped)."""
    cfg = load_sft_config({"input": {"sections": [{"field": "chosen", "parse": "hh", "template": True,
                                                       "train_turns": "last"}]}})
    recs = [r for r in read_hh(shared_data)[:60] if parse_hh(r["chosen"])[-1][2].strip()]
    prepare_part(write_part(tmp_path / "p.jsonl", recs, cfg), tmp_path / "o" / "p", phi3, cfg, FP)
    seq, mask = opened(tmp_path / "o", "p_s0000_text_sequence"), opened(tmp_path / "o", "p_s0000_text_loss_mask")
    for i, rec in enumerate(recs):
        turns = parse_hh(rec["chosen"])
        rendered = phi3.hf.apply_chat_template([{"role": r, "content": c.strip()} for r, _, c in turns], tokenize=False)
        assert seq[i].tolist() == phi3.backend.encode(rendered, add_special_tokens=False).ids
        assert [phi3.decode(r) for r in trained_runs(seq[i], mask[i])] == [turns[-1][2].strip() + "<|end|>"]


# ---- GRPO: prompt, list of responses, rewards ------------------------------------------------------
def grpo_records() -> list[dict[str, Any]]:
    recs = []
    for i in range(8):
        a, b = 13 + 7 * i, 29 + 3 * i
        good = f"{a} + {b} = {a + b}.\nAnswer: {a + b}"
        responses = [good, f"Answer: {a + b + 1}", f"I think it is {a + b - 10}.", good + " (checked)"][: 2 + i % 3]
        recs.append({"id": f"g{i}", "domain": "add" if i % 2 else "add/hard", "prompt": f"What is {a} + {b}?",
                     "responses": responses, "rewards": [1.0 if str(a + b) in r.split("Answer: ")[-1] else 0.0
                                                         for r in responses]})
    recs.append({"id": "bad", "domain": "add", "prompt": "x?", "responses": ["1", "2"], "rewards": [1.0]})
    recs.append({"id": "big", "prompt": "Count.", "responses": [str(k) for k in range(6)],
                 "rewards": [0.5 * k for k in range(6)]})
    return recs


def test_grpo_groups_with_rewards(tmp_path: Path, phi3) -> None:
    raw = sft_section("grpo")
    raw["preprocessing"]["max_items"] = 4
    cfg = load_sft_config(raw)
    assert layout(cfg, "prompt")["mask"] is None and layout(cfg, "responses")["mask"] is None
    recs = grpo_records()
    stats = prepare_part(write_part(tmp_path / "p.jsonl", recs, cfg), tmp_path / "grpo" / "part-00003", phi3, cfg, FP)
    assert stats["dropped"] == {"list_length_mismatch": 1}
    assert stats["diagnostics"]["items_truncated"] == 4    # 'big' keeps 4 of its 6 responses and rewards
    by_domain: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        if r["id"] != "bad":
            by_domain.setdefault(r.get("domain"), []).append(r)
    dirs = {"add": "add", "add/hard": f"add_hard-{hashlib.sha256(b'add/hard').hexdigest()[:8]}",
            None: "_none"}
    assert sorted(s["domain"] for s in stats["shards"]) == sorted(dirs.values())
    assert not any("loss_mask" in f for f in stats["files"])
    for domain, group in by_domain.items():
        out = tmp_path / "grpo" / dirs[domain]
        prompt = opened(out, "part-00003_s0000_prompt_sequence")
        resp = opened(out, "part-00003_s0000_responses_sequence")
        rew = opened(out, "part-00003_s0000_rewards_value")
        assert rew.dtype == np.float32 and resp.dtype == np.int32
        n_items = [min(len(r["responses"]), 4) for r in group]
        assert resp.doc_indices.tolist() == rew.doc_indices.tolist() == np.concatenate(([0], np.cumsum(n_items))).tolist()
        seq_i = 0
        for j, rec in enumerate(group):
            rendered = phi3.hf.apply_chat_template([{"role": "user", "content": rec["prompt"]}], tokenize=False,
                                                   add_generation_prompt=True)
            assert rendered.endswith("<|assistant|>\n")
            assert prompt[j].tolist() == phi3.backend.encode(rendered, add_special_tokens=False).ids
            for k in range(n_items[j]):
                assert resp[seq_i].tolist() == phi3.backend.encode(rec["responses"][k], add_special_tokens=False).ids
                assert rew[seq_i].tolist() == [rec["rewards"][k]]
                seq_i += 1
        meta = json.loads((out / "part-00003_s0000.meta.json").read_text())
        assert meta["documents"] == len(group) and meta["trained_tokens"] is None
        assert meta["keys"]["responses"]["list_field"] == "responses" and meta["keys"]["prompt"]["list_field"] is None
        assert meta["keys"]["rewards"]["value"]["values"] == sum(n_items)


def test_drop_reasons_are_counted_and_keys_stay_aligned(tmp_path: Path, phi3) -> None:
    raw = sft_section("grpo")
    raw["preprocessing"].update(min_chars=40, max_chars=400)
    cfg = load_sft_config(raw)
    good = grpo_records()[0]
    lines = [orjson.dumps({"text": "", "meta": {}, "record": r}) for r in (
        good,
        {**good, "responses": [], "rewards": []},                      # empty
        {**good, "responses": ["", " "], "rewards": [1.0, 0.0]},       # blank responses: nothing to train
        {**good, "prompt": 7},                                          # schema
        {**good, "responses": ["x"], "rewards": [1.0], "prompt": "?"},  # min_chars
        {**good, "responses": ["y" * 500], "rewards": [0.0]},          # max_chars
        {**good, "responses": good["responses"][:2], "rewards": [1e39, -1e39]},  # bad_value: inf in float32
    )] + [orjson.dumps({"text": "no record"}), b"{not json", b""]
    part = tmp_path / "p.jsonl"
    part.write_bytes(b"\n".join(lines) + b"\n")
    stats = prepare_part(part, tmp_path / "o" / "p", phi3, cfg, FP)
    assert stats["records"] == 9 and stats["documents"] == 1     # the blank last line is not a record
    assert stats["dropped"] == {"bad_json": 1, "empty": 1, "max_chars": 1, "min_chars": 1, "no_record": 1,
                                "no_trained_text": 1, "schema": 1, "bad_value": 1}
    assert [d["line"] for d in stats["dropped_records"]] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert {k: v["documents"] for k, v in stats["keys"].items()} == {"prompt": 1, "responses": 1, "rewards": 1}
    assert qc_check({**good, "responses": ["a"], "rewards": [1.0, 2.0]}, cfg)[1].startswith("list_length_mismatch:")


def test_one_blank_response_does_not_drop_its_group(tmp_path: Path, phi3) -> None:
    """Regression: `no_trained_text` ("everything meant to be trained is blank") was checked per list element, so a
    GRPO group with one whitespace-only response among good ones was dropped whole; and a list_field element's reject
    named `section[0]` instead of where it is in the record."""
    cfg = load_sft_config(sft_section("grpo"))
    good = grpo_records()[0]
    group = {**good, "responses": ["   ", *good["responses"][1:]]}
    assert qc_check(group, cfg)[1] is None
    assert qc_check({**good, "responses": ["   ", "\n"], "rewards": [0.0, 1.0]}, cfg)[1] == \
        "no_trained_text: responses: every part to be trained is empty or blank"
    assert qc_check({**good, "rewards": ["1", *good["rewards"][1:]]}, cfg)[1] == \
        "schema: rewards[0]: expected a number or a list of numbers, got str"
    part = tmp_path / "p.jsonl"
    part.write_bytes(orjson.dumps({"text": "", "meta": {}, "record": group}) + b"\n")
    stats = prepare_part(part, tmp_path / "o" / "p", phi3, cfg, FP)
    assert stats["dropped"] == {} and stats["keys"]["responses"]["sequences"] == len(group["responses"])
    seq = next((tmp_path / "o").rglob("p_s0000_responses_sequence.idx"))  # in its domain's folder
    out = opened(seq.parent, seq.stem)
    assert out[0].tolist() == phi3.backend.encode("   ", add_special_tokens=False).ids


def test_a_value_past_its_dtypes_range_is_a_reject_before_qc() -> None:
    """Regression: only finiteness was checked before QC, so a reward of 1e39 (inf in float32) passed it, took the
    exact-dedup digest of its valid twin (same prompt and responses) and was then dropped by the shards as
    `bad_value`: neither group was written. It is rejected before QC now, as a NaN is."""
    cfg = load_sft_config(sft_section("grpo"))
    good = grpo_records()[0]
    assert qc_check({**good, "rewards": [1e39, *good["rewards"][1:]]}, cfg) == \
        (None, "bad_value: rewards[0]: 1e+39 is beyond float32's range (±3.4e+38)")
    assert qc_check({**good, "rewards": [3e38, *good["rewards"][1:]]}, cfg)[1] is None
    wide = load_sft_config({**sft_section("grpo"), "output": {"value_dtype": "float64"}})
    assert qc_check({**good, "rewards": [1e39, *good["rewards"][1:]]}, wide)[1] is None
    listed = load_sft_config({"input": {"sections": [{"field": "q"}, {"field": "scores", "action": "value"}]}})
    assert qc_check({"q": "hi", "scores": [1.0, -1e39]}, listed) == \
        (None, "bad_value: scores[1]: -1e+39 is beyond float32's range (±3.4e+38)")


def test_a_long_value_list_is_range_checked_at_once() -> None:
    """Regression: the range check cast each value to the dtype alone (~2 µs a value, in the QC of every record and
    again in its shard: a run of 3,000 records of 2,048 values took 24 CPU-s instead of 5); it casts the list."""
    listed = load_sft_config({"input": {"sections": [{"field": "q"}, {"field": "scores", "action": "value"}]}})
    scores = [i / 7 for i in range(300_000)]
    t0 = time.process_time()
    assert qc_check({"q": "hi", "scores": scores}, listed) == ("hi", None)
    assert time.process_time() - t0 < 0.2  # ~0.04 s now; 0.5 s before
    assert qc_check({"q": "hi", "scores": [*scores, 1e39]}, listed)[1] == \
        "bad_value: scores[300000]: 1e+39 is beyond float32's range (±3.4e+38)"


def test_a_missing_field_in_a_list_element_names_the_element() -> None:
    """Regression: a list_field element without its section's field was rejected as `field 'text' is missing`, not
    naming the element (`responses[1].text`), as a wrong type there was."""
    cfg = load_sft_config({"input": {"sources": {"responses": {"list_field": "responses",
                                                               "sections": [{"field": "text", "action": "train"}]}}}})
    assert qc_check({"responses": [{"text": "a"}, {"txt": "b"}]}, cfg) == \
        (None, "schema: field 'responses[1].text' is missing")
    assert qc_check({"responses": [{"text": "a"}, {"text": 7}]}, cfg) == \
        (None, "schema: responses[1].text: expected a string, got int")
    assert qc_check({"response": [{"text": "a"}]}, cfg) == (None, "schema: field 'responses' is missing")


@pytest.mark.slow
def test_megatron_core_reads_grouped_documents(tmp_path: Path, phi3) -> None:
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    cfg = load_sft_config(sft_section("grpo"))
    recs = [r for r in grpo_records() if r["id"] != "bad" and r.get("domain") == "add"]
    prepare_part(write_part(tmp_path / "p.jsonl", recs, cfg), tmp_path / "o" / "p", phi3, cfg, FP)
    ours = IndexedDataset.open(tmp_path / "o" / "add" / "p_s0000_responses_sequence")
    theirs = indexed.IndexedDataset(str(tmp_path / "o" / "add" / "p_s0000_responses_sequence"))
    assert theirs.document_indices.tolist() == ours.doc_indices.tolist()
    assert all(theirs[i].tolist() == ours[i].tolist() for i in range(len(ours)))
    rewards = indexed.IndexedDataset(str(tmp_path / "o" / "add" / "p_s0000_rewards_value"))
    assert rewards[0].dtype == np.float32 and rewards[0].tolist() == [recs[0]["rewards"][0]]


# ---- pretraining-style text, truncation, special tokens, determinism -------------------------------
def test_no_mask_when_every_section_trains_without_template(tmp_path: Path, shared_data: Path) -> None:
    cfg = load_sft_config({"input": {"sections": [{"field": "text"}]}})
    assert layout(cfg, "text")["mask"] is None
    docs = [orjson.loads(line) for line in (shared_data / "web/c4_en_llamafactory_demo300.jsonl").read_bytes().splitlines()[:30]]
    tok = load_chat_tokenizer(shared_data / PHI2)   # no chat template: not needed here
    assert tok.chat_template is None
    stats = prepare_part(write_part(tmp_path / "p.jsonl", docs, cfg), tmp_path / "o" / "p", tok, cfg, FP)
    assert stats["files"] == ["p_s0000.meta.json", "p_s0000_text_sequence.bin", "p_s0000_text_sequence.idx"]
    assert stats["keys"]["text"]["trained_tokens"] is None
    seq = opened(tmp_path / "o", "p_s0000_text_sequence")
    for i, d in enumerate(docs):
        assert seq[i].tolist() == tok.backend.encode(d["text"], add_special_tokens=False).ids


def test_max_seq_len_truncates_or_drops(tmp_path: Path, glaive: dict[str, Any], phi3) -> None:
    records = glaive["records"][:30]
    raw = sft_section("sft_chat")
    raw["preprocessing"]["max_seq_len"] = 300
    cfg = load_sft_config(raw)
    stats = prepare_part(write_part(tmp_path / "p.jsonl", records, cfg), tmp_path / "t" / "p", phi3, cfg, FP)
    full_seq = opened(glaive["out"], "part-00000_s0000_text_sequence")
    full_mask = opened(glaive["out"], "part-00000_s0000_text_loss_mask")
    seq, mask = opened(tmp_path / "t", "p_s0000_text_sequence"), opened(tmp_path / "t", "p_s0000_text_loss_mask")
    long = [i for i in range(30) if full_seq.lengths[i] > 300]
    no_train = [i for i in long if not full_mask[i][:300].any()]
    assert long and stats["diagnostics"]["sequences_truncated"] == len(long) - len(no_train)
    assert stats["dropped"] == ({"no_trained_tokens": len(no_train)} if no_train else {})
    kept = [i for i in range(30) if i not in no_train]
    assert len(seq) == len(kept) and seq.lengths.max() == 300 and np.array_equal(seq.lengths, mask.lengths)
    for j, i in enumerate(kept):
        n = min(300, int(full_seq.lengths[i]))
        assert seq[j].tolist() == full_seq[i][:n].tolist() and mask[j].tolist() == full_mask[i][:n].tolist()
    raw["preprocessing"]["overlong"] = "drop"
    cfg = load_sft_config(raw)
    stats = prepare_part(write_part(tmp_path / "q.jsonl", records, cfg), tmp_path / "d" / "q", phi3, cfg, FP)
    assert stats["dropped"] == {"overlong": len(long)} and stats["documents"] == 30 - len(long)


def test_a_role_that_trains_through_role_map_drops_a_record_with_no_trained_token(tmp_path: Path, phi3) -> None:
    """Regression: a section `action: bot, role_map: {bot: assistant}` trains its turns (the mask's `assistant`), but
    the source was taken as one that can train nothing, so an answer cut off by max_seq_len was written with an
    all-zero mask; it is dropped as `no_trained_tokens` now, as with `action: assistant`."""
    cfg = load_sft_config({"input": {"sections": [
        {"field": "q", "action": "user", "template": True},
        {"field": "a", "action": "bot", "template": True, "role_map": {"bot": "assistant"}}]},
        "preprocessing": {"max_seq_len": 30}})
    assert layout(cfg, "text")["can_train"] is True
    records = [{"q": "What is the capital of France?", "a": "Paris."},
               {"q": "word " * 60, "a": "This answer lies past max_seq_len."}]
    stats = prepare_part(write_part(tmp_path / "p.jsonl", records, cfg), tmp_path / "o" / "p", phi3, cfg, FP)
    assert stats["documents"] == 1 and stats["dropped"] == {"no_trained_tokens": 1}
    assert stats["dropped_records"][0]["detail"] == "text: no trained token left after truncation"


def test_a_long_conversation_costs_what_max_seq_len_keeps(phi3, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: locating message k renders the k messages before it, so a 10,000-message record took ~30 min
    whatever `max_seq_len` kept. Messages past the kept tokens are no longer located: the renders are bounded by the
    limit, and the kept tokens' mask is the one the whole conversation gives."""
    from streamprep.sft.chat import encode_units
    from streamprep.sft.records import Message, TemplateUnit

    def chat(n: int) -> list[TemplateUnit]:
        roles = ("user", "assistant")
        msgs = [Message(roles[i % 2], roles[i % 2], f"turn {i} says hello", i % 2 == 1) for i in range(n)]
        return [TemplateUnit(msgs, add_special_tokens=False)]

    whole, cut = encode_units(phi3, chat(120)), encode_units(phi3, chat(120), 200)
    assert cut.ids == whole.ids and len(whole.ids) > 900 and cut.mask[:200].tolist() == whole.mask[:200].tolist()
    assert 0 < int(cut.mask[:200].sum()) < 200
    renders = []
    real = phi3.render
    monkeypatch.setattr(phi3, "render", lambda *a: renders.append(1) or real(*a))
    long = encode_units(phi3, chat(3000), 200)
    assert long.mask[:200].tolist() == whole.mask[:200].tolist() and len(renders) < 4 * 30


def test_special_tokens_only_where_configured(tmp_path: Path, shared_data: Path) -> None:
    """A tokenizer whose post-processor adds BOS: added only for sections with add_special_tokens: true."""
    from tokenizers import Tokenizer, processors

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    base = Tokenizer.from_file(str(shared_data / PHI3 / "tokenizer.json"))
    base.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    base.save(str(tok_dir / "tokenizer.json"))
    shutil.copy(shared_data / PHI3 / "tokenizer_config.json", tok_dir)
    tok = load_chat_tokenizer(tok_dir)
    recs = [{"q": "What is two plus two?", "a": "Four."}]
    for flag in (False, True):
        cfg = load_sft_config({"input": {"sections": [{"field": "q", "action": "mask", "add_special_tokens": flag},
                                                          {"field": "a", "action": "train"}]}})
        name = f"p{int(flag)}"
        prepare_part(write_part(tmp_path / f"{name}.jsonl", recs, cfg), tmp_path / "o" / name, tok, cfg, FP)
        ids = opened(tmp_path / "o", f"{name}_s0000_text_sequence")[0].tolist()
        m = opened(tmp_path / "o", f"{name}_s0000_text_loss_mask")[0].tolist()
        assert (ids[0] == 1) is flag and ids.count(1) == int(flag)
        assert tok.decode([t for t, k in zip(ids, m) if k]).strip() == "Four."
    # template sections: BOS/EOS only as the template writes them (phi-3: a final <|endoftext|>, no BOS)
    cfg = load_sft_config({"input": {"sections": [{"field": "q", "action": "user", "template": True},
                                                      {"field": "a", "action": "assistant", "template": True}]}})
    prepare_part(write_part(tmp_path / "t.jsonl", recs, cfg), tmp_path / "o" / "t", tok, cfg, FP)
    ids = opened(tmp_path / "o", "t_s0000_text_sequence")[0].tolist()
    m = opened(tmp_path / "o", "t_s0000_text_loss_mask")[0].tolist()
    assert 1 not in ids and ids[-1] == 32000
    assert tok.decode([t for t, k in zip(ids, m) if k]) == "Four.<|end|>"


def test_template_that_rewrites_content_is_refused(tmp_path: Path, shared_data: Path) -> None:
    """A template that does not show the content as given cannot be masked safely: the record is dropped."""
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    shutil.copy(shared_data / PHI3 / "tokenizer.json", tok_dir)
    tcfg = json.loads((shared_data / PHI3 / "tokenizer_config.json").read_text())
    tcfg["chat_template"] = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}"
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(tcfg))
    tok = load_chat_tokenizer(tok_dir)
    cfg = load_sft_config({"input": {"sections": [{"field": "messages", "template": True}]}})
    recs = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]},
            {"messages": [{"role": "user", "content": "A"}, {"role": "assistant", "content": "OK 1"}]}]
    stats = prepare_part(write_part(tmp_path / "p.jsonl", recs, cfg), tmp_path / "o" / "p", tok, cfg, FP)
    assert stats["dropped"] == {"template_unverified": 1} and stats["documents"] == 1   # upper() of 'OK 1' is itself
    assert stats["files"] and stats["keys"]["text"]["trained_tokens"] > 0


def test_a_message_holding_the_sentinel_characters_is_located(tmp_path: Path, phi3) -> None:
    """Regression: message k's content start was the first U+E000 U+E001 in its probe rendering, so an earlier
    message holding those private-use characters dropped the record as template_unverified, naming message k."""
    cfg = load_sft_config({"input": {"sections": [{"field": "messages", "template": True}]}})
    pua = "\ue000\ue001"
    recs = [{"messages": [{"role": "user", "content": f"My keyboard printed {pua} before this: what is 2+2?"},
                          {"role": "assistant", "content": "2 + 2 = 4."}]},
            {"messages": [{"role": "user", "content": "Echo this back."},
                          {"role": "assistant", "content": f"{pua}\ue002 as asked"}]}]
    part = write_part(tmp_path / "p.jsonl", recs, cfg)
    stats = prepare_part(part, tmp_path / "o" / "p", phi3, cfg, FP)
    assert stats["dropped"] == {} and stats["documents"] == 2
    seq, mask = opened(tmp_path / "o", "p_s0000_text_sequence"), opened(tmp_path / "o", "p_s0000_text_loss_mask")
    for i, rec in enumerate(recs):
        assert seq[i].tolist() == phi3.backend.encode(phi3.hf.apply_chat_template(rec["messages"], tokenize=False),
                                                      add_special_tokens=False).ids
        assert [phi3.decode(r) for r in trained_runs(seq[i], mask[i])] == [rec["messages"][1]["content"] + "<|end|>"]


def test_plain_text_template_headers(tmp_path: Path, shared_data: Path) -> None:
    """A template without special tokens ('### role:' headers): masks still follow the messages."""
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    shutil.copy(shared_data / PHI3 / "tokenizer.json", tok_dir)
    tcfg = {"eos_token": "<|endoftext|>", "chat_template":
            "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n\n{% endfor %}"
            "{% if add_generation_prompt %}### assistant:\n{% endif %}"}
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(tcfg))
    tok = load_chat_tokenizer(tok_dir)
    cfg = load_sft_config({"input": {"sections": [{"field": "messages", "template": True}]}})
    recs = [{"messages": [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven is prime."},
                          {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Eleven."}]}]
    prepare_part(write_part(tmp_path / "p.jsonl", recs, cfg), tmp_path / "o" / "p", tok, cfg, FP)
    seq, mask = opened(tmp_path / "o", "p_s0000_text_sequence"), opened(tmp_path / "o", "p_s0000_text_loss_mask")
    runs = [tok.decode(r) for r in trained_runs(seq[0], mask[0])]
    assert [r.strip() for r in runs] == ["Seven is prime.", "Eleven."]


@pytest.mark.slow
def test_outputs_are_byte_identical_and_shards_split_at_max_tokens(tmp_path: Path, shared_data: Path, phi3) -> None:
    raw = sft_section("dpo")
    raw["output"]["max_tokens_per_shard"] = 20_000
    cfg = load_sft_config(raw)
    part = write_part(tmp_path / "in" / "part-00007.jsonl", read_hh(shared_data)[:200], cfg)
    runs = []
    for name in ("a", "b"):
        stats = prepare_part(part, tmp_path / name / "part-00007", shared_data / PHI3, cfg, FP)  # path: cached load
        files = {f: (tmp_path / name / f).read_bytes() for f in stats["files"]}
        runs.append((stats, files))
    (sa, fa), (sb, fb) = runs
    assert sa["files"] == sb["files"] and fa == fb
    assert len(sa["shards"]) > 1
    for s in sa["shards"]:
        assert s["tokens"] <= 20_000 or s["documents"] == 1
    # the shards together hold every document once, in input order
    docs = []
    for s in sa["shards"]:
        ds = opened(tmp_path / "a", f"part-00007_s{s['shard']:04d}_chosen_sequence")
        docs += [ds[i].tolist() for i in range(len(ds))]
    assert len(docs) == sa["documents"] == 199 and sa["dropped"] == {"no_trained_text": 1}   # line 86
    assert docs[0] == phi3.backend.encode(read_hh(shared_data)[0]["chosen"], add_special_tokens=False).ids


# ---- config --------------------------------------------------------------------------------------
OK_SECTION = {"field": "messages", "template": True}


@pytest.mark.parametrize("raw, key", [
    ({"input": {"sections": [OK_SECTION, {"field": "b", "action": 3}]}}, "sft.input.sections[1].action"),
    ({"input": {"sections": [OK_SECTION, {"field": "b", "action": "two words"}]}}, "sft.input.sections[1].action"),
    ({"input": {"sections": []}}, "sft.input.sections"),
    ({"input": {"sections": [OK_SECTION], "sources": {}}}, "sft.input"),
    ({"input": {"sources": {"chosen": {"sections": [{"field": "c", "tempalte": True}]}}}},
     "sft.input.sources.chosen.sections[0].tempalte"),
    ({"input": {"sources": {"a b": {"sections": [OK_SECTION]}}}}, "sft.input.sources.a b"),
    ({"input": {"sources": {"a\n": {"sections": [OK_SECTION]}}}}, "sft.input.sources.a\\n"),  # escaped: one line
    ({"input": {"sections": [{"field": "text\n"}]}}, "sft.input.sections[0].field"),
    ({"input": {"sections": [OK_SECTION]}, "mask": {"user\n": "train"}}, "sft.mask.user\\n"),
    ({"input": {"sources": {"x": {"sections": [OK_SECTION], "mask_key": "sequence"}}}}, "sft.input.sources.x.mask_key"),
    ({"input": {"sources": {"x": {"sections": [OK_SECTION], "mask_key": "Sequence"}}}}, "sft.input.sources.x.mask_key"),
    ({"input": {"sources": {"x": {"sections": [OK_SECTION], "mask_key": "VALUE"}}}}, "sft.input.sources.x.mask_key"),
    # a's mask file a_b_sequence would be a_b's sequence file (regression: both were written to it)
    ({"input": {"sources": {"a": {"sections": [OK_SECTION], "mask_key": "b_sequence"},
                            "a_b": {"sections": [OK_SECTION]}}}}, "sft.input.sources.a_b"),
    ({"input": {"sections": [{"action": "train"}]}}, "sft.input.sections[0].field"),
    ({"input": {"sections": [{"field": "r", "action": "value", "template": True}]}}, "sft.input.sections[0].template"),
    ({"input": {"sections": [{"field": "p", "generation_prompt": True}]}}, "sft.input.sections[0].generation_prompt"),
    ({"input": {"sections": [{"field": "p", "parse": "sharegpt"}]}}, "sft.input.sections[0].parse"),
    ({"input": {"sections": [{"field": "p", "parse": "hh", "action": "user"}]}}, "sft.input.sections[0].action"),
    ({"input": {"sections": [{"field": "p", "train_turns": "first"}]}}, "sft.input.sections[0].train_turns"),
    ({"input": {"sections": [{"field": "p", "role_map": {"gpt": "assistant"}}]}}, "sft.input.sections[0].role_map"),
    ({"input": {"sections": [{"field": "p", "role_key": "from"}]}}, "sft.input.sections[0].role_key"),  # no messages
    ({"input": {"sections": [{"field": "p", "content_key": "value"}]}}, "sft.input.sections[0].content_key"),
    ({"input": {"sections": [{"field": "p", "train_turns": "last"}]}}, "sft.input.sections[0].train_turns"),
    ({"input": {"sections": [OK_SECTION]}, "mask": {"assistant": "yes"}}, "sft.mask.assistant"),
    ({"input": {"sections": [OK_SECTION]}, "mask_default": "maybe"}, "sft.mask_default"),
    ({"input": {"sections": [OK_SECTION]}, "preprocessing": {"max_seq_len": 0}}, "sft.preprocessing.max_seq_len"),
    ({"input": {"sections": [OK_SECTION]}, "preprocessing": {"max_items": 2}}, "sft.preprocessing.max_items"),  # no list
    ({"input": {"sections": [OK_SECTION]}, "preprocessing": {"min_chars": 10, "max_chars": 5}},
     "sft.preprocessing.max_chars"),
    ({"input": {"sections": [OK_SECTION]}, "output": {"dtype": "float16"}}, "sft.output.dtype"),
    ({"input": {"sections": [OK_SECTION]}, "output": {"mask_dtype": "int32"}}, "sft.output.mask_dtype"),
    ({"input": {"sections": [OK_SECTION]}, "output": {"max_tokens_per_shard": -1}}, "sft.output.max_tokens_per_shard"),
    ({"input": {"sections": [OK_SECTION]}, "bogus": 1}, "sft.bogus"),
    (None, "sft"),
])
def test_config_errors_name_the_key(raw: Any, key: str) -> None:
    with pytest.raises(SftConfigError) as exc:
        validate_sft_config(raw)
    assert exc.value.key == key
    assert str(exc.value).startswith(key + ": ") and "\n" not in str(exc.value)
    assert isinstance(exc.value, ValueError)


@pytest.mark.parametrize("name", ["sft_chat", "sft_instruction", "dpo", "grpo"])
def test_example_configs_are_valid(name: str) -> None:
    from streamprep.config import validate

    raw = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text(encoding="utf-8"))
    cfg = validate_sft_config(raw.pop("sft"))
    assert validate_sft_config(cfg) == cfg   # idempotent
    if (REPO.parent / "shared" / "data" / "SOURCES.md").is_file():
        validate(raw, CONFIGS)               # the rest is a valid streamprep config (paths exist)


def test_a_pretraining_dtype_beside_an_sft_section_is_a_config_error(tmp_path: Path) -> None:
    """Regression: `output.dtype` was accepted with `sft:` and did nothing (an sft: run writes `sft.output.dtype`)."""
    from streamprep.config import ConfigError, validate

    data = tmp_path / "a.jsonl"
    data.write_text('{"p": "hello there"}\n')
    raw = {"datasets": [{"name": "a", "path": str(data)}], "tokenizer": {"if_missing": "train"},
           "sft": {"input": {"sections": [{"field": "p", "action": "train"}]}}}  # no template: a trained tokenizer
    assert validate(raw)["output"]["dtype"] == "auto"
    with pytest.raises(ConfigError, match=r"^config: 'output.dtype' is the pretraining shards' dtype; .* 'sft.output.dtype'"):
        validate({**raw, "output": {"dtype": "uint16"}})
    pretraining = {k: v for k, v in raw.items() if k != "sft"}
    assert validate({**pretraining, "output": {"dtype": "uint16"}})["output"]["dtype"] == "uint16"


def test_a_valid_fraction_beside_an_sft_section_is_a_config_error(tmp_path: Path, capsys) -> None:
    """Regression: `output.valid_fraction: 0.2` was accepted with `sft:` and did nothing (an sft: run writes no
    blend.json nor a validation split); it is a config error naming the key, exit 2, nothing written."""
    from streamprep.cli import main
    from streamprep.config import ConfigError, validate

    data = tmp_path / "a.jsonl"
    data.write_text('{"p": "hello there"}\n')
    raw = {"datasets": [{"name": "a", "path": str(data)}], "tokenizer": {"if_missing": "train"},
           "sft": {"input": {"sections": [{"field": "p", "action": "train"}]}}}
    assert validate(raw)["output"]["valid_fraction"] == 0.0
    pretraining = {k: v for k, v in raw.items() if k != "sft"}
    assert validate({**pretraining, "output": {"valid_fraction": 0.2}})["output"]["valid_fraction"] == 0.2
    with pytest.raises(ConfigError, match=r"^config: 'output.valid_fraction' \(0.2\) splits blend.json's data, "
                                          r"and an sft: run writes no blend.json"):
        validate({**raw, "output": {"valid_fraction": 0.2}})
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump({**raw, "execution": {"engine": "local"},
                                                       "output": {"valid_fraction": 0.2}}))
    assert main(["ingest", "--config", str(tmp_path / "cfg.yaml"), "--run-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "streamprep: error: config: 'output.valid_fraction' (0.2) splits blend.json's data, and an sft: run writes "
        "no blend.json nor a validation split (leave it out)"]
    assert not (tmp_path / "run").exists()


def test_a_parquet_setting_beside_an_sft_section_is_a_config_error(tmp_path: Path) -> None:
    """Regression: `output.parquet.*` was accepted with `sft:` and did nothing (an sft: run writes no Parquet/TSV);
    a key set to its default stays accepted, and a pretraining run keeps its setting."""
    from streamprep.config import ConfigError, validate

    data = tmp_path / "a.jsonl"
    data.write_text('{"p": "hello there"}\n')
    raw = {"datasets": [{"name": "a", "path": str(data)}], "tokenizer": {"if_missing": "train"},
           "sft": {"input": {"sections": [{"field": "p", "action": "train"}]}}}
    same = validate({**raw, "output": {"parquet": {"compression": "SNAPPY"}}})  # the default, in capitals
    assert same["output"]["parquet"]["compression"] == "snappy"
    with pytest.raises(ConfigError, match=r"^config: 'output.parquet.length_buckets' sets the pretraining "
                                          r"Parquet/TSV export, and an sft: run writes none \(leave it out\)$"):
        validate({**raw, "output": {"parquet": {"length_buckets": [64, 128]}}})
    with pytest.raises(ConfigError, match=r"^config: 'output.parquet.compression' "):
        validate({**raw, "output": {"parquet": {"compression": "zstd"}}})
    with pytest.raises(ConfigError, match=r"^config: 'output.num_shards_multiple_of' sets the pretraining "):
        validate({**raw, "output": {"num_shards_multiple_of": 8}})
    pretraining = {k: v for k, v in raw.items() if k != "sft"}
    assert validate({**pretraining, "output": {"parquet": {"compression": "zstd"}}})["output"]["parquet"][
        "compression"] == "zstd"


def test_output_keys_equal_ignoring_case_are_a_config_error(tmp_path: Path, capsys) -> None:
    """Regression: `chosen:` and `Chosen:` were both accepted and wrote `…_chosen_sequence.bin` and
    `…_Chosen_sequence.bin`, one file on a case-insensitive file system; dataset names were already refused so."""
    import yaml

    from streamprep.cli import main

    data = tmp_path / "a.jsonl"
    data.write_text('{"p": "hello there"}\n')
    sources = {"chosen": {"sections": [{"field": "p", "action": "train"}]},
               "Chosen": {"sections": [{"field": "p", "action": "train"}]}}
    cfg = tmp_path / "cfg.yaml"
    raw = {"datasets": [{"name": "a", "path": str(data)}], "tokenizer": {"if_missing": "train"},
           "execution": {"engine": "local"}, "sft": {"input": {"sources": sources}}}
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))  # `chosen` first
    run_dir = tmp_path / "run"
    assert main(["ingest", "--config", str(cfg), "--run-dir", str(run_dir)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "streamprep: error: config: 'sft.input.sources.Chosen': its file Chosen_sequence.bin would be output key "
        "'chosen''s chosen_sequence.bin (file names compare ignoring case); rename one"]
    assert not run_dir.exists()


def test_a_template_section_needs_a_chat_template_at_config_time(tmp_path: Path, shared_data: Path) -> None:
    """Regression: `template: true` with a tokenizer that has no chat template (phi-2) failed at the first shard,
    after the whole ingest, as a resumable failure that re-running could not fix."""
    from streamprep.config import ConfigError, load

    raw = yaml.safe_load((CONFIGS / "sft_chat.yaml").read_text(encoding="utf-8"))
    raw["datasets"][0]["path"] = str(shared_data / GLAIVE)
    raw["tokenizer"]["path"] = str(shared_data / "tokenizers/phi-3-mini")
    raw["execution"] = {"engine": "local"}
    load(raw)
    raw["tokenizer"]["path"] = str(shared_data / "tokenizers/phi-2")
    with pytest.raises(ConfigError, match=r"^config: 'sft.input.sections\[0\].template': needs a chat "
                                          r"template, and the tokenizer at .*phi-2 has \(.*\) none$"):
        load(raw)  # the key as written (regression: it named 'sft.input.sources.text.sections[0]', which it is not)
    raw["sft"]["input"] = {"sources": {"chat": raw["sft"]["input"]}}
    with pytest.raises(ConfigError, match=r"^config: 'sft.input.sources.chat.sections\[0\].template': needs a chat"):
        load(raw)
    raw["tokenizer"] = {"if_missing": "train"}
    with pytest.raises(ConfigError, match=r"needs a chat template, and a tokenizer the run trains has none$"):
        load(raw)


def _phi3_copy(tmp_path: Path, shared_data: Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """A copy of phi-3-mini's tokenizer.json in tmp_path/tok (its tokenizer_config.json, returned, is the test's to
    write) and the sft_chat config pointing at it, for the chat-template checks."""
    phi3_dir = shared_data / "tokenizers/phi-3-mini"
    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(phi3_dir / "tokenizer.json", tok / "tokenizer.json")
    tcfg = json.loads((phi3_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    raw = yaml.safe_load((CONFIGS / "sft_chat.yaml").read_text(encoding="utf-8"))
    raw["datasets"][0]["path"] = str(shared_data / GLAIVE)
    raw["tokenizer"]["path"] = str(tok)
    raw["execution"] = {"engine": "local"}
    return tok, tcfg, raw


def test_a_chat_template_that_does_not_compile_is_a_config_error(tmp_path: Path, shared_data: Path) -> None:
    """Regression: only the presence of a template was checked, so one with a syntax error was accepted, every record
    was dropped as `template_error` and the run completed with 0 tokens (a re-run could not fix it)."""
    from streamprep.config import ConfigError, load

    tok, tcfg, raw = _phi3_copy(tmp_path, shared_data)
    good = tcfg.pop("chat_template")
    (tok / "tokenizer_config.json").write_text(json.dumps(tcfg), encoding="utf-8")
    (tok / "chat_template.jinja").write_text(good, encoding="utf-8")
    load(raw)
    (tok / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"^config: 'sft.input.sections\[0\].template': the chat template in "
                                          r".*/tok/chat_template.jinja does not compile: unexpected '}' \(line 1\)$"):
        load(raw)
    (tok / "tokenizer_config.json").write_text(json.dumps({**tcfg, "chat_template": "{% if %}"}), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"the chat template in .*/tok/tokenizer_config.json does not compile: "):
        load(raw)
    # regression: a template that is not a string ended the job with a bare TypeError from the compiler, exit 1
    for bad, shown in ((123, "int 123"), ({"a": 1}, "dict {'a': 1}"), ([{"name": "default", "template": 5}], "int 5")):
        (tok / "tokenizer_config.json").write_text(json.dumps({**tcfg, "chat_template": bad}), encoding="utf-8")
        with pytest.raises(ConfigError) as err:
            load(raw)
        assert str(err.value) == (f"config: 'sft.input.sections[0].template': the chat template in "
                                  f"{tok / 'tokenizer_config.json'} is not a string, got {shown}")


def test_an_empty_chat_template_is_a_config_error(tmp_path: Path, shared_data: Path, capsys) -> None:
    """Regression: an empty (or whitespace-only) chat template compiled, so the run completed with every record
    dropped as `empty` and 0 tokens; it is refused at start (exit 2, nothing written), naming the file."""
    from streamprep.cli import main
    from streamprep.config import ConfigError, load

    tok, tcfg, raw = _phi3_copy(tmp_path, shared_data)
    for empty in ("", " \n\t", [{"name": "default", "template": ""}]):
        (tok / "tokenizer_config.json").write_text(json.dumps({**tcfg, "chat_template": empty}), encoding="utf-8")
        with pytest.raises(ConfigError) as err:
            load(raw)
        assert str(err.value) == (f"config: 'sft.input.sections[0].template': the chat template in "
                                  f"{tok / 'tokenizer_config.json'} is empty")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    run_dir = tmp_path / "run"
    assert main(["ingest", "--config", str(cfg), "--run-dir", str(run_dir)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("tokenizer_config.json is empty")
    assert not run_dir.exists()


def test_a_chat_template_that_renders_no_message_is_a_config_error(tmp_path: Path, shared_data: Path, capsys) -> None:
    """Regression: a chat template of comments only, or of a BOM, passed the empty-template check (it is not blank),
    so the run completed (exit 0) with 0 tokens, every record dropped as `empty` or `no_trained_tokens`. A probe
    conversation that renders none of its messages is refused at start (exit 2, nothing written), naming the file;
    templates that render them (transformed, or needing a special token), or raise on the probe, are not."""
    from streamprep.cli import main
    from streamprep.config import ConfigError, load

    tok, tcfg, raw = _phi3_copy(tmp_path, shared_data)
    roles = ["user", "assistant", "function_call", "system", "tool"]  # and those of sft_chat.yaml's `mask`
    for blank, shown in (("{# nothing to render #}\n", ""), ("\ufeff\n", "\ufeff"),
                         ("{% for m in messages %}{{ m.role }}\n{% endfor %}", "".join(f"{r}\n" for r in roles))):
        (tok / "tokenizer_config.json").write_text(json.dumps({**tcfg, "chat_template": blank}), encoding="utf-8")
        with pytest.raises(ConfigError) as err:
            load(raw)
        assert str(err.value) == (f"config: 'sft.input.sections[0].template': the chat template in "
                                  f"{tok / 'tokenizer_config.json'} renders none of the conversation's messages (a "
                                  f"conversation of a message of each role, {', '.join(roles)}, rendered as "
                                  f"{shown!r:.60})")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    run_dir = tmp_path / "run"
    assert main(["ingest", "--config", str(cfg), "--run-dir", str(run_dir)]) == 2
    assert "renders none of the conversation's messages" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not run_dir.exists()
    for fine in (tcfg["chat_template"], "{% for m in messages %}{{ m.content | upper | tojson }}{% endfor %}",
                 "{{ bos_token + messages[-1].content + eos_token }}", "{{ raise_exception('needs a system turn') }}"):
        (tok / "tokenizer_config.json").write_text(json.dumps({**tcfg, "chat_template": fine}), encoding="utf-8")
        load(raw)
    # regression: a template rendering only its own roles (human, gpt) was refused, the probe being user/assistant
    own = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'human' %}USER: {{ m['content'] }}\n{% elif "
           "m['role'] == 'gpt' %}ASSISTANT: {{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}")
    (tok / "tokenizer_config.json").write_text(json.dumps({**tcfg, "chat_template": own}), encoding="utf-8")
    with pytest.raises(ConfigError, match="renders none of the conversation's messages"):
        load(raw)  # sft_chat's roles: none is the template's
    load({**raw, "sft": {**raw["sft"], "mask": {"gpt": "train", "human": "mask"}}})
    sections = [{**sec, "role_map": {"user": "human", "assistant": "gpt"}} for sec in raw["sft"]["input"]["sections"]]
    load({**raw, "sft": {**raw["sft"], "input": {**raw["sft"]["input"], "sections": sections}}})


def test_an_unreadable_or_defaultless_chat_template_is_a_config_error_naming_its_file(tmp_path: Path,
                                                                                     shared_data: Path) -> None:
    """Regression: a chat_template.jinja that is not UTF-8 ended the job with a bare UnicodeDecodeError naming no file
    (exit 1; mid-run in an SFT run without template sections), and a chat_template list without a 'default' entry
    was refused as having no template at all."""
    from streamprep.config import ConfigError, load

    tok, tcfg, raw = _phi3_copy(tmp_path, shared_data)
    good = tcfg.pop("chat_template")
    (tok / "tokenizer_config.json").write_text(json.dumps(tcfg), encoding="utf-8")
    (tok / "chat_template.jinja").write_bytes(b"\xff" + good.encode())
    unreadable = (f"config: 'tokenizer.path': {tok / 'chat_template.jinja'} is not UTF-8 text "
                  "(invalid start byte at byte 0)")
    for sections in (raw["sft"]["input"]["sections"], [{"field": "messages", "action": "train"}]):
        with pytest.raises(ConfigError) as err:
            load({**raw, "sft": {**raw["sft"], "input": {"sections": sections}}})
        assert str(err.value) == unreadable
    (tok / "chat_template.jinja").unlink()
    named = [{"name": "tool_use", "template": good}]
    (tok / "tokenizer_config.json").write_text(json.dumps({**tcfg, "chat_template": named}), encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load(raw)
    assert str(err.value) == ("config: 'sft.input.sections[0].template': needs a chat template, and the chat_template "
                              f"list in {tok / 'tokenizer_config.json'} has no entry named 'default' (named: tool_use)")
    (tok / "tokenizer_config.json").write_text(
        json.dumps({**tcfg, "chat_template": [*named, {"name": "default", "template": good}]}), encoding="utf-8")
    load(raw)


def test_a_default_chat_template_entry_without_a_template_is_a_config_error_saying_so(tmp_path: Path,
                                                                                       shared_data: Path) -> None:
    """Regression: a chat_template list whose `default` entry has template null was refused as having "no entry named
    'default' (named: default)". With a chat_template.jinja beside it that file is the template, as transformers'
    from_pretrained takes it (its .jinja files come before tokenizer_config.json's entries)."""
    from streamprep.config import ConfigError, load

    tok, tcfg, raw = _phi3_copy(tmp_path, shared_data)
    good = tcfg.pop("chat_template")
    listed = f"the chat_template list in {tok / 'tokenizer_config.json'}"
    for entry, got in (({"name": "default", "template": None}, "null"), ({"name": "default"}, "missing")):
        (tok / "tokenizer_config.json").write_text(json.dumps({**tcfg, "chat_template": [entry]}), encoding="utf-8")
        with pytest.raises(ConfigError) as err:
            load(raw)
        assert str(err.value) == ("config: 'sft.input.sections[0].template': needs a chat template, and the entry "
                                  f"named 'default' in {listed} has no template string ('template' is {got})")
    (tok / "chat_template.jinja").write_text(good, encoding="utf-8")
    load(raw)
    assert load_chat_tokenizer(tok).chat_template == good


SHAREGPT = {"input": {"sections": [{"field": "conversations", "template": True, "role_key": "from", "content_key": "value",
                                    "role_map": {"human": "user", "gpt": "assistant"}, "train_turns": "last"}]},
            "mask": {"gpt": "train"}, "mask_default": "train",
            "preprocessing": {"max_seq_len": 10, "overlong": "drop"},
            "output": {"dtype": "auto", "domain_key": "meta.domain"}}
MULTI = {"input": {"sources": {
    "prompt": {"sections": [{"field": "q", "template": True, "action": "user", "generation_prompt": True}],
               "mask_key": False},
    "answers": {"list_field": "a", "mask_key": "m", "sections": [{"action": "mask"}, {"field": "s", "action": "value"}]}}},
    "mask": {}, "preprocessing": {"max_items": 3}}


@pytest.mark.parametrize("raw", [*(sft_section(n) for n in ("sft_chat", "sft_instruction", "dpo", "grpo")), SHAREGPT, MULTI])
def test_typed_config_gives_back_the_validated_dict(raw: dict[str, Any]) -> None:
    """The wire form (task.sft, plan hash, meta.json digest) is byte-identical through SftConfig; it pickles."""
    import pickle
    from dataclasses import FrozenInstanceError

    from streamprep.config import _freeze
    from streamprep.modes import mode_of

    validated = validate_sft_config(raw)
    cfg = SftConfig.from_dict(validated)
    assert orjson.dumps(cfg.to_dict()) == orjson.dumps(validated) and cfg.to_dict() == validated
    assert SftConfig.from_dict(_freeze(validated)) == cfg == pickle.loads(pickle.dumps(cfg)) == load_sft_config(raw)
    assert mode_of(validated).plan_key() == mode_of(cfg).plan_key()
    src = next(iter(cfg.input.sources.values()))
    assert isinstance(src.sections, tuple)
    with pytest.raises(FrozenInstanceError):
        cfg.mask_default = "train"  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.mask["user"] = "train"  # type: ignore[index]
    with pytest.raises(TypeError):
        src.sections[0].role_map["x"] = "y"  # type: ignore[index]


def test_instruction_config_masks_the_prompt(tmp_path: Path, shared_data: Path) -> None:
    cfg = load_sft_config(sft_section("sft_instruction"))
    with gzip.open(shared_data / "code/humaneval-x/humaneval_python.jsonl.gz", "rb") as fh:
        recs = [orjson.loads(line) for line in fh]
    tok = load_chat_tokenizer(shared_data / PHI2)
    stats = prepare_part(write_part(tmp_path / "p.jsonl", recs, cfg), tmp_path / "o" / "p", tok, cfg, FP)
    assert stats["documents"] == 164 and stats["dtypes"]["sequence"] == "uint16"
    seq, mask = opened(tmp_path / "o", "p_s0000_text_sequence"), opened(tmp_path / "o", "p_s0000_text_loss_mask")
    assert seq.dtype == np.uint16
    exact = 0
    for i, r in enumerate(recs):
        ids, m = seq[i], mask[i].astype(bool)
        assert tok.decode(ids.tolist()) == r["prompt"] + r["canonical_solution"]   # joined, encoded once
        got = tok.decode(ids[m].tolist())
        assert r["canonical_solution"].endswith(got) and len(r["canonical_solution"]) - len(got) <= 2
        exact += got == r["canonical_solution"]
    # a token merging the prompt's last newline with the solution's first is masked (never trained on prompt text)
    assert exact == 164 - stats["diagnostics"].get("straddling_tokens_masked", 0) >= 160


@pytest.mark.parametrize("value, kind", [(123456789, "int"), ({"a": 1}, "dict"), ([{"role": "user", "content": "hi"}], "list")])
def test_a_template_section_with_a_role_action_names_the_type_it_got(value: Any, kind: str) -> None:
    """Regression: a prompt that is a number or a mapping was rejected as "got a list"."""
    cfg = load_sft_config({"input": {"sections": [{"field": "prompt", "action": "user", "template": True},
                                                  {"field": "response", "action": "train"}]}})
    assert qc_check({"prompt": value, "response": "ok"}, cfg) == (
        None, f"schema: prompt: action 'user' needs a string field, got {kind}")


def test_a_record_that_does_not_fit_sft_is_shown_in_its_reject_line() -> None:
    """Regression: a post-training record has no text field, so its reject line's text read "None"."""
    from streamprep.sft.mode import SftMode
    from streamprep.sources.base import BadRecord

    mode = SftMode.of(load_sft_config({"input": {"sections": [{"field": "messages", "template": True}]}}))
    (bad, _), = mode.screen([({"id": "x1", "messages": "not a list"}, {"record": 1})], "text")[0]
    assert isinstance(bad, BadRecord) and bad.check == "schema"
    assert bad.raw == '{"id":"x1","messages":"not a list"}'


def test_distinct_domain_values_get_distinct_directories() -> None:
    """Regression: the number 7 and the string "7" (and the string "_none" and a missing domain) shared one
    directory, so a GRPO run's domain split mixed them."""
    from streamprep.sft.output import MISSING_DOMAIN, domain_dir

    values = ["7", 7, 7.0, True, "True", "_none", None, "add", "add/hard", {"a": 1}]
    dirs = [domain_dir(v) for v in values]
    assert len(set(dirs)) == len(values)
    assert domain_dir("7") == "7" and domain_dir("add") == "add" and domain_dir(None) == MISSING_DOMAIN  # as before
    assert domain_dir(7) == "7-" + hashlib.sha256(b"int:7").hexdigest()[:8]



def test_domain_values_equal_ignoring_case_get_directories_distinct_ignoring_case(tmp_path: Path, phi3) -> None:
    """Regression: the domains "Math" and "math" got the directories Math/ and math/, one folder on a case-insensitive
    file system (macOS, Windows, a casefold ext4 folder), where the second's part-00000_s0000_* files replaced the
    first's. A name with capitals now gets the hash suffix, as a changed name does; a lower-case one is as before."""
    from streamprep.sft.output import domain_dir

    values = ["math", "Math", "MATH", "add/Hard", "add/hard"]
    assert len({domain_dir(v).casefold() for v in values}) == len(values)
    assert domain_dir("math") == "math" and domain_dir("Math") == "Math-" + hashlib.sha256(b"Math").hexdigest()[:8]
    cfg = load_sft_config({**sft_section("grpo"), "preprocessing": {}})
    recs = [{"domain": d, "prompt": f"What is {i} + 1?", "responses": [f"Answer: {i + 1}"], "rewards": [1.0]}
            for i, d in enumerate(["Math", "math"])]
    stats = prepare_part(write_part(tmp_path / "p.jsonl", recs, cfg), tmp_path / "o" / "p", phi3, cfg, FP)
    assert len({s["meta"].split("/")[0].casefold() for s in stats["shards"]}) == 2

_MANY_DOMAINS_CHILD = """
import resource, sys
from pathlib import Path
import yaml
from streamprep.sft import load_sft_config, prepare_part
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
raw = yaml.safe_load(Path(sys.argv[1]).read_text())["sft"]
prepare_part(sys.argv[2], sys.argv[3], sys.argv[4], load_sft_config(raw), "sha256:test-fingerprint")
"""


def many_domain_records(n_domains: int) -> list[dict[str, Any]]:
    """GRPO groups over `n_domains` domains, each domain's records interleaved with every other's."""
    return [{"domain": f"topic{i}", "prompt": f"What is {i} + {r}?", "responses": [f"Answer: {i + r}", f"Answer: {r}"],
             "rewards": [1.0, 0.0]} for r in range(2) for i in range(n_domains)]


def test_many_domains_stay_under_the_open_file_limit(tmp_path: Path, shared_data: Path, monkeypatch) -> None:
    """Regression: a part kept every domain's shard files open until its end, so 150 domains (450 `.bin` files)
    under a 256 open-file limit crashed with EMFILE (and every resume did the same). The bytes are those of a
    part written with every file kept open."""
    import os
    import subprocess
    import sys

    from helpers import tree_hashes
    from streamprep.sft import prepare as prep

    cfg = load_sft_config(sft_section("grpo"))
    part = write_part(tmp_path / "in" / "part-00000.jsonl", many_domain_records(150), cfg)
    done = subprocess.run([sys.executable, "-c", _MANY_DOMAINS_CHILD, str(CONFIGS / "grpo.yaml"), str(part),
                           str(tmp_path / "low" / "part-00000"), str(shared_data / PHI3)],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    monkeypatch.setattr(prep, "MAX_OPEN_FILES", 10**6)   # every file open to the end, as before
    stats = prepare_part(part, tmp_path / "all" / "part-00000", shared_data / PHI3, cfg, FP)
    assert len(stats["shards"]) == 150 and stats["documents"] == 300
    low, full = tree_hashes(tmp_path / "low", "."), tree_hashes(tmp_path / "all", ".")
    assert len(low) == 150 * 7 and low == full   # meta + 3 (.bin, .idx) per domain, the same bytes


def test_a_failed_part_leaves_no_empty_domain_directory(tmp_path: Path, phi3, monkeypatch) -> None:
    """Regression: a part that failed midway removed its unfinished files but left their domain directories."""
    from streamprep.sft import prepare as prep

    cfg = load_sft_config(sft_section("grpo"))
    part = write_part(tmp_path / "p.jsonl", many_domain_records(5), cfg)
    calls = []
    real_add = prep.Shard.add

    def failing_add(self, record):
        calls.append(1)
        if len(calls) == 4:
            raise OSError("disk full")
        real_add(self, record)

    monkeypatch.setattr(prep.Shard, "add", failing_add)
    with pytest.raises(OSError, match="disk full"):
        prepare_part(part, tmp_path / "out" / "part-00000", phi3, cfg, FP)
    assert list((tmp_path / "out").iterdir()) == []


def test_a_text_the_tokenizer_panics_on_is_a_counted_drop(tmp_path: Path, shared_data: Path) -> None:
    """Regression: HF tokenizers panics ("AddedVocabulary bad split", a BaseException) on "ab\\x85" with an added "ab"
    (rstrip) and "\\x85" (lstrip): one such record failed the SFT job on every resume (workers >= 2: a PicklingError
    naming no cause). It is dropped as `empty` with the panic as its detail, as the pretraining path drops it, and
    the other records' shards are the bytes of a part without it."""
    spec = json.loads((shared_data / PHI2).read_text())
    for i, (content, flags) in enumerate((("ab", {"rstrip": True, "special": False}), ("\x85", {"lstrip": True}))):
        spec["added_tokens"].append({"id": 50295 + i, "content": content, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True, **flags})
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps(spec))
    tok = load_chat_tokenizer(tmp_path / "tok")
    cfg = load_sft_config({"input": {"sections": [{"field": "prompt", "action": "mask"},
                                                  {"field": "answer", "action": "train"}]}})
    good = [{"prompt": f"Question {i}: add two numbers.", "answer": "def add(a, b):\n    return a + b"} for i in (0, 1)]
    bad = {"prompt": "Question: add two numbers.", "answer": "def add(a, b): ab\x85 hello world"}
    stats = prepare_part(write_part(tmp_path / "with.jsonl", [good[0], bad, good[1]], cfg), tmp_path / "w" / "p",
                         tok, cfg, FP)
    assert stats["dropped"] == {"empty": 1} and stats["documents"] == 2
    detail = "the tokenizer cannot encode it (tokenizers panicked: AddedVocabulary bad split)"
    assert stats["dropped_records"] == [{"line": 1, "reason": "empty", "detail": detail}]
    assert prepare_part(write_part(tmp_path / "without.jsonl", good, cfg), tmp_path / "wo" / "p", tok, cfg,
                        FP)["files"] == stats["files"]
    binidx = [name for name in stats["files"] if name.endswith((".bin", ".idx"))]
    assert len(binidx) == 4    # the sequence and the loss mask
    assert all((tmp_path / "w" / name).read_bytes() == (tmp_path / "wo" / name).read_bytes() for name in binidx)
