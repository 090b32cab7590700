"""`minfer serve` against hostile clients: one probe per limit and check of the server (chapter 07d), then a soak of
valid, malformed, hostile, streamed and abandoned requests from several clients at once, then property-based fuzzing
of the request schema, where any 5xx fails.

One server process serves the module, started with tight limits so that each one bites quickly: 4 seats
(`--max-num-seqs 4`), 2 waiting (`--max-queue-len 2`), a 6 s deadline, 1 s to prepare a request, 4 stop strings of
at most 32 characters, 8 tokens for a chat that sets no `max_tokens`, and an API key. Its launcher registers one output
constraint of its own, `test_fail_after`, whose mask raises for one chosen sample of a request: the failure of one
sequence, seen from the outside. Every generation is a handful of tokens (the 2-core CI machine decodes about 20-40
tokens/s).
"""
import asyncio, contextlib, json, os, random, re, subprocess, sys, threading, time
from pathlib import Path

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
KEY = "safety-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json"}
LIMITS = ["--max-num-seqs", "4", "--max-queue-len", "2", "--request-timeout", "6", "--prepare-timeout", "1",
          "--max-stop-strings", "4", "--max-stop-length", "32", "--n-predict", "8"]
SECRET = "the matcher's internal state, which no client should see"

# the server, with one more output constraint: a mask that raises for sample `choice` of a request at its `at`-th draw
LAUNCH = f'''
import sys
import minfer
from minfer.structured import STRUCTURED_OUTPUTS

minfer.load_all()  # as `minfer serve` does: every chapter's entries (chapter 14's output constraints among them)

class FailingConstraint:
    def __init__(self, at):
        self.at, self.calls, self.done = at, 0, False
    def mask(self, logits):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError({SECRET!r})
        return logits
    def accept(self, token):
        pass
    def forced(self):
        return []
    def rollback(self, n):
        pass

def fail_after(value, tokenizer, eos_ids, jump_forward):
    made = []
    def fresh():
        made.append(None)
        return FailingConstraint(value["at"] if len(made) - 1 == value["choice"] else None)
    return fresh

STRUCTURED_OUTPUTS.register("test_fail_after", fail_after)
from minfer.serve import main
sys.exit(main(sys.argv[1:]))
'''


@pytest.fixture(scope="module")
def server():
    "The server process: yields (base URL, process); `proc.log` collects its stderr (tracebacks land there)."
    cmd = [sys.executable, "-c", LAUNCH, "--host", "127.0.0.1", "--port", "0", "--api-key", KEY, *LIMITS]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("MINFER_API_KEY", None)
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    log, url = [], None
    deadline = time.time() + 180
    while url is None:
        line = proc.stderr.readline()
        if not line or time.time() > deadline:
            proc.kill()
            pytest.fail("the server did not start:\n" + "".join(log))
        log.append(line)
        if m := re.search(r"ready on (http://\S+)", line):
            url = m.group(1)
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
    proc.log = log
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as c:
        for _ in range(5):  # the first output constraint builds the tokenizer's trie (0.3 s): not in a timed test
            if c.post("/v1/completions", json={"prompt": "{", "max_tokens": 2,
                                               "response_format": {"type": "json_object"}}).status_code == 200:
                break
    yield url, proc
    assert proc.poll() is None, "the server died:\n" + "".join(log[-40:])
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def url(server):
    return server[0]


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as c:
        yield c


def error_of(r, status, param=None):
    "The OpenAI error object of a refusal with this status; its message is one short line."
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    assert err["message"] and "\n" not in err["message"] and len(err["message"]) < 300, err["message"]
    assert "Traceback" not in r.text
    return err


def wait_for_idle(http, seconds=20):
    deadline = time.time() + seconds
    while time.time() < deadline:
        s = http.get("/health").json()
        if s["blocks_in_use"] == 0 and s["requests_running"] == 0:
            return s
        time.sleep(0.05)
    return http.get("/health").json()


