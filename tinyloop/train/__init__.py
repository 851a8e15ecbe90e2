"""Training a small Huginn-style looped LM on CPU: corpus, trainer, evaluation.

Nothing here is imported by the serving runtime; ``scripts/train_demo.py`` drives it.
"""
