"""Chapter 11b: prefill and decode on separate worker processes (`pd_split=True`).

Greedy tokens must equal the co-located engine's (chapter 06b's `LLMEngine`, itself checked against naive decode) on
the same prompts: with prefix-cache hits on the prefill side, n > 1 forks, aborts while a transfer is under way, and
requests that wait for room in a small decode pool. Faults: a worker that dies ends the requests in flight with
finish_reason='error' and a `WorkerDied`, nothing hangs, and no worker process outlives `close()` or the program.
Each `DisaggEngine` costs two model loads, so one is shared by the module and the fault tests use one `LLM` more."""
import os, signal, subprocess, sys, textwrap, time
from pathlib import Path

import pytest
import torch
from minfer.engine import EngineConfig, build_model, build_engine
from minfer.disagg import DisaggEngine
from minfer.workers import WorkerDied, post
from minfer.gguf import data_dir
from minfer.tokenizer import Tokenizer
from minfer.paged import PagedKVCache
from minfer.sequence import Sequence, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
DECODE_BLOCKS = 24  # a small decode pool (384 tokens), so that requests have to wait for room in it


def gone(pids, within=10.0):
    "Whether every process in `pids` has exited within `within` seconds (a worker takes a moment to shut down)."
    deadline = time.perf_counter() + within
    while any(alive(p) for p in pids) and time.perf_counter() < deadline: time.sleep(0.1)
    return not any(alive(p) for p in pids)


def alive(pid):
    "A process that exists and is not a zombie."
    try: return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError: return False


@pytest.fixture(scope="module")
def config():
    return EngineConfig(pd_split=True, prefix_cache=True, max_num_batched_tokens=64).resolve()


@pytest.fixture(scope="module")
def tok(config): return Tokenizer(config.model)


@pytest.fixture(scope="module")
def colocated(config):
    "The reference: the same switches in one process (chapter 06b's engine), no prefix cache."
    own = EngineConfig(model=config.model, max_num_batched_tokens=64).resolve()
    return build_engine(own, build_model(own))


@pytest.fixture(scope="module")
def split(config):
    block_bytes = PagedKVCache.block_bytes(_cfg(config), config.block_size)
    eng = DisaggEngine(config, timeout=20.0, decode_overrides=dict(kv_cache_bytes=DECODE_BLOCKS * block_bytes))
    yield eng
    pids = [p.pid for p in eng.procs.values()]
    eng.close()
    assert not any(alive(p) for p in pids)


def _cfg(config):
    from minfer.model import ModelConfig
    return ModelConfig.from_folder(config.model)


def long_ids(tok, start, n):
    ids = tok.encode((data_dir() / "text" / "course.txt").read_text()[:20000])
    return ids[start:start + n]


def run(engine, seqs_and_forks, limit=120):
    "Add every (seq, forks) and step until all finish (with a time limit: a hang is a failure, not a stuck test)."
    for seq, forks in seqs_and_forks: engine.add(seq, forks)
    deadline = time.perf_counter() + limit
    while engine.has_unfinished():
        assert time.perf_counter() < deadline, "engine did not finish in time"
        engine.step()


def greedy(ids, max_tokens, n=1):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n)
    seqs = [Sequence(ids, sp) for _ in range(n)]
    return seqs[0], seqs[1:]


def reference(colocated, prompts, max_tokens):
    pairs = [greedy(p, max_tokens) for p in prompts]
    run(colocated, pairs)
    return [s.output_ids for s, _ in pairs]


def test_greedy_matches_colocated_with_prefix_hits_and_forks(split, colocated, tok):
    shared = long_ids(tok, 0, 40)  # two whole blocks and a bit: the second request takes them from the prefix cache
    prompts = [tok.encode("The three primary colors are"), shared + tok.encode(" In short,"),
               long_ids(tok, 500, 70), shared + tok.encode(" To sum up,")]
    want = reference(colocated, prompts, 12)
    pairs = [greedy(p, 12, n=2 if i == 2 else 1) for i, p in enumerate(prompts)]
    run(split, pairs[:2])  # the shared prefix enters the prefill worker's cache
    run(split, pairs[2:])
    got = [s.output_ids for s, _ in pairs]
    assert got == want
    assert [f.output_ids for f in pairs[2][1]] == [want[2]]  # the fork decodes the same greedy tokens
    assert pairs[3][0].metrics.num_cached_tokens == 32  # a prefix-cache hit on the prefill side
    stats = split.worker_stats()
    assert stats["prefill"]["cached_blocks"] > 0
    assert stats["decode"]["blocks_in_use"] == 0
    assert stats["prefill"]["blocks_in_use"] == stats["prefill"]["cached_blocks"]


