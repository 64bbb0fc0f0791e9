"""Built-in rollout sharding styles: ``legacy`` and ``maxtext``."""

from grpo.core.contracts import MeshLayout, NoOptions, RolloutStyle, Topology
from grpo.core.hookspecs import hookimpl


class LegacyStyle(RolloutStyle):
    name = "legacy"
    description = "Rollout batch sharded over dp x fsdp x tp (every device decodes its own rows)."
    Options = NoOptions

    def batch_axes(self, layout: MeshLayout, options: NoOptions) -> tuple[str, ...]:
        return ("dp", "fsdp", "tp")


class MaxTextStyle(RolloutStyle):
    name = "maxtext"
    description = "Rollout batch sharded over dp only, replicated over fsdp/tp; needs dp == process count."
    Options = NoOptions

    def batch_axes(self, layout: MeshLayout, options: NoOptions) -> tuple[str, ...]:
        return ("dp",)

    def check(self, *, layout: MeshLayout, topology: Topology, options: NoOptions) -> list[str]:
        if layout.dp != topology.process_count:
            return [
                f"rollout.style=maxtext shards the rollout batch over dp only and needs dp == "
                f"process count; the mesh has dp={layout.dp} with {topology.process_count} "
                "process(es). Use mesh.policy=host_local, or rollout.style=legacy."
            ]
        return []


@hookimpl
def register_rollout_styles(register):
    register(LegacyStyle())
    register(MaxTextStyle())
