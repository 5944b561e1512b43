"""Prints what a torchrun worker sees: its name, its arguments and torchrun's variables."""

import os
import sys

NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
         "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
report = {name: os.environ.get(name) for name in NAMES}
argv = list(sys.argv)
print("name", __name__)
print("argv", " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(argv)))
print("env", " ".join(f"{k}={v}" for k, v in report.items() if k not in ("MASTER_ADDR", "MASTER_PORT")))
print("master", bool(report["MASTER_ADDR"]), (report["MASTER_PORT"] or "").isdigit())
print("sees rank", "rank" in globals())
