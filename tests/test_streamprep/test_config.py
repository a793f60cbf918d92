"""Config validation: defaults, both dataset forms, one-line errors naming the key, exit 2, nothing written."""
from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from streamprep.config import Config, ConfigError, drift_keys, load_file, validate


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


def test_an_error_naming_a_key_with_a_newline_stays_one_line(tmp_path: Path, good: dict) -> None:
    """Regression: a YAML key may hold a newline (`? "a\\nb"`); the error naming it was two lines on the CLI."""
    with pytest.raises(ConfigError) as exc:
        validate({**good, "run": {"name": "ok", "bad\nkey": 1}}, base_dir=tmp_path)
    assert str(exc.value) == "config: unknown key 'run.bad\\nkey'"


def test_the_contracts_example_config_is_accepted_as_written(tmp_path: Path, shared_data: Path) -> None:
    """Regression: `split` on a local dataset became exit 2 (round 37), and the contract's own example puts
    `split: train` on one (`data/c4/*.jsonl`). A `split` that names the split the dataset is in says what is so and
    is accepted; another value is still exit 2 (test_cli: an hf key on local files)."""
    text = (shared_data.parent / "docs" / "contract.md").read_text(encoding="utf-8")
    (tmp_path / "data" / "c4").mkdir(parents=True)
    (tmp_path / "data" / "c4" / "a.jsonl").write_text('{"text": "x"}\n')
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(text.split("```yaml\n", 1)[1].split("```", 1)[0], encoding="utf-8")
    cfg = load_file(cfg_path)
    assert [(d.name, d.split, d.blend_split) for d in cfg.datasets] == [("c4", "train", "train")]
    raw = yaml.safe_load(cfg_path.read_text())
    raw["datasets"] = {"train": [{**raw["datasets"][0], "split": None}],
                       "valid": [{**raw["datasets"][0], "name": "v", "split": "valid"}]}
    assert [d["split"] for d in validate(raw, base_dir=tmp_path)["datasets"]] == [None, "valid"]
    raw["datasets"]["valid"][0]["split"] = "train"
    with pytest.raises(ConfigError, match=r"^config: 'datasets.valid\[0\].split' applies to hf:// datasets only, .*"
                                          r"`split` may only name it, here 'valid'\)$"):
        validate(raw, base_dir=tmp_path)


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
    # regression: 5e-324 beside 1e15 was accepted and written as weight 0 in blend.json and mixtures.json
    ({"datasets": [{"name": "a", "path": "A", "weight": 4.9e-324}]},
     "'datasets[0].weight' must be in [1e-15, 1e+15], got 5e-324"),
    ({"datasets": [{"name": "a", "path": "missing/*.jsonl"}]}, "'datasets[0].path': no file matches"),
    ({"datasets": [{"name": "a", "path": "A"}, {"name": "a", "path": "A"}]}, "duplicate dataset name"),
    ({"datasets": [{"name": "a", "path": "hf://org/x"}]}, "'datasets[0].split' is required for hf://"),
    ({"datasets": {"train": [], "dev": []}}, "unknown key 'datasets.dev'"),
    # regression: `train: 5` was a TypeError (exit 1), a mapping read as its keys ("'datasets.train[0]' ... got str")
    ({"datasets": {"train": 5}}, "'datasets.train' must be a list of dataset entries or null, got int 5"),
    ({"datasets": {"train": {"name": "a", "path": "A"}}}, "'datasets.train' must be a list of dataset entries"),
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


def test_a_file_url_is_a_local_path_and_an_empty_memory_url_a_missing_input(tmp_path: Path, data: Path) -> None:
    """Regression: `file:///DIR/a.jsonl` was taken for a relative path (`CONFIG_DIR/file:/DIR/a.jsonl`: "no such
    file or directory" for a file that exists), and a `memory://` URL with nothing there passed validation and
    failed the job (exit 1, `FileNotFoundError`) after creating its run dir. Now the first is the local file and
    the second a config error (optional: the dataset is skipped), as for a local path that does not exist."""
    import fsspec

    cfg = validate({"datasets": [{"name": "a", "path": f"file://{data}"}]}, base_dir=tmp_path)
    assert cfg["datasets"][0]["path"] == str(data)
    with pytest.raises(ConfigError, match=r"^config: 'datasets\[0\].path': 'file://host/a.jsonl' names a host; a local "
                                          r"file's URL is file:///PATH"):
        validate({"datasets": [{"name": "a", "path": "file://host/a.jsonl"}]}, base_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"^config: 'datasets\[0\].path': no object matches memory://streamprep-t/x/"):
        validate({"datasets": [{"name": "a", "path": "memory://streamprep-t/x/*.jsonl"}]}, base_dir=tmp_path)
    cfg = validate({"datasets": [{"name": "m", "path": "memory://streamprep-t/x/*.jsonl", "optional": True},
                                 {"name": "a", "path": str(data)}]}, base_dir=tmp_path)
    assert [d["name"] for d in cfg["datasets"]] == ["a"]
    fs = fsspec.filesystem("memory")
    fs.pipe("/streamprep-t/x/a.jsonl", b'{"text": "hello"}\n')
    try:
        memory = [{"name": "m", "path": "memory://streamprep-t/x/*.jsonl"}]
        assert validate({"datasets": memory, "execution": {"workers": 1}},
                        base_dir=tmp_path)["datasets"][0]["path"] == "memory://streamprep-t/x/*.jsonl"
        # worker processes cannot see the caller's in-memory store: the job stopped after making its run dir
        for execution, why in (({"workers": 2}, "workers is 2"),
                               ({"workers": 1, "ray_address": "auto"}, "ray_address names a cluster")):
            with pytest.raises(ConfigError) as err:
                validate({"datasets": memory, "execution": execution}, base_dir=tmp_path)
            assert str(err.value) == (f"config: 'datasets[0].path': 'memory://streamprep-t/x/*.jsonl' is the job "
                                      f"process's in-memory store, which the worker processes that read units cannot "
                                      f"see ({why}): use workers: 1 without ray_address, or a path on disk")
    finally:
        fs.rm("/streamprep-t", recursive=True)
    # storage_options do nothing for a local file, written as a path or as a file:// URL alike
    with pytest.raises(ConfigError, match=r"^config: 'datasets\[0\].storage_options' applies to fsspec URLs"):
        validate({"datasets": [{"name": "a", "path": f"file://{data}", "storage_options": {"key": "k"}}]},
                 base_dir=tmp_path)


def test_a_mixture_phase_may_name_a_skipped_optional_dataset(tmp_path: Path, data: Path) -> None:
    """Regression: an optional dataset left out for want of input, named in a phase, failed the job as an unknown
    dataset ('gone' (known: a)); it is an empty source of the phase now. A name declared nowhere stays an error."""
    datasets = [{"name": "gone", "path": "nowhere/*.jsonl", "optional": True}, {"name": "a", "path": str(data)}]
    phases = {"p1": {"gone": 1, "a": 1}}
    skipped: list[tuple[str, str]] = []
    cfg = validate({"datasets": datasets, "output": {"mixtures": {"phases": phases}}}, base_dir=tmp_path,
                   skipped=skipped)
    assert [d["name"] for d in cfg["datasets"]] == ["a"] and [n for n, _ in skipped] == ["gone"]
    assert cfg["output"]["mixtures"]["phases"] == phases
    with pytest.raises(ConfigError) as exc:
        validate({"datasets": datasets, "output": {"mixtures": {"phases": {"p1": {"nope": 1, "a": 1}}}}},
                 base_dir=tmp_path)
    assert str(exc.value) == "config: 'output.mixtures.phases.p1.nope': unknown dataset 'nope' (known: a)"


