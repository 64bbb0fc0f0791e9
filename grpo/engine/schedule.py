"""The shape schedule of a run: every shape its packed passes can execute, listed from the
config before step 1, compiled ahead of time in parallel, and a watch that warns of (and
counts) a compile outside the list.

A packed pass (``pack``, ``reference``, ``policy_logprobs``, ``update``, ``unpack``)
compiles once per bins-per-device width ``per`` and head width ``K`` (the step's
micro-batch count is traced): the grid is the run's
(:attr:`~grpo.engine.programs.RunPrograms.shape_grid`, ``train.packing.bins_per_device``
and ``head_buckets``), and :func:`packed_shapes` lists one :class:`ProgramShape` per
program and shape, each lowering the builder's own jitted program on abstract arguments
in exactly the shardings a step gives it. :func:`compile_ahead` compiles them on a thread
pool (XLA compiles in parallel across cores) before step 1; a step's call then hits jit's
cache for the same avals and shardings, so the executables compiled ahead are the ones
that run. The continuous engine's decode compiles once per ``(live slots, page-table
width)`` bucket (``decode_buckets``): with ``ahead: all`` its first session compiles
every bucket in parallel on its own arguments (``compile_decode_buckets``) before its
first chunk, so a later step reaching a new bucket compiles nothing (the listing and the
compile live with the engine: :mod:`grpo.engine.rollout.paged.buckets`).

The rollout, the glue and evaluation have one shape a run and prompt width (the
continuous engine one per admission size and decode bucket too), and a step's prompt width
is the bucket of its longest prompt: :func:`reachable_widths` lists the widths the loaded
split's prompts reach, and :func:`rollout_shapes` the engine's programs at each (its
``shape_lowerings`` where it lists every shape, else its contract's ``lowerings``) on the
engine's own weights (:func:`engine_weights`), with ``to_train``, the glue taking the
prompt width; the trainer adds evaluation's at the eval split's width
(:meth:`~grpo.engine.trainer.Trainer.compile_ahead`).

The packed passes are listed at the prompt widths the run's steps take (:func:`step_widths`,
or with dynamic sampling or partial rollouts every width the split reaches): ``pack``
takes the padded batch, as wide as the step's prompts.

``train.compile.ahead``: ``all`` (and ``auto``) compiles the whole list, the first packed
chain (the update: the longest compile) and the rollout's shapes first
(:func:`submission_order`; step 1 rolls out once the rollout's are compiled:
:meth:`Pending.wait`), ``first`` only the packed passes' widest shape (the most memory a
step needs: an out-of-memory shows before step 1), ``lazy`` none.

:class:`ShapeWatch`: the builder's programs are called through it
(:meth:`ShapeWatch.wrap`); once armed (after step 1, or after the whole list compiled
ahead), a call that compiles logs a warning naming the program and its argument shapes
and counts it (``compile/out_of_list``). Compiles are counted per thread from JAX's
``backend_compile`` event, so a rollout thread compiling its own programs is not blamed
on the update.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

log = logging.getLogger(__name__)

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # one event per XLA compile
_counts = threading.local()
_installed = False
_install_lock = threading.Lock()


def _on_event(event: str, duration: float, **_: Any) -> None:
    if event == BACKEND_COMPILE:
        _counts.n = getattr(_counts, "n", 0) + 1


def compiles() -> int:
    """XLA compiles this thread has run so far (the listener installed on first call)."""
    global _installed
    if not _installed:
        with _install_lock:
            if not _installed:
                jax.monitoring.register_event_duration_secs_listener(_on_event)
                _installed = True
    return getattr(_counts, "n", 0)


@dataclasses.dataclass(frozen=True)
class ProgramShape:
    """One program at one shape of the schedule: ``lower()`` gives its ``jax.stages.Lowered``."""

    program: str
    shape: str  # e.g. "per=2 K=96"
    lower: Callable[[], Any]


def _abstract(x: Any) -> Any:
    """A concrete array's ``ShapeDtypeStruct`` (shape, dtype, sharding, weak type); None kept."""
    if x is None:
        return None
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=getattr(x, "weak_type", False))


