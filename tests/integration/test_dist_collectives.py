"""Every collective and op on 2 real gloo ranks, sync and async, native and emulated routes,
checked against results computed here in one process. One launch runs them all (each launch
costs seconds of torch import), with warnings turned into errors inside the ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dist_helpers  # noqa: F401  (puts this folder on sys.path for the ranks)
import dist_workers as w
from dist_helpers import assert_same, reference_reduce

from clorch_repl import distributed as dist

N = 2
#: the reductions the API documents (README: sum avg min max band bor bxor prod, on every backend)
ALL_OPS = ("sum", "avg", "min", "max", "band", "bor", "bxor", "prod")


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    with dist.launch(nproc_per_node=N, main="dist_workers:collectives_suite", args={"tag": "suite"},
                     timeout_ms=240_000, backend="gloo") as job:
        return job.wait()


def _inputs(dtype: str, numel: int = 6) -> list[torch.Tensor]:
    return [w.make_input(r, dtype, numel) for r in range(N)]


@pytest.mark.parametrize("route", ["native", "emulated"])
def test_all_reduce_every_op_sync_and_async(results: list[dict[str, Any]], route: str) -> None:
    checked = 0
    for dtype, ops in w.ALL_REDUCE_CASES.items():
        for op in ops:
            expected = reference_reduce(_inputs(dtype), op)
            for async_op in (False, True):
                for r in range(N):
                    assert_same(results[r][f"{route}/all_reduce/{dtype}/{op}/{async_op}"], expected,
                                f"rank {r} {route} all_reduce {dtype} {op} async={async_op}")
                    checked += 1
    # every documented op, on floats, integers and bools: an empty or shrunken table fails here
    assert {op for ops in w.ALL_REDUCE_CASES.values() for op in ops} == set(ALL_OPS)
    assert set(w.ALL_REDUCE_CASES) == {"float32", "int64", "bool"}
    assert checked == 2 * N * sum(len(v) for v in w.ALL_REDUCE_CASES.values()) == 2 * N * 16


def test_integer_avg_truncates_toward_zero(results: list[dict[str, Any]]) -> None:
    ints = _inputs("int64")
    total = ints[0] + ints[1]
    assert (total < 0).any() and (total % 2 != 0).any(), "inputs must exercise negative odd sums"
    got = results[0]["native/all_reduce/int64/avg/False"]
    assert got.tolist() == [int(v / 2) for v in total.tolist()]  # int() truncates toward zero


@pytest.mark.parametrize("route", ["native", "emulated"])
def test_reduce_onto_root(results: list[dict[str, Any]], route: str) -> None:
    root = N - 1
    checked = 0
    for dtype, ops in w.REDUCE_CASES.items():
        for op in ops:
            for async_op in (False, True):
                assert_same(results[root][f"{route}/reduce/{dtype}/{op}/{async_op}"],
                            reference_reduce(_inputs(dtype), op), f"{route} reduce {dtype} {op} async={async_op}")
                checked += 1
    assert checked == 2 * 6, f"{checked} reduce cases checked: the table lost some"
    # emulated ops (avg, band, bxor) are among them, on both dtypes
    assert set(w.REDUCE_CASES) == {"float32", "int64"} and {"avg", "band", "bxor"} <= set(w.REDUCE_CASES["int64"])


@pytest.mark.parametrize("route", ["native", "emulated"])
def test_reduce_scatter(results: list[dict[str, Any]], route: str) -> None:
    checked = 0
    for dtype, ops in w.REDUCE_SCATTER_CASES.items():
        for op in ops:
            full = reference_reduce(_inputs(dtype, numel=w.CHUNK * N), op)
            for async_op in (False, True):
                for r in range(N):
                    assert_same(results[r][f"{route}/reduce_scatter/{dtype}/{op}/{async_op}"],
                                full[r * w.CHUNK:(r + 1) * w.CHUNK], f"rank {r} {route} reduce_scatter {dtype} {op}")
                    checked += 1
    assert checked == 2 * N * 8, f"{checked} reduce_scatter cases checked: the table lost some"
    assert set(w.REDUCE_SCATTER_CASES) == {"float32", "int64", "bool"}


def test_broadcast_all_gather_all_to_all(results: list[dict[str, Any]]) -> None:
    inputs = _inputs("float32")
    for async_op in (False, True):
        for r in range(N):
            got = results[r]
            assert_same(got[f"broadcast/{async_op}"], inputs[N - 1], f"rank {r} broadcast")
            assert_same(got[f"all_gather/flat/{async_op}"], torch.cat(inputs), f"rank {r} all_gather flat")
            assert_same(got[f"all_gather/stacked/{async_op}"], torch.stack(inputs), f"rank {r} all_gather stacked")
            # all_to_all with uneven splits: rank r gets, from each rank i, the rows i addressed to r.
            pieces = []
            for i in range(N):
                send, _ = w.a2a_splits(i, N)
                start = sum(send[:r])
                pieces.append(w.a2a_input(i, N)[start:start + send[r]])
            assert_same(got[f"a2a/{async_op}"], torch.cat(pieces), f"rank {r} all_to_all_single uneven")
            even = [torch.arange(2.0 * N) + 10 * i for i in range(N)]
            assert_same(got[f"a2a_even/{async_op}"], torch.cat([e[2 * r:2 * r + 2] for e in even]),
                        f"rank {r} all_to_all_single even")


def test_send_recv_barrier_and_reduceop(results: list[dict[str, Any]]) -> None:
    payload = torch.arange(5.0) * 7
    assert results[1]["p2p/src"] == 0
    assert_same(results[1]["p2p/got"], payload, "recv on rank 1")
    assert_same(results[0]["p2p/back"], payload + 1, "async recv on rank 0")
    assert all(results[r]["barrier/completed"] for r in range(N))
    for r in range(N):
        assert_same(results[r]["reduceop/max"], reference_reduce(_inputs("float32"), "max"), "ReduceOp.MAX")


def test_bad_calls_refused_before_sending(results: list[dict[str, Any]]) -> None:
    got = results[0]
    assert "unknown reduction op 'median'" in got["err/unknown_op"]
    assert "band needs an integer or bool tensor" in got["err/band_float"]
    assert "needs world_size (2) x input (2) = 4" in got["err/gather_size"]
    assert "dtype" in got["err/gather_dtype"]
    assert "needs world_size (2) x output (2) = 4" in got["err/scatter_size"]
    assert "add up to 9 but input has 8 rows" in got["err/a2a_sum"]
    assert "3 entries but there are 2 ranks" in got["err/a2a_len"]
    for r in range(N):  # nothing was sent: the group stayed in step
        assert_same(results[r]["err/after"], torch.full((2,), 2.0), f"rank {r} all_reduce after refusals")


def test_check_mode_names_the_rank_that_differs(results: list[dict[str, Any]]) -> None:
    for r in range(N):
        message, ranks = results[r]["check/shape"]
        assert ranks == [1]
        assert "rank 0 called all_reduce(float32[4], op=sum)" in message
        assert "rank 1 called all_reduce(float32[5], op=sum)" in message
        assert "Rank 1 differs" in message
        split_message, split_ranks = results[r]["check/splits"]
        assert "rank 0 sends 2 rows to rank 1, which expects 1" in split_message
        assert split_ranks == [0, 1]
        assert "send float32[3]" in results[r]["check/p2p"] and "recv float32[4]" in results[r]["check/p2p"]
        assert_same(results[r]["check/ok"], torch.full((3,), 2.0), "matching call under check mode")
        one_sided, differing = results[r]["check/one-sided"]  # raised on both ranks, none left waiting
        assert "all_gather_into" in one_sided and differing == [1], one_sided
