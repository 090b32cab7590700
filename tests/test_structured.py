"""Structured outputs (chapter 14) against independent references: `jsonschema` for JSON outputs, `re.fullmatch` for
regex outputs, the choice list, partial matching of the `regex` package for the token mask itself, unconstrained
greedy decoding where a constraint removes nothing, and the model's own log-softmax for logprobs. Then the engine
(mixed batches, forks, chunks, prefix cache, aborts), bad input, the server (the `openai` client, `--api-key`) and the
command line. Generations are short: the 2-core CI machine decodes about 20 tokens/s.
"""
import contextlib, io, json, re

import httpx
import jsonschema
import pytest
import regex
import torch

from minfer import LLM, SamplingParams
from minfer.structured import make_constraint

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "status": {"enum": ["pending", "shipped"]},
    "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "object", "properties": {
        "sku": {"type": "string", "maxLength": 6}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}},
    "required": ["id", "status", "items"], "additionalProperties": False}
NAME_RX = r"(Mr|Ms|Dr)\. [A-Z][a-z]{1,8}( [A-Z][a-z]{1,8})?, [0-9]{2,3}"


def validates(text, schema):
    try: jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError): return False
    return True


@pytest.mark.parametrize("schema", [PERSON, ORDER], ids=["person", "order"])
def test_sampled_json_validates(llm, schema):
    "Temperature 1, two seeds, n=4: every completed output validates; most complete within the token limit."
    done = 0
    for seed in (0, 1):
        out = llm.chat([{"role": "user", "content": "Give an example as JSON."}],
                       SamplingParams(temperature=1.0, n=4, seed=seed, max_tokens=80,
                                      structured_outputs={"json": schema}))[0]
        for s in out.samples:
            if s.finish_reason == "stop":
                assert validates(s.text, schema), s.text
                done += 1
    assert done >= 4, done  # most finish within 80 tokens (not vacuous); every one that did is checked above


def test_sampled_regex_and_choice(llm):
    for seed in (0, 1, 2):
        out = llm.generate("Our guest:", SamplingParams(temperature=1.0, n=3, seed=seed, max_tokens=24,
                                                        structured_outputs={"regex": NAME_RX}), raw=True)[0]
        assert all(re.fullmatch(NAME_RX, s.text) for s in out.samples if s.finish_reason == "stop"), out.samples
        assert any(s.finish_reason == "stop" for s in out.samples)
    choices = ["yes", "no", "not sure (ask again)", "ça dépend"]
    out = llm.generate("Is it raining?", SamplingParams(temperature=1.0, n=8, seed=3,
                                                        structured_outputs={"choice": choices}))[0]
    assert all(s.text in choices and s.finish_reason == "stop" for s in out.samples), [s.text for s in out.samples]


def test_mask_equals_partial_regex_match(llm):
    """The llguidance mask over the first 3000 tokens (and every special token) equals a brute-force walk: token t is
    allowed after `prefix` iff `prefix + text(t)` can still become a full match (the `regex` package's partial
    matching); end-of-sequence iff `prefix` is a full match. Checked at every token boundary of a matching string."""
    tok = llm.tokenizer
    make = make_constraint({"regex": NAME_RX}, tok, llm.eos_ids)
    state, prefix = make(), ""
    texts = {t: tok.decode([t], skip_special_tokens=False) for t in range(3000)}
    special = {t["id"] for t in json.loads(tok.tok.to_str())["added_tokens"] if t["special"]}
    checked = 0
    for t in tok.encode("Dr. Ada Lovelace, 36"):
        allowed = state.allowed()
        for u, text in texts.items():
            if u in special or "\ufffd" in text: continue  # part of a UTF-8 character: not a string on its own
            expect = regex.fullmatch(NAME_RX, prefix + text, partial=True) is not None
            assert bool(allowed[u]) == expect, (prefix, text)
            checked += 1
        assert not any(allowed[u] for u in special - set(llm.eos_ids))
        assert all(bool(allowed[e]) == bool(re.fullmatch(NAME_RX, prefix)) for e in llm.eos_ids), prefix
        masked = state.mask(torch.zeros(tok.vocab_size + 64))  # a head wider than the vocabulary: never those
        assert torch.equal(masked[:tok.vocab_size] == 0, allowed) and masked[tok.vocab_size:].eq(float("-inf")).all()
        state.accept(t)
        prefix += tok.decode([t])
    assert all(bool(state.allowed()[e]) for e in llm.eos_ids) and checked > 10000


