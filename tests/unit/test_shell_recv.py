"""A rank's kernel takes each shell request as one task (clorch_repl.kernel.shell_recv), in the
kernel's persistent context, as ipykernel's two did: what a request sets in it is there for the next."""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from functools import partial
from typing import Any

from ipykernel.utils import _async_in_context

import pytest

from clorch_repl.kernel.shell_recv import EAGER_TASKS, one_task_per_request

#: the eager start runs only where Python has eager tasks (3.12 and later; CI's 3.11 has not)
needs_eager = pytest.mark.skipif(EAGER_TASKS is None, reason="Python before 3.12 has no eager tasks")

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
        if msg[0] == b"waits":  # a top-level await cell, or a request behind a running one's lock
            await asyncio.sleep(0.01)
        if msg[0] == b"fails":
            raise RuntimeError("the handler failed")
        self.seen.append((subshell_id, msg, PARENT.get(), asyncio.current_task()))
        PARENT.set(msg[0].decode())


def test_each_request_is_one_task_in_the_kernels_persistent_context() -> None:
    kernel = Kernel()
    assert one_task_per_request(kernel, eager=False)
    assert kernel.shell_stream.copy is False

    async def two_requests() -> None:
        for msg in ([b"first"], [b"second"]):
            task = kernel.shell_stream.callback(msg)
            assert isinstance(task, asyncio.Task)
            assert not kernel.seen or kernel.seen[-1][1] != msg  # started on the loop's next turn
            await task

    asyncio.run(two_requests())
    assert [seen[:3] for seen in kernel.seen] == [(None, [b"first"], "none"), (None, [b"second"], "first")]
    assert all(isinstance(seen[3], asyncio.Task) for seen in kernel.seen)
    assert PARENT.get() == "none"  # the kernel's context, not the caller's


@needs_eager
def test_an_eager_request_that_never_waits_is_over_inside_the_callback() -> None:
    """The common cell: handled and finished in the callback that read it, in the kernel's
    persistent context and inside a task of its own; ZMQStream gets nothing to wait for."""
    kernel = Kernel()
    assert one_task_per_request(kernel)

    async def two_requests() -> None:
        for msg in ([b"first"], [b"second"]):
            assert kernel.shell_stream.callback(msg) is None
            assert kernel.seen[-1][1] == msg  # already handled

    asyncio.run(two_requests())
    assert [seen[:3] for seen in kernel.seen] == [(None, [b"first"], "none"), (None, [b"second"], "first")]
    assert all(isinstance(seen[3], asyncio.Task) for seen in kernel.seen)  # current_task() as before
    assert PARENT.get() == "none"


def test_applied_again_it_replaces_its_own_callback() -> None:
    """How a running rank is switched between the two starts (benchmarks/eager_requests.py)."""
    kernel = Kernel()
    assert one_task_per_request(kernel, eager=False)
    first = kernel.shell_stream.callback
    assert one_task_per_request(kernel, eager=False)
    assert kernel.shell_stream.callback is not first

    async def one() -> None:
        await kernel.shell_stream.callback([b"first"])

    asyncio.run(one())
    assert [seen[:2] for seen in kernel.seen] == [(None, [b"first"])]


@needs_eager
def test_an_eager_request_that_waits_goes_on_as_a_task_and_a_failure_is_handed_back() -> None:
    """A request that awaits is a pending task the loop finishes; the next request's context still
    follows it; a request whose handler raised is returned, so that ZMQStream logs it as before."""
    kernel = Kernel()
    assert one_task_per_request(kernel)

    async def requests() -> None:
        task = kernel.shell_stream.callback([b"waits"])
        assert isinstance(task, asyncio.Task) and not task.done()
        await task
        failed = kernel.shell_stream.callback([b"fails"])
        assert isinstance(failed, asyncio.Task) and isinstance(failed.exception(), RuntimeError)
        assert kernel.shell_stream.callback([b"after"]) is None

    asyncio.run(requests())
    assert [seen[:3] for seen in kernel.seen] == [(None, [b"waits"], "none"), (None, [b"after"], "waits")]


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