def _with_shardings(out_info: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda o, s: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=s), out_info, shardings)


def _outputs(compiled: Any) -> Any:
    """A compiled program's outputs, abstract, in the shardings it gives them."""
    return _with_shardings(compiled.out_info, compiled.output_shardings)


def padded_batch(programs: Any, *, prompt_length: int) -> Any:
    """The abstract padded update batch (an UpdateBatch) of a step whose prompts are
    ``prompt_length`` wide, as :meth:`~grpo.engine.trainer.Trainer.row_batch` builds it:
    every array in the update's row layout."""
    from grpo.engine.training.update import UpdateBatch

    import jax.numpy as jnp

    cfg = programs.config
    b, n, sh = cfg.sequences_per_step, cfg.rollout.max_new_tokens, programs.train_sharding
    arr = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sh)  # noqa: E731
    return UpdateBatch(
        prompt_tokens=arr((b, prompt_length), jnp.int32),
        prompt_mask=arr((b, prompt_length), jnp.int32),
        tokens=arr((b, n), jnp.int32),
        mask=arr((b, n), jnp.int32),
        advantages=arr((b, n) if cfg.train.advantage.credit == "turn" else (b,), jnp.float32),
        old_logprobs=None,
        ref_logprobs=None,
        sampler_logprobs=arr((b, n), jnp.float32) if cfg.loss.mismatch is not None else None,
        dropout_keys=arr((b, 2), jnp.uint32) if programs.lora_dropout else None,
        truncated=arr((b,), jnp.bool_) if cfg.loss.mask_truncated else None,
        loss_mask=arr((b, n), jnp.int32) if programs.multi_turn else None,
        routed_experts=_routed(programs, arr, b, n),
    )


def _routed(programs: Any, arr: Any, b: int, n: int) -> Any:
    """The abstract ``routed_experts`` [B, N, layers, k] int16 of a run recording them."""
    from grpo.engine.training.routing import routed_shape

    import jax.numpy as jnp

    shape = routed_shape(programs.graphdef) if programs.config.model.moe.records else None
    return None if shape is None else arr((b, n) + shape, jnp.int16)


def prompt_lengths(programs: Any) -> tuple[int, ...]:
    """The prompt widths a step's batch can have: the rollout's prompt buckets."""
    from grpo.engine.rollout.prompts import default_buckets

    r = programs.config.rollout
    return tuple(sorted(r.prompt_buckets or default_buckets(r.max_prompt_length)))


def reachable_widths(token_ids: Any, buckets: Any) -> tuple[int, ...]:
    """The prompt widths a batch of these prompts can have, narrowest first: a batch is
    as wide as the bucket of its longest prompt
    (:func:`~grpo.engine.rollout.prompts.bucket_for`), so every prompt's bucket, and no
    other (a split whose prompts all fit the first bucket reaches one width)."""
    from grpo.engine.rollout.prompts import bucket_for

    return tuple(sorted({bucket_for(len(t), buckets) for t in token_ids}))


def step_widths(token_ids: Any, buckets: Any, *, position: int, steps: int, prompts: int,
                seed: int) -> tuple[int, ...]:
    """The prompt widths the next ``steps`` steps take, narrowest first, when each step
    feeds the ``prompts`` prompts that follow the last in the data order from
    ``position`` (:func:`~grpo.engine.rollout.prompts.position_indices`): a step is as wide
    as the bucket of its longest prompt, so the run's widths are known exactly before
    step 1, often fewer than :func:`reachable_widths` (a short run rarely meets the
    split's longest prompts). A step that may feed more (dynamic sampling's rounds, a
    partial-rollouts stream) reaches any of :func:`reachable_widths`."""
    from grpo.engine.rollout.prompts import bucket_for, position_indices

    if steps <= 0:
        return ()
    lengths = np.asarray([len(t) for t in token_ids])
    idx = position_indices(len(lengths), start=position, count=steps * prompts, seed=seed)
    widest = lengths[idx].reshape(steps, prompts).max(axis=1)  # each step's longest prompt
    return tuple(sorted({bucket_for(int(n), buckets) for n in np.unique(widest)}))


