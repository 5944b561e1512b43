"""The file format of %clorch pull/push and %%distributed --gather, in this process (no ranks),
and bad transfer input refused before any rank is asked. The commands through a real notebook
kernel: tests/integration/test_transfer.py."""

from __future__ import annotations

import os
import pickle
from typing import Any

import pytest
import torch

from clorch_repl.wire import values


# ------------------------------------------------------------------------ the format, no ranks
@pytest.mark.parametrize("value, message", [
    (lambda: 1, "f is a function, which cannot be sent"),
    (os, "f is a module, which cannot be sent"),
    ({"a": [1, object()]}, "f['a'][1] is a object, which cannot be sent"),
    ({"net": torch.nn.Linear(2, 2)}, "f['net'] is a torch.nn.modules.linear.Linear"),
])
def test_unsendable_values_are_named_with_their_place_and_type(value: Any, message: str) -> None:
    with pytest.raises(values.TransferError, match=None) as err:
        values.check_sendable(value, "f")
    assert message in str(err.value)


def test_a_value_that_contains_itself_is_refused() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    with pytest.raises(values.TransferError, match="contains itself"):
        values.check_sendable(loop, "x")


def test_round_trip_keeps_tensors_dicts_and_scalars(tmp_path: Any) -> None:
    big = torch.arange(1000.0)
    value = {"w": big[:3], "meta": ("run", 1, 2.5, None, True, b"x"), "shape": torch.Size([2]),
             "dtype": torch.float16, "nested": [{"k": {1, 2}}]}
    path = str(tmp_path / "v.pt")
    nbytes, digest = values.save(value, path, 10_000_000, "value")
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert nbytes < 2000  # the 3-element view was copied, not its 1000-element storage
    back = values.load(path, digest, "value")
    assert torch.equal(back["w"], big[:3]) and back["meta"] == value["meta"]
    assert back["shape"] == torch.Size([2]) and back["dtype"] is torch.float16 and back["nested"] == [{"k": {1, 2}}]


def test_loading_never_runs_code_from_the_file(tmp_path: Any) -> None:
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> Any:
            return (open, (str(marker), "w"))

    path = str(tmp_path / "evil.pt")
    with open(path, "wb") as fh:
        pickle.dump(Evil(), fh, protocol=2)  # what a hostile file would hold
    digest = values._sha256(path)
    with pytest.raises(pickle.UnpicklingError):
        values.load(path, digest, "value")
    assert not marker.exists()


def test_a_file_that_changed_since_it_was_announced_is_refused(tmp_path: Any) -> None:
    path = str(tmp_path / "v.pt")
    _, digest = values.save({"a": 1}, path, 100_000, "v")
    with open(path, "ab") as fh:
        fh.write(b"tampered")
    with pytest.raises(values.TransferError, match="does not match"):
        values.load(path, digest, "v")


def test_too_large_is_refused_before_anything_is_written(tmp_path: Any) -> None:
    path = str(tmp_path / "v.pt")
    with pytest.raises(values.TransferError, match="4.0 MB, over the limit of 1.0 MB"):
        values.save(torch.zeros(1_000_000), path, 1_000_000, "big")
    assert not os.path.exists(path)


@pytest.mark.parametrize("line, message", [
    ("%clorch pull", "the following arguments are required: name"),
    ("%clorch pull x --max-mb 0", "--max-mb must be a positive number of megabytes"),
    ("%clorch push x --max-mb lots", "--max-mb must be a number of megabytes; got 'lots'"),
    ("%clorch pull x --ranks a", "--ranks must be comma-separated integers"),
    ("%clorch push for", "NAME must be a Python variable name; got 'for'"),
    ("%%distributed --gather 2x\n1", "--gather must be a Python variable name; got '2x'"),
])
def test_bad_transfer_input_is_one_clear_line_before_any_rank_is_asked(ip: Any, line: str, message: str) -> None:
    from IPython.utils.capture import capture_output

    with capture_output() as cap:
        result = ip.run_cell(line)
    assert not result.success
    assert message in cap.stdout + cap.stderr
    assert "Traceback" not in cap.stdout + cap.stderr
