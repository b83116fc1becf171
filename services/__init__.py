"""Model-side engine of splitspec: prefill, draft, verify and the exact sampler.

Pure PyTorch / transformers logic. Nothing in this package imports ``ray`` or
``grpc``; the Ray Serve layer in ``deployments/`` wraps it.
"""
