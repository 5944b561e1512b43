"""JupyterLab 4 in headless Chromium, for the browser tests: a private server and a page driver.

:class:`LabServer` starts ``jupyter lab`` on 127.0.0.1 with a random token (passed in the
environment, never on a command line), a fresh root folder and its own config, data, runtime,
settings and workspace folders, so that nothing of the user's set-up leaks in. Its settings turn off
the news and update pop-ups (they cover the page) and notebook windowing (JupyterLab otherwise
drops cells that are out of view from the page, and their outputs with them). ``stop`` asks the
server to shut down (its kernels' atexit handlers stop their ranks) and then ends by pid whatever
it started that is still running, saying so.

:class:`LabPage` drives a page with selenium and Debian's chromium/chromedriver (no browser is
downloaded). Traps met while writing it: open notebooks with ``/lab/tree/X.ipynb?reset`` (JupyterLab
reopens earlier notebooks otherwise, each starting a kernel); toolbar buttons are ``jp-button``
elements (``[data-jp-item-name=interrupt]``); a run is over when no prompt shows ``*``, the status
bar says Idle and the toolbar's execution indicator agrees, for a second or more; the status bar
can say "Connecting" while the toolbar already says idle.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Callable, TypeVar

import psutil

logger = logging.getLogger(__name__)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARTIFACTS = os.path.join(ROOT, "tests", "artifacts", "browser")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"  # Debian's packages chromium, chromium-driver
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
T = TypeVar("T")


def missing_tools() -> list[str]:
    """What the browser tests need and this machine lacks (empty when they can run)."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    for module in ("selenium", "jupyterlab"):
        try:
            __import__(module)
        except ImportError:
            missing.append(f"python package {module}")
    return missing


