"""A test module run as the processes of one `jax.distributed` job on this machine."""

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def run_processes(script: str, count: int, timeout: float = 180, args: tuple[str, ...] = ()
                  ) -> list[tuple[subprocess.Popen, str, str]]:
    """Runs `python script ADDRESS I *args` for I in 0..count-1, CPU only and without the test
    session's XLA_FLAGS (each process takes its own device count), over a coordinator port
    held for them (`distributed.reserve_port`); each one's (process, stdout, stderr), after all
    ended. Past `timeout` seconds the ones still running are killed (and the wait raises)."""
    from jaxrlhf.distributed import reserve_port

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    with reserve_port() as sock:
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        procs = [subprocess.Popen([sys.executable, script, address, str(i), *args], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(count)]
        try:
            results = [p.communicate(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return [(p, out, err) for p, (out, err) in zip(procs, results)]
