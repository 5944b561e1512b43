"""The commands beside the library, each run in a process of its own: ``clorch-notebook``
(:mod:`.notebook_cli`: a notebook run headless, :mod:`.notebook_runner`, or exported to a script,
:mod:`.notebook_export`) and ``clorch-release-check`` (:mod:`.release_check`, with what its job runs
on every rank, :mod:`.release_check_ranks`).

Why a package: they are programs that use the library, not the library, and the package's top level
keeps its public face. ``python -m clorch_repl.release_check``, the command's old name, is kept.
"""