def wait_for(fn: Callable[[], T], timeout: float, what: str, poll: float = 0.25) -> T:
    """Poll ``fn`` until it returns something true; bounded, and the error says what was awaited."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if last:
                return last
        except Exception as exc:  # stale elements and the like while the page changes: poll again
            last = exc
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LabServer:
    """A private ``jupyter lab`` serving ``root`` (a folder the test filled)."""

    def __init__(self, home: str, root: str, log_path: str, env: dict[str, str]) -> None:
        self.home, self.root, self.log_path = home, root, log_path
        self.port = _free_port()
        self.token = secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = dict(env)
        for name in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR",
                     "JUPYTERLAB_SETTINGS_DIR", "JUPYTERLAB_WORKSPACES_DIR"):
            self.env[name] = os.path.join(home, name.lower())
            os.makedirs(self.env[name], exist_ok=True)
        self.env["JUPYTER_TOKEN"] = self.token  # read by jupyter_server; never on the command line
        self.env.pop("JUPYTER_PATH", None)
        self.env.pop("JUPYTER_CONFIG_PATH", None)
        self._write_settings(self.env["JUPYTERLAB_SETTINGS_DIR"])
        self.proc: subprocess.Popen[bytes] | None = None
        self._seen: dict[int, psutil.Process] = {}
        self.leftovers: list[str] = []

    @staticmethod
    def _write_settings(settings: str) -> None:
        files = {
            "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
                {"fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True},
            "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
        }
        for name, value in files.items():
            path = os.path.join(settings, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as fh:
                json.dump(value, fh)

    def start(self, timeout: float = 180.0) -> None:
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
               f"--ServerApp.root_dir={self.root}", "--ServerApp.port_retries=0",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
        if os.geteuid() == 0:
            cmd.append("--allow-root")  # CI runs as root
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(cmd, env=self.env, cwd=self.root, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        wait_for(self._up, timeout, f"jupyter lab on {self.base} (log: {self.log_path})", poll=0.5)

    def _up(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {self.proc.returncode}; see {self.log_path}")
        try:
            with urllib.request.urlopen(self._request("/api/status"), timeout=5) as reply:
                return reply.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def _request(self, path: str, method: str = "GET") -> urllib.request.Request:
        return urllib.request.Request(self.base + path, method=method,
                                      headers={"Authorization": f"token {self.token}"})

    def url(self, path: str) -> str:
        return f"{self.base}{path}{'&' if '?' in path else '?'}token={self.token}"

    def remember_processes(self) -> list[psutil.Process]:
        """Every process the server started so far (kernels, and the ranks they started, run in
        sessions of their own: the server's process group does not hold them)."""
        if self.proc is None:
            return []
        try:
            root = psutil.Process(self.proc.pid)
            for proc in [root, *root.children(recursive=True)]:
                self._seen.setdefault(proc.pid, proc)
        except psutil.Error:
            pass
        return list(self._seen.values())

    def stop(self, timeout: float = 60.0) -> list[str]:
        """Shut the server down and make sure nothing it started runs; returns what had to be ended
        by force (``"pid: command"``), which a test may treat as a failure."""
        if self.proc is None:
            return []
        self.remember_processes()
        try:
            urllib.request.urlopen(self._request("/api/shutdown", "POST"), timeout=10).close()
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            logger.warning("jupyter lab did not take the shutdown request: %s", exc)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            logger.warning("jupyter lab still runs %.0f s after the shutdown request", timeout)
        alive = [p for p in self._seen.values() if _running(p)]
        if alive:
            _, alive = psutil.wait_procs(alive, timeout=15.0)  # ranks stopping after their kernel
        for proc in alive:
            try:
                self.leftovers.append(f"{proc.pid}: {' '.join(proc.cmdline())[:160]}")
                proc.kill()
            except psutil.Error:
                continue
        psutil.wait_procs(alive, timeout=10.0)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None
        return self.leftovers


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class LabPage:
    """One headless Chromium window on a :class:`LabServer`."""

    def __init__(self, server: LabServer, shots: str, profile: str) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        os.environ.setdefault("SE_OFFLINE", "true")  # selenium never fetches a driver: Debian's is used
        self.server, self.shots = server, shots
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                    "--window-size=1400,1000", "--hide-scrollbars", f"--user-data-dir={profile}",
                    "--no-first-run", "--disable-extensions"):
            options.add_argument(arg)
        self.service = Service(CHROMEDRIVER, log_output=os.path.join(shots, "chromedriver.log"))
        self.driver = webdriver.Chrome(service=self.service, options=options)
        self.driver.set_window_size(1400, 1000)
        self._procs: list[psutil.Process] = []

    def close(self) -> None:
        """Quit Chromium and its driver, and end by pid any of their processes that stayed."""
        try:
            self._procs = psutil.Process(self.service.process.pid).children(recursive=True)
            self._procs.append(psutil.Process(self.service.process.pid))
        except (psutil.Error, AttributeError):
            self._procs = []
        try:
            self.driver.quit()
        except Exception as exc:  # a crashed browser: its processes are ended below
            logger.warning("chromium did not quit cleanly: %s", exc)
        _, alive = psutil.wait_procs(self._procs, timeout=10)
        for proc in alive:
            try:
                proc.kill()
            except psutil.Error:
                continue

    # -- the notebook ------------------------------------------------------------------------------

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    PANEL = "document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)')"

    def open_notebook(self, path: str, timeout: float = 180.0) -> None:
        from selenium.webdriver.common.by import By

        self.driver.get(self.server.url(f"/lab/tree/{path}?reset"))
        wait_for(lambda: self.driver.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel .jp-Cell"), timeout,
                 f"the cells of {path}")
        wait_for(lambda: self.kernel_status() == "idle", timeout, f"the kernel of {path} to be idle")
        time.sleep(1.0)
        self.dismiss_toasts()

    def kernel_status(self) -> str:
        """'idle' when the status bar and the toolbar's execution indicator both say so."""
        return self.js("""
          const sb = Array.from(document.querySelectorAll('.jp-StatusBar-TextItem')).map(e => e.textContent)
                       .find(t => t.includes(' | '));
          const sbs = sb ? sb.split(' | ').pop().trim().toLowerCase() : 'none';
          const panel = %s;
          const ind = panel && panel.querySelector('.jp-Notebook-ExecutionIndicator');
          const ds = ind ? ind.getAttribute('data-status') : 'none';
          return (sbs === 'idle' && ds === 'idle') ? 'idle' : (sbs + '/' + ds);""" % self.PANEL)

    def prompts(self) -> list[str]:
        return self.js("""
          return Array.from(%s.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt'))
                      .map(e => e.textContent.trim());""" % self.PANEL)

    def busy(self) -> bool:
        return any("*" in p for p in self.prompts()) or self.kernel_status() != "idle"

    def wait_idle(self, timeout: float, settle: float = 1.5) -> None:
        """Done when no prompt shows ``*`` and the kernel says idle, steadily for ``settle`` s."""
        deadline = time.monotonic() + timeout
        since: float | None = None
        while time.monotonic() < deadline:
            self.server.remember_processes()  # ranks come and go during a run: note each one
            if not self.busy():
                since = since or time.monotonic()
                if time.monotonic() - since >= settle:
                    return
            else:
                since = None
            time.sleep(0.25)
        raise TimeoutError(f"still busy after {timeout:.0f} s: prompts {self.prompts()}, "
                           f"kernel {self.kernel_status()}")

    def menu(self, top: str, item: str) -> None:
        from selenium.webdriver.common.by import By

        wait_for(lambda: self.driver.find_element(
            By.XPATH, f"//div[contains(@class,'lm-MenuBar-itemLabel') and normalize-space()='{top}']"),
            30, f"menu {top}").click()
        wait_for(lambda: self.driver.find_element(
            By.XPATH, f"//div[contains(@class,'lm-Menu-itemLabel') and normalize-space()='{item}']"),
            30, f"menu item {top} > {item}").click()
        time.sleep(0.3)

    def click_dialog_button(self, label: str) -> None:
        """Click the button ``label`` of the dialog on the page (Kernel > Restart Kernel…'s "Restart")."""
        from selenium.webdriver.common.by import By

        wait_for(lambda: self.driver.find_element(
            By.XPATH, f"//div[contains(@class,'jp-Dialog')]//button[normalize-space()='{label}']"),
            30, f"the dialog's {label} button").click()
        time.sleep(0.3)

    def run_all(self, timeout: float) -> float:
        """Run > Run All Cells, then wait until the run is over; returns how long it took."""
        started = time.monotonic()
        self.menu("Run", "Run All Cells")
        wait_for(self.busy, 60, "the run to start")
        self.wait_idle(timeout)
        return time.monotonic() - started

    def toolbar_button(self, name: str) -> Any:
        from selenium.webdriver.common.by import By

        return wait_for(lambda: self.driver.find_element(
            By.CSS_SELECTOR, f".jp-NotebookPanel:not(.lm-mod-hidden) [data-jp-item-name={name}] jp-button, "
                             f".jp-NotebookPanel:not(.lm-mod-hidden) jp-button[data-jp-item-name={name}], "
                             f".jp-NotebookPanel:not(.lm-mod-hidden) [data-jp-item-name={name}] button"),
            30, f"the toolbar's {name} button")

    def cell_count(self) -> int:
        return int(self.js("return %s.querySelectorAll('.jp-Cell').length;" % self.PANEL))

    def cell_source(self, index: int) -> str:
        return self.js("""
          const c = %s.querySelectorAll('.jp-Cell')[arguments[0]];
          const e = c && c.querySelector('.jp-InputArea-editor');
          return e ? e.innerText : '';""" % self.PANEL, index)

    def output_text(self, index: int) -> str:
        return self.js("""
          const c = %s.querySelectorAll('.jp-Cell')[arguments[0]];
          const o = c && c.querySelector('.jp-Cell-outputWrapper');
          return o ? o.innerText : '';""" % self.PANEL, index)

    def output_tables(self, index: int) -> list[list[list[str]]]:
        """Every HTML table a cell shows, as rows of cell texts (header row included)."""
        return self.js("""
          const c = %s.querySelectorAll('.jp-Cell')[arguments[0]];
          if (!c) return [];
          return Array.from(c.querySelectorAll('.jp-Cell-outputWrapper table')).map(t =>
            Array.from(t.querySelectorAll('tr')).map(r =>
              Array.from(r.querySelectorAll('th,td')).map(d => d.innerText.trim())));""" % self.PANEL, index)

    def widget_outputs(self, index: int) -> list[dict[str, Any]]:
        """The cell's outputs in order, as JupyterLab shows them: each one's text, and for a rendered
        widget its progress bars' fill (percent of the track, as drawn) and sliders' readouts.
        A widget that failed shows its error text ("Error displaying widget") instead."""
        return self.js("""
          const c = %s.querySelectorAll('.jp-Cell')[arguments[0]];
          if (!c) return [];
          return Array.from(c.querySelectorAll('.jp-OutputArea-child')).map(o => ({
            text: o.innerText.replace(/\u2007/g, ' '),  // tqdm pads its text with figure spaces
            widget: !!o.querySelector('.jupyter-widgets'),
            bars: Array.from(o.querySelectorAll('.widget-hprogress .progress-bar')).map(b => {
              const track = b.parentElement.getBoundingClientRect().width;
              return track ? 100 * b.getBoundingClientRect().width / track : -1; }),
            readouts: Array.from(o.querySelectorAll('.widget-slider .widget-readout')).map(r => r.innerText.trim()),
          }));""" % self.PANEL, index)

    def slider_handle(self, index: int, nth: int) -> Any:
        """The ``nth`` slider handle in the cell's output (to focus it and press keys)."""
        from selenium.webdriver.common.by import By

        cells = self.driver.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell")
        return cells[index].find_elements(By.CSS_SELECTOR, ".widget-slider .noUi-handle")[nth]

    def stdin_boxes(self, index: int) -> list[dict[str, Any]]:
        """JupyterLab's input boxes in the cell's output (``.jp-Stdin``: the kernel's input_request
        shown as its prompt and a text field): each one's prompt text and whether its field is still
        open for typing (an answered box turns into the prompt followed by the answer)."""
        return self.js("""
          const c = %s.querySelectorAll('.jp-Cell')[arguments[0]];
          if (!c) return [];
          return Array.from(c.querySelectorAll('.jp-Stdin')).map(b => {
            const p = b.querySelector('.jp-Stdin-prompt'), i = b.querySelector('input.jp-Stdin-input');
            return {prompt: p ? p.textContent : '', open: !!i && !i.disabled && i.offsetParent !== null};
          });""" % self.PANEL, index)

    def answer_stdin(self, index: int, text: str) -> None:
        """Type ``text`` into the cell's open input box and press Enter, as a user does."""
        from selenium.webdriver.common.by import By
        from selenium.webdriver.common.keys import Keys

        cells = self.driver.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell")
        field = [f for f in cells[index].find_elements(By.CSS_SELECTOR, ".jp-Stdin input.jp-Stdin-input")
                 if f.is_displayed() and f.is_enabled()]
        assert len(field) == 1, f"expected one open input box in cell {index}, found {len(field)}"
        field[0].click()
        field[0].send_keys(text)
        field[0].send_keys(Keys.ENTER)

    def prompt(self, index: int) -> str:
        return self.js("""
          const c = %s.querySelectorAll('.jp-Cell')[arguments[0]];
          const p = c && c.querySelector('.jp-InputArea-prompt');
          return p ? p.textContent.trim() : '';""" % self.PANEL, index)

    def find_cell(self, starts_with: str) -> int:
        for index in range(self.cell_count()):
            if self.cell_source(index).strip().startswith(starts_with):
                return index
        raise AssertionError(f"no cell starts with {starts_with!r}")

    def run_cell(self, index: int) -> None:
        """Select a cell and run it with Ctrl+Enter (the view stays on it, unlike Shift+Enter)."""
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.by import By
        from selenium.webdriver.common.keys import Keys

        self.js("%s.querySelectorAll('.jp-Cell')[arguments[0]].scrollIntoView({block: 'start'});" % self.PANEL,
                index)
        time.sleep(0.3)
        cells = self.driver.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell")
        cells[index].find_element(By.CSS_SELECTOR, ".jp-InputPrompt").click()
        time.sleep(0.2)
        ActionChains(self.driver).key_down(Keys.CONTROL).send_keys(Keys.ENTER).key_up(Keys.CONTROL).perform()

    def dismiss_toasts(self) -> None:
        from selenium.webdriver.common.by import By

        for button in self.driver.find_elements(By.CSS_SELECTOR, ".Toastify__close-button, button.jp-toast-button"):
            try:
                if button.text.strip() in ("No", "", "×"):
                    button.click()
            except Exception as exc:  # a toast that went away by itself
                logger.debug("toast: %s", exc)

    # -- the main thread ---------------------------------------------------------------------------

    def watch_main_thread(self) -> float:
        """Record the page's long tasks (PerformanceObserver 'longtask': the main thread busy over
        50 ms at a time) and each click as the page's own capture listener sees it; returns the
        page's clock (performance.now(), ms) to read the tasks since."""
        return float(self.js(_WATCH))

    def long_tasks(self, since: float) -> list[float]:
        """The durations (ms) of the long tasks that started after ``since`` (page clock)."""
        return [d for start, d in self.js("return window.__clorchWatch.tasks;") if start >= since]

    def timed_click(self, element: Any, timeout: float = 30.0) -> float:
        """Click ``element`` as a user would and return the seconds from the click until the page
        ran its first listener for it (a busy main thread delays that)."""
        count = int(self.js("return window.__clorchWatch.clicks.length;"))
        sent = time.time() * 1000
        element.click()
        seen = wait_for(lambda: self.js("return window.__clorchWatch.clicks[arguments[0]];", count), timeout,
                        "the page to see the click", poll=0.02)
        return (float(seen["at"]) - sent) / 1000

    def output_offset(self, index: int, needle: str) -> dict[str, float] | None:
        """Where the first output of the cell whose text holds ``needle`` is, once the cell is
        scrolled to the top of the notebook: its top (px) below the cell's output area's top and
        below the notebook's visible top, and the visible height; None when no output holds it."""
        return self.js("""
          const c = %s.querySelectorAll('.jp-Cell')[arguments[0]];
          if (!c) return null;
          c.scrollIntoView({block: 'start'});
          const area = c.querySelector('.jp-OutputArea');
          const o = Array.from(c.querySelectorAll('.jp-OutputArea-child')).find(e => e.innerText.includes(arguments[1]));
          if (!o || !area) return null;
          const s = %s.querySelector('.jp-WindowedPanel-outer') || %s.querySelector('.jp-Notebook');
          const top = s.getBoundingClientRect().top, r = o.getBoundingClientRect();
          return {in_area: r.top - area.getBoundingClientRect().top, in_view: r.top - top,
                  view: s.clientHeight};""" % (self.PANEL, self.PANEL, self.PANEL), index, needle)

    # -- screenshots -------------------------------------------------------------------------------

    SCROLLER = ("const p = %s; const s = p && (p.querySelector('.jp-WindowedPanel-outer') "
                "|| p.querySelector('.jp-Notebook'));" % PANEL)

    def screenshot_cell(self, name: str, index: int) -> str:
        """The window as a user sees it with cell ``index`` scrolled to the top (a long output's
        whole-notebook image is too tall to read)."""
        path = os.path.join(self.shots, f"{name}.png")
        self.js("%s.querySelectorAll('.jp-Cell')[arguments[0]].scrollIntoView({block: 'start'});" % self.PANEL,
                index)
        time.sleep(0.5)
        self.driver.save_screenshot(path)
        return path

    def screenshot(self, name: str) -> str:
        """The whole notebook in one image: the window grows to the notebook's height. The first
        cell is made the active one first, or JupyterLab scrolls back to the active cell."""
        from selenium.webdriver.common.by import By

        path = os.path.join(self.shots, f"{name}.png")
        try:
            self.js(self.SCROLLER + "if (s) s.scrollTop = 0;")
            cells = self.driver.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell")
            if cells:
                cells[0].find_element(By.CSS_SELECTOR, ".jp-InputPrompt").click()
            time.sleep(0.3)
            height = self.js(self.SCROLLER + "return s ? s.scrollHeight : 1000;")
            self.driver.set_window_size(1400, min(int(height) + 300, 16000))
            time.sleep(1.0)
            self.js(self.SCROLLER + "if (s) { s.scrollTop = 0; s.dispatchEvent(new Event('scroll')); }")
            time.sleep(0.5)
            self.driver.save_screenshot(path)
        finally:
            self.driver.set_window_size(1400, 1000)
            time.sleep(0.3)
        return path


