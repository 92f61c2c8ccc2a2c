"""A one-node Slurm cluster in a temporary directory, for the launcher tests.

`munged`, `slurmctld` and `slurmd` from Debian's `slurm-wlm` and `munge` packages run as the
current user (root in CI) with their key, sockets, state, spool and logs under one directory,
and a short `slurm.conf` whose ports are free ones on 127.0.0.1; nothing under /etc or /run is
read or written. The node claims more CPUs than the machine has (`config_overrides`) so that a
job of 2 tasks x 2 CPUs fits on a 2-core machine. Client commands (`sbatch`, `scancel`, ...)
find the cluster through `$SLURM_CONF`, which `Cluster.env` sets.

    with Cluster.start(tmp_dir) as cluster:
        job = cluster.sbatch(["--ntasks=2", "launch/slurm.sbatch", "--config=..."])
        cluster.wait(job, timeout_s=120)

By hand: `python tests/slurm_cluster.py DIR` starts one and prints the `SLURM_CONF` to export;
Ctrl-C or SIGTERM stops it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scancel", "scontrol", "sinfo", "srun")
# The node is this machine, under its own name: jax.distributed under Slurm connects to the
# step's first node by that name.
NODE = socket.gethostname().split(".")[0]
NODE_CPUS = 8
# Seconds between the SIGTERM of a plain `scancel` and the SIGKILL that follows (Slurm: 30 by
# default; more here, for a step under way on 2 busy cores).
KILL_WAIT_S = 90
# Seconds a job step's credential is valid, which is also how long a requeued job waits before
# it may start again (Slurm: 120 by default). A step starts well within this on one node.
CRED_EXPIRE_S = 10
# Seconds between the scheduler's passes over every pending job (Slurm: 60), which is what
# starts a requeued job once its wait is over: no event does.
SCHED_INTERVAL_S = 1
# A job that ended stays visible to `scontrol show job` this long (its state and exit code).
MIN_JOB_AGE_S = 600
FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
            "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


# The daemons live in /usr/sbin, which a user's PATH may lack.
PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def missing_binaries() -> list[str]:
    """The Slurm and munge programs this machine lacks (empty: a cluster can start)."""
    return [name for name in DAEMONS + CLIENTS if shutil.which(name, path=PATH) is None]


def _free_port() -> int:
    # The daemons bind their ports themselves a moment later; unlike JAX's servers they do not
    # use SO_REUSEPORT, so a port taken meanwhile makes the start fail loudly, never shared.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _slurm_conf(root: pathlib.Path, munge_socket: pathlib.Path) -> str:
    user, host = Cluster.job_user(), socket.gethostname()
    return f"""\