def engine_weights(programs: Any, engine: Any, *, params: Any, frozen: Any = None) -> Any:
    """The abstract weights ``engine`` reads for the trained ``params`` (its
    :attr:`~grpo.RolloutEngine.weights`: the builder's weight preparation, then the
    engine's quantization), in the shardings a step hands them over: the state as is, or
    the outputs of the ``reshard``/``merge`` program (compiled here: a step runs it
    anyway). None when the engine reads them on other devices than ``params`` (a rollout
    side of its own, which receives them by the weight sync): nothing of it is listed."""
    from grpo.models.lora import merge_params

    if params is None:  # a process holding no trained weights
        return None
    state = merge_params(params, frozen)
    merging = programs._merging(frozen)
    if programs.rollout.resharded:
        fn = programs.reshard_jit(state)
        prepared = _outputs((fn.lower(params, frozen) if merging else fn.lower(state)).compile())
    elif merging:
        prepared = _outputs(programs.merge_jit(state).lower(params, frozen).compile())
    else:
        prepared = jax.tree.map(_abstract, state)
    leaves = jax.tree.leaves(prepared)
    if not leaves or set(leaves[0].sharding.device_set) != set(engine.mesh.devices.flat):
        return None
    return engine.quantize_weights(prepared)


def rollout_shapes(programs: Any, engine: Any, *, weights: Any, prompts: int, widths: Any, key: Any,
                   prefix: str = "", glue: bool = True) -> list[ProgramShape]:
    """The rollout engine's programs (its ``shape_lowerings``, every shape a rollout runs,
    where it lists them: the continuous engine's; else its contract's
    :meth:`~grpo.RolloutEngine.lowerings`), on the abstract ``weights`` of
    :func:`engine_weights` and the PRNG ``key``'s kind) for ``prompts`` prompts at each
    prompt width of ``widths`` (:func:`reachable_widths`), named ``prefix + name``
    (``eval_`` for evaluation's); with ``glue``, the step's glue taking the prompt width:
    ``to_train`` of the rollout's prompts to the update's row layout."""
    out = []
    every = getattr(engine, "shape_lowerings", None)  # an engine listing each shape of its programs
    for lp in widths:
        if every is not None:
            listed = every(weights, prompts=prompts, prompt_length=lp, key=key)
        else:
            listed = [(name, f"prompt={lp}", lower) for name, lower in
                      engine.lowerings(weights, prompts=prompts, prompt_length=lp, key=key).items()]
        out += [ProgramShape(prefix + name, shape, lower) for name, shape, lower in listed]
        if glue:
            out.append(ProgramShape("to_train", f"prompt={lp}", functools.partial(
                _lower_to_train, programs, engine, prompts=prompts, prompt_length=lp)))
    return out


def _lower_to_train(programs: Any, engine: Any, *, prompts: int, prompt_length: int) -> Any:
    """``to_train`` of a step's prompt tokens [rows, width], as the rollout hands them on
    (rows the step selected: already in the update's layout)."""
    tokens = engine.abstract_output(prompts=prompts, prompt_length=prompt_length).prompt_tokens
    if programs.selects_rows:
        tokens = jax.ShapeDtypeStruct(tokens.shape, tokens.dtype, sharding=programs.train_sharding)
    return programs._to_train_jit().lower(tokens)


