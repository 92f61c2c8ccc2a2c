"""A role's parameters from a run's checkpoint, whatever plan the run used: the step asked
for, or the newest one that restores (a damaged newer one is named and skipped).

`python -m jaxrlhf.export` writes them as a Hugging Face directory; `python -m jaxrlhf.evaluate`
scores them.
"""

from __future__ import annotations

import sys

from jaxrlhf.mfc import Role


def restore_role(checkpoints, role: Role, step: int | None):
    """(host state, `role`'s model config and parameters) of checkpoint `step`, or, for None, of the newest one
    that restores (a damaged newer one is named in a warning and skipped)."""
    import jax

    from jaxrlhf import checkpoint
    from jaxrlhf.parallel.layout import make_layout
    from jaxrlhf.spec import model_config_of

    steps = checkpoints.all_steps()
    if step is not None and step not in steps:
        raise FileNotFoundError(f"no checkpoint {step} in {checkpoints.directory} "
                                f"(there are {steps})")
    errors = []
    for candidate in [step] if step is not None else reversed(steps):
        try:
            host = checkpoints.restore_host(candidate)
        except Exception as error:  # noqa: BLE001 - any damage: the previous one
            errors.append((candidate, error))
            continue
        roles = host.trained + host.frozen
        if role.value not in roles:
            raise ValueError(f"checkpoint {host.step} has no {role.value} model; it has "
                             f"{', '.join(roles)}")
        model = model_config_of(host.experiment_config().models[role.value], role,
                                f"models.{role.value}")
        # Sharded over every local device (one is enough); save_hf gathers one tensor at a time.
        layout = make_layout(f"f{jax.device_count()}", model=model)
        try:
            target = {role: checkpoint.abstract_state(model, layout)}
            return host, model, checkpoints.restore_models(host.step, target)[role]
        except Exception as error:  # noqa: BLE001 - any damage: the previous one
            errors.append((candidate, error))
            if step is None:
                print(f"warning: checkpoint {checkpoints.step_path(candidate)} cannot be "
                      f"restored ({type(error).__name__}); trying the previous one",
                      file=sys.stderr, flush=True)
    if not steps:
        raise FileNotFoundError(f"no complete checkpoint in {checkpoints.directory}")
    bad, error = errors[-1]
    text = " ".join(str(error).split())[:200]
    others = [s for s in steps if s not in [b for b, _ in errors]]
    raise FileNotFoundError(
        f"checkpoint {bad} in {checkpoints.directory} cannot be restored ({type(error).__name__}: "
        f"{text})" + (f"; --step= one of {others}" if others else "; none of them restores"))
