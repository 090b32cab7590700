"""One request can never hurt another (chapters 00a, 02b, 02c, 06a, 06b): a failure while sampling, constraining,
detokenizing or stop-checking one sequence ends that sequence alone; temperatures too small to divide by are greedy;
sampling draws with a generator on the logits' device; a model folder's chat template renders in jinja2's sandbox,
byte for byte as transformers renders it."""
import logging, random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from minfer.llm import LLM
from minfer.tokenizer import Tokenizer
from minfer.sampling import SamplingParams, sample_next
from minfer.sequence import Sequence

PROMPTS = ["The capital of France is", "Once upon a time", "Water boils at", "The best way to learn is",
           "def fibonacci(n):"]


class BrokenConstraint:
    "An output constraint whose `mask` raises on its `fail_at`-th call: a grammar matcher hitting a limit, say."
    def __init__(self, fail_at):
        self.calls, self.fail_at, self.done = 0, fail_at, False

    def mask(self, logits):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("the grammar matcher hit its limit")
        return logits

    def accept(self, token):
        pass

    def forced(self):
        return []


@pytest.fixture(scope="module")
def batched(model_dir):
    return LLM(model_dir, max_num_seqs=8)


def run_batch(llm, prompts, broken=None, fail_at=3):
    "Queue every prompt (greedy, 12 tokens); the one at index `broken` gets a constraint that raises; step to the end."
    seqs = []
    for i, p in enumerate(prompts):
        s, = llm.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True), raw=True)
        if i == broken:
            s.logits_processor = BrokenConstraint(fail_at)
        seqs.append(s)
    while llm.has_unfinished():
        llm.step()
    return seqs


def test_a_failing_sequence_ends_alone(batched, caplog):
    alone = [run_batch(batched, [p])[0].output_ids for p in PROMPTS]
    with caplog.at_level(logging.ERROR, logger="minfer"):
        seqs = run_batch(batched, PROMPTS, broken=2)
    failed = seqs[2]
    assert failed.finished and failed.finish_reason == "error"
    assert "\n" not in failed.error and f"request {failed.request_id}" in failed.error
    assert len(failed.output_ids) == 2  # its third sampling raised: two tokens, then the end
    # the traceback went to the log, with the request id; the message to the client has none of it
    assert any(f"request {failed.request_id}" in r.getMessage() and r.exc_info for r in caplog.records)
    assert "Traceback" not in failed.error and "grammar" not in failed.error
    for i, s in enumerate(seqs):
        if i != 2:
            assert s.finish_reason == "length" and s.output_ids == alone[i], PROMPTS[i]
    assert batched.engine.cache.allocator.num_used == 0  # its blocks came back too
    # and the engine serves the next batch as if nothing had happened
    assert [s.output_ids for s in run_batch(batched, PROMPTS[:2])] == alone[:2]


def test_a_failure_while_appending_ends_alone(batched, monkeypatch):
    "A failure after sampling (detokenizing, stop checks, the constraint's accept) ends that sequence alone too."
    alone = [run_batch(batched, [p])[0].output_ids for p in PROMPTS[:3]]
    seqs = []
    for p in PROMPTS[:3]:
        s, = batched.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True), raw=True)
        seqs.append(s)
    victim = seqs[1]

    class Detokenizer:  # the real tokenizer, which breaks on this one sequence's fourth token
        def __init__(self, tok):
            self.tok, self.calls = tok, 0
        def decode(self, ids, **kw):
            self.calls += 1
            if self.calls == 7:  # two decodes a token
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
            return self.tok.decode(ids, **kw)
    victim.tokenizer = Detokenizer(batched.tokenizer)
    while batched.has_unfinished():
        batched.step()
    assert victim.finish_reason == "error" and len(victim.output_ids) == 4
    assert [seqs[0].output_ids, seqs[2].output_ids] == [alone[0], alone[2]]
    assert batched.engine.cache.allocator.num_used == 0


def test_tiny_temperature_is_greedy(batched):
    "1e-40 overflowed logits / T to inf and softmax gave NaN: torch.multinomial raised inside the batch's step."
    assert SamplingParams(temperature=1e-6).temperature == 0 and SamplingParams(temperature=1e-5).temperature > 0
    greedy = batched.generate(PROMPTS[0], SamplingParams(max_tokens=8))[0].token_ids
    for t in (1e-40, 1e-6):
        out = batched.generate(PROMPTS[0], SamplingParams(temperature=t, max_tokens=8, seed=1))[0]
        assert out.finish_reason == "length" and out.token_ids == greedy, t


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=5),
                                    SamplingParams(temperature=2.0, top_p=0.5)])
def test_logits_without_a_distribution_fall_back_to_the_largest(params):
    "A NaN, an inf, or every token masked out: no distribution to draw from; the largest finite logit, never a raise."
    from minfer.sampling import sample
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    best = int(logits.argmax())
    nan, inf, masked = logits.clone(), logits.clone(), torch.full_like(logits, float("-inf"))
    nan[(best + 1) % 100] = float("nan")
    inf[7] = float("inf")
    gen = torch.Generator().manual_seed(1)
    assert [sample(x, params, gen) for x in (nan, inf, masked)] == [best, 7, 0]


