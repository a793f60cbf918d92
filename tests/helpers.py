"""Small builders shared by tests: configs over real or generated data, run dirs, file hashes."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]  # the checkout (tests/ live in subfolders mirroring the packages)


def ingest_with_plugin(tmp_path: Path, module: str, code: str, cfg: dict[str, Any]) -> subprocess.CompletedProcess:
    """`streamprep ingest` of `cfg` into tmp_path/run, in its own interpreter, with the plug-in module `module`
    (source `code`, written to tmp_path/plugins) named in STREAMPREP_PLUGINS: every process of the job imports it."""
    import yaml

    (tmp_path / "plugins").mkdir(exist_ok=True)
    (tmp_path / "plugins" / f"{module}.py").write_text(code)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "STREAMPREP_PLUGINS": module,
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "plugins"), str(REPO)])}
    return subprocess.run([sys.executable, "-m", "streamprep", "ingest", "--config", str(tmp_path / "cfg.yaml"),
                           "--run-dir", str(tmp_path / "run")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
PHI2 = "tokenizers/phi-2/tokenizer.json"


def base_config(datasets: list[dict[str, Any]], tokenizer: str | None, **over: Any) -> dict[str, Any]:
    """A small local-engine config; `over` replaces whole top-level sections."""
    cfg: dict[str, Any] = {
        "run": {"name": "t", "seed": 7},
        "datasets": datasets,
        "quality": {"expected_language": None, "min_chars": 20},
        "tokenizer": {"path": tokenizer, "train": {"vocab_size": 600, "min_frequency": 2}},
        "output": {"shard_records": 200},
        "execution": {"engine": "local", "workers": 1, "batch_records": 64},
    }
    cfg.update(over)
    return cfg


def assert_part_sha_refused(stderr: str, run: Path) -> None:
    """The resume's refusal of dataset gen's part 1, whose SHA-256 is not its sealed record's: the last line of
    `stderr` says what to delete, and run.json records that the run needs a change (exit 2 under every engine)."""
    line = stderr.splitlines()[-1]
    assert line.startswith("streamprep: error: ingest/gen/part-00001.jsonl: its SHA-256 is ") and line.endswith(
        "(a damaged disk or an edit); delete the part (or gen.sealed) and re-run the same command, which ingests "
        "dataset gen again, or start over with a new --run-dir"), line
    assert json.loads((run / "run.json").read_text())["needs_change"] is True


def assert_gone_refused(cfg: dict[str, Any], run: Path, dataset: str, victim: str) -> None:
    """A job of `cfg` in `run` stops with the refusal of `dataset`'s input file `victim`, gone since the run started
    (a ConfigError: exit 2), and run.json records that the run failed and needs a change."""
    import pytest

    from streamprep import run_from_dict
    from streamprep.config import ConfigError

    with pytest.raises(ConfigError) as err:
        run_from_dict(cfg, run_dir=run, console_log=False)
    assert str(err.value) == (f"dataset {dataset}: input file {victim} is gone since this run started; resuming "
                              f"would mix old and new data — restore the file, or start over with a new --run-dir")
    record = json.loads((run / "run.json").read_text())
    assert record["status"] == "failed" and record["needs_change"] is True


def tree_hashes(root: Path, *subdirs: str, names: tuple[str, ...] = ()) -> dict[str, str]:
    """sha256 of every file under the given subdirs (and the named top-level files), by relative path."""
    out = {}
    for sub in subdirs:
        base = root / sub
        for p in sorted(base.rglob("*")) if base.exists() else []:
            if p.is_file():
                out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    for n in names:
        if (root / n).exists():
            out[n] = hashlib.sha256((root / n).read_bytes()).hexdigest()
    return out


def english_docs(n: int, seed: int = 0) -> list[str]:
    """Deterministic English-ish documents of 150-600 chars, all distinct."""
    import random

    words = ("the data pipeline reads records from many files and writes clean text for training large "
             "language models while checking quality and removing duplicates before tokenization").split()
    rng = random.Random(seed)
    return [f"Document {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(25, 90))) + "."
            for i in range(n)]


async def ingest_stopped_after(config: Any, run_dir: Path, dataset: str, consumed: int):
    """Run the asyncio ingest and request a stop once `dataset` has consumed `consumed` items; its final state."""
    import asyncio

    from streamprep.ingest import IngestContext, ingest_all

    ctx = IngestContext.of(config, run_dir, run_dir / "checkpoints", asyncio.Event())
    task = asyncio.create_task(ingest_all(ctx))
    await _until_consumed(ctx, task, dataset, consumed)
    ctx.stop.set()
    return (await task)[dataset]


async def ingest_killing_a_holder(config: Any, run_dir: Path, dataset: str, consumed: int, holder: int) -> int:
    """Run the asyncio ingest with its own dedup holders and kill -9 holder `holder`'s process once `dataset` has
    consumed `consumed` items; the number of holders the job replaced."""
    import asyncio
    import os
    import signal

    from streamprep.ingest import IngestContext, ingest_all, start_holders

    ctx = IngestContext.of(config, run_dir, run_dir / "checkpoints", asyncio.Event())
    ctx.holders = start_holders(ctx)
    try:
        task = asyncio.create_task(ingest_all(ctx))
        await _until_consumed(ctx, task, dataset, consumed)
        os.kill(ctx.holders.pids[holder], signal.SIGKILL)
        await task
        return ctx.holders.replaced
    finally:
        ctx.holders.close()


async def _until_consumed(ctx: Any, task: Any, dataset: str, consumed: int) -> None:
    """Until `dataset` has consumed `consumed` items, or the ingest `task` has ended (awaiting it then raises what
    it raised, instead of this waiting for ever)."""
    import asyncio

    while not task.done() and (dataset not in ctx.progress or ctx.progress[dataset].consumed < consumed):
        await asyncio.sleep(0.001)


def local_source(path: Any, fmt: str | None = None) -> Any:
    """A LocalSource on `path` (a file, directory or glob), as a dataset entry with defaults would open it."""
    from streamprep.config import dataset
    from streamprep.sources.local import LocalSource

    return LocalSource(dataset({"name": "d", "path": str(path), "format": fmt}))


# -- two datasets with known defects, shared by the audit and status tests --------------------------------
SCRIPT_TEXT = "<script>alert(\"pwn\")</script> & 'q' </pre><b>x"
N_A, DUP_EVERY, BAD_EVERY, EMPTY_EVERY = 100, 10, 30, 25


def make_tokenizer(path: Path, texts: list[str]) -> None:
    """A small byte-level BPE whose normaliser deletes 'x' and whitespace: 'xxx xxx' encodes to nothing."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.normalizer = normalizers.Replace(Regex(r"[xX\s]"), "")
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, min_frequency=2, special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))


