"""Check mode: before each collective, every rank shares a fingerprint of its call and all of
them raise, naming the odd ranks, if the calls differ.

Without it, a mismatched call hangs until the group's timeout or crashes a rank inside the
backend (gloo aborts the process on a size mismatch). The check costs one small all-gather per
collective (and an exchange of split sizes for all_to_all_single), so it is opt-in: turn it on
with ``CLORCH_DIST_CHECK=1``, ``process_group(check=True)``, ``dist.check_mode(True)`` or
``launch(..., check=True)``; every rank must use the same setting.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Any, Sequence

import torch
import torch.distributed as tdist

from ..errors import CollectiveMismatch
from ._c10d import all_gather_single, group_info, shape_text

FINGERPRINT_BYTES = 192
_calls = collections.Counter()


def _device_for(group: Any, tensor: torch.Tensor | None) -> torch.device:
    if tensor is not None:
        return tensor.device
    kind, _, _ = group_info(group, None)
    if kind == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(text: str, device: torch.device) -> torch.Tensor:
    raw = text.encode()
    if len(raw) > FINGERPRINT_BYTES:
        digest = hashlib.sha1(raw).hexdigest()[:16].encode()
        raw = raw[: FINGERPRINT_BYTES - len(digest) - 1] + b"#" + digest
    buf = bytearray(FINGERPRINT_BYTES)
    buf[: len(raw)] = raw
    return torch.frombuffer(buf, dtype=torch.uint8).to(device)


def _decode(row: torch.Tensor) -> str:
    return bytes(row.cpu().tolist()).rstrip(b"\0").decode(errors="replace")


def _ranks_of(group: Any, world: int) -> list[int]:
    if group is None:
        return list(range(world))
    return list(tdist.get_process_group_ranks(group))


def _describe(name: str, tensor: torch.Tensor | None, details: dict[str, Any]) -> str:
    parts = [f"{k}={v}" for k, v in details.items() if k != "splits" and v is not None]
    if tensor is not None:
        shape = shape_text(tensor)
        if details.get("splits") is not None:  # all_to_all: rows may differ, the row shape may not
            shape = f"{str(tensor.dtype).replace('torch.', '')}[*, {', '.join(map(str, tensor.shape[1:]))}]"
        parts.insert(0, shape)
    return f"{name}({', '.join(parts)})"


def verify_collective(group: Any, name: str, tensor: torch.Tensor | None, **details: Any) -> None:
    """Raise :class:`CollectiveMismatch` on every rank if the ranks' calls differ."""
    _, world, _ = group_info(group, tensor)
    key = id(group)
    _calls[key] += 1
    mine = _describe(name, tensor, details)
    device = _device_for(group, tensor)
    gathered = torch.empty(world * FINGERPRINT_BYTES, dtype=torch.uint8, device=device)
    all_gather_single(gathered, _encode(mine, device), group=group)
    calls = [_decode(row) for row in gathered.view(world, FINGERPRINT_BYTES)]
    ranks = _ranks_of(group, world)
    if len(set(calls)) > 1:
        _raise_mismatch(_calls[key], ranks, calls)
    splits = details.get("splits")
    if splits is not None:
        _verify_splits(group, tensor, splits, world, ranks, device)


def _raise_mismatch(call_no: int, ranks: Sequence[int], calls: Sequence[str]) -> None:
    by_call: dict[str, list[int]] = {}
    for r, c in zip(ranks, calls):
        by_call.setdefault(c, []).append(r)
    # The largest group of agreeing ranks is taken as intended (ties: the one holding the lowest rank).
    majority = max(by_call.items(), key=lambda kv: (len(kv[1]), -kv[1][0]))[0]
    odd = tuple(r for c, rs in by_call.items() if c != majority for r in rs)
    lines = "; ".join(f"{_plural(rs)} {','.join(map(str, rs))} called {c}" for c, rs in by_call.items())
    verb = "differs" if len(odd) == 1 else "differ"
    raise CollectiveMismatch(
        f"check mode: ranks disagree at collective #{call_no}: {lines}. {_plural(odd).capitalize()} "
        f"{','.join(map(str, odd))} {verb} from the rest; every rank must call the same collectives in "
        "the same order with the same shapes and dtypes", ranks=odd)


def _plural(items: Sequence[int]) -> str:
    return "rank" if len(items) == 1 else "ranks"


def _verify_splits(group: Any, tensor: torch.Tensor, splits: Any, world: int, ranks: Sequence[int],
                   device: torch.device) -> None:
    """all_to_all_single: what rank i sends to j must be what j expects from i."""
    input_splits, output_splits, output = splits
    rows_in = tensor.shape[0] if tensor.dim() else 1
    rows_out = output.shape[0] if output.dim() else 1
    ins = list(input_splits) if input_splits is not None else [rows_in // world] * world
    outs = list(output_splits) if output_splits is not None else [rows_out // world] * world
    mine = torch.tensor(ins + outs, dtype=torch.int64, device=device)
    table = torch.empty(world * 2 * world, dtype=torch.int64, device=device)
    all_gather_single(table, mine, group=group)
    rows = table.view(world, 2 * world).cpu().tolist()
    problems = []
    odd: set[int] = set()
    for i in range(world):
        for j in range(world):
            sent, expected = rows[i][j], rows[j][world + i]
            if sent != expected:
                problems.append(f"rank {ranks[i]} sends {sent} rows to rank {ranks[j]}, which expects {expected}")
                odd.update((ranks[i], ranks[j]))
    if problems:
        raise CollectiveMismatch("check mode: all_to_all_single split sizes disagree: " + "; ".join(problems),
                                 ranks=tuple(sorted(odd)))


def verify_p2p(group: Any, name: str, tensor: torch.Tensor, peer: int) -> None:
    """send/recv: both ends swap a fingerprint first (the sender sends first, so no deadlock)."""
    _, _, me = group_info(group, tensor)
    mine = _encode(f"{name} {shape_text(tensor)}", tensor.device)
    theirs = torch.empty_like(mine)
    if name == "send":
        tdist.send(mine, peer, group=group)
        tdist.recv(theirs, peer, group=group)
    else:
        tdist.recv(theirs, peer, group=group)
        tdist.send(mine, peer, group=group)
    other = _decode(theirs)
    expected = f"{'recv' if name == 'send' else 'send'} {shape_text(tensor)}"
    if other != expected:
        raise CollectiveMismatch(f"check mode: rank {me} called {name} {shape_text(tensor)} with rank {peer}, "
                                 f"but rank {peer} called {other}", ranks=(peer,))
