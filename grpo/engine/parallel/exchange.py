"""The rendezvous between the two sides of a multi-process asynchronous run: the
rollout side on one process's devices, the update side on another's, and one jitted
program over both that swaps what each side hands it.

Why a program and not a ``device_put``: with the installed JAX (0.10.2, CPU, gloo) a
``device_put`` between processes needs ``jax_cross_host_transfer_socket_address`` and
then only moves an array between equal shardings (a resharding transfer fails with
"Cannot reshard an input that is not fully addressable"). A program over a global mesh
of both sides' devices, shaped ``(side=2, n)``, whose input is stacked on the ``side``
axis (each process supplies its own side's shards with
``jax.make_array_from_single_device_arrays``) and whose output is the same stack
reversed, needs neither: XLA moves the blocks with its own collectives, and every process
runs it, in the same order, as the multi-controller model wants (measured on CPU, 2
processes x 4 devices: the swap arrives bit for bit, and each side's own programs on its
local devices run between swaps without the other process taking part).

What is swapped is bytes: each side's payload (named arrays of any dtype and shape, the
two sides' differing) is packed into one byte vector, so one program of one shape
serves weights one way and rollouts the other. A fixed-size header goes first (one
program of its own): the payload's layout, the side's metadata (JSON), its stop flag and
its failure, if any; so both sides learn the byte count to pad to before the payload
program, a stop on one side (SIGTERM) stops both at the same step, and a failure on one
side raises :class:`RemoteFailure` with its message on the other instead of leaving it
waiting in a collective.

Limits: one process a side (each swaps its whole payload through its own devices); the
payload goes through the host on both ends (packing), which on an accelerator costs a
device-to-host copy of the weights per step.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# The header's bytes: the JSON of the layout, metadata, stop flag and failure.
HEADER_BYTES = 1 << 16
SIDES = ("rollout", "update")


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


class SideExchange:
    """The swap between the rollout side (``rollout`` devices, one process) and the
    update side (``update`` devices, another): both processes call :meth:`exchange` (or
    :meth:`fail`) the same number of times, in the same order."""

    def __init__(self, rollout: Sequence[jax.Device], update: Sequence[jax.Device]):
        k = min(len(rollout), len(update))
        rows = [list(rollout[:k]), list(update[:k])]
        owners = [{d.process_index for d in row} for row in rows]
        if any(len(o) != 1 for o in owners) or owners[0] == owners[1]:
            raise ValueError(f"the exchange needs each side on one process of its own; the sides' processes "
                             f"are {[sorted(o) for o in owners]}")
        me = jax.process_index()
        if me not in owners[0] | owners[1]:
            raise ValueError(f"process {me} holds neither side's devices")
        self.side = 0 if me in owners[0] else 1
        self.name = SIDES[self.side]
        self.local = rows[self.side]  # [k], this process's devices, in mesh order
        self.k = k
        self.mesh = Mesh(np.array(rows, dtype=object), ("side", "n"))
        self._header_sharding = NamedSharding(self.mesh, P("side", None))  # each row's block on all its n devices
        self._data_sharding = NamedSharding(self.mesh, P("side", "n"))  # [2, k * c]: chunk j on device j
        self._swap_header = jax.jit(lambda x: x[::-1], out_shardings=self._header_sharding)
        self._swap_data = jax.jit(lambda x: x[::-1], out_shardings=self._data_sharding)

    def _swap(self, local: np.ndarray, sharding: NamedSharding, program) -> np.ndarray:
        """Program ``program`` over the stack of both sides' ``local`` vectors ([m] uint8
        each); the other side's vector back. Header: each device holds the whole vector;
        data: device j the j-th of ``k`` equal chunks."""
        split = sharding is self._data_sharding
        blocks = np.split(local[None], self.k, axis=1) if split else [local[None]] * self.k
        shards = [jax.device_put(b, d) for b, d in zip(blocks, self.local)]
        stacked = jax.make_array_from_single_device_arrays((2, local.shape[0]), sharding, shards)
        out = program(stacked)
        mine = sorted(out.addressable_shards, key=lambda s: s.index[1].start or 0)
        if not split:
            return np.asarray(mine[0].data)[0]
        return np.concatenate([np.asarray(s.data)[0] for s in mine])

    def _headers(self, header: dict[str, Any]) -> dict[str, Any]:
        theirs = read_header(self._swap(header_bytes(header), self._header_sharding, self._swap_header))
        if theirs.get("side") not in (None, 1 - self.side):
            raise RemoteFailure(f"the exchange's other end is the {SIDES[self.side]} side too")
        return theirs

    def exchange(self, payload: Mapping[str, Any], meta: Any = None, *, stop: bool = False
                 ) -> tuple[dict[str, np.ndarray], Any, bool]:
        """Swap ``payload`` (named arrays) and ``meta`` (JSON) with the other side:
        its payload, its meta, and whether either side asked to stop. Raises
        :class:`RemoteFailure` when the other side called :meth:`fail`."""
        data, layout = pack(payload)
        theirs = self._headers({"side": self.side, "layout": layout, "bytes": int(data.size), "meta": meta,
                                "stop": bool(stop)})
        if "error" in theirs:
            raise RemoteFailure(f"the {SIDES[1 - self.side]} side failed: {theirs['error']}")
        # Both sides pad to the same length: the larger payload, rounded up to k chunks.
        n = max(data.size, int(theirs["bytes"]), 1)
        n = -(-n // self.k) * self.k
        padded = np.zeros(n, np.uint8)
        padded[: data.size] = data
        got = self._swap(padded, self._data_sharding, self._swap_data)
        return unpack(got, theirs["layout"]), theirs.get("meta"), bool(stop or theirs.get("stop"))

    def fail(self, message: str) -> None:
        """Tell the other side this one failed (it raises :class:`RemoteFailure` in its
        pending :meth:`exchange`); call it where that exchange would have been called."""
        theirs = self._headers({"side": self.side, "error": str(message)})
        del theirs  # whatever the other side sent: this side is stopping


__all__ = ["HEADER_BYTES", "RemoteFailure", "SideExchange", "header_bytes", "pack", "read_header", "unpack"]