def wait_until_quiet(pid, seconds=60):
    "Until the server process uses less than a third of a core (a constraint compile left running has ended)."
    proc, deadline = psutil.Process(pid), time.time() + seconds
    while time.time() < deadline and proc.cpu_percent(interval=0.5) > 33:
        pass


def completion(http, **body):
    return http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **body})


# ---------------------------------------------------------------- the body: size, nesting, numbers, content type
def test_a_body_over_the_cap_is_413(http):
    "--max-request-bytes (1 MiB): refused from its Content-Length, and, sent in chunks without one, as it arrives."
    big = b'{"prompt": "' + b"a" * (1 << 20) + b'"}'
    error_of(http.post("/v1/completions", content=big, headers=JSON), 413)
    chunks = (big[i:i + 65536] for i in range(0, len(big), 65536))  # a generator: httpx sends it chunked
    error_of(http.post("/v1/completions", content=chunks, headers=JSON), 413)
    assert completion(http).status_code == 200


@pytest.mark.parametrize("raw", [
    b"[" * 10_000 + b"]" * 10_000,  # deeper than Python's parser can recurse: a RecursionError, unguarded
    json.dumps({"prompt": "hi", "structured_outputs": {"json": json.loads('{"items": ' * 100 + "{}" + "}" * 100)}}
               ).encode(),  # parses, but deeper than --max-json-depth (64)
], ids=["10000-deep", "100-deep"])
def test_deep_json_is_400(http, raw):
    assert "nests deeper" in error_of(http.post("/v1/completions", content=raw, headers=JSON), 400)["message"]


@pytest.mark.parametrize("raw", [
    b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",  # over Python's 4300-digit int-string limit
    b'{"prompt": "hi", "seed": 18446744073709551616}',         # 2**64: over 64 bits
    b'{"prompt": "hi", "temperature": 1e999}',                 # overflows a float
    b'{"prompt": "hi", "temperature": NaN}',                   # Python's parser takes it; JSON has no NaN
], ids=["5000-digits", "2**64", "1e999", "NaN"])
def test_huge_numbers_are_400(http, raw):
    error_of(http.post("/v1/completions", content=raw, headers=JSON), 400)


@pytest.mark.parametrize("headers,kw", [
    ({"Content-Type": "text/plain"}, {"content": json.dumps({"prompt": "hi", "max_tokens": 2})}),
    ({}, {"data": {"prompt": "hi"}}),  # an HTML form's encoding
    ({}, {"content": json.dumps({"prompt": "hi", "max_tokens": 2})}),  # no Content-Type at all
], ids=["text/plain", "form", "none"])
def test_a_body_not_declared_json_is_415(http, headers, kw):
    "A page on any site may POST text or a form to 127.0.0.1 without the browser asking first: never parsed."
    error_of(http.post("/v1/completions", headers=headers, **kw), 415)


# ---------------------------------------------------------------- who may ask
def test_a_foreign_host_is_refused(http):
    "DNS rebinding: a name the attacker points at 127.0.0.1 reaches the server, but its Host header gives it away."
    for host in ("evil.example", "evil.example:8000", "localhost.evil.example"):
        error_of(http.get("/health", headers={"Host": host}), 421)
        error_of(http.post("/v1/completions", json={"prompt": "hi"}, headers={"Host": host}), 421)
    for host in ("localhost", "LOCALHOST:1234", "127.0.0.1:80", "[::1]:8000", "10.1.2.3"):
        assert http.get("/health", headers={"Host": host}).status_code == 200, host