def shape_list(programs: Any) -> list[tuple[int, int]]:
    """Every ``(per, K)`` a step can schedule, widest first: the grid's bins-per-device
    widths a step of the run's rows reaches, each with its head widths."""
    from grpo.engine.training.packing import head_widths

    pers, buckets = programs.shape_grid
    reach = programs.schedule_shapes()
    length = programs.config.bin_length
    return [(per, k) for per in sorted((p for p in pers if p in reach), reverse=True)
            for k in sorted(head_widths(slots=per * length, buckets=buckets), reverse=True)]


def packed_shapes(programs: Any, *, params: Any, opt_state: Any, frozen: Any = None, ref_params: Any = None,
                  first: bool = False, widths: Any = None) -> list[ProgramShape]:
    """The packed passes' :class:`ProgramShape` list of ``programs`` (a
    :class:`~grpo.engine.programs.RunPrograms` that packs), lowered on the abstract
    versions of the concrete ``params``/``opt_state``/``frozen``/``ref_params`` (None: no
    reference pass): for every ``(per, K)`` of :func:`shape_list` (``first``: the widest
    only) one chain ``sequence_lengths``, ``pack`` -> ``reference`` -> ``policy_logprobs`` ->
    ``update`` (-> ``unpack``, once per ``per``), for every prompt width of ``widths``
    (the widths the run's steps take, :func:`step_widths`; None: every prompt bucket;
    ``first``: the widest). ``pack`` alone takes the prompt width: a second width's chain
    compiles ``sequence_lengths`` and ``pack`` (the passes after it are the first
    width's, from jit's cache). A chain is one entry (program ``packed``): each pass
    takes the previous one's outputs in the shardings it compiled them to."""
    shapes = shape_list(programs)[:1] if first else shape_list(programs)
    # Built here, once: a step must call the very program objects compiled ahead.
    for build in (programs._lengths_jit, programs._pack_jit, programs._unpack_jit, programs.update,
                  programs.reference, programs.policy_logprobs):
        build()
    state = {k: jax.tree.map(_abstract, v) for k, v in
             dict(params=params, opt_state=opt_state, frozen=frozen, ref_params=ref_params).items()}
    lps = prompt_lengths(programs) if widths is None else tuple(sorted(widths))
    unpacked: set[int] = set()  # unpack compiles once per per: after its widest head's update
    out = []
    for per, k in shapes:
        for lp in (lps[-1:] if first else lps):
            unpack = per not in unpacked
            unpacked.add(per)
            out.append(ProgramShape("packed", f"per={per} K={k} prompt={lp}", functools.partial(
                _chain, programs, state, per=per, head=k, prompt_length=lp, unpack=unpack)))
    return out


class _Chain:
    """The lowered chain of one ``(per, K)``: compiling it compiles every pass in turn."""

    def __init__(self, steps: list[Callable[[Any], Any]]):
        self.steps = steps

    def compile(self) -> Any:
        outs = None
        for step in self.steps:
            outs = step(outs)
        return outs


