"""Parse SkyPilot task files with SkyPilot's own parser and print what it understood, as
JSON. Run by tests/test_launch_recipes.py, in-process when ``sky`` imports and otherwise
with the interpreter named by ``SKYPILOT_PYTHON`` (SkyPilot pins click<8.2, so it lives in
its own virtualenv rather than in the [dev] extra). Offline: no cloud, no credentials."""

from __future__ import annotations

import json
import sys


def parse(path: str) -> dict:
    import sky
    import yaml

    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f)
    required = []
    try:  # without the --env/--secret values, SkyPilot must refuse to launch
        sky.Task.from_yaml_config(config)
    except ValueError as err:
        required.append(str(err))
    task = sky.Task.from_yaml_config(
        config, env_overrides=[("RUN_DIR", "gs://bucket/runs/x")], secrets_overrides=[("WANDB_API_KEY", "secret")]
    )
    (res,) = list(task.resources)
    return {
        "skypilot": sky.__version__,
        "name": task.name,
        "num_nodes": task.num_nodes,
        "accelerators": dict(res.accelerators or {}),
        "accelerator_args": dict(res.accelerator_args or {}),
        "use_spot": res.use_spot,
        "job_recovery": res.job_recovery,
        "cloud": str(res.cloud),
        "envs": dict(task.envs),
        "secret_names": sorted(task.secrets),
        "setup": task.setup,
        "run": task.run,
        "workdir": task.workdir,
        "refused_without_values": required,
    }


if __name__ == "__main__":
    print(json.dumps({p: parse(p) for p in sys.argv[1:]}))
