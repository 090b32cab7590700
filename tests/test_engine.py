"""Chapter 06: continuous batching + chunked prefill.

Every request's greedy output equals its output run alone through chapter 02a's `cached_generate` (the independent
reference), under mixed lengths, chunking, forced preemption, prefix hits, forks and aborts; random arrival/abort
schedules never lose, duplicate or mix tokens and end with every block free. Where batching changes float summation
order the contract allows a divergence only at a near-tie (top-2 logit gap < 1e-3): `assert_solo` checks that.
"""
import random
import pytest, torch
from hypothesis import given, settings, HealthCheck, strategies as st

from minfer.engine import LLMEngine
from minfer.sequential import make_workload
from minfer.paged import PagedKVCache
from minfer.kvquant import QuantizedKVCache, kv_logprobs
from minfer.kivi import Int4KVCache
from minfer.kvcache import cached_generate, ContiguousKVCache
from minfer.sequence import Sequence, SamplingParams
from minfer.llm import LLM
from minfer.cpu_step import cpu_step_available

TEXTS = ["The three primary colors are", "def fibonacci(n):", "Once upon a time, in a land far away, there lived a king who",
         "List of European capitals: Paris, Berlin,", "Q: What is the boiling point of water?\nA:", "1, 2, 3, 4,",
         "The mitochondria is the powerhouse of the cell. It produces energy by", "Hello"]

# every test that takes `kv_dtype` runs with each KV format (chapter 09): a lossy format's reference is the same format,
# the sequence alone in a fresh pool, whole prompt in one step (chapter 09's `kv_logprobs`, greedy); "auto" is lossless.
# int4 groups keys by block, so its reference uses the engine's block size (and the same rule for what is quantized)
KV_DTYPES = ["auto", "int8", "fp8", "int4"]
# A different batch shape changes float summation order (1e-6 relative), which can move a stored element across a code
# boundary: one int8 step is amax/127 of its vector, one fp8 step 1/16 of the element. Measured: such a flip moved the
# top-2 logit gap by 0.19 at most (fp8: 0.14 preempted and recomputed, 0.19 in the int4 cases' run below). So a
# divergence is allowed below these gaps.
# int4 (one step: (max - min) / 15 of a block's channel or a token's group of 32 channels) gets fp8's bound: in this
# file's batch-equals-solo, prefix-cache and fork cases one int4 sequence diverged, where the reference's gap was 0.066
# (blocks of 4; fp8's largest there was 0.19)
# Contract 4 compares a lossy path with fp32, but not here, on purpose: these tests check that batching, chunking,
# preemption, prefix hits and forks store and read each sequence's KV as its solo run does. Against fp32 KV, each
# format's own error would dominate (chapter 09: fp8's greedy runs part from fp32's after 23 to 256 tokens) and hide
# such a bug. Both sides hold the same format over the same fp32 model and differ by summation order only, so the gaps
# below bound what a code flip can do to a divergence; they held on AMD EPYC with AVX-512 and on the AVX2 stand-in.
NEAR_TIE = {"auto": 1e-3, "int8": 0.05, "fp8": 0.25, "int4": 0.25}

_solo_cache = {}
def solo(model, ids, n, kv_dtype="auto", block_size=16):
    key = (tuple(ids), n, kv_dtype, block_size if kv_dtype == "int4" else 16)
    if key not in _solo_cache:
        if kv_dtype == "auto": _solo_cache[key] = cached_generate(model, ids, n)
        else:
            out = list(ids)
            for _ in range(n):
                out.append(int(kv_logprobs(model, out + [0], kv_dtype, len(out) + 1, block_size)[-1].argmax()))
            _solo_cache[key] = out[len(ids):]
    return _solo_cache[key]

def near_tie_at(model, ids, got, want, kv_dtype="auto", block_size=16):
    "True if the first divergence of `got` from `want` happens where the reference's top-2 logits are within NEAR_TIE."
    i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    prefix = list(ids) + want[:i]
    with torch.inference_mode():
        if kv_dtype == "auto":
            logits = model(torch.tensor(prefix), torch.arange(len(prefix)), ContiguousKVCache(model.cfg, len(prefix)), logits_rows=[-1])[0]
        else:  # log-softmax: the same gaps
            logits = kv_logprobs(model, prefix + [0], kv_dtype, len(prefix) + 1, block_size)[-1]
    top2 = torch.topk(logits, 2).values
    return (top2[0] - top2[1]).item() < NEAR_TIE[kv_dtype]

