"""A rank's kernel takes each shell request as one task (clorch_repl.kernel.shell_recv), in the
kernel's persistent context, as ipykernel's two did: what a request sets in it is there for the next."""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from functools import partial
from typing import Any

from ipykernel.utils import _async_in_context

from clorch_repl.kernel.shell_recv import one_task_per_request

PARENT: ContextVar[str] = ContextVar("parent", default="none")


class Stream:
    """ZMQStream's side of it: ``on_recv`` keeps the callback as ``_recv_callback``."""

    def __init__(self) -> None:
        self._recv_callback: Any = None

    def on_recv(self, callback: Any, copy: bool = True) -> None:
        self._recv_callback, self.copy = callback, copy

    @property
    def callback(self) -> Any:
        return self._recv_callback


class Kernel:
    """What ipykernel 7.4's ``Kernel.start`` leaves, without a shell channel thread (its own
    ``_async_in_context`` around ``partial(shell_main, None)``)."""

    def __init__(self, shell_channel_thread: Any = None) -> None:
        self.shell_stream = Stream()
        self.shell_channel_thread = shell_channel_thread
        self.seen: list[tuple[Any, list[bytes], str]] = []
        if shell_channel_thread is None:
            self.shell_stream.on_recv(_async_in_context(partial(self.shell_main, None)), copy=False)

    async def shell_main(self, subshell_id: Any, msg: list[bytes]) -> None:
        self.seen.append((subshell_id, msg, PARENT.get()))
        PARENT.set(msg[0].decode())


def test_each_request_is_one_task_in_the_kernels_persistent_context() -> None:
    kernel = Kernel()
    assert one_task_per_request(kernel)
    assert kernel.shell_stream.copy is False

    async def two_requests() -> None:
        for msg in ([b"first"], [b"second"]):
            task = kernel.shell_stream.callback(msg)
            assert isinstance(task, asyncio.Task)
            await task

    asyncio.run(two_requests())
    assert kernel.seen == [(None, [b"first"], "none"), (None, [b"second"], "first")]
    assert PARENT.get() == "none"  # the kernel's context, not the caller's


def test_a_kernel_with_a_shell_channel_thread_keeps_ipykernels_callback() -> None:
    kernel = Kernel(shell_channel_thread=object())
    assert not one_task_per_request(kernel)
    assert kernel.shell_stream.callback is None


def test_a_callback_other_than_ipykernel_7s_is_left_alone() -> None:
    """Another ipykernel 7.x may install something else: its own path stays (two tasks a request)."""
    kernel = Kernel()

    async def its_own(msg: list[bytes]) -> None:
        await kernel.shell_main("a subshell", msg)

    kernel.shell_stream.on_recv(its_own, copy=False)
    assert not one_task_per_request(kernel)
    assert kernel.shell_stream.callback is its_own
