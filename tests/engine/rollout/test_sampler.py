"""The rollout sampler on a tiny Qwen2 over 8 CPU devices, checked against full forward
passes (no cache): greedy decoding, log-probs, EOS/padding/length cap, early exit, KV
segments, left/right padding, and identical samples under the legacy and maxtext styles."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from flax import nnx

from grpo.core.cli import cli
from grpo.core.contracts import MeshLayout, NoOptions
from grpo.engine.parallel.mesh import build_mesh, current_topology
from grpo.engine.rollout.sampler import RolloutOutput, Sampler, SamplingParams
from grpo.models.loading import load_hf
from grpo.models.decoder import positions_from_mask
from grpo.models.tiny import write_tiny_checkpoint
from grpo.plugins.rollout import LegacyStyle, MaxTextStyle

P, LP, K, N = 4, 8, 2, 8
B = P * K
LENGTHS = np.array([8, 5, 3, 1])
PAD_IN = 306  # prompt padding (its value must not matter)
TEMP = 0.7
SAMPLING = dict(max_new_tokens=N, num_generations=K, temperature=TEMP, top_k=50, top_p=0.9, eos_ids=(308,), pad_id=306)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def layout():
    return MeshLayout(dp=1, fsdp=8, tp=1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, layout):
    # The tiny checkpoint's weights are N(0, 1/fan_in) with random biases and norms, so
    # logits are O(1): samples are far from uniform and greedy has clear winners.
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"), seed=0, tokenizer=False)
    mesh = build_mesh(layout)
    graphdef, params = nnx.split(load_hf(directory, mesh))
    return graphdef, params, mesh


@pytest.fixture(scope="module")
def prompts():
    rs = np.random.default_rng(0)
    tokens = rs.integers(0, 256, size=(P, LP)).astype(np.int32)
    mask = (np.arange(LP)[None, :] >= LP - LENGTHS[:, None]).astype(np.int32)
    return np.where(mask == 1, tokens, PAD_IN).astype(np.int32), mask


@pytest.fixture(scope="module")
def forward(setup):
    """Full-sequence logits [B, T, V] from one forward pass without a cache."""
    graphdef, params, _ = setup

    @jax.jit
    def logits_fn(params, seq, seq_mask):
        model = nnx.merge(graphdef, params)
        hidden, _ = model(seq, positions_from_mask(seq_mask), seq_mask.astype(bool))
        return model.logits(hidden)

    return lambda seq, mask: np.asarray(logits_fn(params, jnp.asarray(seq, jnp.int32), jnp.asarray(mask, jnp.int32)))


def _sampler(setup, style, **overrides):
    graphdef, _, mesh = setup
    kv_segment = overrides.pop("kv_segment", 256)
    layout = MeshLayout(**{a: mesh.shape[a] for a in ("dp", "fsdp", "tp")})
    return Sampler(
        graphdef,
        mesh=mesh,
        batch_axes=style.batch_axes(layout, NoOptions()),
        sampling=SamplingParams(**{**SAMPLING, **overrides}),
        kv_segment=kv_segment,
    )


def _np(out: RolloutOutput) -> RolloutOutput:
    return RolloutOutput(*(None if x is None else np.asarray(x) for x in out))


@pytest.fixture(scope="module")
def legacy_out(setup, prompts):
    out = _sampler(setup, LegacyStyle()).generate(setup[1], *prompts, jax.random.key(42))
    return out


@pytest.fixture(scope="module")
def greedy(setup, prompts):
    """Greedy completions without stop tokens, temperature 0.5 for the log-probs."""
    return _np(_sampler(setup, LegacyStyle(), greedy=True, temperature=0.5, eos_ids=()).generate(
        setup[1], *prompts, jax.random.key(0)))


def _full_sequence(out: RolloutOutput):
    seq = np.concatenate([out.prompt_tokens, out.tokens], axis=1)
    mask = np.concatenate([out.prompt_mask, np.ones_like(out.tokens)], axis=1)
    return seq, mask


def _log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _check_invariants(out: RolloutOutput, eos_ids, pad_id):
    assert out.tokens.shape == (B, N) and out.mask.shape == (B, N) and out.logprobs.shape == (B, N)
    assert out.tokens.dtype == np.int32 and out.mask.dtype == np.int32 and out.logprobs.dtype == np.float32
    np.testing.assert_array_equal(out.lengths, out.mask.sum(1))
    np.testing.assert_array_equal(out.mask, (np.arange(N)[None] < out.lengths[:, None]).astype(np.int32))
    assert np.all(out.tokens[out.mask == 0] == pad_id)
    assert np.all(out.logprobs[out.mask == 0] == 0.0)
    assert np.all(out.logprobs[out.mask == 1] < 0.0)
    hit = np.isin(out.tokens, eos_ids) & (out.mask == 1)
    # A row stops at its first stop token, which is its last token; otherwise it runs to N.
    np.testing.assert_array_equal(out.truncated, ~hit.any(1))
    assert np.all(hit.sum(1) <= 1)
    assert np.all(out.lengths[out.truncated] == N)
    for r in np.flatnonzero(~out.truncated):
        assert out.tokens[r, out.lengths[r] - 1] in eos_ids


def _expected_with_stops(g: RolloutOutput, eos_ids, pad_id):
    """What greedy decoding with stop tokens must give, from the run without them."""
    tokens = np.full_like(g.tokens, pad_id)
    logprobs = np.zeros_like(g.logprobs)
    lengths = np.full(B, N)
    for r in range(B):
        hits = np.flatnonzero(np.isin(g.tokens[r], eos_ids))
        if hits.size:
            lengths[r] = hits[0] + 1
        tokens[r, : lengths[r]] = g.tokens[r, : lengths[r]]
        logprobs[r, : lengths[r]] = g.logprobs[r, : lengths[r]]
    return tokens, logprobs, lengths


# --------------------------------------------------------------------------- tests


def test_greedy_equals_argmax_of_full_forward(greedy, prompts, forward):
    tokens, mask = prompts
    _check_invariants(greedy, (), 306)
    np.testing.assert_array_equal(greedy.prompt_tokens, np.repeat(tokens, K, axis=0))
    np.testing.assert_array_equal(greedy.prompt_mask, np.repeat(mask, K, axis=0))
    assert greedy.truncated.all() and np.all(greedy.lengths == N)
    # Independent reference: greedy decoding by re-running the full forward (no cache)
    # once per token on a fixed-size buffer (later slots are invisible causally).
    buf = np.concatenate([greedy.prompt_tokens, np.zeros((B, N), np.int32)], axis=1)
    buf_mask = np.concatenate([greedy.prompt_mask, np.ones((B, N), np.int32)], axis=1)
    for t in range(N):
        logits = forward(buf, buf_mask)[:, LP - 1 + t]
        buf[:, LP + t] = logits.argmax(-1)
    np.testing.assert_array_equal(greedy.tokens, buf[:, LP:])
    # Log-probs under the temperature-scaled distribution (T=0.5), not 0.
    ref = _log_softmax(forward(buf, buf_mask)[:, LP - 1 : LP - 1 + N] / 0.5)
    ref = np.take_along_axis(ref, greedy.tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(greedy.logprobs, ref, atol=1e-4)
    # The K copies of a prompt agree under greedy; different prompts do not.
    np.testing.assert_array_equal(greedy.tokens[0::2], greedy.tokens[1::2])
    assert len({tuple(r) for r in greedy.tokens}) == P


def test_logprobs_match_full_forward(legacy_out, forward):
    out = _np(legacy_out)
    _check_invariants(out, (308,), 306)
    seq, seq_mask = _full_sequence(out)
    logits = forward(seq, seq_mask)[:, LP - 1 : LP - 1 + N] / TEMP  # B N V
    logp = _log_softmax(logits)
    ref = np.take_along_axis(logp, out.tokens[..., None], -1)[..., 0]
    valid = out.mask == 1
    np.testing.assert_allclose(out.logprobs[valid], ref[valid], atol=1e-4)
    # Every draw lies inside the top-k (50) and the top-p (0.9) nucleus of the reference.
    order = np.argsort(-logits, axis=-1, kind="stable")
    rank = np.argmax(order == out.tokens[..., None], axis=-1)
    assert np.all(rank[valid] < 50)
    top = np.take_along_axis(logits, order[..., :50], -1)
    p = np.exp(top - top.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    mass_before = np.cumsum(p, -1) - p
    assert np.all(np.take_along_axis(mass_before, np.minimum(rank, 49)[..., None], -1)[..., 0][valid] < 0.9 + 1e-5)
    # Sampling really samples: the K generations of a prompt differ.
    assert all(not np.array_equal(out.tokens[2 * b], out.tokens[2 * b + 1]) for b in range(P))


def test_behaviour_logprobs_under_top_p_match_the_truncated_distribution(setup, prompts, forward, greedy):
    """top-p 0.5 on the tiny model: ``behaviour`` is each drawn token's log-prob under the
    nucleus renormalised (numpy, from a full forward pass); ``logprobs`` stays the
    full-vocabulary one. Without a filter the two are one array (``legacy_out`` has top-k
    and top-p: see ``test_logprobs_match_full_forward``)."""
    out = _np(_sampler(setup, LegacyStyle(), top_k=0, top_p=0.5).generate(setup[1], *prompts, jax.random.key(3)))
    seq, seq_mask = _full_sequence(out)
    logits = forward(seq, seq_mask)[:, LP - 1 : LP - 1 + N].astype(np.float64) / TEMP  # B N V
    valid = out.mask == 1
    full = np.take_along_axis(_log_softmax(logits), out.tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(out.logprobs[valid], full[valid], atol=1e-4)
    behaviour = np.zeros_like(full)
    for b, t in zip(*np.nonzero(valid)):
        order = np.argsort(-logits[b, t], kind="stable")
        p = np.exp(_log_softmax(logits[b, t][order]))
        kept = order[: max(int(np.sum(np.cumsum(p) - p < 0.5)), 1)]  # the smallest nucleus of mass >= 0.5
        assert out.tokens[b, t] in kept
        behaviour[b, t] = _log_softmax(logits[b, t][kept])[list(kept).index(out.tokens[b, t])]
    np.testing.assert_allclose(out.behaviour_logprobs[valid], behaviour[valid], atol=1e-4)
    assert np.all(out.behaviour_logprobs[~valid] == 0.0)
    # The truncation is real here: the full log-prob is off by the kept mass (< 1).
    assert np.mean(out.behaviour_logprobs[valid] - out.logprobs[valid]) > 0.1
    assert greedy.behaviour_logprobs is None and greedy.behaviour is greedy.logprobs  # no filter


def test_legacy_and_maxtext_give_identical_samples(setup, prompts, legacy_out):
    assert MaxTextStyle().check(layout=MeshLayout(1, 8, 1), topology=current_topology(), options=NoOptions()) == []
    maxtext_out = _sampler(setup, MaxTextStyle()).generate(setup[1], *prompts, jax.random.key(42))
    # The styles really lay the batch out differently: over 8 devices vs replicated.
    assert not legacy_out.tokens.sharding.is_fully_replicated
    assert len({str(s.index) for s in legacy_out.tokens.addressable_shards}) == 8
    assert maxtext_out.tokens.sharding.is_fully_replicated
    a, b = _np(legacy_out), _np(maxtext_out)
    for name in ("prompt_tokens", "prompt_mask", "tokens", "mask", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_other_seed_other_samples(setup, prompts, legacy_out):
    # Same compiled sampler as the fixture (same SamplingParams), another key.
    other = _np(_sampler(setup, LegacyStyle()).generate(setup[1], *prompts, jax.random.key(43)))
    assert np.mean(other.tokens != np.asarray(legacy_out.tokens)) > 0.3


def test_right_padding_equals_left_padding(setup, prompts, legacy_out):
    tokens, mask = prompts
    # Right-align the same prompts (and pad with another id).
    right_tokens = np.full_like(tokens, 7)
    right_mask = np.zeros_like(mask)
    for b, n in enumerate(LENGTHS):
        right_tokens[b, :n] = tokens[b, LP - n :]
        right_mask[b, :n] = 1
    out = _np(_sampler(setup, LegacyStyle()).generate(setup[1], right_tokens, right_mask, jax.random.key(42)))
    ref = _np(legacy_out)
    # Returned left-aligned (padding slots keep the caller's pad value).
    np.testing.assert_array_equal(out.prompt_mask, ref.prompt_mask)
    np.testing.assert_array_equal(out.prompt_tokens * out.prompt_mask, ref.prompt_tokens * ref.prompt_mask)
    assert np.all(out.prompt_tokens[out.prompt_mask == 0] == 7)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-6)


def test_kv_segments_and_chunks_do_not_change_samples(setup, prompts, legacy_out):
    # N=8 with chunks of 3: steps rounded up to 9 (one discarded), segments (0,3),(3,6),(6,9):
    # the cache grows twice and the last chunk runs past the cap.
    sampler = _sampler(setup, LegacyStyle(), early_stop_chunk=3, kv_segment=3)
    assert sampler.plan() == ((0, 3), (3, 6), (6, 9))
    out = _np(sampler.generate(setup[1], *prompts, jax.random.key(42)))
    ref = _np(legacy_out)
    for name in ("tokens", "mask", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(out, name), getattr(ref, name), err_msg=name)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)


def test_stop_tokens_padding_and_length_cap(setup, prompts, greedy):
    # Two stop ids taken from the greedy run: rows that produce one stop there, the others
    # run to the cap (truncated). Chunks of 2 exercise the while loop with some rows done.
    eos = (int(greedy.tokens[0, 2]), int(greedy.tokens[4, 5]))
    sampler = _sampler(setup, LegacyStyle(), greedy=True, temperature=0.5, eos_ids=eos, pad_id=307, early_stop_chunk=2)
    out, steps = sampler.decode(setup[1], sampler.prefill(setup[1], *prompts), jax.random.key(0))
    out = _np(out)
    _check_invariants(out, eos, 307)
    tokens, logprobs, lengths = _expected_with_stops(greedy, eos, 307)
    assert (lengths < N).any() and (lengths == N).any(), lengths  # both kinds of row
    np.testing.assert_array_equal(out.tokens, tokens)
    np.testing.assert_array_equal(out.lengths, lengths)
    np.testing.assert_array_equal(out.truncated, lengths == N)  # no stop token within N
    np.testing.assert_allclose(out.logprobs, logprobs, atol=1e-5)
    assert int(steps) == N


def test_early_exit_when_all_rows_stop(setup, prompts, greedy):
    # Every row stops by its 3rd token, so the loop exits long before N.
    eos = tuple(sorted({int(greedy.tokens[r, 1 + (r // 2) % 2]) for r in range(B)}))
    sampler = _sampler(setup, LegacyStyle(), greedy=True, temperature=0.5, eos_ids=eos, pad_id=307, early_stop_chunk=2)
    out, steps = sampler.decode(setup[1], sampler.prefill(setup[1], *prompts), jax.random.key(0))
    out = _np(out)
    _check_invariants(out, eos, 307)
    tokens, logprobs, lengths = _expected_with_stops(greedy, eos, 307)
    assert lengths.max() <= 3 and not out.truncated.any()
    np.testing.assert_array_equal(out.tokens, tokens)
    np.testing.assert_allclose(out.logprobs, logprobs, atol=1e-5)
    # Step 0, then chunks of 2 until the chunk in which the last row stopped: the check
    # runs once per chunk, so at most one chunk runs after everything has stopped.
    last = int(lengths.max()) - 1
    assert last >= 1
    assert int(steps) == 1 + 2 * -(-last // 2) < N


def test_bench_rollout_cli():
    args = ["bench", "rollout", "--preset", "tiny", "--batch", "8", "--generations", "2", "--prompt-len", "8",
            "--new-tokens", "4", "--early-stop-chunk", "2", "--repeats", "1", "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output.strip().splitlines()[-1])
    for key in ("device", "batch", "new_tokens", "compile_s", "prefill_s", "decode_s", "ms_per_decode_step",
                "tokens_per_s", "peak_bytes_in_use", "hbm_roofline_fraction"):
        assert key in data, key
    assert data["batch"] == 8 and data["new_tokens"] == 4 and data["prompts"] == 4
    assert data["decode_s"] > 0 and data["tokens_per_s"] > 0 and 1 <= data["decode_steps"] <= 4


def test_bench_rollout_measures_the_run_sampler_and_the_builder_merge(tmp_path):
    """The bench's settings are a run config, and its sampler is the one the program
    builder makes for `grpo run` (kv_segment and early stop included)."""
    from grpo.engine.bench.rollout import bench_config
    from grpo.engine.programs import build_programs

    cfg = bench_config(model_path=None, preset="tiny", dtype="float32", batch=8, generations=2, prompt_len=8,
                       new_tokens=4, early_stop=False, early_stop_chunk=2, kv_segment=64, style="maxtext",
                       mesh_policy="auto", mesh_shape=None, temperature=0.7, top_k=5, top_p=0.9, seed=3)
    assert cfg.train.prompts_per_step == 4 and cfg.rollout.num_generations == 2
    assert cfg.rollout.kv_segment == 64 and cfg.rollout.early_stop_chunk == 0 and cfg.rollout.prompt_buckets == [8]
    layout = MeshLayout(dp=1, fsdp=8, tp=1)
    model = load_hf(write_tiny_checkpoint(tmp_path / "m"), build_mesh(layout))
    programs = build_programs(cfg, mesh=build_mesh(layout), layout=layout, graphdef=nnx.split(model)[0],
                              eos_ids=(7,), pad_id=0)
    sampler = programs.sampler()
    assert sampler.kv_segment == 64 and sampler.batch_axes == ("dp",)
    assert (sampler.sampling.temperature, sampler.sampling.top_k, sampler.sampling.top_p) == (0.7, 5, 0.9)
    assert sampler.sampling.early_stop_chunk == 0 and sampler.sampling.num_generations == 2

    # LoRA: the decode reads base + adapters, and merge_s times the builder's merge.
    args = ["bench", "rollout", "--preset", "tiny", "--batch", "8", "--generations", "2", "--prompt-len", "8",
            "--new-tokens", "2", "--repeats", "1", "--lora-rank", "2", "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    lora = json.loads(result.output.strip().splitlines()[-1])["lora"]
    assert lora["rank"] == 2 and lora["trainable_params"] > 0 and lora["merge_s"] > 0
    bad = CliRunner().invoke(cli, ["bench", "rollout", "--preset", "tiny", "--temperature", "0.5", "--top-p", "1",
                                   "--batch", "8", "--generations", "2", "--mesh", "explicit", "--shape", "3,-1,1"])
    assert bad.exit_code == 2 and "mesh" in bad.output and "Traceback" not in bad.output


def test_bench_rollout_refuses_maxtext_without_dp_per_process():
    args = ["bench", "rollout", "--preset", "tiny", "--style", "maxtext", "--mesh", "explicit", "--shape", "2,4,1"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2
    assert "dp == process count" in result.output


def test_global_array_prompts_and_empty_prompt(setup, prompts, legacy_out):
    tokens, mask = prompts
    sampler = _sampler(setup, LegacyStyle())
    out = _np(sampler.generate(setup[1], jnp.asarray(tokens), jnp.asarray(mask), jax.random.key(42)))
    np.testing.assert_array_equal(out.tokens, np.asarray(legacy_out.tokens))
    empty = mask.copy()
    empty[2] = 0
    with pytest.raises(ValueError, match=r"prompts \[2\] have no tokens"):
        sampler.generate(setup[1], tokens, empty, jax.random.key(0))


def test_samples_do_not_depend_on_the_mesh(tmp_path_factory, setup, prompts, legacy_out):
    # maxtext on a (dp=1, fsdp=4, tp=2) mesh: batch replicated, heads/KV cache/vocab split
    # over tp, parameters laid out differently — yet the same samples as legacy on (1, 8, 1).
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_tp"), seed=0, tokenizer=False)
    layout = MeshLayout(dp=1, fsdp=4, tp=2)
    mesh = build_mesh(layout)
    graphdef, params = nnx.split(load_hf(directory, mesh))
    sampler = Sampler(graphdef, mesh=mesh, batch_axes=MaxTextStyle().batch_axes(layout, NoOptions()),
                      sampling=SamplingParams(**SAMPLING))
    out = sampler.generate(params, *prompts, jax.random.key(42))
    assert out.tokens.sharding.is_fully_replicated
    a, b = _np(legacy_out), _np(out)
    for name in ("tokens", "mask", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_single_and_multi_turn_samplers_share_one_interface():
    """The trainer, the evaluator and the plan call any sampler the same way: the one
    interface has one signature in both kinds."""
    import inspect

    from grpo.engine.rollout.multiturn import MultiTurnSampler
    from grpo.engine.rollout.sampler import BaseSampler

    for name in ("sample", "lowerings", "cache_slots", "cache_bytes", "jitted", "abstract_output"):
        sigs = {str(inspect.signature(getattr(cls, name))) for cls in (BaseSampler, Sampler, MultiTurnSampler)}
        assert len(sigs) == 1, (name, sigs)


def test_texts_detokenize_only_the_rows_read():
    from grpo.engine.rollout.sampler import Texts

    seen = []

    def detokenize(tokens, mask):
        seen.append(len(tokens))
        return [" ".join(str(t) for t, m in zip(row, ms) if m) for row, ms in zip(tokens, mask)]

    tokens, mask = np.arange(12).reshape(4, 3), np.asarray([[1, 1, 0]] * 4)
    texts = Texts(detokenize, tokens, mask)
    assert len(texts) == 4 and seen == []
    assert texts[:2] == ["0 1", "3 4"] and seen == [2]
    assert texts[-1] == "9 10" and texts[1] == "3 4" and seen == [2, 1, 1]
    assert list(texts) == ["0 1", "3 4", "6 7", "9 10"] and seen[-1] == 4
