"""The engine and what runs it: rounds, sweeps, records, checkpoints, sharding, tuning."""
