"""Test setup: 8 fake CPU devices, fp32 matmuls, fast compiles and one compilation cache, before JAX is
imported anywhere."""

import os
import shutil
import tempfile

from jaxrlhf.backend import use_cpu_devices  # sets flags only; imports no JAX

use_cpu_devices(8)
# The suite checks behaviour and numerics (against references, with tolerances), not speed, and
# compiles hundreds of small programs once each: LLVM's optimisation is most of a tiny
# program's compile time on XLA:CPU (a GRPO smoke job: 64 -> 40 CPU s at level 0). The jobs a
# test starts in a subprocess inherit the setting; an XLA_FLAGS value the user set wins.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache for the whole test session, shared by both pytest workers
# and by every job a test starts in a subprocess (they inherit the environment): many tests
# compile the same tiny models and plans, and XLA's compiles are most of the suite's time.
# The controller process imports this file first and the workers inherit its variables, so
# they all use the controller's directory; it is removed when the session ends, so it has no
# size bound: a bound makes JAX lock the directory and, on every write, list, stat and read the
# access time of every entry to find what to evict (O(entries) per compile, under the lock that
# both workers' reads wait on). The suite writes thousands of entries (test_kernels.py alone
# 483); with 20,000 fake ones in the directory, test_kernels.py took 649 s with the bound and
# 21 s without (on loaded cores). Without the lock a process may read an entry another is still
# writing: its truncated compressed stream fails to decompress, JAX warns and compiles it
# (outputs never depend on the cache).
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxrlhf-test-xla-cache-")
    os.environ["JAXRLHF_TEST_CACHE_OWNER"] = str(os.getpid())
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

# Reference comparisons need full-precision matmuls, not the default bf16-pass on some backends.
jax.config.update("jax_default_matmul_precision", "highest")


def sandbox_or_skip():
    """The code sandbox's `Isolation` (`data/sandbox.py`: bubblewrap, Debian's `bubblewrap`,
    which `.ci/run` installs). Without it the test is skipped with one line naming the package,
    except under CI=true, where it fails."""
    from jaxrlhf.data import sandbox

    isolation = sandbox.probe()
    if isinstance(isolation, str):
        if os.environ.get("CI") == "true":
            pytest.fail(f"the sandbox {isolation}")
        pytest.skip(f"the sandbox {isolation}")
    return isolation


@pytest.fixture(scope="session")
def bwrap():
    """The code sandbox, started once (`sandbox_or_skip`)."""
    return sandbox_or_skip()


@pytest.fixture(scope="session")
def libtpu():
    """libtpu (XLA's TPU compiler, the `[tpu]` extra, which the test extra holds), quiet and
    loadable by both workers: compiling for a described TPU slice needs no TPU. Without it the
    test is skipped with one line naming the extra, except under CI=true, where it fails."""
    import importlib.util

    from jaxrlhf.calibration.targets import TPU_HOST_ENV

    if importlib.util.find_spec("libtpu") is None:
        if os.environ.get("CI") == "true":
            pytest.fail('libtpu is not installed (the test extra holds it: pip install -e ".[tpu]")')
        pytest.skip('needs libtpu: pip install -e ".[tpu]"')
    for name, value in TPU_HOST_ENV.items():
        os.environ.setdefault(name, value)


# CI installs the newest versions its ranges allow, so a release that breaks us shows at once:
# the summary names what this run tested against (also under -q).
_REPORTED = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers", "kernels",
             "tokenizers", "torch", "numpy")


def pytest_terminal_summary(terminalreporter):
    from importlib import metadata

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "absent"

    terminalreporter.write_line(
        "versions: " + ", ".join(f"{name} {version(name)}" for name in _REPORTED))


def pytest_unconfigure(config):
    if os.environ.get("JAXRLHF_TEST_CACHE_OWNER") == str(os.getpid()):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


# The modules holding the default suite's longest tests, longest first (a 2-process Slurm job
# beside a 1-process one, 2-process runs, the train main, the GPU suite's dry run: 40-100 s each
# on 2 quiet cores), run first: pytest-xdist deals tests out in collection order, and one of
# these started near the end would leave the other worker idle for its length.
_FIRST = ("test_launcher.py", "test_multiprocess.py", "test_entry_train.py", "test_gpu_suite.py")


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.devices(n)`: the test builds layouts over n devices. The default suite has 8
    (virtual CPU devices); run on a box with fewer (`JAX_PLATFORMS=cuda` on one GPU, say), such a
    test is skipped, saying why, and the rest (numerics against references) still run there.

    The modules in `_FIRST` go first, in its order, each kept whole (a stable sort)."""
    first = {name: i for i, name in enumerate(_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))
    available = jax.device_count()
    for item in items:
        marker = item.get_closest_marker("devices")
        if marker is not None and marker.args[0] > available:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {marker.args[0]} devices, {available} available"))