@pytest.mark.parametrize("form", ["file://{}", "file:{}", "file://localhost{}", "FILE://{}", "File:{}"])
def test_each_form_of_a_file_url_is_the_local_path(tmp_path: Path, data: Path, form: str) -> None:
    """Regression: `file:/DIR/a.jsonl` (RFC 8089's form without a host), `file://localhost/DIR/…` and an upper-case
    `FILE:` were taken for relative paths (`CONFIG_DIR/file:/DIR/a.jsonl`: "no such file" for a file that exists),
    and a tokenizer given as `file:///…` was refused as a remote URL to download first."""
    from helpers import make_tokenizer

    tok = tmp_path / "tokenizer.json"
    make_tokenizer(tok, ["ab ab abc abc"] * 4)
    cfg = validate({"datasets": [{"name": "a", "path": form.format(data)}],
                    "tokenizer": {"path": form.format(tok)}}, base_dir=tmp_path)
    assert cfg["datasets"][0]["path"] == str(data)
    assert cfg["tokenizer"]["path"] == str(tok)


def test_a_file_urls_percent_escapes_are_decoded(tmp_path: Path) -> None:
    """Regression: `Path.as_uri()`'s `file:///DIR/sp%20ace/a%20b.jsonl` was read with its escapes kept ("no such file
    or directory: DIR/sp%20ace/a%20b.jsonl", exit 2) for a file that exists; so for `tokenizer.path` and
    `run.checkpoint_dir`, which share the code."""
    from helpers import make_tokenizer

    folder = tmp_path / "sp ace é"
    folder.mkdir()
    data = folder / "a b%.jsonl"
    data.write_text('{"text": "hello"}\n')
    tok = folder / "tok #1.json"
    make_tokenizer(tok, ["ab ab abc abc"] * 4)
    assert "%20" in data.as_uri() and "%25" in data.as_uri() and "%23" in tok.as_uri()
    cfg = validate({"run": {"checkpoint_dir": (folder / "ck").as_uri()},
                    "datasets": [{"name": "a", "path": data.as_uri()}], "tokenizer": {"path": tok.as_uri()}},
                   base_dir=tmp_path)
    assert (cfg["datasets"][0]["path"], cfg["tokenizer"]["path"]) == (str(data), str(tok))
    assert cfg["run"]["checkpoint_dir"] == str(folder / "ck")
    for url, message in (("file:///x%FF.jsonl", "'file:///x%FF.jsonl' has percent-escapes that are not UTF-8"),
                         ("file:///x%00.jsonl", "embedded null byte")):
        with pytest.raises(ConfigError) as err:
            validate({"datasets": [{"name": "a", "path": url}]}, base_dir=tmp_path)
        assert str(err.value) == f"config: 'datasets[0].path': {message}"


@pytest.mark.parametrize("form", ["d/{}", "{base}/d/{}", "file://{base}/d/{}"])
@pytest.mark.parametrize("pattern", ["*/", "**/"])
def test_a_local_glob_ending_in_a_slash_matches_folders_alone_as_on_an_object_store(tmp_path: Path, form: str,
                                                                                   pattern: str) -> None:
    """Regression: the path's resolving dropped a glob's trailing '/': `d/*/` was recorded as `d/*`, read d/a.jsonl
    (which it does not match) and made d/sub a reject, `d/**/` read every file, where `s3://b/d/*/` and `**/` are
    exit 2 'no object matches … (only folders do: …)' (docs/operations.md: object store globs are listed as on
    disk). Both match folders alone now; a folder path with a trailing '/' is that folder, as before."""
    (tmp_path / "d" / "sub").mkdir(parents=True)
    for name in ("a.jsonl", "sub/b.jsonl"):
        (tmp_path / "d" / name).write_text('{"text": "hello"}\n')
    with pytest.raises(ConfigError) as err:
        validate({"datasets": [{"name": "a", "path": form.format(pattern, base=tmp_path)}]}, base_dir=tmp_path)
    assert str(err.value) == (f"config: 'datasets[0].path': no file matches {tmp_path}/d/{pattern} (only folders do: "
                              f"a glob ending in `/` matches folders alone; `{tmp_path}/d/{pattern}*` reads the files in "
                              f"them)")
    cfg = validate({"datasets": [{"name": "a", "path": form.format("", base=tmp_path)}]}, base_dir=tmp_path)
    assert cfg["datasets"][0]["path"] == str(tmp_path / "d")


@pytest.mark.parametrize("path", ["file:a.jsonl", "file://host/a.jsonl"])
def test_a_file_url_of_a_relative_path_or_a_host_is_refused(tmp_path: Path, data: Path, path: str) -> None:
    with pytest.raises(ConfigError, match=r"^config: 'datasets\[0\].path': .* a local file's URL is file:///PATH"):
        validate({"datasets": [{"name": "a", "path": path}]}, base_dir=tmp_path)


@pytest.mark.parametrize("url", ["s3://bucket/tokenizer.json", "hf://microsoft/phi-2/tokenizer.json",
                                 "https://example.com/tok/tokenizer.json"])
@pytest.mark.parametrize("if_missing", ["error", "train"])
def test_a_tokenizer_path_given_as_a_url_is_refused_in_one_line(tmp_path: Path, data: Path, url: str,
                                                                 if_missing: str) -> None:
    """Regression: a URL was taken for a local folder, mangled ("no tokenizer.json in s3:/bucket/tokenizer.json")."""
    with pytest.raises(ConfigError) as exc:
        validate({"datasets": [{"name": "a", "path": str(data)}],
                  "tokenizer": {"path": url, "if_missing": if_missing}}, base_dir=tmp_path)
    assert str(exc.value) == (f"config: 'tokenizer.path' must be a local (or mounted) tokenizer.json or folder "
                              f"holding one, got {url!r}: download it first")


def test_valid_fraction_with_per_split_datasets_is_an_error(tmp_path: Path, data: Path) -> None:
    """Regression: blend.json ignores `valid_fraction` once a dataset is in the valid or test split, and said nothing."""
    per_split = {"train": [{"name": "a", "path": str(data)}], "valid": [{"name": "b", "path": str(data)}]}
    with pytest.raises(ConfigError, match="'output.valid_fraction' splits the training data of a list of datasets"):
        validate({"datasets": per_split, "output": {"valid_fraction": 0.1}}, base_dir=tmp_path)
    assert validate({"datasets": per_split}, base_dir=tmp_path)["output"]["valid_fraction"] == 0
    train_only = {"train": per_split["train"]}  # nothing but train: the fraction still splits it
    assert validate({"datasets": train_only, "output": {"valid_fraction": 0.1}}, base_dir=tmp_path)["output"][
        "valid_fraction"] == 0.1


def test_drift_keys_name_output_changes_only(data: Path) -> None:
    a = validate({"datasets": [{"name": "a", "path": str(data)}]})
    b = validate({"datasets": [{"name": "a", "path": str(data)}], "quality": {"min_chars": 5},
                  "execution": {"workers": 3}})
    assert drift_keys(a, b) == ["quality.min_chars"]
    # `shard_records: null` (the contract's example) is the default, 100 000: a resume may switch between them
    null = validate({"datasets": [{"name": "a", "path": str(data)}], "output": {"shard_records": None}})
    assert drift_keys(a, null) == drift_keys(null, a) == []
    assert drift_keys(null, validate({"datasets": [{"name": "a", "path": str(data)}], "output": {"shard_records": 500}})) \
        == ["output.shard_records"]


