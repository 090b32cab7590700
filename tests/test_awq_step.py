"""Chapter 08's int4 weights inside chapter 05c's one-call decode step (`decode_step_q4x8`: every projection through
`matmul_q4x8`, whose kernel tests/test_awq_q4x8.py checks on every instruction set): the whole step and the modules'
path against the dequantising reference (`dequantize_awq`, AutoAWQ's definition of the weight) in fp32."""
import pytest, torch

from minfer.awq import AWQLinear, quantize_folder, load_awq_model
from minfer.cpu_step import fuse_decode_step, cpu_step_available
from minfer.cpu_kernels import fuse_cpu_ops
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


@pytest.fixture(scope="module")
def rtn_folder(tmp_path_factory, model_dir):
    "The default model quantised with round-to-nearest, groups of 64 (AutoAWQ's GEMM format; seconds, no search)."
    return quantize_folder(model_dir, tmp_path_factory.mktemp("rtn") / "rtn-g64", method="rtn", group_size=64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int4_step_matches_the_modules(rtn_folder, tokenizer, dtype):
    """Three decode steps of three sequences, one call each, every path fed the greedy tokens of the fp32 reference (the
    modules with the dequantised weights: F.linear) over the same pool. The step and the modules each against fp32,
    never against each other (contract 4; `lossy` explains the bounds): both run every projection through chapter 08a's
    `matmul_q4x8` (x rounded to 8 bits per block of 32 inputs), the step inside its one C++ call, the modules one
    call per projection; bf16 rounds the activations too. Logits within E = 8 bf16 eps of the largest |logit|; logits
    minus that of fp32's top token within D = 5, so the argmax is fp32's in the rows whose fp32 top-2 gap exceeds D;
    the other rows are near-ties, where the quantized paths may pick another token than fp32. K/V in fp32's slots,
    each vector within 2**-4 of its length in layer 0 (8-bit x moves a vector by up to half a step of its block's
    largest input: measured 0.040 on AMD EPYC, AVX-512, against bf16 rounding's 0.010) and 2**-1 in every layer
    (measured 0.18)."""
    prompts = [tokenizer.encode(t) for t in SHORT]
    modules = lambda dt: fuse_cpu_ops(load_awq_model(rtn_folder, dt))
    reference = fuse_cpu_ops(dequantized(load_awq_model(rtn_folder, "float32")))
    want, fed, k_want, v_want = prefill_then_decode(reference, prompts, steps=3)
    step = fuse_decode_step(modules(dtype))
    assert step.scale_group == 64 and step.step_kernel[0] == "decode_step_q4x8"
    step.timings = torch.zeros(5, dtype=torch.float64)
    got, _, k_got, v_got = prefill_then_decode(step, prompts, steps=3, feed=fed)
    assert step.timings.sum() > 0  # the decode steps were the C++ call
    ops, _, k_ops, v_ops = prefill_then_decode(modules(dtype), prompts, steps=3, feed=fed)
    for what, logits, k, v in (("step", got, k_got, v_got), ("modules", ops, k_ops, v_ops)):
        assert_near_fp32(logits, want, 8, 5, f"{dtype} {what}")
        assert_kv_near_fp32(k, k_want, f"{dtype} {what}, K", layer0=2**-4)
        assert_kv_near_fp32(v, v_want, f"{dtype} {what}, V", layer0=2**-4)


def test_llm_picks_the_int4_step(rtn_folder):
    """LLM(awq folder) resolves kernels='step' by itself, in bf16. Its greedy tokens and those of kernels='cpu' (the
    modules, chapter 08a's 8-bit-activation kernel) are each the fp32 reference's (the folder's dequantised weights in
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
