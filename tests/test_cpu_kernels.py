"""Chapter 05b: fused C++ kernels for the CPU.

Each kernel against the PyTorch code it replaces (chapter 00a's modules, F.silu): in bf16 equal but for a rare one-step
rounding, in fp32 within float rounding. The fused model against transformers (contract 1) and against the unfused model
(bf16: logits a few roundings apart, identical past FUSED_MAX_ROWS, where PyTorch's ops run; the tokens of each against
fp32's). `CpuAttention` against chapter 03's `PagedAttention` on scattered blocks: the same K/V written, the same output
to float rounding; `paged_decode` itself against SDPA over gathered keys. `LLM(kernels="cpu")` greedy tokens against
chapter 01's naive decode (contract 2).
"""
import collections
import pytest, torch
import torch.nn.functional as F
from hypothesis import given, example, settings, strategies as st

from minfer import cpu_kernels as ck
from minfer.cpu_kernels import (rms_norm, rope_, silu_mul, fuse_cpu_ops, CpuAttention, build_cpu_kernels, cpu_kernels,
                                can_fuse, FUSED_MAX_ROWS)
from minfer.model import RMSNorm, RotaryEmbedding, ModelConfig, NoCache, load_model
from minfer.paged import PagedKVCache, PagedAttention, BlockTable, build_batch_meta
from minfer.llm import LLM
from minfer.cpu_step import cpu_step_kernels
from minfer.sampling import SamplingParams
from lossy import assert_near_fp32

pytestmark = pytest.mark.skipif(not ck.cpu_kernels_available(), reason="no C++ compiler to build the CPU kernels")
DTYPES = [torch.float32, torch.bfloat16]

@pytest.fixture(scope="module")
def cfg(model_dir): return ModelConfig.from_folder(model_dir)

def bf16_close(a, b):
    """Equal in all but a few elements, and those a rounding step or two apart (a step moved in an intermediate result,
    like RMSNorm's before its weight multiply, can move the final rounding too)."""
    a, b = a.float(), b.float()
    return ((a - b).abs() <= b.abs() * 2**-6).all() and (a != b).float().mean() < 0.02

def same(dtype):
    """bf16: the kernels round where PyTorch rounds, but sum in another order, so a last-bit difference in fp32 now and
    then moves a bf16 rounding; fp32: float rounding (the compiler may fuse a multiply and an add)."""
    return bf16_close if dtype == torch.bfloat16 else fp32_close

def fp32_close(a, b):
    "Within a few fp32 roundings, relative to each value or, where terms cancel (RoPE's sum), to the largest one."
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())

@settings(max_examples=25, deadline=None)
@example(rows=39, dtype=torch.float32, scale=30.0, seed=1)  # found by CI: RoPE's sum cancels to near 0
@given(rows=st.integers(1, 40), dtype=st.sampled_from(DTYPES), scale=st.sampled_from([0.01, 1.0, 30.0]), seed=st.integers(0, 2**16))
def test_norm_and_rope_match_pytorch(rows, dtype, scale, seed):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: (torch.randn(*s, generator=g) * scale).to(dtype)
    x, res = rnd(rows, 576), rnd(rows, 576)
    norm = RMSNorm(576, 1e-5).to(dtype); norm.weight.data = (torch.rand(576, generator=g) + 0.5).to(dtype)
    assert same(dtype)(rms_norm(x, norm.weight, norm.eps), norm(x))
    x2 = x.clone(); out = rms_norm(x2, norm.weight, norm.eps, residual=res)
    assert torch.equal(x2, x + res) and same(dtype)(out, norm(x + res))
    rope = RotaryEmbedding(64, 100000.0, 4096)
    cos, sin = rope.tables(torch.randint(0, 4096, (rows,), generator=g), dtype)
    qkv = rnd(rows, 15, 64)
    want = torch.cat([RotaryEmbedding.rotate(qkv[:, :12], cos, sin), qkv[:, 12:]], 1)
    assert same(dtype)(rope_(qkv.clone(), cos, sin, 12), want)