def test_cli_bad_config_exits_2_one_line_nothing_written(tmp_path: Path, data: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump({"datasets": [{"name": "a", "path": str(data)}], "output": {"shard_records": -1}}))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "streamprep", "ingest", "--config", str(cfg), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["streamprep: error: config: 'output.shard_records' must be >= 1, got -1"]
    assert not run_dir.exists()


def test_yaml_syntax_error_is_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("datasets: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_file(cfg)


# -- every bad value fails at validation, naming its key (issue #13 items 2, 4) ------------------------

def _with(raw: dict, dotted: str, value: object) -> dict:
    """`raw` with `dotted` (e.g. "output.parquet.compression", "datasets[0].weight") set to `value`."""
    raw = copy.deepcopy(raw)
    node, *path = dotted.split(".")
    target = raw["datasets"][0] if node == "datasets[0]" else raw.setdefault(node, {})
    for part in path[:-1]:
        target = target.setdefault(part, {})
    target[path[-1]] = value
    return raw


@pytest.fixture()
def good(data: Path, shared_data: Path) -> dict:
    return {"datasets": [{"name": "a", "path": str(data)}],
            "tokenizer": {"path": str(shared_data / "tokenizers/phi-2/tokenizer.json")}}


NAN, INF = float("nan"), float("inf")
BAD_VALUES = [
    ("datasets[0].weight", NAN), ("datasets[0].weight", INF), ("datasets[0].weight", -1), ("datasets[0].weight", 0),
    ("datasets[0].weight", 1e16), ("datasets[0].weight", 10**400), ("datasets[0].size_mb", NAN), ("datasets[0].size_mb", 0),
    ("datasets[0].max_records", 0), ("datasets[0].text_field", ""), ("datasets[0].text_field", "  "),
    ("datasets[0].name", "x" * 250), ("datasets[0].name", "a/b"), ("datasets[0].name", ".."),
    ("datasets[0].name", "."), ("datasets[0].name", ""), ("datasets[0].name", "-a"), ("datasets[0].split", ""),
    ("datasets[0].filter", {"": 1}), ("run.name", "../x"), ("run.name", "a/b"), ("run.name", ""),
    ("run.name", "x" * 65), ("run.seed", -1), ("run.checkpoint_dir", ""),
    ("run.checkpoint_dir", "s3://bucket/ck"),  # regression: written to a local folder `s3:/bucket/ck`
    ("run.name", "demo\n"), ("datasets[0].name", "web\n"),  # regression: `$` matched before a last newline
    ("execution.progress_interval_s", NAN), ("execution.progress_interval_s", INF),
    ("execution.progress_interval_s", 0), ("execution.progress_interval_s", 0.001),
    ("execution.workers", 0), ("execution.batch_records", 0), ("execution.max_concurrent_downloads", 0),
    ("execution.ray_address", ""), ("output.max_rejects_per_check", -1), ("output.valid_fraction", NAN),
    ("output.valid_fraction", 1.0), ("output.valid_fraction", -0.1), ("output.num_shards_multiple_of", 0),
    ("output.shard_records", 0), ("output.parquet.compression", "bogus"), ("output.parquet.compression", "lzo"),
    ("output.parquet.compression", ""), ("output.parquet.shard_size_bytes", -1),
    ("output.parquet.shard_size_bytes", 0), ("output.parquet.row_group_size", -10),
    ("output.parquet.length_buckets", []), ("output.parquet.length_buckets", [0, 8]),
    ("output.parquet.length_buckets", [8, 4]), ("output.parquet.length_buckets", [1.5]),
    ("output.parquet.length_buckets", [2**31]), ("output.parquet.length_buckets", list(range(1, 102))),
    ("output.parquet.length_buckets", list(range(1, 101))),  # regression: 100 bounds named the overflow b100
    ("output.parquet.length_buckets", [[128], 256]), ("output.parquet.length_buckets", [128, {"a": 1}]),  # regression:
    ("output.mixtures.phases", {"p": {"a": NAN}}), ("output.mixtures.phases", {"p": {"a": 1e308}}),  # bare errors ("tokenizer.eod_token", "<|not-in-phi2|>"),
    ("tokenizer.eod_token", ""), ("tokenizer.train.vocab_size", 10), ("tokenizer.train.vocab_size", 2**40),
    ("tokenizer.train.vocab_size", 2**20 + 1), ("tokenizer.train.vocab_size", 2_000_000_000),  # regression: aborted
    ("tokenizer.train.min_frequency", -1),
]


@pytest.mark.parametrize("key, value", BAD_VALUES, ids=[f"{k}={v!r:.20}" for k, v in BAD_VALUES])
def test_bad_value_names_its_key(tmp_path: Path, good: dict, key: str, value: object) -> None:
    with pytest.raises(ConfigError) as exc:
        validate(_with(good, key, value), base_dir=tmp_path)
    message = str(exc.value)
    shown = key.replace("output.mixtures.phases", "output.mixtures.phases.p.a")
    assert f"'{shown}'" in message and "\n" not in message


def _number_keys() -> list[str]:
    from streamprep.config import DATASET_SPEC, NUM, SPEC

    def walk(spec: dict, prefix: str) -> list[str]:
        out = []
        for k, v in spec.items():
            if isinstance(v, dict):
                out += walk(v, f"{prefix}{k}.")
            elif set(v[0]) & set(NUM):
                out.append(f"{prefix}{k}")
        return out

    return walk(SPEC, "") + walk(DATASET_SPEC, "datasets[0].")


def test_every_number_key_has_a_range() -> None:
    from streamprep.config import BOUNDS, DATASET_BOUNDS

    ranged = set(BOUNDS) | {f"datasets[0].{k}" for k in DATASET_BOUNDS}
    assert sorted(set(_number_keys()) - ranged) == []


@pytest.mark.parametrize("key", _number_keys())
@pytest.mark.parametrize("value", [NAN, INF, -INF, -1])
def test_every_number_key_rejects_nan_inf_negative(tmp_path: Path, good: dict, key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"'{key}'")):
        validate(_with(good, key, value), base_dir=tmp_path)


def _quality_number_keys() -> list[str]:
    from quality.settings import QUALITY_DEFAULTS

    return [k for k, v in QUALITY_DEFAULTS.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]


@pytest.mark.parametrize("key", _quality_number_keys())
@pytest.mark.parametrize("value", [NAN, INF, -1])
def test_every_quality_number_rejects_nan_inf_negative(tmp_path: Path, good: dict, key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"'quality.{key}'")):
        validate(_with(good, f"quality.{key}", value), base_dir=tmp_path)


@pytest.mark.parametrize("section", ["quality", "sft"])
def test_a_plug_in_section_that_is_not_a_mapping_is_named_once(tmp_path: Path, good: dict, section: str) -> None:
    """Regression: `quality: []` was reported as `'quality.quality': section must be a mapping`."""
    with pytest.raises(ConfigError, match=rf"^config: '{section}': .*mapping"):
        validate({**good, section: []}, base_dir=tmp_path)


SFT_NUMBERS = ["preprocessing.max_seq_len", "preprocessing.min_chars", "preprocessing.max_chars",
               "preprocessing.max_items", "output.max_tokens_per_shard"]