def test_the_generator_lives_on_the_logits_device(monkeypatch):
    """torch.multinomial wants its generator on the probabilities' device (a CPU generator fails every CUDA sample):
    sampling asks the sequence for its generator on the logits' device, and draws with it there."""
    asked, drawn = [], []
    token_generator, multinomial = Sequence.token_generator, torch.multinomial
    def spy_generator(self, ahead=0, **kw):
        asked.append(kw.get("device"))
        return token_generator(self, ahead, **kw)
    def spy_multinomial(probs, n, generator=None, **kw):
        drawn.append((probs.device, generator.device))
        return multinomial(probs, n, generator=generator, **kw)
    monkeypatch.setattr(Sequence, "token_generator", spy_generator)
    monkeypatch.setattr(torch, "multinomial", spy_multinomial)
    seq = Sequence([1, 2, 3], SamplingParams(temperature=1.0, max_tokens=4, seed=0))
    logits = torch.randn(50)
    sample_next(seq, logits)
    assert asked == [logits.device] and drawn == [(logits.device, logits.device)]


@pytest.mark.gpu
def test_sampling_on_cuda(model_dir):
    llm = LLM(model_dir, device="cuda")
    out = llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=16, seed=3))
    assert all(o.finish_reason == "length" for o in out)


def text_at_first_stop(tokenizer, ids, stops):
    """The reference: after each token, search the whole text decoded so far; the text before the earliest stop string
    found at the first token where any is found (None: no stop)."""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[:min(hits)]
    return None


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), n_stops=st.integers(1, 3))
def test_stop_strings_found_where_they_first_appear(tokenizer, seed, n_stops):
    """Only the text a token adds is searched for stop strings (not the whole text, every token), and a stop string
    that spans tokens is still found, where a search of the whole text after each token finds it."""
    rng = random.Random(seed)
    ids = tokenizer.encode(open(__file__).read())
    start = rng.randrange(0, len(ids) - 80)
    ids = ids[start:start + 80]
    text = tokenizer.decode(ids)
    stops = []
    for _ in range(n_stops):
        a = rng.randrange(0, len(text) - 1)
        stops.append(text[a:a + rng.randint(1, 12)])
    seq = Sequence([0], SamplingParams(max_tokens=len(ids), stop=stops), tokenizer)
    for t in ids:
        if seq.finished:
            break
        seq.append(t)
    expected = text_at_first_stop(tokenizer, ids, stops)
    assert (seq.finish_reason, seq.text) == (("length", text) if expected is None else ("stop", expected))


# ---- chat templates: the sandbox, and byte-identity with transformers

HOSTILE = [
    "{{ cycler.__init__.__globals__.os.popen('touch {marker}').read() }}",
    "{{ self.__init__.__globals__.__builtins__.__import__('os').system('touch {marker}') }}",
    "{% set ns = namespace(_x=1) %}{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.append({'role': 'user'}) }}",  # the immutable sandbox: no mutating what the engine passes in
]


@pytest.mark.parametrize("template", HOSTILE)
def test_a_hostile_template_is_refused(model_dir, tmp_path, template):
    marker = tmp_path / "ran"
    tok = Tokenizer(model_dir)
    tok.chat_template = template.replace("{marker}", str(marker))
    with pytest.raises(ValueError) as e:
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert "\n" not in str(e.value) and not marker.exists()


def test_a_hostile_template_leaves_the_engine_usable(batched):
    tok, before = batched.tokenizer, batched.tokenizer.chat_template
    try:
        tok.chat_template = "{{ cycler.__init__.__globals__ }}"
        with pytest.raises(ValueError, match="sandbox"):
            batched.chat([{"role": "user", "content": "Hi"}])
    finally:
        tok.chat_template = before
    assert batched.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4))[0].finish_reason


TEMPLATES = {
    "tools and tojson": (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if m.meta %} {{ m.meta | tojson }}"
        "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "namespace and loop controls": (
        "{{ bos_token }}{% set ns = namespace(system='') %}{% for m in messages %}{% if m.role == 'system' %}"
        "{% set ns.system = m.content %}{% continue %}{% endif %}[{{ m.role | upper }}] {{ ns.system ~ ' ' if "
        "loop.first }}{{ m.content | trim }}{% if loop.index > 6 %}{% break %}{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"),
    "generation tags": (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{{ eos_token }}"
        "{% endgeneration %}{% else %}<{{ m.role }}>{{ m.content }}{% endif %}\n{% endfor %}"),
    "raise_exception": (
        "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"),
}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "  What is <b>2+2</b>? ü \"quoted\" ", "meta": {"lang": "<é>", "n": [1, 2]}},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
]


@pytest.mark.parametrize("name", [None, *TEMPLATES])
def test_templates_render_as_transformers_renders_them(model_dir, name):
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(model_dir)
    ours = Tokenizer(model_dir)
    if name is not None:
        ref.chat_template = ours.chat_template = TEMPLATES[name]
    for conv in CONVERSATIONS:
        try:
            expected = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # the template refuses this conversation: so must ours, in one line
            with pytest.raises(ValueError, match=str(e)):
                ours.apply_chat_template(conv)
            continue
        assert ours.apply_chat_template(conv) == expected
