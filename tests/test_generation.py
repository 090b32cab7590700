"Correctness contract 2 for chapters 01-02: lossless switches give the naive decode's greedy tokens; sampling rules."
import pytest, torch
from minfer.naive import naive_generate
from minfer.kvcache import cached_generate, ContiguousKVCache
from minfer.sequence import SamplingParams, Sequence
from minfer.sequential import SequentialEngine
from minfer.sampling import sample
from minfer.llm import LLM

PROMPTS = ["The three primary colors are", "def add(a, b):", "Once upon a time, in a small village,", "Q: What is 7 times 6?\nA:"]

@pytest.mark.parametrize("prompt", PROMPTS)
def test_cached_equals_naive(model, tokenizer, prompt):
    ids = tokenizer.encode(prompt)
    assert cached_generate(model, ids, 16) == naive_generate(model, ids, 16)

def test_naive_equals_transformers_greedy(model, model_dir, tokenizer):
    from transformers import LlamaForCausalLM
    ref = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer.encode(PROMPTS[0])
    with torch.inference_mode():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None)[0, len(ids):].tolist()
    assert naive_generate(model, ids, 12) == want

def test_cache_write_at_offset_matches_full_prefill(model, tokenizer):
    "A prompt fed in two pieces through the cache gives the last-token logits of one full pass (the masked T<S path)."
    ids = tokenizer.encode(PROMPTS[2])
    full = ContiguousKVCache(model.cfg, 64); split = ContiguousKVCache(model.cfg, 64)
    with torch.inference_mode():
        a = model(torch.tensor(ids), torch.arange(len(ids)), full)[-1]
        model(torch.tensor(ids[:5]), torch.arange(5), split); split.advance(5)
        b = model(torch.tensor(ids[5:]), torch.arange(5, len(ids)), split)[-1]
    assert (a - b).abs().max().item() < 1e-4

@pytest.mark.parametrize("kv", ["none", "contiguous"])
def test_llm_switches_give_naive_tokens(model_dir, model, tokenizer, kv):
    llm = LLM(model_dir, kv=kv)
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=10, ignore_eos=True), raw=True)
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == naive_generate(model, tokenizer.encode(p), 10)

def test_default_llm_answers_paris(llm):
    out = llm.generate("What is the capital of France?")[0]
    assert "Paris" in out.text and out.finish_reason == "stop"
    assert out.token_ids[-1] == llm.tokenizer.eos_token_id and "<|im_end|>" not in out.text

def test_seed_reproducible_and_samples_differ(llm):
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=123, n=3)
    a, b = llm.generate("Write a word.", p)[0], llm.generate("Write a word.", p)[0]
    assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
    assert len({tuple(s.token_ids) for s in a.samples}) > 1
    c = llm.generate("Write a word.", SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=124))[0]
    assert c.token_ids != a.token_ids

def test_max_tokens_and_length_reason(llm):
    o = llm.generate("Count: 1, 2, 3,", SamplingParams(max_tokens=5, ignore_eos=True), raw=True)[0]
    assert len(o.token_ids) == 5 and o.finish_reason == "length"

def test_stop_string_cuts_text(llm):
    free = llm.generate("List three animals.", SamplingParams(max_tokens=30))[0].text
    assert "\n" in free
    o = llm.generate("List three animals.", SamplingParams(max_tokens=30, stop=["\n"]))[0]
    assert o.finish_reason == "stop" and o.text == free[:free.index("\n")]

def test_stream_concatenates_to_generate(llm):
    p = SamplingParams(max_tokens=24, stop=["Paris"])
    text = "".join(llm.stream("What is the capital of France?", p))
    assert text == llm.generate("What is the capital of France?", p)[0].text

def test_stream_closed_early_leaves_engine_clean(llm):
    g = llm.stream("Tell me a long story.", SamplingParams(max_tokens=50))
    next(g); g.close()
    assert not llm.engine.has_unfinished()
    assert llm.engine.cache.allocator.num_used == 0  # no prefix cache here: every block of the closed request is back
    assert "Paris" in llm.generate("What is the capital of France?")[0].text

def test_chat_uses_template_and_history(llm):
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    a = llm.chat(conv)[0]
    b = llm.generate(llm.tokenizer.apply_chat_template(conv), raw=True)[0]
    assert a.token_ids == b.token_ids and "Paris" in a.text

def test_metrics_present(llm):
    m = llm.generate("Hello", SamplingParams(max_tokens=8, ignore_eos=True))[0].metrics
    assert m["ttft"] > 0 and m["tpot"] > 0 and m["tokens_per_s"] > 0 and m["num_generated_tokens"] == 8
    from minfer.roofline import weight_bytes_per_step
    assert weight_bytes_per_step(llm.model_config) < m["bytes_per_token"] < 1.2 * weight_bytes_per_step(llm.model_config)

def test_sample_filters(model, tokenizer):
    ids = tokenizer.encode("My favourite fruit is")
    with torch.inference_mode(): logits = model(torch.tensor(ids), torch.arange(len(ids)), ContiguousKVCache(model.cfg, 16))[-1]
    g = torch.Generator().manual_seed(0)
    top3 = set(torch.topk(logits, 3).indices.tolist())
    assert all(sample(logits, SamplingParams(temperature=2.0, top_k=3), g) in top3 for _ in range(40))
