"""Chapter 05c: the one-call decode step and its matvec, against independent references (F.linear, transformers, chapter
05b's modules over the same pool, chapter 01's naive decode)."""
import collections
import pytest, torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from minfer.cpu_step import matvec, StepLlama, STEP_MAX_ROWS, fuse_decode_step, cpu_step_available
from minfer.cpu_kernels import fuse_cpu_ops, CpuAttention, FUSED_MAX_ROWS
from minfer.model import Llama, NoCache, load_model
from minfer.roofline import pack_weights
from minfer.paged import PagedKVCache, PagedAttention, BlockTable, build_batch_meta
from minfer.llm import LLM
from minfer.sampling import SamplingParams
from lossy import assert_near_fp32, assert_kv_near_fp32

pytestmark = pytest.mark.skipif(not cpu_step_available(), reason="no C++ compiler with OpenMP to build the step kernels")
LONG = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog while counting sheep." for i in range(40))
SHORT = ["The capital of France is", "def fibonacci(n):", "Water boils at 100 degrees Celsius at sea level. At the top of"]
TEXTS = SHORT[:2] + [LONG] + SHORT[2:]

@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, FUSED_MAX_ROWS), n_in=st.sampled_from([16, 37, 576, 1536]), n_out=st.integers(1, 300),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_matvec_matches_linear(rows, n_in, n_out, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n_out, n_in, generator=g).to(dtype), torch.randn(rows, n_in, generator=g).to(dtype)
    got, exact = matvec(w, x).float(), F.linear(x.float(), w.float())  # the exact sums of the same (rounded) inputs
    # fp32: a few roundings of a sum of n_in terms, each as large as the sum of the terms' sizes (a sum that cancels to
    # near 0 keeps that error); bf16: one rounding of the output on top (both sum in fp32 first)
    size = F.linear(x.float().abs(), w.float().abs())
    tol = 1e-6 * n_in ** 0.5 * size
    if dtype == torch.bfloat16:
        tol = tol + exact.abs() * 2**-8
    assert ((got - exact).abs() <= tol).all(), (got - exact).abs().max()
    # a row's sums never depend on the rows beside it, so a tree's node, a chain's guess and a plain step agree exactly
    alone = torch.cat([matvec(w, x[r:r + 1]) for r in range(rows)])
    assert torch.equal(alone, matvec(w, x))

def test_matvec_refuses_bad_input_with_one_line():
    w, x = torch.randn(64, 32), torch.randn(2, 32)
    for call, word in [(lambda: matvec(w, torch.randn(FUSED_MAX_ROWS + 1, 32)), "x must be"),
                       (lambda: matvec(w, torch.randn(2, 31)), "x must be"),
                       (lambda: matvec(w.t(), torch.randn(2, 64)), "contiguous"),
                       (lambda: matvec(w.bfloat16(), x), "dtype"),
                       (lambda: matvec(w.half(), x.half()), "float16")]:
        with pytest.raises(ValueError) as e: call()
        assert "\n" not in str(e.value) and word in str(e.value)
    assert torch.allclose(matvec(w, x), F.linear(x, w), rtol=1e-5, atol=1e-5)  # still usable

