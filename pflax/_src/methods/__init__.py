"""One file per method: its state, its builder."""
