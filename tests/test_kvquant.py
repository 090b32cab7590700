"""Chapter 09: KV-cache quantization (kv_dtype="int8" / "fp8"); chapter 09a's int4 is tests/test_kivi.py.

Lossy, so never compared with its own earlier output: the formats' round trips against their definitions (int8: half
a step of amax/127; fp8 e4m3: 3 mantissa bits), the pool's bytes (scales counted) against arithmetic, block moves
(copy-on-write, transfers) carrying the scales, the config's refusals, and quality on held-out text against the model's
own dtype within the chapter's measured table. Paged attention over a quantized pool against `attend` on dequantized
K/V is in tests/test_paged_radix.py, and the engine's scheduling properties with each format in tests/test_engine.py.
Triton: chapter 05a's decode kernel with this chapter's tile loader (int8 / fp8) against attend on dequantized K/V
(Triton's interpreter on a CPU, compiled on a GPU), and `attention="triton"` against chapter 03's PagedAttention on
pools filled the same way (`backends_on_the_same_steps`, which tests/test_kivi.py runs on an int4 pool too).
"""
import os
from types import SimpleNamespace
import pytest, torch
if not torch.cuda.is_available(): os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from minfer.paged import KV_FORMATS, KV_READERS, attention_backend, kv_cache_from_budget, kv_token_bytes
from minfer.kvquant import QuantizedKVCache, kv_quality, key_rotation, KVFormat
from minfer.paged import PagedKVCache, PagedAttention, BlockTable, build_batch_meta
from minfer.model import attend
from minfer.engine import EngineConfig

CFG = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=3, head_dim=64)


def sample(n=200, seed=0):
    "Key-like vectors: mostly N(0, 1), some channels 20x larger (the outliers real keys have), one all-zero vector."
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, CFG.num_key_value_heads, CFG.head_dim, generator=g)
    x[:, :, 5] *= 20
    x[7] = 0
    return x


def test_int8_round_trip_is_within_half_a_step():
    x = sample()
    codes, scales = KV_FORMATS["int8"].quantize(x)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert codes.dtype == torch.int8 and scales.shape == x.shape[:-1]
    err = (KV_FORMATS["int8"].dequantize(codes, scales) - x).abs()
    assert (err <= step / 2 + 1e-6).all()
    assert codes.abs().amax(-1)[x.abs().amax(-1) > 0].eq(127).all()  # the largest element uses the full range
    assert torch.equal(KV_FORMATS["int8"].dequantize(codes, scales)[7], x[7])  # zeros stay zeros, no NaN


def test_fp8_round_trip_keeps_three_mantissa_bits():
    x = sample()
    codes, scales = KV_FORMATS["fp8"].quantize(x)
    assert codes.dtype == torch.float8_e4m3fn
    scale = scales[..., None]
    err = (KV_FORMATS["fp8"].dequantize(codes, scales) - x).abs()
    # e4m3: relative rounding error <= 2^-4 for normal numbers; below 2^-6 (subnormal) the spacing is 2^-9 (of the scale)
    assert (err <= torch.maximum(x.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)).all()
    assert torch.isfinite(KV_FORMATS["fp8"].dequantize(codes, scales)).all()


@pytest.mark.parametrize("d", [64, 96])
def test_key_rotation_is_orthogonal(d):
    "Hadamard where head_dim is a power of two (entries +-1/sqrt(d)), a random orthogonal matrix otherwise."
    R = key_rotation(d)
    assert torch.allclose(R @ R.T, torch.eye(d), atol=1e-5)
    if d == 64: assert torch.allclose(R.abs(), torch.full((d, d), d ** -0.5))


