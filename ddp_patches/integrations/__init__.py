"""Entry points for the training tools users drive from a config file (each imported only by its tool)."""