@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_pytorch(dtype):
    gu = (torch.randn(7, 2 * 1536, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    g, u = gu.chunk(2, -1)
    got, want = silu_mul(gu).float(), (F.silu(g) * u).float()
    if dtype == torch.float32: assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    else: assert bf16_close(got, want)  # exp_fast and PyTorch's exp differ in their last fp32 bits

def test_bad_tensors_are_refused_with_one_line():
    x, w = torch.randn(4, 576), torch.randn(576)
    for call, word in [(lambda: rms_norm(x.t().contiguous().t(), w, 1e-5), "contiguous"),
                       (lambda: rms_norm(x, w.bfloat16(), 1e-5), "dtype"),
                       (lambda: rms_norm(x.half(), w.half(), 1e-5), "float16"),
                       (lambda: silu_mul(torch.randn(4, 3072)[:, ::2]), "contiguous"),
                       (lambda: rms_norm(x, w[:100], 1e-5), "weight"),  # shapes a raw pointer would overrun
                       (lambda: rope_(torch.randn(4, 15, 64), torch.randn(3, 1, 64), torch.randn(3, 1, 64), 12), "cos"),
                       (lambda: rope_(torch.randn(4, 15, 64), torch.randn(4, 1, 64), torch.randn(4, 1, 64), 16), "heads"),
                       (lambda: silu_mul(torch.randn(4, 3071)), "2 * I")]:
        with pytest.raises(ValueError) as e: call()
        assert "\n" not in str(e.value) and word in str(e.value)
    assert torch.allclose(rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5), rtol=1e-5, atol=1e-6)  # still usable

def test_fused_model_matches_transformers_fp32(model_dir, tokenizer):
    "Contract 1 holds for the fused model: within 1e-4 of transformers in fp32, on a 500+ token prompt."
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer.encode(" ".join(f"Item {i}: the quick brown fox jumps over the lazy dog while counting sheep." for i in range(40)))
    assert len(ids) >= 500
    fused = fuse_cpu_ops(load_model(model_dir))
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
        got = fused(torch.tensor(ids), torch.arange(len(ids)), NoCache())
    assert (got - ref).abs().max().item() <= 1e-4

@pytest.mark.parametrize("rows", [1, FUSED_MAX_ROWS, FUSED_MAX_ROWS + 1, 200], ids=["one", "at-limit", "past-limit", "prefill"])
def test_fused_model_bf16_matches_unfused(model_dir, tokenizer, rows):
    """The norm and RoPE kernels at every size, SiLU x up's up to FUSED_MAX_ROWS tokens (PyTorch's past it): the same
    bf16 logits within a few bf16 roundings of the largest. Tokens (contract 4): each model against fp32, not against
    the other (`lossy`): logits within E = 8 bf16 eps of the largest |logit|, logits minus that of fp32's top token
    within D = 5 (measured 2.3 and 2.3 on AMD EPYC, AVX-512; 2.7 and 2.4 on the AVX2 stand-in), so the argmax is fp32's
    where fp32's top-2 gap exceeds D: 1 of 1, 7 of 16, 7 of 17 and 174 of 200 rows; 1 or 2 of the others, near-ties,
    have another argmax in bf16."""
    ids = (tokenizer.encode("The three primary colours are red, yellow and blue. Mixing red and yellow gives") * 20)[:rows]
    plain, fused = load_model(model_dir, "bfloat16"), fuse_cpu_ops(load_model(model_dir, "bfloat16"))
    models = (plain, fused, load_model(model_dir))  # the last: fp32
    with torch.inference_mode(): a, b, ref = (m(torch.tensor(ids), torch.arange(len(ids)), NoCache()) for m in models)
    # a few bf16 roundings of the largest logit: written on an AVX2 EPYC (<= 0.25); on an AVX-512 Xeon PyTorch's bf16
    # ops round some intermediates differently (measured 0.47 at 16 rows, largest logit 30.75, i.e. 2 ulps)
    tol = 4 * torch.finfo(torch.bfloat16).eps * a.abs().max()
    assert (a - b).abs().max() <= tol, ((a - b).abs().max(), tol)
    for what, logits in (("unfused", a), ("fused", b)): assert_near_fp32(logits, ref, 8, 5, what)

def test_fuse_refuses_what_it_cannot_run(model_dir):
    with pytest.raises(ValueError, match="float32 or bfloat16"): fuse_cpu_ops(load_model(model_dir, "float16"))

def decode_step(cfg, cls, dtype, lens, bs, seed, keys=None, rope_buffer=False):
    """One decode step (each sequence's last token new) of sequences scattered over a shuffled pool: (output, pool k,
    pool v). keys: per sequence None or the positions its row attends to (`build_batch_meta`'s). rope_buffer: q and k
    read from a buffer of their own (where the layers' RoPE writes them), v from the qkv output: rows of k and v lie
    different distances apart."""
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-n // bs) for n in lens) + 3
    cache = PagedKVCache(cfg, nb, bs, dtype)
    cache.allocator.free_ids = collections.deque(torch.randperm(nb, generator=g).tolist())
    tables = [BlockTable(cache.allocator) for _ in lens]
    for t, n in zip(tables, lens): t.append_slots(n)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g)); cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    qkv = torch.randn(len(lens), nq + 2 * nkv, cfg.head_dim, generator=g).to(dtype)
    attn = cls(cache).bind(build_batch_meta([(t, n - 1, 1) for t, n in zip(tables, lens)], bs, keys=keys))
    qk = qkv[:, :nq + nkv].clone() if rope_buffer else qkv
    out = attn(5, qk[:, :nq], qk[:, nq:nq + nkv], qkv[:, nq + nkv:])
    return out, cache.k, cache.v

