"""common.workdir: what a deleted working directory is called, and which folder a process is in."""

from __future__ import annotations

import os
import tempfile
from typing import Iterator

import pytest

from clorch_repl.common import workdir
from clorch_repl.errors import ConfigError


@pytest.fixture
def folder() -> Iterator[str]:
    home, path = os.getcwd(), tempfile.mkdtemp()
    os.chdir(path)
    try:
        yield path
    finally:
        os.chdir(home)
        if os.path.isdir(path):
            os.rmdir(path)


def test_a_working_directory_deleted_is_named_with_what_to_do(folder: str) -> None:
    assert workdir.working_directory() == folder and workdir.shares_folder(os.getpid(), folder)
    os.rmdir(folder)
    with pytest.raises(ConfigError) as refused:
        workdir.working_directory()
    assert str(refused.value) == (
        f"this process's working directory, {folder} (pid {os.getpid()} on host {os.uname().nodename}), was "
        "deleted, and new ranks start in it: change to an existing folder (%cd in a notebook, os.chdir() in a "
        "script) and try again")
    assert not workdir.shares_folder(os.getpid(), folder)


def test_a_folder_made_again_at_the_path_is_another_folder(folder: str) -> None:
    os.rmdir(folder)
    os.mkdir(folder)
    with pytest.raises(ConfigError, match="was deleted; the folder there now is another one, and new ranks"):
        workdir.working_directory()
    assert not workdir.shares_folder(None, folder)  # (still in the deleted one, whatever is at its path)
    os.chdir(folder)
    assert workdir.shares_folder(None, folder) and workdir.shares_folder(os.getpid(), folder)


def test_torch_imported_already_needs_no_folder(folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    os.rmdir(folder)
    monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch") or object())
    workdir.torch_importable("%clorch pull t")  # imported: nothing to refuse
    monkeypatch.delitem(sys.modules, "torch")
    with pytest.raises(ConfigError, match=r", and %clorch pull t imports torch here, which would end this process"):
        workdir.torch_importable("%clorch pull t")
