"""`python -m minfer.serve` as a user runs it: a real server process on a free loopback port, the real model, spoken to
with the official `openai` package (chat, completions, streaming, n > 1, stop), and with plain HTTP for what a
client library would refuse to send (invalid JSON, wrong types). (The chat page at `/`, chapter 07f's, is
tests/test_chat.py's.)

One server process serves the whole module (loading the model is most of its start-up). Every generation asks for a
handful of tokens: the 2-core CI machine decodes about 20 tokens/s.
"""
import json

import httpx
import pytest

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from serving import server_process, wait_for_idle  # noqa: E402

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def server():
    "The server process: yields (base URL, process)."
    with server_process("--max-num-seqs", "16") as running:
        yield running


@pytest.fixture(scope="module")
def url(server): return server[0]

@pytest.fixture(scope="module")
def client(url): return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=120) as c: yield c

@pytest.fixture(scope="module")
def tokenizer():
    from minfer.gguf import default_model_dir
    from minfer.tokenizer import Tokenizer
    return Tokenizer(default_model_dir())

def ask(client, content, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)

def stats(http): return http.get("/health").json()

def metric_values(http):
    "The /metrics text as {sample name with labels: value}."
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


# ---------------------------------------------------------------- the API, through the official client
def test_models_and_health(client, http):
    assert [m.id for m in client.models.list()] == [MODEL]
    h = stats(http)
    assert h["status"] == "ok" and h["blocks_total"] > 0 and h["switches"]["kv"] == "paged"


def test_chat_applies_the_template(client, http, tokenizer):
    "A chat turn is the completion of the rendered chat template: same prompt tokens, same greedy text."
    chat = ask(client, "What is the capital of France?", max_tokens=12, temperature=0)
    choice = chat.choices[0]
    assert chat.object == "chat.completion" and choice.message.role == "assistant"
    assert "Paris" in choice.message.content and choice.finish_reason in ("stop", "length")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert chat.usage.prompt_tokens == len(tokenizer.encode(rendered))
    same = client.completions.create(model=MODEL, prompt=rendered, max_tokens=12, temperature=0)
    assert same.choices[0].text == choice.message.content
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens


def test_completion_length_and_usage(client):
    out = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0)
    assert out.object == "text_completion" and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5 and out.choices[0].text


def test_streaming_matches_the_full_response(client, http):
    full = ask(client, "Name three colours.", max_tokens=10, temperature=0).choices[0].message.content
    chunks = list(ask(client, "Name three colours.", max_tokens=10, temperature=0, stream=True,
                      stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) > 3 and "".join(content) == full  # streamed piece by piece, nothing lost
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    # the raw event stream ends with OpenAI's sentinel
    body = {"model": MODEL, "prompt": "The sky is", "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = [l for l in r.iter_lines() if l]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(l.startswith("data: ") for l in lines)
    assert "usage" not in json.loads(lines[-2][6:])  # no include_usage: no usage chunk


def test_n_samples(client):
    out = client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=6, n=3,
                                    temperature=1.0, seed=5)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 18 and len({c.text for c in out.choices}) > 1
    again = client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=6, n=3,
                                      temperature=1.0, seed=5)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded: reproducible
    streamed = {0: "", 1: "", 2: ""}
    finished = set()
    for chunk in client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=6, n=3,
                                           temperature=1.0, seed=5, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
            if c.finish_reason: finished.add(c.index)
    assert finished == {0, 1, 2} and [streamed[i] for i in range(3)] == [c.text for c in out.choices]


def test_stop_strings(client):
    prompt = "1, 2, 3, 4,"
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    assert " 6," in free, free
    stopped = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[" 6", "zz"])
    assert stopped.choices[0].text == free[:free.index(" 6")] and stopped.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                                                   temperature=0, stop=" 6", stream=True)]
    assert "".join(pieces) == stopped.choices[0].text  # the held-back prefix " " never leaks into the stream


