"""ReadySockets (session/ready_sockets.py) on real ZeroMQ sockets in this process (inproc pairs:
no other process is started): it finds every socket holding a message, in registration order,
including the cases where no descriptor wakes it again (a message left unread, a send that took
the wake-up), waits no longer than asked, and a message whose wake-up something else swallowed
is found by the sweep."""

from __future__ import annotations

import collections
import time
from typing import Iterator

import pytest
import zmq

from clorch_repl.session import ready_sockets
from clorch_repl.session.ready_sockets import ReadySockets


@pytest.fixture
def pairs() -> Iterator[list[tuple[zmq.Socket, zmq.Socket]]]:
    """Eight DEALER pairs: (the relay's end, the rank's end)."""
    ctx = zmq.Context()
    made = []
    for i in range(8):
        ours, theirs = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        ours.bind(f"inproc://ready-{i}")
        theirs.connect(f"inproc://ready-{i}")
        made.append((ours, theirs))
    yield made
    ctx.destroy(linger=0)


@pytest.fixture
def looks(monkeypatch) -> collections.Counter:
    """How often each socket's events were looked up (ReadySockets asks its suspects through
    ``zmq.zmq_poll``), per socket."""
    counts: collections.Counter = collections.Counter()
    real = zmq.zmq_poll

    def counted(items, timeout=None):  # type: ignore[no-untyped-def]
        counts.update(sock for sock, _ in items)
        return real(items, timeout)

    monkeypatch.setattr(zmq, "zmq_poll", counted)
    return counts


def _settle(ready: ReadySockets) -> None:
    assert ready.poll(0) == []  # nothing sent yet: the registration's suspects are asked and cleared


def test_finds_the_sockets_with_a_message_in_registration_order(pairs) -> None:
    ready = ReadySockets()
    for ours, _ in pairs:
        ready.register(ours)
    _settle(ready)
    for i in (5, 1, 6):
        pairs[i][1].send(b"hello")
    deadline = time.monotonic() + 5
    found: list[zmq.Socket] = []
    while len(found) < 3 and time.monotonic() < deadline:
        found = ready.poll(1.0)
    assert found == [pairs[1][0], pairs[5][0], pairs[6][0]]
    for sock in found:
        assert sock.recv(zmq.NOBLOCK) == b"hello"
    assert ready.poll(0) == []


def test_a_message_left_unread_is_found_again(pairs) -> None:
    ready = ReadySockets()
    ours, theirs = pairs[0]
    ready.register(ours)
    _settle(ready)
    theirs.send(b"one")
    theirs.send(b"two")
    assert ready.poll(2.0) == [ours]
    assert ours.recv() == b"one"  # a bounded batch: one read, one left
    assert ready.poll(0) == [ours], "the message left behind was not found again"
    assert ours.recv() == b"two"
    assert ready.poll(0) == []


def test_a_send_that_took_the_wake_up_is_told_and_the_reply_found(pairs) -> None:
    ready = ReadySockets()
    ours, theirs = pairs[0]
    ready.register(ours)
    _settle(ready)
    theirs.send(b"reply")
    time.sleep(0.05)
    ours.send(b"request")  # processes the socket's commands: its descriptor may not wake epoll now
    ready.touched(ours)
    assert ready.poll(0) == [ours]
    assert ours.recv() == b"reply"


