"""hf:// streaming: 12 files x ~4 MB on the loopback Hub (1 MB/s per response), max_records 50: files/bytes fetched, time to first kept
record, wall. Run with PYTHONPATH=<tree> to compare trees (else this checkout's packages, ahead of an installed streamprep); the
Hub stand-in and helpers come from this repo's tests/. The run folder is removed and the Hub stopped however it ends."""
import asyncio, json, os, shutil, signal, sys, tempfile, time
from pathlib import Path
REPO = Path(__file__).resolve().parents[1]
# the repository root after PYTHONPATH's trees (sys.path[0] is this folder, then PYTHONPATH's entries), before site-packages
sys.path.insert(1 + len([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]), str(REPO))
sys.path.insert(0, str(REPO / "tests"))
from hub_server import FakeHub
from helpers import base_config, english_docs

signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`, kill: through the finally below too
hub = FakeHub().start()
tmp = Path(tempfile.mkdtemp(prefix="bench-hf-stream-"))
try:
    os.environ.update(HF_ENDPOINT=hub.url, HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="127.0.0.1,localhost")
    os.environ["HF_HOME"] = str(tmp / "hf_home")
    from huggingface_hub import constants
    constants.ENDPOINT = hub.url
    constants.HUGGINGFACE_CO_URL_TEMPLATE = hub.url + "/{repo_id}/resolve/{revision}/{filename}"
    docs = english_docs(9300, seed=1)
    files = {}
    for f in range(12):
        files[f"data/train-{f:05d}.jsonl"] = b"".join(json.dumps({"text": f"file {f} " + d}).encode() + b"\n" for d in docs)
    hub.add_dataset("org/big", files)
    total = sum(map(len, files.values()))
    hub.rate = 1_000_000
    from streamprep.config import load
    from streamprep.ingest import IngestContext, ingest_all
    raw = base_config([{"name": "big", "path": "hf://org/big", "split": "train", "max_records": 50}], None)
    raw["execution"].update(max_concurrent_downloads=4)
    conf = load(raw)

    async def main():
        ctx = IngestContext.of(conf, tmp / "run", tmp / "run/checkpoints", asyncio.Event())
        t0 = time.monotonic()
        task = asyncio.create_task(ingest_all(ctx))
        while "big" not in ctx.progress or ctx.progress["big"].kept == 0:
            if task.done():
                break
            await asyncio.sleep(0.005)
        first = time.monotonic() - t0
        at_first = len([p for p in hub.file_requests("GET") if p.startswith("data/")])
        st = (await task)["big"]
        wall = time.monotonic() - t0
        await asyncio.sleep(1.5)  # let downloads already started land, to count them
        gets = {p: n for p, n in hub.file_requests("GET").items() if p.startswith("data/")}
        print(json.dumps({"tree": os.environ.get("PYTHONPATH"), "kept": st.kept, "files_total": 12, "bytes_total": total,
                          "files_fetched": len(gets), "bytes_sent": hub.bytes_sent, "first_kept_s": round(first, 2), "files_requested_at_first_kept": at_first,
                          "ingest_wall_s": round(wall, 2)}))
    asyncio.run(main())
finally:
    hub.stop()
    shutil.rmtree(tmp, ignore_errors=True)