def assert_solo(model, seq, n=None, kv_dtype="auto", block_size=16):
    want = solo(model, seq.prompt_ids, n or seq.params.max_tokens, kv_dtype, block_size)[:len(seq.output_ids)]
    got = seq.output_ids
    assert got == want or near_tie_at(model, seq.prompt_ids, got, want, kv_dtype, block_size), (seq.prompt_ids[:8], got, want)

def greedy(ids, n, tok): return Sequence(ids, SamplingParams(max_tokens=n, ignore_eos=True), tok)

def run(engine):
    while engine.has_unfinished(): engine.step()

def pool(model, blocks, block_size=16, kv_dtype="auto", max_seqs=64):
    "kv_cache_bytes that hold `blocks` blocks (int4: plus its residual window, a block per running sequence)."
    if kv_dtype == "int4":
        window = max_seqs * Int4KVCache.residual_bytes(model.cfg, block_size, model.dtype)
        return blocks * QuantizedKVCache.block_bytes(model.cfg, block_size, model.dtype, kv_dtype) + window
    if kv_dtype != "auto": return blocks * QuantizedKVCache.block_bytes(model.cfg, block_size, model.dtype, kv_dtype)
    return blocks * PagedKVCache.block_bytes(model.cfg, block_size, model.dtype)

