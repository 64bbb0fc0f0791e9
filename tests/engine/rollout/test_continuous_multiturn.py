"""Multi-turn rows on the continuous-batching engine against the static multi-turn sampler,
on a tiny Qwen2 over 8 CPU devices with scripted environments: for the same key, the same
compacted rows (tokens, masks, loss mask, truncation, transcripts) and log-probs within
1e-5 (f32), with rows that queue, leave their slots at tool calls, come back as
append-prefills into their own pages, and are evicted (then re-prefilled from their
conversation) when a device's part of the pool runs short."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from grpo.core.contracts import Environment, EnvStep, MeshLayout, NoOptions
from grpo.engine.parallel.mesh import build_mesh
from grpo.engine.rollout.continuous_multiturn import ContinuousMultiTurnSampler
from grpo.engine.rollout.multiturn import MultiTurnSampler
from grpo.engine.rollout.paged.pages import PageAllocator
from grpo.engine.rollout.paged.scheduler import TurnScheduler
from grpo.engine.rollout.sampler import SamplingParams
from grpo.models.loading import load_hf
from grpo.models.tiny import special_token_ids, write_tiny_checkpoint
from grpo.plugins.rollout import LegacyStyle
from _multiturn import opening_prompts

P, K, N, TURNS = 4, 4, 64, 3


class Scripted(Environment):
    """A tool reply per turn whose length depends on the row (ragged appends); the episode
    ends after two replies, or at once for rows whose turn contains the letter 'q'."""

    def __init__(self, row: int):
        self.row, self.seen = row, []

    def reset(self, example):
        return [{"role": "user", "content": example["q"]}]

    def step(self, model_turn_text):
        self.seen.append(model_turn_text)
        if len(self.seen) > 2 or "q" in model_turn_text:
            return EnvStep(None, True, {})
        return EnvStep([{"role": "tool", "content": f"r{self.row}." + "x" * (self.row % 5)}], False, {"tool_calls": 1})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_cmt"), seed=3)
    layout = MeshLayout(dp=1, fsdp=8, tp=1)
    mesh = build_mesh(layout)
    graphdef, params = nnx.split(load_hf(directory, mesh))
    tok = AutoTokenizer.from_pretrained(directory)
    letters = sorted({i for c in "abcdefghijklmnopqrstuvwxyz" for i in tok(c, add_special_tokens=False)["input_ids"]})
    sampling = SamplingParams(max_new_tokens=N, num_generations=K, temperature=0.8, top_k=60, top_p=0.95,
                              eos_ids=(special_token_ids()["<|im_end|>"],), pad_id=tok.pad_token_id,
                              early_stop_chunk=4)
    kwargs = dict(sampling=sampling, max_turns=TURNS, turn_stop_ids=letters)
    base = dict(mesh=mesh, batch_axes=LegacyStyle().batch_axes(layout, NoOptions()))
    return graphdef, params, tok, kwargs, base


def _render(tok):
    def fn(messages, tools, add_generation_prompt):
        return tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)

    return fn


def converse(sampler, params, tok):
    """One rollout of P prompts x K rows through fresh :class:`Scripted` environments."""
    examples = [{"q": q} for q in ("What is 2+3?", "Say hi", "Name a colour", "Count to three")]
    envs = [Scripted(r) for r in range(P * K)]
    openings = [envs[r].reset(examples[r // K]) for r in range(P * K)]
    rend = _render(tok)
    ptok, pmask, Lp = opening_prompts(tok, rend, openings, prompts=P, generations=K)
    out, ep = sampler.converse(params, ptok, pmask, jax.random.key(7), envs=envs, openings=openings, render=rend,
                               tokenizer=tok)
    return type(out)(*(None if x is None else np.asarray(x) for x in out)), ep, Lp


@pytest.fixture(scope="module")
def static(setup):
    graphdef, params, tok, kwargs, base = setup
    return converse(MultiTurnSampler(graphdef, **kwargs, **base), params, tok)


def _assert_same(got, want):
    (out, ep, _), (ref, ref_ep, _) = got, want
    for name in ("prompt_tokens", "prompt_mask", "tokens", "mask", "loss_mask", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(out, name), getattr(ref, name), err_msg=name)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, rtol=0, atol=1e-5)
    np.testing.assert_allclose(out.behaviour_logprobs, ref.behaviour_logprobs, rtol=0, atol=1e-5)
    assert ep.messages == ref_ep.messages and ep.turns == ref_ep.turns and ep.last_text == ref_ep.last_text
    for name in ("num_turns", "tool_calls"):
        np.testing.assert_array_equal(getattr(ep, name), getattr(ref_ep, name), err_msg=name)


def test_continuous_multiturn_equals_static(setup, static):
    graphdef, params, tok, kwargs, base = setup
    ref, ref_ep, Lp = static
    # The rollout has what the matrix needs: several turns, replies between them, rows
    # ending on the sequence's stop, on max_turns and truncated by the budget.
    assert ref_ep.num_turns.max() == TURNS and ref_ep.tool_calls.sum() > 0 and (ref.mask - ref.loss_mask).sum() > 0
    assert ref.truncated.any() and not ref.truncated.all()
    # 16 rows, 8 slots (one per device): rows queue, and refill as rows end or leave for
    # a tool call and come back.
    cont = ContinuousMultiTurnSampler(graphdef, slots=8, page_size=32, chunk=8, backend="reference", **kwargs, **base)
    got = converse(cont, params, tok)
    assert cont.last_stats["prefills"] >= 4, cont.last_stats
    _assert_same(got, static)


@pytest.mark.slow
def test_serving_layout_multiturn_equals_static_legacy(setup, static):
    """The serving layout (tp=2: the pool's KV heads over tp, rows over 4 devices), two
    slots a device over a pool short of two rows at the cap: rows are evicted, seated or
    parked, and re-prefilled from their conversation."""
    from grpo.engine.rollout.layout import RolloutPlacement
    from grpo.plugins.rollout import serving_layout

    graphdef, params, tok, kwargs, base = setup
    placement = RolloutPlacement.of_layout(base["mesh"], serving_layout(8, 2, kv_heads=2))
    served = placement.reshard_jit(params)(params)
    cont = ContinuousMultiTurnSampler(graphdef, mesh=placement.mesh, batch_axes=placement.batch_axes,
                                      activation_rules=placement.activation_rules, cache_rules=placement.cache_rules,
                                      slots=8, page_size=32, pool_pages=5, chunk=8, backend="reference", **kwargs)
    got = converse(cont, served, tok)
    assert cont.shards(8) == 4 and cont.last_stats["evictions"] > 0, cont.last_stats
    _assert_same(got, static)


def test_turn_schedule_parks_returns_and_evicts():
    """The host's bookkeeping alone: a row that finishes a turn parks its pages; resumed,
    it comes back before the queue into a free slot of its part of the pool, its pages
    grown; a short part evicts its latest admitted row, parked or seated, freeing its
    pages for a re-prefill; nothing leaks."""
    alloc = PageAllocator(pages=8, page_size=4, slots=2, max_pages=6)
    sched = TurnScheduler(alloc, prompt_len=np.array([4, 4, 4]), cap=16, chunk=4)
    assert sched.admit() == [(0, 0), (1, 1)] and list(sched.queue) == [2]  # 2 pages each
    assert sched.release_done(np.array([True, False]), np.array([6, 6])) == [0]
    assert alloc.parked() == {0: 0} and sched.base[0] == 6 and sched.slot_row == [-1, 1]
    sched.resume(0, 9)  # its turn's last token and a 2-token reply appended: 9 tokens
    sched.grow_live(np.array([0, 6]))  # row 1 grows to 10 tokens: 3 pages
    assert sched.admit() == [(0, 0)]  # row 0 first, into its part's free slot, before row 2
    assert len(alloc.held(0)) == 4 and alloc.free_pages == 1 and list(sched.queue) == [2]
    # Row 1 needs 17 tokens (5 pages): the pool is short, the latest admitted row (row 1
    # itself, admitted after row 0) goes back to the head of the queue, pages freed.
    sched.grow_live(np.array([9, 13]))
    assert sched.slot_row == [0, -1] and list(sched.queue) == [1, 2] and sched.evictions == 1
    assert sched.base[1] == 0 and sched.hist_len[1] == 4
    alloc.check()
    # Row 0 parks again; a resumed parked row is evicted like a seated one.
    sched.release_done(np.array([True, False]), np.array([12, 0]))
    sched.resume(0, 14)
    sched._evict_one(0)
    assert alloc.parked() == {} and list(sched.queue) == [0, 1, 2] and sched.base[0] == 0
    assert alloc.free_pages == 8
    alloc.check()


@pytest.mark.slow
def test_quantized_weights_and_pages_run_multiturn_rows(setup, static):
    """Issue 53: int8 weights and an int8 page pool under multi-turn rows (tool replies
    appended into quantized pages, rows leaving and coming back): several turns run, and
    along each row's prefix shared with the float rollout the log-probs are close to the
    float model's but not equal (the quantized model drew them)."""
    graphdef, params, tok, kwargs, base = setup
    ref, _, _ = static
    cont = ContinuousMultiTurnSampler(graphdef, slots=8, page_size=32, chunk=8, backend="reference",
                                      weight_format="int8", kv_format="int8", **kwargs, **base)
    cont.update_weights(params)
    out, ep, _ = converse(cont, cont.weights, tok)
    assert ep.num_turns.max() >= 2 and ep.tool_calls.sum() > 0 and np.isfinite(out.logprobs).all()
    same = np.cumprod(out.tokens == ref.tokens, axis=1).astype(bool) & (ref.loss_mask > 0)
    assert same.sum() > 0
    gap = np.abs(out.logprobs - ref.logprobs)[same]
    assert 0 < gap.max() < 0.5, gap.max()
