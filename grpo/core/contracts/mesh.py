"""The mesh policy contract: a topology in, the (dp, fsdp, tp) mesh layout out."""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar, Sequence

from pydantic import BaseModel

from grpo.core.contracts.base import _PluginBase

MESH_AXES: tuple[str, str, str] = ("dp", "fsdp", "tp")

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
    """A resolved mesh: sizes of the (dp, fsdp, tp) axes, and warnings for the user."""

    dp: int
    fsdp: int
    tp: int
    warnings: tuple[str, ...] = ()

    axis_names: ClassVar[tuple[str, str, str]] = MESH_AXES

    @property
    def shape(self) -> dict[str, int]:
        return {"dp": self.dp, "fsdp": self.fsdp, "tp": self.tp}

    @property
    def size(self) -> int:
        return self.dp * self.fsdp * self.tp

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
