"""Built-in plugins. Each subpackage is an ordinary plugin module (see
``grpo.core.plugins.DEFAULT_PLUGINS``) and must stay JAX-free at import time."""
