"""The notebook kernel's status while a %%distributed cell runs (clorch_repl.notebook.kernel_status):
a control request's idle does not make JupyterLab's status bar say Idle. Fast: a stand-in kernel
records what would be published; tests/integration/test_widgets.py checks it in a real notebook kernel."""

from __future__ import annotations

from typing import Any

from clorch_repl.notebook.kernel_status import busy_during, published_status


def test_only_a_control_requests_idle_during_a_cell_is_held_busy() -> None:
    assert published_status("idle", "control", cell_running=True) == "busy"
    assert published_status("busy", "control", cell_running=True) == "busy"
    assert published_status("idle", "shell", cell_running=True) == "idle"  # the cell's own end
    assert published_status("idle", "control", cell_running=False) == "idle"  # between cells: as ipykernel


class _Kernel:
    def __init__(self) -> None:
        self.published: list[tuple[str, str]] = []

    def _publish_status(self, status: str, channel: str, parent: Any = None) -> None:
        self.published.append((channel, status))


def test_the_kernel_reports_busy_for_the_length_of_the_cell_only() -> None:
    kernel = _Kernel()
    with busy_during(kernel):
        kernel._publish_status("busy", "control")
        kernel._publish_status("idle", "control")
    kernel._publish_status("idle", "control")
    with busy_during(kernel):  # wrapped once, however many cells
        kernel._publish_status("idle", "control")
    assert kernel.published == [("control", "busy"), ("control", "busy"), ("control", "idle"), ("control", "busy")]
    with busy_during(None):  # a terminal IPython: no kernel, nothing to hold
        pass
