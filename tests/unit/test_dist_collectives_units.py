"""A collective called without a process group is a clear error. The collectives on real gloo
ranks: tests/integration/test_dist_collectives.py."""

from __future__ import annotations

import pytest
import torch

from clorch_repl import distributed as dist


def test_no_group_is_a_clear_error() -> None:
    import torch.distributed as tdist

    if tdist.is_initialized():
        pytest.skip("a default group exists in this process")
    with pytest.raises(dist.NoProcessGroup, match="process_group"):
        dist.all_reduce(torch.ones(1))
    assert dist.rank() == 0 and dist.world_size() == 1
