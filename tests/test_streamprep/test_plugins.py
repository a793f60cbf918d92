"""A toy plug-in of each kind (source format, gate, output writer, executor), added through the public
registration only (one line each, as docs/architecture.md shows), runs in a small local job."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import pytest

import yaml

from helpers import REPO, base_config, english_docs, ingest_with_plugin, tree_hashes
from quality.gates import Doc, Gate, register_gate
from streamprep import atomic, config, registry, run_from_dict
from streamprep.binidx import IndexedDataset
from streamprep.config import ConfigError
from streamprep.engines.base import Engine, Result
from streamprep.exports import WriterContext
from streamprep.sources.base import BadRecord
from streamprep.tokenize import ShardTask, TokenizerCache, run_task
from streamprep.verify import verify_run

def read_toy(fh: BinaryIO, path: str) -> Iterator[dict[str, Any] | BadRecord]:
    """`.toy` files: records separated by lines of `%%`, the first line of a block its title."""
    for n, block in enumerate(fh.read().decode("utf-8").split("\n%%\n"), 1):
        title, _, body = block.strip("\n").partition("\n")
        if not body:
            yield BadRecord(f"toy block {n} of {path} has no body", title)
        else:
            yield {"text": body, "title": title}


class ForbiddenGate(Gate):
    """Rejects a text that says FORBIDDEN."""

    name = failed_check = "forbidden"

    def check(self, doc: Doc) -> str | None:
        at = doc.text.find("FORBIDDEN")
        return None if at < 0 else f"says FORBIDDEN at char {at}"


def write_counts(ctx: WriterContext) -> list[str]:
    """`toy_counts.json`: records per dataset."""
    atomic.write_json(ctx.run_dir / "toy_counts.json", {idx.name: len(idx) for idx in ctx.indexes})
    return ["toy_counts.json"]


class InlineEngine(Engine):
    """Runs each shard task at once, in the caller's thread, and remembers which it ran."""

    name = "inline"
    ran: list[str] = []

    def __init__(self, executor: Any = None, workers: int = 1, ray_address: str | None = None):
        super().__init__()
        self._results: list[Result] = []
        self._tokenizers = TokenizerCache()

    def submit(self, task: ShardTask) -> None:
        self.submitted += 1
        result = run_task(task, self._tokenizers.get(task))
        InlineEngine.ran.append(f"{task.dataset}/{task.part}")
        self._done(result)
        self._results.append(result)

    def drain(self) -> list[Result]:
        out, self._results = self._results, []
        return out


@pytest.fixture
def toy_plugins() -> Iterator[None]:
    registry.SOURCE_FORMATS.register("toy", read_toy, suffixes=(".toy",))
    register_gate(lambda settings, text_field: ForbiddenGate())
    registry.WRITERS.register("toy_counts", write_counts)
    registry.ENGINES.register("inline", InlineEngine)
    import quality.gates

    gates = list(quality.gates.EXTRA_GATES)
    yield
    for reg, name in ((registry.SOURCE_FORMATS, "toy"), (registry.WRITERS, "toy_counts"),
                      (registry.ENGINES, "inline")):
        reg.unregister(name)
    for factory in gates:
        quality.gates.EXTRA_GATES.remove(factory)


TOY_FORMAT_PLUGIN = """
from streamprep import registry


def read_toy(fh, path):
    for block in fh.read().decode("utf-8").split("\\n%%\\n"):
        title, _, body = block.strip("\\n").partition("\\n")
        yield {"text": body, "title": title}


registry.SOURCE_FORMATS.register("toy", read_toy, suffixes=(".toy",))
"""


