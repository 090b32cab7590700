"""Logprobs (vLLM's meaning): SamplingParams(logprobs=k) gives each output token's log-probability and the k most likely
tokens; prompt_logprobs=k the same for every prompt token (None for the first). Checked against transformers'
log-softmax over the same tokens (fp32, <= 1e-4 on plain weights), through every engine path that computes them."""
import pickle
import pytest, torch
from minfer.llm import LLM
from minfer.sequence import SamplingParams, Sequence

TEXT = ("The Moon is Earth's only natural satellite. It orbits at an average distance of 384,400 km, about thirty "
        "times the diameter of Earth, and always shows the same face to us.")

@pytest.fixture(scope="module")
def reference(model_dir, tokenizer):
    "-> a function: token ids -> transformers' log-softmax [len, vocab] in float64 (row i predicts token i + 1)."
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    def logprobs(ids):
        with torch.inference_mode(): return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    return logprobs

def check(entries, ids, ref, k, first_row, tol):
    "Each entry holds the actual token first, then the true top k (up to ties at the cut), values within tol."
    for i, (e, t) in enumerate(zip(entries, ids)):
        row = ref[first_row + i]
        assert list(e)[0] == t and len(e) in (k, k + 1), (i, e)
        assert all(abs(v - float(row[j])) <= tol for j, v in e.items()), (i, max(abs(v - float(row[j])) for j, v in e.items()))
        kth = float(row.topk(k).values[-1]) if k else float("inf")
        assert all(float(row[j]) >= kth - tol for j in list(e)[1:])

@pytest.mark.parametrize("switches", [dict(weights="plain"), dict(weights="plain", max_num_batched_tokens=7),
                                      dict(kv="contiguous", weights="plain")], ids=["paged", "chunked-prefill", "contiguous"])
def test_logprobs_match_transformers(model_dir, tokenizer, reference, switches):
    llm = LLM(model_dir, **switches)
    out = llm.generate(TEXT, SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True), raw=True)[0]
    prompt = tokenizer.encode(TEXT)
    ref = reference(prompt + out.token_ids)
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    check(out.prompt_logprobs[1:], prompt[1:], ref, 2, 0, 1e-4)
    check(out.samples[0].logprobs, out.token_ids, ref, 3, len(prompt) - 1, 1e-4)

def test_default_switches_logprobs_and_perplexity(model_dir, tokenizer, reference):
    "The default (oneDNN-packed weights, another summation order) within 1e-3; perplexity from prompt logprobs."
    llm = LLM(model_dir)
    out = llm.generate(TEXT, SamplingParams(max_tokens=1, prompt_logprobs=0), raw=True)[0]
    prompt = tokenizer.encode(TEXT)
    ref = reference(prompt)
    check(out.prompt_logprobs[1:], prompt[1:], ref, 0, 0, 1e-3)
    ours = -sum(e[t] for e, t in zip(out.prompt_logprobs[1:], prompt[1:])) / (len(prompt) - 1)
    theirs = -float(ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].mean())
    assert abs(ours - theirs) < 1e-4

def test_prompt_logprobs_with_prefix_cache_and_forks(model_dir, tokenizer, reference):
    """A request for prompt logprobs computes its whole prompt even when the prefix cache holds it (vLLM does the same);
    n > 1 samples each get their own logprobs; the cache still serves the next request."""
    llm = LLM(model_dir, weights="plain", prefix_cache=True, block_size=4)
    llm.generate(TEXT, SamplingParams(max_tokens=2), raw=True)
    out = llm.generate(TEXT, SamplingParams(max_tokens=3, n=2, temperature=1.0, seed=1, logprobs=1, prompt_logprobs=1), raw=True)[0]
    prompt = tokenizer.encode(TEXT)
    assert out.samples[0].metrics["num_cached_tokens"] == 0
    check(out.prompt_logprobs[1:], prompt[1:], reference(prompt), 1, 0, 1e-4)
    for s in out.samples:
        check(s.logprobs, s.token_ids, reference(prompt + s.token_ids), 1, len(prompt) - 1, 1e-4)
    again = llm.generate(TEXT, SamplingParams(max_tokens=2), raw=True)[0]
    assert again.metrics["num_cached_tokens"] > 0 and llm.engine.stats["blocks_in_use"] == llm.engine.stats["cached_blocks"]

def test_logprobs_off_by_default_and_bad_values(llm):
    out = llm.generate("Hello", SamplingParams(max_tokens=2))[0]
    assert out.samples[0].logprobs is None and out.prompt_logprobs is None
    for bad in (dict(logprobs=-1), dict(logprobs=21), dict(prompt_logprobs="5"), dict(logprobs=True)):
        with pytest.raises(ValueError) as e: SamplingParams(**bad)
        assert "\n" not in str(e.value) and "[0, 20]" in str(e.value)
    assert llm.generate("Hello", SamplingParams(max_tokens=2))[0].token_ids  # still usable

def test_sequence_pickles_without_tokenizer(tokenizer):
    "What a worker process receives: ids and state, no tokenizer; the next draw is the same on both sides."
    s = Sequence(tokenizer.encode("Hi"), SamplingParams(temperature=1.0, logprobs=1), tokenizer, [tokenizer.eos_token_id])
    s.append(42, {42: -0.5})
    copy = pickle.loads(pickle.dumps(s))
    assert copy.tokenizer is None and s.tokenizer is tokenizer and copy.logprobs == [{42: -0.5}]
    logits = torch.randn(tokenizer.vocab_size)
    from minfer.sampling import sample_next
    assert sample_next(copy, logits) == sample_next(s, logits)
