"""A rank's kernel takes each shell request as one task (clorch_repl.kernel.shell_recv), in the
kernel's persistent context, as ipykernel's two did: what a request sets in it is there for the next."""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from typing import Any

from clorch_repl.kernel.shell_recv import one_task_per_request

PARENT: ContextVar[str] = ContextVar("parent", default="none")


class Stream:
    def __init__(self) -> None:
        self.callback: Any = None

    def on_recv(self, callback: Any, copy: bool = True) -> None:
        self.callback, self.copy = callback, copy


class Kernel:
    def __init__(self, shell_channel_thread: Any = None) -> None:
        self.shell_stream = Stream()
        self.shell_channel_thread = shell_channel_thread
        self.seen: list[tuple[Any, list[bytes], str]] = []

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