@pytest.mark.parametrize("key", SFT_NUMBERS)
@pytest.mark.parametrize("value", [NAN, INF, -1, 1.5])
def test_every_sft_number_rejects_nan_inf_negative(tmp_path: Path, good: dict, key: str, value: float) -> None:
    good["sft"] = {"input": {"sections": [{"field": "text"}]}}
    with pytest.raises(ConfigError, match=re.escape(f"'sft.{key}'")):
        validate(_with(good, f"sft.{key}", value), base_dir=tmp_path)


def test_empty_input_directory_and_not_a_tokenizer(tmp_path: Path, good: dict, data: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"'datasets\[0\].path': directory has no input files"):
        validate(_with(good, "datasets[0].path", str(tmp_path / "empty")), base_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"'tokenizer.path': .* is not a tokenizer.json"):
        validate(_with(good, "tokenizer.path", str(data)), base_dir=tmp_path)
    (tmp_path / "tok" / "tokenizer.json").mkdir(parents=True)  # a folder where the file should be
    for folder in (tmp_path / "empty", tmp_path / "tok"):  # regression: "directory has no input files", a dataset's
        with pytest.raises(ConfigError, match=rf"^config: 'tokenizer.path': no tokenizer.json in {folder}$"):
            validate(_with(good, "tokenizer.path", str(folder)), base_dir=tmp_path)


def test_a_tokenizer_json_that_panics_tokenizers_on_load_is_a_config_error(tmp_path: Path, good: dict,
                                                                          shared_data: Path) -> None:
    """phi-2 with model.continuing_subword_prefix "##": tokenizers panics loading it (a BaseException, not the
    Exception caught): a Rust backtrace and a traceback, exit 1, where a file that is not a tokenizer is exit 2."""
    import json

    spec = json.loads((shared_data / "tokenizers/phi-2/tokenizer.json").read_text())
    spec["model"]["continuing_subword_prefix"] = "##"
    bad = tmp_path / "contprefix.json"
    bad.write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match=rf"^config: 'tokenizer.path': {bad} is not a tokenizer.json \(slice index"):
        validate(_with(good, "tokenizer.path", str(bad)), base_dir=tmp_path)


def test_a_whitespace_eod_token_of_the_vocabulary_is_taken(good: dict, tmp_path: Path) -> None:
    """Regression: eod_token "   " (three spaces: an added token of phi-2, id 50285) was refused as 'must be a
    non-empty string, got '   ''. A token's text may be whitespace: taken when in the vocabulary, else named."""
    from streamprep.config import TokenizerConfig
    from streamprep.tokenizer import prepare

    cfg = validate(_with(good, "tokenizer.eod_token", "   "), base_dir=tmp_path)
    assert prepare(TokenizerConfig.from_dict(cfg["tokenizer"]), tmp_path / "run").eod_id == 50285
    with pytest.raises(ConfigError, match=r"^config: 'tokenizer.eod_token': ' \\t' is not in the tokenizer's "
                                          r"vocabulary$"):
        validate(_with(good, "tokenizer.eod_token", " \t"), base_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"^config: 'tokenizer.eod_token' must be a non-empty string, got ''$"):
        validate(_with(good, "tokenizer.eod_token", ""), base_dir=tmp_path)


def test_trained_tokenizer_eod_must_be_one_of_its_special_tokens(tmp_path: Path, data: Path) -> None:
    raw = {"datasets": [{"name": "a", "path": str(data)}]}
    assert validate(_with(raw, "tokenizer.eod_token", "</s>"))["tokenizer"]["eod_token"] == "</s>"
    with pytest.raises(ConfigError, match="'tokenizer.eod_token'"):
        validate(_with(raw, "tokenizer.eod_token", "<|endoftext|>"))


def test_good_values_pass_and_names_are_unique_ignoring_case(tmp_path: Path, good: dict, data: Path) -> None:
    good["output"] = {"parquet": {"compression": "ZSTD", "shard_size_bytes": 1024}}
    good["datasets"].append({"name": "données_v1.2-x", "path": str(data), "weight": 1e15})
    good["tokenizer"]["train"] = {"vocab_size": 2**20}  # the largest a trainer may be asked for
    cfg = validate(good, base_dir=tmp_path)
    assert cfg["output"]["parquet"]["compression"] == "zstd"
    assert cfg["tokenizer"]["path"].endswith("phi-2/tokenizer.json")
    good["datasets"].append({"name": "A", "path": str(data)})
    with pytest.raises(ConfigError, match=r"'datasets\[2\].name': duplicate dataset name 'A'"):
        validate(good, base_dir=tmp_path)


def test_exports_take_the_validated_parquet_settings(good: dict, tmp_path: Path) -> None:
    from streamprep.config import ParquetConfig, load

    out = load(good, base_dir=tmp_path).output
    assert out.parquet == ParquetConfig((128, 256, 512, 1024, 2048, 4096, 8192), 64 << 20, "snappy", 10_000)
    assert out.num_shards_multiple_of == 1


def test_mixture_phases_are_checked_once_at_load(good: dict, tmp_path: Path) -> None:
    """The exports take validated phases as they are: a phase naming an unknown dataset fails at load."""
    good["output"] = {"mixtures": {"phases": {"x": {"wiki": 1}}}}
    with pytest.raises(ConfigError, match=r"'output\.mixtures\.phases\.x\.wiki': unknown dataset 'wiki'"):
        validate(good, base_dir=tmp_path)


# -- YAML limits (issue #13 item 5) --------------------------------------------------------------------

# Billion laughs, 742 bytes: 10 ** 12 "lol" leaves once expanded (the bomb was 807 bytes, 10 ** 9).
BOMB = "\n".join(["l0: &l0 [" + ", ".join(['"lol"'] * 10) + "]"] + [
    f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, 12)]) + "\n"


