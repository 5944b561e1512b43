"""What runs beside a rank on its host: the processes between the notebook and a rank's kernel.

Nothing here runs user code or imports the notebook's side. :mod:`.supervisor` (one per rank: a
child subreaper that ends the rank's whole process tree and keeps its log bounded, :mod:`.logcap`)
is started as a script with ``python -I -S`` and imports :mod:`.hold`, :mod:`.logcap` and
:mod:`.logfiles` from its own folder, which is why those three live beside it and use the
standard library only. :mod:`.hold` is the detached session's note: the notebook writes it
(``%clorch detach``/``connect``), but its reader and its rule are the supervisor's. :mod:`.nanny`
is a remote rank's nanny (``python -m clorch_repl.rank``), :mod:`.rank_process` starts and ends a
process below a supervisor (the nanny's kernels, a batch job's ranks), :mod:`.rankfiles` reads a
rank's log, stack dump and pid file where the rank runs, and :mod:`.cuda_checkpoint` is the
helper process that suspends and resumes a rank's GPU state on the rank's host. :mod:`.zygote` is
the local session's fork server (torch and the kernel imported once; each rank's supervisor and
kernel forked from it, issue 39), :mod:`.proctitle` what such a forked process shows in ``ps``.

The package imports nothing itself: a script-run supervisor and a batch rank must not pay for
more than they use.
"""