def test_fp8_pool_stores_keys_turned_and_reads_them_back():
    """The fp8 pool holds each key times key_rotation (its codes are the format's codes of k R, not of k) and hands
    attention k back: (codes * scale) R^T, within fp8's error of the key. Values are stored as they are."""
    k, v = sample(seed=1), sample(seed=2)
    cache = QuantizedKVCache(CFG, 50, 4, kv_dtype="fp8")
    cache.store(0, torch.arange(len(k)), k, v)
    R = key_rotation(CFG.head_dim)
    codes, _ = KV_FORMATS["fp8"].quantize(k @ R)
    assert torch.equal(cache.k[0].flatten(0, 1)[:len(k)].float(), codes.float())
    keys, values = (x.view(-1, CFG.num_key_value_heads, CFG.head_dim)[:len(k)] for x in cache.layer(0))
    assert torch.allclose(keys, k, atol=2**-4 * (k @ R).abs().amax().item())
    assert torch.equal(values, dequantized(v, "fp8"))


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_block_bytes_count_the_scales_and_the_pool_holds_more(kv_dtype):
    per_block = QuantizedKVCache.block_bytes(CFG, 16, kv_dtype=kv_dtype)
    assert per_block == 16 * 2 * 2 * 3 * (64 * 1 + 4)  # tokens x (K, V) x layers x heads x (codes + one fp32 scale)
    budget = 10 * 2**20
    cache = kv_cache_from_budget(CFG, budget, 16, torch.bfloat16, kv_format=kv_dtype)
    assert cache.num_blocks == budget // per_block and cache.nbytes == cache.num_blocks * per_block
    bf16 = PagedKVCache.from_budget(CFG, budget, 16, torch.bfloat16)
    assert cache.num_blocks >= 1.8 * bf16.num_blocks  # the target: 1.88x here (2 * 64 / 68)
    assert kv_token_bytes(CFG, kv_dtype) * 16 == per_block and kv_token_bytes(CFG, "bfloat16") == 2 * 2 * 3 * 64 * 2


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_copy_on_write_and_transfers_move_codes_and_scales(kv_dtype):
    a = QuantizedKVCache(CFG, 4, 4, kv_dtype=kv_dtype)
    k, v = sample(8, 1), sample(8, 2)
    for layer in range(2): a.store(layer, torch.arange(8), k * (layer + 1), v)  # blocks 0 and 1
    read = lambda c, layer, block: [x.view(-1, 3, 64)[block * 4:block * 4 + 4] for x in c.layer(layer)]
    a.copy_blocks([(1, 3)])
    for layer in range(2):
        for x, y in zip(read(a, layer, 1), read(a, layer, 3)): assert torch.equal(x, y)
    b = QuantizedKVCache(CFG, 2, 4, kv_dtype=kv_dtype)
    b.write_blocks([1, 0], a.read_blocks([0, 1]))
    for layer in range(2):
        for x, y in zip(read(a, layer, 0), read(b, layer, 1)): assert torch.equal(x, y)
        # the reads are the round trip of what was stored (the scales came along; fp8's keys turned and back)
        R = key_rotation(64) if KV_FORMATS[kv_dtype].rotate_keys else torch.eye(64)
        assert torch.allclose(read(b, layer, 0)[0], dequantized(k[4:] * (layer + 1) @ R, kv_dtype) @ R.T, atol=1e-6)


@pytest.mark.parametrize("switches, message", [
    (dict(kv_dtype="fp8", kernels="step"), "reads K/V in the model's dtype or kv_dtype='int8', not kv_dtype='fp8'"),
    (dict(kv_dtype="fp8", attention="cpu"), "attention='cpu' does not read kv_dtype='fp8'"),
    (dict(kv_dtype="fp8", kv="contiguous", kernels="cpu"), "needs kv='paged'"),
    (dict(kv_dtype="float16", dtype="float32"), "stored in the model's dtype"),
    (dict(kv_dtype="int3"), "kv_dtype='int3' is not supported"),
])
def test_combinations_a_backend_cannot_run_are_refused_in_one_line(model_dir, switches, message):
    with pytest.raises(ValueError, match=message) as e: EngineConfig(model_dir, **switches).resolve()
    assert "\n" not in str(e.value)


def test_auto_picks_what_reads_the_format(model_dir):
    from minfer.cpu_kernels import cpu_kernels_available
    from minfer.cpu_step import cpu_step_available
    c = EngineConfig(model_dir, kv_dtype="int8", device="cpu").resolve()
    assert (c.kv_dtype, c.attention) == ("int8", "cpu" if cpu_kernels_available() else "torch")
    assert (c.kernels == "step") == cpu_step_available()  # the one-call step reads an int8 pool
    c = EngineConfig(model_dir, kv_dtype="fp8", device="cpu").resolve()
    assert (c.kv_dtype, c.attention) == ("fp8", "torch") and c.kernels != "step"