@pytest.mark.slow  # two whole jobs
def test_a_plugin_imported_before_the_job_runs_in_its_worker_processes(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: the docs say to import a plug-in before the job starts or name it in STREAMPREP_PLUGINS; with
    `workers: 2` the imported one ran in no worker (a separate process): the gate judged nothing and a `.toy`
    file was one "unknown file type" reject, the run complete and different from `workers: 1`'s, and run.json's
    `plugins` empty, so a resume without it was not refused either. Workers now import the module, and run.json
    names it."""
    import importlib
    import quality.gates

    (tmp_path / "mods").mkdir()
    (tmp_path / "mods/late_toy_plugin.py").write_text(GATE_PLUGIN + TOY_FORMAT_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    gates = len(quality.gates.EXTRA_GATES)
    importlib.import_module("late_toy_plugin")
    docs = english_docs(40)
    (tmp_path / "in").mkdir()
    (tmp_path / "in/corpus.toy").write_text("\n%%\n".join(f"title {i}\n{d[:60]} FORBIDDEN {d[60:]}" if i % 7 == 3
                                                         else f"title {i}\n{d}" for i, d in enumerate(docs)) + "\n")
    try:
        outputs, pids = [], []
        for workers in (1, 2):
            cfg = base_config([{"name": "toy", "path": str(tmp_path / "in/corpus.toy")}], None,
                              execution={"engine": "local", "workers": workers, "batch_records": 8})
            run_dir = tmp_path / f"w{workers}"
            assert run_from_dict(cfg, run_dir=run_dir, console_log=False).status == "complete"
            assert json.loads((run_dir / "run.json").read_text())["plugins"] == ["late_toy_plugin"]
            rejects = [json.loads(line) for line in (run_dir / "rejects/toy.jsonl").read_text().splitlines()]
            assert [r["failed_check"] for r in rejects] == ["forbidden"] * 6
            pids.append({r["reason"].rsplit("pid ", 1)[1] for r in rejects})
            outputs.append(tree_hashes(run_dir, "ingest", "binidx"))
        assert outputs[0] == outputs[1] and pids[0] == {f"{os.getpid()})"} and f"{os.getpid()})" not in pids[1]
    finally:
        registry.SOURCE_FORMATS.unregister("toy")
        del quality.gates.EXTRA_GATES[gates:]
        sys.modules.pop("late_toy_plugin", None)


def test_a_gate_registered_before_import_streamprep_is_a_late_one(tmp_path: Path) -> None:
    """Regression: a gate module imported before `streamprep` (the docs' gate imports quality.gates only) was
    counted as a STREAMPREP_PLUGINS gate: workers (`workers: 2`) did not import it, so it judged nothing there
    (29 rejects with `workers: 1`, 0 with 2), and run.json's `plugins` did not record it. It is a late gate now,
    after the STREAMPREP_PLUGINS ones as in a worker; a STREAMPREP_PLUGINS module imported early stays theirs."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods/early_gate.py").write_text(GATE_PLUGIN)
    (tmp_path / "mods/named_gate.py").write_text(GATE_PLUGIN.replace('"forbidden"', '"named"'))
    script = ("import early_gate, named_gate\n"
              "import streamprep, quality.gates\n"
              "from streamprep import pipeline, unit_worker\n"
              "print([f.__module__ for f in quality.gates.EXTRA_GATES], unit_worker.late_plugins(), "
              "pipeline.plugin_modules())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "mods"), str(REPO)]),
           "STREAMPREP_PLUGINS": "named_gate"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    assert proc.stdout == ("['named_gate', 'early_gate'] [('quality gate', '<lambda>', 'early_gate')] "
                           "['named_gate', 'early_gate']\n"), proc.stderr[-2000:]


def test_a_plugin_workers_cannot_import_stops_the_job_naming_it(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A plug-in defined in the script that starts the job (module __main__) cannot reach a worker process: its
    workers say so, rather than judge without it. So does one whose module calls sys.exit there (it ended the
    worker process)."""
    from streamprep.unit_worker import _adopt

    monkeypatch.delitem(sys.modules, "__mp_main__", raising=False)  # a Ray actor: it runs none of the script
    assert _adopt([("quality gate", "MyGate", "__main__")]) == (
        "plug-in quality gate 'MyGate' (module __main__) is registered in the process that started the job but not "
        "in its worker processes: it is defined in the script that starts the job, which they do not run: move it "
        "to a module of its own; or name its module in STREAMPREP_PLUGINS, which every process imports")
    monkeypatch.setitem(sys.modules, "__mp_main__", sys.modules["__main__"])  # a local worker ran it again
    assert _adopt([("quality gate", "MyGate", "__main__")]) == (
        "plug-in quality gate 'MyGate' (module __main__) is registered in the process that started the job but not "
        "in its worker processes: it is registered under the script's `if __name__ == \"__main__\":`, which worker "
        "processes skip: register it at the script's top level or in a module; or name its module in "
        "STREAMPREP_PLUGINS, which every process imports")
    assert "importing no_such_module_here there failed (ModuleNotFoundError: No module named " \
           in _adopt([("source format", "x", "no_such_module_here")])  # its type once
    (tmp_path / "exits_in_a_worker.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "importing exits_in_a_worker there failed (SystemExit: 3)" \
           in _adopt([("quality gate", "G", "exits_in_a_worker")])
    assert _adopt([]) is None


SCRIPT_GATE_JOB = """
import sys

import streamprep
import yaml
from quality.gates import Doc, Gate, register_gate


class Marked(Gate):
    name = failed_check = "marked"

    def check(self, doc: Doc) -> str | None:
        return "says MARK" if "MARK" in doc.text else None


def factory(settings, text_field):
    return Marked()


if sys.argv[1] == "top":  # in the workers too, which run the script again (as __mp_main__)
    register_gate(factory)
if __name__ == "__main__":
    if sys.argv[1] == "guarded":
        register_gate(factory)
    try:
        print(streamprep.run_from_dict(yaml.safe_load(open("cfg.yaml")), run_dir=sys.argv[2], console_log=False).status)
    except streamprep.ConfigError as exc:
        print(f"ConfigError: {exc}")
"""


@pytest.mark.slow  # a whole job, in its own interpreter
def test_a_gate_the_script_registers_reaches_local_workers_at_top_level_not_under_its_main_guard(
        tmp_path: Path) -> None:
    """Regression: the docs said a gate defined in the script that starts the job cannot reach its workers; at
    the script's top level it does (`workers: 2`: each worker runs the script again as `__mp_main__`). Under its
    `if __name__ == "__main__":` it does not, and the job stopped as `SourceError: dataset a: reading or judging
    the input failed after item 0: PluginMissing: … defined in the script that starts the job, which they do not
    run`, blaming the input and wrong about the script. It is a config error now, naming the main guard; the run,
    failed, resumes once the gate is registered at the top level."""
    docs = english_docs(40)
    (tmp_path / "corpus.jsonl").write_text("".join(
        json.dumps({"text": f"{d[:60]} MARK {d[60:]}" if i % 7 == 3 else d}) + "\n" for i, d in enumerate(docs)))
    cfg = base_config([{"name": "a", "path": str(tmp_path / "corpus.jsonl")}], None,
                      execution={"engine": "local", "workers": 2, "batch_records": 8})
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "job.py").write_text(SCRIPT_GATE_JOB)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("STREAMPREP_PLUGINS", None)

    def job(where: str, run_dir: str) -> str:
        proc = subprocess.run([sys.executable, "job.py", where, run_dir], cwd=tmp_path, capture_output=True, text=True,
                              env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.strip()

    assert job("top", "top") == "complete"
    rejects = [json.loads(line) for line in (tmp_path / "top/rejects/a.jsonl").read_text().splitlines()]
    marked = sorted(r["source"]["index"] for r in rejects if r["failed_check"] == "marked")
    assert marked == list(range(3, 40, 7))
    assert job("guarded", "moved") == (
        "ConfigError: plug-in quality gate 'factory' (module __main__) is registered in the process that started the "
        "job but not in its worker processes: it is registered under the script's `if __name__ == \"__main__\":`, "
        "which worker processes skip: register it at the script's top level or in a module; or name its module in "
        "STREAMPREP_PLUGINS, which every process imports")
    assert json.loads((tmp_path / "moved/run.json").read_text())["status"] == "failed"
    assert job("top", "moved") == "complete"
    assert tree_hashes(tmp_path / "moved", "ingest", "binidx") == tree_hashes(tmp_path / "top", "ingest", "binidx")


@pytest.mark.slow  # a whole job
def test_a_toy_plugin_of_each_kind_runs_in_a_job(tmp_path: Path, toy_plugins: None) -> None:
    docs = english_docs(60)
    forbidden = {7, 19, 33, 41, 52}
    blocks = [f"title {i}\n{d[:80]} FORBIDDEN {d[80:]}" if i in forbidden else f"title {i}\n{d}"
              for i, d in enumerate(docs)]
    blocks.insert(10, "a title alone")
    (tmp_path / "in").mkdir()
    (tmp_path / "in/corpus.toy").write_text("\n%%\n".join(blocks) + "\n")
    cfg = base_config([{"name": "toy", "path": str(tmp_path / "in/corpus.toy")}], None,
                      execution={"engine": "inline", "workers": 1, "batch_records": 16},
                      output={"shard_records": 20})
    InlineEngine.ran.clear()
    result = run_from_dict(cfg, run_dir=tmp_path / "run", console_log=False)
    run_dir = result.run_dir
    assert result.status == "complete"

    # the source format read the made-up format: every kept text is a block's body, its title kept beside it
    kept = [json.loads(line) for p in sorted((run_dir / "ingest/toy").glob("part-*.jsonl"))
            for line in p.read_text().splitlines()]
    bodies = {d: i for i, d in enumerate(docs) if i not in forbidden}
    assert kept and all(k["text"] in bodies for k in kept)
    # the gate rejected exactly the five FORBIDDEN texts, with its reason; the title-only block is a parse reject
    rejects = [json.loads(line) for line in (run_dir / "rejects/toy.jsonl").read_text().splitlines()]
    by_check: dict[str, list[dict[str, Any]]] = {}
    for r in rejects:
        by_check.setdefault(r["failed_check"], []).append(r)
    assert len(by_check["forbidden"]) == 5
    assert all(r["reason"].startswith("says FORBIDDEN at char ") for r in by_check["forbidden"])
    assert [r["reason"] for r in by_check["parse"]] == [f"toy block 11 of {tmp_path / 'in/corpus.toy'} has no body"]
    run = json.loads((run_dir / "run.json").read_text())
    assert run["summary"]["kept"]["toy"] == len(kept) == 60 - 5 - sum(len(v) for k, v in by_check.items()
                                                                     if k not in ("forbidden", "parse"))

    # the executor ran every shard, and the shards hold every kept record
    receipts = sorted(p.stem for p in (run_dir / "receipts/toy").glob("part-*.json"))
    assert len(receipts) >= 2 and sorted(InlineEngine.ran) == [f"toy/{p}" for p in receipts]
    docs_in_shards = sum(len(IndexedDataset.open(str(run_dir / f"binidx/toy/{p}_text_document")))
                         for p in receipts)
    assert docs_in_shards == len(kept)

    # the writer's file is there, with the records per dataset, and the manifest lists and hashes it
    written = run_dir / "toy_counts.json"
    assert json.loads(written.read_text()) == {"toy": len(kept)}
    entry = next(f for f in json.loads((run_dir / "manifest.json").read_text())["files"]
                 if f["path"] == "toy_counts.json")
    assert entry["role"] == "toy_counts" and entry["sha256"] == hashlib.sha256(written.read_bytes()).hexdigest()
    assert verify_run(run_dir) == []
    written.write_text('{"toy": 0}')
    assert any("toy_counts.json" in p for p in verify_run(run_dir))


def test_config_lists_a_registered_engine_and_format(tmp_path: Path, toy_plugins: None) -> None:
    """Registration is all config needs: the names show in its one-line errors."""
    (tmp_path / "a.toy").write_text("t\nbody text\n")
    cfg = base_config([{"name": "a", "path": str(tmp_path / "a.toy"), "format": "xml"}], None)
    with pytest.raises(ConfigError, match=r"^config: 'datasets\[0\]\.format' must be jsonl, parquet, txt, "
                                          r"document or toy, got 'xml'$"):
        config.load(cfg)
    cfg = base_config([{"name": "a", "path": str(tmp_path / "a.toy")}], None, execution={"engine": "slurm"})
    with pytest.raises(ConfigError, match=r"^config: 'execution\.engine' must be xenna, local or inline, "
                                          r"got 'slurm'$"):
        config.load(cfg)


def test_a_lazy_plugin_that_fails_to_load_is_a_config_error_naming_it(tmp_path: Path, capsys: Any) -> None:
    """Regression: a plug-in declared as "module:attr" whose module is missing was found where the job first called
    it: a source format's as `SourceError: cannot read input file a.toy after record 0: ModuleNotFoundError` (the
    input blamed, the run dir written), a writer's after the whole ingest and tokenization, an engine's a bare
    ModuleNotFoundError, each exit 1. Now each entry the job uses loads at the config check: one line naming the
    registry, the name and the target, exit 2, nothing written; a broken one the job does not use fails nothing."""
    from streamprep.cli import main

    (tmp_path / "a.toy").write_text("t\nbody text\n")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in english_docs(10)))
    gone = "No module named 'nosuchmod_abc'"
    toy, jl = {"name": "a", "path": str(tmp_path / "a.toy")}, {"name": "j", "path": str(corpus)}
    cases = [
        (registry.SOURCE_FORMATS, "toy", {"suffixes": (".toy",)}, base_config([toy], None),
         f"config: 'datasets[0].path': source format 'toy' (nosuchmod_abc:read) cannot be loaded: "
         f"ModuleNotFoundError: {gone}"),
        (registry.SOURCE_FORMATS, "toy", {}, base_config([jl, {**toy, "format": "toy"}], None),
         f"config: 'datasets[1].format': source format 'toy' (nosuchmod_abc:read) cannot be loaded: "
         f"ModuleNotFoundError: {gone}"),
        (registry.WRITERS, "lazyw", {}, base_config([jl], None),
         f"config: output writer 'lazyw' (nosuchmod_abc:read) cannot be loaded: ModuleNotFoundError: {gone}"),
        (registry.ENGINES, "inline", {}, base_config([jl], None, execution={"engine": "inline"}),
         f"config: 'execution.engine': engine 'inline' (nosuchmod_abc:read) cannot be loaded: "
         f"ModuleNotFoundError: {gone}"),
        (registry.SOURCE_FORMATS, "toy", {"suffixes": (".toy",)}, base_config([jl], None), None),  # not used
        (registry.ENGINES, "inline", {}, base_config([jl], None), None),
    ]
    for reg, name, meta, cfg, message in cases:
        reg.register(name, "nosuchmod_abc:read", **meta)
        try:
            if message is None:
                assert config.load(cfg).datasets[0].name == "j"
                continue
            (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
            assert main(["ingest", "--config", str(tmp_path / "cfg.yaml"), "--run-dir", str(tmp_path / "run")]) == 2
        finally:
            reg.unregister(name)
        assert capsys.readouterr().err.splitlines() == [f"streamprep: error: {message}"]
        assert not (tmp_path / "run").exists()


class NotAnEngine:
    """A class registered as an engine that is not an `Engine` subclass."""

    def __init__(self, **kwargs: Any) -> None:
        pass


class NoRayAddress(InlineEngine):
    """An engine whose __init__ lacks `create`'s ray_address keyword."""

    def __init__(self, executor: Any = None, workers: int = 1) -> None:  # type: ignore[override]
        super().__init__(executor, workers)


class DrainsNone(InlineEngine):
    """The docs' engine with drain() returning None: a plug-in bug."""

    def drain(self) -> list[Result]:
        super().drain()
        return None  # type: ignore[return-value]


def test_an_engine_plugin_that_breaks_the_interface_is_named(tmp_path: Path, capsys: Any) -> None:
    """Regression: a registered class that is no Engine stopped the job after its run dir was written with
    `AttributeError: type object 'NotAnEngine' has no attribute 'job_executor'`, one whose __init__ lacks ray_address
    with a bare TypeError (an unexpected keyword), and drain() returning None with `TypeError: 'NoneType' object is
    not iterable`, each exit 1, the engine unnamed. The first two are config errors naming it (exit 2, nothing
    written); the last an EngineError naming it."""
    from streamprep.cli import main

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in english_docs(10)))
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(base_config([{"name": "a", "path": str(corpus)}], None,
                                                                   execution={"engine": "mine", "workers": 1})))
    ingest = ["ingest", "--config", str(tmp_path / "cfg.yaml"), "--run-dir", str(tmp_path / "run")]
    where = f"engine 'mine' ({__name__})"
    for cls, code, message in (
            (NotAnEngine, 2, f"config: 'execution.engine': {where} is NotAnEngine, not a subclass of "
                             f"streamprep.engines.base.Engine"),
            (NoRayAddress, 2, f"config: 'execution.engine': {where}: NoRayAddress() must take executor=, workers= and "
                              f"ray_address= (got an unexpected keyword argument 'ray_address')"),
            (DrainsNone, 1, f"EngineError: {where}: drain() returned NoneType, not a list of its tasks' results "
                            f"(tokenize.run_task's dicts)")):
        registry.ENGINES.register("mine", cls)
        try:
            assert main(ingest) == code
        finally:
            registry.ENGINES.unregister("mine")
        assert capsys.readouterr().err.splitlines()[-1] == f"streamprep: error: {message}"
        assert (tmp_path / "run").exists() == (code == 1)


