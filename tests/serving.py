"""`minfer serve` for a test module: the real server process on a free loopback port, started as a user starts
it (`python -m minfer.serve`, every chapter loaded), answering `/health` before the first test, stopped after the
last."""
import contextlib, os, re, subprocess, sys, threading, time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def server_process(*args, start_timeout=180):
    """`python -m minfer.serve --host 127.0.0.1 --port 0 *args`; -> (base URL, process). Start-up prints
    `ready on http://host:port` (port 0: a free one); `proc.log` collects its stderr, start-up lines first."""
    cmd = [sys.executable, "-m", "minfer.serve", "--host", "127.0.0.1", "--port", "0", *args]
    env = {k: v for k, v in os.environ.items() if k != "MINFER_API_KEY"}  # the key, if any, is in `args`
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    log, url = [], None
    deadline = time.time() + start_timeout
    while url is None:
        line = proc.stderr.readline()
        if not line or time.time() > deadline:
            proc.kill()
            pytest.fail("the server did not start:\n" + "".join(log))
        log.append(line)
        if m := re.search(r"ready on (http://\S+)", line):
            url = m.group(1)
    # keep reading stderr so the pipe never fills (and a traceback, if any, is there to show)
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
    proc.log = log
    try:
        wait_for_health(url)
        yield url, proc
        assert proc.poll() is None, "the server died:\n" + "".join(log[-40:])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def wait_for_health(url, tries=200):
    "Until `/health` answers 200 (it is open with or without a key)."
    with httpx.Client() as c:
        for _ in range(tries):
            try:
                if c.get(url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)


def wait_for_idle(http, seconds=15):
    "`/health` once no request runs and no KV block is in use (or after `seconds`)."
    deadline = time.time() + seconds
    while time.time() < deadline:
        s = http.get("/health").json()
        if s["blocks_in_use"] == 0 and s["requests_running"] == 0:
            return s
        time.sleep(0.05)
    return http.get("/health").json()
