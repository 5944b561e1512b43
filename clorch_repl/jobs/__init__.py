"""Batch jobs: ``clorch_repl.distributed.launch`` and the processes it starts.

The orchestrator runs in the launching process (a notebook, a script): :mod:`.batch` (``launch``,
:class:`~.batch.Job` and the registry behind ``%clorch jobs``), :mod:`.job_inputs` (what to run,
checked before any rank starts), :mod:`.job_dirs` (the job's private folder, and the sweep of
those a killed notebook left), :mod:`.job_ranks` (where the ranks run, one kind per launcher)
and :mod:`.job_status` (what ``job.status()`` answers). Each rank of a job runs
:mod:`._rank_entry` (``python -m clorch_repl.jobs._rank_entry``), which joins the process group and
calls ``main`` (:mod:`._target`) or runs a torchrun script (:mod:`._script_entry`), and reports
through a result file (:mod:`clorch_repl.wire.results`).

The public names (``launch``, ``Job``, ``jobs``, ``get_job``) are ``clorch_repl.distributed``'s,
as API.md spells them; the package itself imports nothing.
"""
