"""process_group's lifecycle in a plain process (no launcher): a one-rank world that is torn down
on a normal exit, aborted on an error, entered again afterwards, and left alone when nested."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import dist_helpers

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "CLORCH_DIST_BACKEND", "CLORCH_DIST_TIMEOUT_MS", "CLORCH_DIST_CHECK")


def test_enter_exit_error_and_reenter() -> None:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join([dist_helpers.HERE, *sys.path])
    proc = subprocess.run([sys.executable, "-W", "error", "-m", "dist_workers"], cwd=dist_helpers.HERE, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["first"] == ["gloo", 0, 1, [1.0, 1.0, 1.0]]
    assert seen["after_normal_exit"] is False
    assert seen["check_inside"] is True and seen["check_after"] is False
    assert seen["error_propagated"] is True and seen["after_error_exit"] is False
    assert seen["nested_is_world"] is True and seen["after_nested"] is True
    assert seen["third"] == [5.0, 5.0] and seen["after_third"] is False
