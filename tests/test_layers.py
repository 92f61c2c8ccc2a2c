"""The layers of docs/ARCHITECTURE.md, enforced on the import graph (module- and function-level
imports).

Every `import` statement of the library is read with `ast` (also those inside functions, which
run later but are dependencies all the same). Checked: no import cycles between files; the
library never imports `configs/` or `meshes/` (`jaxrlhf.configs`, `jaxrlhf.meshes`: the
repository's folders install inside the package); each layer imports only its own layer and
the layers below it (models < parallel < engine < algorithms < data < dataflow < planner < ... <
run stack < entry points), with no exception for any file; `meshes/` holds data (cluster files
import only the planner).

A package's `__main__.py` is what `python -m PACKAGE` runs, so Python wants it inside the
package's folder; it is an entry point's hook, not part of that package. It counts as an entry
point, and `test_main_hooks_only_forward` holds it to forwarding (one import of an entry-point
module, one call), so that nothing of its folder's layer lives there.
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

ENTRY = 11  # the entry points' layer, the top
# Layer of each top-level part of the library, bottom up: a module imports only modules of
# its own part or of a lower layer.
LAYERS = {
    "jaxrlhf.kernels": 0, "jaxrlhf.models": 0, "jaxrlhf.mfc": 0,
    "jaxrlhf.backend": 0, "jaxrlhf.shipped": 0, "jaxrlhf": 1,  # the package exports MFC and Call
    "jaxrlhf.parallel": 1,
    "jaxrlhf.engine": 2,
    "jaxrlhf.algorithms": 3, "jaxrlhf.schema": 3,  # the algorithms own sections of it
    "jaxrlhf.data": 4,
    "jaxrlhf.dataflow": 5,
    "jaxrlhf.plan": 6, "jaxrlhf.perf": 6,
    "jaxrlhf.checkpoint": 7, "jaxrlhf.metrics": 7, "jaxrlhf.distributed": 7,
    "jaxrlhf.fingerprint": 7,
    "jaxrlhf.spec": 8,
    "jaxrlhf.restore": 9,  # a role's parameters read back from a run's checkpoint
    "jaxrlhf.run": 9,
    "jaxrlhf.calibration": 10, "jaxrlhf.cli": 10,
    # entry points: flags -> spec -> run
    "jaxrlhf.train": ENTRY, "jaxrlhf.bench": ENTRY, "jaxrlhf.generate": ENTRY,
    "jaxrlhf.export": ENTRY, "jaxrlhf.graph": ENTRY, "jaxrlhf.plan_cli": ENTRY,
    "jaxrlhf.evaluate": ENTRY,
}
# The repository's folders and the modules they hold once installed: kernels/ and meshes/
# install inside the package (through the links jaxrlhf/kernels, jaxrlhf/meshes, which the
# walk of jaxrlhf/ does not follow).
FOLDERS = {"jaxrlhf": "jaxrlhf", "kernels": "jaxrlhf.kernels", "meshes": "jaxrlhf.meshes"}
CONFIGS, MESHES = "jaxrlhf.configs", FOLDERS["meshes"]


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            inside = path.relative_to(ROOT / folder)
            if any((ROOT / folder / up).is_symlink() for up in inside.parents):
                continue
            parts = list(inside.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def _imports(path: pathlib.Path) -> set[str]:
    """Modules of this repository `path` imports anywhere in it (a name imported from a
    package that is one of its submodules counts as that submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return {m for m in found if m.split(".")[0] == "jaxrlhf"}


GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def _within(module: str, part: str) -> bool:
    return module == part or module.startswith(part + ".")


def _is_hook(module: str) -> bool:
    """A package's `__main__`: the hook of `python -m PACKAGE`."""
    return module.endswith(".__main__")


def _layer(module: str) -> tuple[str, int]:
    """(the LAYERS key `module` falls under, its layer): the longest matching key; a package's
    `__main__` is an entry point (itself its key)."""
    if _is_hook(module):
        return module, ENTRY
    keys = [k for k in LAYERS if module == k or module.startswith(k + ".")]
    if not keys:
        raise AssertionError(f"{module} is in no layer of tests/test_layers.py")
    key = max(keys, key=len)
    return key, LAYERS[key]


def test_no_import_cycles_between_files():
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(GRAPH.get(node, ())):
            if nxt not in GRAPH:
                continue
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(GRAPH):
        if node not in state:
            visit(node)


def test_library_never_imports_configs_or_meshes():
    bad = {m: sorted(i for i in imps if _within(i, CONFIGS) or _within(i, MESHES))
           for m, imps in GRAPH.items() if not _within(m, MESHES)}
    assert not {m: i for m, i in bad.items() if i}


def test_meshes_hold_data():
    for module, imports in GRAPH.items():
        if _within(module, MESHES):
            assert all(_within(i, "jaxrlhf.plan") for i in imports), (module, imports)


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if not _within(m, MESHES)))
def test_imports_point_down(module):
    key, layer = _layer(module)
    up = sorted(i for i in GRAPH[module] if i in MODULES and _layer(i)[1] > layer
                and not i.startswith(key + "."))
    assert not up, f"{module} (layer {layer}) imports from above: {up}"


