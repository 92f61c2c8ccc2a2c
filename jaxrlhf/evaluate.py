"""Score a model or a run's checkpoint on a dataset: pass@1 and pass@k of a reward.

    python -m jaxrlhf.evaluate (--model=HF_DIR | --workdir=RUN [--step=N]) --data=FILE
        [--reward=math|exact_match|module:function] [--samples=k] [--temperature=T]
        [--max-new-tokens=N] [--max-prompt-len=P] [--layout=0-7:d8] [--chat]
        [--batch-prompts=64] [--out=FILE.jsonl]

FILE is JSONL or parquet with a prompt per row in any shape the run's readers take
(`data/datasets.py`): `prompt`/`answer`, GSM8K's `question`/`answer`, MATH's
`problem`/`solution`, or `messages` (rendered with the chat template). With --chat, `prompt`
rows are rendered as one user message too.

It generates on the rollout engine through the run stack's held-out evaluation
(`run/evaluate.py`, `HeldOut`) on --layout (default: a run's own generation layout, or the
colocated plan of this machine's devices), scores every response with the reward in its
process pool, and reports (`data/evaluation.py`): greedy (--samples=1, --temperature=0) pass@1
is the accuracy a run's held-out evaluation reports; with --samples=k > 1 it samples at
--temperature (default: the run's rollout temperature, else 1.0) and reports the unbiased pass@1
and pass@k. The k samples use the key of a run's periodic evaluation after checkpoint N's update
(`eval.samples=k`), and each batch of --batch-prompts prompts is one generate call, so a file of
at most that many prompts draws exactly that evaluation's samples.

Output: a progress bar (stderr), then one JSON line per prompt {"prompt", "answer", "samples",
"rewards", "lengths"} and as the last line one JSON object of the totals {"prompts", "samples",
"pass@1", "pass@k", "mean_reward", "mean_response_tokens", "reward_errors", "tokens_per_second",
"generate_seconds"} to --out (stdout when empty; the totals then also go to stderr as one
readable line). `tokens_per_second` is response tokens per second of the generate calls after
the first (which compiles), or of the only one, compilation included; `generate_seconds` each
call's wall time. Input that cannot work is
one line `error: FLAG: problem`, exit code 2, before anything compiles.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time

from absl import flags, logging

from jaxrlhf import cli
from jaxrlhf.schema import ConfigError, field

_MODEL = flags.DEFINE_string("model", None, "HF checkpoint directory (config.json, safetensors, "
                             "tokenizer.json).")
_WORKDIR = flags.DEFINE_string("workdir", None, "A run's workdir: its actor at checkpoint "
                               "--step, with the run's tokenizer and settings.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest that restores).")
_DATA = flags.DEFINE_string("data", None, "JSONL or parquet file of prompts with answers.",
                            required=True)
_REWARD = flags.DEFINE_string("reward", None, "math | exact_match | module:function | "
                              "/path/file.py:function (data/rewards.py); default: the run's "
                              "reward function, else math.")
_SAMPLES = flags.DEFINE_integer("samples", 1, "Responses per prompt (k of pass@k).",
                                lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", None, "Sampling temperature (default: 0 for "
                                  "--samples=1, else the run's rollout temperature or 1.0).")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", None, "New tokens per response "
                                       "(default: the run's rollout.max_new_tokens, else 256).")
_MAX_PROMPT_LEN = flags.DEFINE_integer("max_prompt_len", None, "Prompt tokens (default: the "
                                       "run's rollout.max_prompt_len, else the longest prompt).")
_LAYOUT = flags.DEFINE_string("layout", "", "Generation layout, e.g. 0-7:d2t4 (default: the "
                              "run's generation layout, or the colocated plan's).")
_CHAT = flags.DEFINE_bool("chat", False, "Render prompts with the tokenizer's chat template.")
_BATCH_PROMPTS = flags.DEFINE_integer("batch_prompts", 64, "Prompts per generate call.",
                                      lower_bound=1)
_OUT = flags.DEFINE_string("out", "", "JSONL output file (default: stdout).")
_SEED = flags.DEFINE_integer("seed", None, "Sampling seed (default: the run's seed, else 0).")

DEFAULT_MAX_NEW_TOKENS = 256  # an HF model's, where no run says


def _check_flags() -> None:
    """The flags alone: one source of weights, a readable data file, a reward, k and T that
    make sense together."""
    if (_MODEL.value is None) == (_WORKDIR.value is None):
        raise ConfigError("--model: give exactly one of --model=HF_DIR and --workdir=RUN")
    if _STEP.value is not None and _WORKDIR.value is None:
        raise ConfigError(f"--step={_STEP.value}: a checkpoint step needs --workdir")
    if not pathlib.Path(_DATA.value).is_file():
        raise ConfigError(f"--data={_DATA.value}: no such file")
    temperature = _TEMPERATURE.value
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(f"--temperature={temperature}: must be a finite number >= 0")
    if _SAMPLES.value > 1 and temperature == 0:
        raise ConfigError(f"--samples={_SAMPLES.value}: greedy responses (--temperature=0) are "
                          "all the same; sample with --temperature > 0")
    for flag in (_MAX_NEW_TOKENS, _MAX_PROMPT_LEN):
        if flag.value is not None and flag.value < 1:
            raise ConfigError(f"--{flag.name}={flag.value}: must be at least 1")
    if _REWARD.value is not None:
        from jaxrlhf.data.rewards import resolve_reward

        with field(f"--reward={_REWARD.value}"):
            resolve_reward(_REWARD.value)


def _rows(tokenizer, max_prompt_len: int | None):
    """(the --data rows fitted to the prompt length, that length): the run's readers and chat
    rendering; the longest prompt's length where none is given."""
    from jaxrlhf.data import datasets
    from jaxrlhf.data.chat import ChatTemplateMode, template_rows
    from jaxrlhf.data.long_prompts import LongPrompts, fit_rows
    from jaxrlhf.data.tokenizer import encode_prompt

    where = f"--data={_DATA.value}"
    chat = ChatTemplateMode.AUTO if _CHAT.value else ChatTemplateMode.NONE
    with field(where):
        rows = datasets.read_rows(_DATA.value, datasets.RowKind.PROMPT)
        if any(r.answer is None for r in rows):
            raise ConfigError("a row has no answer (answer, GSM8K's answer or MATH's solution): "
                              "pass@k needs every row's reference")
    if _CHAT.value and tokenizer.chat_template is None:
        raise ConfigError("--chat: the tokenizer has no chat_template")
    if max_prompt_len is None:  # every prompt whole
        rendered = template_rows(rows, tokenizer, chat, where)
        max_prompt_len = max(len(r.prompt_ids if r.prompt_ids is not None
                                 else encode_prompt(tokenizer, r.prompt)) for r in rendered)
    with field(where):
        return fit_rows(rows, tokenizer, max_prompt_len, LongPrompts.ERROR, where, chat), \
            max_prompt_len


