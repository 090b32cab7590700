"""Chapter 08a's kernels for AWQ's 4-bit weights, and how they plug into chapter 08: the Triton W4A16 kernel against
the dequantised reference (`F.linear` on `AWQLinear.dequantize()`); `AWQ_KERNELS`, where chapter 08 registers the
reference and 08a adds its kernels under their own names, each picked for the inputs it says it takes; and chapter 08
alone (a fresh process that imports `minfer.awq` only), which runs the reference and leaves the one-call step alone.
(The CPU kernel against fp64 products: tests/test_awq_q4x8.py; the one-call step over it: tests/test_awq_step.py.)

Without CUDA the Triton kernel runs in Triton's interpreter (TRITON_INTERPRET=1 is set before triton is imported),
in fp32 and fp16 only; the `gpu`-marked tests run it compiled, bf16 and larger shapes included.
"""
import json, os, subprocess, sys
import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA: os.environ.setdefault("TRITON_INTERPRET", "1")

from minfer.awq import AWQ_KERNELS, AWQKernel, AWQLinear, quantize_folder
from minfer.awq_kernels import awq_cpu_available, awq_gemm
from minfer.engine import resolve_config, EngineConfig
from test_awq import random_weight, tiny_folder, tiny_config, tiny_model  # noqa: F401 (a fixture and its helpers)

DEV = "cuda" if CUDA else "cpu"
gpu = pytest.mark.gpu


# (M, K, N, group size, block_n, block_k): one row; more rows than a short tile holds (a tall tile, rows masked);
# N not a multiple of the tile; group > block_k
TRITON_CASES = {
    "one-row": (1, 128, 64, 32, 32, 16),
    "tall": (40, 128, 64, 32, 32, 16),
    "ragged-n": (5, 192, 40, 64, 32, 32),
    "group-128": (3, 256, 48, 128, 32, 64),
}

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_kernel_matches_reference(case, dtype):
    M, K, N, G, block_n, block_k = TRITON_CASES[case]
    layer = AWQLinear.from_weight(random_weight(N, K, seed=M), G).to(DEV)
    x = torch.randn(M, K, device=DEV).to(dtype)
    got = awq_gemm(x, layer.qweight, layer.qzeros, layer.scales, G, block_n=block_n, block_k=block_k)
    want = F.linear(x.float(), layer.dequantize())
    err = (got.float() - want).abs().max().item()
    assert got.dtype == dtype and err <= (1e-5 if dtype == torch.float32 else 3e-3) * want.abs().max().item(), err


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M,K,N,G", [(1, 4096, 4096, 128), (16, 576, 3072, 64), (200, 1536, 576, 64)])
def test_triton_kernel_compiled(M, K, N, G, dtype):
    layer = AWQLinear.from_weight(torch.randn(N, K) * 0.02, G).cuda()
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    assert AWQ_KERNELS.pick(layer, x) is AWQ_KERNELS["triton"]  # on CUDA, forward is the Triton kernel
    got = layer(x)
    want = F.linear(x.float(), layer.dequantize())
    err = (got.float() - want).abs().max().item()
    assert err <= 2e-2 * want.abs().max().item(), err


def test_each_kernel_runs_the_inputs_it_takes():
    """Chapter 08's reference first, 08a's kernels after it under their own names; `forward` runs the last registered
    kernel that takes x: the CPU kernel for CPU rows in fp32 and bf16 (group size a multiple of 32), the reference for
    the rest (fp16 on a CPU, groups of 16), Triton for CUDA inputs only."""
    assert list(AWQ_KERNELS)[:3] == ["reference", "cpu-q4x8", "triton"]
    assert AWQ_KERNELS["triton"].devices == ("cuda",) and AWQ_KERNELS["cpu-q4x8"].devices == ("cpu",)
    layer, narrow = AWQLinear.from_weight(random_weight(64, 128), 64), AWQLinear.from_weight(random_weight(64, 128), 16)
    x = torch.randn(3, 128)
    cpu = "cpu-q4x8" if awq_cpu_available() else "reference"
    for x_in, lin, name in ((x, layer, cpu), (x.bfloat16(), layer, cpu), (x.half(), layer, "reference"),
                            (x, narrow, "reference"), (x.to("meta"), layer, "reference")):
        assert AWQ_KERNELS.pick(lin, x_in) is AWQ_KERNELS[name], (x_in.dtype, x_in.device, lin.group_size)
    assert torch.equal(narrow(x), narrow.reference(x))  # what no kernel takes, the definition runs
    assert AWQ_KERNELS.step_reads() == awq_cpu_available() and (cpu == "reference" or layer.step_weights()[1] == 64)


def test_a_kernel_never_replaces_another():
    "Add-only: a name taken by another kernel is refused in one line, and an entry must be an `AWQKernel`."
    with pytest.raises(ValueError) as e:
        AWQ_KERNELS.register("reference", AWQKernel(lambda linear, x: linear.reference(x) * 2))
    assert "\n" not in str(e.value) and "'reference' is registered already" in str(e.value)
    with pytest.raises(TypeError, match="must be a AWQKernel"):
        AWQ_KERNELS.register("toy", lambda linear, x: x)
    assert "toy" not in AWQ_KERNELS


CHAPTER_08_ALONE = """
import json, sys, torch
import minfer.awq as awq
from minfer.engine import EngineConfig, resolve_config
layer = awq.AWQLinear.from_weight(torch.randn(64, 128) * 0.05, 64)
x = torch.randn(3, 128)
try:
    layer.step_weights()
    step_error = None
except ValueError as e:
    step_error = str(e)
config = resolve_config(EngineConfig(model=sys.argv[1]))
print(json.dumps(dict(kernels=list(awq.AWQ_KERNELS), same=all(torch.equal(layer(t), layer.reference(t))
                                                               for t in (x, x.bfloat16())),
                      step_reads=awq.AWQ_KERNELS.step_reads(), step_error=step_error,
                      config=[config.weights, config.kernels],
                      later="minfer.awq_kernels" in sys.modules)))
"""


def test_chapter_08_alone_runs_the_reference(tiny_folder, tmp_path):
    """A fresh process that imports chapter 08 and not 08a: one kernel, the reference, which `forward` runs; no reader
    for the one-call step, so an AWQ folder's config resolves to kernels='cpu' (the modules), not 'step'; and with
    every chapter loaded the same folder resolves to 'step' (chapter 08a's reader), as before the split."""
    folder = quantize_folder(tiny_folder, tmp_path / "rtn", method="rtn", group_size=32)
    out = subprocess.run([sys.executable, "-c", CHAPTER_08_ALONE, str(folder)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    alone = json.loads(out.stdout.strip().splitlines()[-1])
    assert alone["kernels"] == ["reference"] and alone["same"] and not alone["later"]
    assert not alone["step_reads"] and "\n" not in alone["step_error"] and "kernels='cpu'" in alone["step_error"]
    assert alone["config"] == ["awq-int4", "cpu"]
    config = resolve_config(EngineConfig(model=str(folder)))  # this process: every chapter loaded (conftest)
    assert (config.weights, config.kernels) == ("awq-int4", "step" if awq_cpu_available() else "cpu")
