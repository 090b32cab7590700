"""Chapter 13b: replicas of `minfer serve` behind the gateway `smg`, as a user runs them (`python -m minfer cluster`),
on loopback addresses of their own (127.0.0.2 and 127.0.0.3 stand for two machines), spoken to over real HTTP.

What a gateway needs from a worker (chapter 07d's server with 13b's route) is checked on one in-process server first;
those tests need no gateway. The rest share one module-scoped cluster of two replicas (each loads the default model)
and are skipped, with the reason, where `smg` is not installed (`pip install 'minfer[cluster]'`). They run in file
order in one xdist worker (`xdist_group`; `make test` runs pytest with `--dist loadgroup`): the last ones kill a
replica and then stop the cluster.
"""
import importlib.util, json, os, re, signal, subprocess, sys, threading, time
from pathlib import Path

import httpx
import pytest

from minfer.cli import main as cli_main
from minfer.cluster import gateway_missing, replica_cores, replica_serve_args, scrape
from minfer.llm import LLM
from minfer.serve import serve_in_thread

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
SERVE_FLAGS = ["--kv-cache-bytes", "100000000", "--max-num-seqs", "8"]
pytestmark = pytest.mark.xdist_group("cluster")
needs_gateway = pytest.mark.skipif(gateway_missing() is not None, reason=str(gateway_missing()))


@pytest.fixture(scope="module")
def one_server(model_dir):
    "One server in this process, with the replicas' switches: the baseline, and the worker a gateway talks to."
    llm = LLM(model_dir, prefix_cache=True, kv_cache_bytes=100_000_000, max_num_seqs=8)
    with serve_in_thread(llm, served_model_name=MODEL) as server:
        yield server.url
    llm.close()


def chat(url, messages, max_tokens=8, **extra):
    body = dict(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **extra)
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def conversation(tag):
    "A conversation whose first block is its own (`tag` first): no other test's prompt shares a cached block with it."
    system = (f"{tag}: you are the support assistant of Northwind Rail. Answer questions about tickets, refunds, "
              "delays, bicycles on trains and station facilities, briefly and politely.")
    return [{"role": "system", "content": system}, {"role": "user", "content": "My train was late. A refund?"}]


# ---- what a gateway needs from a worker: one server, no gateway