def make_inputs(root: Path) -> dict:
    """Two datasets with known defects; returns the config dict and what the audit must find."""
    root.mkdir(parents=True, exist_ok=True)
    docs = english_docs(150)
    make_tokenizer(root / "tok.json", docs)
    expect = {"duplicate": 0, "parse": 0, "schema": 0, "empty_tokens": 0}
    with open(root / "a.jsonl", "w") as fh:
        for i, d in enumerate(docs[:N_A]):
            fh.write(json.dumps({"text": d, "id": f"a{i}"}) + "\n")
            if i % DUP_EVERY == 0:
                fh.write(json.dumps({"text": d}) + "\n")
                expect["duplicate"] += 1
            if i % BAD_EVERY == 0:
                fh.write('{"text": "broken\n')
                expect["parse"] += 1
            if i % EMPTY_EVERY == 0:  # kept by QC once, then exact duplicates of itself
                fh.write(json.dumps({"text": "x" * 30 + " " + "x" * 40}) + "\n")
                if i:
                    expect["duplicate"] += 1
                else:
                    expect["empty_tokens"] += 1
        fh.write(json.dumps({"text": SCRIPT_TEXT}) + "\n")   # too short: schema
        fh.write(json.dumps({"body": "no text field"}) + "\n")  # schema
        expect["schema"] += 2
    with open(root / "b.jsonl", "w") as fh:
        for d in docs[N_A:]:
            fh.write(json.dumps({"text": d}) + "\n")
    cfg = base_config([{"name": "a", "path": str(root / "a.jsonl")}, {"name": "b", "path": str(root / "b.jsonl")}],
                      str(root / "tok.json"), output={"shard_records": 30})
    cfg["quality"]["min_chars"] = 60
    return {"config": cfg, "expect": expect}


