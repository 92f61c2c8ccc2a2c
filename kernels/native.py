"""This package's C++ kernels for XLA:CPU (XLA FFI handlers): compiled for the host on first
use, kept, and loaded from there by every later process.

Why at first use and not at install: `pip install` stays pure Python, and the library is built
for the host's own instruction set (`-march=native`: AVX-512 where the CPU has it), which a
wheel built elsewhere could not be. It is kept in a folder per host (`host_key`) and named by
a hash of its source, the compiler, the flags and jaxlib's FFI headers, so a changed kernel or a
new jaxlib builds anew and a home folder shared by several CPU generations hands no node a
library it cannot run.

Where: `$JAXRLHF_KERNEL_CACHE`, else `$XDG_CACHE_HOME/jaxrlhf/kernels`, else
`~/.cache/jaxrlhf/kernels` (readable by its owner only, `host_folder`). The compiler: `$CXX`,
else the first of c++, g++, clang++ on PATH.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import time

FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
# A build takes ~10 s on 2 cores; another process building the same library is waited for
# this long at most.
BUILD_TIMEOUT_S = 600


class BuildError(RuntimeError):
    """A kernel could not be built on this host (no compiler, or the compiler failed)."""


def host_key() -> str:
    """This host's machine and instruction-set extensions, as a folder name: `x86_64-<hash>`.

    Why: compilers targeting the host (XLA:CPU, `-march=native` here) use its own extensions
    (AVX-512, AMX, ...), and a home folder shared by nodes of several CPU generations (a
    cluster's NFS home) would hand a binary built on one to another that cannot run its
    instructions."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    identity = " ".join(sorted(flags.partition(":")[2].split())) or platform.processor()
    return f"{platform.machine()}-{hashlib.sha256(identity.encode()).hexdigest()[:12]}"


def host_folder(root: pathlib.Path) -> pathlib.Path:
    """`root / host_key()`, made where missing, it and `root` readable by their owner only:
    whoever can write there can make this process run code (a kernel here, an executable in
    JAX's compilation cache)."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder = root / host_key()
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


def cache_root() -> pathlib.Path:
    """The folder that keeps built kernels (module docstring)."""
    if os.environ.get("JAXRLHF_KERNEL_CACHE"):
        return pathlib.Path(os.environ["JAXRLHF_KERNEL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return pathlib.Path(base).expanduser() / "jaxrlhf" / "kernels"


def compiler() -> str | None:
    """The C++ compiler's path, None if there is none."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _library_path(source: pathlib.Path, cxx: str) -> pathlib.Path:
    import jax

    version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    # The FFI headers the library compiles against (they change with jaxlib).
    headers = sorted((pathlib.Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api").glob("*.h"))
    identity = "\0".join([source.read_text(), cxx, version, " ".join(FLAGS),
                          *(h.read_text() for h in headers)])
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return cache_root() / host_key() / f"{source.stem}-{digest}.so"


def _lock(path: pathlib.Path, deadline: float):
    """`path` opened and exclusively locked, waiting until `deadline` at most."""
    import fcntl  # POSIX only: imported where a build needs it

    handle = open(path, "w")
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                handle.close()
                raise BuildError(f"another process held {path} for over {BUILD_TIMEOUT_S} s"
                                 ) from e
            time.sleep(0.2)


def build(source: pathlib.Path) -> pathlib.Path:
    """The shared library of `source` for this host: built, or kept from an earlier build.

    Raises:
      BuildError: no compiler, or it failed (the message ends with its last error lines).
    """
    import jax

    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler on PATH (c++, g++ or clang++; or set CXX)")
    library = _library_path(source, cxx)
    if library.exists():
        return library
    host_folder(cache_root())
    # One process builds; the others wait for its library.
    with _lock(library.with_suffix(".lock"), time.monotonic() + BUILD_TIMEOUT_S):
        if library.exists():
            return library
        logging.info("compiling %s for this host, once (kept in %s)", source.name, library.parent)
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        command = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(source), "-o", str(partial)]
        try:
            result = subprocess.run(command, capture_output=True, text=True,
                                    timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise BuildError(f"{cxx} took over {BUILD_TIMEOUT_S} s on {source.name}") from e
        if result.returncode != 0:
            partial.unlink(missing_ok=True)
            errors = [line for line in result.stderr.splitlines() if "error" in line][-3:]
            raise BuildError(f"{cxx} failed on {source.name}: " + " | ".join(errors))
        os.replace(partial, library)  # whole or absent: a reader never loads a partial file
    return library