def _chain(programs: Any, state: dict[str, Any], *, per: int, head: int, prompt_length: int,
           unpack: bool = True) -> _Chain:
    import jax.numpy as jnp

    cfg = programs.config
    replicated = programs.replicated
    m_cap, width, length = programs.scheduled_shape(per)
    idx = [jax.ShapeDtypeStruct((m_cap, width, length), jnp.int32, sharding=replicated)] * 3
    padded = padded_batch(programs, prompt_length=prompt_length)
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    params, opt_state, frozen, ref_params = (state[k] for k in ("params", "opt_state", "frozen", "ref_params"))
    ctx: dict[str, Any] = {}

    def pack(_):
        programs._lengths_jit().lower(padded.prompt_mask, padded.mask).compile()
        packed, ctx["place"] = _outputs(programs._pack_jit().lower(padded, *idx, head=head).compile())
        ctx["ub"] = packed._replace(micro_batches=scalar)

    def reference(_):
        fn = programs.reference()
        if fn is None or ref_params is None:
            return
        ref = _outputs(fn.lower(ref_params, ctx["ub"], frozen).compile())
        ctx["ub"] = ctx["ub"]._replace(ref_logprobs=ref)

    def behaviour(_):
        fn = programs.policy_logprobs()
        if fn is None:
            return
        ub = ctx["ub"]
        ctx["logprobs"] = _outputs(fn.lower(params, ub._replace(dropout_keys=None), frozen).compile())
        if ub.sampler_logprobs is not None:
            fn.lower(params, ub, frozen).compile()

    def update(_):
        fn = programs.update()
        ub = ctx["ub"]
        outs = _outputs(fn.lower(params, opt_state, ub, frozen).compile())
        if cfg.train.ppo_epochs > 1:  # later epochs carry the first one's log-probs
            fn.lower(params, opt_state, ub._replace(old_logprobs=outs[3]), frozen).compile()
        if ctx.get("logprobs") is None:
            ctx["logprobs"] = outs[3]
        if unpack:  # the trainer's log-probs back to rows (the metrics' sampler gap)
            programs._unpack_jit().lower(ctx["logprobs"], ctx["place"], cfg.sequences_per_step,
                                         cfg.rollout.max_new_tokens).compile()

    return _Chain([pack, reference, behaviour, update])


def submission_order(rollout: list[ProgramShape], packed: list[ProgramShape], *,
                     workers: int | None = None) -> list[ProgramShape]:
    """The order the pool takes the ``rollout`` and ``packed`` shapes in: the first packed
    chain first, then the rollout's, then the other chains. A chain holds the update
    (forward, backward and optimizer: a run's longest compile; measured on the tiny CPU
    run, 6.6 of the 10.4 CPU seconds compiled ahead) and step 1's first packed pass waits
    for every shape, so started first it ends first, while the other workers compile the
    rollout's (step 1 rolls out once they are compiled) and the rest; started after them,
    its end is later by the time a worker spent on them. On one worker (``workers``,
    default the cores, as the pool) the rollout's come first: step 1 rolls out while the
    chains compile."""
    if not packed or not rollout or (workers or os.cpu_count() or 1) < 2:
        return rollout + packed
    return packed[:1] + rollout + packed[1:]


def compile_ahead(shapes: list[ProgramShape], *, workers: int | None = None,
                  progress: Callable[[str], None] | None = None) -> dict[str, float]:
    """Compile every shape of ``shapes`` on a pool of ``workers`` threads (default: the
    cores), reporting ``"compiling N programs: i/N"`` to ``progress`` (default: the log)
    as each finishes. Returns ``{"programs": N, "failed": F, "compile_s": wall seconds}``.
    A shape that fails to compile ahead is logged with its error (a step that takes it
    compiles it then, and fails there if it must)."""
    return Pending(shapes, workers=workers, progress=progress).wait()


