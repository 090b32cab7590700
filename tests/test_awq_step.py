"""Chapter 08's int4 weights inside chapter 05c's one-call decode step: the 4-bit matvec against the dequantising
reference (`dequantize_awq`, AutoAWQ's definition of the weight), each CPU instruction set's path of it, and the whole
step and the modules' path (chapter 08's 8-bit-activation kernel in bf16) against the dequantising reference in fp32."""
import platform
import pytest, torch
import torch.nn.functional as F

from minfer.awq import AWQLinear, quantize_folder, load_awq_model, unpack_int4
from minfer.cpu_step import (pack_q4, matvec_q4, fuse_decode_step, cpu_step_available, CPU_STEP_SOURCE, STEP_CXX_FLAGS,
                             _STEP_SIGNATURES)
from minfer.cpu_kernels import fuse_cpu_ops, build_cpu_kernels, load_kernels, FUSED_MAX_ROWS
from minfer.llm import LLM
from minfer.sampling import SamplingParams
from minfer.kvcache import cached_generate
from minfer.model import NoCache
from test_cpu_step import prefill_then_decode, SHORT
from lossy import assert_near_fp32, assert_kv_near_fp32, first_divergence_is_near_tie, bound

pytestmark = pytest.mark.skipif(not cpu_step_available(), reason="no C++ compiler with OpenMP to build the step kernels")


def forward(model, ids):
    "The logits of every position of `ids`, no cache."
    with torch.inference_mode(): return model(torch.tensor(ids), torch.arange(len(ids)), NoCache())


