"""Rank-side code: what runs inside each rank's kernel process, and nothing the notebook runs.

``app`` is the process's entry point (``python -m clorch_repl.kernel.app``); ``rank_kernel`` the
kernel class, with the relay's lean execute path in ``lean_execute`` and the output budget and
stream in ``output``; ``display_log``, ``stdin_policy``, ``breakpoints`` and ``tracebacks`` what a
rank adds to a plain kernel's output, ``input()``, ``breakpoint()`` and tracebacks; ``probes``
answers the notebook's "where are you" on the control channel; ``group`` joins and leaves the
process group; ``torchrun`` makes torchrun code agree with that group; ``script``, ``transfer`` and
``profiler`` are the rank's halves of ``%clorch run``, ``%clorch pull/push`` and ``--profile``;
``requests`` is the registry through which the notebook asks for any of these (by name, with JSON
arguments); ``shell`` finds the rank's IPython shell. The notebook's process never imports this
package's modules but this file (the kernel's, ``lean_execute``, ``output`` and ``rank_kernel``,
import ipykernel's kernel at module level; the others torch or IPython when called); what both sides
share (the wire format, the output budget's rules, the value format) lives in
:mod:`clorch_repl.wire`.

This file holds only what the notebook's side needs to start a rank's kernel and read its stack
dumps (the launchers, :mod:`clorch_repl.host.rankfiles`), and imports nothing but the table of
environment variables.
"""

from ..common import env_vars

#: the rank's kernel, as ``python -m KERNEL_MODULE -f CONNECTION_FILE`` (:mod:`.app`)
KERNEL_MODULE = "clorch_repl.kernel.app"
#: where the rank's kernel appends its main thread's stack on SIGUSR1 (:mod:`.app`)
STACK_FILE_ENV = env_vars.STACK_FILE.name
