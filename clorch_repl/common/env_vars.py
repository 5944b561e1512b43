"""Every ``CLORCH_*`` environment variable: its name, what it means, who sets it and its default.

Why one table: the names were spelled across twenty files, two of them defined twice (the CPU
binding and the GPU index in the rank's environment and again in the NUMA binding), so a reader
could not find what a variable does or what happens when it is unset, and a renamed one would
silently split in two. Every module now takes a variable's name (and, where unset has a value, its
default) from here; tests/unit/test_env_vars.py fails on a ``"CLORCH_..."`` string anywhere else.
How a value is parsed stays with the module that uses it (a size, a switch, a path), and the rank's
environment is still composed in :mod:`clorch_repl.wire.rank_env`.

Standard library only, importing nothing of the package: the rank's supervisor, run as a script
(``python -I -S``), imports it from this folder (see :mod:`clorch_repl.host.supervisor`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Mapping

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variable:
    """One environment variable of clorch_repl's."""

    name: str
    #: what it does, and who sets it (the user, or one of clorch_repl's processes for another)
    meaning: str
    #: the value an unset variable stands for, or None where unset has a meaning of its own
    default: str | None = None

    def get(self, environ: Mapping[str, str] | None = None) -> str | None:
        """Its value in ``environ`` (default ``os.environ``), or :attr:`default` when unset."""
        return (os.environ if environ is None else environ).get(self.name, self.default)

    def __str__(self) -> str:
        return self.name


# --------------------------------------------------------------------- set by the user
NPROC = Variable("CLORCH_NPROC", "the default --nproc of %clorch start (clorch-notebook --nproc sets it for a "
                 "whole run); unset: one rank per visible GPU, 2 CPU ranks without one")
SPARES = Variable("CLORCH_SPARES", "0 or 1: the default of %clorch start --spares, and whether loading the "
                  "extension warms a set of spares; unset: one set for GPU ranks, none for CPU ranks")
FORK_RANKS = Variable("CLORCH_FORK_RANKS", "0 starts each local rank as a fresh interpreter; 1 forks the ranks "
                      "from one process that imported torch and the kernel once (Linux; issue 39)", "1")
COMPACT_REPLIES = Variable("CLORCH_COMPACT_REPLIES", "0: the ranks answer the relay's cells with the lean reply "
                           "in Jupyter's five parts, as before issue 39's compact reply; 1 compact", "1")
HEAD_START = Variable("CLORCH_HEAD_START", "0 turns off the head start (a %%distributed cell sent to the ranks "
                      "as it arrives, before IPython runs the magic); 1 keeps it on", "1")
OUTPUT_LIMIT = Variable("CLORCH_OUTPUT_LIMIT", "characters of output a cell shows per rank before the rest is "
                        "held back (k/M suffixes; 0: no limit)", str(100 * 1024))
OUTPUT_LINES = Variable("CLORCH_OUTPUT_LINES", "lines of output a cell shows per rank before the rest is held "
                        "back (0: no limit)", "1000")
OUTPUT_RATE = Variable("CLORCH_OUTPUT_RATE", "characters a second of output a rank may stream (k/M suffixes; "
                       "0: no limit)", str(50 * 1024))
LOG_CAP = Variable("CLORCH_LOG_CAP", "the cap of one rank's log on disk at %clorch start (bytes, k/M/G "
                   "suffixes, 0: no cap), read in the notebook or on a remote rank's host", str(64 * 1024 * 1024))
KEEP_LOGS = Variable("CLORCH_KEEP_LOGS", "0 removes the rank logs with their session's files; 1 moves them "
                     "into <session directory>-logs first", "1")
CONNECT_DIR = Variable("CLORCH_CONNECT_DIR", "where the notebook writes a multi-host session's connect files; "
                       "unset: ~/.clorch (0700), which the nodes of a cluster usually share")
FLIGHT_RECORDER = Variable("CLORCH_FLIGHT_RECORDER", "0 runs the ranks without torch's flight recorder (the "
                           "evidence of a hang notice and %clorch why)", "1")
DIST_CHECK = Variable("CLORCH_DIST_CHECK", "1 (or true, yes, on) turns on check mode: every collective compares "
                      "its call across ranks first (launch(check=True) sets it in every rank)", "")
LOG_LEVEL = Variable("CLORCH_LOG_LEVEL", "the logging level of the suspend helper process "
                     "(python -m clorch_repl.host.cuda_checkpoint)", "WARNING")

# --------------------------------------------------------------------- set by clorch_repl for a rank or a nanny
CONNECT_FILE = Variable("CLORCH_CONNECT_FILE", "the connect file (0600: the notebook's address, public key and "
                        "a one-time token) a remote rank's nanny reads; set by the launcher or the user")
CONNECT = Variable("CLORCH_CONNECT", "the connect file's content itself, where the launcher hands every task "
                   "the notebook's environment (srun); read before CLORCH_CONNECT_FILE")
DIST_BACKEND = Variable("CLORCH_DIST_BACKEND", "the rank's process-group backend (nccl or gloo); set in every "
                        "rank by the launchers, the nannies and launch()")
DIST_TIMEOUT_MS = Variable("CLORCH_DIST_TIMEOUT_MS", "the process group's timeout in milliseconds; set with "
                           "CLORCH_DIST_BACKEND")
STORE_FILE = Variable("CLORCH_STORE_FILE", "the path of the group's FileStore in a private directory "
                      "(ranks of one host); unset: a TCP store at MASTER_ADDR:MASTER_PORT")
CPU_BIND = Variable("CLORCH_CPU_BIND", "numa or none: whether the rank binds itself to its GPU's NUMA node at "
                    "start (%clorch start --cpu-bind); unset: none")
GPU_INDEX = Variable("CLORCH_GPU_INDEX", "the rank's own GPU as its host names it (a physical index or a UUID), "
                     "whatever position CUDA_VISIBLE_DEVICES gives it: for NUMA binding and %clorch top")
SPARE = Variable("CLORCH_SPARE", "set in a warm spare's environment: it imports torch before its kernel starts "
                 "and learns the group's meeting point only when it is made a rank")
SPARE_CUDA = Variable("CLORCH_SPARE_CUDA", "0: a warm spare of a GPU rank sets up the CUDA driver (cuInit: no "
                      "context, no GPU memory) at its join instead of ahead, while it waits (the default, 1: "
                      "0.1-0.2 s off every restart on an H100)", default="1")
RANK_LOG = Variable("CLORCH_RANK_LOG", "a warm spare's rank log: where it moves its stdout and stderr when it "
                    "is made a rank")
STACK_FILE = Variable("CLORCH_STACK_FILE", "where the rank's kernel appends its main thread's stack on SIGUSR1")
JOB_ID = Variable("CLORCH_JOB_ID", "the batch job a rank of launch() belongs to")

#: every variable by name
ALL: dict[str, Variable] = {v.name: v for v in globals().values() if isinstance(v, Variable)}
