"""`streamprep logs`: tail -n, and --follow across many real RotatingFileHandler rollovers."""
from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import deny_reading
from streamprep import logs
from streamprep.logtail import Follower, last_lines, log_path, tail


def _run_dir(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"status": "running", "config": {"datasets": []}}))
    return run_dir


def _seqs(lines) -> list[int]:
    out = []
    for line in lines:
        line = line.decode() if isinstance(line, bytes) else line
        if line.strip():
            out.append(json.loads(line)["seq"])
    return out


def _rotated_files(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "logs").iterdir())


@pytest.fixture
def log_writer():
    """Configure the run log with tiny rotation limits; restore a handler-free set-up afterwards."""
    def configure(run_dir: Path, max_bytes: int, backups: int):
        logs.configure(run_dir, console=False, max_bytes=max_bytes, backups=backups)
        return logs.get("writer")

    yield configure
    logs.configure(None, console=False)


def test_last_lines_reaches_into_rotated_files(tmp_path, log_writer, capsys):
    run_dir = _run_dir(tmp_path)
    log = log_writer(run_dir, max_bytes=1500, backups=3)
    for i in range(40):
        log.info("line", seq=i)
    assert (run_dir / "logs" / "streamprep.log.1").exists()
    assert _seqs(last_lines(run_dir, 5)) == list(range(35, 40))
    current = len(log_path(run_dir).read_text().splitlines())
    n = current + 3  # more than the current file holds: the rest comes from .1
    assert _seqs(last_lines(run_dir, n)) == list(range(40 - n, 40))
    assert tail(run_dir, 3) == 0
    assert _seqs(capsys.readouterr().out.splitlines()) == [37, 38, 39]


@pytest.mark.parametrize("follow", [True, False])
def test_a_rollover_between_reading_the_log_and_its_backups_repeats_no_line(tmp_path, log_writer, monkeypatch,
                                                                              follow):
    """Regression: `logs -n N [-f]` read streamprep.log, then its backups by name: a rollover between the two made .1
    the file just read, and its lines were printed twice (3 runs in 80 at a 100-byte limit). A backup that is the file
    read, or newer than it, is not read as older."""
    from streamprep import logtail

    run_dir = _run_dir(tmp_path)
    log = log_writer(run_dir, max_bytes=1500, backups=3)
    for i in range(30):
        log.info("line", seq=i)
    real = logtail._backups
    rolled = []

    handler = next(h for h in logging.getLogger("streamprep").handlers if isinstance(h, logs._RunLog))

    def rollover_first(path):  # the writer rolls over twice, writing after each, just as the tail looks for backups
        if not rolled:
            rolled.append(True)
            for seq in (30, 31):
                handler.doRollover()
                log.info("line", seq=seq)
        return real(path)

    monkeypatch.setattr(logtail, "_backups", rollover_first)
    n = len(log_path(run_dir).read_text().splitlines()) + 4  # reaches into the backups
    out = io.StringIO()
    if follow:
        polls = []
        tail(run_dir, n, follow=True, out=out, poll_s=0.01, stop=lambda: polls.append(1) or len(polls) > 3)
    else:
        tail(run_dir, n, out=out)
    seqs = _seqs(out.getvalue().splitlines())
    assert rolled and seqs == sorted(set(seqs)), seqs  # none twice, in order
    assert seqs[-1] == (31 if follow else 29) and len(seqs) >= n


def test_a_file_rotated_past_the_last_backup_after_it_was_read_has_no_older_lines(tmp_path):
    """Regression (review of the fix above): when the file `logs -n` read was rotated past the last backup before
    its backups were looked at, every backup was newer than it, and their lines were printed as older ones, before
    its own."""
    import logging.handlers

    from streamprep import logtail

    path = tmp_path / "logs" / "streamprep.log"
    path.parent.mkdir()
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=30, backupCount=5)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("test_logtail_gone")
    log.propagate, log.level = False, logging.INFO
    log.addHandler(handler)
    seq = iter(range(100))
    try:
        for _ in range(12):
            log.info("line %03d", next(seq))
        with open(path, "rb") as fh:
            head = fh.read()
            for _ in range(20):  # its file renamed to .1, … and past .5: removed
                log.info("line %03d", next(seq))
            assert os.fstat(fh.fileno()).st_nlink == 0
            assert logtail._tail_of(path, head, fh, 8) == head.decode().splitlines()
    finally:
        log.removeHandler(handler)
        handler.close()


