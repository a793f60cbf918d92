"""The Ray head of a job that starts its own cluster, as its own process:
`python -m streamprep.ray_head NUM_CPUS NICENESS`, niced and under the idle scheduling policy.

In its own process the start-up can be abandoned: a job that finished before Ray came up kills this
process group at once, where an in-process `ray.init` can be neither interrupted nor killed under the
driver (its core worker ends the whole process once the GCS it waits for is gone). It prints the GCS
address and the cluster's session dir (which the driver removes with it) as its only stdout line, then holds
the cluster until its stdin closes: the driver closing it, or dying.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from streamprep.ray_cluster import HEAD_TMP_PREFIX, init_here, shutdown_ray


def main() -> None:
    num_cpus, niceness = int(sys.argv[1]), int(sys.argv[2])
    os.nice(niceness)  # before Ray starts: every process of the cluster inherits it
    if hasattr(os, "SCHED_IDLE"):  # Linux: and runs only on cycles no other process wants. Niced alone, its ~20
        # processes still took ~4 CPU-s of start-up from the job's workers (a fifth of a 300 MB job on 2 cores)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    address_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever Ray prints goes to stderr; stdout carries the address alone
    ctx = init_here(num_cpus)
    try:
        address_out.write(f"{ctx.address_info['gcs_address']} {ctx.address_info.get('session_dir', '')}\n")
        address_out.flush()
        sys.stdin.read()  # EOF: the driver is done with the cluster (or gone)
    except BrokenPipeError:  # the driver died while the cluster came up (kill -9): its session dir and this
        pass               # process's TMPDIR were left behind, the error skipping what follows
    shutdown_ray()
    tmp = Path(os.environ.get("TMPDIR", ""))
    if tmp.name.startswith(HEAD_TMP_PREFIX):  # the driver removes it too, unless it was killed (kill -9)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
