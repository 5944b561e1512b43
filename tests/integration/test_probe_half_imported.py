"""A probe answered while the rank's main thread is still importing torch (clorch_repl.common.imported).

A start's join imports torch in fresh interpreters, and an interrupt of that start asks every rank
where it is: the control thread answers while ``torch`` is in ``sys.modules`` but its
``__init__`` has not finished. A CI run saw a rank die of SIGSEGV there. The answer must not touch
such a torch at all, and must touch it once its import is over (or the check would prove nothing).

Mock: a stand-in ``torch`` package (this test cannot stop the real torch's import half way), in a
child process, so that it never meets the real one in this interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

FAKE_TORCH = textwrap.dedent('''
    import threading
    TOUCHED = []
    RELEASE = threading.Event()
    RELEASE.wait(30)  # the import stays half done until the test has asked its questions

    class _Cuda:
        def is_initialized(self):
            TOUCHED.append("cuda.is_initialized")
            return False

    cuda = _Cuda()
''')

SCRIPT = textwrap.dedent('''
    import json, sys, threading, time
    sys.path[:0] = [{fake!r}, {root!r}]
    from clorch_repl.diagnosis import probe, record
    from clorch_repl.common.imported import imported

    importer = threading.Thread(target=lambda: __import__("torch"))
    importer.start()
    while "torch" not in sys.modules:
        time.sleep(0.005)
    half = {{"imported": imported("torch") is not None, "cuda_busy": probe.cuda_busy(),
            "read": record.read(collectives=False)[1], "groups": record.group_members()}}
    torch = sys.modules["torch"]
    touched_half = list(torch.TOUCHED)
    torch.RELEASE.set()
    importer.join(30)
    whole = {{"imported": imported("torch") is not None, "cuda_busy": probe.cuda_busy()}}
    print(json.dumps({{"half": half, "touched_half": touched_half, "whole": whole, "touched": torch.TOUCHED}}))
''')


def test_a_probe_during_torchs_import_does_not_touch_it_and_does_once_it_finished(tmp_path) -> None:
    package = tmp_path / "fake" / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_TORCH)
    script = SCRIPT.format(fake=str(tmp_path / "fake"), root=ROOT)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["half"]["imported"] is False
    assert seen["half"]["cuda_busy"] is None
    assert "has not finished" in seen["half"]["read"]
    assert seen["half"]["groups"] == {}
    assert seen["touched_half"] == [], "the probe called into torch while its import was still running"
    assert seen["whole"]["imported"] is True
    assert seen["touched"] == ["cuda.is_initialized"], "once imported, torch must be asked (else the test proves nothing)"
