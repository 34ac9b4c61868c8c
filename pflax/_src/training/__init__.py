"""Local training: losses, the client trainer and its mappings, models and their parts."""
