"""The publish of new weights off the trainer's path (run/publisher.py): the caller goes on while
a version travels, an unsent version is superseded by a newer one, every wait has a deadline,
a failure reaches the caller as one line, and generation ends with the very weights a blocking
publish gives it; in the asynchronous loop the trainer's next update starts before the
version published after the previous one has arrived."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.data import tasks
from jaxrlhf.engine.generate import GenerateConfig
from jaxrlhf.engine.rollout import Rollout
from jaxrlhf.mfc import MFC, Call, Role
from jaxrlhf.models.sizes import get_size
from jaxrlhf.parallel.delta import WeightSync
from jaxrlhf.parallel.layout import init_params, make_layout
from jaxrlhf.run import async_loop
from jaxrlhf.run.publisher import PublishError, Publisher
from jaxrlhf.run.rollout_worker import RolloutWorker


def _gated():
    """A transfer that records its inputs and returns them once `release` is set."""
    release, sent = threading.Event(), []

    def transfer(params, version):
        sent.append(int(params))
        assert release.wait(timeout=60), "never released"
        return params * 10

    return transfer, release, sent


def test_the_caller_goes_on_while_a_version_travels_and_a_newer_one_supersedes_the_unsent():
    transfer, release, sent = _gated()
    publisher = Publisher(transfer, timeout_s=60)
    publisher.offer(jnp.int32(1), 1)
    while not sent:  # the thread has taken v1 and is blocked in it
        threading.Event().wait(0.01)
    publisher.offer(jnp.int32(2), 2)  # waits behind v1 ...
    publisher.offer(jnp.int32(3), 3)  # ... and is replaced: only the newest matters
    events = [what for what, _, _ in publisher.events]
    assert events == ["offer", "send", "offer", "offer"]  # the offers returned mid-send
    assert publisher.busy and publisher.ready() is None
    release.set()
    params, version = publisher.wait()
    assert (int(params), version) == (30, 3) and sent == [1, 3] and publisher.superseded == 1
    assert not publisher.busy and publisher.wait() is None
    publisher.close()


def test_a_failed_publish_is_one_line_at_the_next_call_naming_the_version():
    def broken(params, version):
        raise ValueError("checksum mismatch in bucket 3\nsecond line")

    publisher = Publisher(broken, timeout_s=60)
    publisher.offer(jnp.int32(0), 7)
    with pytest.raises(PublishError) as raised:
        publisher.wait()
    message = str(raised.value)
    assert message == ("weights v7: the publish to generation failed: ValueError: checksum "
                       "mismatch in bucket 3")
    with pytest.raises(PublishError, match="weights v7"):
        publisher.offer(jnp.int32(1), 8)  # the trainer's next step stops on it


def test_waits_have_a_deadline():
    transfer, release, _ = _gated()
    publisher = Publisher(transfer, timeout_s=0.2)
    publisher.offer(jnp.int32(1), 4)
    with pytest.raises(PublishError, match=r"weights v4: .* did not finish within 0 s"):
        publisher.wait()
    release.set()
    publisher.close()


@pytest.mark.parametrize("sync", [WeightSync.FULL, WeightSync.DELTA])
def test_generation_gets_a_blocking_publishs_weights_bit_for_bit(sync):
    config = get_size("tiny", dtype=jnp.float32)
    train = make_layout("0-1:f2", model=config)
    gen = make_layout("2-3:d2", model=config)
    mfc = MFC("actor_gen", Role.ACTOR, Call.GENERATE, ("prompt_tokens_bp", "prompt_mask_bp"),
              ("seq_bs", "seq_mask_bs", "response_mask_bn", "logp_bn"))

    def worker():
        rollout = Rollout(config, GenerateConfig(4, 1, 0), gen, 4, 2)
        return RolloutWorker(mfc, rollout, gen, config, seed=0, chunk_tokens=2,
                             weight_sync=sync)

    blocking, published = worker(), worker()
    params = init_params(config, train, jax.random.key(0))
    blocking.publish(params, 0)
    published.publish(params, 0)
    publisher = Publisher(lambda snapshot, _: published.transfer(snapshot, owned=True), 120)
    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(0)
    for version in range(1, 7):
        # Some tensors change (one of them by one ulp), the others stay: what delta skips.
        leaves = [x + jnp.float32(0.25) if i % 3 == version % 3 else
                  (jnp.nextafter(x, jnp.inf) if i == 0 else x) for i, x in enumerate(leaves)]
        params = jax.tree.unflatten(treedef, leaves)
        blocking.publish(params, version)
        publisher.offer(params, version)
        if rng.random() < 0.5:
            published.install(*publisher.wait())
        elif (got := publisher.ready()) is not None:
            published.install(*got)
    if (got := publisher.wait()) is not None:
        published.install(*got)
    publisher.close()
    assert published.version == blocking.version == 6
    for a, b in zip(jax.tree.leaves(published.params), jax.tree.leaves(blocking.params)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32),
                                      np.asarray(b).view(np.uint32))


@pytest.mark.slow  # a GRPO run of the in-process asynchronous loop (~30 s on 2 loaded cores)
def test_the_trainers_next_update_starts_before_the_version_published_arrives(tmp_path,
                                                                                monkeypatch):
    from test_async_rl import STEPS, _async, _config

    rows = tasks.make_reverse_task(tasks.ReverseTask(num_train=64, num_eval=8, num_sft=8)).train
    cond, log = threading.Condition(), []  # ("train", k) when update k starts, ("sent", v)
    submit, transfer = async_loop._Trainer.submit, RolloutWorker.transfer

    def traced_submit(self, train, done):
        def traced(buffer):
            with cond:
                log.append(("train", done.index))
                cond.notify_all()
            return train(buffer)
        return submit(self, traced, done)

    def gated_transfer(self, params, owned=False):
        """A publish after update k arrives only once update k + 1 has started (unless the run
        ends): with a blocking publish the update could never start, and this times out."""
        if threading.current_thread().name == "jaxrlhf-publish":
            with cond:
                started = sum(what == "train" for what, _ in log)
                if started < STEPS:
                    cond.wait_for(lambda: sum(w == "train" for w, _ in log) > started, 60)
                log.append(("sent", started))
        return transfer(self, params, owned)

    monkeypatch.setattr(async_loop._Trainer, "submit", traced_submit)
    monkeypatch.setattr(RolloutWorker, "transfer", gated_transfer)
    result, got, _ = _async(_config("grpo", 1, kind="disaggregate"), rows, tmp_path)
    assert sorted(got) == list(range(STEPS)) and max(
        got[s]["async/staleness_max"] for s in range(STEPS)) <= 1
    sends = [k for what, k in log if what == "sent"]
    assert sends, log
    for k in sends:  # the version published after update k - 1 arrived after update k began
        if k < STEPS:
            assert log.index(("train", k)) < log.index(("sent", k)), log