GATE_PLUGIN = """
import os

from quality.gates import Doc, Gate, register_gate


class ForbiddenGate(Gate):
    name = failed_check = "forbidden"

    def check(self, doc: Doc) -> str | None:
        at = doc.text.find("FORBIDDEN")
        return None if at < 0 else f"says FORBIDDEN at char {at} (pid {os.getpid()})"


register_gate(lambda settings, text_field: ForbiddenGate())
"""


@pytest.mark.slow  # a whole job, in its own interpreter
def test_a_gate_named_in_streamprep_plugins_runs_in_every_qc_process(tmp_path: Path) -> None:
    """With `workers: 2` QC runs in a process pool; a gate whose module is named in STREAMPREP_PLUGINS (and
    imported nowhere else) is registered in those processes too, and rejects exactly the records it should."""
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins/toy_gate_plugin.py").write_text(GATE_PLUGIN)
    docs = english_docs(120)
    forbidden = {3, 17, 40, 41, 66, 90, 118}
    (tmp_path / "corpus.jsonl").write_text("".join(
        json.dumps({"text": f"{d[:60]} FORBIDDEN {d[60:]}" if i in forbidden else d}) + "\n"
        for i, d in enumerate(docs)))
    cfg = base_config([{"name": "toy", "path": str(tmp_path / "corpus.jsonl")}], None,
                      execution={"engine": "local", "workers": 2, "batch_records": 8},
                      output={"shard_records": 40})
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "STREAMPREP_PLUGINS": "toy_gate_plugin",
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "plugins"), str(REPO)])}
    proc = subprocess.Popen([sys.executable, "-m", "streamprep", "ingest", "--config", str(tmp_path / "cfg.yaml"),
                             "--run-dir", str(tmp_path / "run")], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]

    rejects = [json.loads(line) for line in (tmp_path / "run/rejects/toy.jsonl").read_text().splitlines()]
    ours = [r for r in rejects if r["failed_check"] == "forbidden"]
    assert sorted(r["source"]["index"] for r in ours) == sorted(forbidden)
    pids = {int(r["reason"].rpartition("pid ")[2].rstrip(")")) for r in ours}
    assert proc.pid not in pids and 1 <= len(pids) <= 2  # judged in the pool's processes, not in the driver
    run = json.loads((tmp_path / "run/run.json").read_text())
    assert run["summary"]["rejected"]["toy"] == len(rejects)
    assert run["summary"]["kept"]["toy"] == 120 - len(rejects)


def test_a_plugin_module_that_fails_to_import_is_one_line_exit_2_for_every_command(tmp_path: Path) -> None:
    """Regression: a STREAMPREP_PLUGINS module that was missing or raised at import was a traceback out of
    `import streamprep`, exit 1, for every command. Now the CLI says so in one line, exit 2, writing nothing, and
    the API's `config.validate` raises a ConfigError naming it. One calling sys.exit at import too: every command
    exited with its code (sys.exit(0): silently, as a success)."""
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins/broken_plugin.py").write_text("raise RuntimeError('boom at registration\\nsecond line')\n")
    (tmp_path / "plugins/exiting_plugin.py").write_text("import sys\nsys.exit(0)\n")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in english_docs(10)))
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(base_config([{"name": "a", "path": str(corpus)}], None)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "plugins"), str(REPO)])}
    for module, why in (("broken_plugin", "RuntimeError: boom at registration"),
                        ("no_such_plugin", "ModuleNotFoundError: No module named 'no_such_plugin'"),
                        ("exiting_plugin", "SystemExit: 0")):  # regression: every command ended 0, saying nothing
        line = f"STREAMPREP_PLUGINS: module {module!r} failed to import ({why})"
        for command in (["ingest", "--config", str(tmp_path / "cfg.yaml"), "--run-dir", str(tmp_path / "run")],
                        ["status", str(tmp_path / "run")]):
            proc = subprocess.run([sys.executable, "-m", "streamprep", *command], cwd=tmp_path, capture_output=True,
                                  text=True, env={**env, "STREAMPREP_PLUGINS": module}, timeout=120)
            assert (proc.returncode, proc.stderr) == (2, f"streamprep: error: {line}\n"), command
        assert not (tmp_path / "run").exists()
        api = subprocess.run([sys.executable, "-c", "import streamprep.config as c; c.validate({})"], cwd=tmp_path,
                             capture_output=True, text=True, env={**env, "STREAMPREP_PLUGINS": module}, timeout=120)
        assert api.stderr.splitlines()[-1] == f"streamprep.config.ConfigError: config: {line}"


ONCE_PLUGIN = """
import os

# the first process to import it only, as a plug-in binding a fixed port at import: EADDRINUSE in the next one
os.close(os.open(os.path.join(os.path.dirname(__file__), "imported.once"), os.O_CREAT | os.O_EXCL))
""" + GATE_PLUGIN


