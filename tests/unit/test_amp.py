"""Mixed precision helpers: dtypes, autocast on CPU, the scaler, and no deprecation warnings."""

from __future__ import annotations

import warnings

import pytest
import torch

from clorch_repl import amp
from clorch_repl.errors import ConfigError


def test_dtype_words_and_scaler_need() -> None:
    assert amp.resolve_dtype("bfloat16") is torch.bfloat16
    assert amp.resolve_dtype("float16") is torch.float16
    assert amp.resolve_dtype(torch.float32) is torch.float32
    assert amp.needs_scaler("float16") and not amp.needs_scaler("bfloat16") and not amp.needs_scaler("float32")
    with pytest.raises(ConfigError, match="float16, bfloat16 or float32"):
        amp.resolve_dtype("int8")


@pytest.mark.parametrize("dtype,expected", [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                            ("float32", torch.float32)])
def test_autocast_on_cpu(dtype: str, expected: torch.dtype) -> None:
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with amp.autocast(device="cpu", dtype=dtype):
            assert (a @ b).dtype == expected
    assert (a @ b).dtype == torch.float32


def test_autocast_refuses_cuda_without_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="no usable GPU"):
        with amp.autocast(device="cuda", dtype="float16"):
            pass


def test_grad_scaler_is_torch_amp_and_validates() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler = amp.grad_scaler(initial_scale=1024.0, device="cpu")
    assert isinstance(scaler, torch.amp.GradScaler)
    assert scaler.get_scale() == 1024.0
    for bad in (dict(initial_scale=0), dict(initial_scale="x"), dict(growth_factor=1.0),
                dict(backoff_factor=1.5), dict(growth_interval=0)):
        with pytest.raises(ConfigError):
            amp.grad_scaler(device="cpu", **bad)


def test_backward_scales_only_with_an_enabled_scaler() -> None:
    w = torch.ones(2, requires_grad=True)
    amp.backward(None, (w * 3).sum())
    assert torch.equal(w.grad, torch.full((2,), 3.0))
    w.grad = None
    amp.backward(amp.grad_scaler(initial_scale=4.0, device="cpu"), (w * 3).sum())
    assert torch.equal(w.grad, torch.full((2,), 12.0))
    w.grad = None
    amp.backward(amp.grad_scaler(enabled=False, device="cpu"), (w * 3).sum())
    assert torch.equal(w.grad, torch.full((2,), 3.0))
    with pytest.raises(ConfigError, match="loss tensor"):
        amp.backward(None, 1.0)  # type: ignore[arg-type]
