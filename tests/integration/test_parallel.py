"""DDP wrapper, accumulation and AMP overflow agreement, checked on a real 2-rank gloo group."""

from __future__ import annotations

import pytest
import torch

from tests import train_helpers


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return train_helpers.run_ranks("tests.train_helpers:ddp_checks", nproc=2)


def test_ddp_gradient_equals_single_process_full_batch(results: list[dict]) -> None:
    for r in results:
        assert r["grad_max_diff"] < 1e-6, r["grad_max_diff"]


def test_rank_zero_parameters_are_broadcast(results: list[dict]) -> None:
    assert all(r["params_equal_rank0_after_wrap"] for r in results)


def test_accumulation_with_no_sync_equals_one_large_batch(results: list[dict]) -> None:
    for r in results:
        assert r["accum_stepped"] is True
        assert r["accum_param_max_diff"] < 1e-6, r["accum_param_max_diff"]


def test_leaving_the_block_removes_what_it_installed(results: list[dict]) -> None:
    for r in results:
        assert r["plain_grads_local_after_exit"]
        assert r["hooks_left"] == 0
        assert r["closed_wrapper_error"].startswith("ClorchError:")
        assert "after its `with distributed_data_parallel" in r["closed_wrapper_error"]


def test_stepping_on_unreduced_gradients_is_refused(results: list[dict]) -> None:
    for r in results:
        assert "inside no_sync" in r["step_inside_no_sync"] and f"rank {r['rank']}" in r["step_inside_no_sync"]
        assert "ran inside no_sync" in r["step_after_no_sync_forward"]
        assert r["step_after_synced_forward"] is True


def test_options_unknown_refused_deprecated_mapped_without_warning(results: list[dict]) -> None:
    # the ranks run with warnings as errors, so reaching here means no warning was raised
    for r in results:
        assert r["unknown_option"].startswith("ConfigError:") and "bogus" in r["unknown_option"]
        assert r["forward_sync_buffers"] is False


def test_signature_mismatch_names_the_rank_on_every_rank(results: list[dict]) -> None:
    for r in results:
        assert r["signature_error"].startswith("ConfigError: rank 1 has a different model than rank 0")
        assert "'0.weight' is [6, 8] float32 on rank 0 but [5, 8]" in r["signature_error"]


def test_overflow_on_one_rank_makes_every_rank_skip_and_back_off(results: list[dict]) -> None:
    for r in results:
        assert r["overflow_stepped"] is False
        assert r["overflow_params_unchanged"] is True
        assert r["scale_after_overflow"] == 512.0  # 1024 backed off by 0.5, on both ranks
        assert r["normal_stepped"] is True
        assert r["scale_after_normal"] == 512.0
    for a, b in zip(results[0]["params_after_normal"], results[1]["params_after_normal"]):
        assert torch.equal(a, b)  # the replicas stayed identical