def test_transfer_log_moves_whole_blocks(split, tok, config):
    "Every transfer moves the prompt's blocks: ceil(prompt / block_size) x the bytes one block holds in every layer."
    seq, forks = greedy(long_ids(tok, 900, 50), 3)
    run(split, [(seq, forks)])
    rec = split.worker_stats()["decode"]["transfers"][-1]
    block_bytes = PagedKVCache.block_bytes(_cfg(config), config.block_size)
    assert rec["error"] is None and rec["blocks"] == 4 and rec["bytes"] == 4 * block_bytes


def test_requests_wait_for_room_in_the_decode_pool(split, colocated, tok):
    "Three requests of 10 blocks each against a 24-block decode pool: the third waits, then finishes unchanged."
    prompts = [long_ids(tok, 2000 + 300 * i, 150) for i in range(3)]  # 150 + 10 tokens = 10 blocks each
    want = reference(colocated, prompts, 10)
    pairs = [greedy(p, 10) for p in prompts]
    run(split, pairs)
    assert [s.output_ids for s, _ in pairs] == want
    assert all(s.finish_reason == "length" for s, _ in pairs)


def test_abort_mid_transfer_loses_nothing(split, colocated, tok):
    "Abort requests while their KV is on the wire (the prefill worker holds each send 0.5 s): blocks all come back."
    post(split.inboxes["prefill"], "delay", 0.5)
    try:
        victims = [greedy(long_ids(tok, 4000 + 100 * i, 60), 20) for i in range(2)]
        for s, f in victims: split.add(s, f)
        deadline = time.perf_counter() + 60
        while not all(s.output_ids for s, _ in victims):  # prefilled: their transfer is next
            assert time.perf_counter() < deadline
            split.step()
        time.sleep(0.2)  # the decode worker has pulled the first: its send is being held
        for s, _ in victims: split.abort(s.id)
        assert all(s.finish_reason == "abort" for s, _ in victims) and not split.has_unfinished()
    finally:
        post(split.inboxes["prefill"], "delay", 0.0)
    prompt = long_ids(tok, 5000, 30)
    want = reference(colocated, [prompt], 8)
    seq, forks = greedy(prompt, 8)
    run(split, [(seq, forks)])
    assert seq.output_ids == want[0]  # still serving, same tokens
    time.sleep(1.5)  # the held sends finish and their blocks return
    stats = split.worker_stats()
    assert stats["decode"]["blocks_in_use"] == 0
    assert stats["prefill"]["blocks_in_use"] == stats["prefill"]["cached_blocks"]


def test_idle_time_is_not_silence(split, tok):
    "The no-news timeout counts only while requests are in flight: a request after a long idle pause runs normally."
    timeout, split.timeout = split.timeout, 3.0
    try:
        time.sleep(3.5)
        s, f = greedy(tok.encode("Hello"), 2)
        run(split, [(s, f)])
        assert len(s.output_ids) == 2
    finally:
        split.timeout = timeout


def test_bad_request_is_one_line_and_engine_stays_usable(split, tok):
    seq, _ = greedy(list(range(10, 10 + DECODE_BLOCKS * 16)), 8)
    with pytest.raises(ValueError, match="KV blocks"): split.add(seq)
    masked, _ = greedy(tok.encode("Hello"), 2)
    masked.logits_processor = object()  # the decode worker samples in its own process: no processor can follow it
    with pytest.raises(ValueError, match="^pd_split=True's decode worker samples without logits processors"):
        split.add(masked)
    s, f = greedy(tok.encode("Hello"), 2)
    run(split, [(s, f)])
    assert len(s.output_ids) == 2


