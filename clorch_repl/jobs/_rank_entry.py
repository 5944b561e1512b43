"""Entry point of one launched rank: ``python -m clorch_repl.jobs._rank_entry JOB_SPEC``.

Joins the process group, calls ``main`` with the rank's dict, and reports the outcome to the
parent through a result file (:mod:`clorch_repl.wire.results`). The rank's supervisor
(:mod:`clorch_repl.host.supervisor`) ends it and everything it started as soon as the
launching process is gone, so a killed notebook never leaves ranks behind.
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import signal
import sys
import time
import traceback

# The hang probe's signal (clorch_repl.diagnosis.jobs.SIGNAL), blocked before anything slow
# happens in this module: a probe that arrives before the probe thread runs stays pending for it
# instead of ending the rank. (The launcher only signals ranks that wrote jobs.ready_path; this
# covers a probe sent some other way, e.g. kill -USR2 by hand.)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})


def _exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing left to write it to
            pass
    os._exit(code)


def _user_traceback(exc: BaseException) -> str:
    """The traceback from the user's code on: the frames of this entry point (and a script job's
    runner's and runpy's) are ours, not theirs."""
    from ._script_entry import script_frames

    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, script_frames(tb)))


def run(spec_path: str) -> int:
    from ..common.procs import end_own_group, watch_parent
    from ..distributed.failures import looks_like_cascade
    from ..errors import ScriptExit
    from ..wire.results import RankResult, encode_value, write_result

    with open(spec_path) as fh:
        spec = json.load(fh)
    if "RANK" not in os.environ:  # one task of an srun step: its place is in Slurm's variables
        from ..wire.rank_env import identity_environment, read_identity

        os.environ.update(identity_environment(read_identity(os.environ)))

    def orphaned() -> None:
        # Nobody is left to read the job's files: remove them, unless they live in a log_dir the
        # user asked to keep.
        if spec.get("owns_dir"):
            shutil.rmtree(spec["dir"], ignore_errors=True)
        end_own_group()

    from ..diagnosis import jobs as hang, record

    record.enable()  # before the process group exists: torch reads it then
    hang.serve(spec["dir"], int(os.environ["RANK"]))  # before any thread starts: it sets the signal mask
    # Our parent is the rank's supervisor, which ends us (needing no GIL) when the launching
    # process is gone; this thread covers a supervisor that was itself killed outright.
    watch_parent(os.getppid(), orphaned)
    faulthandler.enable()  # a native crash still leaves a Python traceback in the log
    rank = int(os.environ["RANK"])
    failed_at: float | None = None
    result_path = os.path.join(spec["dir"], f"rank-{rank}.result.json")
    try:
        from ._target import load_target
        from ..distributed.group import process_group

        fn = load_target(spec["main"]) if "main" in spec else None
        with process_group() as pg:
            import torch.distributed as tdist

            try:
                if fn is None:  # launch(script=...) / module=: a torchrun script (._script_entry)
                    from ._script_entry import run_script

                    run_script(spec)
                    value = None
                else:
                    value = fn({"rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", rank)),
                                "world_size": int(os.environ["WORLD_SIZE"]), "backend": str(tdist.get_backend()),
                                "process_group": pg, "args": spec["args"]})
            except BaseException:
                failed_at = time.time()  # before the group's abort, which peers may notice at once
                raise
        try:
            value_json, value_pickle = encode_value(value)
        except Exception as exc:  # noqa: BLE001 - pickle raises anything; reported, not swallowed
            raise TypeError(f"main returned a {type(value).__name__} that can be neither JSON-encoded nor "
                            f"pickled ({exc}); return plain data") from None
        write_result(result_path, RankResult(rank=rank, ok=True, value_json=value_json, value_pickle=value_pickle))
        return 0
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        if isinstance(exc, SystemExit) and exc.code in (None, 0):
            write_result(result_path, RankResult(rank=rank, ok=True))
            return 0
        failed_at = failed_at or time.time()
        kind = type(exc).__name__
        message = str(exc)
        if isinstance(exc, ScriptExit):
            # A script's sys.exit, as python ends: no traceback (the one line says the status and
            # the script's line); what it printed on the way out (argparse's usage and error) is
            # the log's last lines, which the job shows for a rank without a traceback.
            text = None
            code = exc.status if 0 < exc.status < 256 else 1  # the status the script's process would have had
        else:
            text = _user_traceback(exc)
            sys.stderr.write(f"[clorch rank {rank}] main failed:\n{text}")
            code = 1
        write_result(result_path, RankResult(rank=rank, ok=False, error_type=kind, error_message=message,
                                             traceback=text, cascade=looks_like_cascade(kind, message),
                                             failed_at=failed_at))
        return code


if __name__ == "__main__":
    code = run(sys.argv[1])
    if code:
        _exit(code)  # skip interpreter teardown: nothing may wait on peers that are gone
    sys.exit(0)
