"""`placement.compile_check`: a run with `placement.kind=auto` believes the compiler.

The planner's search ranks plans by its cost and memory models; the models are predictions
(docs/ARCHITECTURE.md, "Plans"). With the key on, after every input check has passed
(`run/check.py`, which resolved and checked the best few searched plans as `Job.fallbacks`),
the run compiles every call of those plans for its own devices, best first, prints the table
`python -m jaxrlhf.plan --compile` prints for each (`calibration/aot.py`: XLA's peak bytes per
device beside the memory model's, FLOPs, kernels, compile seconds) and runs the first plan whose
every call fits by XLA's account. Nothing is compiled before the input checks, so bad input
still exits 2 in one line first; without the key nothing here runs.

The limit a program may use is the cluster file's usable memory per device
(`placement.cluster`, which the search priced), or less where the devices report less (their
`memory_stats()["bytes_limit"]`; CPU devices report none).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax

from jaxrlhf.calibration import aot
from jaxrlhf.plan.allocation import format_allocation
from jaxrlhf.plan.cluster import Cluster, load_cluster
from jaxrlhf.run.check import Job
from jaxrlhf.schema import ConfigError



def _size(num_bytes: float) -> str:
    """"1.68 GiB", or "3.9 MiB" below a GiB (tiny models' calls)."""
    return (f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30
            else f"{num_bytes / 2**20:.1f} MiB")


def limit_bytes(cluster: Cluster, devices: Sequence[jax.Device]) -> int:
    """What a program may use per device: the cluster file's usable memory, or the device's own
    limit where it reports a smaller one."""
    reported = (devices[0].memory_stats() or {}).get("bytes_limit")
    return min(cluster.usable_hbm_bytes, reported or cluster.usable_hbm_bytes)


def choose(job: Job, limit: int | None = None,
           log: Callable[[str], None] = lambda line: print(line, flush=True)) -> Job:
    """The job on the first of its searched plans (itself, then `job.fallbacks`) whose every
    call fits `limit` bytes per device (default `limit_bytes`) by XLA's account, compiled for
    this job's devices; `job` itself without `placement.compile_check`.

    Raises:
      ConfigError: no plan fits by XLA's account (one line: the best plan's largest call).
    """
    spec = job.spec
    if not spec.placement.compile_check:
        return job
    cluster, devices = load_cluster(spec.placement.cluster), jax.devices()
    limit = limit_bytes(cluster, devices) if limit is None else limit
    jobs = [job, *job.fallbacks]
    log(f"compile check: {len(jobs)} searched plans, best first, compiled for this job's "
        f"{len(devices)} {devices[0].platform.upper()} devices until one fits "
        f"{_size(limit)} a device by XLA's account")
    index, reports = aot.first_that_fits(
        spec, cluster, [(f"plan {i + 1}: placement.allocation={format_allocation(j.plan.plan)}",
                         j.plan.plan) for i, j in enumerate(jobs)], devices, limit, log)
    if not all(r.fits for r in reports):
        worst = max(reports, key=lambda r: (not r.compiled, r.xla_bytes))
        what = (f"did not compile ({worst.error})" if not worst.compiled else
                f"needs {_size(worst.xla_bytes)} a device by XLA's account")
        raise ConfigError(
            f"placement.compile_check: none of the {len(jobs)} best searched plans fits "
            f"{_size(limit)} a device ({spec.placement.cluster}'s usable memory): in the "
            f"best, {worst.name} ({worst.spec}) {what}")
    log(f"compile check: running plan {index + 1}")
    return dataclasses.replace(jobs[index], fallbacks=())
