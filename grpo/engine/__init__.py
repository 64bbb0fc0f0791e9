"""The machinery plugins plug into: mesh building, distributed start-up, sampler,
trainer, advantages, metrics, checkpoints, data. Imports JAX."""
