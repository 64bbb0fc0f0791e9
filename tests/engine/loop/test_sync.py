"""Weights enter the rollout engine in one place (grpo/engine/loop/sync.py), on 8 CPU
devices with LoRA merged on the way into a serving layout (tp=2): the loop's weight sync
hands the trained adapters to the engine's ``update_weights``; the engine prepares them
(one merge + reshard) when the draw first reads them, every round samples that prepared
copy, and the copy is freed when the draw is done (it never lives through the update);
evaluation's engine, a separate object of the same builder, takes the weights through the
same preparation and reads the same arrays."""

from __future__ import annotations

import gc
import weakref

import jax
import numpy as np
import pytest

from _runs import _config

from grpo.engine.trainer import Trainer


@pytest.mark.slow
def test_weights_enter_the_engine_through_update_weights_and_the_prepared_copy_dies_with_the_draw(tmp_path):
    trainer = Trainer(_config(**{"rollout.style": "serving", "rollout.options.tensor_parallel": 2,
                                 "model.lora": {"rank": 4, "alpha": 8, "sampler": "merged"},
                                 "eval.num_examples": 4}), tmp_path)
    assert trainer.programs.rollout.resharded
    engine, evaluating = trainer.collector.sampler, trainer.programs.eval_sampler()
    assert trainer.loop.sync.engine is engine and evaluating is not engine
    # One preparation for both: the builder's, bound to the run's LoRA base.
    assert engine.prepare == evaluating.prepare == trainer.programs.prepare_weights

    seen: dict[str, list] = {"updates": [], "prepared": [], "sampled": []}
    prepare, update, sample = engine.prepare, engine.update_weights, engine.sample

    def counted_prepare(params):
        out = prepare(params)
        seen["prepared"].append(weakref.ref(jax.tree.leaves(out)[0]))
        return out

    def recorded_update(params, version=0):
        seen["updates"].append((params, version))
        update(params, version)

    def recorded_sample(params, *args):
        seen["sampled"].append(params is engine.__dict__["_prepared"])
        return sample(params, *args)

    engine.prepare, engine.update_weights, engine.sample = counted_prepare, recorded_update, recorded_sample
    trainer.loop.step()
    # The start's weights, then the update's: the trained adapters as the trainer holds them.
    assert [v for _, v in seen["updates"]] == [0, 1] and seen["updates"][-1][0] is trainer.params
    # One draw: one preparation, which every round sampled; then the copy was released.
    assert len(seen["prepared"]) == 1 and seen["sampled"] and all(seen["sampled"])
    assert engine.__dict__["_prepared"] is None
    gc.collect()
    assert seen["prepared"][0]() is None  # freed before the update ran: nothing else held it

    # Evaluation takes the same weights through its engine's update_weights, the same way.
    rollout_reads = jax.device_get(engine.weights)
    eval_reads = []
    eval_sample = evaluating.sample
    evaluating.sample = lambda params, *args: (eval_reads.append(jax.device_get(params)), eval_sample(params, *args))[1]
    row = trainer.evaluate()
    assert "eval/pass@1" in row and eval_reads
    for a, b in zip(jax.tree.leaves(rollout_reads), jax.tree.leaves(eval_reads[0]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert evaluating.__dict__["_prepared"] is None  # released after the evaluation