def test_billion_laughs_bomb_is_exit_2_fast_with_bounded_memory(tmp_path: Path) -> None:
    assert len(BOMB.encode()) < 1024
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text(BOMB)
    run_dir = tmp_path / "run"
    code = ("import re, sys; from streamprep.cli import main; rc = main(sys.argv[1:]); "  # peak RSS of this process
            "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1]); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, "ingest", "--config", str(cfg), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"streamprep: error: config: {cfg}: more than 100000 YAML nodes (aliases expanded)"]
    assert int(proc.stdout) < 300_000  # KiB: the interpreter and its imports, not an expanded bomb
    assert not run_dir.exists()


@pytest.mark.parametrize("text, message", [
    ("a: &a [1, *a]\n", "recursive YAML alias"),
    ("x: " + "[" * 70 + "]" * 70 + "\n", "nested deeper than 64"),
    ("a: &a [" + "1," * 999 + "1]\nb: [" + "*a," * 100 + "*a]\n", "more than 100000 YAML nodes"),
    ("x: '" + "a" * (1 << 20) + "'\n", "larger than 1048576 bytes"),
], ids=["recursive", "deep", "nodes", "bytes"])
def test_yaml_limits(tmp_path: Path, text: str, message: str) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_file(cfg)


def test_yaml_aliases_within_limits_still_work(tmp_path: Path, data: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"datasets:\n  - &ds {{name: a, path: {data}, weight: 2}}\n  - {{<<: *ds, name: b}}\n")
    assert [(d.name, d.weight) for d in load_file(cfg).datasets] == [("a", 2.0), ("b", 2.0)]
    # a merge that overrides a merged key, into an anchor merged again from a shallower mapping: no key given twice
    # (a check on the built mapping saw the keys the inner merge had added, and refused it)
    cfg.write_text(f"run:\n  x: &x {{<<: {{name: a, seed: 1}}, seed: 2}}\nextra: {{<<: *x, name: b}}\n"
                   f"datasets: [{{name: c, path: {data}}}]\n")
    with pytest.raises(ConfigError, match=r"unknown key 'extra'"):  # past the YAML: its keys were taken as written
        load_file(cfg)


@pytest.mark.parametrize("text, message", [
    ("run: {seed: 2020-13-45}\n", "line 1: '2020-13-45' is not a valid YAML timestamp (month must be in 1..12); "
                                   "quote it if it is a string"),
    ("run:\n  seed: !!int abc\n", "line 2: 'abc' is not a valid YAML int (invalid literal for int() with base 10: "
                                   "'abc'); quote it if it is a string"),
    ("run: {seed: !!timestamp nope}\n", "line 1: 'nope' is not a valid YAML timestamp; quote it if it is a string"),
    ("run: {seed: 1}\nexecution: {workers: 1}\nrun: {seed: 2}\n",
     "line 3: key 'run' given twice in one mapping (first on line 1); the later one would silently replace it"),
    ("execution:\n  workers: 1\n  engine: local\n  workers: 2\n",
     "line 4: key 'workers' given twice in one mapping (first on line 2); the later one would silently replace it"),
    # a bare `on:` is the text "on" (not YAML 1.1's True): beside a quoted "on" it is a key given twice
    ('output: {mixtures: {phases: {p1: {on: 1.0, "on": 9.0}}}}\n',
     "line 1: key 'on' given twice in one mapping (first on line 1); the later one would silently replace it"),
    ('output: {mixtures: {phases: {p1: {2024: 1.0, "2024": 9.0}}}}\n',
     "line 1: key '2024' given twice in one mapping (first on line 1); the later one would silently replace it"),
], ids=["date", "int", "timestamp", "twice", "twice-nested", "twice-bool", "twice-int"])
def test_yaml_values_that_cannot_be_built_and_keys_given_twice_are_one_line(tmp_path: Path, text: str,
                                                                          message: str) -> None:
    """Regression: a value PyYAML resolves but cannot build was a bare ValueError (exit 1, no file, no line), and a
    key given twice silently kept the last (two `datasets:` lists ingested only the second)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_file(cfg)
    assert str(err.value) == f"config: {cfg}: {message}"


def test_an_unquoted_yes_no_on_off_key_is_its_text_and_such_a_value_is_named(tmp_path: Path, data: Path) -> None:
    """Regression: YAML 1.1 reads an unquoted `on`/`no` as a boolean: a dataset `on` in a mixture's phase was
    "unknown dataset True (known: on)", and `name: on` said "must be a string, got bool True" without why."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"datasets:\n  - {{name: 'on', path: {data}}}\n  - {{name: 'no', path: {data}}}\n  - {{name: 'yes', path: {data}}}\n"
                   f"output: {{mixtures: {{phases: {{p1: {{on: 1, no: 2, 'yes': 3}}}}}}}}\n")
    assert dict(load_file(cfg).output.mixtures.phases["p1"]) == {"on": 1.0, "no": 2.0, "yes": 3.0}
    cfg.write_text(f"datasets:\n  - {{name: on, path: {data}}}\n")
    with pytest.raises(ConfigError) as err:
        load_file(cfg)
    assert str(err.value) == ("config: 'datasets[0].name' must be a string, got bool True (YAML reads an unquoted "
                              "yes/no/on/off as a boolean: quote it)")


@pytest.mark.parametrize("value, where, message", [
    ("weight: 1e-3", "datasets[0]", "'datasets[0].weight' must be a number, got str '1e-3' (YAML 1.1, as the config "
     "is read, takes 1e-3 for text: write 0.001, or 1.0e-3, with a decimal point and a signed exponent)"),
    # an integer key: the integer only (its 1.0e+6 was refused in turn, "got float"), also past a float's precision
    ("max_records: 1E6", "datasets[0]", "'datasets[0].max_records' must be an integer or null, got str '1E6' (YAML 1.1, "
     "as the config is read, takes 1E6 for text: write 1000000)"),
    ("near_dedup: {seed: 1e19}", "quality", "'quality.near_dedup.seed': must be an integer in "
     "[0, 18446744073709551615], got '1e19' (YAML 1.1, as the config is read, takes 1e19 for text: write "
     "10000000000000000000)"),
    # a key that wants no number, or an integer key given a fraction: no hint (its advice could only fail again)
    ("language_detector: 1e3", "quality", "'quality.language_detector': must be one of cld2, langdetect, cascade, got "
     "'1e3'"),
    ("max_records: 15e-1", "datasets[0]", "'datasets[0].max_records' must be an integer or null, got str '15e-1'"),
    ("max_records: 1e999999", "datasets[0]", "'datasets[0].max_records' must be an integer or null, got str "
     "'1e999999'"),
    ("max_records: 1e99999999999999999999", "datasets[0]", "'datasets[0].max_records' must be an integer or null, "
     "got str '1e99999999999999999999'"),  # regression: Decimal's InvalidOperation, exit 1
    ("min_language_prob: 9e-1", "quality", "'quality.min_language_prob': must be a number in [0, 1], got '9e-1' "
     "(YAML 1.1, as the config is read, takes 9e-1 for text: write 0.9, or 9.0e-1, with a decimal point and a "
     "signed exponent)"),
    ("phases: {p: {a: 1e-20}}", "output.mixtures", "'output.mixtures.phases.p.a': weight must be a number in [1e-15, "
     "1e+15], got str '1e-20' (YAML 1.1, as the config is read, takes 1e-20 for text: write 1.0e-20, with a decimal "
     "point and a signed exponent)"),
])
def test_a_number_yaml_1_1_reads_as_text_is_named_so(tmp_path: Path, data: Path, value: str, where: str,
                                                    message: str) -> None:
    """Regression: PyYAML reads YAML 1.1, where `1e-3` (no decimal point, no exponent sign) is a string, and the
    error said "must be a number, got str '1e-3'", which read as nonsense; it says why now, and how to write it. A
    quoted "1e-3" is text as written, and the error says no more. Regression (round 52): an integer key was told to
    write a float it then refused, and a key of words was told to write a number."""
    cfg = tmp_path / "c.yaml"
    entry = f"name: a, path: {data}" + (f", {value}" if where == "datasets[0]" else "")
    section = {"quality": f"quality: {{{value}}}\n", "output.mixtures": f"output: {{mixtures: {{{value}}}}}\n"}
    cfg.write_text(f"datasets: [{{{entry}}}]\n" + section.get(where, ""))
    with pytest.raises(ConfigError) as err:
        load_file(cfg)
    assert str(err.value) == f"config: {message}"
    cfg.write_text(f"datasets: [{{name: a, path: {data}, weight: '1e-3'}}]\n")
    with pytest.raises(ConfigError) as err:
        load_file(cfg)
    assert str(err.value) == "config: 'datasets[0].weight' must be a number, got str '1e-3'"


@pytest.mark.parametrize("value, key, got", [
    ("!!set {a}", "f", "set {'a'}"), ("!!binary aGVsbG8=", "f", "bytes b'hello'"),
    ("2024-01-01", "f", "date 2024-01-01"), ("{d: [1, 2024-01-01]}", "f.d[1]", "date 2024-01-01")])
