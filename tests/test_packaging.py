"""What installs: only `jaxrlhf`, so that no name of ours shadows another distribution's.

The repository's kernels/, configs/ and meshes/ folders install inside the package
(docs/ARCHITECTURE.md, "What installs"). Hugging Face's `kernels` distribution, which
`transformers` imports when a model class loads, is the case that broke: our top-level
`kernels/` package stood first on `sys.path` wherever the repository root did (pytest, `python
-c` in a checkout), and every test that loaded a `transformers` model failed.

Two checks, each as a user meets it:
  * a plain `python -c` (no -I, no -P) with the repository root as its working directory;
  * a wheel built from the checkout, installed with `--no-deps` into a venv that sees this
    environment's packages (not its editable install of the checkout), used from another
    directory: the shipped configs and cluster files by their repository paths, and
    `plan --calibrate` refusing to write into it.
"""

import json
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = ("kernels", "configs", "meshes")

# Run in a subprocess from the repository root: Hugging Face's `kernels` is the one imported,
# transformers' Llama and Qwen3 classes load and run, and jaxrlhf's kernels import.
CHECKOUT_ROOT = f"""
import importlib.metadata, importlib.util, pathlib
root = pathlib.Path({str(ROOT)!r})
import kernels
hf = pathlib.Path(importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py"))
assert pathlib.Path(kernels.__file__).resolve() == hf.resolve(), (kernels.__file__, str(hf))
for name in {FOLDERS!r}:  # none of the repository's folders is a regular package
    spec = importlib.util.find_spec(name)
    origin = spec and spec.origin and pathlib.Path(spec.origin).resolve()
    assert not (origin and origin.parent == (root / name).resolve()), (name, str(origin))
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
tiny = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, vocab_size=64)
for model, config in ((LlamaForCausalLM, LlamaConfig), (Qwen3ForCausalLM, Qwen3Config)):
    logits = model(config(**tiny))(torch.zeros(1, 4, dtype=torch.long)).logits
    assert logits.shape == (1, 4, 64), logits.shape
import jaxrlhf.kernels.cpu_decode_attention, jaxrlhf.kernels.decode_attention
import jaxrlhf.kernels.flash_attention, jaxrlhf.kernels.paged_decode_attention
from jaxrlhf.models import attention
print("ok", kernels.__file__)
"""


def _run(args, cwd, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_checkout_root_imports_hugging_faces_kernels():
    done = _run([sys.executable, "-c", CHECKOUT_ROOT], cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok "), done.stdout


def test_the_repository_folders_are_no_top_level_packages():
    """They hold no __init__.py, and the package reaches each through its link."""
    for name in FOLDERS:
        assert not (ROOT / name / "__init__.py").exists(), name
        link = ROOT / "jaxrlhf" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve(), name


def _copy_checkout(dest: pathlib.Path) -> pathlib.Path:
    """What the build reads, copied (links kept as links): a wheel builds in its source tree,
    which must not be the repository's (nor copy a venv that lives inside it)."""
    ignore = shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    for folder in ("jaxrlhf", *FOLDERS):
        shutil.copytree(ROOT / folder, dest / folder, symlinks=True, ignore=ignore)
    for name in ("pyproject.toml", "README.md", *(p.name for p in ROOT.glob("requirements*.txt"))):
        shutil.copy(ROOT / name, dest / name)
    return dest


def _see_this_environment(python: pathlib.Path) -> None:
    """Puts this interpreter's site-packages folders after the venv's own (a `.pth` file of
    paths). `--system-site-packages` would not do: run from a venv, it shows the base
    interpreter's packages, not this environment's. The folders' own `.pth` files are not run,
    so the checkout's editable install is not seen there."""
    found = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                 cwd=python.parent)
    assert found.returncode == 0, found.stderr[-3000:]
    ours = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    pathlib.Path(found.stdout.strip(), "this_environment.pth").write_text("\n".join(ours) + "\n")


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    """(a venv holding the wheel of this checkout, installed without dependencies and seeing
    this environment's packages; the wheel's path)."""
    work = tmp_path_factory.mktemp("wheel")
    source = _copy_checkout(work / "src")
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                  "-q", "-w", str(work / "dist"), str(source)], cwd=work)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (work / "dist").glob("jaxrlhf-*.whl")
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(work / "venv")], cwd=work)
    assert made.returncode == 0, made.stderr[-3000:]
    python = work / "venv" / "bin" / "python"
    _see_this_environment(python)
    installed = _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                      str(wheel)], cwd=work)
    assert installed.returncode == 0, installed.stderr[-3000:]
    return python, wheel


def test_the_wheel_installs_only_jaxrlhf(wheel_venv):
    _, wheel = wheel_venv
    names = zipfile.ZipFile(wheel).namelist()
    jaxrlhf, info = sorted({n.split("/")[0] for n in names})
    assert jaxrlhf == "jaxrlhf" and info.endswith(".dist-info"), (jaxrlhf, info)
    for shipped in ("jaxrlhf/kernels/cpu_decode_attention.cc", "jaxrlhf/kernels/native.py",
                    "jaxrlhf/configs/ppo_tiny.py", "jaxrlhf/meshes/cpu_8.py",
                    "jaxrlhf/meshes/calibration/cpu_8.json",
                    "jaxrlhf/meshes/gpu_targets/h100_sxm.txtpb"):
        assert shipped in names, shipped


def test_the_installed_wheel_works_from_another_directory(wheel_venv, tmp_path):
    """From a folder that is not the checkout: the wheel's package is the one imported, Hugging
    Face's `kernels` is `kernels`, and the planner finds the shipped config and cluster file by
    their repository paths, with the shipped calibration."""
    python, _ = wheel_venv
    check = ("import jaxrlhf, kernels, pathlib, sys\n"
             "venv = pathlib.Path(sys.prefix).resolve()\n"
             "assert venv in pathlib.Path(jaxrlhf.__file__).resolve().parents, jaxrlhf.__file__\n"
             "assert venv not in pathlib.Path(kernels.__file__).resolve().parents\n"
             "assert 'jaxrlhf' not in pathlib.Path(kernels.__file__).parts\n"
             "import jaxrlhf.kernels.cpu_decode_attention as k, jaxrlhf.kernels.native\n"
             "assert pathlib.Path(k.__file__).with_suffix('.cc').is_file()\n")
    done = _run([str(python), "-c", check], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    plan = _run([str(python), "-m", "jaxrlhf.plan", "--config=configs/ppo_tiny.py",
                 "--cluster=meshes/cpu_8.py", "--json", "--iterations=50", "--time_limit=5"],
                cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr[-3000:]
    report = json.loads(plan.stdout[plan.stdout.index("{"):])
    assert report["plans"], report.keys()
    assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())


def test_calibrate_never_writes_into_the_installed_package(wheel_venv, tmp_path):
    """Beside a shipped cluster file means inside site-packages: refused in one line, before
    any device is touched; with --workdir the same command is taken (not run here)."""
    python, _ = wheel_venv
    done = _run([str(python), "-m", "jaxrlhf.plan", "--config=configs/ppo_tiny.py",
                 "--cluster=meshes/cpu_8.py", "--calibrate"], cwd=tmp_path, timeout=120)
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: --workdir: the cluster file ") and "installed" in line, line
