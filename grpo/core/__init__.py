"""The minimal core every plugin depends on: hook specs, plugin manager, registries,
config and CLI. Nothing here imports JAX at module level."""
