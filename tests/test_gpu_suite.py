"""benchmarks/gpu_suite.sh, the one-call GPU suite of issue 30, kept alive on the CPU.

`--dry-run` runs every step of the suite (preflight, the GPU numerics tests, gpu_kernels.py, the
rollout rows of `jaxrlhf.bench`, gpu_kernels.py's Pallas decode) on the CPU at tiny sizes, and
the one JSON file must hold every step with rc 0 and the figures each step is there for.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "gpu_suite.sh"
STEPS = ["preflight", "tests", "kernels", "rollout", "decode_pallas"]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "GPU_SUITE_DRY_RUN",
                                                            "GPU_SUITE_BUDGET")}
    env.update(PYTHON=sys.executable, PYTHONPATH=str(ROOT), **extra)
    return env


def _suite(tmp_path, *args, env=None, timeout=200) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "suite" / "gpu_suite.json"
    proc = subprocess.run(["bash", str(SUITE), *args, f"--out={out}"], cwd=tmp_path,
                          env=env or _env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


def _rows(result) -> list:
    """A step's JSON rows: a list of rows, or an object holding them under "rows"."""
    return result if isinstance(result, list) else result["rows"]


def test_dry_run_runs_every_step_into_one_json(tmp_path):
    # One row of each kind (a token count, a long tail): the dry run's default third row is
    # only one more pair of compiles (about 6 CPU seconds of the step's 30).
    proc, report = _suite(tmp_path, "--dry-run",
                          env=_env(GPU_SUITE_BUDGET="170", GPU_SUITE_ROLLOUT="4,tail:16"))
    log = "\n".join(f"--- {n}: rc {s['rc']}\n" + "\n".join(s["log_tail"])
                    for n, s in report["steps"].items())
    assert list(report["steps"]) == STEPS, log
    assert report["dry_run"] is True and report["backend"] == "cpu", report
    assert report["device"] == jax.devices("cpu")[0].device_kind
    assert report["jax_version"] == jax.__version__
    assert report["total_seconds"] <= report["budget_seconds"] == 170
    assert (tmp_path / "suite" / "gpu_suite.log").stat().st_size > 0
    for name, step in report["steps"].items():
        assert step["command"] and step["log_tail"], (name, step)
        assert not step["timed_out"] and 0 < step["seconds"] <= step["cap_seconds"], (name, log)
        assert step["rc"] == 0, (name, log)

    pre = report["steps"]["preflight"]["result"]
    assert not [k for k, v in pre["imports"].items() if str(v).startswith("error")], pre
    assert pre["cluster"] == "meshes/cpu_8.py"

    tests = report["steps"]["tests"]["result"]
    assert tests["failed"] == tests["error"] == 0, tests
    # The GPU tests are collected (an import error in one would fail the step) and, on the
    # CPU, skip themselves: kernels compiled (3) and cuDNN attention (1), at least.
    assert tests["collected"] >= 4 and tests["skipped"] == tests["collected"], tests
    assert any("paged_decode_compiled_on_gpu" in c["test"] for c in tests["cases"]), tests

    kernels = report["steps"]["kernels"]["result"]
    assert [(r["phase"], r.get("stack")) for r in kernels["rows"]] == [
        ("train", None), ("prefill", None), ("decode", "layers"), ("attention", "layers"),
        ("decode", "layers_kv"), ("attention", "layers_kv"), ("decode", "scan")], kernels
    assert {r["runs_as"] for r in kernels["rows"]} == {"xla"}
    assert all(r["seconds"] > 0 for r in kernels["rows"])
    assert all(r.get("fraction_of_roofline", r.get("fraction_of_bandwidth")) > 0
               for r in kernels["rows"][2:])
    pallas = report["steps"]["decode_pallas"]["result"]
    assert [(r["phase"], r["runs_as"]) for r in pallas["rows"]] == [("decode", "pallas"),
                                                                    ("attention", "pallas")]
    # The figures, one line each, end the output (what a device call's output tail shows).
    for line in ("tests: 0 passed, 0 failed, 0 errors, ", "kernels: train (xla, rows=2, len=8)",
                 "kernels: decode (xla, stack=layers, batch=2, prompt=8, new=2)",
                 "decode_pallas: decode (pallas, stack=layers_kv, batch=2"):
        assert line in proc.stdout, proc.stdout

    rows = _rows(report["steps"]["rollout"]["result"])
    assert [r["row"] for r in rows] == ["4", "tail:16"], rows
    assert all(r["useful_tokens_per_s"] > 0 and r["recompiles_after_warmup"] == 0 for r in rows)
    # Through the suite's persistent compilation cache (tests/conftest.py), as a user's
    # `compile.cache_dir` would be: the environment's directory wins over the config's.
    cache = report["steps"]["rollout"]["result"]["compile_cache"]
    assert cache["dir"] == os.environ["JAX_COMPILATION_CACHE_DIR"] and cache["compiles"] > 0
    assert "rollout:" in proc.stdout, proc.stdout


def test_without_a_gpu_the_gpu_run_stops_after_preflight(tmp_path):
    """The real suite on a machine whose jax has no GPU: nothing is run at 1B sizes on a CPU
    (it would only burn the budget), and the JSON says why."""
    _, report = _suite(tmp_path, env=_env(JAX_PLATFORMS="cpu"))
    steps = report["steps"]
    assert list(steps) == STEPS and steps["preflight"]["rc"] != 0, steps["preflight"]
    assert all(steps[n]["rc"] is None and "no GPU" in steps[n]["skipped"] for n in STEPS[1:])
    assert report["ok"] is False and report["dry_run"] is False


def test_a_spent_budget_skips_steps_and_still_writes_the_json(tmp_path):
    _, report = _suite(tmp_path, "--dry-run", env=_env(GPU_SUITE_BUDGET="0"))
    assert list(report["steps"]) == STEPS
    assert all(s["rc"] is None and s["skipped"] == "budget" for s in report["steps"].values())


def test_unknown_argument_is_one_line_error(tmp_path):
    proc = subprocess.run(["bash", str(SUITE), "--nope"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: gpu_suite.sh: unknown argument '--nope' "
                                   "(--dry-run, --out=PATH)")
