"""Server-side aggregators: pure functions of stacked client pytrees, one file each."""
