"""The algorithm registry (`jaxrlhf/algorithms/registry.py`): an algorithm is one module of
`jaxrlhf/algorithms/`, and nothing outside that folder names one.

Read with `ast` as `tests/test_layers.py` reads imports: outside `jaxrlhf/algorithms/`, a
module names an algorithm when it holds a string (docstrings aside) equal to a registered
name, a string with a key of an algorithm's own section ("dapo.oversample"), an attribute of
such a section (`config.gspo`), the old `AlgorithmName` enum, or an import of a module that
registers algorithms. The shared policy-gradient section `ppo` (`jaxrlhf/schema.py`, read by the RL
algorithms) is a section, not an algorithm: its keys and attribute are free to use.
"""

import ast
import pathlib
import re

import pytest

from jaxrlhf.algorithms import registry
from jaxrlhf.schema import ConfigError, _shared, base_config
from jaxrlhf.spec import run_spec

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALGORITHMS = ROOT / "jaxrlhf" / "algorithms"
# Strings equal to an algorithm's name that name something else: (module, the string).
NOT_AN_ALGORITHM = {
    ("jaxrlhf.schema", "ppo"),  # the key of the shared policy-gradient section
    ("jaxrlhf.data.datasets", "sft"),  # the warm start's dataset kind
}


def _library() -> dict[str, pathlib.Path]:
    """Module name -> file of every library module outside `jaxrlhf/algorithms/` (the links
    `jaxrlhf/kernels`, `configs`, `meshes` lead out of the package and are not followed)."""
    out = {}
    for path in (ROOT / "jaxrlhf").rglob("*.py"):
        inside = path.relative_to(ROOT / "jaxrlhf")
        if path.is_relative_to(ALGORITHMS) or (ROOT / "jaxrlhf" / inside.parts[0]).is_symlink():
            continue
        parts = ["jaxrlhf", *inside.with_suffix("").parts]
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _registering_modules() -> set[str]:
    """The modules of `jaxrlhf/algorithms/` that register algorithms."""
    return {f"jaxrlhf.algorithms.{p.stem}" for p in ALGORITHMS.glob("*.py")
            if re.search(r"^ALGORITHMS\b", p.read_text(), re.M)}


def _docstrings(tree: ast.Module) -> set[ast.AST]:
    """The docstrings' nodes: prose, which may speak of an algorithm."""
    return {node.body[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}


def _namings(module: str, path: pathlib.Path) -> list[str]:
    """Where `module` names an algorithm (see the module docstring), as `line: what`."""
    names = set(registry.names())
    owned = {s.name for s in registry.sections()} & names  # `cost` is a role's too
    key = re.compile(r"\b(" + "|".join(sorted(owned)) + r")\.\w")
    registering = _registering_modules()
    tree = ast.parse(path.read_text(), str(path))
    prose, found = _docstrings(tree), []
    for node in ast.walk(tree):
        what = None
        if node in prose:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in names and (module, node.value) not in NOT_AN_ALGORITHM:
                what = repr(node.value)
            elif key.search(node.value):
                what = f"a key of {key.search(node.value).group(1)}.*: {node.value!r}"
        elif isinstance(node, ast.Attribute) and node.attr in owned:
            what = ast.unparse(node)
        elif isinstance(node, ast.Name) and node.id == "AlgorithmName":
            what = "AlgorithmName"
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported = {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            what = ", ".join(sorted(imported & registering)) or None
        elif isinstance(node, ast.Import):
            what = ", ".join(sorted({a.name for a in node.names} & registering)) or None
        if what:
            found.append(f"{node.lineno}: {what}")
    return found


def test_the_scan_sees_what_it_looks_for(tmp_path):
    """The rules catch each way of naming an algorithm (on code written for the test), and
    leave the shared `ppo` section alone."""
    path = tmp_path / "probe.py"
    path.write_text('from jaxrlhf.algorithms import dapo\nimport jaxrlhf.algorithms.gspo\n'
                    'x = config.algorithm == "grpo"\ny = config.dapo.oversample\n'
                    'z = "set dapo.oversample"\nw = AlgorithmName.PPO\n'
                    'v = config.ppo.clip_eps + "ppo.tis_cap"\n')
    assert sorted(f.split(":")[0] for f in _namings("probe", path)) == list("123456")


@pytest.mark.parametrize("module", sorted(_library()))
def test_no_module_outside_the_algorithms_names_one(module):
    assert not _namings(module, _library()[module]), _namings(module, _library()[module])


def test_every_algorithm_module_registers_itself():
    """Names are unique (the registry checks) and each is found by walking the package."""
    names = registry.names()
    assert len(names) == len(set(names)) and {"ppo", "grpo", "dpo", "sft"} <= set(names)
    assert registry.lookup("grpo").reads_sections == ("grpo", "ppo")


def test_an_unknown_name_is_one_line_listing_the_names():
    config = base_config()
    config.algorithm = "ppo2"
    with pytest.raises(ConfigError) as e:
        run_spec(config)
    assert str(e.value) == f"algorithm='ppo2' is not one of: {', '.join(registry.names())}"


def test_owned_sections_are_in_the_schema_with_their_defaults():
    config, shared = base_config(), _shared()
    for section in registry.sections():
        assert section.name not in shared, section.name  # one owner per section
        assert config[section.name].to_dict() == dict(section.defaults)
        for reader in registry.readers(section.name):
            assert section.name in registry.lookup(reader).reads_sections


def test_an_owned_section_bound_is_checked():
    """A section's ranges are held like the schema's own (`schema.check_ranges`)."""
    section = next(s for s in registry.sections() if s.bounds)
    relation, bound, keys = section.bounds[0]
    config = base_config()
    config[section.name][keys[0]] = type(bound)(bound - 1 if relation.startswith(">") else bound + 1)
    with pytest.raises(ConfigError, match=rf"^{section.name}\.{keys[0]}="):
        run_spec(config)


def test_capabilities_match_the_graphs():
    """CRITIC is declared where the built graph trains a critic."""
    from jaxrlhf.mfc import Role

    for name in registry.names():
        config = base_config()
        config.algorithm, config.rollout.group_size = name, 2
        has_critic = Role.CRITIC in run_spec(config).graph.roles()
        assert has_critic == (registry.Capability.CRITIC in registry.lookup(name).capabilities), name


def test_a_checkpoint_from_before_a_section_was_added_is_the_same_run():
    """A new algorithm's section enters every run's fingerprint at its defaults: a checkpoint
    written before it still resumes (the key reads as its default there), and one whose run
    changed such a key does not."""
    from jaxrlhf.fingerprint import differences, run_fingerprint

    section = next(s for s in registry.sections()[::-1]
                   if any(isinstance(v, float) for v in s.defaults.values()))
    config = base_config()
    now = run_fingerprint(config.to_json())
    before = {k: v for k, v in now.items() if not k.startswith(f"{section.name}.")}
    assert before != now and differences(before, now) == []
    key = next(k for k, v in section.defaults.items() if isinstance(v, float))
    config[section.name][key] = section.defaults[key] * 2 + 1
    changed = run_fingerprint(config.to_json())
    assert [d.split(":")[0] for d in differences(before, changed)] == [f"{section.name}.{key}"]
