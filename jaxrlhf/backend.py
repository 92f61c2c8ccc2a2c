"""Process-level backend settings that must be made before JAX starts a backend."""

import os

# XLA:CPU aborts the process when one virtual device's thread reaches a collective more than
# 40 s (its default) after the others. On an oversubscribed host (8 virtual devices on 2 busy
# cores) that is load, not a deadlock: the test suite lost a worker to it in this session's
# CI run. Still a deadline, only a longer one; cross-process waits have their own.
COLLECTIVE_TERMINATE_S = 600


def _add_flag(name: str, value) -> None:
    """Appends --name=value to XLA_FLAGS unless the user set that flag already."""
    flags = os.environ.get("XLA_FLAGS", "")
    if name not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --{name}={value}".strip()


def use_cpu_devices(count: int) -> None:
    """Gives the CPU backend `count` virtual devices (no effect on GPU/TPU devices).

    XLA reads the flags when the CPU backend starts, so entry points call this first; an
    XLA_FLAGS value the user set explicitly wins.
    """
    _add_flag("xla_force_host_platform_device_count", count)
    _add_flag("xla_cpu_collective_call_terminate_timeout_seconds", COLLECTIVE_TERMINATE_S)