def dequantized(model):
    """`model` (int4, fp32) with each AWQLinear swapped for a Linear holding its dequantised weight: the products of
    `AWQLinear.reference` (the fp32 reference), without dequantising the weights again at every call."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, AWQLinear):
                linear = torch.nn.Linear(child.in_features, child.out_features, bias=False)
                linear.weight = torch.nn.Parameter(child.dequantize(), requires_grad=False)
                setattr(parent, name, linear)
    return model


def random_awq(n_out, n_in, group_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    return AWQLinear.from_weight(torch.randn(n_out, n_in, generator=g) * 0.05 + 0.01, group_size)


def tolerance(lin, x, exact):
    """fp32: a few roundings of sums of n_in terms, each term at most |code * scale * x| + |zero * scale * x| (the
    kernel sums codes times x and subtracts zero times the group's sum of x); bf16 adds one rounding of the output."""
    codes, zeros = unpack_int4(lin.qweight).T.float(), unpack_int4(lin.qzeros).T.float()
    s = lin.scales.T.float().repeat_interleave(lin.group_size, 1)
    size = F.linear(x.abs().float(), codes * s + zeros.repeat_interleave(lin.group_size, 1) * s)
    tol = 1e-6 * lin.in_features ** 0.5 * size
    return tol if x.dtype == torch.float32 else tol + exact.abs() * 2**-8


def test_pack_q4_layout_by_hand():
    "Byte j of a pair holds row j's code for input k (low nibble) and k+1 (high); then 16 scales and 16 zeros, fp16."
    codes = (torch.arange(16)[:, None] + torch.arange(64)[None]) % 16      # row j, input k: (j + k) mod 16
    scales, zeros = torch.full((16, 1), 0.5), torch.arange(16.)[:, None]
    packed = pack_q4(codes, scales, zeros)
    assert packed.numel() == 16 * 64 // 2 + 16 * 4
    assert packed[:16].tolist() == [(j % 16) | (((j + 1) % 16) << 4) for j in range(16)]           # inputs 0, 1
    assert packed[16:32].tolist() == [((j + 2) % 16) | (((j + 3) % 16) << 4) for j in range(16)]   # inputs 2, 3
    tail = packed[512:].view(torch.float16)
    assert tail[:16].tolist() == [0.5] * 16 and tail[16:].tolist() == list(range(16))


@pytest.mark.parametrize("n_out, n_in, group_size", [(960, 576, 64), (576, 576, 64), (3072, 576, 64), (576, 1536, 64),
                                                     (48, 64, 32), (16, 256, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matvec_q4_matches_dequantized_reference(n_out, n_in, group_size, dtype):
    lin = random_awq(n_out, n_in, group_size)
    w, g = lin.q4_weights()
    for rows in (1, 2, 3, 4, 5, 9, FUSED_MAX_ROWS):
        x = torch.randn(rows, n_in, generator=torch.Generator().manual_seed(rows)).to(dtype)
        exact = lin.reference(x.float())  # dequantize_awq's fp32 weight, of the same (rounded) inputs
        got = matvec_q4(w, x, n_out, g).float()
        assert ((got - exact).abs() <= tolerance(lin, x, exact)).all(), (rows, (got - exact).abs().max())


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the AVX-512 / AVX2 paths are x86's")
def test_every_instruction_set_path_matches():
    """The same source built three ways (as -march=native gives it here, without AVX-512, without AVX2 either: the
    plain loop), each checked against the reference (only the paths this CPU can run)."""
    lin = random_awq(96, 192, 64, seed=3)
    w, g = lin.q4_weights()
    for extra in ((), ("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2")):
        f = load_kernels(build_cpu_kernels(CPU_STEP_SOURCE, flags=(*STEP_CXX_FLAGS, *extra)), _STEP_SIGNATURES)
        for rows in (1, 3, 6):
            x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows))
            y = torch.empty(rows, 96)
            f["matvec_q4", torch.float32](w.data_ptr(), x.data_ptr(), y.data_ptr(), rows, 192, 96, g)
            exact = lin.reference(x)
            assert ((y - exact).abs() <= tolerance(lin, x, exact)).all(), (extra, rows)


def test_bad_input_is_one_line():
    lin = random_awq(32, 64, 32)
    w, g = lin.q4_weights()
    for call, word in [(lambda: matvec_q4(w, torch.randn(FUSED_MAX_ROWS + 1, 64), 32, g), "x must be"),
                       (lambda: matvec_q4(w, torch.randn(2, 64), 48, g), "x must be"),
                       (lambda: matvec_q4(w.float(), torch.randn(2, 64), 32, g), "x must be"),
                       (lambda: pack_q4(torch.zeros(40, 64), torch.ones(40, 2), torch.zeros(40, 2)), "multiple of 16")]:
        with pytest.raises(ValueError) as e: call()
        assert "\n" not in str(e.value) and word in str(e.value)


@pytest.fixture(scope="module")
def rtn_folder(tmp_path_factory, model_dir):
    "The default model quantised with round-to-nearest, groups of 64 (AutoAWQ's GEMM format; seconds, no search)."
    return quantize_folder(model_dir, tmp_path_factory.mktemp("rtn") / "rtn-g64", method="rtn", group_size=64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int4_step_matches_the_modules(rtn_folder, tokenizer, dtype):
    """Three decode steps of three sequences, one call each, every path fed the greedy tokens of the fp32 reference (the
    modules with the dequantised weights: F.linear) over the same pool. fp32: the step within float rounding of it. bf16
    (contract 4; `lossy` explains the bounds): the step and the modules each against fp32, never against each other.
    Both prefill through the modules, whose bf16 projections are chapter 08's `matmul_q4x8` (x rounded to 8 bits per
    block of 32 inputs). Logits within E = 8 bf16 eps of the largest |logit|; logits minus that of fp32's top token
    within D = 5, so the argmax is fp32's in the rows whose fp32 top-2 gap exceeds D; the other rows are near-ties,
    where the bf16 paths may pick another token than fp32. K/V in fp32's slots, each vector within 2**-4 of its length
    in layer 0 (8-bit x moves a vector by up to half a step of its block's largest input: measured 0.040 on AMD EPYC,
    AVX-512, against bf16 rounding's 0.010) and 2**-1 in every layer (measured 0.18)."""
    prompts = [tokenizer.encode(t) for t in SHORT]
    modules = lambda dt: fuse_cpu_ops(load_awq_model(rtn_folder, dt))
    reference = fuse_cpu_ops(dequantized(load_awq_model(rtn_folder, "float32")))
    want, fed, k_want, v_want = prefill_then_decode(reference, prompts, steps=3)
    step = fuse_decode_step(modules(dtype))
    if dtype == "float32":  # the prompts' K/V by the definition, so that the step's own products are compared alone
        for m in step.modules():
            if isinstance(m, AWQLinear): m.forward = m.reference
    assert step.group_size == 64
    step.timings = torch.zeros(5, dtype=torch.float64)
    got, _, k_got, v_got = prefill_then_decode(step, prompts, steps=3, feed=fed)
    assert step.timings.sum() > 0  # the decode steps were the C++ call
    if dtype == "float32":
        assert (got - want).abs().max() <= 1e-3 and torch.allclose(k_got, k_want, atol=1e-4)
        return
    ops, _, k_ops, v_ops = prefill_then_decode(modules(dtype), prompts, steps=3, feed=fed)
    for what, logits, k, v in (("step", got, k_got, v_got), ("modules", ops, k_ops, v_ops)):
        assert_near_fp32(logits, want, 8, 5, f"bf16 {what}")
        assert_kv_near_fp32(k, k_want, f"bf16 {what}, K", layer0=2**-4)
        assert_kv_near_fp32(v, v_want, f"bf16 {what}, V", layer0=2**-4)


def test_llm_picks_the_int4_step(rtn_folder):
    """LLM(awq folder) resolves kernels='step' by itself, in bf16. Its greedy tokens and those of kernels='cpu' (the
    modules, chapter 08's 8-bit-activation kernel) are each the fp32 reference's (the folder's dequantised weights in
    fp32), or first differ where fp32's top-2 gap is below D = 8 bf16 eps of that position's largest |logit| (`lossy`;
    per position, the teacher-forced tests measured up to 4.1 of them). On AMD EPYC, AVX-512, and on the AVX2
    stand-in both paths gave fp32's 12 tokens for each of the three chat prompts, through near-ties down to a gap of
    0.14."""
    llm = LLM(rtn_folder)
    assert (llm.weights, llm.dtype, llm.kernels) == ("awq-int4", "bfloat16", "step")
    reference = dequantized(load_awq_model(rtn_folder, "float32"))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for kernels, engine in (("step", llm), ("cpu", LLM(rtn_folder, kernels="cpu"))):
        for text, out in zip(SHORT, engine.generate(SHORT, params)):
            ids = out.prompt_token_ids  # the chat template's
            want = cached_generate(reference, ids, 12)
            after = lambda prefix: forward(reference, ids + prefix)[-1]
            ok, where = first_divergence_is_near_tie(out.token_ids, want, after, lambda logits: bound(logits, 8))
            assert ok, (kernels, text, where)