ClusterName=jaxrlhf-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
AuthInfo=socket={munge_socket},cred_expire={CRED_EXPIRE_S}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval={SCHED_INTERVAL_S}
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
KillWait={KILL_WAIT_S}
MinJobAge={MIN_JOB_AGE_S}
InactiveLimit=0
NodeName={NODE} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} State=UNKNOWN
PartitionName=test Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
"""


@dataclasses.dataclass
class Cluster:
    """A running one-node cluster; `stop` (or leaving the `with`) ends its daemons."""

    root: pathlib.Path
    conf: pathlib.Path
    procs: list[subprocess.Popen]

    @property
    def env(self) -> dict[str, str]:
        """The environment for client commands (and the jobs they submit)."""
        return {**os.environ, "PATH": PATH, "SLURM_CONF": str(self.conf)}

    @classmethod
    def start(cls, root: pathlib.Path, timeout_s: float = 60) -> "Cluster":
        """Starts munged, slurmctld and slurmd under `root`; returns once the node is idle."""
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o700)  # munged refuses a key or socket directory others can write
        for sub in ("state", "spool", "munge"):
            (root / sub).mkdir(exist_ok=True)
        key = root / "munge/munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        munge_socket = root / "munge/munge.socket"
        conf = root / "slurm.conf"
        conf.write_text(_slurm_conf(root, munge_socket))
        cluster = cls(root, conf, [])
        logs = open(root / "daemons.out", "ab")  # noqa: SIM115 - kept by the daemons
        commands = (
            ["munged", "--foreground", "--force", f"--socket={munge_socket}",
             f"--key-file={key}", f"--pid-file={root}/munge/munged.pid",
             f"--log-file={root}/munge/munged.log", f"--seed-file={root}/munge/munged.seed"],
            ["slurmctld", "-D", "-i", "-f", str(conf)],
            ["slurmd", "-D", "-N", NODE, "-f", str(conf)],
        )
        try:
            for command in commands:
                cluster.procs.append(subprocess.Popen(
                    command, stdout=logs, stderr=subprocess.STDOUT, env=cluster.env,
                    start_new_session=True))  # a Ctrl-C in the test's terminal is not theirs
                if command[0] == "munged":
                    cluster._wait_for(munge_socket.exists, timeout_s, "munged's socket")
            cluster._wait_for(cluster._node_idle, timeout_s, f"node {NODE} to be idle")
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _node_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-n", NODE, "-o", "%T"], env=self.env,
                             capture_output=True, text=True)
        return out.returncode == 0 and out.stdout.strip() == "idle"

    def _wait_for(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"slurm test cluster: no {what} after {timeout_s} s"
                                   f"{f' ({dead} exited)' if dead else ''}; logs in {self.root}:"
                                   f"\n{self.logs()}")
            time.sleep(0.2)

    def logs(self, tail: int = 40) -> str:
        """The last lines of every daemon's log (for failure messages)."""
        parts = []
        for name in ("daemons.out", "munge/munged.log", "slurmctld.log", "slurmd.log"):
            path = self.root / name
            if path.exists():
                lines = path.read_text(errors="replace").splitlines()[-tail:]
                parts.append(f"--- {name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def run(self, *command: str, check: bool = True) -> str:
        """A client command's stdout (raises with its stderr when it fails and `check`)."""
        out = subprocess.run(command, env=self.env, capture_output=True, text=True)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({out.returncode}): {out.stderr}")
        return out.stdout

    def sbatch(self, args: list[str], cwd: pathlib.Path, env: dict[str, str] | None = None
               ) -> int:
        """Submits a batch job from `cwd`; its job id."""
        out = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, capture_output=True,
                             text=True, env={**self.env, **(env or {})})
        if out.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {out.stderr}")
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, ExitCode, StdOut, ...)."""
        text = self.run("scontrol", "show", "job", "-o", str(job_id))
        return dict(field.split("=", 1) for field in text.split() if "=" in field)

    def wait(self, job_id: int, timeout_s: float, until=FINISHED) -> dict[str, str]:
        """Waits for the job to reach one of the states `until`; its fields then."""
        deadline = time.monotonic() + timeout_s
        while True:
            fields = self.job(job_id)
            if fields["JobState"] in until:
                return fields
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {fields['JobState']} after {timeout_s} s")
            time.sleep(0.5)

    def stop(self) -> None:
        """Cancels every job, then stops the daemons (slurmd, slurmctld, munged, in that order)."""
        if all(p.poll() is None for p in self.procs[1:]):
            self.run("scancel", "--signal=KILL", "--full", "--user", self.job_user(), check=False)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs = []

    @staticmethod
    def job_user() -> str:
        return pwd.getpwuid(os.getuid()).pw_name

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        sys.exit(f"usage: {argv[0]} DIR   (starts a one-node cluster; Ctrl-C stops it)")
    if missing := missing_binaries():
        sys.exit(f"not installed: {', '.join(missing)} (apt-get install slurm-wlm munge)")
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM):  # SIGINT is ignored in a background job
        signal.signal(signum, interrupt)
    with Cluster.start(pathlib.Path(argv[1]).resolve()) as cluster:
        print(f"export SLURM_CONF={cluster.conf}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()


if __name__ == "__main__":
    main(sys.argv)