class _Restored:
    """A checkpoint's actor: its step, experiment config and parameters (export's restore)."""

    def __init__(self, workdir: str, step: int | None):
        from jaxrlhf import checkpoint
        from jaxrlhf.mfc import Role
        from jaxrlhf.restore import restore_role

        directory = pathlib.Path(workdir) / checkpoint.CHECKPOINT_DIR
        if not directory.is_dir():
            raise ConfigError(f"--workdir={workdir}: no checkpoints in {directory}")
        checkpoints = checkpoint.Checkpointer(directory, None)
        try:
            host, _, self.params = restore_role(checkpoints, Role.ACTOR, step)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"--workdir={workdir}: {e}") from None
        finally:
            checkpoints.close()
        self.step, self.experiment_config = host.step, host.experiment_config


def _config(restored: _Restored | None) -> tuple:
    """(the run's experiment config, or a fresh one over --model; the checkpoint step or 0)."""
    from jaxrlhf.schema import base_config

    if _MODEL.value is not None:
        config = base_config()
        config.models.actor.path = config.tokenizer = _MODEL.value
        config.warm_start.sft_steps = 0
        return config, 0
    return restored.experiment_config(), restored.step


def _job(config, step: int):
    """The run stack's job over the --data rows: the run's settings, with the flags' sampling,
    lengths and reward."""
    from jaxrlhf.data.sources import Data
    from jaxrlhf.data.tokenizer import check_vocab, load_tokenizer
    from jaxrlhf.run.check import Job
    from jaxrlhf.run.layouts import place
    from jaxrlhf.spec import run_spec

    with field("--model" if _MODEL.value else "--workdir"):
        tokenizer = load_tokenizer(config.tokenizer)
    rows, max_prompt_len = _rows(tokenizer, _MAX_PROMPT_LEN.value or (
        None if _MODEL.value else config.rollout.max_prompt_len))
    r = config.rollout
    r.max_prompt_len = max_prompt_len
    r.max_new_tokens = _MAX_NEW_TOKENS.value or (DEFAULT_MAX_NEW_TOKENS if _MODEL.value
                                                 else r.max_new_tokens)
    k = _SAMPLES.value
    if k > 1:
        r.temperature = _TEMPERATURE.value if _TEMPERATURE.value is not None else r.temperature
    config.eval.update(samples=k if k > 1 else 0, max_prompts=0)
    if _REWARD.value is not None or _MODEL.value is not None:
        config.reward.update(kind="function", function=_REWARD.value or "math")
    elif config.reward.kind != "function":
        raise ConfigError(f"--reward: the run at {_WORKDIR.value} is scored by a reward model; "
                          "name a reward function (math, exact_match, module:function)")
    config.seed = config.seed if _SEED.value is None else _SEED.value
    spec = run_spec(config)
    with field("--model" if _MODEL.value else "--workdir"):
        check_vocab(tokenizer, spec.base.config.vocab_size)
    positions = spec.base.config.max_position_embeddings
    if max_prompt_len + r.max_new_tokens > positions:
        raise ConfigError(f"--max_new_tokens={r.max_new_tokens}: with {max_prompt_len}-token "
                          f"prompts that passes the model's {positions} positions")
    return Job(spec, tokenizer, place(spec), pathlib.Path(_WORKDIR.value or "."), {},
               Data(train=[], eval=rows, sft=[])), step


