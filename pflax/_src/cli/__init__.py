"""`pflax-run`: the command line."""
