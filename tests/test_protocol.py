"""Chapter 07b's wire format without a server: a body is checked into `SamplingParams` or refused in
one line, by plain function calls (no HTTP, no thread, no model)."""
import pytest

from minfer.protocol import (APIError, ChatRequest, CompletionRequest, ServerLimits, chat_messages,
                             completion_prompts, decode_json, parse_request, sampling_params)

LIMITS = ServerLimits()


def check(raw, model=CompletionRequest):
    "`raw` read and checked as the server does before any work: -> (request, SamplingParams)."
    req = parse_request(model, decode_json(raw, LIMITS.max_json_depth))
    if model is ChatRequest:
        chat_messages(req.messages)
    else:
        completion_prompts(req.prompt)
    return req, sampling_params(req, req.max_tokens or 16, limits=LIMITS)


def test_a_chat_body_gives_its_sampling_params():
    raw = (b'{"messages": [{"role": "developer", "content": "Be brief."},'
           b' {"role": "user", "content": "Hi"}], "temperature": 0.2, "top_k": 5, "seed": 7,'
           b' "stop": "\\n", "n": 2, "max_tokens": 8}')
    req, params = check(raw, ChatRequest)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.2, 1.0, 5, 7)
    assert (params.stop, params.n, params.max_tokens) == (["\n"], 2, 8)
    assert chat_messages(req.messages)[0] == {"role": "system", "content": "Be brief."}


@pytest.mark.parametrize("raw, param, words", [
    (b"[" * 10_000 + b"]" * 10_000, None, "nests deeper than 64"),
    (b'{"prompt": "Hi", "seed": 1' + b"0" * 5_000 + b"}", None, "outside the signed 64-bit range"),
    (b'{"prompt": "Hi", "temperature": NaN}', None, "NaN, which is not JSON"),
    (b'{"prompt": "Hi", "temperature": "hot"}', "temperature", "valid number"),
    (b'{"prompt": "Hi", "top_p": 1.5}', "top_p", "top_p=1.5 is invalid"),
    (b'{"prompt": "Hi", "stop": [' + b",".join([b'"s"'] * 17) + b"]}", "stop", "at most 16"),
    (b'{"prompt": [1, 2, 3]}', "prompt", "token-id prompts"),
    (b'{"prompt": "Hi", "logit_bias": {"1": 5}}', "logit_bias", "not supported"),
])
def test_a_hostile_body_is_refused_in_one_line(raw, param, words):
    with pytest.raises(APIError) as e:
        check(raw)
    assert (e.value.status, e.value.param) == (400, param)
    message = e.value.message
    assert words in message and "\n" not in message and len(message) <= 300
