"""Built-in mesh policies: ``auto``, ``host_local``, ``explicit``."""

from grpo.core.hookspecs import hookimpl
from grpo.plugins.mesh._policies import AutoMesh, ExplicitMesh, HostLocalMesh, parse_shape

__all__ = ["AutoMesh", "ExplicitMesh", "HostLocalMesh", "parse_shape"]


@hookimpl
def register_mesh_policies(register):
    register(AutoMesh())
    register(HostLocalMesh())
    register(ExplicitMesh())
