"""JAX's persistent compilation cache (`compile.cache_dir`): a rerun or a restart loads what an
earlier run compiled instead of compiling it again."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jaxrlhf import backend
from jaxrlhf.kernels import native
from jaxrlhf.run.check import check_config
from jaxrlhf.schema import ConfigError, base_config
from jaxrlhf.spec import run_spec

REPO = pathlib.Path(__file__).resolve().parent.parent

# `python -m jaxrlhf.train ARGS...` with JAX's compilation-cache events counted; prints them as
# the last line of stderr.
_COUNTED_TRAIN = """
import atexit, collections, json, runpy, sys
import jax
events = collections.Counter()
jax.monitoring.register_event_listener(lambda event, **_: events.update([event]))
atexit.register(lambda: print(json.dumps(events), file=sys.stderr))
sys.argv = ["jaxrlhf.train", *sys.argv[1:]]
runpy.run_module("jaxrlhf.train", run_name="__main__")
"""
_REQUESTS, _HITS, _WRITES = (backend.CACHE_REQUEST_EVENT, backend.CACHE_HIT_EVENT,
                             backend.CACHE_WRITE_EVENT)


def _train(cache: pathlib.Path, workdir: pathlib.Path) -> tuple[dict, dict]:
    """(the job's summary, its cache events): SFT on the tiny model, one device, one step, in a
    fresh process whose cache is the config's (the suite's own, in the environment, is not
    passed on)."""
    env = {k: v for k, v in os.environ.items() if k not in (
        backend.ENV_CACHE_DIR, backend.ENV_CACHE_MIN_SECONDS, "XLA_FLAGS")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               XLA_FLAGS="--xla_backend_optimization_level=0")  # not conftest's 8 devices
    result = subprocess.run(
        [sys.executable, "-c", _COUNTED_TRAIN, "--config=configs/sft_tiny.py:smoke",
         "--config.steps=1", "--config.cpu_devices=1", "--config.eval.max_prompts=4",
         "--config.checkpoint.every=0", f"--config.compile.cache_dir={cache}",
         f"--workdir={workdir}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    return summary, json.loads(result.stderr.strip().splitlines()[-1])


def _entries(cache: pathlib.Path) -> list[str]:
    """The cache's executables, in this host's folder (beside them: access times and a lock,
    where its size is bounded)."""
    assert [p.name for p in cache.iterdir()] == [native.host_key()]
    return sorted(p.name for p in (cache / native.host_key()).glob("*-cache"))


@pytest.mark.entry
def test_a_rerun_compiles_nothing_and_computes_the_same(tmp_path):
    """The first run compiles every program and writes each to the cache; a second run, in a
    fresh process, loads every one of them (no compile, no new entry) and computes the same
    losses bit for bit."""
    cache = tmp_path / "cache"
    first, first_events = _train(cache, tmp_path / "first")
    entries = _entries(cache)
    assert first_events.get(_HITS, 0) == 0 and first_events[_WRITES] == first_events[_REQUESTS]
    assert len(entries) == first_events[_WRITES] > 0  # everything compiled is kept
    again, again_events = _train(cache, tmp_path / "again")
    assert again_events[_HITS] == again_events[_REQUESTS] == first_events[_REQUESTS]
    assert again_events.get(_WRITES, 0) == 0
    assert _entries(cache) == entries
    for key in ("eval_loss_before", "eval_loss_after", "accuracy_after", "recompiles"):
        assert again[key] == first[key], key
    for folder in (cache, cache / native.host_key()):  # whoever writes there runs code
        assert (folder.stat().st_mode & 0o777) == 0o700


def test_cache_dir_is_an_absolute_path_and_empty_is_none():
    config = base_config()
    config.compile.cache_dir = "~/jaxrlhf-xla"
    assert run_spec(config).compile_cache_dir == pathlib.Path.home() / "jaxrlhf-xla"
    config.compile.cache_dir = "xla"  # JAX would take a relative path from each cwd
    assert run_spec(config).compile_cache_dir == pathlib.Path.cwd() / "xla"
    config.compile.cache_dir = ""
    assert run_spec(config).compile_cache_dir is None


def test_a_cache_dir_that_cannot_be_made_is_one_line(tmp_path, monkeypatch):
    """A directory under a file: named in one line (the suite's cache in the environment would
    win over the config's, so it is taken away here)."""
    monkeypatch.delenv(backend.ENV_CACHE_DIR)
    (tmp_path / "a_file").write_text("")
    config = base_config()
    config.compile.cache_dir = str(tmp_path / "a_file" / "xla")
    with pytest.raises(ConfigError) as info:
        check_config(config, str(tmp_path / "work"))
    assert str(info.value).startswith("compile.cache_dir: [Errno 20] Not a directory: ")
    assert str(info.value).endswith('(set a directory that takes files, or "" for no cache)')
    assert "\n" not in str(info.value)
