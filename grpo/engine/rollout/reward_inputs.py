"""What a model reward's inputs are made of: a row's prompt and completion as text, a
template filled with them and the row's columns, and the devices it runs on (this
process's devices of the rollout mesh)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
from jax.sharding import Mesh

from grpo.core.contracts import MeshLayout
from grpo.core.errors import UserError
from grpo.engine.parallel.mesh import build_mesh
from grpo.engine.rollout.prompts import JOIN

BATCH_AXES = ("dp", "fsdp")
"""The local mesh's batch axes (its rows split over every local device)."""


def local_mesh(mesh: Mesh) -> Mesh:
    """A (1, n, 1) mesh of this process's devices of ``mesh`` (the rollout's)."""
    here = jax.process_index()
    devices = [d for d in mesh.devices.flat if d.process_index == here] or list(jax.local_devices())
    return build_mesh(MeshLayout(dp=1, fsdp=len(devices), tp=1), devices)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# --------------------------------------------------------------------------- text


def completion_text(completion: Any) -> str:
    """A completion as text: a string, or TRL's conversational ``[{role, content}, ...]``
    (the contents of its assistant messages)."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content", "")) for m in completion if m.get("role", "assistant") == "assistant")


def prompt_messages(prompt: Any) -> list[dict[str, str]]:
    """A prompt (a string, or chat messages) as chat messages."""
    if prompt is None:
        return []
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]


def prompt_text(prompt: Any) -> str:
    """A prompt as plain text: the string, or its messages' contents joined."""
    return prompt if isinstance(prompt, str) else JOIN.join(m["content"] for m in prompt_messages(prompt))


def fill_template(template: str, *, prompt: Any, completion: str, columns: Mapping[str, Any], where: str) -> str:
    """``template`` with ``{prompt}``, ``{completion}`` and the row's columns; a field
    that is neither is a UserError naming ``where``."""
    try:
        return template.format_map({**columns, "prompt": prompt_text(prompt), "completion": completion})
    except KeyError as err:
        have = ", ".join(sorted({"prompt", "completion", *columns}))
        raise UserError(f"{where}: the template's field {{{err.args[0]}}} is not a column of the rows "
                        f"(it can use: {have}).") from None


def row_columns(columns: Mapping[str, Sequence[Any]], i: int) -> dict[str, Any]:
    return {k: v[i] for k, v in columns.items()}


__all__ = ["BATCH_AXES", "completion_text", "fill_template", "local_mesh", "prompt_messages", "prompt_text",
           "round_up", "row_columns"]