def copy_notebook(src: str, dst_dir: str) -> str:
    """Copy a notebook without its outputs into the server's root (JupyterLab saves into it)."""
    import nbformat

    nb = nbformat.read(src, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    path = os.path.join(dst_dir, os.path.basename(src))
    nbformat.write(nb, path)
    return path


def clean_dir(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def write_notebook(folder: str, name: str, cells: tuple[str, ...]) -> str:
    """A notebook of ``cells`` (code) for the notebook's own python3 kernel, as ``folder/name``."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in cells]
    path = os.path.join(folder, name)
    nbformat.write(nb, path)
    return path


def env_without_repository() -> dict[str, str]:
    """The server's environment: the repository off PYTHONPATH (clorch_repl comes from the
    installed package, as a user's would) and no CLORCH_NPROC (the notebooks say their ranks)."""
    env = dict(os.environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != ROOT]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.pop("CLORCH_NPROC", None)
    return env


# The main thread's long tasks and a click's delay, read in the page (installed by watch_main_thread)
_WATCH = """
  if (!window.__clorchWatch) {
    window.__clorchWatch = {tasks: [], clicks: []};
    new PerformanceObserver(list => list.getEntries().forEach(e =>
        window.__clorchWatch.tasks.push([e.startTime, e.duration]))).observe({type: 'longtask'});
    window.addEventListener('click', e => window.__clorchWatch.clicks.push(
        {at: Date.now(), delay: performance.now() - e.timeStamp}), true);
  }
  return performance.now();"""