def test_engine_runs_int8_and_its_bytes_per_token_count_the_smaller_kv(model_dir):
    from minfer.llm import LLM
    from minfer.sequence import SamplingParams
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    outs = {kv: LLM(model_dir, kv_dtype=kv, kernels="cpu", attention="torch").generate("Paris is", sp, raw=True)[0]
            for kv in ("auto", "int8")}
    assert len(outs["int8"].samples[0].token_ids) == 4
    b = {kv: o.samples[0].metrics["bytes_per_token"] for kv, o in outs.items()}
    assert b["int8"] < b["auto"]


@pytest.fixture(scope="module")
def quality(model, tokenizer):
    from minfer.naive import text_path
    ids = tokenizer.encode(text_path("evaluation.txt").read_text())[:256]
    return kv_quality(model, ids, ["int8", "fp8"], chunk=32)


def test_quality_on_held_out_text_within_the_measured_table(quality):
    """256 tokens of data/text/evaluation.txt in chunks of 32 (later chunks read stored, quantized KV). The chapter's
    table (1,024 tokens) measured int8 -0.13% perplexity, fp8 (keys rotated) +0.19%; on these 256 tokens +0.0% and
    +0.48%. Bounds: the targets, int8 0.5%, fp8 1.5%."""
    assert abs(quality["int8"]["ppl_change_pct"]) < 0.5 and quality["int8"]["kl_mean"] < 0.002
    assert abs(quality["fp8"]["ppl_change_pct"]) < 1.5 and quality["fp8"]["kl_mean"] < 0.01
    assert quality["int8"]["same_top1"] > 0.97 and quality["fp8"]["same_top1"] > 0.93
    assert quality["int8"]["kl_mean"] < quality["fp8"]["kl_mean"]  # 8 bits of mantissa-like steps beat 3


@pytest.mark.parametrize("text", ["evaluation.txt", "course.txt"])
def test_fp8_within_its_bound_on_two_texts_and_rotation_pays(model, tokenizer, quality, text, monkeypatch):
    """fp8 within 1.5% of full precision's perplexity on two different texts (256 tokens each; measured +0.48% and
    -1.11%; on 1,024 tokens +0.19% and +0.25%), and its KL to full precision below 0.9 of the same format with keys
    not rotated (measured 0.78 and 0.80 of it here; 0.64 and 0.70 on 1,024 tokens)."""
    from minfer.naive import text_path
    monkeypatch.setitem(KV_FORMATS, "fp8_plain", KVFormat("fp8_plain", torch.float8_e4m3fn, 448.0))
    monkeypatch.setitem(KV_READERS, ("torch", "fp8_plain"), PagedAttention)
    ids = tokenizer.encode(text_path(text).read_text())[:256]
    q = kv_quality(model, ids, ["fp8_plain"] + ([] if text == "evaluation.txt" else ["fp8"]))
    fp8 = quality["fp8"] if text == "evaluation.txt" else q["fp8"]
    assert abs(fp8["ppl_change_pct"]) < 1.5, fp8
    assert fp8["kl_mean"] < 0.9 * q["fp8_plain"]["kl_mean"], (fp8, q["fp8_plain"])


def dequantized(x, kv_dtype="int8"): return KV_FORMATS[kv_dtype].dequantize(*KV_FORMATS[kv_dtype].quantize(x))


