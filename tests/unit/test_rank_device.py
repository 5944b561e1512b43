"""Which GPU a rank drives (clorch_repl.distributed.group): the refusal where there is none."""

from __future__ import annotations

import socket

import pytest

from clorch_repl import cuda
from clorch_repl.distributed import group
from clorch_repl.errors import ConfigError


def test_gloo_ranks_drive_no_gpu() -> None:
    assert group._cuda_device("gloo") is None


@pytest.mark.skipif(cuda.available(), reason="this machine has a GPU")
def test_an_nccl_rank_without_a_gpu_says_which_rank_on_which_host_and_what_to_use(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError) as err:
        group._cuda_device("nccl")
    text = str(err.value)
    assert f"rank 3 on {socket.gethostname()} sees none" in text, text
    assert "use the gloo backend (--backend gloo)" in text, text
