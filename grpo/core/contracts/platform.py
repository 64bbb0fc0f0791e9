"""The compile target: the platform a program is traced for, which may not be the host's.

A plugin that picks kernels by platform asks :func:`target_platform`, never
``jax.default_backend()``.
"""

from __future__ import annotations

import contextlib
import contextvars

_TARGET_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("grpo_target_platform", default=None)


@contextlib.contextmanager
def compiling_for(platform: str | None):
    """While tracing a program for a mesh, the platform its devices belong to.

    The engine sets it around plugin code it traces (the loss), so a plugin that picks
    kernels by platform (Pallas: Mosaic on TPU, Triton on GPU) compiles for the mesh's
    devices: ``grpo plan`` traces for a TPU topology on a CPU host, where
    ``jax.default_backend()`` is ``cpu``.
    """
    token = _TARGET_PLATFORM.set(platform)
    try:
        yield
    finally:
        _TARGET_PLATFORM.reset(token)


def target_platform() -> str | None:
    """The platform set by :func:`compiling_for` (None outside it)."""
    return _TARGET_PLATFORM.get()
