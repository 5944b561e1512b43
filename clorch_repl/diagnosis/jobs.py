"""Hang diagnosis for ``launch()`` jobs: their ranks are plain processes, not kernels.

A launched rank blocks SIGUSR2 in every thread and keeps one thread in ``sigwait`` for it; on the
signal that thread writes the rank's answer (:func:`.probe.answer`, JSON) into the job's private
directory (0700, files 0600), even while the main thread is blocked in a collective. The launcher
asks every live rank this way when a job times out and puts the verdict into the job's message.
A job's ranks all run on the launching host, so the job's directory is a channel they share.

SIGUSR2's default action ends a process, and a rank spends seconds importing torch before it can
serve the probe; so :func:`serve` leaves a marker file once its thread waits for the signal, and
:func:`explain` signals only ranks that left one (a rank still starting is reported as not
answering, never killed by the question).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

from ..wire.probe import ProbeRequest
from . import probe, render
from .analyse import RankEvidence, analyse

logger = logging.getLogger(__name__)

SIGNAL = signal.SIGUSR2
ANSWER_WAIT_S = 3.0


def answer_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank}.probe.json")


def ready_path(directory: str, rank: int) -> str:
    """Exists once the rank serves the probe: only then may it be sent :data:`SIGNAL`."""
    return os.path.join(directory, f"rank-{rank}.probe-ready")


def serve(directory: str, rank: int) -> None:
    """In a launched rank, before any other thread starts: answer SIGUSR2 from a thread of its own.

    The signal is blocked in every thread (threads started later inherit the mask), so it is
    always taken by ``sigwait`` here and never interrupts the rank's own code.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, {SIGNAL})
    path = answer_path(directory, rank)

    def loop() -> None:
        while True:
            signal.sigwait({SIGNAL})
            try:
                data = json.dumps(probe.answer(ProbeRequest())).encode()
                tmp = path + ".tmp"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    os.write(fd, data)
                finally:
                    os.close(fd)
                os.replace(tmp, path)
            except (OSError, TypeError, ValueError) as exc:
                logger.warning("rank %d could not answer the hang probe: %s", rank, exc)

    threading.Thread(target=loop, name="clorch-probe", daemon=True).start()
    os.close(os.open(ready_path(directory, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))


def explain(directory: str, pids: dict[int, int | None], exits: dict[int, str | None]) -> str | None:
    """Ask the live ranks (``pids``) where they are; ``exits`` describes ranks already gone.

    Only ranks that serve the probe (:func:`ready_path`) are signalled. Returns the verdict and
    evidence as text, or None when no rank answered.
    """
    asked = {}
    for rank, pid in pids.items():
        if pid is None:
            continue
        if not os.path.exists(ready_path(directory, rank)):
            logger.debug("rank %d does not serve the hang probe yet (still starting): not asked", rank)
            continue
        try:
            os.unlink(answer_path(directory, rank))
        except FileNotFoundError:
            pass
        try:
            os.kill(pid, SIGNAL)
            asked[rank] = pid
        except ProcessLookupError:
            continue
    answers: dict[int, dict] = {}
    deadline = time.monotonic() + ANSWER_WAIT_S
    while len(answers) < len(asked) and time.monotonic() < deadline:
        for rank in asked:
            if rank in answers:
                continue
            try:
                with open(answer_path(directory, rank)) as fh:
                    answers[rank] = json.load(fh)
            except (FileNotFoundError, ValueError):
                continue
        time.sleep(0.05)
    if not answers:
        return None
    states = []
    for rank in sorted(set(pids) | set(exits)):
        if rank in answers:
            states.append(RankEvidence(rank, answer=answers[rank]))
        elif exits.get(rank):
            states.append(RankEvidence(rank, dead=exits[rank]))
        else:
            states.append(RankEvidence(rank))
    return render.report(analyse(states), states)