def test_the_key_guards_all_but_health_and_the_page(url, http):
    with httpx.Client(base_url=url, timeout=60) as stranger:
        for path in ("/metrics", "/v1/models", "/docs", "/openapi.json"):
            assert error_of(stranger.get(path), 401)["code"] == "invalid_api_key", path
        error_of(stranger.post("/v1/completions", json={"prompt": "hi"}), 401)
        error_of(stranger.get("/metrics", headers={"Authorization": "Bearer wrong"}), 401)
        health = stranger.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert not {"model", "engine", "switches"} & set(health.json()) and "smollm2" not in health.text
        page = stranger.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert http.get("/metrics").status_code == 200
    assert http.get("/health").json()["switches"]["max_num_seqs"] == 4


@pytest.mark.parametrize("argv,env", [(["--api-key", ""], {}), (["--api-key", "  "], {}), ([], {"MINFER_API_KEY": ""})],
                         ids=["flag", "blank", "environment"])
def test_an_empty_api_key_is_refused_at_start(argv, env):
    "An empty key would switch authentication off without a word: one line, exit status 2, before the model loads."
    environ = {k: v for k, v in os.environ.items() if k != "MINFER_API_KEY"}
    r = subprocess.run([sys.executable, "-m", "minfer.serve", "--port", "0", *argv], cwd=ROOT, env={**environ, **env},
                       capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "API key is empty" in lines[0], r.stderr


# ---------------------------------------------------------------- what one request may ask
def test_stop_strings_are_limited(http):
    assert error_of(completion(http, stop=["a", "b", "c", "d", "e"]), 400, "stop")
    assert "--max-stop-length" in error_of(completion(http, stop=["x" * 33]), 400, "stop")["message"]
    assert completion(http, stop=["a", "b", "c", "x" * 32]).status_code == 200


def test_prompts_times_n_over_max_num_seqs_is_400(http):
    error_of(completion(http, n=5), 400, "n")
    error_of(completion(http, prompt=["a", "b", "c"], n=2), 400, "n")
    error_of(completion(http, prompt=["a"] * 5), 400, "prompt")
    assert len(completion(http, prompt=["a", "b"], n=2).json()["choices"]) == 4


def test_chat_without_max_tokens_stops_at_n_predict(http):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Tell me a story."}],
                                                "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 8 and r.json()["choices"][0]["finish_reason"] == "length"


def test_a_full_queue_is_429_with_retry_after(url, http):
    "4 requests take the 4 seats, 2 wait (--max-queue-len 2): a 7th is refused at once, and told when to retry."
    long = {"prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "temperature": 0, "stream": True}
    with contextlib.ExitStack() as held:
        for _ in range(6):
            c = held.enter_context(httpx.Client(base_url=url, headers=AUTH, timeout=60))
            assert held.enter_context(c.stream("POST", "/v1/completions", json=long)).status_code == 200
        refused = http.post("/v1/completions", json=long)
        assert error_of(refused, 429)["code"] == "queue_full" and refused.headers["retry-after"] == "1"
    # the six connections closed: their requests are aborted, their blocks freed, and the queue is open again
    s = wait_for_idle(http)
    assert s["blocks_in_use"] == 0 and s["requests_running"] == 0, s
    assert completion(http).status_code == 200


def test_the_deadline_ends_a_request_and_frees_its_blocks(http):
    "--request-timeout 6: a request for 4000 tokens ends after about 6 s with what it has, finish_reason 'length'."
    start = time.perf_counter()
    r = http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True,
                                           "temperature": 0}, timeout=40)
    took = time.perf_counter() - start
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert 0 < r.json()["usage"]["completion_tokens"] < 4000 and 5.5 < took < 30, (r.json()["usage"], took)
    s = wait_for_idle(http)
    assert s["blocks_in_use"] == 0 and s["requests_running"] == 0, s


