"""The models splitspec runs by default: the SmolLM2 target, its derived drafter and EAGLE head (their shipped
weights), a tiny test pair, and the prompt sets the benchmarks measure on. How they were trained: services.training."""
