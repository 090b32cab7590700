"""Worker processes of chapters 11b (pd_split) and 13 (tensor parallelism), supervised by chapter 11a's functions,
probed as an attacker and as a careless operator would: every socket they listen on is on loopback (even where
gloo's own default would pick another interface); a rank refuses, without unpickling it, a message not signed with
its launch's secret; a tensor-parallel engine idle for longer than its step timeout still serves; ranks and workers
die with a SIGKILLed parent, whether they are starting, idle, or blocked on a full pipe; a script without the
`__main__` guard gets one line within seconds; `health()` says None while every worker lives and names the one that
died."""
import datetime, os, pickle, signal, socket, subprocess, sys, textwrap, time
from pathlib import Path

import psutil, pytest, torch
import torch.distributed as dist
from minfer.disagg import DisaggEngine
from minfer.workers import WorkerDied, free_port
from minfer.engine import EngineConfig
from minfer.tokenizer import Tokenizer
from minfer.sequence import SamplingParams, Sequence

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def alive(pid):
    "A process that exists and is not a zombie."
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def gone(pids, within):
    "Whether every process in `pids` has exited within `within` seconds."
    deadline = time.perf_counter() + within
    while any(alive(p) for p in pids) and time.perf_counter() < deadline:
        time.sleep(0.1)
    return not any(alive(p) for p in pids)


def spawned_children(pid):
    "The processes multiprocessing spawned under `pid` (not its resource tracker)."
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for c in children:
        try:
            if "spawn_main" in " ".join(c.cmdline()):
                out.append(c.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def greedy(engine, ids, max_tokens=4):
    "Run one greedy request on `engine` to the end (with a time limit); -> its tokens."
    seq = Sequence(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    engine.add(seq)
    deadline = time.perf_counter() + 120
    while engine.has_unfinished():
        assert time.perf_counter() < deadline, "the engine did not finish in time"
        engine.step()
    return seq.output_ids


class Marker:
    "A pickle that creates a file when it is unpickled: the proof that a rank ran code from the wire."
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def other_interface():
    """Point gloo's own default (GLOO_SOCKET_IFNAME) at a non-loopback interface of this machine while the module's
    engines start, so that a group left to that default would listen there: binding to loopback must be explicit."""
    names = [n for n, addrs in psutil.net_if_addrs().items()
             if any(a.family == socket.AF_INET and not a.address.startswith("127.") for a in addrs)]
    before = os.environ.get("GLOO_SOCKET_IFNAME")
    if names:
        os.environ["GLOO_SOCKET_IFNAME"] = names[0]
    yield names[0] if names else None
    if before is None:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)
    else:
        os.environ["GLOO_SOCKET_IFNAME"] = before


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def tp(other_interface):
    "A tensor-parallel engine whose step timeout (4 s) is shorter than the idle pause below."
    from minfer.tp import TensorParallelEngine
    engine = TensorParallelEngine(EngineConfig(tensor_parallel_size=2, kv_cache_bytes=2**27).resolve(),
                                  timeout=4.0)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def pd(other_interface):
    "A prefill/decode engine (two workers, each with the whole model)."
    engine = DisaggEngine(EngineConfig(pd_split=True, kv_cache_bytes=2**27).resolve(), timeout=20.0)
    yield engine
    engine.close()


def listening(pid):
    "The addresses process `pid` listens on (TCP, IPv4 and IPv6)."
    return [c.laddr.ip for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]


def test_every_listening_socket_is_on_loopback(tp, pd, other_interface):
    "This process (rank 0, the P/D engine's store) and every worker and rank listen on 127.0.0.1 only."
    pids = [os.getpid(), *(p.pid for p in tp.procs.values()), *(p.pid for p in pd.procs.values())]
    addresses = {pid: listening(pid) for pid in pids}
    assert addresses[os.getpid()] and all(addresses[p.pid] for p in pd.procs.values()), addresses  # not vacuous
    assert all(a in ("127.0.0.1", "::1") for ips in addresses.values() for a in ips), (other_interface, addresses)


def test_an_idle_tensor_parallel_engine_outlives_its_step_timeout(tp, tok):
    "Idle for 6 s with a 4 s step timeout: the ranks wait for work without a bound, the next request is served."
    ids = tok.encode("The capital of France is")
    want = greedy(tp, ids)
    time.sleep(6)
    assert greedy(tp, ids) == want
    assert tp.health() is None


def test_a_rank_slower_to_load_than_the_step_timeout_still_starts(monkeypatch):
    """Rank 0 launched as torchrun launches it, rank 1 played by hand in a thread: it joins, takes the config, then
    loads for 5 s, longer than the 2 s step timeout. Start-up is bounded by `start_timeout`, not the step timeout:
    rank 0 waits for the slow rank to take the pool's size (CI lost a run to a rank loading slowly beside a busy
    neighbour), then stops it cleanly."""
    import threading
    from minfer.tp import FOREVER, RankGroup, TensorParallelEngine
    port, secret = free_port(), os.urandom(32)
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": "0",
                        "MINFER_WORKER_SECRET": secret.hex()}.items():
        monkeypatch.setenv(name, value)
    got = []

    def slow_rank():
        starting = datetime.timedelta(seconds=60)
        store = dist.TCPStore("127.0.0.1", port, None, False, starting)
        store.add("joined", 1)
        group = RankGroup(store, 1, 2, "127.0.0.1", secret, 2.0)
        got.append(group.broadcast(wait=starting)[0])
        time.sleep(5.0)  # loading its slice
        got.append(group.broadcast(wait=starting)[0])
        got.append(group.broadcast(wait=FOREVER)[0])

    rank1 = threading.Thread(target=slow_rank, daemon=True)
    rank1.start()
    engine = TensorParallelEngine(EngineConfig(tensor_parallel_size=2, kv_cache_bytes=2**27).resolve(),
                                  timeout=2.0, start_timeout=60.0)
    engine.close()
    rank1.join(30)
    assert got == ["config", "pool", "stop"]


