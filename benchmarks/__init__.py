"""absl-flag benchmark programs (`python -m benchmarks.<name>`): each prints a table and writes JSON."""
