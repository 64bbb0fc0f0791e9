"""The ``train.compile`` section: when the run's programs compile (ahead of step 1, from the
shape schedule) and where compiled programs are kept (JAX's persistent compilation cache)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from grpo.core.config.section import Section


class CompileConfig(Section):
    """When the run's programs compile and where they are kept. Every shape a step can
    execute is listed from the config (:mod:`grpo.engine.schedule`); a shape outside the
    list compiles when it comes, with a warning naming the program and the shape."""

    ahead: Literal["auto", "all", "first", "lazy"] = Field(
        "auto",
        description="all: compile every listed shape ahead, in parallel: the rollout engine's programs, the glue and "
        "evaluation's at every prompt width the data reaches (before step 1 rolls out), the packed passes' (while it "
        "rolls out) and the continuous engine's decode buckets (a later compile of the run's programs is then warned of and "
        "counted: compile/out_of_list); first: only the packed passes' widest shape (the most memory a step needs), "
        "the others, and the rollout's at a new width, when a step first takes them; lazy: none ahead; auto: all on accelerators, and on the CPU all but "
        "the decode buckets, which compile when a rollout first reaches them (a CPU run reaches a few of the grid, "
        "and compiling the rest doubled a continuous-engine test's time).",
    )

    def decode_buckets_ahead(self, platform: str) -> bool:
        """Whether the continuous engine compiles every decode bucket ahead on ``platform``."""
        return self.ahead == "all" or (self.ahead == "auto" and platform != "cpu")
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
