"""TPU topologies by the names users type, and the chips' published limits.

``grpo plan`` compiles for a TPU pod on any machine: with ``libtpu`` installed,
``jax.experimental.topologies.get_topology_desc`` describes a pod's devices (with their
process indices) without any TPU present, and programs lowered on a ``Mesh`` of those
devices are compiled by the real TPU compiler.

Names: ``v6e-8``, ``v6e-16``, ``v5e-8``, ``v5p-8``, ``v4-8``, ... (Cloud TPU's accelerator
types) or a raw ``v6e:2x4`` / ``v5p:2x2x2`` topology. The number after a v4/v5p type
counts TensorCores (two per chip, one JAX device per chip in megacore mode); after a
v5e/v6e type it counts chips. v5e/v6e hosts hold 8 chips when the slice has at most 8
(one host), else 4; v4/v5p hosts hold 4 chips.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import re
from typing import Any

from grpo.core.errors import UserError

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """Per-chip limits used for fits and the roofline.

    ``hbm_bytes`` is the HBM the TPU compiler lets a program use (what its
    ``exceeds available HBM (...)`` message reports; measured with libtpu 0.0.52 by
    compiling a program too large for one chip); ``hbm_physical`` the published capacity.
    ``bf16_flops`` and ``hbm_bandwidth`` are the published peaks (per chip);
    ``ici_bandwidth`` the published bidirectional inter-chip interconnect bandwidth per
    chip (all its ICI ports, both directions). A chip takes in at most half of it, so the
    plan's ICI time is ``bytes one chip receives / (ici_bandwidth / 2)``.
    ``dcn_bandwidth`` the data-center network bandwidth per chip, one direction (a host's
    NICs shared by its chips), which carries what crosses TPU slices: a multi-slice
    program's collectives, and the weights of an asynchronous run whose two sides are on
    different slices. ``dcn_source`` says where that figure comes from.
    """

    generation: str
    bf16_flops: float  # FLOP/s
    hbm_bandwidth: float  # bytes/s
    hbm_bytes: int  # usable, as the compiler reports it
    hbm_physical: int
    source: str
    ici_bandwidth: float  # bytes/s, bidirectional, per chip
    dcn_bandwidth: float = 0.0  # bytes/s per chip, one direction
    dcn_source: str = ""


# Published figures: Cloud TPU system architecture pages (cloud.google.com/tpu/docs/<gen>).
# ICI: "Bidirectional inter-chip interconnect (ICI) bandwidth (per chip)" on the v6e (800
# GBps), v5e (400 GBps) and v5p (1200 GBps) pages. The v4 page publishes no per-chip ICI
# figure; v5p's 1200 GBps is assumed (an upper bound: v4's links are not faster).
# DCN, per chip and direction (Gbps / 8 = GB/s):
# - v5p: "Data center network (DCN) bandwidth per chip (Gbps): 50" (the v5p page);
# - v5e: "Per-host NIC configuration: 2 x 100 Gbps NIC" for 8 chips a host, 25 Gbps a chip
#   (the same as its "Data center network bandwidth per Pod: 6.4 Tbps" over 256 chips);
# - v6e: "Per-host NIC configuration: 4 x 200 Gbps NIC" for 8 chips a host, 100 Gbps a
#   chip (the same as its "Data center network bandwidth per Pod: 25.6 Tbps" over 256);
# - v4: the v4 page publishes no DCN figure; v5p's 50 Gbps a chip is assumed.
CHIPS: dict[str, ChipSpec] = {
    "v6e": ChipSpec("v6e", 918e12, 1640e9, int(31.24 * GiB), 32 * GiB, "https://cloud.google.com/tpu/docs/v6e",
                    800e9, 100e9 / 8, "https://cloud.google.com/tpu/docs/v6e (4 x 200 Gbps NICs per 8-chip host)"),
    "v5p": ChipSpec("v5p", 459e12, 2765e9, int(95.73 * GiB), 95 * GiB, "https://cloud.google.com/tpu/docs/v5p",
                    1200e9, 50e9 / 8, "https://cloud.google.com/tpu/docs/v5p (DCN bandwidth per chip: 50 Gbps)"),
    "v5e": ChipSpec("v5e", 197e12, 819e9, int(15.75 * GiB), 16 * GiB, "https://cloud.google.com/tpu/docs/v5e",
                    400e9, 25e9 / 8, "https://cloud.google.com/tpu/docs/v5e (2 x 100 Gbps NICs per 8-chip host)"),
    "v4": ChipSpec("v4", 275e12, 1200e9, int(30.75 * GiB), 32 * GiB, "https://cloud.google.com/tpu/docs/v4",
                   1200e9, 50e9 / 8, "assumed: v5p's 50 Gbps per chip (the v4 page publishes none)"),
}

# (generation -> sizes users may type after the dash) and the topology of each.
_GRID_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_GRID_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
            512: "8x8x8"}


def _named() -> dict[str, str]:
    out = {}
    for gen in ("v6e", "v5e"):
        for chips, grid in _GRID_2D.items():
            out[f"{gen}-{chips}"] = f"{gen}:{grid}"
    for gen in ("v5p", "v4"):
        for chips, grid in _GRID_3D.items():
            out[f"{gen}-{2 * chips}"] = f"{gen}:{grid}"  # the type counts TensorCores
    return out


NAMED_TOPOLOGIES: dict[str, str] = _named()
_RAW = re.compile(r"^(v6e|v5e|v5p|v4):(\d+)x(\d+)(?:x(\d+))?$")


@dataclasses.dataclass(frozen=True)
class TpuTopology:
    """A resolved topology name."""

    name: str  # as typed
    raw: str  # e.g. "v6e:2x4"
    chip: ChipSpec
    chips: int
    kwargs: tuple[tuple[str, Any], ...]  # extra get_topology_desc arguments

    def hosts(self) -> tuple[int, int]:
        """``(processes, devices per process)`` of the slice by the rule above (one JAX
        device per chip), without libtpu: what ``grpo config validate --processes P
        --local-devices L`` checks a plan's topology as."""
        per_host = self.chips if self.chip.generation in ("v6e", "v5e") and self.chips <= 8 else min(4, self.chips)
        return self.chips // per_host, per_host

    def devices(self) -> list[Any]:
        """The pod's devices (``TpuDevice`` with process indices), from libtpu."""
        require_libtpu()
        import os

        # Describing a topology loads libtpu without claiming any TPU; without this, a
        # second process (a plan beside a run on a TPU VM, parallel tests) hits libtpu's
        # single-process lockfile.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        from jax.experimental import topologies

        try:
            desc = topologies.get_topology_desc(platform="tpu", topology_name=self.raw, **dict(self.kwargs))
        except Exception as err:  # noqa: BLE001 - libtpu's own message, one line
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UserError(f"libtpu cannot describe topology {self.name!r} ({self.raw}): {first}") from None
        return list(desc.devices)

    def processes(self, devices: list[Any]) -> tuple[int, ...]:
        per = collections.Counter(d.process_index for d in devices)
        return tuple(per[p] for p in sorted(per))


