"""The feeder prepares the configured tokenizer in its own thread while ingest starts: parts sealed before it is
ready wait for it and go out in order, and a tokenizer that cannot be prepared fails the job at the next
checkpoint rather than after the whole ingest."""
from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

from streamprep import tokenizer as tokmod
from streamprep.checkpoints import DatasetFiles, IngestState
from streamprep.feeder import ShardFeeder


class _Engine:
    def __init__(self) -> None:
        self.submitted: list[Any] = []

    def submit(self, task: Any) -> None:
        self.submitted.append(task)


def _state(parts: int) -> IngestState:
    state = IngestState("d")
    state.part_index, state.sealed = parts, [[f"sha{i}", 1] for i in range(parts)]
    return state


@dataclass(frozen=True)
class _Task:  # a ShardTask's fields the feeder reads or sets
    info: Any
    part: str
    sha: str
    check_input: bool = False


def _feeder(tmp_path: Path, given: Any) -> tuple[ShardFeeder, _Engine]:
    engine = _Engine()
    plan = lambda name, part, sha, info: _Task(info=info, part=part.name, sha=sha)  # noqa: E731 - a ShardTask
    feeder = ShardFeeder(engine, plan, {"d": DatasetFiles(tmp_path, tmp_path / "ck", "d")}, given,  # type: ignore[arg-type]
                         lambda states: pytest.fail("trained although a tokenizer was given"), None)
    return feeder, engine


def test_parts_sealed_before_the_given_tokenizer_is_ready_wait_for_it_in_order(tmp_path: Path) -> None:
    ready = threading.Event()

    def given(wait: Any) -> str:
        ready.wait(10)
        return "tok"

    feeder, engine = _feeder(tmp_path, given)
    try:
        feeder.on_checkpoint(_state(2))  # ingest goes on while the tokenizer is prepared
        feeder.on_checkpoint(_state(3))
        assert engine.submitted == [] and feeder.info is None
        ready.set()
        assert feeder.finish({"d": _state(3)}) == "tok"
    finally:
        feeder.close()
    assert [(t.info, t.part, t.sha) for t in engine.submitted] == [("tok", f"part-{i:05d}.jsonl", f"sha{i}")
                                                                   for i in range(3)]
    # the first call's parts are the resume's, their hashes read back from the sealed log: the worker checks them
    assert [t.check_input for t in engine.submitted] == [True, True, False]


def test_a_tokenizer_that_cannot_be_prepared_fails_at_the_next_checkpoint(tmp_path: Path) -> None:
    def given(wait: Any) -> str:
        raise RuntimeError("tokenizer.backend is gigatoken but it cannot load tokenizer.json")

    feeder, engine = _feeder(tmp_path, given)
    try:
        with pytest.raises(RuntimeError, match="cannot load"):
            feeder._given.exception(10)  # prepared (and failed) in the feeder's thread
            feeder.on_checkpoint(_state(1))
        with pytest.raises(RuntimeError, match="cannot load"):
            feeder.finish({"d": _state(1)})
    finally:
        feeder.close()
    assert engine.submitted == []


def test_a_close_ends_the_given_tokenizers_wait_for_a_worker_that_does_not_answer(tmp_path: Path) -> None:
    """Regression: the backend check's wait for a worker (a Xenna stage still starting) had no stop check, so a
    SIGTERM during it waited ~30 s in the feeder's close (and was aborted by Ray's crash handler 3 s in)."""
    waiting = threading.Event()
    never: Future = Future()  # a worker's call that is not answered

    def given(wait: Any) -> str:
        waiting.set()
        return wait(never)

    feeder, engine = _feeder(tmp_path, given)
    assert waiting.wait(10)
    t0 = time.monotonic()
    feeder.close()
    assert time.monotonic() - t0 < 2.0
    assert isinstance(feeder._given.exception(0), CancelledError) and feeder.info is None and engine.submitted == []


def test_the_given_tokenizers_wait_returns_a_workers_answer(tmp_path: Path) -> None:
    answered: Future = Future()
    threading.Timer(0.3, answered.set_result, ("tok",)).start()  # after a few polls
    feeder, _ = _feeder(tmp_path, lambda wait: wait(answered))
    try:
        assert feeder.finish({"d": _state(0)}) == "tok"
    finally:
        feeder.close()


# ---- the training sample (tokenizer.train.sample_mb): read from sealed parts only ----------------------------
def test_the_sample_waits_for_its_share_in_sealed_parts_not_in_staged_lines() -> None:
    """Regression: kept text still staged (open lines, in no part yet) counted toward the share, so training
    started and then opened a part that did not exist (FileNotFoundError in a resumed run's training)."""
    state = IngestState("d", kept_text_bytes=1000, part_index=1, part_lines=3, part_bytes=700)
    assert state.sealed_text_bytes() == 300
    assert not tokmod.sample_ready({"d": 500}, {"d": state.sealed_text_bytes()}, {"d": False})
    state.part_index, state.part_lines, state.part_bytes = 2, 0, 0  # the open lines were sealed
    assert tokmod.sample_ready({"d": 500}, {"d": state.sealed_text_bytes()}, {"d": False})


def test_the_sample_never_opens_the_part_after_its_share(tmp_path: Path) -> None:
    """Regression: a share completed by the last text of a sealed part opened the next (unsealed) part."""
    texts = ["alpha " * 10, "beta " * 10, "gamma " * 10]
    (tmp_path / "part-00000.jsonl").write_bytes(b"".join(orjson.dumps({"text": t}) + b"\n" for t in texts))
    parts = [tmp_path / "part-00000.jsonl", tmp_path / "part-00001.jsonl"]  # the second does not exist
    share = sum(len(t.encode()) for t in texts)
    assert list(tokmod.sample_texts({"d": parts}, {"d": share})) == texts
    assert list(tokmod.sample_texts({"d": parts}, {"d": share - 1})) == texts
    assert list(tokmod.sample_texts({"d": parts}, {"d": len(texts[0].encode())})) == texts[:1]
    assert list(tokmod.sample_texts({"d": parts}, {"d": 0})) == []
    with pytest.raises(FileNotFoundError):  # a share the sealed parts do not hold is an error, not a short sample
        list(tokmod.sample_texts({"d": parts}, {"d": share + 1}))
