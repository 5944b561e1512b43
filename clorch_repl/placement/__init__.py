"""Where a group's ranks are placed and how they are ended, written once for sessions and batch jobs.

Both ways of running ranks, a session's launchers (:mod:`clorch_repl.launchers`) and ``launch()``'s
batch jobs (:mod:`clorch_repl.jobs`), place ranks on this host (below a supervisor each) or as the
tasks of one ``srun`` step, and end them again. What they share lives here, so that the two never
speak srun, read Slurm's variables or tear ranks down each in its own way (issue 33):

* :mod:`.srun`: the ``srun`` command line (and the one printed for ``--launcher attach``, from
  the same task layout), the step's process (started with its own log, what it said, its end: a
  wait, SIGTERM, SIGKILL and ``scancel`` of the step as the backstop, by its id inside an
  allocation, by name outside one) and srun's wait after SIGTERM (``SRUN_KILL_WAIT_S``);
* :mod:`.slurm_tasks`: where a task of a step is, from Slurm's variables (``SLURM_PROCID``,
  ``SLURM_LOCALID``, the compressed ``SLURM_STEP_TASKS_PER_NODE``), read by every rank that srun
  started (a session's nanny, a batch rank);
* :mod:`.teardown`: ending ranks that run below supervisors on this host: SIGTERM to every
  supervisor at once, one shared deadline (``deadline``: their grace and one margin), SIGKILL to
  what is left of their trees, and the wait for them to be gone.

It is a near-leaf: it imports only :mod:`clorch_repl.common` and :mod:`clorch_repl.errors`, so the
rank's side (``wire``, ``host``) may use it as well as the notebook's. The package imports nothing
itself.
"""