def test_a_slow_constraint_compile_is_400_and_the_loop_stays_responsive(url, http, server):
    """A JSON schema of 6000 patterned properties takes llguidance seconds to compile (0.3 MB, within the body cap).
    It compiles on a worker thread: past --prepare-timeout (1 s) the request gets a 400, and all along the event
    loop answers /health at once."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"[a-f]{{8}}{i}[0-9]{{2,9}}"}
                                               for i in range(6000)}}
    answer = {}

    def ask():
        with httpx.Client(base_url=url, headers=AUTH, timeout=120) as c:
            answer["r"] = c.post("/v1/completions", json={"prompt": "A record:", "max_tokens": 4,
                                                          "structured_outputs": {"json": schema}})
    slow = threading.Thread(target=ask)
    slow.start()
    waits = []
    while slow.is_alive():
        start = time.perf_counter()
        assert http.get("/health").status_code == 200
        waits.append(time.perf_counter() - start)
        time.sleep(0.05)
    slow.join()
    err = error_of(answer["r"], 400, "structured_outputs")
    assert "--prepare-timeout" in err["message"]
    assert len(waits) >= 5 and max(waits) < 0.5, waits
    wait_until_quiet(server[1].pid)  # the compile runs on to its end in the background: let it finish


# ---------------------------------------------------------------- failures stay small
def sse_chunks(r):
    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_a_failing_choice_ends_alone(http, server):
    """Sample 1 of 3 fails while sampling its third token: that choice ends with finish_reason 'error' and one line,
    the traceback (with the secret) goes to the server's log, and samples 0 and 2 finish as if alone."""
    greedy = completion(http, prompt="Once upon a time", max_tokens=6, temperature=0, ignore_eos=True)
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 3,
            "structured_outputs": {"test_fail_after": {"choice": 1, "at": 3}}}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and SECRET not in r.text, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["finish_reason"] for c in choices] == ["length", "error", "length"]
    assert choices[0]["text"] == choices[2]["text"] == greedy.json()["choices"][0]["text"]
    message = choices[1]["error"]["message"]
    assert "\n" not in message and "request" in message and "error" not in (choices[0].get("error") or "")
    log = "".join(server[1].log)
    assert SECRET in log and f"request {r.json()['id']}: choice 1 ended with an error" in log
    # streamed: the failing choice gets a last chunk of its own, carrying the error; the others stream on
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        chunks = sse_chunks(s)
    ends = {c["choices"][0]["index"]: c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]}
    assert {i: e["finish_reason"] for i, e in ends.items()} == {0: "length", 1: "error", 2: "length"}
    assert ends[1]["error"]["message"] and SECRET not in json.dumps(chunks)
    assert wait_for_idle(http)["blocks_in_use"] == 0


def test_health_is_503_when_the_engine_cannot_serve(llm):
    """In this process, on the session's `LLM`: an engine that reports itself dead (a worker engine's `health()`,
    chapters 11b and 13) makes /health a 503 with its reason; an engine thread that stops makes the request in flight,
    /health and every later request a 503, never a request that waits forever."""
    from minfer.serve import ServerThread
    with ServerThread(llm, api_key=KEY) as srv, httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as c:
        assert c.get("/health").status_code == 200
        llm.engine.health = lambda: "decode worker exited (code -9)"
        try:
            r = c.get("/health")
        finally:
            del llm.engine.health
        assert r.status_code == 503 and r.json()["error"] == "decode worker exited (code -9)"
        assert c.get("/health").status_code == 200

        def stop_the_thread():
            raise SystemExit  # not an Exception: nothing in the loop catches it
        llm.engine.step = stop_the_thread
        try:
            error_of(c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}), 503)
        finally:
            del llm.engine.step
        r = c.get("/health")
        assert r.status_code == 503 and "engine thread stopped" in r.json()["error"]
        error_of(c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}), 503)
    assert not llm.has_unfinished()  # the request in flight was aborted: the LLM is usable again


# ---------------------------------------------------------------- a soak: everything at once, then nothing left over
GOOD_PROMPTS = ["The capital of France is", "1, 2, 3, 4,"]
MALFORMED = [b"{not json", b"[1, 2]", b"\xff\xfe", {"prompt": "Hi", "temperature": "hot"}, {"prompt": ""},
             {"prompt": "Hi", "n": True}, {"prompt": "Hi", "stop": 5}, {"max_tokens": 4}, {"prompt": [1, 2]},
             {"prompt": "Hi", "top_p": 1.5}, {"prompt": "hello " * 9000}]