def triton_int8_decode_case(dtype, device, lens, H=2, Hq=6, D=16, bs=4, num_splits=None, seed=0, kv_dtype="int8"):
    """Random int8 (or fp8) pool (NaN scales where nothing was stored), one decode token per sequence: chapter 05a's
    Triton kernel with this chapter's loader (through the backend `attention="triton"`, or `decode_attention_8bit` with
    `num_splits`) vs attend on K/V quantized and dequantized by the format's own PyTorch functions."""
    from minfer.kvquant import decode_attention_8bit
    from minfer.paged import KV_READERS
    from minfer.model import attend
    g = torch.Generator().manual_seed(seed)
    cfg = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=H, head_dim=D)
    nblocks = sum(-(-n // bs) for n in lens) + 2
    cache = QuantizedKVCache(cfg, nblocks, bs, dtype=dtype, device=device, kv_dtype=kv_dtype)
    cache.k_scale.fill_(float("nan")); cache.v_scale.fill_(float("nan"))
    ids = torch.randperm(nblocks, generator=g).tolist()
    tables, ks, vs = [], [], []
    for n in lens:
        nb = -(-n // bs); tables.append(ids[:nb]); ids = ids[nb:]
        k, v = torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)
        slots = torch.tensor([tables[-1][p // bs] * bs + p % bs for p in range(n)], device=device)
        cache.store(0, slots, k.to(device), v.to(device)); ks.append(k); vs.append(v)
    q = torch.randn(len(lens), Hq, D, generator=g)
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    kc, vc = cache.layer(0)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    if num_splits is None:  # through the backend's decode path, which turns q where keys are stored rotated (fp8)
        meta = SimpleNamespace(max_seqlen_q=1, seq_lens=seq_lens, block_tables=bt)
        out = KV_READERS[("triton", kv_dtype)](None).attention(q.to(device, dtype), kc, vc, meta)
    else:
        out = decode_attention_8bit(q.to(device, dtype), kc, vc, bt, seq_lens, num_splits=num_splits)
    # the reference: the format's own PyTorch quantize/dequantize, keys turned by key_rotation and back for fp8
    R = key_rotation(D) if KV_FORMATS[kv_dtype].rotate_keys else torch.eye(D)
    ref = torch.cat([attend(q[i:i + 1], dequantized(ks[i] @ R, kv_dtype) @ R.T, dequantized(vs[i], kv_dtype))
                     for i in range(len(lens))])
    return out.float().cpu(), ref


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 1e-2)])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_triton_decode_reads_int8_tile_by_tile(dtype, tol, num_splits, kv_dtype):
    """Chapter 05a's decode kernel with the 8-bit loader (interpreter on a CPU: fp32/fp16, small shapes) == dequantized;
    the 70-token sequence's splits hold two key tiles each by default (the online softmax rescales)."""
    if torch.cuda.is_available(): pytest.skip("the compiled version is test_triton_int8_decode_compiled")
    out, ref = triton_int8_decode_case(dtype, "cpu", [11, 1, 29, 6, 70], num_splits=num_splits, kv_dtype=kv_dtype)
    assert torch.allclose(out, ref, atol=tol), (out - ref).abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-2), (torch.float16, 1e-2), (torch.bfloat16, 3e-2)])
def test_triton_int8_decode_compiled(dtype, tol, kv_dtype):
    if kv_dtype == "fp8" and torch.cuda.get_device_capability() < (8, 9): pytest.skip("fp8 conversions need sm_89+")
    out, ref = triton_int8_decode_case(dtype, "cuda", [517, 1, 2048, 33, 300], H=8, Hq=32, D=128, bs=16,
                                       kv_dtype=kv_dtype)
    assert torch.allclose(out, ref, atol=tol), (out - ref).abs().max()


def test_plain_triton_decode_refuses_codes():
    "Chapter 05a's `decode_attention` reads K/V in the query's dtype: int8 codes without their scales are refused."
    from minfer.flash import decode_attention
    cache = QuantizedKVCache(CFG, 2, 4, kv_dtype="int8")
    with pytest.raises(ValueError, match="dtypes differ"):
        decode_attention(torch.zeros(1, 3, 64), cache.k[0], cache.v[0], torch.zeros(1, 1, dtype=torch.int32),
                         torch.ones(1, dtype=torch.int32))