@pytest.mark.parametrize("budget,blocks,block_size", [(256, 200, 16), (7, 200, 16), (24, 12, 16), (16, 30, 4)],
                         ids=["roomy", "tiny-chunks", "preempting", "small-blocks"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_batch_equals_solo(model, tokenizer, budget, blocks, block_size, kv_dtype):
    prompts = [tokenizer.encode(t) for t in TEXTS]
    eng = LLMEngine(model, block_size=block_size, kv_cache_bytes=pool(model, blocks, block_size, kv_dtype),
                    max_num_batched_tokens=budget, kv_format=kv_dtype)
    assert eng.cache.num_blocks == blocks
    seqs = [greedy(p, 10, tokenizer) for p in prompts]
    for s in seqs: eng.add(s)
    run(eng)
    for s in seqs:
        assert s.finish_reason == "length" and len(s.output_ids) == 10
        assert_solo(model, s, kv_dtype=kv_dtype, block_size=block_size)
    if blocks == 12: assert eng.stats["preemptions"] > 0
    assert eng.cache.allocator.num_free == eng.cache.num_blocks
    for _, kinds, _ in eng.history: assert sum(n for _, n, _ in kinds) <= budget

def test_history_keeps_the_newest_steps_only(model, tokenizer, monkeypatch):
    "A server steps for days: the per-step history keeps the newest `history_steps` and forgets older ones."
    monkeypatch.setattr(LLMEngine, "history_steps", 5)
    eng = LLMEngine(model)
    eng.add(greedy(tokenizer.encode("Once upon a time"), 12, tokenizer))
    run(eng)
    assert eng.stats["steps"] > 5 and len(eng.history) == 5
    assert [t for t, _, _ in eng.history] == sorted(t for t, _, _ in eng.history)  # the newest, in order


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_prefix_cache_hits_give_same_tokens(model, tokenizer, kv_dtype):
    eng = LLMEngine(model, max_num_batched_tokens=64, prefix_cache=True, kv_format=kv_dtype)
    system = tokenizer.encode("You are a helpful assistant. Answer briefly and precisely, in one sentence. " * 3)
    base = system + tokenizer.encode("What is the capital of France?")
    cases = [base, base, base[:len(base) - 3], base + tokenizer.encode(" And of Spain?"), system + tokenizer.encode("Name a color.")]
    for ids in cases:
        s = greedy(ids, 6, tokenizer); eng.add(s); run(eng)
        assert_solo(model, s, kv_dtype=kv_dtype)
    # the re-sent prompt and everything after the first hit the cache
    assert eng.stats["cached_blocks"] > 0
    assert eng.cache.allocator.num_used == eng.stats["cached_blocks"]  # only the tree holds blocks now

def test_prefix_cache_reports_cached_tokens(model, tokenizer):
    eng = LLMEngine(model, prefix_cache=True)
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)
    a, b = greedy(ids, 4, tokenizer), greedy(ids, 4, tokenizer)
    eng.add(a); run(eng); eng.add(b); run(eng)
    assert a.metrics.num_cached_tokens == 0 and b.metrics.num_cached_tokens == min(len(ids) // 16 * 16, len(ids) - 1) > 0
    assert a.output_ids == b.output_ids

@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_abort_frees_blocks_others_unaffected(model, tokenizer, kv_dtype):
    eng = LLMEngine(model, max_num_batched_tokens=16, kv_format=kv_dtype)
    seqs = [greedy(tokenizer.encode(t), 12, tokenizer) for t in TEXTS[:5]]
    for s in seqs: eng.add(s)
    eng.step(); eng.abort(seqs[1].id)  # running (mid-prefill)
    eng.step(); eng.step(); eng.abort(seqs[3].id)
    eng.abort(seqs[4].id)  # possibly still waiting
    run(eng)
    assert {seqs[i].status for i in (1, 3, 4)} == {"aborted"}
    for i in (0, 2): assert_solo(model, seqs[i], kv_dtype=kv_dtype)
    assert eng.cache.allocator.num_free == eng.cache.num_blocks

def test_bad_request_refused_alone(model, tokenizer):
    eng = LLMEngine(model, kv_cache_bytes=pool(model, 4))
    good = greedy(tokenizer.encode(TEXTS[0]), 8, tokenizer); eng.add(good)
    with pytest.raises(ValueError, match="KV blocks"): eng.add(greedy(tokenizer.encode(TEXTS[0]), 200, tokenizer))
    run(eng)
    assert good.finish_reason == "length"; assert_solo(model, good)

@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_forks_share_prompt_blocks(model, tokenizer, kv_dtype):
    "n samples of one prompt: the prompt's blocks are shared (copy-on-write), greedy samples all equal the solo output."
    eng = LLMEngine(model, kv_format=kv_dtype)
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog and then " * 3)
    parent, forks = greedy(ids, 8, tokenizer), [greedy(ids, 8, tokenizer) for _ in range(3)]
    eng.add(parent, forks=forks)
    eng.step()  # prefill, then the forks start
    shared = set(parent.block_table.blocks[:len(ids) // 16])
    assert shared and all(shared <= set(f.block_table.blocks) for f in forks)
    assert eng.cache.allocator.num_used < 4 * -(-(len(ids) + 1) // 16)
    run(eng)
    for s in (parent, *forks): assert_solo(model, s, kv_dtype=kv_dtype)

def test_llm_paged_switches_equal_naive(model_dir, model, tokenizer):
    from minfer.naive import naive_generate
    p = SamplingParams(max_tokens=8, ignore_eos=True)
    # the default on a CPU is weights="packed" (oneDNN's layout for products, another summation order, plus the plain
    # matrices for chapter 05c's one-call decode step); weights="plain" keeps only the Hugging Face layout
    for kw in (dict(kv="paged"), dict(kv="paged", weights="plain"), dict(kv="paged", prefix_cache=True, block_size=4),
               dict(kv="paged", max_num_batched_tokens=5), dict(kv="contiguous", weights="packed")):
        llm = LLM(model_dir, **kw)
        assert llm.weights == kw.get("weights", "packed")
        outs = llm.generate(TEXTS[:4], p, raw=True)
        for t, o in zip(TEXTS, outs):
            want = naive_generate(model, tokenizer.encode(t), 8)
            assert o.token_ids == want or near_tie_at(model, tokenizer.encode(t), o.token_ids, want), kw

def test_engine_metrics(model_dir):
    llm = LLM(model_dir)
    outs = llm.generate(TEXTS[:3], SamplingParams(max_tokens=6, ignore_eos=True), raw=True)
    for o in outs:
        m = o.metrics
        assert m["queue_time"] >= 0 and m["ttft"] > 0 and m["tpot"] > 0 and m["num_generated_tokens"] == 6
        assert 0 < m["bytes_per_token"]
    st_ = llm.engine.stats
    assert st_["tokens_generated"] >= 18 and st_["steps"] >= 6 and st_["blocks_in_use"] == 0

def test_workload_is_seeded_and_follows_its_distributions(tokenizer):
    a = make_workload(tokenizer, 50, seed=3, arrival="poisson", rate=5.0)
    assert a == make_workload(tokenizer, 50, seed=3, arrival="poisson", rate=5.0)
    assert a != make_workload(tokenizer, 50, seed=4, arrival="poisson", rate=5.0)
    times = [t for t, _, _ in a]
    assert times == sorted(times) and 2 < times[-1] < 30  # 50 arrivals at 5/s: about 10 s
    assert all(8 <= len(p) <= 512 and 16 <= n <= 128 for _, p, n in a)

@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.data())
def test_random_arrivals_and_aborts(model, tokenizer, data):
    "Random arrivals, aborts, budgets and pool sizes: no token lost, duplicated or mixed up; every block free at the end."
    budget = data.draw(st.integers(4, 48), "budget")
    blocks = data.draw(st.integers(6, 24), "blocks")
    prefix = data.draw(st.booleans(), "prefix_cache")
    kv_dtype = data.draw(st.sampled_from(KV_DTYPES), "kv_dtype")
    seqs = data.draw(st.integers(1, 6))
    eng = LLMEngine(model, block_size=4, kv_cache_bytes=pool(model, blocks, 4, kv_dtype, seqs), max_num_batched_tokens=budget,
                    prefix_cache=prefix, max_num_seqs=seqs, kv_format=kv_dtype)
    pending = [greedy(tokenizer.encode(TEXTS[data.draw(st.integers(0, len(TEXTS) - 1))]), data.draw(st.integers(1, 5)), tokenizer) for _ in range(data.draw(st.integers(1, 6)))]
    added, aborted = [], set()
    for _ in range(200):
        if pending and data.draw(st.booleans()): s = pending.pop(0); eng.add(s); added.append(s)
        live = [s for s in added if not s.finished]
        if live and data.draw(st.integers(0, 9)) == 0:
            victim = data.draw(st.sampled_from(live)); eng.abort(victim.id); aborted.add(victim.id)
        if eng.has_unfinished(): eng.step()
        elif not pending: break
    run(eng)
    a = eng.cache.allocator
    held_by_tree = eng.scheduler.radix.num_blocks if prefix else 0
    assert a.num_used == held_by_tree and a.num_free + a.num_used == a.num_blocks
    for s in added:
        assert s.finished
        if s.id in aborted: assert s.status == "aborted"; continue
        assert len(s.output_ids) == s.params.max_tokens
        assert_solo(model, s, kv_dtype=kv_dtype, block_size=4)

@pytest.mark.parametrize("switches", [dict(), dict(kernels="cpu", attention="torch"), dict(kernels="torch", weights="plain"),
                                      dict(dtype="bfloat16"), dict(kv="contiguous", kernels="cpu")],
                         ids=["default", "cpu-kernels-torch-attention", "torch-plain", "bf16", "contiguous"])
def test_what_repr_says_is_what_runs(model_dir, switches):
    "Every resolved switch is visible in the objects that run: no switch is silently overridden (issue 13)."
    from minfer.paged import ATTENTION_BACKENDS
    from minfer.roofline import PackedLinear
    from minfer.cpu_kernels import FusedDecoderLayer
    from minfer.cpu_step import StepLlama
    llm = LLM(model_dir, **switches)
    c = llm.config
    assert all(repr(getattr(c, k)) in repr(llm) for k in ("kv", "dtype", "weights", "kernels", "attention"))
    assert all(getattr(c, k) == v for k, v in switches.items())
    assert str(llm.model.dtype) == f"torch.{c.dtype}"
    assert isinstance(llm.model.layers[0].mlp.down_proj, PackedLinear) == (c.weights == "packed")
    assert isinstance(llm.model, StepLlama) == (c.kernels == "step")
    assert isinstance(llm.model.layers[0], FusedDecoderLayer) == (c.kernels in ("cpu", "step"))
    if c.kv == "paged": assert type(llm.engine.attn) is ATTENTION_BACKENDS[c.attention]
    assert llm.generate("The capital of France is", SamplingParams(max_tokens=3, ignore_eos=True), raw=True)[0].token_ids
