"""The platform a program being traced will run on.

A call compiled ahead of time for another machine's devices (`python -m jaxrlhf.plan
--compile`: a TPU slice or a GPU cluster described on a CPU host) is traced in a process whose
default backend is the CPU, under a mesh of the target's devices. What the program may use (a
Mosaic kernel, the C++ CPU kernel, interpret mode) follows the devices it is compiled for, so
it is read off the mesh in scope (`Layout.activation_context` sets it), and only without one
off JAX's default backend.
"""

from __future__ import annotations

import jax


def platform() -> str:
    """"cpu", "gpu" or "tpu" (as `jax.Device.platform` names them) of the program being
    traced: its mesh's devices, else the default backend's."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.abstract_device is not None:
        return _canonical(mesh.abstract_device.platform)
    return _canonical(jax.default_backend())


def _canonical(name: str) -> str:
    """JAX names a CUDA device's platform "gpu" and its backend "cuda" (or "rocm")."""
    return "gpu" if name in ("cuda", "rocm") else name