class Pending:
    """:func:`compile_ahead` running in the background (:func:`start_compile`), the
    shapes submitted to the pool in their order, so the step compiles nothing meanwhile
    that it would compile twice: :meth:`wait` with ``programs`` waits for those alone (the
    rollout's, before step 1 rolls out), without, for every shape (before the first packed
    pass)."""

    def __init__(self, shapes: list[ProgramShape], *, workers: int | None = None,
                 progress: Callable[[str], None] | None = None):
        self._say = progress or log.info
        self._shapes = shapes
        self._result: dict[str, float] | None = None
        self._error: BaseException | None = None
        self._t0 = time.perf_counter()
        self._futures: list[concurrent.futures.Future] = []
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        if shapes:
            n = len(shapes)
            self._say(f"compiling {n} programs: 0/{n}")
            workers = max(1, min(n, workers or os.cpu_count() or 1))
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpo-compile")
            self._futures = [self._pool.submit(lambda s=s: s.lower().compile()) for s in shapes]
        self._thread = threading.Thread(target=self._run, name="grpo-compile-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            n, failed = len(self._shapes), 0
            index = {id(f): s for f, s in zip(self._futures, self._shapes)}
            for done, future in enumerate(concurrent.futures.as_completed(self._futures), start=1):
                error = future.exception()
                if error is not None:  # a step taking this shape compiles it then
                    failed += 1
                    shape = index[id(future)]
                    log.warning("compiling %s (%s) ahead failed, it compiles when a step takes it: %s", shape.program,
                                shape.shape, str(error).splitlines()[0] if str(error) else type(error).__name__)
                self._say(f"compiling {n} programs: {done}/{n}")
            self._result = {"programs": n, "failed": failed, "compile_s": time.perf_counter() - self._t0}
        except BaseException as e:  # noqa: BLE001 (re-raised by wait, on the caller's thread)
            self._error = e
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=False)

    def wait(self, programs: Callable[[str], bool] | None = None) -> dict[str, float] | None:
        """With ``programs`` (a test of a :class:`ProgramShape`'s program name): once those
        shapes compiled (or failed: their step compiles them), None. Without: the
        compile's ``{"programs", "failed", "compile_s"}`` once every shape compiled (its
        error raised here)."""
        if programs is not None:
            concurrent.futures.wait([f for f, s in zip(self._futures, self._shapes) if programs(s.program)])
            return None
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


def start_compile(shapes: list[ProgramShape], **kwargs: Any) -> Pending:
    """:func:`compile_ahead` of ``shapes`` in the background (its keyword arguments)."""
    return Pending(shapes, **kwargs)


class ShapeWatch:
    """Warns of and counts a compile of a watched program once armed (see the module's
    docstring). ``out_of_list``: compiles seen since the last :meth:`take`."""

    def __init__(self) -> None:
        self.armed = False
        self.out_of_list = 0
        self.total = 0

    def wrap(self, name: str, fn: Any) -> "Watched":
        return Watched(name, fn, self)

    def take(self) -> int:
        """The out-of-list compiles since the last call (a step's metric)."""
        n, self.out_of_list = self.out_of_list, 0
        return n

    def saw(self, name: str, args: tuple, kwargs: dict, count: int) -> None:
        self.out_of_list += count
        self.total += count
        log.warning("compiled %s for a shape outside the run's shape schedule (%s): a compile mid-run; "
                    "train.packing.bins_per_device/head_buckets set the schedule", name, describe(args, kwargs))


def describe(args: tuple, kwargs: dict) -> str:
    """The shapes of a call's array arguments, compactly: ``f32[16,48] ... (N arrays)``."""
    leaves = [x for x in jax.tree.leaves((args, kwargs)) if hasattr(x, "shape") and hasattr(x, "dtype")]
    shapes = sorted({f"{np.dtype(x.dtype).name}{list(x.shape)}" for x in leaves})
    statics = [f"{k}={v}" for k, v in kwargs.items() if isinstance(v, (int, str))]
    return ", ".join(statics + shapes[:12] + ([f"... {len(shapes)} shapes"] if len(shapes) > 12 else []))


class Watched:
    """A jitted program called through a :class:`ShapeWatch` (every other attribute, e.g.
    ``lower``, is the program's own)."""

    def __init__(self, name: str, fn: Any, watch: ShapeWatch):
        self._name, self._fn, self._watch = name, fn, watch

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._watch.armed:
            return self._fn(*args, **kwargs)
        before = compiles()
        out = self._fn(*args, **kwargs)
        grew = compiles() - before
        if grew:
            self._watch.saw(self._name, args, kwargs, grew)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)


__all__ = [
    "BACKEND_COMPILE", "Pending", "ProgramShape", "ShapeWatch", "Watched", "compile_ahead", "compiles", "describe",
    "engine_weights", "packed_shapes", "padded_batch", "prompt_lengths", "reachable_widths", "rollout_shapes",
    "shape_list", "start_compile", "step_widths", "submission_order",
]
