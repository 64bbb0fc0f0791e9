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


@pytest.mark.slow
def test_lora_moves_only_the_adapters_and_the_rollout_reads_what_a_full_merged_sync_gives(tmp_path):
    """Issue 51 (LoRA: adapter-only sync). Asynchronous GRPO in one process with LoRA
    merged on the rollout side: the base moved to the rollout mesh once, and each step's
    sync moves only the trained adapters (``weight_sync/bytes``: their bytes). What the
    rollout engine reads after a trained step (the adapters merged into the base there)
    is bit for bit what a full merged sync gives: the adapters merged into the base on the
    update mesh, the whole merged state moved to the rollout mesh."""
    from grpo.engine.loop.sync import tree_bytes
    from grpo.models.lora import merge_into_state

    trainer = Trainer(_config(**{"model.lora": {"rank": 4, "alpha": 8, "sampler": "merged"},
                                 "train.async": {"enabled": True, "max_staleness": 1}}), tmp_path)
    sync, engine = trainer.loop.sync, trainer.loop.sync.engine
    row = trainer.loop.step()
    adapters = tree_bytes(trainer.params)
    assert row["weight_sync/bytes"] == adapters < tree_bytes(trainer.frozen)
    assert any(np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(trainer.params))  # B moved off zero
    # The adapter-only sync: the moved adapters, merged on the rollout side by the engine.
    adapter_only = engine.weights
    # The full merged sync: merged on the update side, the whole state moved.
    merged = jax.jit(lambda p, f: merge_into_state(trainer.programs.graphdef, p, f))(trainer.params, trainer.frozen)
    full = jax.device_put(merged, jax.tree.map(lambda x: x.sharding, adapter_only))
    assert tree_bytes(full) > 10 * adapters
    rollout_devices = set(sync.programs.mesh.devices.flat)
    for a, b in zip(jax.tree.leaves(adapter_only), jax.tree.leaves(full), strict=True):
        assert set(a.sharding.device_set) <= rollout_devices
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