def test_a_filter_value_no_json_record_holds_is_a_config_error_naming_it(tmp_path: Path, value: str, key: str,
                                                                         got: str) -> None:
    """Regression: a filter value YAML reads as a set or bytes passed validation and the job stopped on a traceback
    when the config was hashed (`Type is not JSON serializable`); a date never matched a record's text (0 read,
    exit 0). Each is exit 2 naming the key; JSON values pass."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"datasets:\n  - {{name: w, path: hf://org/x, split: train, filter: {{f: {value}}}}}\n")
    with pytest.raises(ConfigError) as err:
        load_file(cfg)
    assert str(err.value) == (f"config: 'datasets[0].filter.{key}' must be what a JSON record holds (text, a number, "
                              f"true/false, null, a list or a mapping), got {got} (quote it)")
    cfg.write_text("datasets:\n  - {name: w, path: hf://org/x, split: train,\n     filter: {f: [a, 1, 2.5, null, {x: true}]}}\n")
    assert load_file(cfg).datasets[0].filter["f"][4]["x"] is True


def test_an_unquoted_key_yaml_reads_as_a_number_null_or_date_is_its_text(tmp_path: Path, data: Path) -> None:
    """Regression: only boolean keys kept their text, so a dataset '2024' in a mixture's phase was "unknown dataset
    2024 (known: 2024, other)" (the int 2024), and so for `null:` (None), `1_000:`, `0x1F:`, `1.5:`, `2001-01-01:`."""
    names = ["2024", "null", "1_000", "0x1F", "1.5", "2001-01-01", "other"]
    cfg = tmp_path / "c.yaml"
    datasets = "".join(f"  - {{name: '{n}', path: {data}}}\n" for n in names)
    weights = ", ".join(f"{n}: {i + 1}" for i, n in enumerate(names))
    cfg.write_text(f"datasets:\n{datasets}output: {{mixtures: {{phases: {{p1: {{{weights}}}, 2: {{other: 1}}}}}}}}\n")
    phases = load_file(cfg).output.mixtures.phases
    assert list(phases) == ["p1", "2"]
    assert dict(phases["p1"]) == {n: float(i + 1) for i, n in enumerate(names)}


@pytest.mark.parametrize("key", ["datasets[0].path", "tokenizer.path", "run.checkpoint_dir"])
def test_a_path_of_an_unknown_users_home_names_its_key(tmp_path: Path, data: Path, key: str) -> None:
    """Regression: `~nosuchuser/x.jsonl` ended the job with `RuntimeError: Could not determine home directory.`,
    exit 1, no key named."""
    raw: dict = {"datasets": [{"name": "a", "path": str(data)}], "tokenizer": {"if_missing": "train"}}
    where = "~nosuchuser-streamprep/x"
    if key == "datasets[0].path":
        raw["datasets"][0]["path"] = where
    elif key == "tokenizer.path":
        raw["tokenizer"]["path"] = where
    else:
        raw["run"] = {"checkpoint_dir": where}
    with pytest.raises(ConfigError) as err:
        validate(raw, base_dir=tmp_path)
    assert str(err.value) == f"config: '{key}': Could not determine home directory."


@pytest.mark.parametrize("key, where", [("max_records", "datasets[0].max_records"),
                                        ("quality", "quality.max_chars"), ("output", "output.max_rejects_per_check")])
def test_integers_beyond_64_bits_are_refused_naming_the_key(data: Path, key: str, where: str) -> None:
    """Regression: they passed validation and failed in the run's config hash (orjson), after the run dir existed.
    Regression: the message read "'key' must fit", without the colon every other config error has after its key."""
    from helpers import base_config

    raw = base_config([{"name": "a", "path": str(data)}], None)
    big = 10**30
    if key == "max_records":
        raw["datasets"][0]["max_records"] = big
    else:
        raw.setdefault(key, {})[where.split(".")[1]] = big
    with pytest.raises(ConfigError, match=rf"^config: '{re.escape(where)}': must fit a 64-bit integer "
                                          rf"\(at most 9223372036854775807\), got a 31-digit integer$"):
        validate(raw)
    raw["run"]["seed"] = 10**400  # beyond a float's range too (formatting it as one raised OverflowError)
    with pytest.raises(ConfigError, match=r"^config: 'run\.seed': must fit a 64-bit integer .* got a 401-digit "
                                          r"integer$"):
        validate(raw)
    raw = base_config([{"name": "a", "path": str(data), "max_records": 2**63 - 1}], None)
    assert validate(raw)["datasets"][0]["max_records"] == 2**63 - 1


# -- a failed run does not refuse the corrected config (issue #13 item 4) ------------------------------

def _failed_run(run_dir: Path, cfg: dict, status: str = "failed") -> None:
    from streamprep import atomic

    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "streamprep.log").write_text("{}\n")
    (run_dir / ".lock").write_text("")
    atomic.write_json(run_dir / "run.json", {"run_id": "r1", "status": status, "config": cfg,
                                             "checkpoint_dir": str(run_dir / "checkpoints")})


def test_failed_run_without_outputs_is_no_drift(tmp_path: Path, data: Path) -> None:
    from streamprep.pipeline import _preflight

    old = validate({"datasets": [{"name": "a", "path": str(data)}], "quality": {"min_chars": 5}})
    new = validate({"datasets": [{"name": "a", "path": str(data)}]})
    run_dir = tmp_path / "run"
    _failed_run(run_dir, old)
    assert _preflight(Config.from_dict(new), run_dir, fresh=False) is None  # nothing written that the change could mix with
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "a.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"config changed since this run started \(quality.min_chars\)"):
        _preflight(Config.from_dict(new), run_dir, fresh=False)


@pytest.mark.parametrize("status, refused", [("failed", False), ("interrupted", False), ("complete", True)])
def test_export_only_keys_may_change_until_the_run_completes(tmp_path: Path, data: Path, status: str,
                                                              refused: bool) -> None:
    from streamprep.pipeline import _preflight

    base = {"datasets": [{"name": "a", "path": str(data)}]}
    old = validate({**base, "output": {"parquet": {"compression": "gzip"}, "num_shards_multiple_of": 50}})
    new = validate({**base, "run": {"seed": 9}, "output": {"valid_fraction": 0.1}})
    new["datasets"][0]["weight"] = 3.0
    run_dir = tmp_path / "run"
    _failed_run(run_dir, old, status)
    (run_dir / "receipts").mkdir()
    (run_dir / "receipts" / "a.json").write_text("{}")  # tokenization output exists
    assert drift_keys(old, new) == ["datasets[0].weight", "output.num_shards_multiple_of",
                                    "output.parquet.compression", "output.valid_fraction", "run.seed"]
    if refused:
        with pytest.raises(ConfigError, match="config changed"):
            _preflight(Config.from_dict(new), run_dir, fresh=False)
    else:
        assert _preflight(Config.from_dict(new), run_dir, fresh=False)["run_id"] == "r1"


