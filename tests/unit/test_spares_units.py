"""The status line counts a spare not yet forked as starting. Warm spares with real kernels:
tests/integration/test_spares.py."""

from __future__ import annotations


def test_the_status_line_counts_a_spare_not_yet_forked_as_starting() -> None:
    # Right after %load_ext on the H200 box the spare's kernel had no pid yet: it was left out,
    # and a set of one read "0 (pids ), ready" (a benchmark then took it for ready).
    from clorch_repl.magics.views import spares_line

    line = spares_line([(None, None, False)], "the first %clorch start")
    assert line.startswith("warm spares for the first %clorch start: 1 (pids ?), starting, "), line
    line = spares_line([(41, 2**20, True), (42, 2**20, True)])
    assert ": 2 (pids 41, 42), ready, 2.0 MiB resident in all" in line, line


def test_a_spare_whose_cuda_driver_fails_ahead_still_starts_and_says_why(monkeypatch, caplog) -> None:
    # A GPU rank's spare (CLORCH_SPARE_CUDA unset: on): the driver is set up before the join. Here torch's
    # CPU build is what fails (no CUDA compiled in), for real: the spare's start must go on (its
    # join meets the same error in the rank's cell), and its log must say what failed.
    import logging

    import torch

    from clorch_repl.kernel import app

    from clorch_repl import cuda

    monkeypatch.delenv("CLORCH_SPARE_CUDA", raising=False)  # the default: on
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    if cuda.available():  # a stand-in where CUDA would work: initialising it here would make this
        def broken() -> None:  # test process a bad fork for every later test that forks
            raise RuntimeError("CUDA driver initialization failed (a stand-in)")
        monkeypatch.setattr(torch.cuda, "init", broken)
    with caplog.at_level(logging.WARNING, logger=app.__name__):
        app._warm_cuda_driver()
    (record,) = caplog.records
    assert "CUDA's driver set-up ahead failed" in record.getMessage()
    assert "sets it up when it joins" in record.getMessage()


def test_a_spare_sets_up_no_cuda_when_told_not_to_or_for_a_cpu_rank(monkeypatch, caplog) -> None:
    import logging

    from clorch_repl.kernel import app

    for spare_cuda, visible in (("0", "0"), ("1", ""), ("", "")):
        monkeypatch.setenv("CLORCH_SPARE_CUDA", spare_cuda)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        with caplog.at_level(logging.WARNING, logger=app.__name__):
            app._warm_cuda_driver()
        assert not caplog.records, (spare_cuda, visible)  # the CPU build would have failed, and said so


def test_the_ranks_zygote_never_initialises_cuda_whatever_clorch_spare_cuda_says(monkeypatch) -> None:
    # The zygote runs a spare's imports (host/zygote.py's preload: app.warm_imports) and forks every
    # rank: torch marks each process forked after a CUDA init a bad fork, so CLORCH_SPARE_CUDA=1
    # there would fail every rank's first CUDA call. (preload itself starts a process, uname, on
    # its imports: not for a unit test; it is warm_imports that must not touch CUDA.)
    import torch

    from clorch_repl.kernel import app

    called: list[str] = []
    monkeypatch.setattr(torch.cuda, "init", lambda: called.append("torch.cuda.init"))
    monkeypatch.setenv("CLORCH_SPARE_CUDA", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    app.warm_imports()
    assert called == []
    app._warm_cuda_driver()  # what the spare itself calls, after warm_imports, in its own process
    assert called == ["torch.cuda.init"]