def test_logprobs(client):
    "Greedy: the chosen token is the most likely one, in both of OpenAI's shapes; not asked for, the field is null."
    out = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text and len(lp.token_logprobs) == 3
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and logprob <= 0 and logprob == max(top.values()) == top[token]
    chat = ask(client, "Hi", max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.logprob == t.top_logprobs[0].logprob for t in content)
    assert ask(client, "Hi", max_tokens=2, temperature=0).choices[0].logprobs is None  # not asked for: null


# ---------------------------------------------------------------- bad input: 400 with OpenAI's error object
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
BAD = [  # (endpoint, body, the param the error names)
    ("completions", b"{not json", None),
    ("completions", b"[1, 2]", None),
    ("completions", b"\xff\xfe", None),
    ("completions", {**COMPLETION, "temperature": "hot"}, "temperature"),
    ("completions", {**COMPLETION, "max_tokens": "5"}, "max_tokens"),
    ("completions", {**COMPLETION, "n": True}, "n"),
    ("completions", {**COMPLETION, "stream": "yes"}, "stream"),
    ("completions", {**COMPLETION, "stop": 5}, "stop"),
    ("completions", {**COMPLETION, "prompt": 42}, "prompt"),
    ("completions", {**COMPLETION, "prompt": [1, 2, 3]}, "prompt"),
    ("completions", {**COMPLETION, "temperature": -1}, "temperature"),
    ("completions", {**COMPLETION, "top_p": 0}, "top_p"),
    ("completions", {**COMPLETION, "top_p": 1.5}, "top_p"),
    ("completions", {**COMPLETION, "top_k": -2}, "top_k"),
    ("completions", {**COMPLETION, "max_tokens": 0}, "max_tokens"),
    ("completions", {**COMPLETION, "n": 0}, "n"),
    ("completions", {**COMPLETION, "n": 1000}, "n"),
    ("completions", {**COMPLETION, "seed": -1}, "seed"),
    ("completions", {**COMPLETION, "logprobs": 50}, "logprobs"),
    ("completions", {**COMPLETION, "presence_penalty": 0.5}, "presence_penalty"),
    ("completions", {**COMPLETION, "prompt": ""}, "prompt"),
    ("completions", {**COMPLETION, "prompt": "   "}, "prompt"),
    ("completions", {"max_tokens": 2}, "prompt"),
    ("completions", {**COMPLETION, "prompt": "hello " * 9000}, "prompt"),  # over the 8192-token context
    ("chat/completions", {**CHAT, "messages": []}, "messages"),
    ("chat/completions", {**CHAT, "messages": "Hi"}, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "Hi"}]}, "messages[0].role"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": "  "}]}, "messages"),
    ("chat/completions", {**CHAT, "temperature": [1]}, "temperature"),
    ("chat/completions", {**CHAT, "top_logprobs": 3}, "top_logprobs"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hello " * 9000}]}, "messages"),
]

def _body(body):
    "httpx's keyword for a body: raw bytes (broken JSON on purpose) or an object to encode."
    if isinstance(body, bytes): return {"content": body, "headers": {"Content-Type": "application/json"}}
    return {"json": body}

@pytest.mark.parametrize("endpoint,body,param", BAD, ids=[f"{e}-{i}" for i, (e, _, _) in enumerate(BAD)])
def test_bad_input_is_a_400_with_openai_error(http, endpoint, body, param):
    r = http.post(f"/v1/{endpoint}", **_body(body))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert err["message"] and "\n" not in err["message"] and len(err["message"]) < 300, err["message"]


def test_unknown_model_and_route(http):
    r = http.post("/v1/completions", json={**COMPLETION, "model": "gpt-9"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_bad_requests_affect_nothing_else(client, http):
    "A stream runs while bad requests arrive; it completes with the text it gets alone, and the pool drains."
    alone = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0)
    pieces = []
    for i, chunk in enumerate(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16,
                                                        temperature=0, stream=True)):
        pieces.append(chunk.choices[0].text)
        if i == 2:
            for _, body, _ in BAD[:6] + BAD[-9:]:
                assert http.post("/v1/completions", **_body(body)).status_code == 400
    assert "".join(pieces) == alone.choices[0].text
    assert stats(http)["blocks_in_use"] == 0


