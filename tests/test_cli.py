"""Every entry point reports bad input as one line `error: FIELD: problem`, exit code 2.

`jaxrlhf.train`'s cases are in test_bad_inputs.py and `jaxrlhf.generate`'s in
test_generate_cli.py; these are the other tools', each a failure met before anything compiles.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = [
    ("plan_cluster_file_missing",
     ["jaxrlhf.plan", "--config=configs/ppo_tiny.py", "--cluster=meshes/nope.py"],
     "error: --cluster=meshes/nope.py: cluster file 'meshes/nope.py' does not exist"),
    ("plan_cluster_flag_missing", ["jaxrlhf.plan", "--config=configs/ppo_tiny.py"],
     "error: flag --cluster=None: Flag --cluster must have a value other than None."),
    ("plan_calibrate_and_validate",
     ["jaxrlhf.plan", "--config=configs/ppo_tiny.py", "--cluster=meshes/cpu_8.py",
      "--calibrate", "--validate"],
     "error: --calibrate, --validate and --compile are separate runs"),
    ("plan_validate_gpu_cluster_on_cpu",  # compared A100 predictions with CPU timings
     ["jaxrlhf.plan", "--config=configs/ppo_tiny.py", "--cluster=meshes/a100_2x8.py",
      "--validate"],
     "error: --cluster: a100_2x8 is a GPU cluster but this machine presents CPU devices"),
    ("plan_calibrate_gpu_cluster_on_cpu",  # wrote an A100 calibration from CPU timings
     ["jaxrlhf.plan", "--config=configs/ppo_tiny.py", "--cluster=meshes/a100_2x8.py",
      "--calibrate", "--workdir={tmp}"],
     "error: --cluster: a100_2x8 is a GPU cluster but this machine presents CPU devices"),
    ("plan_validate_zero_steps",
     ["jaxrlhf.plan", "--config=configs/ppo_tiny.py", "--cluster=meshes/cpu_8.py",
      "--validate", "--steps=0"],
     "error: flag --steps=0: 0 is not a positive integer"),
    ("graph_unknown_algorithm",
     ["jaxrlhf.graph", "--config=configs/ppo_tiny.py", "--config.algorithm=foo"],
     "error: algorithm='foo' is not one of: ppo, grpo"),
    ("graph_env_class_renamed",  # a Python keyword: --config.env.class= could not parse
     ["jaxrlhf.graph", "--config=configs/grpo_tiny.py", "--config.env.class=tools"],
     "error: --config.env.class: renamed to env.name"),
    ("graph_config_file_missing", ["jaxrlhf.graph", "--config=configs/nope.py"],
     "error: --config=configs/nope.py: no such config file"),
    ("bench_batch_does_not_split",
     ["jaxrlhf.bench", "--config=configs/ppo_tiny.py", "--config.rollout.batch_size=7"],
     "error: placement.strategy: MFC 'actor_gen' (0-7:d8) splits the batch 8 ways"),
    ("bench_zero_steps",  # compiled, then died on a median of no timings
     ["jaxrlhf.bench", "--config=configs/ppo_tiny.py", "--steps=0"],
     "error: flag --steps=0: 0 is not a positive integer"),
    ("bench_stray_argument", ["jaxrlhf.bench", "--config=configs/ppo_tiny.py", "extra"],
     "error: unexpected arguments: ['extra']"),
    ("export_no_checkpoints", ["jaxrlhf.export", "--workdir={tmp}", "--out={tmp}/hf"],
     "error: --workdir={tmp}: no checkpoints in {tmp}/checkpoints"),
    ("export_unknown_role",
     ["jaxrlhf.export", "--workdir={tmp}", "--out={tmp}/hf", "--role=critic2"],
     "error: flag --role=critic2: value should be one of <actor|critic|ref|reward|cost|"),
    ("evaluate_greedy_samples",
     ["jaxrlhf.evaluate", "--workdir={tmp}", "--data=README.md", "--samples=4",
      "--temperature=0"],
     "error: --samples=4: greedy responses (--temperature=0) are all the same"),
    ("evaluate_no_checkpoints", ["jaxrlhf.evaluate", "--workdir={tmp}", "--data=README.md"],
     "error: --workdir={tmp}: no checkpoints in {tmp}/checkpoints"),
]


@pytest.mark.entry
@pytest.mark.parametrize("args,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_naming_the_field(tmp_path, args, expected):
    args = [a.format(tmp=tmp_path) for a in args]
    proc = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0].startswith(expected.format(tmp=tmp_path)), errors[0]


@pytest.mark.entry
def test_the_environment_is_set_on_the_command_line(tmp_path):
    """`--config.env.name=tools` (the README's flag) parses and gives the multi-turn graph."""
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrlhf.graph", "--config=configs/grpo_tiny.py",
         "--config.env.name=tools", f"--out={tmp_path}/g.png"], capture_output=True, text=True,
        cwd=ROOT, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("grpo_multiturn: 3 MFCs"), proc.stdout