def test_a_weight_is_no_export_only_key_when_it_shares_out_the_tokenizer_sample(tmp_path: Path, data: Path) -> None:
    """Regression: with `tokenizer.train.sample_mb` the dataset weights decide the tokenizer's training sample, yet a
    resume of an unfinished run took a changed weight as an export-only key: the run kept the tokenizer trained on
    the old shares and run.json recorded the new weights, whose own run trains another tokenizer."""
    from streamprep.pipeline import _preflight

    raw = {"datasets": [{"name": "a", "path": str(data)}], "tokenizer": {"train": {"sample_mb": 0.5}}}
    old, new = validate(raw), validate(raw)
    new["datasets"][0]["weight"] = 3.0
    assert drift_keys(old, new, exports_redone=True) == ["datasets[0].weight"]
    run_dir = tmp_path / "run"
    _failed_run(run_dir, old, "interrupted")
    (run_dir / "receipts").mkdir()
    (run_dir / "receipts" / "a.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"config changed since this run started \(datasets\[0\]\.weight\)"):
        _preflight(Config.from_dict(new), run_dir, fresh=False)
    del raw["tokenizer"]  # trained on all kept text: the weights are the exports' only
    assert drift_keys(validate(raw), {**validate(raw), "datasets": new["datasets"]}, exports_redone=True) == []


@pytest.mark.slow
def test_run_failed_in_exports_resumes_with_the_corrected_config(tmp_path: Path, shared_data: Path) -> None:
    """num_shards_multiple_of too large fails after ingest + tokenization; the fix resumes in the same run dir
    and writes the same bytes as a fresh run of the corrected config."""
    import json

    from helpers import PHI2, base_config, english_docs, tree_hashes
    from streamprep.exports import ShardCountError
    from streamprep.pipeline import run_from_dict

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(40)))
    cfg = base_config([{"name": "gen", "path": str(src)}], str(shared_data / PHI2))
    bad = copy.deepcopy(cfg)
    bad["output"]["num_shards_multiple_of"] = 1000
    run_dir = tmp_path / "run"
    with pytest.raises(ShardCountError) as err:
        run_from_dict(bad, run_dir=run_dir, console_log=False)
    assert isinstance(err.value, ConfigError)  # regression: exit 1 and "to resume: re-run", which could only fail
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"
    assert run_from_dict(cfg, run_dir=run_dir, console_log=False).status == "complete"
    run_from_dict(cfg, run_dir=tmp_path / "fresh", console_log=False)
    outputs, names = ("ingest", "binidx", "receipts", "parquet", "tokenizer"), ("manifest.json", "mixtures.json")
    hashes = tree_hashes(run_dir, *outputs, names=names)
    assert hashes == tree_hashes(tmp_path / "fresh", *outputs, names=names)
    assert any(k.startswith("parquet/") for k in hashes) and "manifest.json" in hashes