def log_events(run_dir, event: str) -> list[dict]:
    """The lines of the run's log (`logs/streamprep.log`) whose event is `event`, parsed, in order."""
    lines = (run_dir / "logs" / "streamprep.log").read_text().splitlines()
    return [x for x in map(json.loads, lines) if x["event"] == event]


# -- a running job's metrics, as an operator reads them ------------------------------------------------------
def port_of(run_dir) -> int | None:
    """The port a `metrics_port: 0` job picked, as an operator finds it: in the run's log."""
    log = run_dir / "logs" / "streamprep.log"
    lines = log.read_text().splitlines() if log.is_file() else []
    ports = [json.loads(line)["port"] for line in lines if '"metrics server listening"' in line]
    return ports[-1] if ports else None


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def log_in_worker(n: int, fail: bool = False) -> int:
    """An executor call that logs (what a unit's Hub retry or a backend's fallback does in a worker), then returns
    its process's pid or raises."""
    from streamprep import logs

    logs.get("probe").warning("probe event", n=n)
    if fail:
        logs.get("probe").info("probe failing", n=n)
        raise ValueError(f"probe {n} failed")
    return os.getpid()


def exit_in_worker(code: int) -> None:
    """An executor call that ends the process running it at once, as a plug-in's os._exit or a crash would."""
    os._exit(code)


def nap(seconds: float) -> str:
    """An executor call with its own retry (`executor.again`): "first" from a first attempt."""
    import time

    time.sleep(seconds)
    return "first"


def nap_again(seconds: float) -> str:
    """What an executor runs for `nap` again after its worker died."""
    return "again"


nap.again = nap_again  # type: ignore[attr-defined]


def ray_worker_error() -> BaseException:
    """What `ray.get` raises for a call that raised TypeError in a Ray worker actor: Ray's own RayTaskError, as Ray
    builds it (`as_instanceof_cause`), its message Ray's ANSI-coloured header, then the worker's traceback."""
    from ray.exceptions import RayTaskError

    cause = TypeError("build_audit() takes 1 positional argument but 2 were given")
    trace = ('Traceback (most recent call last):\n  File "/n/streamprep/executor.py", line 130, in with_events\n'
             f"    result = fn(*args)\nTypeError: {cause}")
    return RayTaskError("_Actor.run", trace, cause, proctitle="ray::_Actor.run", pid=4242, ip="10.0.0.7",
                        actor_repr="<streamprep.executor._Actor object at 0x7f>", actor_id="ab12").as_instanceof_cause()



def streamprep_obeying_permissions(argv: list[str], cwd: Path | None = None) -> Any:
    """`python -m streamprep ARGV` (a CompletedProcess, text) in a process that permission bits refuse as they refuse
    a user: run as root, CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH leave its capability bounding set before it starts
    (`setpriv --bounding-set=-dac_override,-dac_read_search`), as root reads and enters a `chmod 000` folder. Skips
    where they cannot be dropped."""
    import ctypes
    import subprocess
    import sys

    import pytest

    def drop() -> None:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH; 24: PR_CAPBSET_DROP
            if prctl(24, cap, 0, 0, 0) != 0:
                os._exit(77)

    proc = subprocess.run([sys.executable, "-m", "streamprep", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=120, check=False, preexec_fn=drop if os.geteuid() == 0 else None)
    if proc.returncode == 77:
        pytest.skip("cannot drop root's permission override (no CAP_SETPCAP)")
    return proc


def deny_reading(monkeypatch: Any, refused: Path, read_bytes: bool = True) -> None:
    """`refused` as a file this process may not read (chmod 000 as a user; root reads anything): `os.access` denies
    it R_OK, and, with `read_bytes`, `Path.read_bytes` of it raises PermissionError naming it."""
    import errno

    access, read = os.access, Path.read_bytes

    def refusing(path: Path) -> bytes:
        if path == refused:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return read(path)
    if read_bytes:
        monkeypatch.setattr(Path, "read_bytes", refusing)
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: (Path(path) != refused or mode & os.R_OK == 0)
                        and access(path, mode, **kw))