def test_a_plugin_module_that_fails_to_import_in_a_worker_stops_it_before_a_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker process whose `import streamprep` could not import a STREAMPREP_PLUGINS module (its
    `registry.PLUGIN_IMPORT_ERRORS`) judges nothing: it raises the config error naming the module and why."""
    from streamprep import unit_worker
    from streamprep.modes import PRETRAIN

    line = "STREAMPREP_PLUGINS: module 'p' failed to import (OSError: [Errno 98] Address already in use)"
    monkeypatch.setattr(registry, "PLUGIN_IMPORT_ERRORS", [line])
    unit_worker.init_worker({"dedup": "none", "expected_language": None, "min_chars": 1}, PRETRAIN)
    with pytest.raises(unit_worker.PluginMissing) as err:
        unit_worker.judge_piece("d", "text", 4, str(tmp_path / "piece"), None, items=[{"text": "a record"}])
    assert str(err.value) == f"{line} in a worker process, though the process that started the job imported it"


@pytest.mark.parametrize(("driver", "worker"), [(["evengate"], []), ([], ["evengate"]), (["a", "b"], ["b", "a"])])
def test_a_worker_with_other_streamprep_plugins_than_the_driver_stops_before_a_record(
        driver: list[str], worker: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a Ray worker has its node's environment, not the driver's, and its STREAMPREP_PLUGINS modules
    were not compared with the driver's: a gate the driver named judged nothing there (or one only the node named
    judged), exit 0, run.json naming the driver's. A worker whose modules (in order: it decides the gates') are not
    the driver's raises the config error naming both; the same modules judge."""
    from streamprep import unit_worker
    from streamprep.modes import PRETRAIN

    settings = {"dedup": "none", "expected_language": None, "min_chars": 1}
    monkeypatch.setattr(registry, "PLUGIN_MODULES", worker)
    unit_worker.init_worker(settings, PRETRAIN, [], driver)
    with pytest.raises(unit_worker.PluginMissing) as err:
        unit_worker.judge_piece("d", "text", 4, str(tmp_path / "piece"), None, items=[{"text": "a record"}])
    assert str(err.value) == (
        f"STREAMPREP_PLUGINS names {','.join(driver) or 'none'!r} in the process that started the job but "
        f"{','.join(worker) or 'none'!r} in its worker processes: give every process of the job the same "
        f"STREAMPREP_PLUGINS")
    unit_worker.init_worker(settings, PRETRAIN, [], list(worker))
    summary = unit_worker.judge_piece("d", "text", 4, str(tmp_path / "piece2"), None, items=[{"text": "a record"}])
    assert summary.kinds == bytes([unit_worker.KEPT])


def test_the_plugins_changed_error_advises_what_clears_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: the error's other way, "(or import the plug-in's module yourself)", left the variable as set after
    the import, which the same error then refused again: the way is to set it back (and import the module)."""
    monkeypatch.setattr(registry, "PLUGIN_MODULES", [])
    monkeypatch.setenv("STREAMPREP_PLUGINS", "json")
    import json as plugin  # noqa: F401 - what the old advice said to do: the variable still differs

    assert registry.plugins_changed_since_import() == (
        "STREAMPREP_PLUGINS names 'json' now but named 'none' when streamprep was imported, the moment it is read: "
        "set it before `import streamprep`, or set it back (a plug-in's module you import yourself reaches the "
        "workers too; the variable set after the import still differs)")
    monkeypatch.setenv("STREAMPREP_PLUGINS", "")  # set back, as it says
    assert registry.plugins_changed_since_import() is None


ENV_CHANGED_DRIVER = """
import json, os, sys
import streamprep  # imports the STREAMPREP_PLUGINS modules of this environment: `json`
from streamprep.config import ConfigError

os.environ["STREAMPREP_PLUGINS"] = ""  # the workers' forkserver starts with this environment
try:
    streamprep.run_from_dict(json.loads(sys.argv[1]), run_dir=sys.argv[2], console_log=False)
except ConfigError as exc:
    print("error:", exc)
