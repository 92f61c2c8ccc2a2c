#!/usr/bin/env bash
# Everything issue 30 measures on one GPU, in one call of at most 8 minutes, into ONE JSON file.
#
#   bash benchmarks/gpu_suite.sh [--dry-run] [--out=PATH]
#
# Steps, each in its own process under `timeout` (a step that fails or runs out of time is
# recorded with its rc, and the suite goes on):
#   preflight      device, backend, versions, the imports the steps need; picks the cluster file
#                  (H200 -> meshes/h200_1.py, else meshes/h100_1.py) for the denominators
#   tests          the GPU numerics tests: `pytest -m "gpu and not devices"` over the test files
#                  that carry the gpu marker (the `devices(n)` ones need n > 1 devices)
#   kernels        benchmarks/gpu_kernels.py, llama-3.2-1b bf16, random weights: train MFU
#                  (8 x 2048), prefill MFU and decode vs the HBM roofline at batch 64 and 256
#                  (prompt 512, 256 decode steps), attention=auto; the decode on the layer
#                  stack generation runs on a GPU (layers: engine.decode_layers, tiled caches),
#                  on per-layer [b, S, k, d] caches (layers_kv, cuDNN) and on the scanned one,
#                  and the decode attention alone against reading its cache once
#   (rollout: ~50 s of compiles a row on one H200; a row cut at the cap leaves the ones before
#   it in the JSON)
#   rollout        python -m jaxrlhf.bench --config=configs/rollout_bench_gpu.py
#                  --rollout=64,512,tail,2048: the rollout engine's rows (1B bf16, 64 rows)
#   decode_pallas  gpu_kernels.py's decode rows again with attention=pallas (the ragged Pallas
#                  kernel instead of cuDNN), layer by layer on one [b, S, k, d] cache per layer
#                  (stack layers_kv): the figures for choosing the GPU's decode attention
# Step caps (seconds) and the whole budget (480) are clamped so the suite ends inside it; the
# last step gets what is left. The JSON (default $OUT/gpu_suite.json when $OUT is set, else
# ./gpu_suite.json) holds the device, jax version, each step's rc, seconds, cap, command, the
# tail of its log and its own JSON (pytest's results from junit XML); the whole log is written
# beside it (same name, .log).
#
# --dry-run (or GPU_SUITE_DRY_RUN=1): the same steps on the CPU at tiny sizes (kernels at
# size=tiny fp32, the rollout rows on configs/rollout_bench_gpu.py:cpu,smoke), each well under
# a minute; tests/test_gpu_suite.py runs it in the default suite so the suite never rots.
#
# Python: $PYTHON (default python3; on the lent GPU machines the one with jax and CUDA). The
# repository goes first on PYTHONPATH. Wheels in .whl/ (packages the machine lacks, e.g.
# ml-collections and tensorboardX on the lent GPU image) are installed first into a scratch
# folder on PYTHONPATH.
set -u
T0=$(date +%s)  # the budget counts from here: the wheels' install is inside it

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
DRY=${GPU_SUITE_DRY_RUN:-0}
OUT_PATH=""
for arg in "$@"; do
  case $arg in
    --dry-run) DRY=1 ;;
    --out=*) OUT_PATH=${arg#--out=} ;;
    *) echo "error: gpu_suite.sh: unknown argument '$arg' (--dry-run, --out=PATH)" >&2; exit 2 ;;
  esac
