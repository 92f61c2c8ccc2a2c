"""notebooks/quickstart.ipynb runs top to bottom in a Jupyter kernel (nbclient), with its
`parameters` cell set to a few steps, and shows the reward curve, timeline and dataflow graph."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow  # a kernel, JAX's start and the tiny PPO's compiles: over a minute
def test_quickstart_notebook_runs(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert "pip" in nb.cells[1].source  # Colab: the first code cell installs jaxrlhf
    (parameters,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    parameters.source = "steps, sft_steps = 2, 2"
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(images) == 3  # reward curve, timeline, dataflow graph
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert '"accuracy_after"' in text and '"steps": 2' in text


def test_quickstart_notebook_is_valid():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")  # stored clean


def _install(monkeypatch, cwd, source=None) -> list[list[str]]:
    """The pip commands the install cell runs from `cwd` where jaxrlhf is not importable,
    with JAXRLHF_SOURCE=`source` (None: unset)."""
    import importlib.util
    import subprocess

    calls = []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.setattr(subprocess, "check_call", lambda args, **kw: calls.append(args))
    monkeypatch.chdir(cwd)
    if source is None:
        monkeypatch.delenv("JAXRLHF_SOURCE", raising=False)
    else:
        monkeypatch.setenv("JAXRLHF_SOURCE", source)
    exec(nbformat.read(NOTEBOOK, as_version=4).cells[1].source, {})
    return [args[args.index("install") + 1:] for args in calls]


def test_the_install_cell_installs_this_checkout_or_what_the_user_names(monkeypatch, tmp_path):
    """Inside a checkout: the checkout; elsewhere: JAXRLHF_SOURCE, or a message saying to set
    it. Never the bare name `jaxrlhf` (a stranger's package on PyPI; issue 46)."""
    root = NOTEBOOK.parents[1]
    assert _install(monkeypatch, NOTEBOOK.parent) == [["-q", str(root)]]
    wheel = str(tmp_path / "jaxrlhf-0.1-py3-none-any.whl")
    assert _install(monkeypatch, tmp_path, wheel) == [["-q", wheel]]
    with pytest.raises(RuntimeError, match="not inside a checkout of it: set "
                                           r"os.environ\['JAXRLHF_SOURCE'\] to a wheel"):
        _install(monkeypatch, tmp_path)