def test_the_relays_sends_are_asked_only_when_nothing_was_heard_of_them_for_a_moment(pairs, looks) -> None:
    """A cell's send to every rank made each shell socket a suspect, asked at the next poll: 64
    looks at 64 ranks for nothing (a reply takes longer). ``sent`` asks them only after
    SENT_CHECK_S; a reply that wakes its descriptor first is found at once, and the reply whose
    wake-up the send took (a reply to an earlier request) is still found, that much later."""
    ready = ReadySockets()
    counted = [ours for ours, _ in pairs]
    for sock in counted:
        ready.register(sock)
    _settle(ready)
    before = [looks[c] for c in counted]
    for sock in counted:
        sock.send(b"request")
        ready.sent(sock)
    assert ready.poll(0) == [] and [looks[c] for c in counted] == before, "the sends' sockets were asked at once"
    pairs[3][1].send(b"reply")  # its descriptor wakes: found at once, asked once
    assert ready.poll(1.0) == [counted[3]]
    assert pairs[3][0].recv() == b"reply"
    ready.drained(counted[3])
    time.sleep(ready_sockets.SENT_CHECK_S * 2)
    assert ready.poll(0) == [] and all(looks[c] == n + 1 for c, n in zip(counted, before) if c is not counted[3])
    # (the others, heard of by none, asked once their moment passed: empty)
    # a reply already there when the request was sent, whose wake-up the send took
    ours, theirs = pairs[0]
    theirs.send(b"old reply")
    time.sleep(0.05)
    ours.get(zmq.EVENTS)  # (what the send may do to the descriptor)
    ready.sent(counted[0])
    t0 = time.monotonic()
    found = ready.poll(1.0)
    assert found == [counted[0]] and time.monotonic() - t0 >= ready_sockets.SENT_CHECK_S * 0.9, found
    assert time.monotonic() - t0 < 0.5
    assert ours.recv() == b"old reply"


def test_a_swallowed_wake_up_is_found_by_the_sweep(pairs, monkeypatch) -> None:
    monkeypatch.setattr(ready_sockets, "SWEEP_S", 0.2)
    ready = ReadySockets()
    ours, theirs = pairs[0]
    ready.register(ours)
    _settle(ready)
    theirs.send(b"reply")
    time.sleep(0.05)
    ours.get(zmq.EVENTS)  # what a send elsewhere does to the descriptor, without telling anyone
    t0 = time.monotonic()
    found = ready.poll(5.0)
    assert found == [ours] and time.monotonic() - t0 < 2.0


def test_waits_no_longer_than_asked_and_forgets_what_it_unregisters(pairs) -> None:
    ready = ReadySockets()
    ours, theirs = pairs[0]
    ready.register(ours)
    _settle(ready)
    t0 = time.monotonic()
    assert ready.poll(0.15) == []
    assert 0.1 <= time.monotonic() - t0 < 2.0
    ready.unregister(ours)
    assert ours not in ready
    theirs.send(b"late")
    assert ready.poll(0.1) == []
    with pytest.raises(KeyError):
        ready.unregister(ours)
    ready.close()


def test_a_drained_socket_is_not_asked_until_its_descriptor_wakes(pairs, looks) -> None:
    """What the relay's read loop does: it reads until EVENTS says empty and says so (drained)."""
    ready = ReadySockets()
    ours, theirs = pairs[0]
    ready.register(ours)
    _settle(ready)
    theirs.send(b"reply")
    assert ready.poll(2.0) == [ours]
    assert ours.recv() == b"reply"
    assert not ours.get(zmq.EVENTS) & zmq.POLLIN
    ready.drained(ours)
    asked = looks[ours]
    assert ready.poll(0) == [] and looks[ours] == asked, "a drained socket was asked again"
    theirs.send(b"next")
    assert ready.poll(2.0) == [ours]
    assert ours.recv() == b"next"


def test_the_sweep_leaves_out_a_socket_nothing_else_uses_and_its_message_is_still_found(pairs, monkeypatch,
                                                                                        looks) -> None:
    # a rank's iopub: only the read loop touches it, so no send can have swallowed its wake-up,
    # and asking it in every sweep (a third of the sockets at any rank count) is wasted
    monkeypatch.setattr(ready_sockets, "SWEEP_S", 0.05)
    ready = ReadySockets()
    (shell, shell_peer), (iopub, iopub_peer) = pairs[0], pairs[1]
    swept, unswept = shell, iopub
    ready.register(swept)
    ready.register(unswept, swept=False)
    _settle(ready)
    before = looks[swept], looks[unswept]
    assert ready.poll(0.3) == []  # several sweeps' worth of waiting, nothing sent
    assert looks[swept] > before[0], "the sweep did not ask the socket that may be sent on"
    assert looks[unswept] == before[1], "the sweep asked the socket that only its reader uses"
    iopub_peer.send(b"output")  # its descriptor wakes epoll: found without any sweep
    assert ready.poll(2.0) == [unswept]
    assert iopub.recv() == b"output"
    ready.unregister(unswept)
    ready.unregister(swept)
    shell_peer.send(b"late")
    assert ready.poll(0.1) == []