def _burst_between_polls(run_dir, log_writer, backups: int, lines: int) -> tuple[list[int], list[str]]:
    """Follow from the end, log `lines` lines at once (rotating many times), poll once: (seqs read, warnings)."""
    log = log_writer(run_dir, max_bytes=1200, backups=backups)
    log.info("line", seq=0)
    warnings: list[str] = []
    f = Follower(log_path(run_dir), start_at_end=True, warn=warnings.append)
    got = list(f.head.splitlines())
    for i in range(1, lines):
        log.info("line", seq=i)
    got += f.poll()
    f.close()
    return _seqs(got), warnings


def test_follow_in_process_burst_of_rotations_between_polls(tmp_path, log_writer):
    """Dozens of rollovers between two polls: followed file by file, every line once, in order."""
    run_dir = _run_dir(tmp_path)
    got, warnings = _burst_between_polls(run_dir, log_writer, backups=200, lines=400)
    assert len(_rotated_files(run_dir)) > 30
    assert got == list(range(400))
    assert not warnings


def test_follow_when_files_are_deleted_before_read_warns_and_never_repeats(tmp_path, log_writer):
    got, warnings = _burst_between_polls(_run_dir(tmp_path), log_writer, backups=2, lines=200)
    assert warnings and "missing" in warnings[0]
    assert got == sorted(set(got)) and got[-1] == 199  # in order, no repeats, reaches the end


@pytest.mark.parametrize("removed", ["logs/streamprep.log", "logs/"])
def test_follow_a_log_removed_and_made_again_by_the_next_job(tmp_path, log_writer, removed):
    """Regression: a followed log removed (or its folder) and made again by a new job was taken for one rotated past
    the last backup: 'log rotated faster than it was read; lines may be missing before streamprep.log' with nothing
    missing, and with older backups beside it the oldest of them was printed again. Now the new log is followed
    from its first line, with a line saying what happened; a real rotation past the last backup still warns."""
    import shutil

    run_dir = _run_dir(tmp_path)
    log = log_writer(run_dir, max_bytes=1200, backups=3)
    i = 0
    while not (run_dir / "logs" / "streamprep.log.3").exists() or log_path(run_dir).stat().st_size > 400:
        log.info("line", seq=i)  # up to just after a rollover, with 3 backups: the next line rotates nothing
        i += 1
    warnings: list[str] = []
    f = Follower(log_path(run_dir), start_at_end=True, warn=warnings.append)
    log.info("line", seq=40)
    time.sleep(0.05)  # a person's `rm`, not in the instant of the last rollover
    if removed == "logs/":
        shutil.rmtree(run_dir / "logs")
    else:
        log_path(run_dir).unlink()
    assert _seqs(f.poll()) == [40] and i < 40  # the removed file's last line; no new log yet
    log = log_writer(run_dir, max_bytes=1200, backups=3)  # the next job
    for i in range(100, 105):
        log.info("line", seq=i)
    assert _seqs(f.poll()) == list(range(100, 105))
    for i in range(105, 200):  # many rollovers in one poll: lines lost, and said
        log.info("line", seq=i)
    got = _seqs(f.poll())
    f.close()
    assert got[0] == 105 and got[-1] == 199 and got == sorted(set(got)) and len(got) < 95  # lines lost
    assert warnings == ["streamprep.log was removed and created again; following the new one from its start",
                        "log rotated faster than it was read; lines may be missing before streamprep.log.3"]


def test_follow_truncated_in_place_restarts_from_top(tmp_path):
    run_dir = _run_dir(tmp_path)
    path = log_path(run_dir)
    path.write_text('{"seq": 0}\n{"seq": 1}\n')
    warnings: list[str] = []
    f = Follower(path, start_at_end=True, warn=warnings.append)
    with open(path, "r+") as fh:
        fh.truncate(0)
    with open(path, "a") as fh:
        fh.write('{"seq": 2}\n{"seq"')
    assert _seqs(f.poll()) == [2]  # the partial line waits for its end
    with open(path, "a") as fh:
        fh.write(': 3}\n')
    assert _seqs(f.poll()) == [3]
    f.close()
    assert warnings


