"""The mesh policy contract: a topology in, the (dp, fsdp, tp) mesh layout out, and the
expert axis ``ep`` a mixture-of-experts run adds (``mesh.expert_parallel``)."""

from __future__ import annotations

import abc
import dataclasses
from typing import Sequence

from pydantic import BaseModel

from grpo.core.contracts.base import _PluginBase

MESH_AXES: tuple[str, str, str] = ("dp", "fsdp", "tp")

EXPERT_AXIS = "ep"
"""The expert mesh axis: a mixture-of-experts model's experts are sharded over it and
tokens reach them by all-to-all; every other parameter and the batch treat it as one
more data-parallel (FSDP) axis. A mesh has it only when its size is over 1 (between
``fsdp`` and ``tp``), so a run without expert parallelism has the (dp, fsdp, tp) mesh."""

@dataclasses.dataclass(frozen=True)
class Topology:
    """What a mesh policy sees: processes and devices, no device objects.

    ``devices_per_process`` lists the local device count of every process (all equal on
    a healthy pod); ``platform`` is ``cpu``/``gpu``/``tpu`` when known.
    """

    process_count: int
    local_device_count: int
    devices_per_process: tuple[int, ...] = ()
    platform: str = "unknown"

    def __post_init__(self) -> None:
        if not self.devices_per_process:
            object.__setattr__(
                self, "devices_per_process", (self.local_device_count,) * self.process_count
            )

    @property
    def device_count(self) -> int:
        return sum(self.devices_per_process)

    @property
    def uniform(self) -> bool:
        return len(set(self.devices_per_process)) <= 1


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """A resolved mesh: sizes of the (dp, fsdp, tp) axes, the expert axis ``ep`` (1: none),
    and warnings for the user."""

    dp: int
    fsdp: int
    tp: int
    warnings: tuple[str, ...] = ()
    ep: int = 1

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The mesh's axes, in order: (dp, fsdp, tp), or (dp, fsdp, ep, tp) with experts."""
        return MESH_AXES if self.ep == 1 else ("dp", "fsdp", EXPERT_AXIS, "tp")

    @property
    def shape(self) -> dict[str, int]:
        sizes = {"dp": self.dp, "fsdp": self.fsdp, EXPERT_AXIS: self.ep, "tp": self.tp}
        return {a: sizes[a] for a in self.axis_names}

    @property
    def size(self) -> int:
        return self.dp * self.fsdp * self.ep * self.tp

    @property
    def data(self) -> int:
        """How many ways the update's batch is split: dp x fsdp x ep."""
        return self.dp * self.fsdp * self.ep

    def with_expert_axis(self, ep: int) -> "MeshLayout":
        """This layout with an expert axis of size ``ep`` carved out of its fsdp axis
        (``mesh.expert_parallel``); ValueError when ``ep`` does not divide fsdp."""
        if ep == 1:
            return self
        if ep < 1 or self.fsdp % ep:
            raise ValueError(f"mesh.expert_parallel={ep} does not divide the fsdp axis of mesh {self.shape}")
        return dataclasses.replace(self, fsdp=self.fsdp // ep, ep=self.ep * ep)

    def axis_size(self, axes: Sequence[str]) -> int:
        out = 1
        for a in axes:
            out *= self.shape[a]
        return out


class MeshPolicy(_PluginBase):
    """Topology in, (dp, fsdp, tp) layout out. Pure: no devices needed.

    Raise :class:`grpo.UserError` when the policy cannot lay out this topology, with a
    message that says what was received.
    """

    @abc.abstractmethod
    def resolve(self, topology: Topology, options: BaseModel) -> MeshLayout: ...
