"""Chapter 05a's Triton attention kernels against PyTorch's SDPA (`minfer.model.attend`), one sequence at a time.

Without CUDA the kernels run in Triton's interpreter: TRITON_INTERPRET=1 is set below, before anything imports
triton, and only fp32/fp16 are tested (the interpreter computes bf16 wrongly). With CUDA the same tests run compiled,
plus the `gpu`-marked ones (longer sequences, head dim 128, bf16).

Every batch comes from `random_paged_batch`: each sequence's K/V scattered over shuffled cache blocks, every slot that
belongs to no sequence (block 0, which table padding points to, and the tail of each last block) filled with NaN, so a
kernel that reads past seq_len fails the test. The reference uses each sequence's own contiguous K/V, in fp32.

Tolerances (max abs error vs the fp32 reference; outputs are O(1)): fp32 1e-5, fp16 3e-3, bf16 2e-2.
"""
import os
import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA: os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (minfer.flash does it too)

from hypothesis import given, settings, HealthCheck, strategies as st
from minfer.flash import prefill_attention, decode_attention, random_paged_batch

DEV = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16]
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def run_prefill(b, **kw):
    return prefill_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.cu_seqlens_q, b.seq_lens, b.max_seqlen_q, **kw)

def run_decode(b, **kw):
    return decode_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, **kw)

def check(o, b, dtype):
    assert o.dtype == dtype and o.shape == b.q.shape
    err = (o.float() - b.reference()).abs().max().item()  # NaN (a read past seq_len) fails this too
    assert err <= TOL[dtype], f"max abs error {err:.2e} > {TOL[dtype]}"


# (seq_lens, q_lens, Hq, Hkv, head_dim, block_size, kernel tile kwargs): lengths are not multiples of tiles or blocks
PREFILL_CASES = {
    "fresh-prompts-gqa3":  ([45, 17, 1, 33], None, 6, 2, 64, 16, dict(block_m=32, block_n=16)),
    "extend-after-prefix": ([37, 23, 50], [5, 23, 1], 4, 1, 64, 8, dict(block_m=32, block_n=16)),
    "mha-block-size-1":    ([19, 30], [19, 7], 2, 2, 64, 1, {}),
    "gqa8-tiny-tiles":     ([21, 9], [21, 4], 8, 1, 32, 4, dict(block_m=16, block_n=16)),
    "odd-block-head-dim":  ([29, 40], [10, 40], 8, 2, 48, 5, dict(block_n=16)),
}

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_matches_sdpa(case, dtype):
    seq_lens, q_lens, hq, hkv, d, bs, kw = PREFILL_CASES[case]
    b = random_paged_batch(seq_lens, q_lens, hq, hkv, d, bs, dtype=dtype, device=DEV)
    check(run_prefill(b, **kw), b, dtype)


# (seq_lens, Hq, Hkv, head_dim, block_size, num_splits, block_n): empty splits, splits ending mid-block, length 1
DECODE_CASES = {
    "mixed-lengths-3-splits": ([1, 40, 75, 16], 6, 2, 64, 16, 3, 16),
    "gqa4-default-splits":    ([100, 3], 4, 1, 64, 8, None, None),
    "mha-block-1-5-splits":   ([33], 2, 2, 64, 1, 5, 16),
    "odd-block-head-dim":     ([50, 7], 8, 2, 48, 5, 2, 16),
}

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_matches_sdpa(case, dtype):
    seq_lens, hq, hkv, d, bs, splits, bn = DECODE_CASES[case]
    b = random_paged_batch(seq_lens, [1] * len(seq_lens), hq, hkv, d, bs, dtype=dtype, device=DEV, seed=1)
    check(run_decode(b, num_splits=splits, block_n=bn), b, dtype)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), group=st.sampled_from([1, 2, 3, 4]), hkv=st.sampled_from([1, 2]),
       block_size=st.sampled_from([1, 3, 4, 16]), seed=st.integers(0, 2**16))
def test_random_batches(data, group, hkv, block_size, seed):
    "Random batch compositions through both kernels, fp32."
    seq_lens = data.draw(st.lists(st.integers(1, 48), min_size=1, max_size=3), label="seq_lens")
    q_lens = [data.draw(st.integers(1, s), label="q_len") for s in seq_lens]
    b = random_paged_batch(seq_lens, q_lens, group * hkv, hkv, 32, block_size, device=DEV, seed=seed)
    check(run_prefill(b, block_m=16, block_n=16), b, torch.float32)
    b = random_paged_batch(seq_lens, [1] * len(seq_lens), group * hkv, hkv, 32, block_size, device=DEV, seed=seed)
    check(run_decode(b, num_splits=data.draw(st.integers(1, 4), label="splits"), block_n=16), b, torch.float32)


