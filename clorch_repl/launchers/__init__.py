"""Where ranks run: the launchers behind ``%clorch start --launcher NAME``.

:mod:`.base` holds the contract (:class:`Launcher`, :class:`RankHandle`); ``local`` (children of
this kernel), ``slurm`` (``srun``) and ``attach`` (any launcher the user runs: torchrun, srun,
mpirun...) implement it; ``local`` forks its ranks from a zygote through :mod:`.forked`. They are found by name in the entry-point group ``clorch_repl.launchers``
(declared in pyproject.toml), so another package can add one with::

    [project.entry-points."clorch_repl.launchers"]
    mine = "my_package.launcher:MyLauncher"

The package itself imports nothing (a batch job's launching process imports :mod:`.registry` from here
and must not pay for jupyter_client); :mod:`.registry` finds launchers by name.

A launcher class is constructed with ``(topology, options)`` where ``options`` is the
:class:`~.base.LaunchOptions` of the start command; ``local`` ignores what it does not use.
"""