@pytest.mark.parametrize("fused_rows", [False, True], ids=["separate", "qkv-rows"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cpu_kernel_reads_int8(dtype, tol, fused_rows):
    """Chapter 09's C++ decode over an int8 pool (`paged_decode_q8`) == chapter 03's reference on the same pool; also
    with q, k, v as strided views of one qkv row each, as the fused attention module passes them to several rows."""
    from minfer.cpu_kernels import cpu_kernels_available
    from minfer.kvquant import QuantizedCpuAttention
    from minfer.paged import PagedAttention, build_batch_meta
    if not cpu_kernels_available(): pytest.skip("no C++ compiler")
    g = torch.Generator().manual_seed(0)
    cache = QuantizedKVCache(CFG, 40, 16, dtype=dtype, kv_dtype="int8")
    cache.k_scale.fill_(float("nan")); cache.v_scale.fill_(float("nan"))  # never written: must never be read
    tables, lens = [[5, 2, 7], [0, 3, 9, 11, 12], [4]], [41, 70, 3]
    for t, n in zip(tables, lens):
        slots = torch.tensor([t[p // 16] * 16 + p % 16 for p in range(n - 1)])
        cache.store(1, slots, torch.randn(n - 1, 3, 64, generator=g), torch.randn(n - 1, 3, 64, generator=g))
    q, k, v = (torch.randn(3, h, 64, generator=g).to(dtype) for h in (9, 3, 3))
    if fused_rows: q, k, v = torch.cat([q, k, v], 1).split([9, 3, 3], 1)  # q: not contiguous
    outs = []
    # the kernel's call stores the new K/V too; the reference writes them again
    for cls in (QuantizedCpuAttention, PagedAttention):
        a = cls(cache).bind(build_batch_meta([(t, n - 1, 1) for t, n in zip(tables, lens)], 16))
        outs.append(a(1, q, k, v).float())
    assert torch.isfinite(outs[0]).all() and torch.allclose(*outs, atol=tol), (outs[0] - outs[1]).abs().max()


TRITON_STEPS = [[(0, 0, 9)], [(0, 9, 1), (1, 0, 6)], [(0, 10, 1), (1, 6, 1)]]  # (sequence, tokens before, new tokens)


def backends_on_the_same_steps(make_cache):
    """Chapter 03's PagedAttention (`attention="torch"`) and `attention="triton"`, each on its own pool
    `make_cache(cfg)` (8 blocks of 4 tokens) filled the same way: a prefill, a mixed step (a decode row beside a
    prefill chunk: chapter 03's path) and a decode step (chapter 05a's kernel with a format's loader), fp32.
    -> {backend: [output of each of TRITON_STEPS]}."""
    cfg = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=2, head_dim=16)
    g = torch.Generator().manual_seed(0)
    data = [[torch.randn(n, h, 16, generator=g) for h in (6, 2, 2)] for step in TRITON_STEPS for _, _, n in step]
    outs = {}
    for backend in ("torch", "triton"):
        cache = make_cache(cfg)
        cache.allocator.allocate(8)
        tables = [BlockTable(cache.allocator, blocks, 0, share=False) for blocks in ([5, 2, 7], [0, 3])]
        attn, rows, outs[backend] = attention_backend(backend, cache), iter(data), []
        for step in TRITON_STEPS:
            for j, _, n in step:
                tables[j].append_slots(n)
            attn = attn.bind(build_batch_meta([(tables[j], start, n) for j, start, n in step], 4))
            q, k, v = (torch.cat(x) for x in zip(*[next(rows) for _ in step]))
            outs[backend].append(attn(0, q, k, v))
    return outs


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_triton_backend_reads_quantized_pools_like_the_reference(kv_dtype):
    """`attention="triton"` (this chapter's `QuantizedTritonAttention` in chapter 03's registry) == chapter 03's
    PagedAttention, each on its own pool filled the same way (`backends_on_the_same_steps`)."""
    if torch.cuda.is_available(): pytest.skip("runs in Triton's interpreter (fp32, small shapes)")
    from minfer.kvquant import QuantizedTritonAttention

    assert issubclass(KV_READERS[("triton", kv_dtype)], QuantizedTritonAttention)
    outs = backends_on_the_same_steps(lambda cfg: QuantizedKVCache(cfg, 8, 4, kv_dtype=kv_dtype))
    for step, ref, out in zip(TRITON_STEPS, outs["torch"], outs["triton"]):
        assert (out - ref).abs().max() < 1e-5, (step, (out - ref).abs().max())


# ---- chapter 05c's one-call step over an int8 pool (`STEP_POOLS["int8"]`, `Int8Pool`, `decode_step*_kv8`) ----

def decode_over(model, cache, backend, prompts, feed):
    """Prefill `prompts` (token ids) one at a time into `cache` through attention class `backend`, then one decode step
    of all of them together per row of `feed` [steps, batch] (the tokens fed: the same for every model compared).
    -> logits [steps, batch, vocab]"""
    tables, out = [], []
    with torch.inference_mode():
        for ids in prompts:
            t = BlockTable(cache.allocator)
            t.append_slots(len(ids))
            tables.append(t)
            a = backend(cache).bind(build_batch_meta([(t, 0, len(ids))], cache.block_size))
            model(torch.tensor(ids), torch.arange(len(ids)), a, logits_rows=torch.tensor([len(ids) - 1]))
        for tokens in feed:
            for t in tables: t.append_slots(1)
            a = backend(cache).bind(build_batch_meta([(t, t.num_tokens - 1, 1) for t in tables], cache.block_size))
            out.append(model(tokens, torch.tensor([t.num_tokens - 1 for t in tables]), a))
    return torch.stack(out).float()


STEP_PROMPTS = ["The capital of France is", "def fibonacci(n):",
                " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(12))]


@pytest.fixture(scope="module")
def rtn_folder(tmp_path_factory, model_dir):
    "The default model in chapter 08's 4-bit weights (round-to-nearest, groups of 64: seconds, no search)."
    from minfer.awq import quantize_folder
    return quantize_folder(model_dir, tmp_path_factory.mktemp("rtn") / "rtn-g64", method="rtn", group_size=64)


@pytest.mark.parametrize("weights, drift_bound", [("plain", 2**-4), ("awq-int4", 2**-2)])
def test_one_call_step_reads_an_int8_pool_like_the_dequantized_reference(weights, drift_bound, model_dir, tokenizer,
                                                                          request, monkeypatch):
    """The one-call step over an int8 pool (the call quantizes each layer's new K/V itself, then reads codes and
    scales), with plain weights and with chapter 08's 4-bit ones, against the same model's modules (fp32) over their own
    int8 pool read by chapter 03's attention, which dequantizes the rows it gathers; both fed the same tokens.
    Both store the same format and start from the same numbers, differing by summation order (about 1e-6 relative). So
    in layer 0 the call writes `KVFormat.quantize`'s codes and scales: scales within 1e-5, codes equal but where that
    noise carried a value across a rounding boundary (one step, rare). Once a code flips, every later layer sees a value
    one step (amax/127 of its vector) away and passes the difference up, as int8's own rounding does: each vector within
    `drift_bound` of its length in every layer (measured 0.021 with plain weights, 0.037 on the AVX2 stand-in; 0.091
    and 0.108 with 4-bit ones, whose products round their inputs to 8 bits, so a difference crosses more boundaries).
    The logits: flips move a few elements by one step where int8's
    rounding moves every element by up to half a step, so the step is no further from the reference than the reference
    is from fp32 K/V, plus what the step and the modules differ by over fp32 K/V (measured, plain weights: 0.15 against
    0.53 + 0.0001, AVX2 stand-in 0.22; 4-bit weights, whose 8-bit inputs round again wherever a difference reaches
    them: 1.32 against 1.28 + 0.66, AVX2 stand-in 1.30 against 1.28 + 0.76)."""
    import minfer.cpu_step as cpu_step
    from minfer.cpu_kernels import fuse_cpu_ops
    from minfer.model import load_model
    from minfer.awq import load_awq_model
    from minfer.kvquant import QuantizedCpuAttention
    if not cpu_step.cpu_step_available(): pytest.skip("no C++ compiler with OpenMP to build the step kernels")
    if weights == "plain":
        load = lambda: fuse_cpu_ops(load_model(model_dir, "float32"))
    else:
        load = lambda: fuse_cpu_ops(load_awq_model(request.getfixturevalue("rtn_folder"), "float32"))
    step, modules = cpu_step.fuse_decode_step(load()), load()
    calls, call = [], cpu_step.step_call
    monkeypatch.setattr(cpu_step, "step_call", lambda kernel, *a, **kw: calls.append(kernel[0]) or call(kernel, *a, **kw))
    prompts = [tokenizer.encode(t) for t in STEP_PROMPTS]
    feed = torch.tensor(tokenizer.encode(" is a small town in the north of the country"))[:, None].expand(-1, 3)
    pool = lambda: QuantizedKVCache(modules.cfg, 24, 16, torch.float32, kv_dtype="int8")
    step_pool, ref_pool = pool(), pool()
    got = decode_over(step, step_pool, QuantizedCpuAttention, prompts, feed)
    assert calls == [f"{step.step_kernel[0]}_kv8"] * len(feed)  # every decode step one call; prefills: the modules
    want = decode_over(modules, ref_pool, PagedAttention, prompts, feed)
    fp32 = decode_over(modules, PagedKVCache(modules.cfg, 24, 16, torch.float32), PagedAttention, prompts, feed)
    for codes, scales, ref_codes, ref_scales in ((step_pool.k, step_pool.k_scale, ref_pool.k, ref_pool.k_scale),
                                                 (step_pool.v, step_pool.v_scale, ref_pool.v, ref_pool.v_scale)):
        off = (codes[0].int() - ref_codes[0].int()).abs()  # layer 0: the quantizer itself
        assert off.max() <= 1 and off.bool().float().mean() < 1e-3, (off.max(), off.bool().float().mean())
        assert torch.allclose(scales[0], ref_scales[0], rtol=1e-5, atol=0), ((scales[0] - ref_scales[0]) / ref_scales[0]).abs().max()
        values, ref = codes.float() * scales[..., None], ref_codes.float() * ref_scales[..., None]
        drift = ((values - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max().item()
        assert drift <= drift_bound, drift
    # what the step and the modules already differ by over fp32 K/V (4-bit weights: their 8-bit inputs' roundings)
    from minfer.cpu_kernels import CpuAttention
    apart = (decode_over(step, PagedKVCache(modules.cfg, 24, 16, torch.float32), CpuAttention, prompts, feed) - fp32)
    err, int8_effect, apart = (got - want).abs().max().item(), (want - fp32).abs().max().item(), apart.abs().max().item()
    print(f"{weights}: logits {err:.3f} from the reference, which is {int8_effect:.3f} from fp32 K/V; the step "
          f"{apart:.3f} from the modules over fp32 K/V; drift {drift:.3f}")
    assert err <= int8_effect + apart, (err, int8_effect, apart)


def test_the_int8_step_has_a_twin_of_every_weight_formats_step():
    "Each weight format's step kernel (05c, 08a, 08c) is built again over an int8 pool; fp8 has no step reader."
    from minfer.cpu_step import STEP_POOLS, cpu_step_available
    from minfer.kvquant import KV8_STEPS, _step_refuses_format
    if not cpu_step_available(): pytest.skip("no C++ compiler with OpenMP to build the step kernels")
    cache = QuantizedKVCache(CFG, 2, 4, kv_dtype="int8")
    for name in KV8_STEPS:
        kernel, table = STEP_POOLS["int8"].kernel((name, None), cache, torch.float32)
        assert kernel == f"{name}_kv8" and (kernel, torch.float32) in table and (kernel, torch.bfloat16) in table
    assert STEP_POOLS["int8"].kernel(("a_step_built_nowhere", None), cache, torch.float32) is None
    assert "fp8" not in STEP_POOLS
    assert "not kv_dtype='fp8'" in _step_refuses_format(SimpleNamespace(kernels="step", kv_dtype="fp8"))


def test_llm_with_int8_kv_runs_the_one_call_step_with_the_references_tokens(model_dir, model, tokenizer):
    """`LLM(model, kv_dtype="int8")` with its default kernels runs the one-call step (its clock moves), and both it and
    chapter 09's per-layer path (kernels='cpu') give the greedy tokens of the fp32 reference (the model over an int8
    pool read by chapter 03's attention, `kv_logprobs`), on prompts where that reference has no near-tie: every top-2
    gap above test_engine's int8 bound (what a code flip moved a gap by)."""
    from minfer.llm import LLM
    from minfer.sequence import SamplingParams
    from minfer.kvquant import kv_logprobs
    from minfer.cpu_step import StepLlama, cpu_step_available
    from test_engine import NEAR_TIE
    if not cpu_step_available(): pytest.skip("no C++ compiler with OpenMP to build the step kernels")
    n, texts = 10, STEP_PROMPTS[:2]
    want = {}
    for t in texts:
        ids, out = tokenizer.encode(t), []
        for _ in range(n):
            logprobs = kv_logprobs(model, ids + out + [0], "int8", len(ids) + len(out) + 1)[-1]
            top2 = logprobs.topk(2).values
            assert top2[0] - top2[1] > NEAR_TIE["int8"], (t, out)  # the prompts are chosen so
            out.append(int(logprobs.argmax()))
        want[t] = out
    p = SamplingParams(max_tokens=n, ignore_eos=True)
    step = LLM(model_dir, kv_dtype="int8")
    assert (step.kernels, step.attention) == ("step", "cpu") and isinstance(step.model, StepLlama)
    step.model.timings = clock = torch.zeros(5, dtype=torch.float64)
    per_layer = LLM(model_dir, kv_dtype="int8", kernels="cpu")
    for llm in (step, per_layer):
        for t, o in zip(texts, llm.generate(texts, p, raw=True)):
            assert o.token_ids == want[t], (llm.kernels, t, o.token_ids, want[t])
    assert clock.sum() > 0  # the int8 pool's decode steps were one call each
