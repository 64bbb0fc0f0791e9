"""``grpo export``: a run's latest (or chosen) checkpoint as a Hugging Face directory
(merged full weights), or for a LoRA run with ``adapter=True`` a PEFT adapter directory."""

from __future__ import annotations

import logging
from pathlib import Path

import jax
from flax import nnx

from grpo.core.config import load_config
from grpo.core.errors import UserError
from grpo.models.lora import merge_params, save_peft, split_params


def export_run(run_dir: str | Path, out_dir: str | Path, *, step: int | None = None, adapter: bool = False) -> Path:

    from grpo.core.contracts import MeshLayout
    from grpo.engine.parallel.mesh import build_mesh
    from grpo.engine.runs import identity, rundir
    from grpo.engine.runs.checkpoint import Checkpointer
    from grpo.models.loading import save_hf
    from grpo.models.policy import load_policy

    if not rundir.readable_run_dir(run_dir, need="config.yaml"):
        raise UserError(f"{run_dir} is not a grpo run directory (no config.yaml).")
    # The config that trained the exported step (a resumed run may record several).
    config = load_config(identity.latest_config(run_dir, step)[1])
    run_dir = rundir.path(run_dir)
    ckpt = Checkpointer(run_dir / "checkpoints", keep=config.checkpoint.keep)
    if ckpt.latest_step() is None:
        raise UserError(f"{run_dir} holds no checkpoint to export.")
    if step is not None and step not in ckpt.all_steps():
        raise UserError(f"{run_dir} has no checkpoint at step {step}; it has {ckpt.all_steps()}.")
    if adapter and config.model.lora is None:
        raise UserError(f"{run_dir} is a full fine-tuning run (no model.lora): export it without --adapter.")
    mesh = build_mesh(MeshLayout(dp=1, fsdp=jax.device_count(), tp=1))
    policy = load_policy(config.model, mesh, seed=config.train.seed)
    graphdef, full = nnx.split(policy.model)
    params, frozen = split_params(full)  # LoRA: checkpoints hold the adapters only
    state, _meta = ckpt.restore({"params": params}, step)
    ckpt.close()
    model = nnx.merge(graphdef, merge_params(state["params"], frozen))
    if adapter:
        if config.model.lora.base_quantization != "none":
            logging.getLogger(__name__).warning(
                "these adapters were trained against a %s-quantized base; on the float base (what PEFT loads "
                "unless it quantizes the base the same way) the model differs slightly from the trained one, "
                "which the merged export (without --adapter) reproduces exactly",
                config.model.lora.base_quantization,
            )
        base = None
        if config.model.source == "hf":
            # A local base as an absolute path: a relative one (to where `grpo run` was
            # started) in adapter_config.json would not load from anywhere else.
            local = Path(config.model.path).expanduser()
            base = str(local.resolve()) if local.is_dir() else config.model.path
        return save_peft(model, out_dir, base_model=base)
    return save_hf(model, out_dir, policy.tokenizer_dir)
