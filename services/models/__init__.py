"""The models splitspec runs by default: the SmolLM2 target, its derived drafter, and a tiny test pair."""
