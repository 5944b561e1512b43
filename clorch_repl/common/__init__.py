"""Leaves every side may use: the notebook's, the rank's, the host's and the tools.

:mod:`.atomic` (files replaced whole), :mod:`.procs` (processes: liveness, exits, trees, ports),
:mod:`.human` (sizes, durations and wrapped sentences for people), :mod:`.rank_sets` (the one
spelling of a set of ranks), :mod:`.cell_boundary` (where a rank's cell begins on its stack),
:mod:`.user_frames` (public functions' errors shown ending at the user's call),
:mod:`.package_files` (which source files are the package's own) and
:mod:`.topology` (rank counts, devices and backends checked once for every entry point) and
:mod:`.imported` (whether a module's import has finished, for code that must not touch a half-built one). None of
them imports the notebook's side; the package itself imports nothing.
"""