def prefill_then_decode(model, prompts, steps, bs=8, seed=0, feed=None):
    """Prefill `prompts` (token ids) into a pool with a shuffled free list, then `steps` decode steps of all of them
    together, fed their greedy tokens or, with `feed` [steps, batch], those (teacher forcing: another model's tokens, so
    that two models see the same inputs): (logits of every decode step [steps, batch, vocab], the tokens fed
    [steps, batch], the pool's k, v)."""
    nb = sum(-(-(len(p) + steps) // bs) for p in prompts) + 4
    cache = PagedKVCache(model.cfg, nb, bs, model.dtype)
    cache.allocator.free_ids = collections.deque(torch.randperm(nb, generator=torch.Generator().manual_seed(seed)).tolist())
    attn, tables, nxt, out, fed = CpuAttention(cache), [], [], [], []
    with torch.inference_mode():
        for ids in prompts:
            t = BlockTable(cache.allocator); t.append_slots(len(ids)); tables.append(t)
            attn = attn.bind(build_batch_meta([(t, 0, len(ids))], bs))
            nxt.append(int(model(torch.tensor(ids), torch.arange(len(ids)), attn, logits_rows=torch.tensor([len(ids) - 1]))[0].argmax()))
        for i in range(steps):
            if feed is not None: nxt = feed[i].tolist()
            for t in tables: t.append_slots(1)
            attn = attn.bind(build_batch_meta([(t, t.num_tokens - 1, 1) for t in tables], bs))
            logits = model(torch.tensor(nxt), torch.tensor([t.num_tokens - 1 for t in tables]), attn, logits_rows=torch.arange(len(tables)))
            out.append(logits)
            fed.append(nxt)
            nxt = logits.argmax(-1).tolist()
    return torch.stack(out), torch.tensor(fed), cache.k, cache.v

def step_model(model_dir, dtype):
    model = fuse_decode_step(fuse_cpu_ops(load_model(model_dir, dtype)))
    model.timings = torch.zeros(5, dtype=torch.float64)  # to see that the one call ran
    return model

def test_one_call_matches_transformers_fp32(model_dir, tokenizer):
    "Contract 1 for the one-call step: 4 sequences (one of 500+ tokens) in one decode step, within 1e-4 of transformers."
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [tokenizer.encode(t) for t in TEXTS]
    assert max(map(len, prompts)) >= 500
    model = step_model(model_dir, "float32")
    logits, *_ = prefill_then_decode(model, prompts, steps=1)
    assert model.timings.sum() > 0  # the decode step was the C++ call, not the modules
    with torch.inference_mode():
        for ids, got in zip(prompts, logits[0]):
            full = ids + [int(hf(torch.tensor([ids])).logits[0, -1].argmax())]
            ref = hf(torch.tensor([full])).logits[0, -1]
            assert (got - ref).abs().max().item() <= 1e-4

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_call_matches_chapter_05b_over_several_steps(model_dir, tokenizer, dtype):
    """Three decode steps of three sequences, every path fed the greedy tokens of chapter 05b's fp32 modules (teacher
    forcing: the same inputs everywhere). fp32: the step's logits and K/V within float rounding of the modules'. bf16
    (contract 4; `lossy` explains the bounds): the step and chapter 05b's bf16 modules each against fp32, never against
    each other. Logits within E = 8 bf16 eps of the largest |logit| (measured on AMD EPYC, AVX-512: step 3.2, modules
    1.5; AVX2 stand-in: 1.6, 1.6); logits minus that of fp32's top token within D = 5 (2.4, 1.8; 2.0, 1.5), so the
    argmax is fp32's in the 2 of these 9 rows whose fp32 top-2 gap exceeds D (1.5); 4 rows are near-ties, gaps 0.07 to
    0.47, that a bf16 path may break either way. K/V in fp32's slots, each vector within 2**-5 of its length in layer
    0 and 2**-1 in every layer (measured 0.007 and 0.16 on both)."""
    prompts = [tokenizer.encode(t) for t in SHORT]  # short: a bf16 prefill of hundreds of tokens is slow on a CPU
    want, fed, k_want, v_want = prefill_then_decode(fuse_cpu_ops(load_model(model_dir)), prompts, steps=3)
    step = step_model(model_dir, dtype)
    got, _, k_got, v_got = prefill_then_decode(step, prompts, steps=3, feed=fed)
    assert step.timings.sum() > 0  # the decode steps were the C++ call
    if dtype == "float32":
        assert (got - want).abs().max() <= 1e-4 and torch.allclose(k_got, k_want, atol=1e-4) and torch.allclose(v_got, v_want, atol=1e-4)
        return
    ops, _, k_ops, v_ops = prefill_then_decode(fuse_cpu_ops(load_model(model_dir, dtype)), prompts, steps=3, feed=fed)
    for what, logits, k, v in (("step", got, k_got, v_got), ("modules", ops, k_ops, v_ops)):
        assert_near_fp32(logits, want, 8, 5, f"bf16 {what}")
        assert_kv_near_fp32(k, k_want, f"bf16 {what}, K")
        assert_kv_near_fp32(v, v_want, f"bf16 {what}, V")

def test_steps_it_cannot_take_run_the_modules(model_dir, tokenizer):
    "Prefills, steps over the row limit and other attentions go through the modules: chapter 05b's numbers exactly."
    step, ops = step_model(model_dir, "float32"), fuse_cpu_ops(load_model(model_dir))
    many = [tokenizer.encode(t) for t in SHORT] * 6  # 18 sequences: more than STEP_MAX_ROWS[float32]
    assert len(many) > STEP_MAX_ROWS[torch.float32]
    a, *_ = prefill_then_decode(step, many, steps=1)
    b, *_ = prefill_then_decode(ops, many, steps=1)
    assert torch.equal(a, b) and step.timings.sum() == 0

def kv_of(cache, table, n):
    "The K and V a sequence's first n positions hold in `cache`: [layers, n, kv heads, head dim] each."
    bs = cache.block_size
    slots = [table.blocks[p // bs] * bs + p % bs for p in range(n)]
    return cache.k.flatten(1, 2)[:, slots], cache.v.flatten(1, 2)[:, slots]

def test_one_call_takes_a_sequences_several_rows(model_dir, tokenizer):
    """A step where sequences bring several rows (a speculative chain's guesses over a cached prefix, a short prompt
    of its own) beside a one-row decode is one call, each row attending causally (`decode_tables`): every row's logits
    within 1e-4 of chapter 00a's model over the sequence's whole text without a cache, and the K/V of every position
    within 1e-4 of what chapter 03's attention writes for a prefill of that text, fp32."""
    step, reference = step_model(model_dir, "float32"), load_model(model_dir)
    texts = [tokenizer.encode(t) for t in SHORT]
    cached, new = [texts[0], texts[1], []], [tokenizer.encode(" Paris, the city of")[:5], texts[0][:1], texts[2][:3]]
    cache = PagedKVCache(step.cfg, 16, 4, step.dtype)
    shuffled = torch.randperm(16, generator=torch.Generator().manual_seed(1))
    cache.allocator.free_ids = collections.deque(shuffled.tolist())  # scattered blocks
    attn, tables = CpuAttention(cache), []
    with torch.inference_mode():
        for ids in cached:  # the prefixes, through the modules (a prefill wanting its last row's logits only)
            t = BlockTable(cache.allocator)
            t.append_slots(len(ids))
            tables.append(t)
            if ids:
                attn = attn.bind(build_batch_meta([(t, 0, len(ids))], 4))
                step(torch.tensor(ids), torch.arange(len(ids)), attn, logits_rows=torch.tensor([len(ids) - 1]))
        assert step.timings.sum() == 0
        for t, ids in zip(tables, new): t.append_slots(len(ids))
        attn = attn.bind(build_batch_meta([(t, len(c), len(n)) for t, c, n in zip(tables, cached, new)], 4))
        positions = torch.cat([torch.arange(len(c), len(c) + len(n)) for c, n in zip(cached, new)])
        got = step(torch.tensor(sum(new, [])), positions, attn).split([len(n) for n in new])
        assert step.timings.sum() > 0  # one call
        for t, c, n, logits in zip(tables, cached, new, got):
            full = torch.tensor(c + n)
            want = reference(full, torch.arange(len(full)), NoCache())[len(c):]
            assert (logits - want).abs().max() <= 1e-4
            fresh = PagedKVCache(step.cfg, 8, 4, step.dtype)
            ft = BlockTable(fresh.allocator)
            ft.append_slots(len(full))
            prefill = PagedAttention(fresh)
            prefill = prefill.bind(build_batch_meta([(ft, 0, len(full))], 4))
            reference(full, torch.arange(len(full)), prefill)
            for got_kv, want_kv in zip(kv_of(cache, t, len(full)), kv_of(fresh, ft, len(full))):
                assert (got_kv - want_kv).abs().max() <= 1e-4

def test_llm_step_equals_naive(model_dir, model, tokenizer):
    """Contract 2: LLM(kernels='step') gives chapter 01's greedy tokens: 18 prompts at once (over fp32's row limit: the
    modules), 5 at once and 1 alone (one call each step, seen on the call's clock)."""
    from minfer.naive import naive_generate
    from test_engine import TEXTS as ENGINE_TEXTS, near_tie_at
    llm = LLM(model_dir, kernels="step")
    assert llm.kernels == "step" and llm.weights == "packed" and isinstance(llm.model, StepLlama)
    assert isinstance(llm.engine.attn, CpuAttention)
    texts, p = ENGINE_TEXTS * 2 + ENGINE_TEXTS[:2], SamplingParams(max_tokens=8, ignore_eos=True)
    assert len(texts) > STEP_MAX_ROWS[torch.float32]
    llm.model.timings = clock = torch.zeros(5, dtype=torch.float64)
    outs = llm.generate(texts, p, raw=True)
    assert clock.sum() == 0  # 18 sequences per step: never one call
    outs += llm.generate(texts[:5], p, raw=True) + llm.generate(texts[:1], p, raw=True)
    assert clock.sum() > 0
    naive = {t: naive_generate(model, tokenizer.encode(t), 8) for t in set(texts)}
    for t, o in zip(texts + texts[:5] + texts[:1], outs):
        assert o.token_ids == naive[t] or near_tie_at(model, tokenizer.encode(t), o.token_ids, naive[t])

def test_step_switch_errors_leave_things_usable(model_dir):
    for kw, words in [(dict(kernels="step", kv="contiguous"), "kv='paged'"), (dict(kernels="step", dtype="float16"), "kernels='step' needs"),
                      (dict(kernels="step", attention="torch"), "attention='cpu'")]:
        with pytest.raises(ValueError) as e: LLM(model_dir, **kw)
        assert "\n" not in str(e.value) and words in str(e.value)
    model = load_model(model_dir)
    down = model.layers[0].mlp.down_proj
    down.weight = torch.nn.Parameter(down.weight.t().contiguous().t(), requires_grad=False)  # same values, column-major
    with pytest.raises(ValueError, match="plain"): fuse_decode_step(model)
    llm = LLM(model_dir, kernels="step")
    llm.model.timings = torch.zeros(5)  # float32, not float64: refused before any pointer is used
    with pytest.raises(ValueError) as e: llm.generate("Hello", SamplingParams(max_tokens=3))
    assert "\n" not in str(e.value) and "float64" in str(e.value)
    llm.model.timings = None
    assert llm.generate("The capital of France is", SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids

def test_one_call_step_is_deterministic(model_dir, tokenizer):
    """The step's logits and K/V depend on its inputs only: bitwise the same on every call, with one thread or two, and
    after the heap has been filled with NaN. Each of its parallel loops writes its own rows from its own sums, and every
    scratch buffer is zeroed, so a race or a read of memory nobody wrote would show here as a difference."""
    prompts = [tokenizer.encode(t) for t in SHORT]
    model = step_model(model_dir, "float32")
    cache = PagedKVCache(model.cfg, 16, 4, model.dtype)
    shuffled = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    cache.allocator.free_ids = collections.deque(shuffled.tolist())  # scattered blocks
    attn, tables = CpuAttention(cache), []
    with torch.inference_mode():
        for ids in prompts:
            t = BlockTable(cache.allocator)
            t.append_slots(len(ids))
            tables.append(t)
            attn = attn.bind(build_batch_meta([(t, 0, len(ids))], 4))
            model(torch.tensor(ids), torch.arange(len(ids)), attn)
        for t in tables: t.append_slots(1)
        attn = attn.bind(build_batch_meta([(t, t.num_tokens - 1, 1) for t in tables], 4))
        tokens, positions = torch.tensor([1, 2, 3]), torch.tensor([t.num_tokens - 1 for t in tables])
        threads, first = torch.get_num_threads(), None
        try:
            for n in (1, *[2] * 40, 1):  # a race needs both threads running at once: try a few times
                torch.set_num_threads(n)
                junk = [torch.full((1 << k,), float("nan")) for k in range(8, 24)]
                del junk  # freed NaN: the next allocations of these sizes reuse it
                run = (model(tokens, positions, attn), cache.k.clone(), cache.v.clone())
                first = first or run
                assert all(torch.equal(a, b) for a, b in zip(first, run)), f"a call on {n} threads differs"
        finally:
            torch.set_num_threads(threads)
    assert model.timings.sum() > 0 and first[0].isfinite().all()