def _layout(job):
    from jaxrlhf.parallel import make_layout
    from jaxrlhf.run.evaluate import generation_layout

    if not _LAYOUT.value:
        return generation_layout(job)
    with field(f"--layout={_LAYOUT.value}"):
        return make_layout(_LAYOUT.value, model=job.spec.base.config)


def _params(job, layout, restored: _Restored | None):
    """The actor's parameters on `layout`: the checkpoint's, or --model's loaded there."""
    from jaxrlhf.models import hf_io
    from jaxrlhf.models.sizes import abstract_params
    from jaxrlhf.run.build import actor_copy

    model = job.spec.base.config
    if restored is not None:
        return actor_copy(restored.params, model, layout)
    with field(f"--model={_MODEL.value}"):
        hf_io.check_weights(_MODEL.value)
        _, params = hf_io.load_hf(_MODEL.value, dtype=model.dtype,
                                  shardings=lambda c: layout.param_shardings(abstract_params(c)))
    return params


def evaluate() -> dict:
    """Runs the evaluation the flags describe; writes the per-prompt lines and returns the
    totals."""
    import jax
    import numpy as np
    from tqdm import tqdm

    from jaxrlhf.data.evaluation import eval_metrics
    from jaxrlhf.run.evaluate import HeldOut, sampling_key

    _check_flags()
    restored = None if _WORKDIR.value is None else _Restored(_WORKDIR.value, _STEP.value)
    job, step = _job(*_config(restored))
    layout = _layout(job)
    params = _params(job, layout, restored)
    rows, k = job.data.eval, _SAMPLES.value
    greedy, batch = k == 1 and not _TEMPERATURE.value, _BATCH_PROMPTS.value
    rng = jax.random.key(0) if greedy else sampling_key(job.spec.seed, step)
    out = open(_OUT.value, "w") if _OUT.value else sys.stdout  # noqa: SIM115 - closed below
    rewards_pk, lengths, errors, seconds, tokens = [], [], 0, [], []
    try:
        with HeldOut(job, layout) as held_out, tqdm(total=len(rows), desc="evaluate",
                                                     unit="prompt", file=sys.stderr) as bar:
            for start in range(0, len(rows), batch):
                chunk = rows[start:start + batch]
                began = time.perf_counter()  # batch 0 keeps the run's key (module docstring)
                key = rng if start == 0 else jax.random.fold_in(rng, start // batch)
                # a short last batch is filled up to the others' shape: nothing recompiles
                filled = chunk if len(rows) <= batch else [chunk[i % len(chunk)]
                                                            for i in range(batch)]
                responses = held_out.responses(params, filled, k, key, greedy=greedy)
                seconds.append(time.perf_counter() - began)
                tokens.append(int(responses.lengths_b[:len(chunk) * k].sum()))
                rewards, failed = held_out.score([r for r in chunk for _ in range(k)],
                                                 responses.texts[:len(chunk) * k])
                errors += failed
                for i, row in enumerate(chunk):
                    part = slice(i * k, (i + 1) * k)
                    rewards_pk.append(rewards[part])
                    lengths.extend(int(n) for n in responses.lengths_b[part])
                    out.write(json.dumps({
                        "prompt": row.prompt if row.messages is None else list(row.messages),
                        "answer": row.answer, "samples": responses.texts[part],
                        "rewards": [float(x) for x in rewards[part]],
                        "lengths": [int(n) for n in responses.lengths_b[part]]}) + "\n")
                bar.update(len(chunk))
        scores_pk = np.stack(rewards_pk)
        metrics = eval_metrics(scores_pk, tuple(sorted({1, k})), prefix="")
        totals = {"prompts": len(rows), "samples": k,
                  **{name.lstrip("/"): value for name, value in metrics.items()
                     if name.startswith("/pass@")},
                  "mean_reward": float(scores_pk.mean()),
                  "mean_response_tokens": float(np.mean(lengths)),
                  "reward_errors": errors, "tokens_per_second": _tokens_per_second(tokens, seconds),
                  "generate_seconds": [round(t, 3) for t in seconds]}
        out.write(json.dumps(totals) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    return totals


def _tokens_per_second(tokens: list[int], seconds: list[float]) -> float:
    """Response tokens per second of the calls after the first (it compiles), or of the one."""
    later = slice(1 if len(seconds) > 1 else 0, None)
    return sum(tokens[later]) / sum(seconds[later])


def main() -> None:
    logging.set_verbosity(logging.ERROR)  # orbax logs every checkpoint file it opens
    totals = evaluate()
    summary = ("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in totals.items() if k != "generate_seconds"))
    print(summary, file=sys.stderr if not _OUT.value else sys.stdout, flush=True)


if __name__ == "__main__":
    cli.run(main, flags_parser=cli.parse_dashed_flags)
