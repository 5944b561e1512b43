"""Shared by the distributed tests: make this folder importable (for the ranks' worker module)
and compute expected collective results in one process."""

from __future__ import annotations

import functools
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # launch passes sys.path on, so the ranks import dist_workers too


def reference_reduce(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction of every rank's tensor, computed here with plain torch."""
    stacked = torch.stack(inputs)
    n = len(inputs)
    if op == "sum":
        return stacked.sum(0).to(inputs[0].dtype)
    if op == "prod":
        return stacked.prod(0).to(inputs[0].dtype)
    if op == "min":
        return stacked.amin(0)
    if op == "max":
        return stacked.amax(0)
    if op == "avg":
        total = stacked.sum(0)
        if inputs[0].is_floating_point():
            return total / n
        return torch.div(total, n, rounding_mode="trunc")  # toward zero, like C and NCCL
    fold = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op]
    return functools.reduce(fold, inputs)


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if actual.is_floating_point():
        assert torch.allclose(actual, expected), f"{what}: {actual} != {expected}"
    else:
        assert torch.equal(actual, expected), f"{what}: {actual} != {expected}"