@pytest.mark.parametrize("lens,bs", [((1,), 16), ((300,), 16), ((1, 17, 40, 5), 4), (tuple(range(1, 60, 3)), 8)],
                         ids=["one-token", "one-long", "mixed", "batch-20"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_attention_matches_paged_attention(cfg, lens, bs, dtype):
    want, k_want, v_want = decode_step(cfg, PagedAttention, dtype, lens, bs, seed=len(lens))
    got, k_got, v_got = decode_step(cfg, CpuAttention, dtype, lens, bs, seed=len(lens))
    assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)  # the new K/V land in the same slots
    if dtype == torch.float32: assert torch.allclose(got, want, atol=2e-6), (got - want).abs().max()
    else:  # both within one bf16 rounding of the fp32 answer from the same bf16 inputs
        exact, _, _ = decode_step(cfg, PagedAttention, torch.float32, lens, bs, seed=len(lens))
        tol = exact.abs().amax(-1, keepdim=True) * 2**-7 + 0.02  # + the inputs' own bf16 rounding, drawn in fp32 above
        assert ((got.float() - exact).abs() <= tol).all() and ((got.float() - want.float()).abs() <= tol).all()

@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_attention_runs_k_and_v_of_different_row_strides(cfg, dtype, monkeypatch):
    """q and k from RoPE's buffer, v from the qkv projection (what a step wider than the one-call step's rows hands
    the layers' attention): the kernel runs them, without falling back to chapter 03's path, and writes and reads what
    chapter 03's attention does."""
    lens, bs = (1, 17, 40, 5, 23), 8
    want, k_want, v_want = decode_step(cfg, PagedAttention, dtype, lens, bs, seed=3, rope_buffer=True)

    def fell_back(*args, **kwargs):
        raise AssertionError("CpuAttention fell back to chapter 03's path")

    monkeypatch.setattr(PagedAttention, "__call__", fell_back)
    got, k_got, v_got = decode_step(cfg, CpuAttention, dtype, lens, bs, seed=3, rope_buffer=True)
    assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)
    monkeypatch.undo()
    exact, _, _ = decode_step(cfg, PagedAttention, torch.float32, lens, bs, seed=3, rope_buffer=True)
    tol = 2e-6 if dtype == torch.float32 else exact.abs().amax(-1, keepdim=True) * 2**-7 + 0.02  # as above
    assert ((got.float() - exact).abs() <= tol).all(), (got.float() - exact).abs().max()


