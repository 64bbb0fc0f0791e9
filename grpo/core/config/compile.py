"""The ``train.compile`` section: how a run compiles its programs (the persistent
compilation cache). Its own module: :mod:`grpo.core.config.schema` is at its size limit."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class CompileConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)  # as schema.Section

    cache_dir: str | Literal[False] | None = Field(
        "auto",
        description="JAX's persistent compilation cache: a rerun or a resume of the same config loads its compiled "
        "programs instead of compiling them again. `auto`: JAX_COMPILATION_CACHE_DIR when set, else .jax_cache "
        "beside the run directory (runs/.jax_cache); a directory or a gs:// URL; null or false: off.",
    )

    @field_validator("cache_dir", mode="before")
    @classmethod
    def _setting(cls, v):
        if v is None or v is False or (isinstance(v, str) and v.strip()):
            return v
        raise ValueError("must be `auto`, a directory, a gs:// URL, null or false")


__all__ = ["CompileConfig"]
