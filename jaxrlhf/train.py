"""`python -m jaxrlhf.train --config=configs/ppo_tiny.py [--config.key=value ...] [--workdir=DIR]`.

Multi-process (one process per host, every process runs this same command):
`... --coordinator_address=HOST:PORT --num_processes=N --process_id=I --workdir=SHARED_DIR`,
or `launch/local.sh N ...` on one machine; see jaxrlhf/distributed.py and the README.

A config that cannot work (unknown key, bad strategy, missing file, ...) is reported as one line
`error: FIELD: problem` on stderr, exit code 2, before anything compiles.
"""

import json
import os
import pathlib
import sys
import tempfile
import traceback

from absl import app, flags, logging
from ml_collections import config_flags

from jaxrlhf import cli, distributed
from jaxrlhf.backend import use_cpu_devices
from jaxrlhf.run import lock
from jaxrlhf.schema import ConfigError

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory (default: config.workdir, "
                               "else a new temporary directory; multi-process: required, and "
                               "the same directory for every process)")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "HOST:PORT of process 0 for a multi-process run, or 'auto' "
    f"(SLURM, TPU pod, Open MPI); default ${distributed.ENV_COORDINATOR}, else one process")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "processes in the job "
                                      f"(default ${distributed.ENV_NUM_PROCESSES})")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process, 0..num_processes-1 "
                                   f"(default ${distributed.ENV_PROCESS_ID})")
_HEARTBEAT = flags.DEFINE_integer("heartbeat_timeout", 15, "seconds without a heartbeat after "
                                  "which a process counts as dead and the whole job stops")
_WAIT_TIMEOUT = flags.DEFINE_float("wait_timeout", 600.0, "seconds a cross-process wait (a "
                                   "transfer, a barrier, a step's device work) may last before "
                                   "the job stops with a message naming it")


def _config_error(message, dist: distributed.DistributedConfig | None = None) -> None:
    """`error: message` in one line on stderr, exit 2 (`cli.bad_input`). Multi-process: the job
    stops at once (no exit barrier: a process whose check passed must not wait for this one)."""
    if dist is not None and dist.multi_process:
        distributed.abort(cli.error_line(message), cli.EXIT_BAD_INPUT)
    cli.bad_input(message)


def _stopped(error: Exception, dist: distributed.DistributedConfig) -> None:
    """`stopped: ...` (one or two lines: the reason, what was saved) on stderr, exit 1."""
    message = "\n".join(" ".join(line.split()) for line in str(error).splitlines())
    if dist.multi_process:
        distributed.abort(f"stopped: {message}", 1)
    print(f"stopped: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def main(argv):
    del argv
    try:
        config = _CONFIG.value
        config.algorithm  # noqa: B018 - a config file that failed to load raises on first use
    except OSError as e:
        _config_error(f"--config: {e}")
    logging.set_verbosity(logging.WARNING)  # library INFO lines would bury the progress bar
    try:
        dist = distributed.from_flags(_COORDINATOR.value, _NUM_PROCESSES.value,
                                      _PROCESS_ID.value, _HEARTBEAT.value,
                                      _WAIT_TIMEOUT.value)
        use_cpu_devices(distributed.cpu_devices_per_process(config.cpu_devices, dist))
        if dist.multi_process and not (_WORKDIR.value or config.workdir):
            raise distributed.DistributedError(
                "workdir: a multi-process run needs --workdir (one directory every process "
                "reaches: checkpoints are written by all of them)")
    except distributed.DistributedError as e:
        _config_error(e)
    distributed.initialize(dist)
    if dist.multi_process and not distributed.is_main_process():
        # Only process 0 prints progress (the others compute the same numbers), set before
        # tqdm is imported: it reads TQDM_DISABLE then.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
        os.environ["TQDM_DISABLE"] = "1"
    workdir = _WORKDIR.value or config.workdir or tempfile.mkdtemp(prefix="jaxrlhf-")
    if distributed.is_main_process():  # a busy workdir is refused before the heavy imports
        try:
            lock.make(pathlib.Path(workdir))
            lock.hold(pathlib.Path(workdir))
        except OSError as e:
            _config_error(f"workdir: {e}", dist)
        except ConfigError as e:
            _config_error(e, dist)
    # Imported only now: JAX must not start a backend before the device flags and
    # jax.distributed are set.
    from jaxrlhf.checkpoint import CheckpointError
    from jaxrlhf.run.loop import STOPS
    from jaxrlhf.run import rl
    from jaxrlhf.run.check import check_config
    from jaxrlhf.calibration.compile_check import choose

    try:
        job = choose(check_config(config, workdir))  # compiles only after every input check
        summary = rl.run(job)
    except (ConfigError, CheckpointError) as e:  # no checkpoint restores: one line as well
        _config_error(e, dist)
    except STOPS as e:  # a stop for a reason: what and what was saved, no traceback
        _stopped(e, dist)
    except Exception as e:  # noqa: BLE001 - see below
        if not dist.multi_process:
            raise
        # The others may wait in a collective with this process: leave at once (no exit
        # barrier) so that their heartbeat check stops them within seconds.
        traceback.print_exc()
        distributed.abort(distributed.failure_message(e))
    print(json.dumps(summary))


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    app.run(main, flags_parser=cli.parse_flags)
