"""The Ray head of a job that starts its own cluster, as its own process:
`python -m streamprep.ray_head NUM_CPUS NICENESS`, niced and under the idle scheduling policy.

In its own process the start-up can be abandoned: a job that finished before Ray came up kills this
process group at once, where an in-process `ray.init` can be neither interrupted nor killed under the
driver (its core worker ends the whole process once the GCS it waits for is gone). It prints the GCS
address as its only stdout line, then holds the cluster until its stdin closes: the driver closing it,
or dying.
"""
from __future__ import annotations

import os
import sys

from streamprep.ray_cluster import init_here, shutdown_ray


def main() -> None:
    num_cpus, niceness = int(sys.argv[1]), int(sys.argv[2])
    os.nice(niceness)  # before Ray starts: every process of the cluster inherits it
    if hasattr(os, "SCHED_IDLE"):  # Linux: and runs only on cycles no other process wants. Niced alone, its ~20
        # processes still took ~4 CPU-s of start-up from the job's workers (a fifth of a 300 MB job on 2 cores)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    address_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever Ray prints goes to stderr; stdout carries the address alone
    ctx = init_here(num_cpus)
    address_out.write(ctx.address_info["gcs_address"] + "\n")
    address_out.flush()
    sys.stdin.read()  # EOF: the driver is done with the cluster (or gone)
    shutdown_ray()


if __name__ == "__main__":
    main()