HOSTILE = [  # (how to send it, the status it must get)
    (dict(content=b"[" * 10_000 + b"]" * 10_000, headers=JSON), 400),
    (dict(content=b'{"prompt": "hi", "seed": ' + b"7" * 5000 + b"}", headers=JSON), 400),
    (dict(content=json.dumps({"prompt": "hi"}), headers={"Content-Type": "text/plain"}), 415),
    (dict(json={"prompt": "hi"}, headers={"Host": "evil.example"}), 421),
    (dict(json={"prompt": "hi"}, headers={"Authorization": "Bearer guess"}), 401),
    (dict(json={"prompt": "hi", "stop": list("abcdefgh")}), 400),
    (dict(json={"prompt": "hi", "n": 64}), 400),
    (dict(content=b'{"prompt": "' + b"a" * (1 << 20) + b'"}', headers=JSON), 413),
    (dict(json={"prompt": "hi", "max_tokens": 3, "n": 2, "structured_outputs": {"test_fail_after": {"choice": 0,
                                                                                                  "at": 2}}}), 200),
]


async def soak(url, references, requests=240, concurrency=5, seed=0):
    "-> [(kind, HTTP status, whether the answer was right)] for `requests` mixed requests, `concurrency` at a time."
    rng = random.Random(seed)
    kinds = ["completion"] * 5 + ["chat", "stream", "abandon", "n2", "choice"] * 2 + ["malformed"] * 3 + ["hostile"] * 3
    plan = [rng.choice(kinds) for _ in range(requests)]
    results = []
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as http:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)

        async def one(kind):
            k = rng.randrange(len(GOOD_PROMPTS))
            greedy = dict(model=MODEL, prompt=GOOD_PROMPTS[k], max_tokens=4, temperature=0)
            if kind == "completion":
                r = await http.post("/v1/completions", json=greedy)
                ok = r.status_code != 200 or r.json()["choices"][0]["text"] == references[k]
                return r.status_code, ok
            if kind == "stream":
                try:
                    pieces = [c.choices[0].text async for c in await client.completions.create(**greedy, stream=True)]
                except openai.RateLimitError:
                    return 429, True
                return 200, "".join(pieces) == references[k]
            if kind == "chat":
                try:
                    r = await client.chat.completions.create(model=MODEL, max_tokens=3, messages=[
                        {"role": "user", "content": "Say hi."}])
                except openai.RateLimitError:
                    return 429, True
                return 200, r.choices[0].finish_reason in ("stop", "length")
            if kind == "abandon":  # reads one event of a long stream, then hangs up
                async with http.stream("POST", "/v1/completions", json={**greedy, "max_tokens": 300, "stream": True,
                                                                        "ignore_eos": True}) as r:
                    async for _ in r.aiter_lines():
                        break
                return r.status_code, True
            if kind == "n2":
                r = await http.post("/v1/completions", json={**greedy, "n": 2, "temperature": 1.0, "seed": 3})
                return r.status_code, r.status_code != 200 or len(r.json()["choices"]) == 2
            if kind == "choice":
                r = await http.post("/v1/completions", json={**greedy, "structured_outputs": {"choice": ["yes", "no"]}})
                return r.status_code, r.status_code != 200 or r.json()["choices"][0]["text"] in ("yes", "no")
            if kind == "malformed":
                body = rng.choice(MALFORMED)
                sent = dict(content=body, headers=JSON) if isinstance(body, bytes) else dict(json=body)
                r = await http.post("/v1/completions", **sent)
                return r.status_code, r.status_code == 400
            how, status = rng.choice(HOSTILE)
            r = await http.post("/v1/completions", **how)
            return r.status_code, r.status_code == status

        async def worker(todo):
            while todo:
                kind = todo.pop()
                status, ok = await one(kind)
                results.append((kind, status, ok))
        todo = list(plan)
        await asyncio.gather(*(worker(todo) for _ in range(concurrency)))
        await client.close()
    return results


