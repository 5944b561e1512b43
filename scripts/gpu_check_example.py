"""The training example step of ``scripts/gpu_check.sh``: bf16 and fp16, accumulation 2, a
checkpoint after epochs 1-2, then resumed from it for epochs 3-4, one NCCL rank per device.

A file rather than a heredoc in the shell script so that it can be read, linted and run alone:

    python3 scripts/gpu_check_example.py --devices 0,1

Without a GPU the same run uses ``len(devices)`` CPU ranks with gloo (see ``run_local``). It prints
one line per precision (backend, final losses, skipped steps, parameter digests); a failed rank
raises ``RankFailure`` naming it (exit status 1).
"""

from __future__ import annotations

import argparse
import sys

from clorch_repl.examples.distributed_training import run_local


def parse_devices(text: str) -> list[int]:
    """``"0,1"`` -> ``[0, 1]``; an empty or malformed list is a usage error that says what it got."""
    try:
        devices = [int(d) for d in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--devices wants comma-separated GPU numbers such as 0,1; got {text!r}") from None
    return devices


def check(devices: list[int], precisions: tuple[str, ...] = ("bfloat16", "float16")) -> None:
    """Train, checkpoint and resume once per precision; print what a person compares by eye."""
    for precision in precisions:
        path = f"/tmp/clorch-ddp-{precision}.pt"
        first = run_local(devices, epochs=2, accumulation=2, precision=precision, checkpoint_path=path)
        resumed = run_local(devices, epochs=4, accumulation=2, precision=precision, checkpoint_path=path,
                            resume=True)
        print(f"{precision}: {len(devices)} {first.backend.upper()} ranks, "
              f"epochs 1-2 final loss {first.final_loss:.5f}, "
              f"resumed epochs 3-4 final loss {resumed.final_loss:.5f}, skipped {resumed.skipped_steps}, "
              f"digests {sorted(set(resumed.param_digests.values()))}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=parse_devices, required=True, help="GPU numbers, e.g. 0,1")
    parser.add_argument("--precisions", default="bfloat16,float16", help="comma-separated (default: both)")
    ns = parser.parse_args(argv)
    check(ns.devices, tuple(p for p in ns.precisions.split(",") if p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
