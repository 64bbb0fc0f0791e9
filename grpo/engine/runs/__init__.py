"""A run on disk (or in a bucket): its directory, metrics, checkpoints and export.

- ``rundir``: run-directory paths and I/O on local disks, ``gs://`` and ``s3://``.
- ``metrics``: metrics.jsonl / eval.jsonl, W&B, the progress bar and the plot.
- ``checkpoint``: Orbax checkpoints of the trainable state and the run's position.
- ``export``: a run's trained policy as a Hugging Face directory (or PEFT adapter).

May import: ``grpo.core``, ``grpo.models``, ``grpo.engine.parallel``.
"""