def test_custom_scale():
    b = random_paged_batch([20], [6], 2, 1, 32, 4, device=DEV)
    o = run_prefill(b, scale=0.5)
    ref = random_paged_batch([20], [6], 2, 1, 32, 4, device=DEV)  # same seed: same data
    ref.q = ref.q * (0.5 / 32 ** -0.5)                           # attend uses 1/sqrt(D); fold the custom scale into q
    assert (o - ref.reference()).abs().max() < 1e-5


def test_bad_inputs_raise():
    b = random_paged_batch([8], [8], 3, 2, 32, 4, device=DEV)    # 3 query heads on 2 KV heads: not a GQA layout
    with pytest.raises(ValueError, match="multiple"): run_prefill(b)
    b = random_paged_batch([8], [1], 2, 1, 32, 4, device=DEV)
    with pytest.raises(ValueError, match="dtypes"):
        decode_attention(b.q.half(), b.k_cache, b.v_cache, b.block_tables, b.seq_lens)
    with pytest.raises(ValueError, match="int32"):
        decode_attention(b.q, b.k_cache, b.v_cache, b.block_tables.long(), b.seq_lens)


# ---- the engine backend: same greedy tokens as the PyTorch path ----

def _generate(model, prompt_ids, n_new, attn_cls, block_size=4, blocks=(5, 2, 7, 1)):
    "Greedy decode of one sequence through a small paged cache (blocks out of order): one prefill step, then decodes."
    from minfer.paged import build_batch_meta, PagedKVCache
    dev = model.device
    cache = PagedKVCache(model.cfg, 8, block_size, model.dtype, dev)
    attn, new, done, out = attn_cls(cache), list(prompt_ids), 0, []
    for _ in range(n_new):
        attn = attn.bind(build_batch_meta([(list(blocks), done, len(new))], block_size, device=dev))
        with torch.inference_mode():
            logits = model(torch.tensor(new, device=dev), torch.arange(done, done + len(new), device=dev), attn, logits_rows=[-1])
        out.append(int(logits[0].argmax())); done += len(new); new = [out[-1]]
    return out

@pytest.mark.parametrize("q_lens", [[1, 1, 1], [1, 12, 1], [30, 0, 2]], ids=["decode", "mixed", "with-empty"])
def test_triton_attention_dispatch(q_lens):
    "TritonAttention.attention (decode kernel when every q_len is 1, else prefill) == PagedAttention's PyTorch gather."
    from minfer.paged import PagedAttention, BatchMeta
    from minfer.flash import TritonAttention
    b = random_paged_batch([30, 45, 9], q_lens, 6, 2, 32, 4, device=DEV, seed=3)
    meta = BatchMeta(None, b.cu_seqlens_q, b.seq_lens, b.block_tables, max(q_lens), 45)
    ref = PagedAttention(None).attention(b.q, b.k_cache, b.v_cache, meta)
    assert (TritonAttention(None).attention(b.q, b.k_cache, b.v_cache, meta) - ref).abs().max() < 1e-5

def test_triton_attention_greedy_tokens():
    from minfer.model import load_model
    from minfer.gguf import default_model_dir
    from minfer.tokenizer import Tokenizer
    from minfer.paged import PagedAttention
    from minfer.flash import TritonAttention
    model, tok = load_model(default_model_dir(), dtype="float32", device=DEV), Tokenizer(default_model_dir())
    prompt = tok.encode("The capital of France is")                         # 5 tokens; 3 new: prefill + 2 decodes
    ref = _generate(model, prompt, 3, PagedAttention)
    assert _generate(model, prompt, 3, TritonAttention) == ref


# ---- compiled only: longer sequences, head dim 128, bf16 ----

@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_prefill_long_gpu(dtype):
    b = random_paged_batch([1000, 2055, 513, 1], [1000, 300, 513, 1], 32, 8, 128, 16, dtype=dtype, device=DEV)
    check(run_prefill(b), b, dtype)

@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_decode_long_gpu(dtype):
    lens = [1, 17, 4096, 3000, 129, 8191, 64, 2]
    b = random_paged_batch(lens, [1] * len(lens), 32, 8, 128, 16, dtype=dtype, device=DEV)
    check(run_decode(b), b, dtype)
    check(run_decode(b, num_splits=1), b, dtype)