"""


@pytest.mark.slow  # a whole job, in its own interpreter
@pytest.mark.parametrize("workers", [1, 2])
def test_streamprep_plugins_changed_after_import_is_a_config_error_naming_when_it_is_read(
        workers: int, tmp_path: Path) -> None:
    """Local worker processes get the environment of their forkserver, started at the job's first call, so a caller
    that changed STREAMPREP_PLUGINS after `import streamprep` had them judge with other modules than the driver's
    (workers 2, without a word; then refused by the worker check as another process's, advice it could not follow),
    and with one worker the job ran without the module it names, exit 0 (hunter R50 W). STREAMPREP_PLUGINS is read
    at the import: a config error says so, before anything is written."""
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in english_docs(20)))
    cfg = base_config([{"name": "a", "path": str(tmp_path / "corpus.jsonl")}], None,
                      execution={"engine": "local", "workers": workers, "batch_records": 8})
    env = {**os.environ, "STREAMPREP_PLUGINS": "json", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", ENV_CHANGED_DRIVER, json.dumps(cfg), str(tmp_path / "run")],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.stdout.splitlines()[-1:] == [
        "error: config: STREAMPREP_PLUGINS names 'none' now but named 'json' when streamprep was imported, the moment "
        "it is read: set it before `import streamprep`, or set it back (a plug-in's module you import yourself "
        "reaches the workers too; the variable set after the import still differs)"], \
        (proc.stdout + proc.stderr)[-3000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # a whole job, in its own interpreter
def test_a_plugin_module_only_the_driver_could_import_stops_a_two_worker_job_exit_2(tmp_path: Path) -> None:
    """Regression: a STREAMPREP_PLUGINS gate module that failed to import in the worker processes only (one binding
    a fixed port at import: the second importer gets EADDRINUSE) was skipped there without a word: `workers: 2`
    completed, exit 0, keeping what its gate rejects with `workers: 1`. The job stops before a record is judged,
    one line naming the module and its import error, exit 2 as for a module that fails to import anywhere."""
    docs = english_docs(40)
    (tmp_path / "corpus.jsonl").write_text("".join(
        json.dumps({"text": f"{d[:60]} FORBIDDEN {d[60:]}" if i % 5 == 2 else d}) + "\n" for i, d in enumerate(docs)))
    cfg = base_config([{"name": "a", "path": str(tmp_path / "corpus.jsonl")}], None,
                      execution={"engine": "local", "workers": 2, "batch_records": 8})
    proc = ingest_with_plugin(tmp_path, "once_gate", ONCE_PLUGIN, cfg)
    assert (proc.returncode, proc.stderr.splitlines()[-1]) == (2, (
        "streamprep: error: STREAMPREP_PLUGINS: module 'once_gate' failed to import (FileExistsError: [Errno 17] "
        f"File exists: '{tmp_path / 'plugins/imported.once'}') in a worker process, though the process that started "
        "the job imported it")), proc.stderr[-3000:]
    assert json.loads((tmp_path / "run/run.json").read_text())["status"] == "failed"
    assert not list((tmp_path / "run").glob("ingest/a/part-*"))


class _Verdicts(Gate):
    """Returns what its text asks for: a gate whose verdicts are not None or a string."""

    name = failed_check = "odd"

    def check(self, doc: Doc) -> Any:
        return {"forty-two": 42, "false": False, "why": "a reason"}.get(doc.text.split()[0])


@pytest.fixture
def extra_gate() -> Iterator[Any]:
    import quality.gates

    added: list[Any] = []
    yield lambda factory: added.append(register_gate(factory))
    for factory in added:
        quality.gates.EXTRA_GATES.remove(factory)


def test_a_gate_verdict_that_is_not_none_or_a_string_costs_the_record_as_an_error(extra_gate: Any) -> None:
    """Regression: `False` or a number was taken for a reason: every such record rejected under the gate's own
    check with the reason 'False' / '42'. It is a gate bug, which costs the record as a raise does, saying so."""
    from quality.control import QualityControl

    extra_gate(lambda settings, text_field: _Verdicts())
    records = [{"text": f"{w} and enough words to pass the length gate"} for w in ("forty-two", "false", "why", "ok")]
    settings = {"expected_language": None, "pii_max_density": 1.0, "profanity_max_density": 1.0, "min_chars": 0}
    for judge in ("evaluate", "evaluate_batch"):
        qc = QualityControl(settings)
        verdicts = [qc.evaluate(r) for r in records] if judge == "evaluate" else qc.evaluate_batch(records)
        assert [(v.keep, v.meta.get("failed_check"), v.meta.get("reason")) for v in verdicts] == [
            (False, "error", "odd: internal error: check returned int 42, not None or a reason"),
            (False, "error", "odd: internal error: check returned bool False, not None or a reason"),
            (False, "odd", "a reason"), (True, None, None)], judge


def test_a_gate_factory_that_fails_to_give_a_gate_is_named() -> None:
    """Regression: a factory that raised, returned a non-gate or a gate without a name stopped the job as
    `reading the input failed: KeyError: ...` (or an AttributeError), naming neither the plug-in nor the gate."""
    from quality.control import QualityControl
    from quality.gates import GatePluginError

    class Nameless(Gate):
        def check(self, doc: Doc) -> str | None:
            return None

    def broken(settings: Any, text_field: str) -> Gate:
        raise KeyError("factory broke")

    here = f"quality gate plug-in {__name__}.{broken.__qualname__.removesuffix('broken')}"
    for factory, message in (
            (broken, f"{here}broken failed to build its gate: KeyError: 'factory broke'"),
            (lambda s, t: "a gate", f"{here}<lambda> returned str, not a Gate or None"),
            (lambda s, t: Nameless(), f"{here}<lambda>: its gate Nameless needs the strings `name` and `failed_check`")):
        import quality.gates

        register_gate(factory)
        try:
            with pytest.raises(GatePluginError) as err:
                QualityControl({})
        finally:
            quality.gates.EXTRA_GATES.remove(factory)
        assert str(err.value).startswith(message)


def test_sys_exit_inside_a_job_is_one_line_exit_1(tmp_path: Path, extra_gate: Any, capsys: Any) -> None:
    """Regression: a gate calling sys.exit(3) ended the job with exit 3 and nothing on stderr."""
    from streamprep.cli import main

    class Exits(Gate):
        name = failed_check = "exits"

        def check(self, doc: Doc) -> str | None:
            raise SystemExit(3)

    extra_gate(lambda settings, text_field: Exits())
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in english_docs(10)))
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(base_config([{"name": "a", "path": str(corpus)}], None)))
    assert main(["ingest", "--config", str(tmp_path / "cfg.yaml"), "--run-dir", str(tmp_path / "run")]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == ("streamprep: error: SystemExit(3) raised inside the command "
                                                       "(a plug-in calling sys.exit?); re-run the same command to resume")
    failed = [json.loads(line) for line in (tmp_path / "run" / "logs" / "streamprep.log").read_text().splitlines()
              if '"run failed"' in line]  # regression: the error that stopped a run was in run.json only
    assert [(e["level"], e["error"]) for e in failed] == [("error", "SystemExit: 3")]


def test_a_gate_factory_calling_sys_exit_is_a_config_error_at_start_exit_2(tmp_path: Path, extra_gate: Any,
                                                                            capsys: Any) -> None:
    """Regression: a gate factory calling sys.exit(1) stopped the job as exit 1 "re-run the same command to
    resume", though nothing was written and each re-run called it again. It is the factory's fault as a raise is:
    one line naming the plug-in, exit 2, no run dir."""
    from streamprep.cli import main

    def exits(settings: Any, text_field: str) -> Gate:
        raise SystemExit(1)

    extra_gate(exits)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in english_docs(10)))
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(base_config([{"name": "a", "path": str(corpus)}], None)))
    assert main(["ingest", "--config", str(tmp_path / "cfg.yaml"), "--run-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"streamprep: error: config: quality gate plug-in {__name__}.{exits.__qualname__} failed to build its gate: "
        f"SystemExit: 1")
    assert not (tmp_path / "run").exists()


def test_a_gate_named_as_the_pipelines_own_reason_is_refused_at_start_exit_2(tmp_path: Path, extra_gate: Any,
                                                                           capsys: Any) -> None:
    """Regression: a plug-in gate named `duplicate` was accepted and its rejects counted as exact duplicates
    (rejected_as_duplicate 340 of 250); `empty_tokens`, `error`, a built-in gate's failed_check or "" alike. The
    job now stops before it starts: one line naming the plug-in and the clash, exit 2, no run dir."""
    from streamprep.cli import main

    class Dup(Gate):
        name = failed_check = "duplicate"

        def check(self, doc: Doc) -> str | None:
            return "mine" if len(doc.text) % 5 == 0 else None

    def factory(settings: Any, text_field: str) -> Gate:
        return Dup()

    extra_gate(factory)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in english_docs(10)))
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(base_config([{"name": "a", "path": str(corpus)}], None)))
    assert main(["ingest", "--config", str(tmp_path / "cfg.yaml"), "--run-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"streamprep: error: config: quality gate plug-in {__name__}.{factory.__qualname__}: its gate's name "
        f"'duplicate' is exact dedup's reject reason, which streamprep writes itself (the audit counts a gate's stats "
        f"under its name, its rejects under its failed_check): name it otherwise"]
    assert not (tmp_path / "run").exists()


def test_the_reasons_refused_to_gates_are_those_the_pipeline_writes(extra_gate: Any) -> None:
    """`quality.lines.PIPELINE_CHECKS` (and the `sft:` prefix) against the code that writes each reason: a gate
    must not report its rejects, or keep its stats, under one of them."""
    from quality import QualityControl, near_dedup
    from quality.gates import BUILT_IN
    from quality.lines import BUILT_IN_NAMES, PIPELINE_CHECKS, PIPELINE_PREFIX
    from streamprep import stats
    from streamprep.audit.gather import EMPTY_TOKENS

    class Raises(Gate):
        name = failed_check = "raises"

        def check(self, doc: Doc) -> str | None:
            raise ValueError("bug")

    written = {BadRecord("unreadable", "").check, EMPTY_TOKENS,
               near_dedup.reject_meta({}, "d", near_dedup.Twin(0, 0.9))["failed_check"]}
    st: dict[str, Any] = {}
    stats.add_record(st, False, {}, 1)  # a reject without a failed_check
    written |= set(st["rejects_by_check"])
    qc = QualityControl({"min_chars": 0, "expected_language": None, "near_dedup": {"enabled": True}})
    record = {"text": "the same words twice " * 5}
    assert qc.clean_record(dict(record))[0]
    written.add(qc.clean_record(dict(record))[1]["failed_check"])  # the second copy: an exact duplicate
    qc.evaluate_batch([dict(record)])
    written |= set(qc.stats["gates"]) - {g.name for g in qc.gates}  # stats the chain keeps beside its gates'
    extra_gate(lambda settings, text_field: Raises())
    written.add(QualityControl({"min_chars": 0}).evaluate(dict(record)).meta["failed_check"])
    built_in = {v for cls in BUILT_IN for v in (cls.name, cls.failed_check)}
    assert written == set(PIPELINE_CHECKS)
    assert BadRecord("sft: x", "", check="schema").check in built_in  # the SFT mode's screen (streamprep.sft.mode)
    first = {v: cls.__name__ for cls in reversed(BUILT_IN) for v in (cls.failed_check, cls.name)}
    assert BUILT_IN_NAMES == first  # what the driver checks a reader's BadRecord against, without the gates
    assert PIPELINE_PREFIX == "sft:"  # streamprep.audit: the SFT shards' drops as `sft:<reason>`


def test_a_source_format_plugin_cannot_replace_a_built_in_one() -> None:
    """Regression: a reader registered as `jsonl` read `.jsonl.gz` files (whole-file units) but not `.jsonl` ones
    (byte-range units, read by the local source itself), without a word."""
    with pytest.raises(ValueError, match=r"^source format 'jsonl' is built in; register yours under another name$"):
        registry.SOURCE_FORMATS.register("jsonl", read_toy)
    # regression: a writer named `parquet` replaced the built-in one: no Parquet shard, mixtures.json's records 0,
    # and `verify` failed the run's own output; one named `blend` left blend.json out without a word
    # regression: a plug-in's section passed validation and then crashed every run (Config has no field for it)
    with pytest.raises(ValueError, match=r"^config section 'mine': a plug-in cannot add a top-level config section "):
        registry.SECTIONS.register("mine", lambda raw: raw)
    # regression: a backend name of a plug-in's passed validation; the run then failed at its tokenizer, at each resume
    with pytest.raises(ValueError, match=r"^tokenizer backend 'mine': a plug-in cannot add a tokenizer backend "):
        registry.TOKENIZER_BACKENDS.register("mine")
    for name in ("parquet", "blend", "mixtures"):
        with pytest.raises(ValueError, match=rf"^output writer '{name}' is built in; register yours under another "
                                             rf"name$"):
            registry.WRITERS.register(name, write_counts)
    assert registry.SOURCE_FORMATS.entry("jsonl").target is None


def test_a_resume_with_other_plugins_is_refused_like_a_changed_config(tmp_path: Path) -> None:
    """Regression: a run killed with a gate plug-in and resumed without it kept other records for the rest of the
    run, without a word. run.json records STREAMPREP_PLUGINS, and a resume with others is exit 2 naming both."""
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins/toy_gate_plugin.py").write_text(GATE_PLUGIN)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in english_docs(20)))
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(base_config([{"name": "a", "path": str(corpus)}], None)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "plugins"), str(REPO)])}
    env.pop("STREAMPREP_PLUGINS", None)
    command = [sys.executable, "-m", "streamprep", "ingest", "--config", str(tmp_path / "cfg.yaml"), "--run-dir",
               str(tmp_path / "run")]

    def ingest(plugins: str | None) -> subprocess.CompletedProcess:
        extra = {"STREAMPREP_PLUGINS": plugins} if plugins is not None else {}
        return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env={**env, **extra}, timeout=300)

    assert ingest("toy_gate_plugin").returncode == 0
    assert json.loads((tmp_path / "run/run.json").read_text())["plugins"] == ["toy_gate_plugin"]
    refused = ingest(None)
    assert (refused.returncode, refused.stderr.splitlines()[-1]) == (2, (
        "streamprep: error: plug-ins changed since this run started (was 'toy_gate_plugin', now 'none': the modules "
        "STREAMPREP_PLUGINS names, then those of plug-ins registered before the job, each in the order registered); "
        "plug-ins decide verdicts and bytes as the config does, their order too (which gate runs first, which of two "
        "registrations of a name stands): resume with the same, in the same order, or use a new --run-dir"))
    assert ingest(" toy_gate_plugin ").returncode == 0  # the same modules


def test_a_plugin_module_named_twice_is_recorded_once_and_resumes_named_once(tmp_path: Path) -> None:
    """Regression: STREAMPREP_PLUGINS=p,p (imported once) was recorded in run.json as ['p', 'p'], and a resume with
    STREAMPREP_PLUGINS=p was refused as "plug-ins changed". Each module is recorded once, at its first mention; a
    run.json an earlier streamprep wrote with the duplicate resumes with the module named once."""
    env = _plugin_job(tmp_path, {"p_gate": GATE_PLUGIN})
    command = [sys.executable, "-m", "streamprep", "ingest", "--config", str(tmp_path / "cfg.yaml"), "--run-dir",
               str(tmp_path / "run")]

    def ingest(plugins: str) -> subprocess.CompletedProcess:
        return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
                              env={**env, "STREAMPREP_PLUGINS": plugins})

    first = ingest("p_gate, p_gate")
    assert first.returncode == 0, first.stderr[-2000:]
    run_json = tmp_path / "run/run.json"
    record = json.loads(run_json.read_text())
    assert record["plugins"] == ["p_gate"]
    again = ingest("p_gate")
    assert again.returncode == 0, again.stderr[-2000:]
    atomic.write_json(run_json, {**record, "plugins": ["p_gate", "p_gate"]})  # an earlier streamprep's record
    again = ingest("p_gate")
    assert again.returncode == 0, again.stderr[-2000:]


WRITER_PLUGIN = """
from streamprep import atomic, registry


def write_counts(ctx):
    atomic.write_json(ctx.run_dir / "toy_counts.json", {idx.name: len(idx) for idx in ctx.indexes})
    return ["toy_counts.json"]


registry.WRITERS.register("toy_counts", write_counts)
"""


def test_the_same_plugins_imported_by_the_api_resume_a_run_the_cli_started(tmp_path: Path) -> None:
    """Regression: a run started with STREAMPREP_PLUGINS=p_gate,p_toy,p_writer was refused when the same modules,
    imported in that order by a script, resumed it through the API (`plug-ins changed … (was
    'p_gate,p_toy,p_writer', now 'p_toy,p_writer,p_gate')`): run.json listed an imported plug-in's modules by
    registry family (formats, writers, gates), not in the order imported. They are listed in import order now, as
    STREAMPREP_PLUGINS's are (the order decides the gates' order); a run.json of the family order still resumes."""
    env = _plugin_job(tmp_path, {"p_gate": GATE_PLUGIN, "p_toy": TOY_FORMAT_PLUGIN, "p_writer": WRITER_PLUGIN,
                                 "p_gate2": GATE_PLUGIN.replace('"forbidden"', '"second"')})
    cli = subprocess.run([sys.executable, "-m", "streamprep", "ingest", "--config", str(tmp_path / "cfg.yaml"),
                          "--run-dir", str(tmp_path / "run")], cwd=tmp_path, capture_output=True, text=True,
                         env={**env, "STREAMPREP_PLUGINS": "p_gate,p_toy,p_writer"}, timeout=300)
    assert cli.returncode == 0, cli.stderr[-2000:]
    run_json = tmp_path / "run/run.json"
    assert json.loads(run_json.read_text())["plugins"] == ["p_gate", "p_toy", "p_writer"]

    api = functools.partial(_api_job, tmp_path, env)

    assert api("p_gate, p_toy, p_writer") == "complete"
    record = json.loads(run_json.read_text())
    assert record["plugins"] == ["p_gate", "p_toy", "p_writer"]
    atomic.write_json(run_json, {**record, "plugins": ["p_toy", "p_writer", "p_gate"]})  # an earlier streamprep's
    assert api("p_gate, p_toy, p_writer") == "complete"
    atomic.write_json(run_json, {**record, "plugins": ["p_gate", "p_gate2"]})
    assert api("p_gate2, p_gate") == (  # two gates in the other order: the other one rejects first
        "plug-ins changed since this run started (was 'p_gate,p_gate2', now 'p_gate2,p_gate': the modules "
        "STREAMPREP_PLUGINS names, then those of plug-ins registered before the job, each in the order registered); "
        "plug-ins decide verdicts and bytes as the config does, their order too (which gate runs first, which of two "
        "registrations of a name stands): resume with the same, in the same order, or use a new --run-dir")


def _plugin_job(tmp_path: Path, modules: dict[str, str]) -> dict[str, str]:
    """Plug-in modules (name: source) in tmp_path/plugins, a 20-record job at tmp_path/cfg.yaml; the environment
    that finds them (no STREAMPREP_PLUGINS)."""
    (tmp_path / "plugins").mkdir()
    for module, text in modules.items():
        (tmp_path / f"plugins/{module}.py").write_text(text)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in english_docs(20)))
    cfg = base_config([{"name": "a", "path": str(corpus)}], None, execution={"engine": "local", "workers": 1})
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "plugins"), str(REPO)])}
    env.pop("STREAMPREP_PLUGINS", None)
    return env


def _api_job(tmp_path: Path, env: dict[str, str], imports: str, installs: str = "pass", run: bool = True) -> str:
    """What a script printed that imports `imports`, runs `installs` under its main guard, then the job of
    tmp_path/cfg.yaml in tmp_path/run (its status, or the ConfigError refusing it), or with `run` False prints the
    plug-in modules run.json would record."""
    script = (f"import {imports}, yaml, streamprep\n"
              f"from streamprep.pipeline import plugin_modules\n"
              f"if __name__ == '__main__':\n"
              f"    {installs}\n"
              f"    if not {run}:\n"
              f"        raise SystemExit(print(','.join(plugin_modules())))\n"
              f"    cfg = yaml.safe_load(open('cfg.yaml'))\n"
              f"    try:\n"
              f"        print(streamprep.run_from_dict(cfg, run_dir='run', console_log=False).status)\n"
              f"    except streamprep.ConfigError as exc:\n"
              f"        print(exc)\n")
    (tmp_path / "job.py").write_text(script)
    proc = subprocess.run([sys.executable, "job.py"], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


INSTALLED_GATE_PLUGIN = """
from quality.gates import Gate, register_gate


