"""The unit tier (`python -m pytest -q -n 2 tests/unit`, about a minute on 2 cores) holds only
tests that start no entry point and no process: models, parallel layouts, algorithms, the
planner and engine numerics at tiny sizes. Checked on each test file's imports (read with
`ast`, those inside functions too): no process machinery (subprocess, multiprocessing, runpy,
signals), nothing of the run stack or above (`jaxrlhf.run`, `jaxrlhf.calibration`,
`jaxrlhf.cli` and the entry points of docs/ARCHITECTURE.md's top layers), so that nothing
here runs a job. Tests that do go in tests/, which the default suite runs with these."""

import ast
import pathlib

import pytest

HERE = pathlib.Path(__file__).resolve().parent
PROCESSES = ("subprocess", "multiprocessing", "runpy", "signal",
             "concurrent.futures.ProcessPoolExecutor")
RUN_STACK = ("jaxrlhf.run", "jaxrlhf.calibration", "jaxrlhf.cli", "jaxrlhf.train",
             "jaxrlhf.bench", "jaxrlhf.generate", "jaxrlhf.export", "jaxrlhf.graph",
             "jaxrlhf.plan_cli", "jaxrlhf.evaluate")


def _imports(path: pathlib.Path) -> set[str]:
    """Every module `path` imports (`from a import b` counts as a and a.b)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _under(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


@pytest.mark.parametrize("path", sorted(HERE.glob("test_*.py")), ids=lambda p: p.name)
def test_a_unit_test_starts_no_job_and_no_process(path):
    offending = sorted(name for name in _imports(path)
                       if _under(name, PROCESSES) or _under(name, RUN_STACK))
    assert not offending, f"{path.name} imports {offending}: it belongs in tests/, not tests/unit"


def test_the_rule_sees_a_job(tmp_path):
    """The check itself: a file that runs a job through the run stack is caught."""
    path = tmp_path / "test_job.py"
    path.write_text("import subprocess\n\ndef test():\n    from jaxrlhf.run import rl\n")
    assert {"subprocess", "jaxrlhf.run", "jaxrlhf.run.rl"} <= {
        name for name in _imports(path) if _under(name, PROCESSES) or _under(name, RUN_STACK)}