@pytest.mark.slow
def test_follow_cli_across_rotations_exactly_once_and_ctrl_c_exits_0(tmp_path, log_writer):
    """A real `streamprep logs --follow` process while this process writes and rotates the log."""
    run_dir = _run_dir(tmp_path)
    log = log_writer(run_dir, max_bytes=4000, backups=5)
    log.info("line", seq=0)
    proc = subprocess.Popen([sys.executable, "-m", "streamprep", "logs", str(run_dir), "--follow", "-n", "1",
                             "--poll-interval", "0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    seen = threading.Event()
    last = 700

    def reader():
        for line in proc.stdout:
            lines.append(line)
            if '"seq": %d' % last in line or f'"seq":{last}' in line:
                seen.set()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while not lines and time.monotonic() < deadline:  # the follower is up once it printed the -n 1 tail
        time.sleep(0.02)
    assert lines, "follower printed nothing"
    rotations, ino = 0, os.stat(log_path(run_dir)).st_ino
    for i in range(1, last + 1):
        log.info("line", seq=i, pad="x" * 40)
        now = os.stat(log_path(run_dir)).st_ino
        rotations, ino = rotations + (now != ino), now
        time.sleep(0.002)
    assert seen.wait(20), f"follower stopped at {lines[-1:]}"
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(10)
    t.join(5)
    err = proc.stderr.read()
    assert rc == 0, err
    assert rotations >= 15, f"only {rotations} rotations; the test needs many"
    assert _seqs(lines) == list(range(last + 1)), err
    assert "Traceback" not in err


def test_logs_command_without_a_log_yet(tmp_path, capsys):
    from streamprep.cli import main

    run_dir = _run_dir(tmp_path)
    assert main(["logs", str(run_dir)]) == 0
    assert capsys.readouterr() == ("", f"streamprep: logs: no log at {log_path(run_dir)}\n")  # regression: silence
    log_path(run_dir).mkdir(parents=True)  # regression: a folder there printed nothing, exit 0
    assert main(["logs", str(run_dir)]) == 2
    assert capsys.readouterr().err == (f"streamprep: error: {log_path(run_dir)} is a folder where the run keeps a "
                                       f"file; remove it and re-run\n")


@pytest.mark.parametrize("backup", [False, True])
def test_a_log_it_may_not_read_is_one_line_exit_2(tmp_path, capsys, monkeypatch, backup):
    """Regression: an unreadable streamprep.log (`chmod 000`) was skipped as if rotated away between two looks:
    `logs` printed nothing, exit 0 (with a readable .1, .1's last lines as the newest), and `--follow` waited in
    silence. The line names it, exit 2; `--follow` raises it too. (Simulated: root reads through permission bits.)"""
    import errno

    from streamprep import logtail
    from streamprep.cli import main

    run_dir = _run_dir(tmp_path)
    refused = log_path(run_dir)
    refused.write_text('{"event": "current"}\n')
    if backup:
        refused.with_name(refused.name + ".1").write_text('{"event": "older"}\n')

    def opener(path: Path, mode: str = "r", *args, **kw):
        if Path(path) == refused:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return open(path, mode, *args, **kw)
    monkeypatch.setattr(logtail, "open", opener, raising=False)  # logtail's open only: pytest's own are left as are
    deny_reading(monkeypatch, refused, read_bytes=False)
    assert main(["logs", str(run_dir), "-n", "3"]) == 2
    assert capsys.readouterr() == ("", f"streamprep: error: cannot read {refused}: Permission denied; make it "
                                       f"readable and re-run the same command\n")
    polls = iter(range(5))
    with pytest.raises(PermissionError):
        tail(run_dir, follow=True, out=io.StringIO(), poll_s=0.01, stop=lambda: next(polls) == 4)


def test_logs_follow_without_a_log_yet_says_so_then_follows_it(tmp_path, capsys):
    """Regression: --follow on a run dir with no log said nothing at all, while the doc promised the line."""
    run_dir = _run_dir(tmp_path)
    from streamprep.logtail import tail

    calls = iter(range(1000))
    out = io.StringIO()

    def stop() -> bool:
        if next(calls) == 3:
            log_path(run_dir).parent.mkdir(parents=True, exist_ok=True)
            log_path(run_dir).write_text('{"event": "first"}\n')
        return '"first"' in out.getvalue()

    assert tail(run_dir, follow=True, out=out, poll_s=0.01, stop=stop) == 0
    assert capsys.readouterr().err == f"streamprep: logs: no log at {log_path(run_dir)} yet; waiting for it\n"
    assert out.getvalue() == '{"event": "first"}\n'


def test_logs_names_a_path_with_control_characters_escaped(tmp_path, capsys):
    """Regression: `mkdir $'e\\e[31m'; streamprep logs -f $'e\\e[31m'` printed a raw ESC to the terminal in "no run at
    … yet"; the path is escaped now, as an error line escapes it."""
    run_dir = tmp_path / "e\x1b[31m"
    run_dir.mkdir()
    assert tail(run_dir, follow=True, out=io.StringIO(), poll_s=0.01, stop=lambda: True) == 0
    assert capsys.readouterr().err == (f"streamprep: logs: no run at {tmp_path}/e\\x1b[31m yet (no run.json); "
                                       "waiting for it to start\n")
    assert tail(run_dir) == 0
    assert capsys.readouterr().err == f"streamprep: logs: no log at {tmp_path}/e\\x1b[31m/logs/{logs.LOG_NAME}\n"


@pytest.mark.slow
def test_logs_follow_before_the_run_dir_exists_waits_for_the_run_then_follows_its_log(tmp_path):
    """Regression: `logs RUN_DIR --follow` started before the job had written run.json exited 2, `not a streamprep
    run directory (no run.json)`; it says once that it waits for the run and follows its log when it appears
    (the job writes its log before run.json). Ctrl-C exits 0."""
    run_dir = tmp_path / "runs" / "lb"
    proc = subprocess.Popen([sys.executable, "-m", "streamprep", "logs", str(run_dir), "--follow", "--poll-interval",
                             "0.02"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    hung = threading.Timer(30, proc.kill)  # a read that never comes ends as "" (a failure), not a hung test
    hung.start()
    try:
        assert proc.stderr.readline() == f"streamprep: logs: no run at {run_dir} yet (no run.json); waiting for it " \
                                         f"to start\n"
        log_path(run_dir).parent.mkdir(parents=True)
        log_path(run_dir).write_text('{"event": "first"}\n')
        assert proc.stdout.readline() == '{"event": "first"}\n'
        (run_dir / "run.json").write_text(json.dumps({"status": "running", "config": {"datasets": []}}))
        with open(log_path(run_dir), "a") as fh:
            fh.write('{"event": "second"}\n')
        assert proc.stdout.readline() == '{"event": "second"}\n'
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(10)
        hung.cancel()
    assert rc == 0 and proc.stderr.read() == ""


@pytest.mark.parametrize("where", ["file", "under_a_file", "run_json_a_folder"])
def test_logs_follow_on_what_never_becomes_a_run_dir_is_an_error(tmp_path, capsys, where: str):
    from streamprep.cli import main

    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "d" / "run.json").mkdir(parents=True)
    path = {"file": tmp_path / "notes.txt", "under_a_file": tmp_path / "notes.txt" / "run",
            "run_json_a_folder": tmp_path / "d"}[where]
    why = {"file": "not a directory (a streamprep run directory holds run.json)",
           "under_a_file": "no such run directory", "run_json_a_folder": "not a streamprep run directory (no run.json)"}
    for args in (["logs", str(path), "--follow"], ["logs", str(path)]):
        assert main(args) == 2
        assert capsys.readouterr().err == f"streamprep: error: {path}: {why[where]}\n"
    assert main(["logs", str(tmp_path / "absent")]) == 2  # without --follow, not yet a run dir is an error as before
    assert capsys.readouterr().err == f"streamprep: error: {tmp_path / 'absent'}: no such run directory\n"