class G(Gate):
    name = failed_check = __name__

    def check(self, doc):
        return "says 'the'" if " the " in doc.text else None


def install():
    register_gate(lambda settings, text_field: G())
"""


def test_a_resume_that_registers_the_same_gates_in_another_order_is_refused(tmp_path: Path) -> None:
    """Regression: a run whose script imported gate modules g_a, g_b and registered g_b's gate, then g_a's (each
    rejecting the same texts, so the first decides which is counted), resumed by a script registering g_a's first
    was accepted and the audit then split the rejects between both gates: run.json listed the modules in the order
    imported (`sys.modules`), which was the same both times. It lists them in the order they registered, all
    families together (`registry.registration_order`), so the resume is refused; a format module registering at
    import before a gate installed later is listed first."""
    env = _plugin_job(tmp_path, {"g_a": INSTALLED_GATE_PLUGIN, "g_b": INSTALLED_GATE_PLUGIN,
                                 "p_toy": TOY_FORMAT_PLUGIN})

    api = functools.partial(_api_job, tmp_path, env)

    assert api("g_a, g_b", "g_b.install(); g_a.install()") == "complete"
    assert json.loads((tmp_path / "run/run.json").read_text())["plugins"] == ["g_b", "g_a"]
    assert api("g_a, g_b", "g_b.install(); g_a.install()") == "complete"  # the same order
    assert api("g_a, g_b", "g_a.install(); g_b.install()") == (
        "plug-ins changed since this run started (was 'g_b,g_a', now 'g_a,g_b': the modules "
        "STREAMPREP_PLUGINS names, then those of plug-ins registered before the job, each in the order registered); "
        "plug-ins decide verdicts and bytes as the config does, their order too (which gate runs first, which of two "
        "registrations of a name stands): resume with the same, in the same order, or use a new --run-dir")
    assert api("g_a, p_toy", "g_a.install()", run=False) == "p_toy,g_a"
    assert api("p_toy, g_a", "g_a.install()", run=False) == "p_toy,g_a"


@pytest.mark.parametrize("returned, why", [
    (None, "returned NoneType, not a list of the run-dir-relative paths it wrote"),
    (["missing.json"], "returned 'missing.json', which is not a file in the run dir"),
    (["/etc/hostname"], "returned '/etc/hostname': not a path inside the run dir, relative to it"),
    (["../outside.json"], "returned '../outside.json': not a path inside the run dir, relative to it")])
def test_a_writer_that_returns_what_it_did_not_write_is_named(tmp_path: Path, returned: Any, why: str) -> None:
    """Regression: a writer returning None was a bare TypeError and one naming a file it did not write a bare
    FileNotFoundError; one naming a file outside the run dir had it listed and hashed in the manifest, and verify
    then called it damaged. Each is now an error naming the writer."""
    from types import SimpleNamespace

    from streamprep.exports import WriterError, _written

    (tmp_path / "run").mkdir()
    (tmp_path / "outside.json").write_text("{}")
    entry = registry.Entry("mine", lambda ctx: returned)
    with pytest.raises(WriterError) as err:
        _written(entry, SimpleNamespace(run_dir=tmp_path / "run"))
    assert str(err.value) == f"output writer 'mine' ({__name__}) {why}"
    (tmp_path / "run/ok.json").write_text("{}")
    assert _written(registry.Entry("mine", lambda ctx: ["ok.json"]), SimpleNamespace(run_dir=tmp_path / "run")) == \
        ["ok.json"]


def test_a_writer_that_raises_is_named(tmp_path: Path) -> None:
    """Regression: a writer plug-in raising ended the run with `streamprep: error: RuntimeError: writer boom`, naming
    no writer. It is a WriterError naming it, its exception the cause (a full disk is still told as one)."""
    from types import SimpleNamespace

    from streamprep.exports import WriterError, _written

    def boom(ctx: Any) -> list[str]:
        raise RuntimeError("writer boom")

    with pytest.raises(WriterError) as err:
        _written(registry.Entry("mine", boom), SimpleNamespace(run_dir=tmp_path))
    assert str(err.value) == f"output writer 'mine' ({__name__}) raised RuntimeError: writer boom"
    assert isinstance(err.value.__cause__, RuntimeError)
    with pytest.raises(RuntimeError, match="^writer boom$"):  # a built-in's own error is not re-worded
        _written(registry.Entry("mine", boom, {"builtin": True}), SimpleNamespace(run_dir=tmp_path))


def _clobber_blend(ctx: Any) -> list[str]:
    atomic.write_json(ctx.run_dir / "blend.json", {"x": 1})
    return ["blend.json"]


def _zero_shard(ctx: Any) -> list[str]:
    shard = ctx.run_dir / "binidx/d/part-00000_text_document.bin"
    atomic.write_bytes(shard, bytes(shard.stat().st_size))  # same size, zeroed, and not returned
    (ctx.run_dir / "mine.json").write_text("{}")
    return ["mine.json"]


def _returns(*paths: str) -> Any:
    """A writer that writes each of `paths` that is not there yet, and returns them all."""
    def write(ctx: Any) -> list[str]:
        for path in (ctx.run_dir / rel for rel in paths):
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("{}")
        return list(paths)
    return write


@pytest.mark.parametrize("write, why", [
    (_clobber_blend, "changed 'blend.json', which belongs to output writer 'blend'"),
    (_zero_shard, "changed 'binidx/d/part-00000_text_document.bin', which belongs to the run"),
    (_returns("./mixtures.json"), "returned './mixtures.json', which belongs to output writer 'mixtures'"),
    (_returns("logs/mine.log"), "returned 'logs/mine.log', which belongs to the run"),
    (_returns("parquet/train/mine.parquet"), "changed 'parquet/train/mine.parquet', which belongs to the run")])
def test_a_writer_cannot_write_or_list_a_file_of_the_run_or_of_another_writer(tmp_path: Path, write: Any,
                                                                             why: str) -> None:
    """Regression: a writer plug-in that rewrote blend.json, or zeroed a `.bin` shard, had the run end complete (the
    manifest listing blend.json twice, verify passing it). A file of the run or of an earlier writer, changed or
    returned, is a WriterError naming the writer and the file."""
    from types import SimpleNamespace

    from streamprep.exports import WriterError, _written

    run = tmp_path / "run"
    for rel in ("blend.json", "mixtures.json", "manifest.json", "binidx/d/part-00000_text_document.bin",
                "parquet/train/part-00000.parquet", "logs/streamprep.log"):
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_bytes(b"run's own")
    taken = {"parquet/train/part-00000.parquet": "parquet", "blend.json": "blend", "mixtures.json": "mixtures"}
    with pytest.raises(WriterError) as err:
        _written(registry.Entry("mine", write), SimpleNamespace(run_dir=run), taken)
    assert str(err.value) == f"output writer 'mine' ({__name__}) {why}: a writer writes files of its own only"
    # a file of its own anywhere else, and the run's files left alone
    assert _written(registry.Entry("mine", _returns("mine/counts.json")), SimpleNamespace(run_dir=run), taken) == \
        ["mine/counts.json"]
    with pytest.raises(WriterError, match=r"^output writer 'mine' \(.*\) returned 'a.json' twice$"):
        _written(registry.Entry("mine", _returns("a.json", "a.json")), SimpleNamespace(run_dir=run), taken)


@pytest.mark.slow  # a whole job
def test_a_writer_that_rewrites_blend_json_fails_the_run(tmp_path: Path) -> None:
    """Regression (a whole job): the run ended complete with the writer's blend.json; now the run fails naming it."""
    from streamprep.exports import WriterError

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in english_docs(20)))
    registry.WRITERS.register("mine", _clobber_blend)
    try:
        with pytest.raises(WriterError, match=r"^output writer 'mine' \(.*\) changed 'blend.json', which belongs to "
                                              r"output writer 'blend'"):
            run_from_dict(base_config([{"name": "a", "path": str(corpus)}], None), run_dir=tmp_path / "run",
                          console_log=False)
    finally:
        registry.WRITERS.unregister("mine")
    assert json.loads((tmp_path / "run/run.json").read_text())["status"] != "complete"
    assert not (tmp_path / "run/manifest.json").exists()


