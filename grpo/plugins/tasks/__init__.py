"""Built-in plugins of this kind (filled in by their own modules)."""
