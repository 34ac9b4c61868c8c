"""The lowest floor: types, boundary checks, numerics, tree utilities, client weights and statistics, keys."""
