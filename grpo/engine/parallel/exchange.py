"""The rendezvous between the two sides of a multi-process asynchronous run: the
rollout side on some processes' devices, the update side on the others', any number of
processes a side, and programs over both sides' devices that move what each side hands
them to the other.

Why programs and not a ``device_put``: with the installed JAX (0.10.2, CPU, gloo) a
``device_put`` between processes needs ``jax_cross_host_transfer_socket_address`` and
then only moves an array between equal shardings (a resharding transfer fails with
"Cannot reshard an input that is not fully addressable"). A program over a mesh of every
device of both sides (one axis, ``d``, rollout devices first) whose input is stacked on
``d`` (each process supplies its own devices' blocks with
``jax.make_array_from_single_device_arrays``) needs neither: XLA moves the blocks with
its own collectives, every process runs it, in the same order, as the multi-controller
model wants, and each side's own programs on its own devices run between swaps without
the other side's processes taking part (measured on CPU, gloo: 2 processes x 4 devices,
and 4 processes x 2 devices split 2 + 2 and 1 + 3).

The move is point to point (:func:`route`): rollout device ``i`` receives the block of
update device ``i mod n_update`` and update device ``j`` that of rollout device
``j mod n_rollout``, in as many ``ppermute`` rounds as the larger side needs (a device
sends at most once a round). Every device of a side holds the side's whole block, so
each receiver gets a whole copy.

What is swapped:

- bytes (:meth:`SideExchange.exchange`): each side's payload (named arrays of any dtype
  and shape, the two sides' differing) packed into one byte vector, so one program of
  one shape serves rollouts one way and state the other. A fixed-size header goes first,
  gathered from every process of both sides (one program of its own): the payload's
  layout, the side's metadata (JSON), its stop flag and its failure, if any; so both
  sides learn the byte count to pad to before the payload program, a stop on one process
  stops all at the same step, and a failure on one process raises
  :class:`RemoteFailure` with its message on every other instead of leaving them waiting
  in a collective;
- device arrays (:meth:`SideExchange.swap_arrays`): the weights, from the update mesh to
  the rollout side's devices with no host round trip (each leaf made whole on the update
  side's devices first, on device).

A failure in the exchange reaches only the processes that enter it. With several
processes a side, the failing process's own side may be elsewhere: in a collective of the
side alone (the rollout side gathering rewards, say), waiting for the failed process,
which waits in the exchange for them. So :meth:`SideExchange.fail` also posts the
failure to the coordination service's key-value store, and in a run every process
watches it (:class:`FailureWatch`): a process that has not stopped
:data:`FAILURE_GRACE_S` after a failure was posted prints the one message (the side, the
process and the cause) and exits (status 1).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import threading
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

log = logging.getLogger(__name__)

# The header's bytes: the JSON of the layout, metadata, stop flag and failure.
HEADER_BYTES = 1 << 16
SIDES = ("rollout", "update")
# Where a failure is posted (a key per process) in the coordination service's store.
FAILURE_KEYS = "grpo_async_failure/"
FAILURE_GRACE_S = 3.0
"""How long a process may go on stopping by itself (the failure reached it in an
exchange) after a failure was posted, before :class:`FailureWatch` ends it."""


class RemoteFailure(RuntimeError):
    """The other side failed (its message), or the two sides disagree on the exchange."""


def pack(payload: Mapping[str, Any]) -> tuple[np.ndarray, list[list[Any]]]:
    """``payload``'s arrays as one byte vector (in name order) and its layout
    ``[[name, shape, dtype], ...]``: what :func:`unpack` reads them back from, bit for bit."""
    layout, parts = [], []
    for name in sorted(payload):
        x = np.asarray(payload[name])
        layout.append([name, list(x.shape), str(x.dtype)])
        parts.append(np.ascontiguousarray(x.reshape(-1)).view(np.uint8))
    data = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    return data, layout


def unpack(data: np.ndarray, layout: Sequence[Sequence[Any]]) -> dict[str, np.ndarray]:
    """The arrays :func:`pack` wrote into ``data`` (which may carry padding after them)."""
    out, at = {}, 0
    for name, shape, dtype in layout:
        dt = np.dtype(jax.numpy.dtype(dtype))
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        out[name] = data[at : at + n].view(dt).reshape(shape).copy()
        at += n
    return out


def _plain(x: Any) -> Any:
    """numpy scalars (a metrics row's) as the Python numbers JSON writes."""
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON")


def header_bytes(header: Mapping[str, Any], *, size: int = HEADER_BYTES) -> np.ndarray:
    """``header`` as JSON in a ``[size]`` uint8 buffer (length-prefixed, 4 bytes little
    endian); a header too long becomes a failure header, so the other side still learns
    why the exchange stopped."""
    text = json.dumps(header, sort_keys=True, default=_plain).encode()
    if len(text) + 4 > size:
        text = json.dumps({"error": f"the exchange header is {len(text)} bytes, over its {size - 4}"}).encode()
    out = np.zeros(size, np.uint8)
    out[:4] = np.frombuffer(np.uint32(len(text)).tobytes(), np.uint8)
    out[4 : 4 + len(text)] = np.frombuffer(text, np.uint8)
    return out


def read_header(buf: np.ndarray) -> dict[str, Any]:
    """The header :func:`header_bytes` wrote."""
    n = int(np.frombuffer(buf[:4].tobytes(), np.uint32)[0])
    return json.loads(buf[4 : 4 + n].tobytes())


def route(n_rollout: int, n_update: int) -> tuple[list[list[tuple[int, int]]], np.ndarray]:
    """The point-to-point rounds of a swap over ``n_rollout + n_update`` devices (rollout
    devices first): each round's ``(source, destination)`` pairs (a device sends and
    receives at most once a round), and the round each device receives in."""
    rollout, update = list(range(n_rollout)), list(range(n_rollout, n_rollout + n_update))
    rounds: list[list[tuple[int, int]]] = []
    when = np.zeros(n_rollout + n_update, np.int32)
    for src, dst in ((update, rollout), (rollout, update)):
        for i, d in enumerate(dst):
            t = i // len(src)
            while len(rounds) <= t:
                rounds.append([])
            rounds[t].append((src[i % len(src)], d))
            when[d] = t
    return rounds, when


class SideExchange:
    """The swap between the rollout side (``rollout`` devices, of one or more processes)
    and the update side (``update`` devices, of the others): every process calls
    :meth:`exchange` (or :meth:`fail`) and :meth:`swap_arrays` the same number of times,
    in the same order. Every process of a side hands in the same payload."""

    def __init__(self, rollout: Sequence[jax.Device], update: Sequence[jax.Device]):
        owners = [sorted({d.process_index for d in side}) for side in (rollout, update)]
        if set(owners[0]) & set(owners[1]):
            raise ValueError(f"the exchange needs each side on processes of its own; the sides' processes "
                             f"are {owners}")
        me = jax.process_index()
        if me not in owners[0] + owners[1]:
            raise ValueError(f"process {me} holds neither side's devices")
        self.side = 0 if me in owners[0] else 1
        self.name = SIDES[self.side]
        self.processes = owners  # each side's processes
        self.devices = list(rollout) + list(update)
        self.sizes = (len(rollout), len(update))
        self.local = [d for d in self.devices if d.process_index == me]  # in mesh order
        log.info("%s", self.describe())
        self.mesh = Mesh(np.array(self.devices, dtype=object), ("d",))
        self._blocks = NamedSharding(self.mesh, P("d"))
        self._gather = jax.jit(lambda x: x, out_shardings=NamedSharding(self.mesh, P()))
        rounds, when = route(*self.sizes)

        def move(x):  # [1, ...] a device: the block its partner on the other side sent
            t = jnp.asarray(when)[jax.lax.axis_index("d")]
            out = jnp.zeros_like(x)
            for i, pairs in enumerate(rounds):
                out = jnp.where(t == i, jax.lax.ppermute(x, "d", pairs), out)
            return out

        self._move = jax.jit(jax.shard_map(lambda tree: jax.tree.map(move, tree), mesh=self.mesh,
                                           in_specs=P("d"), out_specs=P("d")))
        self.watch: FailureWatch | None = None

    def watch_failures(self, **kwargs: Any) -> "SideExchange":
        """Start this process's :class:`FailureWatch` (a run's exchange; ``kwargs``: its
        own); :meth:`close` stops it."""
        self.watch = FailureWatch(**kwargs)
        return self

    def close(self) -> None:
        """The run ended: stop watching for failures, unless one was posted (then the
        watch goes on, and ends this process if its exit hangs on a process that waits
        for the failed one)."""
        if self.watch is not None:
            self.watch.stop()

    def describe(self) -> str:
        """Which processes are on which side, and this one's: logged by every process at
        start-up, so that a process the runtime reports dead (JAX's coordination service:
        ``Task N heartbeat timeout``, after ``distributed.heartbeat_timeout_s``, when it
        stops every other process) names its side in every process's log."""
        return (f"async GRPO split by processes: processes {self.processes[0]} roll out, processes "
                f"{self.processes[1]} update; process {jax.process_index()} is on the {self.name} side (a process "
                f"that dies is reported by the runtime as 'Task <process> heartbeat timeout', and every other "
                f"process stops)")

    def _stacked(self, blocks: Sequence[Any], shape: tuple[int, ...]) -> jax.Array:
        """The ``[D, *shape]`` array of this process's ``blocks`` (one ``[1, *shape]`` a
        local device)."""
        return jax.make_array_from_single_device_arrays((len(self.devices),) + tuple(shape), self._blocks, list(blocks))

    def _host_stack(self, local: np.ndarray) -> jax.Array:
        return self._stacked([jax.device_put(local[None], d) for d in self.local], local.shape)

    def _headers(self, header: dict[str, Any]) -> dict[str, Any]:
        """Every process's header gathered; the other side's (its processes' agree), or
        :class:`RemoteFailure` with the first failure another process sent."""
        every = np.asarray(self._gather(self._host_stack(header_bytes(header))).addressable_data(0))
        first = {}
        for i, d in enumerate(self.devices):
            first.setdefault(d.process_index, i)
        me, theirs = jax.process_index(), None
        for p, i in sorted(first.items()):
            h = read_header(every[i])
            if p != me and "error" in h:
                side = SIDES[0] if p in self.processes[0] else SIDES[1]
                if "error" not in header:
                    raise RemoteFailure(f"the {side} side failed (process {p}): {h['error']}")
            if p in self.processes[1 - self.side] and theirs is None:
                theirs = h
        assert theirs is not None
        if theirs.get("side") not in (None, 1 - self.side):
            raise RemoteFailure(f"the exchange's other end is the {SIDES[self.side]} side too")
        return theirs

    def exchange(self, payload: Mapping[str, Any], meta: Any = None, *, stop: bool = False
                 ) -> tuple[dict[str, np.ndarray], Any, bool]:
        """Swap ``payload`` (named arrays) and ``meta`` (JSON) with the other side:
        its payload, its meta, and whether either side asked to stop. Raises
        :class:`RemoteFailure` when another process called :meth:`fail`."""
        data, layout = pack(payload)
        theirs = self._headers({"side": self.side, "layout": layout, "bytes": int(data.size), "meta": meta,
                                "stop": bool(stop)})
        # Both sides pad to the same length: the larger payload.
        n = max(data.size, int(theirs["bytes"]), 1)
        padded = np.zeros(n, np.uint8)
        padded[: data.size] = data
        got = np.asarray(self._move(self._host_stack(padded)).addressable_data(0))[0]
        return unpack(got, theirs["layout"]), theirs.get("meta"), bool(stop or theirs.get("stop"))

    def swap_arrays(self, tree: Any) -> Any:
        """The update side's device arrays ``tree`` onto the rollout side's devices, with
        no host round trip: on the update side ``tree`` is the arrays (on its mesh), on
        the rollout side anything of the same structure, shapes and dtypes (it receives).
        Returns, on the rollout side, each leaf whole on each of this process's devices
        (``[device][leaf]`` single-device arrays, in :attr:`local` order); on the update
        side None."""
        leaves, treedef = jax.tree.flatten(tree)
        if self.side == 1:  # each leaf whole on every update device (one program, on device), then its blocks
            whole = _replicate_tree(leaves[0].sharding.mesh)(leaves) if leaves else []
            mine = [[_row(x, d) for d in self.local] for x in whole]
        else:
            mine = [[jnp.zeros((1,) + tuple(x.shape), x.dtype, device=d) for d in self.local] for x in leaves]
        stacked = [self._stacked(blocks, x.shape) for blocks, x in zip(mine, leaves)]
        moved = self._move(jax.tree.unflatten(treedef, stacked))
        if self.side == 1:
            return None
        by_device = {d: [] for d in self.local}
        for x in jax.tree.leaves(moved):
            for s in x.addressable_shards:
                by_device[s.device].append(s.data[0])
        return [by_device[d] for d in self.local]

    def fail(self, message: str) -> None:
        """Tell every other process this one failed (each raises :class:`RemoteFailure`
        in its pending :meth:`exchange`); call it where that exchange would have been
        called. The failure is posted first (:func:`post_failure`): a process of either
        side that is not in the exchange learns it from its :class:`FailureWatch`."""
        post_failure(self.name, str(message))
        try:
            self._headers({"side": self.side, "error": str(message)})
        except RemoteFailure:
            pass  # another process failed too: this side is stopping anyway


def _client() -> Any:
    """This process's coordination-service client, or None (one process)."""
    from jax._src import distributed as _state

    return _state.global_state.client


def post_failure(side: str, message: str) -> None:
    """``message`` (this process's failure, on ``side``) in the coordination service's
    key-value store, where :class:`FailureWatch` reads it."""
    client = _client()
    if client is None:
        return
    try:
        client.key_value_set(f"{FAILURE_KEYS}{jax.process_index()}", json.dumps({"side": side, "error": message}))
    except Exception as err:  # noqa: BLE001 - posted already, or the service is gone: the exchange still tells
        log.warning("could not post the failure to the coordination service: %s", err)


def failure_message(entries: Sequence[tuple[str, str]]) -> str | None:
    """The one message of the failures posted (``(key, JSON)`` pairs of the store), the
    lowest process's: ``the <side> side failed (process <p>): <cause>``; None when none."""
    posted = sorted((int(k.rsplit("/", 1)[-1]), json.loads(v)) for k, v in entries)
    if not posted:
        return None
    p, failure = posted[0]
    return f"the {failure['side']} side failed (process {p}): {failure['error']}"


class FailureWatch:
    """A thread that polls the failures posted by any process (:func:`post_failure`)
    every ``poll_s``; once one is, it gives this process ``grace_s`` to stop by itself
    (the failure reached it in an exchange), then prints ``Error: <the message>`` to
    stderr and exits the process (status 1): it may be waiting in a collective that the
    failed process will never enter. :meth:`stop` ends the watch (the run ended)."""

    def __init__(self, *, grace_s: float = FAILURE_GRACE_S, poll_s: float = 0.5):
        self.client, self.grace_s, self.poll_s = _client(), grace_s, poll_s
        self._stop = threading.Event()
        self._thread = None
        if self.client is not None:
            self._thread = threading.Thread(target=self._run, name="grpo-failure-watch", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                message = failure_message(self.client.key_value_dir_get(FAILURE_KEYS))
            except Exception:  # noqa: BLE001 - the service going away: the runtime reports that itself
                continue
            if message is None:
                continue
            # Process 0 holds the coordination service: it goes last, so that the others
            # print their message before the service's end stops them.
            if self._stop.wait(self.grace_s + (1.0 if jax.process_index() == 0 else 0.0)):
                return
            print(f"Error: {message}. The failed process's output says where.", file=sys.stderr, flush=True)
            os._exit(1)

    def stop(self) -> None:
        """End the watch, unless a failure was posted (a failing run's exit may wait on a
        process that waits for the failed one: the watch still ends this process then)."""
        if self._thread is None:
            return
        try:
            if failure_message(self.client.key_value_dir_get(FAILURE_KEYS)) is not None:
                return
        except Exception:  # noqa: BLE001 - the service is gone: nothing more to watch
            pass
        self._stop.set()
        self._thread.join()


@functools.lru_cache(maxsize=None)
def _replicate_tree(mesh: Mesh):
    """A program that makes every leaf of a tree on ``mesh`` whole on each of its devices."""
    return jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, P()))


def _row(x: jax.Array, device: jax.Device) -> jax.Array:
    """``x``'s copy on ``device`` as a ``[1, ...]`` block (on that device)."""
    data = next(s.data for s in x.addressable_shards if s.device == device)
    return jax.device_put(data[None], device)


__all__ = ["FAILURE_GRACE_S", "FailureWatch", "HEADER_BYTES", "RemoteFailure", "SideExchange", "failure_message",
           "header_bytes", "pack", "post_failure", "read_header", "route", "unpack"]
