"""Old home of the checkpoint code, now :mod:`clorch_repl.training.checkpoint` (public names:
``dist.save_checkpoint``/``dist.load_checkpoint``); kept only until ``release_check.py`` imports
from there (then delete this file)."""
from ..errors import CheckpointError  # noqa: F401
from ..training.checkpoint import load_checkpoint, read_checkpoint_metadata, save_checkpoint  # noqa: F401