def test_a_forged_message_is_refused_without_unpickling(tmp_path):
    "The verification alone: only this launch's secret and this message's number unpickle; nothing else runs code."
    from minfer.tp import ForgedMessage, sign, signed_loads
    marker, secret = tmp_path / "ran", os.urandom(32)
    payload = pickle.dumps(Marker(marker))
    forged = {"unsigned": payload, "another secret": sign(os.urandom(32), 0, payload) + payload,
              "replayed": sign(secret, 1, payload) + payload, "truncated": sign(secret, 0, payload)[:16],
              "tampered": sign(secret, 0, payload) + payload + b"."}
    for name, data in forged.items():
        with pytest.raises(ForgedMessage) as e:
            signed_loads(secret, 0, data)
        assert "\n" not in str(e.value) and not marker.exists(), name
    signed_loads(secret, 0, sign(secret, 0, payload) + payload).close()  # the control: a signed pickle does run
    assert marker.exists()


def test_a_worker_refuses_an_unsigned_broadcast_and_exits(tmp_path):
    """End to end: `minfer worker` (rank 1, its secret in the environment) joins a "rank 0" that is an attacker: a
    store and a gloo group of its own, broadcasting a bare pickle the way a rank's messages travel. The worker exits
    with one line; the marker file is never created."""
    marker, port = tmp_path / "ran", free_port()
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": "1",
           "MINFER_WORKER_SECRET": os.urandom(32).hex()}
    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", port, None, True, timeout, wait_for_workers=False)
    worker = subprocess.Popen([sys.executable, "-m", "minfer", "worker"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        options = dist.ProcessGroupGloo._Options()
        options._devices, options._timeout = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")], timeout
        group = dist.ProcessGroupGloo(store, 0, 2, options)
        root = dist.BroadcastOptions()
        root.rootRank = 0
        data = torch.frombuffer(bytearray(pickle.dumps(("config", Marker(marker), True))), dtype=torch.uint8)
        group.broadcast([torch.tensor([data.numel()])], root).wait()
        group.broadcast([data], root).wait()
        code = worker.wait(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
    err = worker.stderr.read().strip()
    assert not marker.exists(), "the worker unpickled an unsigned message"
    assert code != 0 and len(err.splitlines()) == 1 and "refused" in err, err


def test_a_worker_without_its_secret_is_refused_in_one_line():
    "`minfer worker` with torchrun's environment but no MINFER_WORKER_SECRET: one line, exit status 2, at once."
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "RANK": "1"}
    env.pop("MINFER_WORKER_SECRET", None)
    out = subprocess.run([sys.executable, "-m", "minfer", "worker"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "MINFER_WORKER_SECRET" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_health_names_a_worker_that_died_while_idle(tp, pd, tok):
    "A rank and a P/D worker SIGKILLed while idle: health() names each without a step; the next step raises."
    assert tp.health() is None and pd.health() is None
    rank = tp.procs[1]
    os.kill(rank.pid, signal.SIGKILL)
    rank.join(5)
    assert tp.health() == f"rank 1 (pid {rank.pid}) exited with code -9"
    with pytest.raises(WorkerDied, match="rank 1 .*exited with code -9"):
        greedy(tp, tok.encode("Hello"))
    assert "stopped" in tp.health()
    decode = pd.procs["decode"]
    os.kill(decode.pid, signal.SIGKILL)
    decode.join(5)
    assert pd.health() == f"the decode worker (pid {decode.pid}) exited with code -9"
    with pytest.raises(WorkerDied, match="decode worker .*exited with code -9"):
        greedy(pd, tok.encode("Hello"))
    assert "stopped" in pd.health()


STARTING = """
    from minfer import LLM
    if __name__ == "__main__":
        LLM(tensor_parallel_size=2, kv_cache_bytes=2**27)
"""
IDLE = """
    import time
    from minfer import LLM, SamplingParams
    if __name__ == "__main__":
        llm = LLM(tensor_parallel_size=2, kv_cache_bytes=2**27)
        llm.generate("Hi", SamplingParams(max_tokens=2))
        print("ready", flush=True)
        time.sleep(600)
"""
FULL_PIPE = """
    import fcntl, termios, time
    from minfer import LLM
    from minfer.disagg import ROLES
    from minfer.workers import post
    if __name__ == "__main__":
        llm = LLM(pd_split=True, kv_cache_bytes=2**27)
        engine = llm.engine
        for _ in range(3000):  # replies nobody reads: the workers' outbox pipe fills, their writes block
            for role in ROLES:
                post(engine.inboxes[role], "stats")
        pipe = engine.outbox._reader.fileno()
        deadline = time.time() + 60
        while time.time() < deadline:
            filled = int.from_bytes(fcntl.ioctl(pipe, termios.FIONREAD, bytes(4)), "little")
            if filled >= 60000:
                break
            time.sleep(0.2)
        print("ready", filled, flush=True)
        time.sleep(600)
"""


# state -> the parent's script, its spawned processes, the seconds they may outlive it (a rank killed while it still
# imports torch runs its watchdog once the import is done: a few seconds on a busy machine)
PARENTS = {"starting": (STARTING, 1, 10.0), "idle": (IDLE, 1, 3.0), "blocked on a full pipe": (FULL_PIPE, 2, 3.0)}


@pytest.mark.parametrize("state", PARENTS)
def test_workers_die_with_a_killed_parent(tmp_path, state):
    """SIGKILL the process that started the engine; its ranks (tensor parallel) or workers (pd_split) are gone within
    seconds: while starting (the rank about to connect to a store that died with its parent), idle, or with a full
    outbox pipe."""
    script, workers, seconds = PARENTS[state]
    path = tmp_path / "parent.py"
    path.write_text(textwrap.dedent(script))
    proc = subprocess.Popen([sys.executable, str(path)], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        if state == "starting":
            deadline = time.time() + 60
            while len(spawned_children(proc.pid)) < workers and time.time() < deadline:
                time.sleep(0.02)
        else:
            line = proc.stdout.readline()
            assert line.startswith("ready"), line
            if state == "blocked on a full pipe":
                assert int(line.split()[1]) >= 60000, line
        children = spawned_children(proc.pid)
        assert len(children) == workers, children
    finally:
        proc.kill()
        proc.wait()
    survived = not gone(children, seconds)
    for pid in filter(alive, children):  # a failed check leaves no orphan behind
        os.kill(pid, signal.SIGKILL)
    assert not survived, f"{state}: a worker outlived its SIGKILLed parent by {seconds:.0f} s"


@pytest.mark.parametrize("switch", ["tensor_parallel_size=2", "pd_split=True"])
def test_a_script_without_the_main_guard_gets_one_line(tmp_path, switch):
    "No `if __name__ == '__main__':`: the spawned processes re-run the script; the parent says so in one line, fast."
    path = tmp_path / "unguarded.py"
    path.write_text(f"from minfer import LLM\nLLM({switch})\n")
    t = time.perf_counter()
    out = subprocess.run([sys.executable, str(path)], env=ENV, capture_output=True, text=True, timeout=60)
    seconds = time.perf_counter() - t
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode != 0 and 'if __name__ == "__main__":' in last and f"LLM({switch})" in last, out.stderr
    assert out.stderr.count("Traceback") == 1, out.stderr  # the parent's; the spawned processes leave quietly
    assert seconds < 30, seconds