def test_a_warm_prefix_reports_its_cached_tokens(one_server):
    "OpenAI's usage.prompt_tokens_details.cached_tokens: 0 cold, the prefix cache's whole blocks warm, streamed too."
    messages = conversation("cached-tokens")
    before = scrape(one_server)
    cold, warm = chat(one_server, messages), chat(one_server, messages)
    assert cold["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    prompt, cached = warm["usage"]["prompt_tokens"], warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (prompt - 1) // 16 * 16 > 0  # whole blocks; the last token is always computed
    after = scrape(one_server)
    assert after["minfer_prefix_cache_hits_total"] - before["minfer_prefix_cache_hits_total"] == cached
    assert after["minfer_prompt_tokens_total"] - before["minfer_prompt_tokens_total"] == 2 * prompt
    body = dict(model=MODEL, messages=messages, max_tokens=4, temperature=0, stream=True,
                stream_options={"include_usage": True})
    with httpx.stream("POST", one_server + "/v1/chat/completions", json=body, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}


def test_the_load_report_a_gateway_polls(one_server):
    "GET /v1/loads in SGLang's schema (what smg reads), and the gauges a person reads in /metrics."
    report = httpx.get(one_server + "/v1/loads", timeout=10).json()
    assert report["dp_rank_count"] == 1 and len(report["loads"]) == 1
    rank = report["loads"][0]
    health = httpx.get(one_server + "/health", timeout=10).json()
    assert rank["max_total_num_tokens"] == health["blocks_total"] * 16 > 0
    assert rank["num_running_reqs"] == rank["num_waiting_reqs"] == 0 and rank["max_running_requests"] == 8
    assert 0 <= rank["token_usage"] <= 1 and 0 <= rank["cache_hit_rate"] <= 1
    metrics = scrape(one_server)
    for name in ("minfer_requests_waiting", "minfer_requests_running", "minfer_kv_blocks_in_use",
                 "minfer_prefix_cache_hits_total"):
        assert name in metrics, name


def test_replica_cores_and_flags():
    assert replica_cores(2, [0, 1]) == [[0], [1]] and replica_cores(2, [0, 1, 2]) == [[0, 1], [2]]
    assert replica_cores(3, [4, 5]) == [[4], [5], [4]]  # more replicas than cores: they share
    assert replica_serve_args(["--max-num-seqs", "8"]) == ["--prefix-cache", "--max-num-seqs", "8"]
    assert replica_serve_args(["--no-prefix-cache"]) == ["--no-prefix-cache"]
    with pytest.raises(ValueError, match="the cluster places the replicas"):
        replica_serve_args(["--port", "9000"])
    with pytest.raises(ValueError, match="does not take: --replicas"):
        replica_serve_args(["--replicas", "2"])


def test_without_the_gateway_one_line(monkeypatch, capsys):
    "Where smg is not installed, `minfer cluster` says so in one line, with the command that installs it."
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "smg" else find_spec(name, *a))
    assert cli_main(["cluster", "--replicas", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'minfer[cluster]'" in err, err


# ---- the cluster: two replicas on 127.0.0.2 and 127.0.0.3 behind smg


def start(args, what):
    """`python -m minfer cluster ARGS` as a process; -> (process, {'replicas': [(url, pid)], 'gateway': (url, pid)},
    its stderr lines so far, read on by a thread)."""
    cmd = [sys.executable, "-m", "minfer", "cluster", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    log, found, deadline = [], {"replicas": []}, time.time() + 300
    while True:
        line = proc.stderr.readline()
        if not line or time.time() > deadline:
            proc.kill()
            pytest.fail(f"{what} did not start:\n" + "".join(log))
        log.append(line)
        if m := re.search(r"replica \d+ on (\S+) \(pid (\d+)", line):
            found["replicas"].append((m.group(1), int(m.group(2))))
        if m := re.search(r"gateway smg .*pid (\d+)\) on (\S+) ", line):
            found["gateway"] = (m.group(2), int(m.group(1)))
        if "ready; logs in" in line:
            break
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
    return proc, found, log


def alive(pid):
    "Whether process `pid` runs (a zombie waiting for a parent to read its status does not)."
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def wait_gone(pids, timeout=15.0):
    deadline = time.time() + timeout
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


@pytest.fixture(scope="module")
def cluster():
    if gateway_missing() is not None:
        pytest.skip(gateway_missing())
    proc, found, log = start(["--replicas", "2", "--policy", "cache_aware", "--port", "0",
                              "--worker-hosts", "127.0.0.2,127.0.0.3", "--", *SERVE_FLAGS], "the cluster")
    yield dict(proc=proc, log=log, **found)
    if proc.poll() is None:
        proc.kill()


def landed(replicas, send):
    "-> (send()'s result, the index of the replica whose prompt-token counter rose)."
    before = [scrape(url)["minfer_prompt_tokens_total"] for url, _ in replicas]
    result = send()
    after = [scrape(url)["minfer_prompt_tokens_total"] for url, _ in replicas]
    rose = [i for i, (b, a) in enumerate(zip(before, after)) if a > b]
    assert len(rose) == 1, (before, after)
    return result, rose[0]


def three_turns(url, replicas, tag):
    "-> [(replica index, cached tokens)] of a three-turn conversation sent through the gateway at `url`."
    messages, out = conversation(tag), []
    for question in ("And with a bicycle?", "Thanks."):
        reply, where = landed(replicas, lambda: chat(url, messages))
        out.append((where, reply["usage"]["prompt_tokens_details"]["cached_tokens"]))
        messages += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                     {"role": "user", "content": question}]
    reply, where = landed(replicas, lambda: chat(url, messages))
    return out + [(where, reply["usage"]["prompt_tokens_details"]["cached_tokens"])]


@needs_gateway
def test_two_replicas_answer_as_one_server(cluster, one_server):
    "The same greedy tokens through the gateway (each replica on its own loopback address) as from one server."
    gateway = cluster["gateway"][0]
    assert [urls[:17] for urls, _ in cluster["replicas"]] == ["http://127.0.0.2:", "http://127.0.0.3:"]
    for prompt in ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a city by the sea,"):
        body = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=0)
        want = httpx.post(one_server + "/v1/completions", json=body, timeout=120).json()["choices"][0]
        got = httpx.post(gateway + "/v1/completions", json=body, timeout=120).json()["choices"][0]
        assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"] and got["text"] == want["text"]


@needs_gateway
def test_cache_aware_keeps_a_conversation_on_its_replica(cluster):
    "Every turn lands on the replica that served the first (the workers' counters say where), and hits its cache."
    turns = three_turns(cluster["gateway"][0], cluster["replicas"], "cache-aware")
    assert len({where for where, _ in turns}) == 1, turns
    assert turns[0][1] == 0 and all(cached >= 48 for _, cached in turns[1:]), turns


@pytest.fixture(scope="module")
def round_robin(cluster):
    "A second gateway, round robin, over the cluster's replicas by URL (as for replicas on other machines)."
    urls = [url for url, _ in cluster["replicas"]]
    proc, found, log = start(["--worker-urls", *urls, "--policy", "round_robin", "--port", "0"], "the gateway")
    assert found["replicas"] == []  # nothing started but the gateway
    yield dict(proc=proc, log=log, **found)
    if proc.poll() is None:
        proc.kill()


@needs_gateway
def test_round_robin_scatters_a_conversation(cluster, round_robin):
    "Round robin sends the turns to the replicas in turn: the second lands where the first is not, and misses."
    turns = three_turns(round_robin["gateway"][0], cluster["replicas"], "round-robin")
    wheres = [where for where, _ in turns]
    assert wheres[0] != wheres[1] and wheres[1] != wheres[2], turns
    assert turns[1][1] == 0, turns  # nothing of this conversation is cached where its second turn went


@needs_gateway
def test_a_killed_supervisor_leaves_nothing(round_robin):
    "kill -9 of `minfer cluster`: its gateway leaves by itself within a second or so (chapter 11a's watch_parent)."
    gateway_pid = round_robin["gateway"][1]
    assert alive(gateway_pid)
    round_robin["proc"].kill()
    assert wait_gone([gateway_pid], timeout=10) == [], "the gateway outlived its supervisor"


@needs_gateway
def test_killing_a_replica(cluster):
    """A replica killed in the middle of a stream: that stream ends with an error, the gateway stops routing to the
    dead replica (within its 2 s health check), the other replica answers, the supervisor says which one died."""
    gateway, replicas = cluster["gateway"][0], cluster["replicas"]
    body = dict(model=MODEL, prompt="Count from one to a thousand: one, two,", max_tokens=400, ignore_eos=True,
                temperature=0, stream=True)
    finish, error, victim = None, None, None
    try:
        with httpx.stream("POST", gateway + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]
                    break
                finish = chunk["choices"][0]["finish_reason"] if chunk.get("choices") else finish
                if victim is None and finish is None:  # the first tokens: kill the replica that sends them
                    busy = [i for i, (url, _) in enumerate(replicas)
                            if scrape(url)["minfer_requests_running"] > 0]
                    assert len(busy) == 1, busy
                    victim = busy[0]
                    os.kill(replicas[victim][1], signal.SIGKILL)
    except httpx.HTTPError as e:  # the gateway may cut the stream rather than send an error event
        error = repr(e)
    assert victim is not None
    assert finish not in ("stop", "length") and (error is not None or finish is None), (finish, error)
    assert wait_gone([replicas[victim][1]], timeout=5) == []
    time.sleep(3)  # the gateway's health check (every 2 s, the cluster's default)
    survivor = replicas[1 - victim][0]
    served = scrape(survivor)["minfer_prompt_tokens_total"]
    for i in range(4):
        reply = chat(gateway, conversation(f"after the kill {i}"))
        assert reply["choices"][0]["finish_reason"] in ("stop", "length")
    assert scrape(survivor)["minfer_prompt_tokens_total"] > served
    deadline = time.time() + 5
    while not any(f"replica {victim}" in line and "routes around it" in line for line in cluster["log"]):
        assert time.time() < deadline, "".join(cluster["log"])
        time.sleep(0.2)


@needs_gateway
def test_sigterm_stops_every_process(cluster):
    "SIGTERM to `minfer cluster`: it stops the gateway and the replicas and exits 0; no process is left."
    pids = [pid for _, pid in cluster["replicas"]] + [cluster["gateway"][1]]
    cluster["proc"].send_signal(signal.SIGTERM)
    assert cluster["proc"].wait(timeout=30) == 0, "".join(cluster["log"])
    assert wait_gone(pids, timeout=5) == []
