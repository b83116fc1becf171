"""How the shipped drafters were made: the training data, the recipes, the measurements.

Nothing here runs when splitspec serves or benchmarks: the runtime (``services``, ``services.models``) loads the
weights and files these recipes write, and never imports this package. Each recipe is a command, e.g.
``python -m services.training.selfinstruct``, ``python -m services.training.eagle_recipe``, and
``splitspec models prepare --retrain`` (``distill.retrain_drafter``).
"""