def test_greedy_under_a_permissive_constraint_is_free_greedy(llm):
    p = "The three primary colours are"
    free = llm.generate(p, SamplingParams(max_tokens=20), raw=True)[0]
    loose = llm.generate(p, SamplingParams(max_tokens=20, structured_outputs={"regex": r"[^\x00]*"}), raw=True)[0]
    assert loose.token_ids == free.token_ids


def test_length_inside_the_structure_is_not_claimed_valid(llm):
    out = llm.chat([{"role": "user", "content": "A person as JSON."}],
                   SamplingParams(max_tokens=4, structured_outputs={"json": PERSON}))[0]
    assert out.finish_reason == "length" and not validates(out.text, PERSON)
    assert out.text.startswith("{")


def test_logprobs_are_the_models_and_decoding_is_token_by_token(llm):
    "With logprobs, each chosen token's logprob is the model's own log-softmax (not the masked one); no jumps."
    prompt = "My name and age as JSON:"
    out = llm.generate(prompt, SamplingParams(max_tokens=16, logprobs=1, structured_outputs={"json": PERSON}),
                       raw=True)[0]
    s = out.samples[0]
    assert len(s.logprobs) == len(s.token_ids) and s.metrics["tokens_per_pass"] in (None, 1.0)
    ids = llm.tokenizer.encode(prompt) + s.token_ids
    with torch.inference_mode():
        from minfer.model import NoCache
        logits = llm.model(torch.tensor(ids), torch.arange(len(ids)), NoCache(), logits_rows=None)
    ref = torch.log_softmax(logits.double(), -1)
    n = len(llm.tokenizer.encode(prompt))
    for i, (t, entry) in enumerate(zip(s.token_ids, s.logprobs)):
        assert abs(entry[t] - float(ref[n + i - 1, t])) < 1e-3, (i, entry[t], float(ref[n + i - 1, t]))


def test_engine_mixed_batch_forks_chunks_prefix_cache_abort(model_dir):
    "Constrained and free rows in the same steps, n > 1, a 16-token budget (jumps go through chunks), the prefix cache."
    llm = LLM(model_dir, prefix_cache=True, max_num_batched_tokens=16, max_num_seqs=8)
    prompts = ["The capital of France is", "Is the Moon a planet? Answer:", "A person as JSON:"]
    params = [SamplingParams(max_tokens=10), SamplingParams(temperature=1.0, seed=7, n=3,
                                                            structured_outputs={"choice": ["yes", "no"]}),
              SamplingParams(temperature=1.0, seed=8, n=2, max_tokens=60, structured_outputs={"json": PERSON})]
    solo = llm.generate(prompts[0], params[0], raw=True)[0]
    for _ in range(2):  # the second round reads the prompts from the prefix cache
        out = llm.generate(prompts, params, raw=True)
        assert out[0].token_ids == solo.token_ids
        assert all(s.text in ("yes", "no") for s in out[1].samples)
        assert all(validates(s.text, PERSON) for s in out[2].samples if s.finish_reason == "stop")
        jumped = [s.metrics["tokens_per_pass"] for s in out[2].samples]
        assert all(j is not None and j > 1 for j in jumped), jumped  # the schema's keys were forced
    assert llm.engine.stats["cached_blocks"] > 0
    seqs = llm.add_request("A person as JSON:", SamplingParams(max_tokens=40, structured_outputs={"json": PERSON}),
                           raw=True)
    for _ in range(3): llm.step()
    llm.abort(seqs)
    stats = llm.engine.stats  # every block left is one the prefix cache keeps
    assert not llm.has_unfinished() and stats["blocks_in_use"] == stats["cached_blocks"]
    again = llm.generate(prompts[2], params[2], raw=True)[0]
    assert all(validates(s.text, PERSON) for s in again.samples if s.finish_reason == "stop")


