"""Configs and cluster files that ship with the package, found by their repository path.

The repository keeps experiment configs in `configs/`, cluster files in `meshes/` and kernels
in `kernels/`. None of them is a top-level package: they install inside this one, as
`jaxrlhf.configs`, `jaxrlhf.meshes` and `jaxrlhf.kernels` (links in `jaxrlhf/` in a checkout,
the same folders in a wheel), so that no name of ours shadows another distribution's
(docs/ARCHITECTURE.md, "What installs").

A command line names a shipped file by its repository path, `configs/ppo_tiny.py` or
`meshes/cpu_8.py`. A file of that path under the working directory wins (a checkout, or a
user's own `configs/` folder); where there is none, the shipped file of that name is used. So
the README's commands run from any folder once the package is installed.
"""

from __future__ import annotations

import pathlib

PACKAGE = pathlib.Path(__file__).parent
# The repository's folders of files that a command line names by path.
FOLDERS = frozenset({"configs", "meshes"})


def resolve(path: str) -> str:
    """The file a command line's `path` names.

    Returns `path` itself where it names a file, else the shipped file where `path` is
    `configs/...` or `meshes/...` and the package holds one of that name, else `path`
    unchanged (the caller reports it missing, as given).
    """
    candidate = pathlib.Path(path)
    head = candidate.parts[0] if candidate.parts else ""  # "/" for an absolute path
    if candidate.is_file() or head not in FOLDERS:
        return path
    shipped = PACKAGE / candidate
    return str(shipped) if shipped.is_file() else path


def in_installed_package(path: str | pathlib.Path) -> bool:
    """Whether `path` lies inside an installed copy of the package (a wheel's folder in
    site-packages), where nothing may be written. A checkout's `meshes/` is not: the links in
    `jaxrlhf/` resolve to the repository's own folders."""
    return PACKAGE.resolve() in pathlib.Path(path).resolve().parents