def test_cpu_attention_reads_explicit_key_lists(cfg):
    """Rows with their own key lists (a token tree's nodes, chapter 10c: through one-slot blocks) beside rows that read
    their whole table: chapter 03's gather over the same lists is the reference."""
    lens, bs = (1, 17, 40, 5, 33), 4
    keys = [None, [0, 3, 4, 9, 16], list(range(0, 40, 3)) + [39], None, list(range(30)) + [32]]
    want, k_want, v_want = decode_step(cfg, PagedAttention, torch.float32, lens, bs, seed=7, keys=keys)
    got, k_got, v_got = decode_step(cfg, CpuAttention, torch.float32, lens, bs, seed=7, keys=keys)
    assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)
    assert torch.allclose(got, want, atol=2e-6), (got - want).abs().max()
    whole, _, _ = decode_step(cfg, PagedAttention, torch.float32, lens, bs, seed=7)
    assert (got[1] - whole[1]).abs().max() > 1e-3 and torch.equal(got[0], whole[0])  # the lists changed what was read

def paged_decode_call(lens, dtype, n_q, n_kv, d, bs, seed=0, table=None):
    """`paged_decode` (of the build `table`; None: this chapter's) called directly on sequences of `lens` keys (the
    last one new), blocks shuffled in a pool:
    (its output, fp32 reference). The reference: the pool after the same K/V write, in fp32, each sequence's keys
    gathered and handed to SDPA (query heads h * group .. read KV head h)."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = [-(-n // bs) for n in lens]
    k_pool, v_pool = (torch.randn(sum(n_blocks) + 2, bs, n_kv, d, generator=g).to(dtype) for _ in "kv")
    order = torch.randperm(len(k_pool), generator=g).int()
    tables = torch.zeros(len(lens), max(n_blocks), dtype=torch.int32)
    for r, (nb, start) in enumerate(zip(n_blocks, torch.tensor([0, *n_blocks]).cumsum(0).tolist())):
        tables[r, :nb] = order[start:start + nb]
    pos = torch.tensor(lens) - 1
    new_slots = tables[torch.arange(len(lens)), pos // bs].long() * bs + pos % bs
    qkv = (torch.randn(len(lens), n_q + 2 * n_kv, d, generator=g) * 2).to(dtype)  # * 2: peakier softmax
    q, k, v = qkv[:, :n_q], qkv[:, n_q:n_q + n_kv], qkv[:, n_q + n_kv:]
    keys, values = (p.float().flatten(0, 1).index_copy(0, new_slots, x.float()) for p, x in ((k_pool, k), (v_pool, v)))
    out, lens_t = torch.empty(len(lens), n_q, d, dtype=dtype), torch.tensor(lens, dtype=torch.int32)
    ck._kernel("paged_decode", out, k_pool, v_pool, table=table)(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_pool.data_ptr(),
        v_pool.data_ptr(), new_slots.data_ptr(), tables.data_ptr(), tables.shape[1],
        lens_t.data_ptr(), bs, out.data_ptr(), len(lens), n_q, n_kv, d, d ** -0.5)
    want = []
    for r, n in enumerate(lens):
        at = tables[r, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
        kr, vr = (x[at].transpose(0, 1).repeat_interleave(n_q // n_kv, 0) for x in (keys, values))
        want.append(F.scaled_dot_product_attention(q[r].float()[:, None], kr, vr)[:, 0])
    return out, torch.stack(want)

@pytest.mark.parametrize("build", ["one_thread", "openmp"])
@pytest.mark.parametrize("n_q,n_kv,d", [(9, 3, 64), (8, 2, 76), (4, 4, 16)], ids=["group3", "group4-tail", "mha"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_matches_sdpa(n_q, n_kv, d, dtype, build):
    """The kernel against SDPA over gathered keys, in fp32 from the same inputs: lengths around the kernel's key
    block (16 keys, 8 without AVX-512) and the pool's block (5: no divisor of 16), so blocks end mid-key-block and the
    running max is rescaled many times; head dims with and without a tail past the kernel's 16-wide chunks (76: past
    8-wide ones too). Both builds: this chapter's (one thread) and chapter 05c's (OpenMP on: the sequences and KV heads
    split over the threads; 3 x 12 sequences here)."""
    lens = (1, 5, 15, 16, 17, 31, 32, 33, 64, 97, 300, 517) * (3 if build == "openmp" else 1)
    table = cpu_step_kernels() if build == "openmp" else cpu_kernels()
    got, want = paged_decode_call(lens, dtype, n_q, n_kv, d, bs=5, seed=d, table=table)
    # fp32: a score of size up to ~20 is off by a few of its ulps (another summation order), a weight by that much
    # relatively (and exp's 3 ulp): ~1e-5 of the largest value. bf16: also the output's rounding, 2^-8 of |x|
    tol = 1e-5 * want.abs().max() + (want.abs() * 2**-8 if dtype == torch.bfloat16 else 0)
    assert ((got.float() - want).abs() <= tol).all(), (got.float() - want).abs().max()
    if dtype == torch.float32:  # the data is not degenerate: the rows' answers differ by far more than the tolerance
        assert (want - want.mean(0)).abs().max() > 0.1

def test_cpu_attention_calls_the_threaded_build_where_it_loads(cfg):
    "With chapter 05c loaded (and OpenMP sharing PyTorch's runtime), `CpuAttention` takes 05c's build of the kernel."
    assert CpuAttention(PagedKVCache(cfg, 4, 16, torch.float32)).kernels is cpu_step_kernels()

def mixed_step(cfg, cls, dtype, seqs, bs, seed):
    """One step of prompt chunks and one-row entries, (cached, new) tokens per sequence, over a shuffled pool:
    (output, pool k, pool v)."""
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-(c + n) // bs) for c, n in seqs) + 3
    cache = PagedKVCache(cfg, nb, bs, dtype)
    cache.allocator.free_ids = collections.deque(torch.randperm(nb, generator=g).tolist())
    tables = [BlockTable(cache.allocator) for _ in seqs]
    for t, (c, n) in zip(tables, seqs): t.append_slots(c + n)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g)); cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    qkv = torch.randn(sum(n for _, n in seqs), nq + 2 * nkv, cfg.head_dim, generator=g).to(dtype)
    attn = cls(cache).bind(build_batch_meta([(t, c, n) for t, (c, n) in zip(tables, seqs)], bs))
    out = attn(3, qkv[:, :nq], qkv[:, nq:nq + nkv], qkv[:, nq + nkv:])
    return out, cache.k, cache.v

@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_attention_mixed_step_matches_paged_attention(cfg, dtype, monkeypatch):
    """A step with prompt chunks: the chunks' rows exactly as chapter 03 computes them, the one-row entries through
    the kernel (03's gathers are never called) within the decode test's bounds, every new K/V in its slot."""
    seqs, bs = [(0, 20), (5, 1), (40, 1), (33, 7), (0, 1), (17, 1)], 8
    chunk_rows = torch.cat([torch.arange(0, 20), torch.arange(22, 29)])
    one_rows = torch.tensor([20, 21, 29, 30])
    want, k_want, v_want = mixed_step(cfg, PagedAttention, dtype, seqs, bs, seed=3)
    def gathered(*args, **kwargs):
        raise AssertionError("the one-row entries went through chapter 03's gathers")
    monkeypatch.setattr(PagedAttention, "attention", gathered)
    got, k_got, v_got = mixed_step(cfg, CpuAttention, dtype, seqs, bs, seed=3)
    assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)
    assert torch.equal(got[chunk_rows], want[chunk_rows])
    got, want = got[one_rows], want[one_rows]
    if dtype == torch.float32: assert torch.allclose(got, want, atol=2e-6), (got - want).abs().max()
    else:  # both within one bf16 rounding of the fp32 answer from the same bf16 inputs
        monkeypatch.undo()
        exact = mixed_step(cfg, PagedAttention, torch.float32, seqs, bs, seed=3)[0][one_rows]
        tol = exact.abs().amax(-1, keepdim=True) * 2**-7 + 0.02
        assert ((got.float() - exact).abs() <= tol).all() and ((got.float() - want.float()).abs() <= tol).all()

def test_llm_cpu_kernels_equal_naive(model_dir, model, tokenizer):
    "Contract 2: LLM with the fused kernels (fp32; batched and alone) gives chapter 01's greedy tokens, or parts at a near-tie."
    from minfer.naive import naive_generate
    from test_engine import TEXTS, near_tie_at
    llm = LLM(model_dir, kernels="cpu")
    assert llm.kernels == "cpu" and isinstance(llm.engine.attn, CpuAttention)
    outs = llm.generate(TEXTS[:4], SamplingParams(max_tokens=8, ignore_eos=True), raw=True)
    for t, o in zip(TEXTS, outs):
        want = naive_generate(model, tokenizer.encode(t), 8)
        assert o.token_ids == want or near_tie_at(model, tokenizer.encode(t), o.token_ids, want)

def test_kernels_switch_defaults_and_errors(model_dir, monkeypatch, tmp_path):
    # "auto" is chapter 05c's one-call step where it builds (over plain or packed weights); with kv='contiguous', 05b's
    assert LLM(model_dir).kernels == "step" and LLM(model_dir, weights="packed").kernels == "step"
    assert LLM(model_dir, kv="contiguous").kernels == "cpu" and LLM(model_dir, kernels="torch").kernels == "torch"
    assert type(LLM(model_dir, kernels="torch").engine.attn) is PagedAttention
    with pytest.raises(ValueError) as e: LLM(model_dir, kernels="cpu", dtype="float16")
    assert "\n" not in str(e.value) and "kernels='cpu'" in str(e.value) and "use kernels='torch'" in str(e.value)
    # no compiler: "auto" falls back to PyTorch's ops, an explicit "cpu" says why it cannot
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MINFER_HOME", str(tmp_path))  # nothing built there either
    cpu_kernels.cache_clear(); cpu_step_kernels.cache_clear()
    try:
        assert not can_fuse("float32", "cpu") and LLM(model_dir).kernels == "torch"
        with pytest.raises(ValueError, match="no C.. compiler is on PATH"): LLM(model_dir, kernels="cpu")
    finally:
        monkeypatch.undo(); cpu_kernels.cache_clear(); cpu_step_kernels.cache_clear()
    assert can_fuse("float32", "cpu")

def test_build_is_cached_and_reports_compile_errors(tmp_path):
    src = 'extern "C" int answer() { return 42; }\n'
    first = build_cpu_kernels(src, tmp_path)
    mtime = first.stat().st_mtime_ns
    assert build_cpu_kernels(src, tmp_path) == first and first.stat().st_mtime_ns == mtime  # found, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left behind
    with pytest.raises(RuntimeError) as e: build_cpu_kernels("this is not C++", tmp_path)
    assert "\n" not in str(e.value) and "failed" in str(e.value)
