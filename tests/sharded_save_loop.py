"""A torchrun script for the SIGKILL test: FSDP2 checkpoints of versions 1, 2, ... until killed."""

import sys

import torch.distributed as dist

from tests import sharded_helpers

if __name__ == "__main__":
    dist.init_process_group("gloo")
    sharded_helpers.save_versions({"rank": dist.get_rank(), "world_size": dist.get_world_size(),
                                   "args": {"path": sys.argv[1], "start": int(sys.argv[2])}})
