"""The checks a GPU session runs (scripts/gpu-check.sh, scripts/gpu-serve-check.sh): the engine on one device
(``gpu``), the service on a GPU (``gpu_serve``), and the chi-square test both they and the suite use."""
