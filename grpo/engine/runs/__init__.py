"""A run on disk (or in a bucket): its directory, metrics, checkpoints and export.

- ``rundir``: run-directory paths and I/O on local disks, ``gs://`` and ``s3://``.
- ``metrics``: metrics.jsonl / eval.jsonl, W&B, the progress bar and the plot.
- ``compiles``: the compiles a run makes (counted from JAX's monitoring events: a step's
  ``compile/count`` and ``time/compile_s``, the summary's start-up total) and JAX's
  persistent compilation cache (``train.compile.cache_dir``).
- ``checkpoint``: Orbax checkpoints of the trainable state and the run's position.
- ``identity``: the configs a run records, and which run ``--resume``/``--run-dir`` may
  continue (same fingerprint, or another accepted with ``--resume-changed``).
- ``export``: a run's trained policy as a Hugging Face directory (or PEFT adapter).

May import: ``grpo.core``, ``grpo.models``, ``grpo.engine.parallel``.
"""
