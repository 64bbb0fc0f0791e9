"""The multi-turn rollout: the model decodes a turn, the host runs the environment (tools),
the replies' tokens are appended to each row's KV cache, and decoding goes on.

Usage (the trainer, for a task whose rows have environments)::

    mt = MultiTurnSampler(graphdef, mesh=mesh, batch_axes=axes, sampling=sampling,
                          max_turns=4, conversations=conversations)
    sampled = mt.sample(params, prompt_tokens, prompt_mask, rng, examples)   # Sampled, as single-turn

:meth:`MultiTurnSampler.sample` makes each row's environment from its example
(:class:`~grpo.engine.rollout.conversations.Conversations`), runs the turns
(:meth:`MultiTurnSampler.converse`, which takes the environments themselves) and closes
them.

How it runs
-----------

Prefill is the single-turn sampler's (K samples of a prompt share it; row ``b*K + j``).
Then, for each turn:

1. **Turn decode** (one jit, the cache donated): every row still in its episode samples
   until a stop token (``eos_ids`` and ``turn_stop_ids``, e.g. the tool format's
   ``</tool_call>``) or its remaining budget; the others sample nothing and their slots
   stay hidden (``kv_valid`` 0). Like the single-turn decode it runs ``lax.fori_loop``
   chunks of ``early_stop_chunk`` tokens inside a ``lax.while_loop`` that exits when
   every row has finished its turn: no per-token host sync.
2. **Host**: each process decodes its own rows' turns and calls ``env.step`` for them
   concurrently (a thread pool: a slow tool does not serialise rows; the built-in tool
   environment bounds every call by ``rollout.tool_timeout_s``). A reply is turned into
   tokens by the chat template itself: the text the template adds after the model's turn
   is ``render(conversation + [assistant turn] + reply, add_generation_prompt=True)``
   minus the text already in the row (prompt and sampled turns). So the update batch is
   the template's rendering of the whole conversation, whatever the template's
   separators are.
3. **Append** (one jit, the cache donated): every continuing row's last sampled token
   (sampled, never fed) and its reply tokens are written at the same slots ``[S, S+L)``,
   ragged rows right-padded and hidden (``kv_valid`` 0); RoPE positions continue each
   row's count of real tokens, so the cache holds exactly what a fresh forward over the
   row's real tokens would. One forward over the ``[B, L]`` chunk (``L`` padded by under
   25%, see :func:`append_bucket`: few compiles) gives the next turn's first logits at
   each row's last real position.

Budgets: ``max_new_tokens`` N bounds each row's completion, model and inserted tokens
together (the completion of the update batch). Slots are shared by all rows (one write
index), so a row that finishes a turn early leaves a hole as long as the longest turn
beside it; the cache after the prompt has ``max_turns x N`` slots, enough for every
turn to run the whole budget, and a row whose next turn or reply would not fit is ended
as truncated. Done rows wait at the cost of their slots in the batch.

Output: each row compacted into ``[turn 1, reply 1, turn 2, ...]`` + padding to N:
``mask`` 1 on every real token (the update's forward attends to model and inserted
tokens alike), ``loss_mask`` 1 on the model's tokens only, sampler log-probs 0 on
inserted tokens, ``truncated`` when the episode did not end (budget, slots, or
``max_turns`` reached with the model still mid-conversation). Everything the host
learnt (turn texts, the trajectory, tool counters) is in :class:`Episodes`, for this
process's rows only.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from grpo.core.contracts import Environment, EnvStep
from grpo.engine.parallel.mesh import mesh_processes
from grpo.engine.parallel.rows import gather_processes, local_rows, to_global
from grpo.engine.rollout._sampling import step_keys
from grpo.engine.rollout.decoding import Outputs, draw, effective_chunk, row_key_data, run_chunks
from grpo.engine.rollout.tools.environment import safe_step
from grpo.engine.rollout.sampler import BaseSampler, RolloutOutput, Sampled
from grpo.models.decoder import KVCache
from grpo.models.layers.moe import EXPERT_ID_DTYPE, MoeCall, routed_shape

log = logging.getLogger(__name__)

TOOL_COUNTERS = ("tool_calls", "tool_errors", "tool_timeouts", "tool_truncated")
"""The environments' ``info`` counters an episode sums per row (in :class:`Episodes`'s order)."""

Render = Callable[[Sequence[Mapping[str, Any]], Mapping[str, Any], bool], str]
"""``render(messages, tools, add_generation_prompt) -> text``: the chat template of the
run (tools = the environment's name -> callable, rendered through ``tools=``)."""


def append_bucket(length: int, smallest: int = 8) -> int:
    """The padded length of an append chunk: ``length`` rounded up to a multiple of the
    largest power of two <= ``length / 4`` (at least ``smallest``): under 25% padding (a
    22-token reply is appended as 24, not 32: the append runs the model over every row's
    chunk) and at most four programs per doubling of the length."""
    step = smallest
    while step * 8 <= length:
        step *= 2
    return max(smallest, -(-length // step) * step)


@dataclasses.dataclass
class Episodes:
    """What the host saw of this process's rows (lists in local row order)."""

    messages: list[list[dict[str, Any]]]  # the whole trajectory: openings, turns, replies
    turns: list[list[dict[str, Any]]]  # [{role, text, trained}] after the prompt
    last_text: list[str]  # the model's last turn (what reward functions score)
    num_turns: np.ndarray  # [b] int32 model turns
    tool_calls: np.ndarray  # [b] int32
    tool_errors: np.ndarray  # [b] int32
    tool_timeouts: np.ndarray  # [b] int32
    tool_truncated: np.ndarray  # [b] int32 tool results cut to fit (MAX_RESULT_CHARS)
    tools_s: float = 0.0  # wall time of the environments' steps, summed over turns
    append_s: float = 0.0  # wall time of rendering + the append programs
    turn_s: list[float] = dataclasses.field(default_factory=list)  # each turn's decode


class _TurnState(NamedTuple):
    cache: KVCache
    kv_valid: jax.Array  # [B, C] bool
    prev: jax.Array  # [B] int32, the last sampled token
    live: jax.Array  # [B] bool, still sampling this turn
    ended: jax.Array  # [B] bool, produced a stop token this turn
    count: jax.Array  # [B] int32, tokens sampled this turn
    pos: jax.Array  # [B] int32, RoPE position of the next fed token (real tokens so far)
    out: Outputs  # [B, W] the turn's tokens and log-probs
    routed: jax.Array | None = None  # [B, W, L, k] the experts of each token fed (record_routing)


class TurnOutput(NamedTuple):
    cache: KVCache
    kv_valid: jax.Array  # [B, C] bool
    pos: jax.Array  # [B] int32
    tokens: jax.Array  # [B, W] int32, the turn's tokens (pad after ``count``)
    logprobs: jax.Array  # [B, W] float32, full vocabulary (the sampler/trainer gap metrics)
    count: jax.Array  # [B] int32
    ended: jax.Array  # [B] bool
    steps: jax.Array  # [] int32: the longest row's turn (slots written: steps - 1)
    behaviour: jax.Array | None = None  # [B, W] float32 behaviour log-probs; None: = logprobs (no filter)
    # [B, W, L, k] int16 (record_routing): the experts of the turn's tokens fed in the turn
    # (all but its last, which the append feeds), -1 elsewhere
    routed: jax.Array | None = None


class _Decoding(NamedTuple):
    """The device side of a multi-turn rollout between programs."""

    cache: KVCache
    kv_valid: jax.Array  # [B, C] bool
    logits: jax.Array  # [B, V] the next turn's first logits
    pos: jax.Array  # [B] int32
    start: int  # the next free slot (shared by every row)


@dataclasses.dataclass
class _Talk:
    """The host side of this process's rows of a multi-turn rollout (local row order)."""

    render: Render
    tokenizer: Any
    eos: set[int]
    envs: Sequence[Environment]
    context: list[str]  # each row's text so far, as the template rendered it
    # tokens, full-vocabulary log-probs, behaviour log-probs (None: no filter), trained
    pieces: list[list[tuple[np.ndarray, np.ndarray, np.ndarray | None, bool]]]
    # record_routing: each row's experts [n, L, k] of the tokens fed so far, in feed order
    # (a turn's tokens but its last, then the append: that token and the reply's), which
    # is the transcript's order: laid end to end they cover every token but the row's last
    routed: list[list[np.ndarray]]
    used: np.ndarray  # [b] int64 completion tokens so far (model and inserted)
    active: np.ndarray  # [b] bool still in its episode
    truncated: np.ndarray  # [b] bool
    episodes: Episodes
    encoded: dict[str, list[int]]  # inserted text -> tokens (rows often get the same reply)

    @classmethod
    def open(cls, envs: Sequence[Environment], openings: Sequence[list[dict[str, Any]]], render: Render,
             tokenizer: Any, *, eos: set[int]) -> "_Talk":
        b = len(envs)
        counts = {k: np.zeros(b, np.int32) for k in ("turns",) + TOOL_COUNTERS}
        ep = Episodes([list(m) for m in openings], [[] for _ in range(b)], [""] * b, counts["turns"],
                      *(counts[k] for k in TOOL_COUNTERS))
        return cls(render=render, tokenizer=tokenizer, eos=eos, envs=envs,
                   context=[render(m, env.tools, True) for m, env in zip(openings, envs)],
                   pieces=[[] for _ in range(b)], routed=[[] for _ in range(b)], used=np.zeros(b, np.int64),
                   active=np.ones(b, bool),
                   truncated=np.zeros(b, bool), episodes=ep, encoded={})

    @property
    def last_text(self) -> list[str]:
        return self.episodes.last_text

    def record_turn(self, out: "TurnOutput", budget: np.ndarray, *, last: bool) -> list[int]:
        """Each sampling row's turn added to its transcript; the rows whose environment
        steps next (the others' episodes end here)."""
        tok, lp = local_rows(out.tokens), local_rows(out.logprobs)
        blp = None if out.behaviour is None else local_rows(out.behaviour)
        count, ended = local_rows(out.count), local_rows(out.ended)
        routed = None if out.routed is None else local_rows(out.routed)
        stepping = []
        for r in np.flatnonzero(budget > 0):
            n = int(count[r])
            if routed is not None:
                self.routed[r].append(routed[r, :max(n - 1, 0)])
            if self.record(int(r), tok[r, :n], lp[r, :n], None if blp is None else blp[r, :n], ended=bool(ended[r]),
                           last=last):
                stepping.append(int(r))
        return stepping

    def record(self, r: int, ids: np.ndarray, lp: np.ndarray, blp: np.ndarray | None, *, ended: bool,
               last: bool) -> bool:
        """Row ``r``'s turn (its tokens, full and behaviour log-probs) added to its
        transcript; whether its environment steps next (False: its episode ends here,
        truncated unless the turn ended on a stop token of the sequence). ``ended``: the
        turn stopped on a stop token; ``last``: it was the row's last allowed turn. Both
        engines record a turn through here (the continuous one row by row, as rows finish
        their turns at different chunk boundaries)."""
        ep, tok_ = self.episodes, self.tokenizer
        n = len(ids)
        self.pieces[r].append((ids, lp, blp, True))
        self.used[r] += n
        ep.num_turns[r] += 1
        raw_text = tok_.decode(ids.tolist(), skip_special_tokens=False)
        text = tok_.decode([int(t) for t in ids if int(t) not in self.eos], skip_special_tokens=False)
        ep.last_text[r] = text
        ep.messages[r].append({"role": "assistant", "content": text})
        ep.turns[r].append({"role": "assistant", "text": text, "trained": True})
        self.context[r] += raw_text
        stopped_eos = n > 0 and int(ids[-1]) in self.eos
        if not ended or last:
            # Budget, slots or the turn's cap ran out mid-turn, or the last turn: no reply.
            self.active[r] = False
            self.truncated[r] = not stopped_eos
            return False
        return True

    def step(self, pool: concurrent.futures.Executor, stepping: Sequence[int]) -> list[EnvStep]:
        """The environments of the ``stepping`` rows stepped on their last turns,
        concurrently on ``pool`` (their wall time added to ``tools_s``)."""
        t0 = time.perf_counter()
        steps = list(pool.map(lambda r: safe_step(self.envs[r], self.last_text[r]), stepping))
        self.episodes.tools_s += time.perf_counter() - t0
        return steps

    def add_replies(self, stepping: list[int], steps: Sequence[EnvStep], *, room: int, slots_left: int,
                    inserted: Any) -> dict[int, list[int]]:
        """The environments' replies added to the transcripts: each continuing row's tokens
        to append (its last sampled token, then the reply's). A row ends when its
        environment is done, or the reply and one more model token do not fit in ``room``
        completion tokens or ``slots_left`` slots."""
        ep = self.episodes
        appends: dict[int, list[int]] = {}
        for r, res in zip(stepping, steps):
            for key in TOOL_COUNTERS:
                getattr(ep, key)[r] += int(res.info.get(key, 0) or 0)
            reply = [dict(m) for m in (res.messages or ())]
            if res.done or not reply:
                self.active[r] = False
                continue
            full = self.render(ep.messages[r] + reply, self.envs[r].tools, True)
            ins = inserted(full, self.context[r], self.tokenizer, self.encoded)
            last_model = [int(self.pieces[r][-1][0][-1])]
            # Room for the reply and at least one more model token, in tokens and slots.
            if ins is None or self.used[r] + len(ins) + 1 > room or 1 + len(ins) > slots_left:
                self.active[r] = False
                self.truncated[r] = ins is not None
                continue
            ep.messages[r].extend(reply)
            ep.turns[r].extend({"role": str(m.get("role", "tool")), "text": str(m.get("content", "")),
                                "trained": False} for m in reply)
            self.context[r] = full
            self.pieces[r].append((np.asarray(ins, np.int32), np.zeros(len(ins), np.float32), None, False))
            self.used[r] += len(ins)
            appends[r] = last_model + ins
        return appends


def set_turns(sampler: Any, *, max_turns: int, turn_stop_ids: Sequence[int] | None, max_turn_tokens: int | None,
              conversations: Any) -> None:
    """The multi-turn settings of ``sampler`` (a :class:`MultiTurnSampler` or the
    continuous engine's multi-turn sampler), checked: ``conversations``, ``max_turns``,
    ``max_turn_tokens`` and ``turn_stop_ids`` (the conversations' own when None; never an
    end-of-sequence id)."""
    sampler.conversations = conversations
    if turn_stop_ids is None:
        turn_stop_ids = conversations.turn_stop_ids() if conversations is not None else ()
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if max_turn_tokens is not None and max_turn_tokens < 1:
        raise ValueError(f"max_turn_tokens must be >= 1, got {max_turn_tokens}")
    sampler.max_turns = int(max_turns)
    sampler.max_turn_tokens = None if max_turn_tokens is None else int(max_turn_tokens)
    sampler.turn_stop_ids = tuple(sorted({int(t) for t in turn_stop_ids} - set(sampler.sampling.eos_ids)))


class MultiTurnSampler(BaseSampler):
    """A sampler whose rollouts alternate model turns and environment replies.

    Extra args: ``max_turns`` (model turns per row, >= 1); ``turn_stop_ids``: tokens that
    end a turn without ending the sequence (a tool call's end; default: the
    conversations' own, :meth:`~grpo.engine.rollout.conversations.Conversations.turn_stop_ids`);
    ``max_turn_tokens``: most tokens of one turn (a turn that reaches it without a stop
    token ends its row as truncated, as the budget does; None: the budget alone);
    ``conversations``: the task's environments and chat template
    (:class:`~grpo.engine.rollout.conversations.Conversations`), which :meth:`sample`
    needs. ``kv_segment`` is unused: the turn loop's cache has its final size from the
    start."""

    loss_mask = True
    records_routing = True  # each token's experts, fed in a turn or an append (MoE, ``record_routing``)

    def __init__(self, graphdef: Any, *, max_turns: int, turn_stop_ids: Sequence[int] | None = None,
                 max_turn_tokens: int | None = None, conversations: Any = None, **kwargs: Any):
        super().__init__(graphdef, **kwargs)
        set_turns(self, max_turns=max_turns, turn_stop_ids=turn_stop_ids, max_turn_tokens=max_turn_tokens,
                  conversations=conversations)
        self.start_jit = jax.jit(self._start_impl)  # grows the cache: a new buffer anyway
        self.turn_jit = jax.jit(self._turn_impl, static_argnames=("key_impl",), donate_argnums=(1, 2))
        self.append_jit = jax.jit(self._append_impl, donate_argnums=(1, 2))

    # ------------------------------------------------------------------ sizes

    def slots(self, prompt_length: int) -> int:
        """Cache slots the turns may fill: the prompt, then ``max_turns x N``."""
        return prompt_length + self.max_turns * self.sampling.max_new_tokens

    def width(self) -> int:
        """Sampling steps of one turn's buffer: N rounded up to whole chunks (+ step 0)."""
        n, c = self.sampling.max_new_tokens - 1, self.turn_chunk()
        return (-(-n // c) * c if n > 0 else 0) + 1

    def turn_chunk(self) -> int:
        return max(effective_chunk(self.sampling.max_new_tokens, self.sampling.early_stop_chunk), 1)

    def allocated(self, prompt_length: int) -> int:
        """Slots allocated: :meth:`slots` plus room for the writes of rows that sample
        nothing past the end (a write past the last slot would be clamped onto it)."""
        return self.slots(prompt_length) + max(self.width(), append_bucket(self.sampling.max_new_tokens))

    # ------------------------------------------------------------------ programs

    def _start_impl(self, cache: KVCache, prompt_mask: jax.Array):
        """The prefilled cache grown to its final size, the slot mask and positions."""
        B, Lp = prompt_mask.shape
        cache = self._grow(cache, self.allocated(Lp))
        kv_valid = jnp.zeros((B, cache.max_length), bool).at[:, :Lp].set(prompt_mask != 0)
        pos = prompt_mask.sum(axis=1).astype(jnp.int32)
        return cache, self._constrain(kv_valid, ("batch", "length")), pos

    def _turn_impl(self, params, cache, kv_valid, logits, pos, start, budget, raw_key, turn, *, key_impl):
        """One turn of every row: row b samples at most ``budget[b]`` tokens (0: none),
        feeding token i at slot ``start + i - 1``."""
        s = self.sampling
        model = self._model(params)
        B = logits.shape[0]
        W, C = self.width(), self.turn_chunk()
        # Each turn draws from its own keys: fold_in(row key, turn).
        keys = step_keys(row_key_data(raw_key, key_impl, jnp.arange(B, dtype=jnp.int32)), turn)
        stops = jnp.asarray(s.eos_ids + self.turn_stop_ids, jnp.int32)

        def batch(x, *names):
            return self._constrain(x, ("batch",) + names)

        def record(st: _TurnState, step, logits, live) -> _TurnState:
            drawn = draw(logits, keys, step, live, sampling=s, stops=stops)
            count = st.count + live.astype(jnp.int32)
            return st._replace(
                prev=jnp.where(live, drawn.tokens, st.prev),
                ended=st.ended | drawn.stopped,
                live=live & ~drawn.stopped & (count < budget),
                count=count,
                out=st.out.column(step, drawn),
            )

        first = budget > 0
        routing = self.record_routing
        st = _TurnState(
            cache=cache, kv_valid=kv_valid, prev=batch(jnp.full((B,), s.pad_id, jnp.int32)), live=first,
            ended=batch(jnp.zeros((B,), bool)), count=batch(jnp.zeros((B,), jnp.int32)), pos=pos,
            out=Outputs.blank(B, W, s, lambda x: batch(x, "length")),
            routed=batch(jnp.full((B, W, model.config.num_hidden_layers, model.config.num_experts_per_tok), -1,
                                  EXPERT_ID_DTYPE), "length", None, None) if routing else None,
        )
        st = record(st, jnp.int32(0), logits, first)

        def step(t, st: _TurnState) -> _TurnState:
            slot = start + t - 1
            # The previous token joins the row's cache only while the row goes on sampling;
            # a turn's last token is fed by the append (or never, when the episode ends).
            kv_valid = jax.lax.dynamic_update_slice(st.kv_valid, st.live[:, None], (jnp.int32(0), slot))
            called = model(st.prev[:, None], st.pos[:, None], kv_valid, cache=st.cache, write_index=slot,
                           **({"moe": MoeCall()} if routing else {}))
            hidden, cache = called[:2]
            if routing:  # the experts [L, B, 1, k] of the token fed (the turn's token t - 1), where it joins
                fed = jnp.where(st.live[:, None, None], jnp.transpose(called[2].experts[:, :, 0], (1, 0, 2)), -1)
                st = st._replace(routed=jax.lax.dynamic_update_slice_in_dim(
                    st.routed, fed[:, None].astype(EXPERT_ID_DTYPE), t - 1, axis=1))
            st = st._replace(cache=cache, kv_valid=kv_valid, pos=st.pos + st.live.astype(jnp.int32))
            return record(st, t, model.logits(hidden)[:, 0, :], st.live)

        st = run_chunks(step, st, first=1, n_chunks=(W - 1) // C, chunk=C, going=lambda st: jnp.any(st.live))
        return TurnOutput(
            cache=st.cache, kv_valid=st.kv_valid, pos=st.pos, tokens=st.out.tokens, logprobs=st.out.logprobs,
            count=st.count, ended=st.ended, steps=jnp.max(st.count), behaviour=st.out.behaviour, routed=st.routed,
        )

    def _append_impl(self, params, cache, kv_valid, logits, pos, start, tokens, tmask):
        """Write every row's ``tokens`` [B, L] (real where ``tmask``, right-padded) at slots
        ``start + [0, L)``; returns the cache, slot mask, the next logits (unchanged for
        rows appending nothing), positions and (``record_routing``) the appended tokens'
        experts [B, L, layers, k] (else None)."""
        model = self._model(params)
        real = tmask != 0
        n = real.sum(axis=1).astype(jnp.int32)  # B
        positions = pos[:, None] + jnp.cumsum(real, axis=1).astype(jnp.int32) - 1
        kv_valid = jax.lax.dynamic_update_slice(kv_valid, real, (jnp.int32(0), start))
        called = model(tokens, positions, kv_valid, cache=cache, write_index=start,
                       **({"moe": MoeCall()} if self.record_routing else {}))
        hidden, cache = called[:2]
        routed = None
        if self.record_routing:  # L B T k -> B T L k
            routed = self._constrain(jnp.transpose(called[2].experts, (1, 2, 0, 3)), ("batch", "length", None, None))
        last = jnp.maximum(n - 1, 0)
        h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)  # B 1 D
        new = model.logits(h)[:, 0, :]
        logits = jnp.where((n > 0)[:, None], new, logits)
        return cache, kv_valid, self._constrain(logits, ("batch", "vocab")), pos + n, routed

    # ------------------------------------------------------------------ the turn loop

    def sample(self, params: Any, prompt_tokens: Any, prompt_mask: Any, rng: jax.Array,
               examples: Sequence[Mapping[str, Any]]) -> Sampled:
        """The rows rolled out as conversations, one environment per row of this process
        (made from its example, closed after whatever happens); each row's example comes
        back with its trajectory in ``messages`` (what reward functions read beside the
        last turn)."""
        conv = self.conversations
        if conv is None:
            raise ValueError("this MultiTurnSampler was built without conversations: sample() needs them")
        envs, openings = conv.environments(examples)
        try:
            out, episodes = self.converse(params, prompt_tokens, prompt_mask, rng, envs=envs, openings=openings,
                                          render=conv.memo_render(), tokenizer=conv.tokenizer)
        finally:
            for env in envs:
                env.close()
        examples = [dict(ex, messages=m) for ex, m in zip(examples, episodes.messages)]
        return Sampled(output=out, texts=episodes.last_text, examples=examples, episodes=episodes)

    def lowerings(self, params: Any, *, prompts: int, prompt_length: int, key: jax.Array) -> dict[str, Any]:
        rows, slots = prompts * self.sampling.num_generations, self.allocated(prompt_length)
        scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(self.mesh, PartitionSpec()))

        def start():
            cache, _ = self._abstract_decode_state(params, rows, prompt_length + self._first_slots())
            return self.start_jit.lower(cache, self._rows(rows, prompt_length))

        def turn():
            cache, logits = self._abstract_decode_state(params, rows, slots)
            raw, impl = self._abstract_key(key)
            return self.turn_jit.lower(params, cache, self._rows(rows, slots, dtype=bool), logits, self._rows(rows),
                                       scalar, self._rows(rows), raw, scalar, key_impl=impl)

        def append():
            cache, logits = self._abstract_decode_state(params, rows, slots)
            L = append_bucket(self.sampling.max_new_tokens)
            return self.append_jit.lower(params, cache, self._rows(rows, slots, dtype=bool), logits,
                                         self._rows(rows), scalar, self._rows(rows, L), self._rows(rows, L))

        return {"prefill": lambda: self._lower_prefill(params, prompts, prompt_length), "start": start,
                "decode": turn, "append": append}

    def jitted(self) -> dict[str, list[Any]]:
        return {**super().jitted(), "start": [self.start_jit], "decode": [self.turn_jit], "append": [self.append_jit]}

    def cache_slots(self, prompt_length: int) -> int:
        return self.allocated(prompt_length)

    def _processes(self) -> int:
        """The processes whose rows this rollout holds: those of its mesh (every process,
        or, split by processes in asynchronous GRPO, the rollout side's alone)."""
        return mesh_processes(self.mesh)[1]

    def _global(self, local: np.ndarray) -> jax.Array:
        names = ("batch",) + ("length",) * (local.ndim - 1)
        full = (local.shape[0] * self._processes(),) + local.shape[1:]
        return to_global(local, self.sharding(full, names))

    def _global_max(self, local: np.ndarray) -> int:
        """The maximum of a per-row host value over the rows of every process of the mesh
        (a collective of those processes alone)."""
        return int(gather_processes(np.int64(local.max(initial=0)), self.mesh).max())

    def converse(
        self,
        params: Any,
        prompt_tokens: Any,
        prompt_mask: Any,
        rng: jax.Array,
        *,
        envs: Sequence[Environment],
        openings: Sequence[list[dict[str, Any]]],
        render: Render,
        tokenizer: Any,
        workers: int = 32,
    ) -> tuple[RolloutOutput, Episodes]:
        """The device and host sides of :meth:`sample`, given the environments:
        ``envs``/``openings`` are those of this process's rows (local row order) and the
        messages their ``reset`` gave (what the prompts were rendered from)."""
        pre = self.prefill(params, prompt_tokens, prompt_mask)
        B, Lp = pre.prompt_tokens.shape
        b = len(envs)
        if b * self._processes() != B:
            raise ValueError(f"{b} environments on each of {self._processes()} processes for {B} rows")
        cache, kv_valid, pos = self.start_jit(pre.cache, pre.prompt_mask)
        dev = _Decoding(cache=cache, kv_valid=kv_valid, logits=pre.logits, pos=pos, start=Lp)
        talk = _Talk.open(envs, openings, render, tokenizer, eos=set(self.sampling.eos_ids))
        raw, impl = self.place_key(rng)
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(workers, b)))
        try:
            for turn in range(self.max_turns):
                budget = self._budget(talk, dev.start, self.slots(Lp))
                if self._global_max(budget) <= 0:
                    break
                t0 = time.perf_counter()
                out = self.turn_jit(params, dev.cache, dev.kv_valid, dev.logits, dev.pos, jnp.int32(dev.start),
                                    self._global(budget), raw, jnp.int32(turn), key_impl=impl)
                dev = dev._replace(cache=out.cache, kv_valid=out.kv_valid, pos=out.pos,
                                   start=dev.start + max(int(out.steps) - 1, 0))
                talk.episodes.turn_s.append(time.perf_counter() - t0)
                stepping = talk.record_turn(out, budget, last=turn == self.max_turns - 1)

                steps = talk.step(pool, stepping)

                t2 = time.perf_counter()
                appends = talk.add_replies(stepping, steps, room=self.sampling.max_new_tokens,
                                           slots_left=self.slots(Lp) - dev.start, inserted=self._inserted)
                width = self._global_max(np.asarray([len(v) for v in appends.values()] or [0]))
                if width:
                    dev = self._append(params, dev, appends, width, rows=b, talk=talk)
                talk.episodes.append_s += time.perf_counter() - t2
                if width == 0:
                    break
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return self._compact(pre, talk.pieces, talk.truncated, routed=talk.routed), talk.episodes

    def _budget(self, talk: "_Talk", start: int, cap: int) -> np.ndarray:
        """Tokens each of this process's rows may sample in the next turn (0: none)."""
        budget = np.minimum(self.sampling.max_new_tokens - talk.used, cap - start + 1)
        if self.max_turn_tokens is not None:
            budget = np.minimum(budget, self.max_turn_tokens)
        return np.where(talk.active, budget, 0).astype(np.int32)

    def _append(self, params: Any, dev: "_Decoding", appends: dict[int, list[int]], width: int, *,
                rows: int, talk: "_Talk") -> "_Decoding":
        """Every continuing row's tokens written into the cache (one append program at the
        padded ``width`` of the widest row of every process); recording routing, their
        experts added to ``talk``'s."""
        L = append_bucket(width)
        chunk = np.full((rows, L), self.sampling.pad_id, np.int32)
        cmask = np.zeros((rows, L), np.int32)
        for r, ids in appends.items():
            chunk[r, : len(ids)] = ids
            cmask[r, : len(ids)] = 1
        cache, kv_valid, logits, pos, routed = self.append_jit(
            params, dev.cache, dev.kv_valid, dev.logits, dev.pos, jnp.int32(dev.start), self._global(chunk),
            self._global(cmask))
        jax.block_until_ready(logits)
        if routed is not None:
            routed = local_rows(routed)
            for r, ids in appends.items():
                talk.routed[r].append(routed[r, : len(ids)])
        return _Decoding(cache=cache, kv_valid=kv_valid, logits=logits, pos=pos, start=dev.start + width)

    @staticmethod
    def _inserted(full: str, context: str, tokenizer: Any, memo: dict[str, list[int]]) -> list[int] | None:
        """The tokens the template adds after ``context`` (the row's text so far) in
        ``full`` (the conversation with the reply, rendered up to the next generation
        prompt); None when the template does not render the model's turn as it was sampled
        (the row then ends: what the model would see next is not a continuation of what it
        wrote). ``memo``: inserted text -> tokens, shared by one rollout's rows."""
        if not full.startswith(context):
            log.warning("the chat template re-renders a model turn differently from how it was sampled; "
                        "the episode ends there (rendered %r, sampled %r)", full[-300:], context[-300:])
            return None
        text = full[len(context):]
        if text not in memo:  # rows often get the same reply
            memo[text] = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(memo[text])

    def _compact(self, pre, pieces, truncated: np.ndarray, routed: list[list[np.ndarray]]) -> RolloutOutput:
        g = self._global
        c = compact(pieces, sampling=self.sampling)
        ids = None
        if self.record_routing:  # every fed token's experts at its column, -1 on the row's last and after
            ids = np.full(c["tokens"].shape + routed_shape(self.graphdef), -1, np.int16)
            for r, parts in enumerate(routed):
                fed = np.concatenate(parts) if parts else ids[r, :0]
                ids[r, : len(fed)] = fed
            ids = to_global(ids, self.sharding((ids.shape[0] * self._processes(),) + ids.shape[1:],
                                               ("batch", "length", None, None)))
        return RolloutOutput(
            prompt_tokens=pre.prompt_tokens, prompt_mask=pre.prompt_mask, tokens=g(c["tokens"]), mask=g(c["mask"]),
            lengths=g(c["mask"].sum(axis=1).astype(np.int32)), truncated=g(truncated), logprobs=g(c["logprobs"]),
            loss_mask=g(c["loss_mask"]), behaviour_logprobs=None if c["behaviour"] is None else g(c["behaviour"]),
            routed_experts=ids,
        )


def compact(pieces: Sequence[Sequence[tuple[np.ndarray, np.ndarray, np.ndarray | None, bool]]], *,
            sampling: Any) -> dict[str, np.ndarray | None]:
    """Each row's pieces (:attr:`_Talk.pieces`: tokens, log-probs, behaviour log-probs,
    trained) laid end to end, ``[turn 1, reply 1, turn 2, ...]`` + padding to N: tokens,
    mask (every real token), loss_mask (the model's tokens), logprobs and behaviour (0 on
    inserted tokens; behaviour None without top-k/top-p), all [b, N] (both engines'
    output)."""
    s = sampling
    b, N = len(pieces), s.max_new_tokens
    tokens = np.full((b, N), s.pad_id, np.int32)
    mask = np.zeros((b, N), np.int32)
    loss_mask = np.zeros((b, N), np.int32)
    logprobs = np.zeros((b, N), np.float32)
    behaviour = np.zeros((b, N), np.float32) if s.truncates else None
    for r, row in enumerate(pieces):
        at = 0
        for ids, lp, blp, trained in row:
            n = len(ids)
            tokens[r, at : at + n] = ids
            mask[r, at : at + n] = 1
            loss_mask[r, at : at + n] = int(trained)
            logprobs[r, at : at + n] = lp
            if behaviour is not None and blp is not None:
                behaviour[r, at : at + n] = blp
            at += n
    return {"tokens": tokens, "mask": mask, "loss_mask": loss_mask, "logprobs": logprobs, "behaviour": behaviour}


__all__ = ["Episodes", "MultiTurnSampler", "TurnOutput", "append_bucket", "compact"]