def test_sequential_engine_follows_the_constraint_too(llm, model_dir):
    "kv='contiguous' (chapter 02d's engine) masks through the same `sample_next` and jumps through the same `append`."
    seq_llm = LLM(model_dir, kv="contiguous")
    params = SamplingParams(max_tokens=40, structured_outputs={"json": PERSON})
    ask = [{"role": "user", "content": "A person as JSON."}]
    assert seq_llm.chat(ask, params)[0].token_ids == llm.chat(ask, params)[0].token_ids


@pytest.mark.parametrize("spec, words", [
    ({"json": {"type": "objekt"}}, "json"), ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "(unclosed"}, "regex"),
    ({"choice": "yes"}, "choice"), ({"choice": []}, "choice"), ({"grammar": "root ::= missing"}, "grammar"),
    ({"json_object": "yes"}, "json_object"), ({"jsn": {}}, "'jsn'"), ({"json": {}, "regex": "a"}, "one of"),
    ({"json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
    ({"regex": "a", "jump_forward": 1}, "jump_forward")])
def test_bad_specs_are_one_line_before_any_work(llm, spec, words):
    steps = llm.engine.ledger.steps
    with pytest.raises(ValueError) as e: llm.generate("hi", SamplingParams(structured_outputs=spec))
    assert words in str(e.value) and "\n" not in str(e.value)
    assert llm.engine.ledger.steps == steps and not llm.has_unfinished()


def test_speculative_decoding_checks_guesses_against_the_constraint(llm, model_dir):
    """Prompt lookup guesses, each verify row masked by the grammar state after the guesses before it, the state rolled
    back: greedy outputs equal the plain engine's (with and without jump-forward), sampled ones validate."""
    spec = LLM(model_dir, speculative={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2})
    schema_prompt = ("Copy this JSON: " + json.dumps({"name": "Ada Lovelace", "age": 36}) + "\nJSON:")
    # a name of at most 6 characters: the guess ` Lovelace` is cut by the mask, the string closes and the grammar forces
    # the next key right after a rejected guess, at positions whose KV held the rejected guesses
    short = {**PERSON, "properties": {**PERSON["properties"], "name": {"type": "string", "maxLength": 6}}}
    for so in ({"json": PERSON}, {"json": PERSON, "jump_forward": False}, {"json": short}, {"regex": NAME_RX}):
        params = SamplingParams(max_tokens=40, structured_outputs=so)
        fast = spec.generate(schema_prompt, params, raw=True)[0]
        plain = llm.generate(schema_prompt, params, raw=True)[0]
        assert fast.token_ids == plain.token_ids, (so, fast.text, plain.text)
        if "json" in so: assert fast.metrics["acceptance_rate"] > 0.5  # it guessed (the prompt holds the JSON)
    # the KV bookkeeping, checked directly: every position a sequence counts as computed holds the KV of its token
    fed, prepare = {}, spec.engine.runner.prepare
    def recording_prepare(batch):  # the tokens the pass runs, at the positions whose KV they write
        tokens, positions, meta, rows = prepare(batch)
        at = 0
        for s, n in batch:
            for i, t in enumerate(tokens[at:at + n].tolist()):
                fed.setdefault(s.id, {})[s.num_computed + i] = t
            at += n
        return tokens, positions, meta, rows
    spec.engine.runner.prepare = recording_prepare
    seqs = spec.add_request(schema_prompt, SamplingParams(max_tokens=40, structured_outputs={"json": short}), raw=True)
    while not seqs[0].finished:
        spec.step()
        s = seqs[0]
        assert all(fed[s.id][i] == t for i, t in enumerate(s.token_ids[:s.num_computed])), (s.num_computed, len(s))
    spec.engine.runner.prepare = prepare
    out = spec.generate(schema_prompt, SamplingParams(temperature=1.0, n=4, seed=2, max_tokens=40,
                                                      structured_outputs={"json": PERSON}), raw=True)[0]
    assert all(validates(s.text, PERSON) for s in out.samples if s.finish_reason == "stop")
    assert any(s.metrics["acceptance_rate"] for s in out.samples)


