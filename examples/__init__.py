"""Runnable examples from the repository; their code lives in :mod:`clorch_repl.examples`."""