# ---------------------------------------------------------------- disconnects free their KV blocks
def test_disconnect_mid_stream_frees_blocks(url, http, server):
    before = metric_values(http).get('minfer_requests_total{endpoint=completions,outcome=aborted}', 0)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "stream": True, "temperature": 0,
            "ignore_eos": True}  # minutes of work unless the server aborts it
    with httpx.Client(base_url=url, timeout=60) as own:  # its own connection, closed mid-stream
        with own.stream("POST", "/v1/completions", json=body) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 11:
                    # read while iterating: leaving the loop drops the line iterator, and httpcore closes the
                    # connection as it is collected, so the server may abort the request before we look
                    running = stats(http)
                    outcomes = {k: v for k, v in metric_values(http).items() if k.startswith("minfer_requests_total")}
                    break
            # on failure: what the stream said and what the server logged, so a rare failure explains itself
            assert running["blocks_in_use"] > 0 and running["requests_running"] == 1, (
                f"HTTP {r.status_code}; running {running['requests_running']}, blocks {running['blocks_in_use']}; "
                f"last lines {lines[-3:]}; {outcomes}; server log: {''.join(server[1].log[-20:])[-1500:]}")
    s = wait_for_idle(http)
    assert s["blocks_in_use"] == 0 and s["requests_running"] == 0, s
    m = metric_values(http)
    assert m["minfer_kv_blocks_in_use"] == 0
    assert m['minfer_requests_total{endpoint=completions,outcome=aborted}'] == before + 1


def test_disconnect_while_waiting_for_a_full_response(url, http):
    "A non-streaming client that gives up (times out) is noticed too: its request is aborted."
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 2000,
            "temperature": 0, "ignore_eos": True}  # minutes of work unless the server aborts it
    with httpx.Client(base_url=url, timeout=1.0) as impatient, pytest.raises(httpx.ReadTimeout):
        impatient.post("/v1/chat/completions", json=body)
    s = wait_for_idle(http)
    assert s["blocks_in_use"] == 0 and s["requests_running"] == 0, s


# ---------------------------------------------------------------- the program loads every chapter's entries
def test_the_program_has_every_chapters_entries(http):
    """`python -m minfer.serve` serves with what every chapter registered: chapter 14's request fields (a
    `structured_outputs` choice constrains the text) and chapter 13b's route (`/v1/loads`)."""
    body = {"model": MODEL, "prompt": "Is Paris in France? Answer:", "max_tokens": 8, "temperature": 0,
            "structured_outputs": {"choice": ["yes", "no"]}}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text
    loads = http.get("/v1/loads")
    assert loads.status_code == 200 and loads.json()["loads"][0]["max_running_requests"] == 16, loads.text


# ---------------------------------------------------------------- metrics
def test_prometheus_metrics(http, client):
    ask(client, "Hi", max_tokens=4, temperature=0)
    assert http.post("/v1/completions", json={"prompt": ""}).status_code == 400  # (tests may run apart, under xdist)
    r = http.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    m = metric_values(http)
    assert m["minfer_time_to_first_token_seconds_count"] > 0 and m["minfer_time_per_output_token_seconds_count"] > 0
    assert m["minfer_generation_tokens_total"] >= 4 and m["minfer_prompt_tokens_total"] > 0
    assert m["minfer_requests_total{endpoint=chat,outcome=ok}"] >= 1
    assert m["minfer_requests_total{endpoint=completions,outcome=rejected}"] >= 1
    assert m["minfer_kv_blocks_total"] == stats(http)["blocks_total"]
    assert "minfer_preemptions_total" in m and "minfer_kv_blocks_in_use" in m
