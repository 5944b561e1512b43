"""Every collective and op on CUDA tensors with NCCL, through launch(), one rank per GPU (1 or 2).

Run on a CUDA machine: ``python -m pytest tests/gpu -q``. Skipped where no GPU is usable. The
bitwise ops take the emulated route on NCCL (all-gather + local fold); avg of integers the
sum-then-truncating-divide route; everything is compared with results computed here on CPU.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # tests/, for dist_workers and dist_helpers (launch passes sys.path on)

from clorch_repl import cuda  # noqa: E402

pytestmark = pytest.mark.skipif(not cuda.available(), reason="needs a CUDA GPU")

NPROC = min(cuda.device_count(), 2) if cuda.available() else 0


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    from clorch_repl import distributed as dist

    with dist.launch(nproc_per_node=NPROC, devices=list(range(NPROC)), backend="nccl",
                     main="dist_workers:collectives_suite", args={"tag": "gpu"}, timeout_ms=300_000) as job:
        return job.wait()


def _inputs(dtype: str, numel: int = 6) -> list[Any]:
    import dist_workers as w

    return [w.make_input(r, dtype, numel) for r in range(NPROC)]


@pytest.mark.parametrize("route", ["native", "emulated"])
def test_every_reduction_op(results: list[dict[str, Any]], route: str) -> None:
    import dist_workers as w
    from dist_helpers import assert_same, reference_reduce

    assert all(res["backend"] == "nccl" for res in results)
    root = NPROC - 1
    for dtype, ops in w.ALL_REDUCE_CASES.items():
        for op in ops:
            expected = reference_reduce(_inputs(dtype), op)
            for async_op in (False, True):
                for r in range(NPROC):
                    assert_same(results[r][f"{route}/all_reduce/{dtype}/{op}/{async_op}"], expected,
                                f"rank {r} {route} all_reduce {dtype} {op} async={async_op}")
    for dtype, ops in w.REDUCE_CASES.items():
        for op in ops:
            for async_op in (False, True):
                assert_same(results[root][f"{route}/reduce/{dtype}/{op}/{async_op}"],
                            reference_reduce(_inputs(dtype), op), f"{route} reduce {dtype} {op}")
    for dtype, ops in w.REDUCE_SCATTER_CASES.items():
        for op in ops:
            full = reference_reduce(_inputs(dtype, numel=w.CHUNK * NPROC), op)
            for async_op in (False, True):
                for r in range(NPROC):
                    assert_same(results[r][f"{route}/reduce_scatter/{dtype}/{op}/{async_op}"],
                                full[r * w.CHUNK:(r + 1) * w.CHUNK], f"rank {r} {route} reduce_scatter {dtype} {op}")


def test_data_movement_and_p2p(results: list[dict[str, Any]]) -> None:
    import torch

    import dist_workers as w
    from dist_helpers import assert_same

    inputs = _inputs("float32")
    for async_op in (False, True):
        for r in range(NPROC):
            got = results[r]
            assert_same(got[f"broadcast/{async_op}"], inputs[NPROC - 1], f"rank {r} broadcast")
            assert_same(got[f"all_gather/flat/{async_op}"], torch.cat(inputs), f"rank {r} all_gather")
            assert_same(got[f"all_gather/stacked/{async_op}"], torch.stack(inputs), f"rank {r} all_gather stacked")
            pieces = []
            for i in range(NPROC):
                send, _ = w.a2a_splits(i, NPROC)
                start = sum(send[:r])
                pieces.append(w.a2a_input(i, NPROC)[start:start + send[r]])
            assert_same(got[f"a2a/{async_op}"], torch.cat(pieces), f"rank {r} all_to_all_single")
    assert all(results[r]["barrier/completed"] for r in range(NPROC))
    if NPROC == 2:
        assert_same(results[1]["p2p/got"], torch.arange(5.0) * 7, "recv on rank 1")
        assert_same(results[0]["p2p/back"], torch.arange(5.0) * 7 + 1, "async recv on rank 0")


def test_refusals_and_check_mode(results: list[dict[str, Any]]) -> None:
    got = results[0]
    assert "unknown reduction op 'median'" in got["err/unknown_op"]
    assert "band needs an integer or bool tensor" in got["err/band_float"]
    for key in ("err/gather_size", "err/gather_dtype", "err/scatter_size", "err/a2a_sum", "err/a2a_len"):
        assert got[key] and "nothing was sent" in got[key], key
    assert got["err/after"].tolist() == [float(NPROC)] * 2
    if NPROC == 2:
        for r in range(2):
            message, ranks = results[r]["check/shape"]
            assert ranks == [1] and "rank 1 called all_reduce(float32[5], op=sum)" in message
            assert results[r]["check/ok"].tolist() == [2.0] * 3


def test_training_and_fail_fast_on_nccl() -> None:
    from clorch_repl import distributed as dist
    from clorch_repl.errors import RankFailure
    from clorch_repl.common.procs import pid_running

    devices = list(range(NPROC))
    trained = dist.launch(nproc_per_node=NPROC, devices=devices, main="dist_workers:train_small",
                          args={"steps": 30}, timeout_ms=300_000).wait()
    assert trained[0]["losses"][-1] < trained[0]["losses"][0] / 10
    if NPROC < 2:
        return
    start = time.monotonic()
    job = dist.launch(nproc_per_node=NPROC, devices=devices, main="dist_workers:fail_one", timeout_ms=300_000,
                      args={"fail_rank": 1, "how": "raise", "others": "collective"})
    with pytest.raises(RankFailure) as info:
        job.wait()
    assert info.value.rank == 1 and "boom from rank 1" in str(info.value)
    assert time.monotonic() - start < 60
    assert not any(pid_running(pid) for pid in job.pids())
