"""splitspec: disaggregated speculative decoding on Ray Serve."""

__version__ = "0.1.0"