done
[[ $DRY == 0 || $DRY == 1 ]] || { echo "error: GPU_SUITE_DRY_RUN=$DRY: 0 or 1" >&2; exit 2; }
[[ -n $OUT_PATH ]] || OUT_PATH=${OUT:-.}/gpu_suite.json
mkdir -p "$(dirname "$OUT_PATH")" || exit 2
LOG=${OUT_PATH%.json}.log
: > "$LOG"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_suite.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$WORK/site" "$ROOT"/.whl/*.whl >> "$LOG" 2>&1 \
    && export PYTHONPATH="$PYTHONPATH:$WORK/site" \
    || echo "warning: installing .whl/*.whl failed (see $LOG)" >&2
fi

if [[ $DRY == 1 ]]; then
  export JAX_PLATFORMS=cpu
  # The figures mean nothing on the CPU: compile fast (LLVM's optimisation is most of a tiny
  # program's compile time; the test suite does the same).
  [[ ${XLA_FLAGS:-} == *xla_backend_optimization_level* ]] \
    || export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0"
  BUDGET=${GPU_SUITE_BUDGET:-240}
  SIZE=(--size=tiny --dtype=float32 --batches=2 --prompt=8 --new=2 --train_rows=2
        --train_len=8 --repeats=1)
  ROLLOUT=(--config=configs/rollout_bench_gpu.py:cpu,smoke --rollout=${GPU_SUITE_ROLLOUT:-4,8,tail:16} --steps=1)
else
  export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}  # fail, rather than measure a CPU
  # kernels/ is written for Pallas' Triton lowering: jax 0.11 takes it on a GPU, jax 0.10 takes
  # Mosaic GPU (where the kernels do not lower) unless this says otherwise.
  export JAX_PALLAS_USE_MOSAIC_GPU=${JAX_PALLAS_USE_MOSAIC_GPU:-0}
  BUDGET=${GPU_SUITE_BUDGET:-480}
  SIZE=(--size=llama-3.2-1b --dtype=bfloat16 --batches=64,256 --prompt=512 --new=256
        --train_rows=8 --train_len=2048 --repeats=3)
  ROLLOUT=(--config=configs/rollout_bench_gpu.py --rollout=${GPU_SUITE_ROLLOUT:-64,512,tail,2048} --steps=1)
fi
STEPS=()

# run_step NAME CAP CMD...: CMD under `timeout`, capped by what is left of the budget (10 s
# kept for the merge); its rc, seconds and cap go to $WORK/NAME.meta, its output to NAME.log.
run_step() {
  local name=$1 cap=$2
  shift 2
  STEPS+=("$name")
  local cmd
  cmd=$(printf '%q ' "$@")
  echo "${cmd% }" > "$WORK/$name.cmd"
  local left=$((BUDGET - ($(date +%s) - T0) - 10))
  ((cap > left)) && cap=$left
  if ((cap < 5)); then
    echo "== $name: skipped, the budget of ${BUDGET}s is spent" | tee -a "$LOG"
    echo "skipped budget" > "$WORK/$name.meta"
    return
  fi
  echo "== $name (cap ${cap}s): $cmd" | tee -a "$LOG"
  local start rc
  start=$(date +%s.%N)
  timeout --kill-after=10 "$cap" "$@" > "$WORK/$name.log" 2>&1
  rc=$?
  echo "$rc $(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN {printf "%.2f", b - a}') $cap" \
    > "$WORK/$name.meta"
  cat "$WORK/$name.log" >> "$LOG"
  tail -n 15 "$WORK/$name.log"
  echo "== $name: rc $rc" | tee -a "$LOG"
}

skip_step() {  # NAME REASON: recorded, not run
  STEPS+=("$1")
  echo "-" > "$WORK/$1.cmd"
  echo "skipped $2" > "$WORK/$1.meta"
  echo "== $1: skipped ($2)" | tee -a "$LOG"
}

run_step preflight 60 "$PY" - "$WORK/preflight.json" "$DRY" <<'EOF'
import importlib, json, platform, sys
report = {"python": platform.python_version(), "imports": {}}
for name in ("jax", "jaxlib", "flax", "optax", "orbax.checkpoint", "chex", "einops",
             "ml_collections", "absl", "tensorboardX", "safetensors", "tokenizers", "jinja2",
             "scipy", "networkx", "pytest", "jaxrlhf", "jaxrlhf.kernels"):
    try:
        module = importlib.import_module(name)
        report["imports"][name] = getattr(module, "__version__", "ok")
    except Exception as e:  # recorded: the step that needs it fails on its own
        report["imports"][name] = f"error: {type(e).__name__}: {e}"
import jax
devices = jax.devices()
report.update(backend=jax.default_backend(), device_kind=devices[0].device_kind,
              device_count=len(devices), jax_version=jax.__version__)
kind = report["device_kind"].upper()
report["cluster"] = ("meshes/cpu_8.py" if sys.argv[2] == "1" else
                     "meshes/h200_1.py" if "H200" in kind else "meshes/h100_1.py")
json.dump(report, open(sys.argv[1], "w"), indent=1)
print(json.dumps(report, indent=1))
bad = [k for k, v in report["imports"].items() if str(v).startswith("error")]
wrong = sys.argv[2] == "0" and report["backend"] != "gpu"
sys.exit(3 if wrong else 1 if bad else 0)
EOF
PRE_RC=$(cut -d' ' -f1 "$WORK/preflight.meta")
CLUSTER=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["cluster"])' \
  "$WORK/preflight.json" 2>/dev/null || echo meshes/h100_1.py)
NAMES=(tests kernels rollout decode_pallas)
if [[ $PRE_RC == 3 || ($DRY == 0 && ! -s $WORK/preflight.json) ]]; then
  # No GPU: 1B models on a CPU would only burn the budget.
  for name in "${NAMES[@]}"; do skip_step "$name" "preflight found no GPU"; done
else
  mapfile -t GPU_TESTS < <(grep -l "pytest.mark.gpu" tests/test_*.py tests/unit/test_*.py)
  run_step tests 100 "$PY" -m pytest -p no:xdist -p no:cacheprovider -q -rs \
    -m "gpu and not devices" --junitxml="$WORK/tests.xml" "${GPU_TESTS[@]}"
  run_step kernels 150 "$PY" benchmarks/gpu_kernels.py "${SIZE[@]}" --cluster="$CLUSTER" \
    --attention=auto --stack=layers,layers_kv,scan --skip=mismatch --json_out="$WORK/kernels.json"
  run_step rollout 230 "$PY" -m jaxrlhf.bench "${ROLLOUT[@]}" --json_out="$WORK/rollout.json"
  run_step decode_pallas 60 "$PY" benchmarks/gpu_kernels.py "${SIZE[@]}" --cluster="$CLUSTER" \
    --attention=pallas --stack=layers_kv --skip=train,prefill,mismatch \
    --json_out="$WORK/decode_pallas.json"
fi

"$PY" - "$WORK" "$OUT_PATH" "$DRY" "$BUDGET" "$T0" "${STEPS[@]}" <<'EOF'
import json, pathlib, sys, time, xml.etree.ElementTree as ET
work, out, dry, budget, t0, names = (pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1",
                                     int(sys.argv[4]), int(sys.argv[5]), sys.argv[6:])

def load(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None if isinstance(e, FileNotFoundError) else {"error": f"{type(e).__name__}: {e}"}

def junit(path):
    """pytest's junit XML as counts and one outcome per test."""
    if not path.exists():
        return None
    cases = []
    for case in ET.parse(path).iter("testcase"):
        kinds = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
        outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(
            kinds[0] if kinds else "", "passed")
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}",
                      "outcome": outcome, "seconds": float(case.get("time", 0))})
    counts = {k: sum(c["outcome"] == k for c in cases)
              for k in ("passed", "failed", "error", "skipped")}
    return {**counts, "collected": len(cases), "cases": cases}

steps = {}
for name in names:
    meta = (work / f"{name}.meta").read_text().split()
    log = work / f"{name}.log"
    step = {"command": (work / f"{name}.cmd").read_text().strip()}
    if meta[0] == "skipped":
        step.update(rc=None, skipped=" ".join(meta[1:]))
    else:
        rc, seconds, cap = int(meta[0]), float(meta[1]), int(meta[2])
        step.update(rc=rc, seconds=seconds, cap_seconds=cap, timed_out=rc in (124, 137))
    step["log_tail"] = log.read_text(errors="replace").splitlines()[-40:] if log.exists() else []
    step["result"] = junit(work / "tests.xml") if name == "tests" else load(work / f"{name}.json")
    steps[name] = step
pre = steps.get("preflight", {}).get("result") or {}
report = {"suite": "benchmarks/gpu_suite.sh", "dry_run": dry,
          "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
          "total_seconds": round(time.time() - t0, 2), "budget_seconds": budget,
          "device": pre.get("device_kind"), "backend": pre.get("backend"),
          "jax_version": pre.get("jax_version"), "cluster": pre.get("cluster"),
          "ok": all(s["rc"] == 0 for s in steps.values()), "steps": steps}
pathlib.Path(out).write_text(json.dumps(report, indent=1))
print(f"{'step':<14} {'rc':>4} {'seconds':>8}  (all in {out})")
for name, s in steps.items():
    print(f"{name:<14} {str(s['rc']):>4} {s.get('seconds', 0):8.1f}"
          + (f"  skipped: {s['skipped']}" if s["rc"] is None else ""))
# The figures the suite is for, one line each (the JSON has them all).
tests = steps.get("tests", {}).get("result") or {}
if tests:
    print(f"tests: {tests['passed']} passed, {tests['failed']} failed, {tests['error']} errors, "
          f"{tests['skipped']} skipped")
for name in ("kernels", "decode_pallas"):
    for row in ((steps.get(name, {}).get("result") or {}).get("rows") or []):
        figure = {"train": "mfu", "prefill": "mfu", "decode": "fraction_of_roofline",
                  "attention": "fraction_of_bandwidth"}.get(row["phase"])
        shape = ", ".join(f"{k}={row[k]}" for k in ("stack", "rows", "len", "batch", "prompt", "new", "slots")
                          if k in row)
        print(f"{name}: {row['phase']} ({row['runs_as']}, {shape}) {row['seconds']:.4g} s"
              + (f", {figure} {row[figure]:.1%}" if figure else ""))
rollout = (steps.get("rollout") or {}).get("result")
for row in (rollout if isinstance(rollout, list) else (rollout or {}).get("rows") or []):
    print("rollout:", json.dumps(row)[:300])
EOF
