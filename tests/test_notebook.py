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
