"""The benchmarks (`splitspec bench …`, `splitspec soak`): each prints ratios measured side by side in one run and
writes its JSON; ``report`` rebuilds docs/benchmarks.md's figures table from the committed JSON."""