def test_llm_pd_split_matches_and_a_dead_worker_ends_requests_with_an_error(tok, colocated):
    from minfer import LLM
    from minfer.llm import RequestError
    llm = LLM(pd_split=True, max_num_batched_tokens=64, kv_cache_bytes=2**27)
    pids = [p.pid for p in llm.engine.procs.values()]
    try:
        prompts = ["The three primary colors are", "def fibonacci(n):"]
        sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, sp, raw=True)
        assert [o.token_ids for o in outs] == reference(colocated, [tok.encode(p) for p in prompts], 12)
        assert "pd_split=True" in repr(llm) and llm.prefill_cores and llm.decode_cores
        # a request whose option compiles to a logits processor (chapter 14's constraints) is refused at the door,
        # in one line naming the option, before any work: the engine says why (`logits_processor_refusal`)
        constrained = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
        with pytest.raises(RequestError, match="^structured_outputs: pd_split=True's decode worker") as refused:
            llm.prepare("hi", constrained)
        assert refused.value.field == "structured_outputs" and not llm.has_unfinished()
        seq, = llm.add_request("Once upon a time", SamplingParams(max_tokens=200, ignore_eos=True), raw=True)
        while not seq.output_ids: llm.step()
        os.kill(llm.engine.procs["decode"].pid, signal.SIGKILL)
        t = time.perf_counter()
        with pytest.raises(WorkerDied, match="decode worker .* exited with code -9; 1 request"):
            while llm.has_unfinished(): llm.step()
        assert time.perf_counter() - t < 10
        assert seq.finished and seq.finish_reason == "error"
        with pytest.raises(WorkerDied, match="create a new engine"): llm.generate("hi")
        assert not any(alive(p) for p in pids)  # the surviving worker was stopped too
    finally:
        llm.close()
    assert not any(alive(p) for p in pids)


def test_a_worker_that_dies_while_starting_fails_fast(config):
    """A worker killed before it reports ready (it can send no message): the constructor notices the process is gone
    and raises one line within seconds, instead of waiting out its start timeout; the other worker is stopped."""
    import multiprocessing, threading
    before = {p.pid for p in multiprocessing.active_children()}  # the module's own engine has workers too
    def kill_prefill_worker():
        deadline = time.perf_counter() + 60
        while time.perf_counter() < deadline:
            for p in multiprocessing.active_children():
                if p.name == "minfer-prefill" and p.pid not in before: return os.kill(p.pid, signal.SIGKILL)
            time.sleep(0.01)
    threading.Thread(target=kill_prefill_worker, daemon=True).start()
    t = time.perf_counter()
    with pytest.raises(WorkerDied, match="prefill worker .*exited with code -9 while starting") as e:
        DisaggEngine(config, start_timeout=300.0)
    assert time.perf_counter() - t < 60 and "\n" not in str(e.value)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("minfer-") and p.pid not in before]


def test_no_worker_outlives_the_program(tmp_path):
    "A script that never calls close(): its workers are gone once it exits."
    script = tmp_path / "leave.py"
    script.write_text(textwrap.dedent("""
        from minfer import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM(pd_split=True, kv_cache_bytes=2**27)
            print(*[p.pid for p in llm.engine.procs.values()], flush=True)
            print(llm.generate("Hi", SamplingParams(max_tokens=2), raw=True)[0].token_ids, flush=True)
    """))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    pids = [int(p) for p in out.stdout.split("\n")[0].split()]
    time.sleep(0.5)
    assert len(pids) == 2 and not any(alive(p) for p in pids)


def test_serve_pd_split(tok, colocated):
    "`minfer serve --pd-split`: the API answers with the co-located engine's greedy text; SIGTERM leaves no worker."
    import httpx, psutil, re, threading
    cmd = [sys.executable, "-m", "minfer", "serve", "--host", "127.0.0.1", "--port", "0", "--pd-split",
           "--kv-cache-bytes", str(2**27)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        log, url, deadline = [], None, time.time() + 300
        while url is None:
            line = proc.stderr.readline()
            assert line and time.time() < deadline, "the server did not start:\n" + "".join(log)
            log.append(line)
            if m := re.search(r"ready on (http://\S+)", line): url = m.group(1)
        threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
        workers = [c.pid for c in psutil.Process(proc.pid).children(recursive=True) if "spawn" in " ".join(c.cmdline())]
        assert len(workers) == 2, workers
        prompt = "The three primary colors are"
        r = httpx.post(url + "/v1/completions", timeout=120, json=dict(model="smollm2-135m-instruct",
                                                                      prompt=prompt, max_tokens=12, temperature=0))
        assert r.status_code == 200, r.text
        want = reference(colocated, [tok.encode(prompt)], 12)[0]
        text = r.json()["choices"][0]["text"]
        assert tok.encode(prompt + text)[len(tok.encode(prompt)):] == want or text == tok.decode(want)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    t = time.perf_counter()
    assert gone(workers), "a worker outlived the server"
    print(f"workers gone {time.perf_counter() - t:.1f} s after the server", "".join(log[-5:]))