def test_checkpoint_dir_under_a_regular_file_is_refused_before_writing(tmp_path: Path, data: Path) -> None:
    from streamprep.pipeline import _preflight

    (tmp_path / "file").write_text("x")
    cfg = validate({"datasets": [{"name": "a", "path": str(data)}], "run": {"checkpoint_dir": "file/ckpt"}},
                   base_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"'run.checkpoint_dir' .*file/ckpt: .*file is not a directory"):
        _preflight(Config.from_dict(cfg), tmp_path / "run", fresh=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where", ["run", "run/tokenizer", "run/parquet", "run/ingest/a"])
def test_a_checkpoint_dir_inside_the_run_dir_is_refused_before_writing(tmp_path: Path, data: Path, where: str) -> None:
    """Regression: `run.checkpoint_dir` at the run dir (or a folder of its outputs) was taken, and a checkpoint
    `<dataset>.json` met the run's own files: a dataset named `run` and run.json overwrote each other (progress
    lost, status at zeros), one named `tokenizer` broke the run's tokenizer (exit 1 at every re-run). The default,
    RUN_DIR/checkpoints, and a folder outside stay fine."""
    from streamprep.pipeline import _preflight

    def preflight(ckpt: str) -> None:
        cfg = validate({"datasets": [{"name": "a", "path": str(data)}], "run": {"checkpoint_dir": ckpt}},
                       base_dir=tmp_path)
        _preflight(Config.from_dict(cfg), tmp_path / "run", fresh=False)

    with pytest.raises(ConfigError, match=rf"^config: 'run.checkpoint_dir': {tmp_path / where} is the run dir or a "
                                          r"folder inside it, where the checkpoint files would meet the run's own; "):
        preflight(where)
    assert not (tmp_path / "run").exists()
    preflight("run/checkpoints")
    preflight("elsewhere")


def test_a_yaml_error_says_what_and_where(tmp_path: Path) -> None:
    """Regression: only PyYAML's context line was kept ("while scanning for the next token"), not the problem or
    its line."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run:\n\tname: x\n")
    with pytest.raises(ConfigError) as err:
        load_file(cfg)
    assert str(err.value) == (f"config: {cfg}: not valid YAML: found character '\\t' that cannot start any token "
                              f"(line 2, column 1)")
    for empty in ("", "# only a comment\n"):  # regression: "top level must be a mapping, got NoneType", no file named
        cfg.write_text(empty)
        with pytest.raises(ConfigError) as err:
            load_file(cfg)
        assert str(err.value) == f"config: {cfg}: empty (no YAML mapping in it)"
    for text, kind in (("- run: {name: x}\n", "list"), ("just text\n", "str"), ("3\n", "int")):  # regression:
        cfg.write_text(text)                                                                   # no file named
        with pytest.raises(ConfigError) as err:
            load_file(cfg)
        assert str(err.value) == f"config: {cfg}: top level must be a mapping, got {kind}"


@pytest.mark.parametrize("key", ["run.name", "datasets[0].name"])
def test_a_name_with_a_letter_written_decomposed_says_so_and_is_not_normalised(tmp_path: Path, good: dict,
                                                                                 key: str) -> None:
    """Regression: `e` + U+0301 (NFD, as macOS writes file names) was refused as "must be a name of 1-64 letters …,
    got 'éx'", a name that looks valid; the error names the mark and the composed form, and nothing is changed."""
    with pytest.raises(ConfigError) as err:
        validate(_with(good, key, "de\u0301j\u00e0"), base_dir=tmp_path)
    assert str(err.value) == (f"config: '{key}' 'de\u0301j\u00e0' holds the combining mark U+0301 (COMBINING ACUTE "
                              f"ACCENT): a letter written decomposed (NFD); write it composed (NFC), 'd\u00e9j\u00e0'")
    with pytest.raises(ConfigError, match=r"must be a name of 1-64 letters"):  # a lone mark composes with nothing
        validate(_with(good, key, "\u0301x"), base_dir=tmp_path)
    cfg = validate(_with(good, key, "d\u00e9j\u00e0"), base_dir=tmp_path)
    assert (cfg["run"]["name"] if key == "run.name" else cfg["datasets"][0]["name"]) == "d\u00e9j\u00e0"


@pytest.mark.parametrize("key", ["run.name", "datasets[0].name"])
@pytest.mark.parametrize("name", ["हिन्दी", "தமிழ்", "ฟิสิกส์", "web.हिन्दी-2"])
def test_a_composed_name_with_combining_marks_is_a_name(tmp_path: Path, good: dict, key: str, name: str) -> None:
    """Regression: `\\w` leaves out combining marks, so a name written in Devanagari, Tamil or Thai (their vowel
    signs are marks) was refused as 'must be a name of 1-64 letters …', though the docs say letters (Unicode); in a
    composed (NFC) name they are letters' parts now. A mark first is still no name."""
    cfg = validate(_with(good, key, name), base_dir=tmp_path)
    assert (cfg["run"]["name"] if key == "run.name" else cfg["datasets"][0]["name"]) == name
    for no_name in ("\u093f" + name, name + ".\u0301", name + "_\u0301"):  # a mark first, or after no letter
        with pytest.raises(ConfigError, match=r"must be a name of 1-64 letters"):
            validate(_with(good, key, no_name), base_dir=tmp_path)


@pytest.mark.parametrize("name, holds", [
    ("\u1112\u1161\u11ab\u1100\u116e\u11a8", "U+1112 (HANGUL CHOSEONG HIEUH): a letter written decomposed (NFD)"),
    ("\u212b", "U+212B (ANGSTROM SIGN), which the composed form (NFC) writes as U+00C5"),
    # every letter of it is in its composed form too ('각가aᆨ'): a bare StopIteration, exit 1
    ("\uac00\u11a8\uac00a\u11a8", "U+AC00 (HANGUL SYLLABLE GA): a letter written decomposed (NFD)"),
    # a composition exclusion, NFC's decomposed: its vowel sign was named, a letter "written decomposed"
    ("\u0958\u093e", "U+0958 (DEVANAGARI LETTER QA), which the composed form (NFC) writes as U+0915 U+093C"),
    ("q\u0958", "U+0958 (DEVANAGARI LETTER QA), which the composed form (NFC) writes as U+0915 U+093C"),
    # composed, its marks out of canonical order: the first mark was named "a letter written decomposed"
    ("\u05e9\u05c1\u05b8", "the combining mark U+05C1 (HEBREW POINT SHIN DOT) before U+05B8 (HEBREW POINT QAMATS), "
                           "which the composed form (NFC) puts first: combining marks in canonical order"),
    # e with two marks, the second composing into it: the first was named
    ("e\u0301\u0323", "the combining mark U+0323 (COMBINING DOT BELOW): a letter written decomposed (NFD)")])
def test_a_name_not_in_composed_form_says_so(tmp_path: Path, good: dict, name: str, holds: str) -> None:
    """Regression: Hangul written decomposed (as macOS writes file names) is letters (conjoining jamo), no mark,
    so it passed as a name, and a second dataset of the same name composed ran beside it in a folder that looks
    the same; any name not in composed form (NFC) is refused, naming the letter and the composed name. And the
    character named is the one NFC changes, with its reason (the first mark was named whatever NFC did)."""
    import unicodedata

    with pytest.raises(ConfigError) as err:
        validate(_with(good, "datasets[0].name", name), base_dir=tmp_path)
    assert str(err.value) == (f"config: 'datasets[0].name' {name!r} holds {holds}; write it composed (NFC), "
                              f"{unicodedata.normalize('NFC', name)!r}")


@pytest.mark.parametrize("key", ["run.checkpoint_dir", "datasets[0].path", "tokenizer.path"])
@pytest.mark.parametrize("absolute", [False, True])
def test_a_path_through_a_symlink_loop_names_its_key(tmp_path: Path, data: Path, key: str, absolute: bool) -> None:
    """Regression: an absolute path was not resolved, so a loop there was a bare RuntimeError at the checkpoint
    dir's preflight (exit 1) and 'no such file or directory' for a dataset or the tokenizer."""
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    loop = str(tmp_path / "loop_a") if absolute else "loop_a"
    raw = {"datasets": [{"name": "a", "path": str(data)}], "run": {}, "tokenizer": {}}
    section, _, name = key.replace("[0]", "").partition(".")
    (raw[section][0] if section == "datasets" else raw[section])[name] = loop
    with pytest.raises(ConfigError, match=rf"^config: '{re.escape(key)}': Symlink loop from "):
        validate(raw, base_dir=tmp_path)


def test_typed_config_is_frozen_and_round_trips_byte_identical(good: dict) -> None:
    import dataclasses
    import pickle

    import orjson

    from streamprep.config import ExecutionConfig, config_hash, load

    raw = {**good, "quality": {"min_language_prob": 0.5}, "output": {"mixtures": {"phases": {"p": {"a": 1.0}}}}}
    plain = validate(copy.deepcopy(raw))
    cfg = load(copy.deepcopy(raw))
    assert isinstance(cfg.execution, ExecutionConfig) and cfg.execution.engine == "xenna"
    assert cfg.output.parquet.length_buckets == (128, 256, 512, 1024, 2048, 4096, 8192)
    assert cfg.datasets[0].name == "a" and cfg.quality.min_language_prob == 0.5
    # run.json and the config hash are written from the dict: same bytes, same key order, same hash
    assert orjson.dumps(cfg.to_dict()) == orjson.dumps(plain)
    assert config_hash(cfg.to_dict()) == config_hash(plain)
    assert Config.from_dict(cfg.to_dict()) == cfg
    # a section holding read-only mappings pickles (as its dict), like the `sft:` section shard tasks carry
    assert pickle.loads(pickle.dumps(cfg.output)) == cfg.output
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.run.seed = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.quality.min_language_prob = 0.1  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.output.mixtures.phases["p"]["a"] = 2.0  # type: ignore[index]


def test_dataclass_fields_mirror_spec_and_carry_no_defaults() -> None:
    """Defaults are defined once, in SPEC / DATASET_SPEC: the dataclasses have the same keys and no defaults."""
    import dataclasses

    from streamprep import config as c

    def check(cls: type, spec: dict) -> None:
        assert [f.name for f in dataclasses.fields(cls)] == list(spec)
        for f in dataclasses.fields(cls):
            assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, f.name

    check(c.RunConfig, c.SPEC["run"])
    check(c.TokenizerConfig, c.SPEC["tokenizer"])
    check(c.TokenizerTrainConfig, c.SPEC["tokenizer"]["train"])
    check(c.OutputConfig, c.SPEC["output"])
    check(c.ParquetConfig, c.SPEC["output"]["parquet"])
    check(c.MixturesConfig, c.SPEC["output"]["mixtures"])
    check(c.ExecutionConfig, c.SPEC["execution"])
    check(c.DatasetConfig, {**c.DATASET_SPEC, "blend_split": None})
    # the default bucket list is written once in the package source
    src = "".join(p.read_text() for p in Path(c.__file__).parent.rglob("*.py"))
    assert src.count("[128, 256, 512, 1024, 2048, 4096, 8192]") == 1


def test_hf_formats_accepted_for_hf_paths_only(data: Path) -> None:
    cfg = validate({"datasets": [{"name": "h", "path": "hf://org/ds", "split": "train", "format": "csv"}],
                    "tokenizer": {"if_missing": "train"}})
    assert cfg["datasets"][0]["format"] == "csv"
    with pytest.raises(ConfigError, match=r"'datasets\[0\]\.format' must be jsonl, parquet, txt or document, got 'csv'"):
        validate({"datasets": [{"name": "a", "path": str(data), "format": "csv"}]})


def test_an_sft_key_left_empty_is_an_error_not_a_pretraining_run(tmp_path: Path) -> None:
    """Regression: `sft:` with nothing under it was read as no `sft:` at all: a pretraining run over chat records,
    every one rejected `schema: no 'text' field`, exit 0. An empty `quality:` still means its defaults."""
    src = tmp_path / "chat.jsonl"
    src.write_text('{"messages": []}\n')
    raw = {"datasets": [{"name": "g", "path": str(src)}], "sft": None}
    with pytest.raises(ConfigError, match=r"^config: 'sft': section is empty \(it needs at least input.sections"):
        validate(raw, base_dir=tmp_path)
    datasets = raw["datasets"]
    assert validate({"datasets": datasets, "quality": None}, base_dir=tmp_path)["quality"] == \
        validate({"datasets": datasets}, base_dir=tmp_path)["quality"]


def test_a_config_path_given_with_a_tilde_is_in_the_home_folder(tmp_path: Path, good: dict, monkeypatch) -> None:
    """Regression: `--config=~/cfg.yaml` (no shell expands a `~` after `=`) was `no such file: ~/cfg.yaml`, where
    the run dir given so is in the home folder; an unknown user is a one-line error naming the path."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(good))
    assert load_file("~/cfg.yaml").datasets[0].name == "a"
    with pytest.raises(ConfigError) as err:
        load_file("~no_such_user_x/cfg.yaml")
    assert str(err.value).startswith("config: ~no_such_user_x/cfg.yaml: ") and "\n" not in str(err.value)
