"""One private JupyterLab server and one Chromium page for every browser test module.

Why shared: starting ``jupyter lab`` and Chromium costs 10-20 s on the 2-core CI box, and the
suite's time is bounded; each module writes its own notebooks into the server's root. Screenshots
go to tests/artifacts/browser/ (not committed). At the end the server is shut down and nothing it
started may still run.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Iterator

import pytest

from lab_driver import ARTIFACTS, LabPage, LabServer, clean_dir, env_without_repository, missing_tools


@pytest.fixture(scope="session")
def lab_server(tmp_path_factory: Any) -> Iterator[tuple[LabServer, LabPage]]:
    missing = missing_tools()
    if missing:
        reason = f"the browser test needs {', '.join(missing)} (apt-get install chromium chromium-driver; " \
                 "pip install -e '.[browser]')"
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser test: {reason}")
        pytest.skip(reason)
    clean_dir(ARTIFACTS)
    home = str(tmp_path_factory.mktemp("lab-home"))
    notebooks = os.path.join(str(tmp_path_factory.mktemp("lab-root")), "notebooks")
    os.makedirs(notebooks)
    server = LabServer(home, notebooks, os.path.join(ARTIFACTS, "jupyter-lab.log"), env_without_repository())
    page: LabPage | None = None
    try:
        server.start()
        page = LabPage(server, ARTIFACTS, profile=os.path.join(home, "chromium-profile"))
        yield server, page
    finally:
        if page is not None:
            page.close()
        leftovers = server.stop()
        shutil.rmtree(os.path.join(home, "chromium-profile"), ignore_errors=True)
    assert not leftovers, f"still running after JupyterLab shut down (ended by the test): {leftovers}"