def read_json_lines(fh: BinaryIO, path: str) -> Iterator[dict[str, Any]]:
    """A reader that trusts its lines: `json.loads` raises on a broken one (a ValueError: the file's bytes)."""
    for line in fh:
        yield json.loads(line)


def read_keyed(fh: BinaryIO, path: str) -> Iterator[dict[str, Any]]:
    """A reader with a bug: it takes every line for an object with a "body" key (a KeyError on one without)."""
    for line in fh:
        yield {"text": json.loads(line)["body"]}


def read_rewording(fh: BinaryIO, path: str) -> Iterator[dict[str, Any]]:
    """A reader that re-words a fault of its file's bytes as its own ValueError."""
    try:
        lines = fh.read().splitlines()
    except EOFError as exc:
        raise ValueError(f"{path} is truncated") from exc
    yield from (json.loads(line) for line in lines)


@pytest.fixture
def jl9() -> Iterator[None]:
    yield
    registry.SOURCE_FORMATS.unregister("jl9")


def test_a_format_plugin_that_raises_on_bad_bytes_loses_the_rest_of_its_file_and_one_with_a_bug_is_named(
        tmp_path: Path, jl9: None) -> None:
    """What a reader raises is judged as a built-in format's faults are: bad bytes (a broken JSON line, bytes that
    are no UTF-8, as docs/architecture.md's example reader meets them; a truncated .gz, re-worded or not) are one
    reject of the file's unreadable rest, counted, and the job goes on; an exception of another kind (a KeyError: a
    bug of the plug-in) is a ReaderError naming the format, the file and the record (it read "cannot read input file"
    twice, the plug-in unnamed). Regression: for a while the broken line and the bad UTF-8 stopped the job."""
    import gzip

    from streamprep.sources.base import ReaderError
    from streamprep.sources.local import LocalSource

    lines = [json.dumps({"text": f"doc {i}"}).encode() + b"\n" for i in range(6)]
    (tmp_path / "bad.jl9").write_bytes(b"".join(lines[:2]) + b'{"text": \n' + b"".join(lines[3:]))
    whole = gzip.compress(b"".join(lines) * 2000, mtime=0)
    (tmp_path / "cut.jl9.gz").write_bytes(whole[:len(whole) // 2])
    (tmp_path / "latin.jl9").write_bytes("Caf\u00e9\nbody\n%%\nx\n".encode("latin-1"))
    start = {"file": 0, "record": 0}

    def read(name: str) -> list[Any]:
        return [item for item, _ in LocalSource.reader(None, None).read_file(0, str(tmp_path / name), start)]

    registry.SOURCE_FORMATS.register("jl9", read_json_lines, suffixes=(".jl9",))
    items = read("bad.jl9")
    assert items[:2] == [{"text": "doc 0"}, {"text": "doc 1"}] and len(items) == 3
    assert items[2].reason == (f"unreadable rest of {tmp_path / 'bad.jl9'} after record 2, skipped: "
                               f"JSONDecodeError: Expecting value: line 2 column 1 (char 10)")
    items = read("cut.jl9.gz")
    assert len(items) > 100 and all(isinstance(item, dict) for item in items[:-1])
    assert items[-1].reason == (f"unreadable rest of {tmp_path / 'cut.jl9.gz'} after record {len(items) - 1}, "
                                f"skipped: EOFError: Compressed file ended before the end-of-stream marker was reached")

    registry.SOURCE_FORMATS.register("jl9", read_toy, suffixes=(".jl9",))
    assert [item.reason for item in read("latin.jl9")] == [
        f"unreadable rest of {tmp_path / 'latin.jl9'} after record 0, skipped: UnicodeDecodeError: 'utf-8' codec "
        f"can't decode byte 0xe9 in position 3: invalid continuation byte"]

    registry.SOURCE_FORMATS.register("jl9", read_rewording, suffixes=(".jl9",))
    assert [item.reason for item in read("cut.jl9.gz")] == [
        f"unreadable rest of {tmp_path / 'cut.jl9.gz'} after record 0, skipped: ValueError: "
        f"{tmp_path / 'cut.jl9.gz'} is truncated"]

    registry.SOURCE_FORMATS.register("jl9", read_keyed, suffixes=(".jl9",))
    got = LocalSource.reader(None, None).read_file(0, str(tmp_path / "bad.jl9"), start)
    with pytest.raises(ReaderError) as err:
        next(got)
    assert str(err.value) == (f"source format 'jl9' ({__name__}) raised reading {tmp_path / 'bad.jl9'} after record 0: "
                              f"KeyError: 'body'")


def _network_errors() -> list[Any]:
    """What a reader fetching its records raises when the network fails (requests' and urllib3's if installed)."""
    import http.client
    import urllib.error
    import urllib.request

    errors: list[Any] = [
        pytest.param(lambda: urllib.request.urlopen("http://127.0.0.1:1/x"),  # refused: nothing listens on port 1
                     r"URLError: <urlopen error \[Errno 111\] Connection refused>", id="urlopen"),
        pytest.param(urllib.error.HTTPError("http://h/x", 503, "Service Unavailable",
                                            None, None),  # type: ignore[arg-type]
                     r"HTTPError: HTTP Error 503: Service Unavailable", id="http-503"),
        pytest.param(http.client.IncompleteRead(b"ab", 10), r"IncompleteRead: IncompleteRead\(2 bytes read, 10 more "
                     r"expected\)", id="incomplete-read")]
    try:
        import requests
        import urllib3
    except ImportError:
        return errors
    return errors + [
        pytest.param(lambda: requests.get("http://127.0.0.1:1/x", timeout=5),
                     r"ConnectionError: HTTPConnectionPool\(host='127.0.0.1', port=1\): Max retries exceeded",
                     id="requests"),
        pytest.param(requests.exceptions.ChunkedEncodingError("Connection broken"),
                     "ChunkedEncodingError: Connection broken", id="requests-chunked"),
        pytest.param(urllib3.exceptions.ProtocolError("Connection broken: IncompleteRead"),
                     "ProtocolError: Connection broken: IncompleteRead", id="urllib3")]


@pytest.mark.parametrize("fault, message", _network_errors())
def test_a_format_plugins_network_error_stops_the_job_as_an_io_error(tmp_path: Path, jl9: None, fault: Any,
                                                                     message: str) -> None:
    """Regression: a reader's network error (urllib's URLError, requests' ConnectionError: OSErrors without an
    errno, as a decoder's are) was one reject of the file's "unreadable rest", the records after it lost in a run
    that ended complete (a re-run never read them); urllib3's or http.client's (no OSError) was a ReaderError, a bug
    of the plug-in. Each is an I/O error now: a SourceError naming the file and the record, the job stops and a
    re-run resumes. The bad bytes beside them are still rejects (the test above)."""
    from streamprep.sources.base import SourceError
    from streamprep.sources.local import LocalSource

    def read_fetching(fh: BinaryIO, path: str) -> Iterator[dict[str, Any]]:
        for n, line in enumerate(fh, 1):
            if n == 3:
                raise fault if isinstance(fault, BaseException) else fault()
            yield json.loads(line)

    registry.SOURCE_FORMATS.register("jl9", read_fetching, suffixes=(".jl9",))
    (tmp_path / "a.jl9").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(5)))
    got = LocalSource.reader(None, None).read_file(0, str(tmp_path / "a.jl9"), {"file": 0, "record": 0})
    assert [next(got)[0] for _ in range(2)] == [{"text": "doc 0"}, {"text": "doc 1"}]
    where = re.escape(str(tmp_path / "a.jl9"))
    with pytest.raises(SourceError, match=rf"^cannot read input file {where} after record 2: {message}"):
        next(got)


