"""Config validation: defaults, both dataset forms, one-line errors naming the key, exit 2, nothing written."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from streamprep.config import ConfigError, drift_keys, load_file, validate


@pytest.fixture()
def data(tmp_path: Path) -> Path:
    f = tmp_path / "a.jsonl"
    f.write_text('{"text": "hello"}\n')
    return f


def test_defaults_and_list_form(data: Path) -> None:
    cfg = validate({"datasets": [{"name": "a", "path": str(data)}]})
    assert cfg["datasets"][0]["text_field"] == "text"
    assert cfg["datasets"][0]["blend_split"] == "train"
    assert cfg["tokenizer"]["append_eod"] is True
    assert cfg["output"]["parquet"]["length_buckets"] == [128, 256, 512, 1024, 2048, 4096, 8192]
    assert cfg["quality"]["min_language_prob"] == 0.9
    assert cfg["execution"]["engine"] == "xenna"


def test_per_split_form_and_relative_paths(tmp_path: Path, data: Path) -> None:
    cfg = validate({"datasets": {"train": [{"name": "a", "path": "a.jsonl"}],
                                 "valid": [{"name": "b", "path": "a.jsonl", "weight": 2}]}}, base_dir=tmp_path)
    assert [(d["name"], d["blend_split"], d["path"]) for d in cfg["datasets"]] == [
        ("a", "train", str(data)), ("b", "valid", str(data))]


@pytest.mark.parametrize("raw, message", [
    ({"datasets": [{"name": "a", "path": "A"}], "bogus": 1}, "unknown key 'bogus'"),
    ({"datasets": [{"name": "a", "path": "A"}], "quality": {"pii_max_densty": 0.1}}, "quality.pii_max_densty"),
    ({"datasets": [{"name": "a", "path": "A"}], "output": {"shard_records": "many"}}, "'output.shard_records' must be an integer"),
    ({"datasets": [{"name": "a", "path": "A", "weight": "x"}]}, "'datasets[0].weight' must be a number"),
    ({"datasets": [{"name": "a", "path": "missing/*.jsonl"}]}, "'datasets[0].path': no file matches"),
    ({"datasets": [{"name": "a", "path": "A"}, {"name": "a", "path": "A"}]}, "duplicate dataset name"),
    ({"datasets": [{"name": "a", "path": "hf://org/x"}]}, "'datasets[0].split' is required for hf://"),
    ({"datasets": {"train": [], "dev": []}}, "unknown key 'datasets.dev'"),
    ({"datasets": [{"name": "a", "path": "A"}], "execution": {"engine": "spark"}}, "'execution.engine'"),
    ({"datasets": [{"name": "a", "path": "A"}], "tokenizer": {"path": "nope.json"}}, "'tokenizer.path'"),
    ({"datasets": [{"name": "a", "path": "A"}], "output": {"append_eod": True}}, "unknown key 'output.append_eod'"),
])
def test_errors_name_the_key(tmp_path: Path, data: Path, raw: dict, message: str) -> None:
    raw = yaml.safe_load(yaml.safe_dump(raw).replace("path: A", f"path: {data}"))
    with pytest.raises(ConfigError) as exc:
        validate(raw, base_dir=tmp_path)
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_optional_dataset_is_skipped_and_tokenizer_falls_back_to_training(tmp_path: Path, data: Path) -> None:
    cfg = validate({"datasets": [{"name": "gone", "path": "nowhere/*.jsonl", "optional": True},
                                 {"name": "a", "path": str(data)}],
                    "tokenizer": {"path": "absent/tokenizer.json", "if_missing": "train"}}, base_dir=tmp_path)
    assert [d["name"] for d in cfg["datasets"]] == ["a"]
    assert cfg["tokenizer"]["path"] is None


def test_drift_keys_name_output_changes_only(data: Path) -> None:
    a = validate({"datasets": [{"name": "a", "path": str(data)}]})
    b = validate({"datasets": [{"name": "a", "path": str(data)}], "quality": {"min_chars": 5},
                  "execution": {"workers": 3}})
    assert drift_keys(a, b) == ["quality.min_chars"]


def test_cli_bad_config_exits_2_one_line_nothing_written(tmp_path: Path, data: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump({"datasets": [{"name": "a", "path": str(data)}], "output": {"shard_records": -1}}))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "streamprep", "ingest", "--config", str(cfg), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["streamprep: error: config: 'output.shard_records' must be > 0"]
    assert not run_dir.exists()


def test_yaml_syntax_error_is_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("datasets: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_file(cfg)