def test_the_planner_never_imports_the_run_stack():
    above = ("jaxrlhf.run", "jaxrlhf.calibration", "jaxrlhf.spec", "jaxrlhf.train",
             "jaxrlhf.plan_cli")
    for module, imports in GRAPH.items():
        if _within(module, "jaxrlhf.plan") and not _is_hook(module):
            bad = [i for i in imports if any(_within(i, a) for a in above)]
            assert not bad, (module, bad)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _is_hook(m)))
def test_main_hooks_only_forward(module):
    """A `__main__.py` holds a docstring, one `from <entry point> import f` and
    `if __name__ == "__main__": f()`: the command line itself lives in the entry point."""
    body = ast.parse(MODULES[module].read_text()).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    imports = [n for n in body if isinstance(n, ast.ImportFrom)]
    assert len(imports) == 1 and len(imports[0].names) == 1, f"{module}: one import only"
    (target,) = GRAPH[module]
    assert not _is_hook(target) and _layer(target)[1] == ENTRY, (module, target)
    guard = [n for n in body if n not in imports]
    assert len(guard) == 1 and isinstance(guard[0], ast.If), f"{module}: one guarded call only"
    (call,) = guard[0].body
    assert ast.unparse(call) == f"{imports[0].names[0].name}()", (module, ast.unparse(call))


def test_nothing_imports_a_main_hook():
    assert not {m: sorted(filter(_is_hook, imps)) for m, imps in GRAPH.items()
                if any(map(_is_hook, imps))}


def test_the_code_cites_documents_of_the_repository():
    """A `*.md` file named in the library, its tests or configs exists in this repository."""
    missing = set()
    for folder in ("jaxrlhf", "kernels", "configs", "meshes", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            for cited in re.findall(r"[\w./-]+\.md\b", path.read_text()):
                if not (ROOT / cited).is_file():
                    missing.add(f"{path.relative_to(ROOT)}: {cited}")
    assert (ROOT / "docs/ARCHITECTURE.md").is_file() and not missing, sorted(missing)


# --- the rollout engine's slots have one driver -------------------------------------------------

SCHEDULER = "jaxrlhf.engine.rollout.scheduler"
SLOT_METHODS = ("fill", "advance", "poll", "compact", "reload", "abort")
# Calls of those names in the library that are no Rollout's: (module, the call's target).
NOT_A_ROLLOUT = {
    ("jaxrlhf.checkpoint", "self._manager.reload"),  # orbax's CheckpointManager
    ("jaxrlhf.data.sandbox", "select.poll"),  # the select module's poll object
    ("jaxrlhf.data.sandbox", "poller.poll"),
    ("jaxrlhf.data.rewards", "self._wake_r.poll"),  # a multiprocessing Connection
    ("jaxrlhf.run.channel", "distributed.abort"),  # a multi-process job's
    ("jaxrlhf.run.remote_weights", "distributed.abort"),
    ("jaxrlhf.train", "distributed.abort"),
}


def _slot_calls(module: str) -> list[str]:
    """The calls `X.fill(...)`, `X.advance(...)`, ... (SLOT_METHODS) in `module`, as written."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    return [ast.unparse(node.func) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in SLOT_METHODS]


def test_only_the_scheduler_drives_the_rollout_slots():
    """Only `engine/rollout/scheduler.py` calls a Rollout's fill, advance, poll, compact,
    reload or abort (the sync call, the async worker and multi-turn trajectories are its
    users). A call of one of those names on something else goes in NOT_A_ROLLOUT."""
    found = {name.rsplit(".", 1)[1] for name in _slot_calls(SCHEDULER)}
    assert found == set(SLOT_METHODS), found  # the scan sees the scheduler's own calls
    others = {(m, call) for m in MODULES if m != SCHEDULER and not _within(m, MESHES)
              for call in _slot_calls(m)}
    assert others <= NOT_A_ROLLOUT, sorted(others - NOT_A_ROLLOUT)


def test_the_rollout_package_is_in_modules_of_one_concept():
    """No file of `jaxrlhf/engine/rollout/` over 550 lines, no function in it over 80."""
    for path in sorted((ROOT / "jaxrlhf/engine/rollout").glob("*.py")):
        text = path.read_text()
        assert len(text.splitlines()) <= 550, path.name
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno - node.lineno < 80, f"{path.name}: {node.name}"