def server_threads(pid):
    return len(os.listdir(f"/proc/{pid}/task"))


def test_soak(url, http, server):
    """240 requests from 5 clients at once: valid, streamed, abandoned mid-stream, malformed and hostile. None gets a
    5xx, every one gets its status, every answer that came is right; afterwards the server answers as before, holds
    no KV blocks and runs nothing, has no more threads than before, and its memory grew by less than 150 MiB."""
    pid = server[1].pid
    references = [completion(http, prompt=p, max_tokens=4, temperature=0).json()["choices"][0]["text"]
                  for p in GOOD_PROMPTS]
    asyncio.run(soak(url, references, requests=24, seed=1))  # every kind once or more: a warm server
    wait_for_idle(http)
    wait_until_quiet(pid)
    threads, rss = server_threads(pid), psutil.Process(pid).memory_info().rss
    results = asyncio.run(soak(url, references))
    assert not [r for r in results if r[1] >= 500], [r for r in results if r[1] >= 500]
    wrong = [r for r in results if not r[2] and r[1] != 429]
    assert not wrong, wrong
    assert sum(1 for _, status, _ in results if status == 200) > len(results) / 3  # mostly served, not refused
    s = wait_for_idle(http)
    assert s["status"] == "ok" and s["blocks_in_use"] == 0 and s["requests_running"] == 0, s
    assert [completion(http, prompt=p, max_tokens=4, temperature=0).json()["choices"][0]["text"]
            for p in GOOD_PROMPTS] == references
    assert server_threads(pid) <= threads, (server_threads(pid), threads)
    grown = (psutil.Process(pid).memory_info().rss - rss) / 2**20
    assert grown < 150, f"RSS grew by {grown:.0f} MiB"


# ---------------------------------------------------------------- fuzzing the request schema: never a 5xx
# strings JSON can carry that are odd as text: empty, blank, lone UTF-16 surrogates, NUL, braces
ODD = st.sampled_from(["", "  ", "\ud800", "a\udfffb", "{", "\x00", "%s{}"])
TEXT = st.text(max_size=12) | ODD
WORDS = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12).filter(str.strip) | st.just("Once upon a time")
SCALAR = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | TEXT
          | st.floats(allow_nan=False, allow_infinity=False))
JUNK = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=8)
EXTREME_INT = st.sampled_from([-1, 0, 21, 65, 2**31, 2**63 - 1, -2**63, 2**63, 10**30])
EXTREME_FLOAT = EXTREME_INT | st.sampled_from([-0.0, 1e-45, 1e-6, 100.5, 1e308, -1e308])
CONSTRAINTS = st.sampled_from([{"choice": ["yes", "no"]}, {"regex": "[0-9]{1,3}"}, {"json": {"type": "integer"}},
                               {"grammar": 'start: "x" | "y"'}, {"json_object": True}])