def valid_names() -> str:
    return ", ".join(NAMED_TOPOLOGIES) + "; or a raw topology such as v6e:2x4 or v5p:2x2x2"


def parse_topology(name: str) -> TpuTopology:
    """``v6e-8`` / ``v6e:2x4`` -> :class:`TpuTopology`; unknown names list the valid ones."""
    text = str(name).strip()
    raw = NAMED_TOPOLOGIES.get(text.lower(), text.lower())
    m = _RAW.match(raw)
    if not m:
        raise UserError(f"Unknown TPU topology {name!r}. Valid names: {valid_names()}.")
    gen = m.group(1)
    dims = [int(g) for g in m.groups()[1:] if g is not None]
    if gen in ("v5p", "v4") and len(dims) != 3 or gen in ("v6e", "v5e") and len(dims) != 2:
        want = "three dimensions (e.g. v5p:2x2x2)" if gen in ("v5p", "v4") else "two dimensions (e.g. v6e:2x4)"
        raise UserError(f"TPU topology {name!r}: {gen} topologies have {want}. Valid names: {valid_names()}.")
    if any(d < 1 for d in dims):
        raise UserError(f"TPU topology {name!r} has a zero dimension. Valid names: {valid_names()}.")
    chips = 1
    for d in dims:
        chips *= d
    kwargs: dict[str, Any] = {}
    if gen in ("v6e", "v5e") and chips <= 8:
        kwargs["chips_per_host_bounds"] = (dims[0], dims[1], 1)  # one host holds the whole slice
    if gen in ("v5p", "v4"):
        kwargs["chip_config_name"] = "megacore"  # one JAX device per chip, as on the pods
    return TpuTopology(name=text, raw=raw, chip=CHIPS[gen], chips=chips, kwargs=tuple(sorted(kwargs.items())))


_KINDS = (("v6 lite", "v6e"), ("v6e", "v6e"), ("v5 lite", "v5e"), ("v5e", "v5e"), ("v5p", "v5p"), ("v5", "v5p"),
          ("v4", "v4"))


def chip_of(device: Any) -> ChipSpec | None:
    """The chip figures of a JAX device (its ``device_kind``, e.g. ``TPU v6 lite``); None
    for a device that is not a TPU in the table (CPU, GPU)."""
    if getattr(device, "platform", None) != "tpu":
        return None
    kind = str(getattr(device, "device_kind", "")).lower()
    for needle, gen in _KINDS:
        if needle in kind:
            return CHIPS[gen]
    return None


INSTALL_HINT = 'pip install libtpu  (from a clone of grpo: pip install -e ".[plan]")'


def libtpu_available() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def require_libtpu() -> None:
    if not libtpu_available():
        raise UserError(
            "grpo plan compiles with the TPU compiler, which ships in the libtpu package, and libtpu is not "
            f"installed. Install it with: {INSTALL_HINT}. It needs no TPU and does not change which backend "
            "`grpo run` uses on a CPU or GPU machine."
        )


__all__ = ["CHIPS", "ChipSpec", "chip_of", "NAMED_TOPOLOGIES", "TpuTopology", "libtpu_available", "parse_topology",
           "require_libtpu", "valid_names"]
