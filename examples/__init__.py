"""Runnable examples; ``examples.distributed_training`` is importable by launched ranks."""