VALID = {  # values each field takes in a request the server serves (a few tokens of work)
    "model": st.just(MODEL), "max_tokens": st.integers(1, 4), "temperature": st.sampled_from([0, 0.7, 1, 2.0]),
    "top_p": st.sampled_from([0.1, 0.9, 1]), "top_k": st.sampled_from([0, -1, 5]), "seed": st.integers(0, 2**63 - 1),
    "n": st.integers(1, 2), "stop": WORDS | st.lists(WORDS, max_size=4), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "ignore_eos": st.booleans(),
    "structured_outputs": CONSTRAINTS,
}
VALID_FIELDS = {
    "completions": {**VALID, "logprobs": st.integers(0, 3)},
    "chat/completions": {**VALID, "logprobs": st.just(True), "top_logprobs": st.integers(0, 3),
                         "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}])},
}
PROMPT = st.one_of(WORDS, WORDS, ODD)  # now and then a string that is odd as text
REQUIRED = {
    "completions": {"prompt": PROMPT | st.lists(PROMPT, min_size=1, max_size=2)},
    "chat/completions": {"messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["system", "developer", "user", "assistant"]),
        "content": PROMPT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": PROMPT}), min_size=1,
                                     max_size=2)}), min_size=1, max_size=3)},
}
ROLE_OR_TEXT = st.sampled_from(["user", "system"]) | TEXT
WILD = {  # what else a field may be sent as
    "max_tokens": EXTREME_INT, "top_k": EXTREME_INT, "seed": EXTREME_INT, "n": EXTREME_INT, "logprobs": EXTREME_INT,
    "top_logprobs": EXTREME_INT, "max_completion_tokens": EXTREME_INT, "best_of": EXTREME_INT,
    "temperature": EXTREME_FLOAT, "top_p": EXTREME_FLOAT, "presence_penalty": EXTREME_FLOAT,
    "stop": TEXT | st.lists(TEXT, max_size=6), "prompt": TEXT | st.lists(TEXT | EXTREME_INT, max_size=5),
    "model": st.sampled_from(["gpt-9", ""]), "structured_outputs": st.fixed_dictionaries({"regex": TEXT}),
    "response_format": st.sampled_from([{"type": "yaml"}, {"type": "json_schema", "json_schema": {"schema": []}}]),
    "messages": st.lists(st.fixed_dictionaries({"role": ROLE_OR_TEXT, "content": TEXT}), max_size=2),
}


@st.composite
def request_bodies(draw, endpoint):
    """A request the server would serve, with up to three fields spoiled (an extreme value, a wrong type, any JSON,
    or left out), or now and then any JSON at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(JUNK)
    body = draw(st.fixed_dictionaries(REQUIRED[endpoint], optional=VALID_FIELDS[endpoint]))
    names = sorted({*REQUIRED[endpoint], *VALID_FIELDS[endpoint], *WILD, "logit_bias", "echo", "suffix"})
    spoiled = draw(st.integers(0, 3))
    for name in draw(st.lists(st.sampled_from(names), min_size=spoiled, max_size=spoiled, unique=True)):
        value = draw(st.sampled_from(["wild", "junk", "gone"]).flatmap(
            lambda how: {"wild": WILD.get(name, JUNK), "junk": JUNK, "gone": st.none()}[how]))
        if value is None:
            body.pop(name, None)
        else:
            body[name] = value
    return body


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(endpoint=st.sampled_from(sorted(REQUIRED)), data=st.data())
def test_fuzzed_requests_never_get_a_5xx(http, endpoint, data):
    """Bodies built from the request schema (`request_bodies`), sent as a hostile client may send them (Python's json
    writes integers of any size). A valid request may be generating for a while: after 3 s the client hangs up, which
    aborts it."""
    raw = json.dumps(data.draw(request_bodies(endpoint), label="body")).encode()
    start, received = time.perf_counter(), b""
    try:
        with http.stream("POST", f"/v1/{endpoint}", content=raw, headers=JSON,
                         timeout=httpx.Timeout(30, read=3)) as r:
            for piece in r.iter_bytes():
                received += piece
                if time.perf_counter() - start > 3:
                    break  # still streaming: hang up
    except httpx.ReadTimeout:
        return  # still generating a whole response: hang up
    assert r.status_code < 500, (r.status_code, received[:300], raw[:300])
    assert b"internal error" not in received and b"Traceback" not in received, (received[:300], raw[:300])


def test_after_the_fuzzing_the_server_is_idle_and_answers(http):
    s = wait_for_idle(http)
    assert s["status"] == "ok" and s["blocks_in_use"] == 0 and s["requests_running"] == 0, s
    assert completion(http, prompt="The capital of France is", max_tokens=4, temperature=0).status_code == 200