# ---- the server
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(llm):
    from minfer.serve import serve_in_thread
    with serve_in_thread(llm) as srv: yield srv


@pytest.fixture(scope="module")
def client(server): return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_server_response_format_and_structured_outputs(client):
    r = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=60, temperature=1.0, seed=1,
                                       messages=[{"role": "user", "content": "A person as JSON."}],
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "person", "schema": PERSON}})
    assert r.choices[0].finish_reason == "stop" and validates(r.choices[0].message.content, PERSON)
    r = client.completions.create(model="smollm2-135m-instruct", prompt="A JSON object:", max_tokens=40, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop": assert isinstance(json.loads(r.choices[0].text), dict)
    else: assert r.choices[0].text.startswith("{")
    r = client.completions.create(model="smollm2-135m-instruct", prompt="Is water wet?", max_tokens=5, n=3,
                                  temperature=1.0, seed=2, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert all(c.text in ("yes", "no") for c in r.choices)
    stream = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=60, stream=True,
                                            messages=[{"role": "user", "content": "A person as JSON."}],
                                            extra_body={"structured_outputs": {"json": PERSON}})
    assert validates("".join(c.choices[0].delta.content or "" for c in stream if c.choices), PERSON)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs"),
    ({"structured_outputs": "json"}, "structured_outputs")])
def test_server_bad_schema_is_400_then_serves(server, client, body, param):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and "\n" not in err["message"]
    assert client.completions.create(model="smollm2-135m-instruct", prompt="hi", max_tokens=2).choices[0].text


def test_api_key(llm, server):
    """Right key: served; wrong key or none: 401 with OpenAI's error object; /health stays open. (The `openai` client
    refuses to send no key at all, so "none" is a plain HTTP request.)"""
    from minfer.serve import ServerThread
    server.stop()  # one engine loop steps `llm` at a time
    with ServerThread(llm, api_key="sekret") as srv:
        ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0, timeout=60)
        assert ok.completions.create(model="smollm2-135m-instruct", prompt="hi", max_tokens=2).choices[0].text
        assert [m.id for m in ok.models.list()] == ["smollm2-135m-instruct"]
        wrong = openai.OpenAI(base_url=srv.url + "/v1", api_key="guess", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as e:
            wrong.completions.create(model="smollm2-135m-instruct", prompt="hi", max_tokens=2)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
        assert httpx.get(srv.url + "/health").status_code == 200


def test_serve_flag_reads_the_environment(monkeypatch):
    import argparse
    from minfer.serve import add_serve_args
    monkeypatch.setenv("MINFER_API_KEY", "from-env")
    assert add_serve_args(argparse.ArgumentParser()).parse_args([]).api_key == "from-env"
    assert add_serve_args(argparse.ArgumentParser()).parse_args(["--api-key", "k"]).api_key == "k"


def test_cli_structured_outputs_flag():
    from minfer.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["generate", "Is Paris in France?", "--max-tokens", "4",
                       "--structured-outputs", '{"choice": ["yes", "no"]}'])
    assert status == 0 and out.getvalue().strip() in ("yes", "no")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["generate", "hi", "--structured-outputs", "{bad"]) == 2
    assert "--structured-outputs is not valid JSON" in err.getvalue()
