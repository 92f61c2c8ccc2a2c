"""Every package the installed code imports is declared in requirements.txt.

`pip install -e .` installs requirements.txt alone (the README's first command), while the test
command also installs requirements-test.txt, whose packages pull in others (torch brings
jinja2): an import that only they satisfy passes every test and fails on a fresh machine.
"""

import ast
import importlib.metadata
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# What pyproject.toml installs, and the benchmarks, which run in an installed tree.
FOLDERS = ("jaxrlhf", "kernels", "meshes", "configs", "benchmarks")


def _name(requirement: str) -> str:
    """A distribution's normalised name (PEP 503)."""
    return re.sub(r"[-_.]+", "-", requirement).lower()


def _declared() -> set[str]:
    """requirements.txt's packages, and the optional extras' (imported only where enabled)."""
    lines = [line for name in ("requirements.txt", "requirements-wandb.txt")
             for line in (ROOT / name).read_text(encoding="utf-8").splitlines()]
    return {_name(re.match(r"[A-Za-z0-9_.-]+", line).group(0))
            for line in map(str.strip, lines) if line and not line.startswith("#")}


def _imported_modules() -> dict[str, str]:
    """Top-level module -> the first file:line importing it, over FOLDERS."""
    out = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if (path.parent / f"{top}.py").exists():
                        continue  # a script's sibling: its folder is on sys.path when it runs
                    out.setdefault(top, f"{path.relative_to(ROOT)}:{node.lineno}")
    return out


def test_every_imported_package_is_a_declared_requirement():
    providers = importlib.metadata.packages_distributions()
    undeclared = []
    for module, where in sorted(_imported_modules().items()):
        # Only `jaxrlhf` is ours at the top level: a bare `import kernels` is Hugging Face's.
        if module in sys.stdlib_module_names or module in ("jaxrlhf", "__future__"):
            continue
        dists = {_name(d) for d in providers.get(module, [module])}
        if not dists & _declared():
            undeclared.append(f"{module} (distribution {', '.join(sorted(dists))}), "
                              f"imported at {where}")
    assert not undeclared, "imported but not in requirements.txt:\n" + "\n".join(undeclared)