@pytest.mark.parametrize("bad, why", [
    (BadRecord("line 1: invalid start byte", b"\xff\xfeab"), "its raw is bytes b'\\xff\\xfeab', not a string"),
    (BadRecord("bad", {1, 2}), "its raw is set {1, 2}, not a string"),  # type: ignore[arg-type]
    (BadRecord(123, {"x": 1}), "its reason is int 123, not a string"),  # type: ignore[arg-type]
    (BadRecord("x", "raw", check=7), "its check is int 7, not a string"),  # type: ignore[arg-type]
    (BadRecord("x", "raw", check=""), "its check is empty"),
    (BadRecord("x", "raw", check="duplicate"),
     "its check 'duplicate' is exact dedup's reject reason, which streamprep writes itself"),
    (BadRecord("x", "raw", check="sft:too_long"),
     "its check 'sft:too_long' is an SFT drop's reason (sft:…), which streamprep writes itself"),
    # a built-in gate's name or failed_check: its rejects were counted as that gate's (`rejected 2: pii 2`)
    (BadRecord("x", "raw", check="pii"), "its check 'pii' is the built-in gate PiiGate's"),
    (BadRecord("x", "raw", check="schema"), "its check 'schema' is the built-in gate SchemaGate's"),
    (BadRecord("x", "raw", check="domain"), "its check 'domain' is the built-in gate MedicalGate's")])
def test_a_format_plugins_bad_record_that_is_no_reject_line_is_named(tmp_path: Path, jl9: None, bad: BadRecord,
                                                                      why: str) -> None:
    """Regression: a reader's BadRecord was passed on unchecked. Bytes or a set as its reason or raw (a reader
    yielding the undecodable line's bytes) stopped the job at its reject line, `TypeError: Type is not JSON
    serializable: bytes`, naming no plug-in; an int or a dict was written as it was; a `check` of 7 stopped the job
    (`Dict key must be str`), one of `duplicate` was counted and audited as exact duplicates, one of `pii` as the
    PII gate's rejects. Each is a bug of the
    plug-in: a ReaderError naming the format, its module, the file and the record. A BadRecord of its own `check`,
    or with a lone surrogate in its strings (its reject line escapes it), is passed on."""
    from streamprep.sources.base import ReaderError
    from streamprep.sources.local import LocalSource

    fine = [BadRecord("line 2 \ud800", "raw \udc00"), BadRecord("odd", "x", check="toy_check"),
            BadRecord("y", "z", check="parse")]
    registry.SOURCE_FORMATS.register("jl9", lambda fh, path: iter([{"text": "doc"}, *fine, bad]), suffixes=(".jl9",))
    (tmp_path / "a.jl9").write_bytes(b"")
    got = LocalSource.reader(None, None).read_file(0, str(tmp_path / "a.jl9"), {"file": 0, "record": 0})
    assert [next(got)[0] for _ in range(4)] == [{"text": "doc"}, *fine]
    with pytest.raises(ReaderError) as err:
        next(got)
    assert str(err.value) == (f"source format 'jl9' ({__name__}) yielded a BadRecord reading {tmp_path / 'a.jl9'} "
                              f"as record 5: {why}")


def read_fetching(fh: BinaryIO, path: str) -> Iterator[dict[str, Any]]:
    """A reader whose records' bodies are fetched: from record 3 on, from a server that refuses (port 1)."""
    import urllib.request

    for n, line in enumerate(fh, 1):
        if n == 3 and not os.environ.get("JL9_ONLINE"):
            urllib.request.urlopen("http://127.0.0.1:1/x")
        yield {"text": json.loads(line)["body"]}


@pytest.mark.slow  # two whole jobs
def test_a_format_plugins_network_error_stops_the_job_and_a_rerun_reads_the_rest(
        tmp_path: Path, jl9: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (whole jobs): a reader's URLError was one reject, "unreadable rest of … after record 2", the
    records after it lost and the run complete, so a re-run read nothing. Now the job stops naming the file, and a
    re-run once the network is back resumes and keeps every record."""
    from streamprep.sources.base import SourceError

    registry.SOURCE_FORMATS.register("jl9", read_fetching, suffixes=(".jl9",))
    (tmp_path / "a.jl9").write_text("".join(json.dumps({"body": d}) + "\n" for d in english_docs(8)))
    cfg = base_config([{"name": "a", "path": str(tmp_path / "a.jl9")}], None)
    with pytest.raises(SourceError, match=r"cannot read input file .*a\.jl9 after record 2: URLError: <urlopen error "
                                          r"\[Errno 111\] Connection refused>"):
        run_from_dict(cfg, run_dir=tmp_path / "run", console_log=False)
    assert json.loads((tmp_path / "run/run.json").read_text())["status"] != "complete"
    monkeypatch.setenv("JL9_ONLINE", "1")
    assert run_from_dict(cfg, run_dir=tmp_path / "run", console_log=False).status == "complete"
    summary = json.loads((tmp_path / "run/run.json").read_text())["summary"]
    assert (summary["kept"]["a"], summary["rejected"]["a"]) == (8, 0), summary


@pytest.mark.slow  # a whole job
def test_a_format_plugin_with_a_bug_stops_the_job_naming_it(tmp_path: Path, jl9: None) -> None:
    """A whole job: a reader's KeyError (a bug of the plug-in, not of the file) stops it naming the plug-in."""
    from streamprep.sources.base import SourceError

    registry.SOURCE_FORMATS.register("jl9", read_keyed, suffixes=(".jl9",))
    docs = english_docs(6)
    (tmp_path / "bad.jl9").write_text(f"{json.dumps({'body': docs[0]})}\n{json.dumps({'body': docs[1]})}\n{{}}\n"
                                      + "".join(json.dumps({"body": d}) + "\n" for d in docs[3:]))
    with pytest.raises(SourceError, match=rf"^dataset a: reading or judging the input failed after item \d+: "
                                          rf"ReaderError: source format 'jl9' \({__name__}\) raised reading "
                                          rf".*bad\.jl9 after record 2: KeyError: 'body'"):
        run_from_dict(base_config([{"name": "a", "path": str(tmp_path / "bad.jl9")}], None),
                      run_dir=tmp_path / "run", console_log=False)
    assert json.loads((tmp_path / "run/run.json").read_text())["status"] != "complete"
