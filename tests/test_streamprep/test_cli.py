"""CLI surface: every command's --help shows an example; a non-run dir is exit 2 with one line."""
from __future__ import annotations

import contextlib
import io
import json
import multiprocessing.forkserver
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from streamprep import forkserver
from streamprep.cli import main
from helpers import REPO, assert_part_sha_refused, deny_reading, ray_worker_error

COMMANDS = ("ingest", "status", "logs", "audit", "verify")


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_examples(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and f"streamprep {command} " in out


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert command in out


@pytest.mark.parametrize("command", ("status", "logs", "audit", "verify"))
def test_not_a_run_dir_is_exit_2_one_line(command, tmp_path, capsys):
    assert main([command, str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("streamprep: error:") and "not a streamprep run directory" in lines[0]
    assert not any(tmp_path.iterdir())  # nothing written
    # regression: a mistyped path, or a file, was "not a streamprep run directory (no run.json)" too
    (tmp_path / "notes.txt").write_text("x")
    for path, why in ((tmp_path / "typo", "no such run directory"),
                      (tmp_path / "notes.txt", "not a directory (a streamprep run directory holds run.json)")):
        assert main([command, str(path)]) == 2
        assert capsys.readouterr() == ("", f"streamprep: error: {path}: {why}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_missing_dir_and_bad_arguments(tmp_path, capsys):
    assert main(["status", str(tmp_path / "nope")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    for argv, said in ((["logs", str(tmp_path), "-n", "-3"], "streamprep logs: error: argument -n/--lines:"),
                       (["status"], "streamprep status: error: the following arguments are required: RUN_DIR"),
                       (["ingest", "--confg", "x.yaml"], "streamprep ingest: error: the following arguments are "
                                                          "required: --config"),
                       (["digest"], "streamprep: error: argument COMMAND: invalid choice: 'digest'"),
                       # regression: `--run-dir "$RUN"` with RUN unset ran the job in runs/<name> of the working
                       # directory, exit 0; `--config ""` said ". is a directory"
                       (["ingest", "--config", "x.yaml", "--run-dir", ""], ("streamprep ingest: error: argument "
                                                                           "--run-dir: an empty path")),
                       (["ingest", "--config", " "], "streamprep ingest: error: argument --config: an empty path")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err  # one line, as every exit 2 (argparse printed its usage block first)
        assert err.startswith(said) and err.count("\n") == 1 and err.endswith(" --help)\n"), err


@pytest.mark.parametrize("command", [["status"], ["status", "--json"], ["logs"], ["logs", "-f"], ["audit"], ["verify"]])
def test_an_empty_run_dir_is_exit_2_not_the_working_directory(command, tmp_path, capsys, monkeypatch):
    """Regression: `streamprep status "$RUN"` with RUN unset read the working directory as the run dir: inside one it
    showed (verify checked, audit rewrote) that run, exit 0, and `logs -f ""` waited for a run to start in "." for
    ever. Now the one line `--run-dir ""` gets."""
    import streamprep.logtail

    def followed(*_, **__):
        raise AssertionError("followed the working directory's log")

    (tmp_path / "run.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(streamprep.logtail.Follower, "lines", followed)  # it waited for ever: fail instead
    with pytest.raises(SystemExit) as exc:
        main([*command, ""])
    assert exc.value.code == 2
    name = command[0]
    said = f"streamprep {name}: error: argument RUN_DIR: an empty path (see streamprep {name} --help)\n"
    assert capsys.readouterr().err == said


@pytest.mark.parametrize("argv", (["--debug", "status", "RUN"], ["status", "RUN", "--debug"], ["status", "RUN"]))
def test_debug_before_or_after_the_command_shows_the_traceback(argv, tmp_path, capsys, monkeypatch):
    """Regression: each command's own `--debug` (default False) overwrote the top-level one, so
    `streamprep --debug COMMAND` printed the one line without its traceback."""
    import streamprep.commands.status

    def fail(args):
        raise RuntimeError("boom")

    monkeypatch.setattr(streamprep.commands.status, "run", fail)
    assert main([str(tmp_path) if a == "RUN" else a for a in argv]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "streamprep: error: RuntimeError: boom"
    assert ("Traceback (most recent call last)" in err) == ("--debug" in argv)


def test_an_error_naming_a_file_with_control_characters_is_escaped(tmp_path, capsys, monkeypatch):
    """Regression: a file named with ESC, BEL or CR passed them to the terminal in the one-line error (clear screen,
    OSC 8 links), and a CR cut the line at `splitlines`, naming a file that does not exist. Escaped now; the line is
    still cut at a real newline."""
    import streamprep.commands.status
    from streamprep.sources.base import SourceError

    name = "b\x1b[2J\x07x\rstate: COMPLETE.jsonl"

    def fail(args):
        raise SourceError(f"cannot read input file /in/{name}: PermissionError\nsecond line")

    monkeypatch.setattr(streamprep.commands.status, "run", fail)
    assert main(["status", str(tmp_path)]) == 1
    assert capsys.readouterr().err == ("streamprep: error: SourceError: cannot read input file "
                                       "/in/b\\x1b[2J\\x07x\\rstate: COMPLETE.jsonl: PermissionError\n")


def test_unreadable_run_json_is_exit_2(tmp_path, capsys):
    (tmp_path / "run.json").write_text("{not json")
    assert main(["status", str(tmp_path)]) == 2
    assert "not a streamprep run directory" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["status", "verify", "audit", "logs"])
def test_run_dir_holding_only_its_lock(tmp_path, capsys, command):
    """A job killed in the moment between making its run dir (the lock) and writing run.json: the commands say
    so and how to go on, not "not a run directory"; while the lock is held, that the job is starting."""
    from streamprep.layout import RunLayout
    from streamprep.lock import RunLock

    lock = RunLock(RunLayout(tmp_path).lock).acquire()
    assert main([command, str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"streamprep: error: {tmp_path}: a job is starting here and has not "
                                       "written run.json yet; try again in a moment\n")
    lock.release()
    assert main([command, str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"streamprep: error: {tmp_path}: its job stopped before it wrote run.json; "
                                       "re-run the same streamprep ingest command to start it\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]
    (tmp_path / "photos").mkdir()  # a folder of the user's that happens to hold a `.lock`: no run's
    assert main([command, str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"streamprep: error: {tmp_path}: not a streamprep run directory (no run.json)\n"


def test_a_run_dir_as_its_job_leaves_it_before_run_json(tmp_path, capsys, monkeypatch):
    """Regression: a job takes the checkpoint dir's lock and claims it (RUN_DIR/checkpoints/.streamprep.lock and
    .streamprep-run) before it writes run.json, and only a folder holding `.lock` and `logs/` alone was taken for a
    starting run: status and logs said "not a streamprep run directory" for a starting job and for one killed at its
    start. Now, from a real job stopped in that moment, the documented lines; a checkpoints/ holding more is no run's."""
    from helpers import base_config, english_docs
    from streamprep import pipeline, run_from_dict

    class Killed(BaseException):
        """The job's end at its first run.json write, as a kill -9 there ends it."""

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(5)))
    run_dir, said = tmp_path / "run", {}

    def first_record(job, *args, **kwargs):
        said.update({c: (main([c, str(run_dir)]), capsys.readouterr().err) for c in ("status", "logs")})
        raise Killed

    monkeypatch.setattr(pipeline.Job, "_save_record", first_record)
    with pytest.raises(Killed):
        run_from_dict(base_config([{"name": "a", "path": str(tmp_path / "a.jsonl")}], None), run_dir,
                      console_log=False)
    assert sorted(os.listdir(run_dir)) == [".lock", "checkpoints", "logs"]
    assert sorted(os.listdir(run_dir / "checkpoints")) == [".streamprep-run", ".streamprep.lock"]
    starting = f"streamprep: error: {run_dir}: a job is starting here and has not written run.json yet; try again " \
               "in a moment\n"
    assert said == {"status": (2, starting), "logs": (2, starting)}
    for command in ("status", "logs"):
        assert main([command, str(run_dir)]) == 2
        assert capsys.readouterr().err == (f"streamprep: error: {run_dir}: its job stopped before it wrote run.json; "
                                           "re-run the same streamprep ingest command to start it\n")
    # regression: killed while writing run.json or the owner file, their temporary files made it "not a run dir"
    (run_dir / ".run.json.streamprep-tmp.99999").write_text('{"x')
    (run_dir / "checkpoints" / "..streamprep-run.streamprep-tmp.99999").write_text("x")
    assert main(["status", str(run_dir)]) == 2
    assert capsys.readouterr().err == (f"streamprep: error: {run_dir}: its job stopped before it wrote run.json; "
                                       "re-run the same streamprep ingest command to start it\n")
    (run_dir / "checkpoints" / "a.json").write_text("{}")  # a checkpoint: more than a start makes
    assert main(["status", str(run_dir)]) == 2
    assert capsys.readouterr().err == f"streamprep: error: {run_dir}: not a streamprep run directory (no run.json)\n"


def test_fresh_takes_a_run_dir_its_job_left_before_run_json(tmp_path, capsys, monkeypatch):
    """Regression: a `--fresh` job stopped before it wrote run.json (a kill or a Ctrl-C at its start) left its lock,
    its checkpoint dir's lock and owner file and logs/; status said to re-run the same ingest command to start it,
    and `--fresh` refused that run dir as not empty, whatever it was told. It takes what such a job left, and runs
    to the bytes of a run in a new run dir; a run dir holding anything more is still refused, nothing written."""
    from helpers import base_config, english_docs
    from streamprep import ConfigError, pipeline, run_from_dict

    class Killed(BaseException):
        """The job's end at its first run.json write, as a kill -9 there ends it."""

    def killed(job, *args, **kwargs):
        (job.run_dir / ".run.json.streamprep-tmp.99999").write_text('{"x')  # the write a kill cut short
        raise Killed

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(40)))
    raw = base_config([{"name": "a", "path": str(tmp_path / "a.jsonl")}], None)
    run_dir, new = tmp_path / "run", tmp_path / "new"
    with monkeypatch.context() as m:
        m.setattr(pipeline.Job, "_save_record", killed)
        with pytest.raises(Killed):
            run_from_dict(raw, run_dir, fresh=True, console_log=False)
    assert sorted(os.listdir(run_dir)) == [".lock", ".run.json.streamprep-tmp.99999", "checkpoints", "logs"]
    # killed again at its start, as kill -9 leaves it: each lock holding a dead pid's record, a metrics endpoint up
    gone = subprocess.Popen(["true"])
    gone.wait()
    for lock in (run_dir / ".lock", run_dir / "checkpoints" / ".streamprep.lock"):
        lock.write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname(), "started": "t"}))
    with monkeypatch.context() as m:
        m.setattr(pipeline.Job, "_save_record", killed)
        with pytest.raises(Killed):
            run_from_dict({**raw, "execution": {**raw["execution"], "metrics_port": 0}}, run_dir, fresh=True,
                          console_log=False)
    assert os.listdir(run_dir / "logs") == ["streamprep.log"]  # what such a start writes there, all of it:
    assert [json.loads(line)["event"] for line in (run_dir / "logs/streamprep.log").read_text().splitlines()] == [
        "took over a stale lock from a process that is gone", "took over a stale lock from a process that is gone",
        "metrics server listening", "removed temporary files of an interrupted run", "metrics server stopped"]
    assert main(["status", str(run_dir)]) == 2
    assert capsys.readouterr().err.endswith("re-run the same streamprep ingest command to start it\n")
    assert run_from_dict(raw, run_dir, fresh=True, console_log=False).status == "complete"
    assert run_from_dict(raw, new, fresh=True, console_log=False).status == "complete"
    assert (run_dir / "manifest.json").read_bytes() == (new / "manifest.json").read_bytes()

    def refused(*names: str) -> None:
        """A run dir of those files (a name ending in / a folder) is refused by --fresh, and left as it was."""
        where = tmp_path / "refused"
        shutil.rmtree(where, ignore_errors=True)
        for name in names:
            (where / name).parent.mkdir(parents=True, exist_ok=True)
            # a lock file empty, as a released lock is (a "{}" one is refused as a user's .lock, whatever else)
            (where / name).mkdir() if name.endswith("/") else (where / name).write_text("" if name == ".lock" else "{}")
        before = sorted(where.rglob("*"))
        with pytest.raises(ConfigError, match=r"^--fresh: run dir .*/refused is not empty \(choose a new --run-dir "
                                              r"or remove it; to resume a run there, re-run without --fresh\)$"):
            run_from_dict(raw, where, fresh=True, console_log=False)
        assert sorted(where.rglob("*")) == before

    start = (".lock", "logs/", "checkpoints/.streamprep.lock", "checkpoints/.streamprep-run")
    refused(*start, "run.json")  # a run's
    refused(*start, "checkpoints/a.json")  # a checkpoint
    refused(*start, "tokenizer/tokenizer.json")  # a start file of a run that went further
    refused(".lock", "photos/")  # a user's folder that happens to hold a `.lock`
    refused("logs/")  # no lock: no job of streamprep's left it
    # logs/ holding what no start writes (a start's log never reaches the rotation size): an old run's log kept
    refused(".lock", "logs/streamprep.log.1")
    refused(".lock", "logs/notes.txt")
    refused(".lock", "logs/streamprep.log")  # a line no start writes ("{}")
    refused(*start, "logs/streamprep.log.1")


def test_fresh_refuses_a_folder_holding_a_users_own_lock_file(tmp_path, capsys):
    """Regression: `ingest --fresh` took a folder holding only a user's own `.lock` ('my lock data') for what a job
    stopped at its start left, and ran there, its lock emptying that file. It is refused as not empty, as before that
    take was allowed, the file left as it was."""
    from helpers import make_inputs

    cfg_path, run_dir = tmp_path / "cfg.yaml", tmp_path / "mine"
    cfg_path.write_text(yaml.safe_dump(make_inputs(tmp_path / "data")["config"]))
    run_dir.mkdir()
    (run_dir / ".lock").write_text("my lock data")
    assert main(["ingest", "--config", str(cfg_path), "--run-dir", str(run_dir), "--fresh"]) == 2
    assert capsys.readouterr().err == (f"streamprep: error: --fresh: run dir {run_dir} is not empty (choose a new "
                                       f"--run-dir or remove it; to resume a run there, re-run without --fresh)\n")
    assert os.listdir(run_dir) == [".lock"] and (run_dir / ".lock").read_text() == "my lock data"


def test_fresh_refuses_a_folder_of_old_logs_and_a_released_lock(tmp_path, capsys):
    """Regression: `ingest --fresh` took a folder holding an empty `.lock` and a `logs/` of an old run's (a full
    streamprep.log, its backups .1 to .5) for what a job stopped at its start left, and ran there: its log rotation
    deleted backup .5, and its lines went on the old log. A start's log never reaches the rotation size and holds
    only a start's lines: the folder is refused as not empty, every file left as it was."""
    from helpers import make_inputs

    cfg_path, run_dir = tmp_path / "cfg.yaml", tmp_path / "keep"
    cfg_path.write_text(yaml.safe_dump(make_inputs(tmp_path / "data")["config"]))
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / ".lock").write_bytes(b"")
    line = json.dumps({"event": "old", "pad": "x" * 200}) + "\n"
    (run_dir / "logs" / "streamprep.log").write_text(line * (5 * 2**20 // len(line) + 1))
    for i in range(1, 6):
        (run_dir / "logs" / f"streamprep.log.{i}").write_text(f"old run backup {i}\n")
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert main(["ingest", "--config", str(cfg_path), "--run-dir", str(run_dir), "--fresh"]) == 2
    assert capsys.readouterr().err == (f"streamprep: error: --fresh: run dir {run_dir} is not empty (choose a new "
                                       f"--run-dir or remove it; to resume a run there, re-run without --fresh)\n")
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("fresh", [False, True])
def test_an_interrupted_fresh_run_is_told_to_resume_without_fresh(tmp_path, capsys, monkeypatch, fresh):
    """Regression: an interrupted `ingest --fresh` said "re-run the same command to resume", and that command was
    refused (the run dir is not empty once its job wrote run.json). It says to re-run without --fresh, which
    resumes; without --fresh the advice is the same command, as before."""
    from helpers import base_config, english_docs
    from streamprep import pipeline

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(40)))
    cfg_path, run_dir = tmp_path / "cfg.yaml", tmp_path / "run"
    cfg_path.write_text(yaml.safe_dump(base_config([{"name": "a", "path": str(tmp_path / "a.jsonl")}], None)))
    command = ["ingest", "--config", str(cfg_path), "--run-dir", str(run_dir)]

    def stopped(job, executor):
        raise KeyboardInterrupt  # a Ctrl-C as the job starts its engine, run.json written

    with monkeypatch.context() as m:
        m.setattr(pipeline.Job, "_engine", stopped)
        assert main(command + ["--fresh"] * fresh) == 1
    advice = "re-run the command without --fresh to resume" if fresh else "re-run the same command to resume"
    assert capsys.readouterr().err == f"streamprep: interrupted; progress saved in {run_dir} — {advice}\n"
    if fresh:  # the command it would have said is refused, naming the way on
        assert main(command + ["--fresh"]) == 2
        assert capsys.readouterr().err == (f"streamprep: error: --fresh: run dir {run_dir} is not empty (choose a "
                                           f"new --run-dir or remove it; to resume a run there, re-run without "
                                           f"--fresh)\n")
    assert main(command) == 0
    assert capsys.readouterr().out.endswith(f"streamprep: run complete: {run_dir}\n")


@pytest.mark.parametrize("fresh", [False, True])
def test_a_second_signal_under_fresh_says_to_resume_without_fresh(tmp_path, capfd, monkeypatch, fresh):
    """Regression: a second signal to `ingest --fresh` printed "second signal, exiting now; re-run the same command
    to resume" (written with os.write, past cli.said_to), and that command was refused: the run dir is not empty. It
    says to re-run without --fresh; without --fresh the advice is the same command, as before."""
    from helpers import base_config, english_docs
    from streamprep import pipeline

    class Exited(BaseException):
        """os._exit(1), which would end pytest too."""

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(40)))
    cfg_path, run_dir = tmp_path / "cfg.yaml", tmp_path / "run"
    cfg_path.write_text(yaml.safe_dump(base_config([{"name": "a", "path": str(tmp_path / "a.jsonl")}], None)))

    def twice(job, executor):  # a stop asked, then a second signal as the job starts its engine, run.json written
        job.signals.on_first = lambda: None
        job.signals.handle(signal.SIGINT)
        job.signals.handle(signal.SIGTERM)

    def exited(code):
        raise Exited(code)

    monkeypatch.setattr(pipeline.Job, "_engine", twice)
    monkeypatch.setattr(pipeline.os, "_exit", exited)
    with pytest.raises(Exited):
        main(["ingest", "--config", str(cfg_path), "--run-dir", str(run_dir)] + ["--fresh"] * fresh)
    advice = "re-run the command without --fresh to resume" if fresh else "re-run the same command to resume"
    said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("streamprep:")]
    assert said == [f"streamprep: second signal, exiting now; {advice}"]


@pytest.mark.parametrize("fresh", [False, True])
@pytest.mark.parametrize("raised, said", [
    (KeyboardInterrupt(), "streamprep: interrupted; re-run the same command to resume"),
    (RuntimeError("a dedup holder process ended; re-run the same command to resume"),
     "streamprep: error: RuntimeError: a dedup holder process ended; re-run the same command to resume"),
    (SystemExit(3), "streamprep: error: SystemExit(3) raised inside the command (a plug-in calling sys.exit?); "
                    "re-run the same command to resume")])
def test_ingest_fresh_errors_say_to_resume_without_fresh(tmp_path, capsys, monkeypatch, raised, said, fresh):
    """Regression: every "re-run the same command" an `ingest --fresh` printed named a command its run dir refuses
    once the job wrote run.json; under --fresh it says to re-run without it."""
    from streamprep import cli

    def ingest(args: object) -> int:
        raise raised

    monkeypatch.setattr(cli.COMMANDS, "get", lambda name: ingest)
    monkeypatch.setattr(cli.forkserver, "start_for", lambda config: None)
    assert cli.main(["ingest", "--config", str(tmp_path / "c.yaml")] + ["--fresh"] * fresh) == 1
    expected = said.replace("re-run the same command", "re-run the command without --fresh") if fresh else said
    assert capsys.readouterr().err == expected + "\n"


def test_status_logs_audit_on_a_real_run(tmp_path, capsys):
    """`ingest` through the CLI prints the audit summary; then status / logs / audit on its run dir."""
    from helpers import make_inputs
    import yaml

    inputs = make_inputs(tmp_path / "data")
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(inputs["config"]))
    run_dir = tmp_path / "run"
    assert main(["ingest", "--config", str(cfg_path), "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "audit:" in out and "counts add up" in out and "run complete" in out

    assert main(["status", str(run_dir), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["state"] == "complete" and st["totals"]["read"] == st["totals"]["kept"] + st["totals"]["rejected"]

    assert main(["logs", str(run_dir), "-n", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and all("event" in json.loads(x) for x in lines)

    (run_dir / "audit" / "audit.html").unlink()
    assert main(["audit", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("audit: 2 dataset(s)") and (run_dir / "audit" / "audit.html").is_file()

    # regression: under a name that is not UTF-8, `audit` (audit.json) and `status --json` failed with `TypeError:
    # str is not valid UTF-8`, exit 1, and `verify` reported every Parquet shard unreadable; each says to rename it
    odd = Path(os.fsdecode(os.fsencode(tmp_path) + b"/r\xffx"))
    run_dir.rename(odd)
    for argv in (["status", str(odd)], ["status", str(odd), "--json"], ["logs", str(odd)], ["audit", str(odd)],
                 ["verify", str(odd)]):
        assert main(argv) == 2
        said = capsys.readouterr()
        assert (said.out, said.err) == ("", f"streamprep: error: run dir: {tmp_path}/r\\udcffx has a name that is "
                                            f"not UTF-8; rename it (run.json names it)\n"), argv  # escaped, as stderr shows it


def test_ingest_names_a_run_dir_with_control_characters_escaped(tmp_path, capsys):
    """Regression: `streamprep ingest --run-dir $'r\\e[31mX'` printed "run complete: PATH" with a raw ESC to the
    terminal, and so did the audit summary's "report: PATH" line; the path is escaped now, as an error line escapes
    it."""
    from helpers import make_inputs

    cfg_path, run = tmp_path / "cfg.yaml", tmp_path / "r\x1b[31mX"
    cfg_path.write_text(yaml.safe_dump(make_inputs(tmp_path / "data")["config"]))
    assert main(["ingest", "--config", str(cfg_path), "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and out.endswith(f"  report: {tmp_path}/r\\x1b[31mX/audit/audit.html\n"
                                              f"streamprep: run complete: {tmp_path}/r\\x1b[31mX\n")


def test_ingest_interrupted_and_complete_again_name_a_run_dir_with_control_characters_escaped(tmp_path, capsys,
                                                                                             monkeypatch):
    """Regression: with `--run-dir $'r\\e[31mX\\a'`, a Ctrl-C printed "interrupted; progress saved in PATH" with a raw
    ESC and BEL to the terminal, and so did the console log's "run already complete … run_dir=PATH" line of a re-run;
    both are escaped now, as an error line escapes them (the run log's JSON keeps the path as it is)."""
    from helpers import make_inputs
    from streamprep import pipeline

    cfg_path, run = tmp_path / "cfg.yaml", tmp_path / "r\x1b[31mX\x07"
    cfg_path.write_text(yaml.safe_dump(make_inputs(tmp_path / "data")["config"]))
    command, shown = ["ingest", "--config", str(cfg_path), "--run-dir", str(run)], f"{tmp_path}/r\\x1b[31mX\\x07"

    def stopped(job, executor):
        raise KeyboardInterrupt  # a Ctrl-C as the job starts its engine, run.json written

    with monkeypatch.context() as m:
        m.setattr(pipeline.Job, "_engine", stopped)
        assert main(command) == 1
    err = capsys.readouterr().err
    assert f"streamprep: interrupted; progress saved in {shown} — re-run the same command to resume\n" in err
    assert main(command) == 0
    capsys.readouterr()
    assert main(command) == 0
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err
    assert f"run already complete; nothing to do component=pipeline run_dir={shown}\n" in err
    last = json.loads((run / "logs" / "streamprep.log").read_text().splitlines()[-1])
    assert (last["event"], last["run_dir"]) == ("run already complete; nothing to do", str(run))


def test_a_run_dir_given_with_a_tilde_is_in_the_home_folder(tmp_path, capsys, monkeypatch):
    """Regression: `--run-dir=~/run` (no shell expands a `~` after `=`) ran the job in a folder `./~/run`."""
    from helpers import make_inputs

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(make_inputs(tmp_path / "data")["config"]))
    assert main(["ingest", "--config", str(cfg_path), "--run-dir=~/run"]) == 0
    assert f"run complete: {home / 'run'}\n" in capsys.readouterr().out
    assert (home / "run" / "run.json").is_file() and not any(work.iterdir())
    for argv in (["status", "~/run"], ["logs", "~/run", "-n", "1"], ["audit", "~/run"], ["verify", "~/run"]):
        assert main(argv) == 0, (argv, capsys.readouterr().err)
    (home / "notes.txt").write_text("x")  # `logs -f` waited for a run in `./~/notes.txt`, forever
    follow = subprocess.run([sys.executable, "-m", "streamprep", "logs", "~/notes.txt", "--follow"], cwd=work,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=30)
    said = f"streamprep: error: {home / 'notes.txt'}: not a directory (a streamprep run directory holds run.json)\n"
    assert (follow.returncode, follow.stderr) == (2, said)
    _assert_exit_2_nothing_written(["ingest", "--config", str(cfg_path), "--run-dir=~no_such_user_x/run"], capsys,
                                   "run dir ~no_such_user_x/run: ", work / "~no_such_user_x")
    assert main(["status", "~no_such_user_x/run"]) == 2
    assert capsys.readouterr().err.startswith("streamprep: error: ~no_such_user_x/run: ")


@pytest.mark.parametrize("given, expected", [(None, "1"), ("4", "4")])
def test_the_cli_gives_openblas_one_thread_unless_told_otherwise(tmp_path, given, expected):
    """Regression (perf: idle OpenBLAS threads took ~3 % of a 2-core job): the variable is set before numpy
    loads in the job's process, and its forkserver and workers inherit it; a value of the user's is kept."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if given is not None:
        env["OPENBLAS_NUM_THREADS"] = given
    code = ("import os, sys; from streamprep.cli import main\n"
            "main(['status', sys.argv[1]]); print(os.environ['OPENBLAS_NUM_THREADS'], 'numpy' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "missing")], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.stdout.split() == [expected, "False"], proc.stderr


def test_a_read_only_command_imports_no_heavy_dependency(tmp_path):
    """`cli.main` runs a read-only command (`status`) without importing Ray, Xenna or torch."""
    proc = subprocess.run([sys.executable, "-c", "import sys; from streamprep.cli import main; "
                           "rc = main(['status', sys.argv[1]]); "
                           "print(sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'cosmos_xenna', 'torch'})); "
                           "sys.exit(rc)", str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and proc.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", [["--help"], ["status", "RUN"], ["logs", "RUN"]])
def test_help_status_and_logs_do_not_import_the_pipeline(tmp_path, argv):
    """Commands are loaded by name (cli.COMMANDS): the read-only ones skip the pipeline and its heavy imports."""
    (tmp_path / "run.json").write_text("{}")
    code = ("import sys; from streamprep.cli import main\n"
            "try: rc = main([a.replace('RUN', sys.argv[1]) for a in sys.argv[2:]])\n"
            "except SystemExit as e: rc = e.code\n"
            "heavy = {'streamprep.pipeline', 'streamprep.ingest', 'numpy', 'pyarrow', 'rich', 'prometheus_client'}\n"
            "print(sorted(heavy & set(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path), *argv], capture_output=True, text=True, cwd=REPO)
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stderr


def _ingest_config(tmp_path: Path, **output) -> Path:
    import yaml

    data = tmp_path / "a.jsonl"
    data.write_text('{"text": "hello"}\n')
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"datasets": [{"name": "a", "path": str(data)}], "output": output,
                                   "execution": {"engine": "local"}}))
    return cfg


def _assert_exit_2_nothing_written(argv: list[str], capsys, expected: str, run_dir: Path) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("streamprep: error:") and expected in err[0], err
    assert not run_dir.exists()


@pytest.mark.parametrize("key, value", [("compression", "bogus"), ("shard_size_bytes", -1), ("row_group_size", -10)])
def test_bad_parquet_setting_is_exit_2_before_the_run_dir_exists(tmp_path, capsys, key, value):
    cfg = _ingest_config(tmp_path, parquet={key: value})
    run_dir = tmp_path / "run"
    _assert_exit_2_nothing_written(["ingest", "--config", str(cfg), "--run-dir", str(run_dir)], capsys,
                                   f"'output.parquet.{key}'", run_dir)


@pytest.mark.parametrize("key, value", [("filter", {"lang": "en"}), ("split", "valid"), ("subset", "en"),
                                        ("revision", "v1")])
def test_an_hf_key_on_local_files_is_exit_2_before_the_run_dir_exists(tmp_path, capsys, key, value):
    """Regression: `filter`, `split`, `subset` and `revision` are read by hf:// datasets only and were silently
    ignored elsewhere: a local dataset given `filter: {lang: en}` kept every language, and `split: valid` still went
    to blend.json's train split. Each is now a config error naming the key."""
    cfg = _ingest_config(tmp_path)
    raw = yaml.safe_load(cfg.read_text())
    raw["datasets"][0][key] = value
    cfg.write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "run"
    _assert_exit_2_nothing_written(["ingest", "--config", str(cfg), "--run-dir", str(run_dir)], capsys,
                                   f"'datasets[0].{key}' applies to hf:// datasets only", run_dir)


def test_run_dir_under_a_regular_file_is_exit_2(tmp_path, capsys):
    cfg = _ingest_config(tmp_path)
    (tmp_path / "file").write_text("x")
    run_dir = tmp_path / "file" / "run"
    _assert_exit_2_nothing_written(["ingest", "--config", str(cfg), "--run-dir", str(run_dir)], capsys,
                                   "is not a directory", run_dir)


def test_run_dir_in_a_symlink_loop_is_exit_2(tmp_path, capsys):
    cfg = _ingest_config(tmp_path)
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    _assert_exit_2_nothing_written(["ingest", "--config", str(cfg), "--run-dir", str(tmp_path / "loop_a" / "run")],
                                   capsys, "Symlink loop", tmp_path / "never-created")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "cfg.yaml", "loop_a", "loop_b"]


def test_absolute_checkpoint_dir_in_a_symlink_loop_is_exit_2(tmp_path, capsys):
    """Regression: exit 1 with a bare 'RuntimeError: Symlink loop', no key named (the relative form was exit 2)."""
    import yaml

    cfg = _ingest_config(tmp_path)
    raw = yaml.safe_load(cfg.read_text())
    raw["run"] = {"checkpoint_dir": str(tmp_path / "loop_a")}
    cfg.write_text(yaml.safe_dump(raw))
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    _assert_exit_2_nothing_written(["ingest", "--config", str(cfg), "--run-dir", str(tmp_path / "run")], capsys,
                                   f"config: 'run.checkpoint_dir': Symlink loop from '{tmp_path / 'loop_a'}'",
                                   tmp_path / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "cfg.yaml", "loop_a", "loop_b"]


def test_a_run_dir_or_checkpoint_dir_whose_name_is_not_utf8_is_exit_2(tmp_path, capsys, monkeypatch):
    """Regression: run.json could not hold such a name (bytes the file system gives, not UTF-8), so the job failed
    with `TypeError: str is not valid UTF-8`, exit 1, after taking its locks: `.lock`, `checkpoints/` and `logs/`
    were left, and every re-run failed the same. Now exit 2 before anything is written, naming the folder, as for
    an input file of such a name: --run-dir, runs/<name> of such a working directory, run.checkpoint_dir."""
    cfg = _ingest_config(tmp_path)
    odd = Path(os.fsdecode(os.fsencode(tmp_path) + b"/r\xffx"))
    shown, not_utf8 = f"{tmp_path}/r\\udcffx", "has a name that is not UTF-8; rename it (run.json names it)"
    _assert_exit_2_nothing_written(["ingest", "--config", str(cfg), "--run-dir", str(odd)], capsys,
                                   f"run dir: {shown} {not_utf8}", odd)  # escaped, as stderr shows it
    odd.mkdir()
    monkeypatch.chdir(odd)
    _assert_exit_2_nothing_written(["ingest", "--config", str(cfg)], capsys, f"run dir: {shown}/runs/run {not_utf8}",
                                   odd / "runs")
    raw = yaml.safe_load(cfg.read_text())
    raw["run"] = {"checkpoint_dir": "ck"}  # against the config's folder
    (odd / "cfg.yaml").write_text(yaml.safe_dump(raw))
    _assert_exit_2_nothing_written(["ingest", "--config", str(odd / "cfg.yaml"), "--run-dir", str(tmp_path / "run")],
                                   capsys, f"config: 'run.checkpoint_dir': {shown}/ck {not_utf8}", tmp_path / "run")
    assert os.listdir(odd) == ["cfg.yaml"]


def test_run_dir_in_a_read_only_location_is_exit_2(tmp_path, capsys):
    import os

    cfg = _ingest_config(tmp_path)
    if os.geteuid() == 0:  # root writes through permission bits: use a location the kernel keeps read-only
        parent = Path("/proc/1")
        if os.access(parent, os.W_OK):
            pytest.skip("no read-only location available")
    else:
        parent = tmp_path / "ro"
        parent.mkdir()
        parent.chmod(0o555)
    run_dir = parent / "streamprep-run"
    _assert_exit_2_nothing_written(["ingest", "--config", str(cfg), "--run-dir", str(run_dir)], capsys,
                                   "is not writable", run_dir)


@pytest.mark.parametrize("execution, started", [
    ({"workers": 1}, False), ({"workers": 2}, True), ({}, (os.cpu_count() or 1) > 1),
    ({"workers": 2, "ray_address": "auto"}, False), ({"workers": "two"}, False), (None, "missing"), ("[", "bad")])
def test_ingest_starts_the_forkserver_early_only_for_local_worker_processes(tmp_path, execution, started):
    """`streamprep ingest` starts its workers' forkserver before importing the pipeline when the config will fork
    local workers; a config it cannot peek at is left to the job's load (which names the problem)."""
    cfg = tmp_path / "cfg.yaml"
    if started == "bad":
        cfg.write_text("execution: " + execution)
    elif execution is not None:
        cfg.write_text(yaml.safe_dump({"execution": execution}))
    assert forkserver.start_for(str(cfg)) is (started is True)
    if started is True:
        pid = multiprocessing.forkserver._forkserver._forkserver_pid
        assert pid is not None and psutil.pid_exists(pid)


def test_ingest_starts_the_forkserver_with_a_config_named_from_home(tmp_path, monkeypatch):
    """Regression: `--config=~/cfg.yaml` (no shell expands `~` after `=`) reached `start_for` as written, whose
    `os.stat` found no such file: the forkserver started later, without the config, its tokenizer not preloaded.
    `~` is the home folder there too, as the job's own load reads it."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"execution": {"workers": 2}}))
    monkeypatch.setenv("HOME", str(tmp_path))
    forkserver.stop()  # our own server, not one an earlier test started with its own environment
    try:
        assert forkserver.start_for("~/cfg.yaml")
        pid = multiprocessing.forkserver._forkserver._forkserver_pid
        want, deadline = f"{forkserver.CONFIG_ENV}={cfg.resolve()}".encode(), time.monotonic() + 10
        # empty, or not yet the server's own, while its exec is under way (1 run in 3 on a busy box)
        while want not in (environ := Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        assert want in environ
    finally:
        forkserver.stop()


def _one() -> int:
    return 1


def test_stop_ends_the_forkserver_by_sigkill_without_its_teardown(tmp_path, monkeypatch):
    """Regression: asked to stop through its pipe, the forkserver tore down every module it preloaded (~0.3 s at
    the end of every job with workers); `forkserver.stop` now ends it by SIGKILL (it ignores SIGTERM, which a stop
    of the job's whole process group sends it too), then reaps it, and still stops the resource tracker."""
    import multiprocessing.resource_tracker
    from concurrent.futures import ProcessPoolExecutor

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"execution": {"workers": 2}}))
    forkserver.stop()  # start our own server, not one an earlier test left running
    assert forkserver.start_for(str(cfg))
    with ProcessPoolExecutor(1, mp_context=forkserver.context()) as pool:
        assert pool.submit(_one).result(timeout=60) == 1
    pid = multiprocessing.forkserver._forkserver._forkserver_pid
    tracker = multiprocessing.resource_tracker._resource_tracker._pid
    signals: list[tuple[int, int]] = []
    real_kill = os.kill
    monkeypatch.setattr(os, "kill", lambda p, sig: (signals.append((p, sig)), real_kill(p, sig))[1])
    forkserver.stop()
    assert signals == [(pid, signal.SIGKILL)]
    assert not psutil.pid_exists(pid) and (tracker is None or not psutil.pid_exists(tracker))


@pytest.mark.slow
def test_ingest_leaves_no_process_behind(tmp_path):
    """`streamprep ingest` with worker processes stops its forkserver and multiprocessing's resource tracker and
    waits for them before it exits: no process of its session is left the moment it has ended (they used to exit
    on their own a moment later)."""
    from helpers import base_config, english_docs

    data = tmp_path / "a.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(300)))
    cfg = base_config([{"name": "a", "path": str(data)}], None)
    cfg["execution"]["workers"] = 2
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    with open(tmp_path / "err", "wb") as err:  # not a pipe: waiting for its end would wait for every holder
        proc = subprocess.Popen([sys.executable, "-m", "streamprep", "ingest", "--config", str(tmp_path / "cfg.yaml"),
                                 "--run-dir", str(tmp_path / "run")], cwd=REPO, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=err)
    proc.wait(timeout=300)
    left = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if os.getsid(p.pid) == proc.pid and p.status() != psutil.STATUS_ZOMBIE:
                left.append(" ".join(p.info["cmdline"] or [])[:120])
                p.kill()
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    assert proc.returncode == 0, (tmp_path / "err").read_text()[-2000:]
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "complete"
    assert left == []


@pytest.mark.slow
def test_the_ingest_driver_loads_no_gates_no_httpx_and_no_pyarrow_writers(tmp_path):
    """Issue 28: the driver of a job with local workers plans and keeps the books; the QC gates (their Hyperscan
    databases, word lists and detectors), httpx and `pyarrow.compute` / `pyarrow.parquet` load only in the processes
    that use them (the workers, from the forkserver's preload). A whole job, its driver's modules read at the end."""
    from helpers import base_config, english_docs

    data = tmp_path / "a.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(600, seed=2)))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(base_config([{"name": "a", "path": str(data)}], None,
                                              execution={"engine": "local", "workers": 2, "batch_records": 64})))
    code = ("import sys; from streamprep.cli import main\n"
            "rc = main(['ingest', '--config', sys.argv[1], '--run-dir', sys.argv[2]])\n"
            "heavy = {'quality.control', 'quality.gates', 'hyperscan', 'pycld2', 'httpx2', 'pyarrow.compute',\n"
            "         'pyarrow.parquet', 'streamprep.sources.hub_http'}\n"
            "print(rc, sorted(heavy & set(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code, str(cfg), str(tmp_path / "run")], capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    assert proc.stdout.strip().splitlines()[-1] == "0 []", proc.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "complete"


def test_a_config_that_is_a_fifo_or_a_folder_is_exit_2_not_a_hang(tmp_path):
    """Regression: the forkserver's early peek read a FIFO config before the config's own checks, and blocked for
    ever; a FIFO was then reported as `no such file`."""
    fifo = tmp_path / "c.yaml"
    os.mkfifo(fifo)
    for path, said in ((fifo, f"{fifo} is not a regular file (a FIFO, socket or device)"),
                       (tmp_path, f"{tmp_path} is a directory")):
        proc = subprocess.run([sys.executable, "-m", "streamprep", "ingest", "--config", str(path), "--run-dir",
                               str(tmp_path / "run")], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert proc.returncode == 2 and proc.stderr.splitlines() == [f"streamprep: error: config: {said}"]
    assert not (tmp_path / "run").exists()


def test_a_full_disk_is_said_as_such_naming_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Regression: a full disk ended a job with a bare "OSError: [Errno 28] No space left on device" naming no file,
    and a unit's staged write that failed so read "reading or judging the input failed" (blaming the input)."""
    import errno

    from streamprep import atomic, cli
    from streamprep.sources.base import SourceError

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    target = tmp_path / "part-00000.jsonl"
    with monkeypatch.context() as m:
        m.setattr(atomic.os, "fsync", full)
        with pytest.raises(OSError) as err:
            atomic.write_bytes(target, b"x\n")
    assert err.value.filename == str(target) and not list(tmp_path.iterdir())

    def ingest(args: object) -> int:
        raise SourceError("dataset d: reading or judging the input failed after item 0: OSError: ...") from err.value

    monkeypatch.setattr(cli.COMMANDS, "get", lambda name: ingest)
    monkeypatch.setattr(cli.forkserver, "start_for", lambda config: None)
    assert cli.main(["ingest", "--config", str(tmp_path / "c.yaml")]) == 1
    line = capsys.readouterr().err
    assert line.startswith(f"streamprep: error: no space left on the disk writing {target}: free some and re-run the "
                           f"same command to resume (SourceError: dataset d:") and line.count("\n") == 1


def test_a_ray_workers_error_names_what_it_raised(tmp_path: Path, capsys, monkeypatch) -> None:
    """Regression: a failure in a Ray worker's call printed only Ray's header, "RayTaskError(TypeError):
    \\x1b[36mray::_Actor.run()\\x1b[39m (pid=…, ip=…, actor_id=…, repr=…)", no cause (and a unit's error wrapping
    one, "reading or judging the input failed …: RayTaskError(…)", the same). The line names what the worker
    raised, and where."""
    import streamprep.commands.status
    from streamprep.sources.base import SourceError, one_line

    raised = [ray_worker_error(), SourceError(f"dataset d: reading or judging the input failed after item 0: "
                                              f"{one_line(ray_worker_error())}")]
    monkeypatch.setattr(streamprep.commands.status, "run", lambda args: (_ for _ in ()).throw(raised.pop(0)))
    what = "TypeError: build_audit() takes 1 positional argument but 2 were given (in a Ray worker, pid 4242)"
    assert main(["status", str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"streamprep: error: {what}\n"
    assert main(["status", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (f"streamprep: error: SourceError: dataset d: reading or judging the input "
                                       f"failed after item 0: {what}\n")


def _sealed_log(tmp_path: Path) -> Path:
    from streamprep import checkpoints

    files = checkpoints.DatasetFiles(tmp_path, tmp_path, "c4")
    checkpoints.save(files, checkpoints.IngestState("c4", sealed=[["0" * 64, 10]]))
    return files.sealed_log


def _dedup_log(tmp_path: Path) -> Path:
    import numpy as np

    from streamprep.holders import Holder

    holder, log = Holder(), tmp_path / "c4.dedup"
    holder.open("c4", str(log), 0)
    holder.add_many("c4", np.arange(8, dtype=np.uint64).reshape(2, 4))
    holder.flush("c4")
    return log


def _binidx(tmp_path: Path) -> Path:
    import numpy as np

    from streamprep.binidx import IndexedDatasetWriter

    writer = IndexedDatasetWriter(tmp_path / "part-00000", np.uint16)
    writer.add_documents([np.arange(1, 5, dtype=np.uint16)])
    writer.close()
    return tmp_path / "part-00000.bin"


def _committed(tmp_path: Path) -> Path:
    from streamprep import atomic

    final = tmp_path / "shard.parquet"
    atomic.tmp_path(final).write_bytes(b"x")
    atomic.commit(atomic.tmp_path(final), final)
    return final


@pytest.mark.parametrize("write", [_sealed_log, _dedup_log, _binidx, _committed])
@pytest.mark.parametrize("code", ["ENOSPC", "EFBIG"])
def test_a_full_disk_or_a_file_too_large_names_the_file_being_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys, write, code: str) -> None:
    """Regression: an fsync (or buffered write) of the sealed log, a dedup log, a binidx file or a Parquet shard that
    failed for room ("[Errno 28] No space left on device") or size ("[Errno 27] File too large", `ulimit -f`) named
    no file, and the job's line said neither where nor (for the latter) what to do."""
    import errno

    from streamprep import cli

    number = getattr(errno, code)

    def fails(fd: int) -> None:
        raise OSError(number, os.strerror(number))

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", fails)
        with pytest.raises(OSError) as err:
            write(tmp_path)
    (tmp_path / "ok").mkdir()
    final = write(tmp_path / "ok")  # the file the same write makes when it succeeds
    assert err.value.filename == str(tmp_path / final.relative_to(tmp_path / "ok"))

    def ingest(args: object) -> int:
        raise err.value

    monkeypatch.setattr(cli.COMMANDS, "get", lambda name: ingest)
    monkeypatch.setattr(cli.forkserver, "start_for", lambda config: None)
    assert cli.main(["ingest", "--config", str(tmp_path / "c.yaml")]) == 1
    said = {"ENOSPC": f"no space left on the disk writing {err.value.filename}: free some and re-run the same command "
                      f"to resume (OSError: ",
            "EFBIG": f"file too large writing {err.value.filename}: raise the limit on a file's size (`ulimit -f`, "
                     f"or the file system's own) and re-run the same command to resume (OSError: "}[code]
    line = capsys.readouterr().err
    assert line.startswith(f"streamprep: error: {said}") and line.count("\n") == 1


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    from helpers import make_inputs
    from streamprep import run_from_dict

    root = tmp_path_factory.mktemp("finished")
    assert run_from_dict(make_inputs(root / "data")["config"], root / "run", console_log=False).status == "complete"
    return root / "run"


@pytest.mark.parametrize("argv", [["status", "RUN", "--json"], ["logs", "RUN"], ["verify", "RUN"], ["audit", "RUN"]])
def test_a_read_only_commands_output_on_a_full_disk_is_not_told_to_resume(finished_run: Path, capsys, argv) -> None:
    """Regression: `streamprep status RUN --json > FILE` on a full disk said "no space left on the disk: free some and
    re-run the same command to resume": there is nothing to resume, and the file it could not write is its output."""
    import errno

    class Full(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with contextlib.redirect_stdout(Full()):
        assert main([str(finished_run) if a == "RUN" else a for a in argv]) == 1
    assert capsys.readouterr().err == ("streamprep: error: no space left on the disk writing its output: free some and "
                                       "re-run the same command (OSError: [Errno 28] No space left on device)\n")


def test_an_error_naming_a_temporary_file_names_the_file_it_becomes(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: out of inodes, creating the temporary file raised "[Errno 28] …: '…/.c4.plan.json.streamprep-tmp.
    4710'", and the job's line named that name, which is gone once the error is out, not c4.plan.json."""
    import errno

    from streamprep import atomic

    def no_inode(path: str, flags: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(atomic, "nofollow", no_inode)
    target = tmp_path / "c4.plan.json"
    with pytest.raises(OSError) as err:
        atomic.write_json(target, [])
    assert (err.value.errno, err.value.filename, err.value.filename2) == (errno.ENOSPC, str(target), None)


def test_a_folder_of_the_run_it_may_not_write_in_is_exit_2_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys) -> None:
    """Regression: a read-only folder inside the run dir (checkpoints/, ingest/<ds>, parquet/, binidx/<ds>) ended a
    resume with a raw "PermissionError: [Errno 13] Permission denied: '…/checkpoints/.dclm.inputs.streamprep-tmp.
    11029'" (pyarrow's "Failed to open local file '….parquet.streamprep-tmp.…'"), exit 1, at every re-run. A folder
    there is now checked at the start: exit 2 naming it, nothing written; one made read-only during the job is the
    line naming the file (not its temporary name) and its folder, exit 2, recorded as needing a change.
    (Simulated: root writes through permission bits.)"""
    import errno

    from helpers import base_config, english_docs, tree_hashes
    from streamprep import atomic, cli, run_from_dict
    from streamprep.layout import needs_change

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(200)))
    cfg, run = base_config([{"name": "gen", "path": str(src)}], None), tmp_path / "run"
    assert run_from_dict(cfg, run_dir=run, console_log=False).status == "complete"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    before = tree_hashes(run, ".", names=())
    access, refusing = os.access, run / "checkpoints"
    with monkeypatch.context() as m:
        m.setattr(os, "access", lambda path, mode, **kw: (Path(path) != refusing or not mode & os.W_OK)
                  and access(path, mode, **kw))  # read-only: r-x
        assert main(["ingest", "--config", str(tmp_path / "c.yaml"), "--run-dir", str(run)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"streamprep: error: run dir {run}: {refusing} is not writable; make it writable and re-run"]
    assert tree_hashes(run, ".", names=()) == before  # nothing written (run.json, logs included)
    # regression: folders the job does not write in were checked too (Megatron's index cache, written by a trainer;
    # a user's folder in a run.checkpoint_dir of theirs, another file's folder in audit/)
    others = [run / "binidx/gen/cache", run / "binidx/gen/cache/GPTDataset_indices", run / "audit/extra"]
    for folder in others:
        folder.mkdir(parents=True, exist_ok=True)
    with monkeypatch.context() as m:
        m.setattr(os, "access", lambda path, mode, **kw: Path(path) not in others and access(path, mode, **kw))
        assert main(["ingest", "--config", str(tmp_path / "c.yaml"), "--run-dir", str(run)]) == 0
    capsys.readouterr()

    nofollow = atomic.nofollow

    def opener(path: str, flags: int) -> int:
        if Path(path).parent == refusing:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return nofollow(path, flags)
    with monkeypatch.context() as m:  # made read-only during the job
        m.setattr(atomic, "nofollow", opener)
        with pytest.raises(PermissionError) as err:
            atomic.write_bytes(refusing / "gen.inputs", b"{}\n")
    assert err.value.filename == str(refusing / "gen.inputs") and needs_change(err.value)

    def ingest(args: object) -> int:
        raise err.value

    monkeypatch.setattr(cli.COMMANDS, "get", lambda name: ingest)
    monkeypatch.setattr(cli.forkserver, "start_for", lambda config: None)
    assert cli.main(["ingest", "--config", str(tmp_path / "c.yaml")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"streamprep: error: cannot write {refusing}/gen.inputs: Permission denied; make {refusing} (and the file, if "
        f"it is there) writable and re-run the same command"]


def test_a_folder_of_the_run_it_may_not_enter_is_exit_2_saying_to_make_it_readable_too(tmp_path: Path) -> None:
    """Regression: `ingest` on a run whose folder was `chmod 000` said to make it writable ("run dir RUN:
    RUN/checkpoints is not writable; make it writable", "cannot write …/receipts/gen/part-00000.json: …; make
    …/receipts/gen … writable"): made so (`chmod u+w`) it still could not be listed or entered. The line says what it
    lacks. (Real permissions: `streamprep_obeying_permissions` drops root's override.)"""
    from helpers import base_config, english_docs, streamprep_obeying_permissions
    from streamprep import run_from_dict

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(200)))
    cfg, run = base_config([{"name": "gen", "path": str(src)}], None), tmp_path / "run"
    assert run_from_dict(cfg, run_dir=run, console_log=False).status == "complete"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    for closed, said in [
            ("checkpoints", (f"run dir {run}: {run / 'checkpoints'} is not readable, writable or searchable; make "
                             f"it readable, writable and searchable and re-run")),
            ("receipts/gen", (f"cannot read {run / 'receipts/gen'}: Permission denied; make it readable, writable "
                              f"and searchable and re-run the same command"))]:
        (run / closed).chmod(0)
        try:
            proc = streamprep_obeying_permissions(["ingest", "--config", str(tmp_path / "c.yaml"), "--run-dir",
                                                   str(run)])
        finally:
            (run / closed).chmod(0o755)
        assert (proc.returncode, proc.stderr.splitlines()[-1]) == (2, f"streamprep: error: {said}"), proc.stderr


def test_a_lock_it_may_not_read_or_write_says_both(tmp_path: Path) -> None:
    """Regression: the run's `.lock` made `chmod 000` was "cannot read …/.lock: Permission denied; make it readable";
    made so (`chmod 444`), the next run said "cannot write …/.lock": the lock is opened to read and write, and the
    line was told by the file's state. It says both, for the checkpoint dir's lock too; with both granted the run
    is complete. (Real permissions: `streamprep_obeying_permissions` drops root's override.)"""
    from helpers import base_config, english_docs, streamprep_obeying_permissions
    from streamprep import run_from_dict

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(50)))
    cfg, run = base_config([{"name": "gen", "path": str(src)}], None), tmp_path / "run"
    assert run_from_dict(cfg, run_dir=run, console_log=False).status == "complete"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    command = ["ingest", "--config", str(tmp_path / "c.yaml"), "--run-dir", str(run)]
    for lock, mode in [(run / ".lock", 0o000), (run / ".lock", 0o444), (run / "checkpoints/.streamprep.lock", 0o000)]:
        lock.chmod(mode)
        try:
            proc = streamprep_obeying_permissions(command)
        finally:
            lock.chmod(0o644)
        assert (proc.returncode, proc.stderr.splitlines()[-1]) == (2, (
            f"streamprep: error: cannot read and write {lock}: Permission denied; make it readable and writable and "
            f"re-run the same command")), (oct(mode), proc.stderr)
    proc = streamprep_obeying_permissions(command)
    assert (proc.returncode, proc.stdout.splitlines()[-1]) == (0, f"streamprep: run complete: {run}"), proc.stderr


def test_a_file_of_the_run_it_may_not_read_is_exit_2_saying_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys) -> None:
    """Regression: a checkpoint (receipt, `<ds>.sealed`, the run's tokenizer.json) made unreadable ended a resume with
    "cannot write …/checkpoints/gen.json: Permission denied; make …/checkpoints (and the file, if it is there)
    writable": the failing call was its read. The line says it cannot read the file and to make it readable, exit 2,
    recorded as needing a change. (Simulated as `chmod 000` would: root reads through permission bits.)"""

    from helpers import base_config, english_docs
    from streamprep import run_from_dict

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(200)))
    cfg, run = base_config([{"name": "gen", "path": str(src)}], None), tmp_path / "run"
    assert run_from_dict(cfg, run_dir=run, console_log=False).status == "complete"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    refused = run / "checkpoints/gen.json"
    deny_reading(monkeypatch, refused)
    assert main(["ingest", "--config", str(tmp_path / "c.yaml"), "--run-dir", str(run)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"streamprep: error: cannot read {refused}: Permission denied; make it readable and re-run the same command")
    assert json.loads((run / "run.json").read_text())["needs_change"] is True


def test_a_finished_run_whose_outputs_were_made_read_only_is_re_run_as_complete(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                                 capsys) -> None:
    """Regression: the start's check of the folders a resume writes in refused a finished run whose ingest/<ds>,
    binidx/<ds>, parquet/ and receipts/ were made read-only ("run dir RUN: RUN/parquet is not writable"), exit 2,
    where its re-run verifies and writes nothing there. It is complete, exit 0; one with something to redo (a
    receipt gone) is refused as before, naming the folder, run.json and the outputs as they were.
    (Simulated: root writes through permission bits.)"""
    from helpers import base_config, english_docs, tree_hashes

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(200)))
    cfg, run = base_config([{"name": "gen", "path": str(src)}], None), tmp_path / "run"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    command = ["ingest", "--config", str(tmp_path / "c.yaml"), "--run-dir", str(run)]
    assert main(command) == 0
    capsys.readouterr()
    refused = [run / "ingest", run / "ingest/gen", run / "binidx", run / "binidx/gen", run / "parquet",
               run / "receipts", run / "receipts/gen"]
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: (Path(path) not in refused or not mode & os.W_OK)
                        and access(path, mode, **kw))  # read-only: r-x
    assert main(command) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"streamprep: run complete: {run}"
    (run / "receipts/gen/part-00000.json").unlink()
    outputs = ("ingest", "binidx", "parquet", "receipts", "checkpoints")
    before = tree_hashes(run, *outputs, names=("run.json", "manifest.json"))
    assert main(command) == 2
    said = capsys.readouterr().err.splitlines()  # (the log's line naming what is to redo, then the error)
    assert said[-1] == f"streamprep: error: run dir {run}: {run / 'ingest'} is not writable; make it writable and re-run"
    assert tree_hashes(run, *outputs, names=("run.json", "manifest.json")) == before


def test_only_the_folders_a_job_writes_in_a_users_checkpoint_dir_are_checked(tmp_path, monkeypatch):
    """Regression: a read-only folder of the user's own inside `run.checkpoint_dir` (reference_data/v1) refused the
    run, the check walking every folder there; a read-only stage/<ds> still is refused, naming the key."""
    from helpers import base_config
    from streamprep.config import Config, ConfigError, validate
    from streamprep.pipeline import _check_written_folders

    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    ckpt = tmp_path / "mine"
    cfg = base_config([{"name": "a", "path": str(tmp_path / "a.jsonl")}], None)
    cfg["run"]["checkpoint_dir"] = str(ckpt)
    config = Config.from_dict(validate(cfg, tmp_path))
    refused = [ckpt / "reference_data/v1", ckpt / "stage/a"]
    for folder in refused:
        folder.mkdir(parents=True)
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: (Path(path) not in refused or not mode & os.W_OK)
                        and access(path, mode, **kw))  # read-only: r-x
    with pytest.raises(ConfigError) as err:
        _check_written_folders(config, tmp_path / "run")
    assert str(err.value) == f"'run.checkpoint_dir' {ckpt}: {ckpt / 'stage/a'} is not writable; make it writable " \
                             f"and re-run"
    refused.pop()
    _check_written_folders(config, tmp_path / "run")


@pytest.mark.parametrize("damaged", ["part", "sealed"])
def test_a_part_whose_sha256_fails_at_resume_is_exit_2_saying_what_to_delete(tmp_path: Path, capsys,
                                                                            damaged: str) -> None:
    """Regression: a part (or its `<ds>.sealed` record) changed since it was sealed made the resume fail with a plain
    ValueError, exit 1, run.json without `needs_change` ("resumable"), and every re-run ended the same; its line said
    to start over. Exit 2 now, recorded as needing a change, and the line names what to delete: then the same
    command ingests the dataset again, to the same bytes."""
    from helpers import base_config, english_docs, tree_hashes
    from streamprep import run_from_dict

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(200)))
    cfg, run = base_config([{"name": "gen", "path": str(src)}], None, output={"shard_records": 50}), tmp_path / "run"
    assert run_from_dict(cfg, run_dir=run, console_log=False).status == "complete"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    outputs = ("binidx", "parquet", "receipts")
    before = tree_hashes(run, *outputs)
    (run / "receipts/gen/part-00001.json").unlink()
    part, sealed = run / "ingest/gen/part-00001.jsonl", run / "checkpoints/gen.sealed"
    edited, at = (part, part.read_bytes().index(b"the")) if damaged == "part" else (sealed, 40 + 5)
    data = bytearray(edited.read_bytes())
    data[at] ^= 1
    edited.write_bytes(bytes(data))
    assert main(["ingest", "--config", str(tmp_path / "c.yaml"), "--run-dir", str(run)]) == 2
    assert_part_sha_refused(capsys.readouterr().err, run)
    part.unlink()
    assert main(["ingest", "--config", str(tmp_path / "c.yaml"), "--run-dir", str(run)]) == 0
    assert tree_hashes(run, *outputs) == before
