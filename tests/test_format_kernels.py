"""Chapter 08c's kernels for chapter 08b's float codes, and how they plug into 08b: the C++ kernels (FP8 decoded in
registers; MXFP4 and NVFP4 as small integers times x rounded to 8 bits per 32 inputs, checked as chapter 08a's kernel
is, tests/test_awq_q4x8.py's `check`, on each instruction set's path) and the Triton kernel against the dequantised
reference; `FORMAT_KERNELS`, where chapter 08b registers the reference and 08c adds its kernels under their own names,
each picked for the inputs it says it takes; and chapter 08b alone (a fresh process that imports `minfer.formats`
only), which runs the reference and leaves the one-call step alone until `minfer.format_kernels` is imported.

Without CUDA the Triton kernel runs in Triton's interpreter (TRITON_INTERPRET=1 is set before triton is imported),
in fp32 and fp16 only."""
import ctypes, json, os, platform, subprocess, sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minfer.cpu_kernels import build_cpu_kernels, load_kernels
from minfer.cpu_step import STEP_CXX_FLAGS
from minfer.awq import AWQKernel
from minfer.engine import EngineConfig, resolve_config
from minfer.formats import (FORMAT_KERNELS, FORMAT_MODULES, Fp8BlockLinear, Nvfp4Linear,
                            fuse_scaled, quantize_format_folder)
from minfer.format_kernels import (FORMAT_CPU_SOURCE, format_cpu_available, format_cpu_matmul, format_step_bytes,
                                   pack_fp4x8, scaled_gemm)
from test_awq import tiny_folder, tiny_config, tiny_model  # noqa: F401 (a fixture and its helpers)
from test_awq_q4x8 import check  # x rounded to 8 bits per 32 inputs: both of 08a's references


@pytest.mark.parametrize("name", ["fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("rows", [1, 3, 9, 17])
def test_cpu_kernel_matches_the_reference(name, rows):
    """FP8: the weights decoded exactly, x in fp32. MXFP4, NVFP4: x rounded to 8 bits per 32
    inputs, so `check`: the dequantised weight times that rounded x up to float rounding, and times
    x itself within half a step per input. 88 output rows: the last block of 16 is half padding."""
    if not format_cpu_available():
        pytest.skip("no C++ compiler with OpenMP here")
    torch.manual_seed(rows)
    parts = [FORMAT_MODULES[name].from_weight(torch.randn(44, 96) * 0.05) for _ in range(2)]
    module = fuse_scaled(parts)
    x = torch.randn(rows, 96)
    if name != "fp8":
        x[0, :32] = 0  # an all-zero block: step 0, codes 0
        check(format_cpu_matmul(module, x), module, x)
        check(format_cpu_matmul(module, x.bfloat16()), module, x.bfloat16())
        return
    ref = module.reference(x)
    assert torch.allclose(format_cpu_matmul(module, x), ref, atol=1e-5, rtol=1e-5)
    got_bf16 = format_cpu_matmul(module, x.bfloat16()).float()  # x and y rounded to bf16; fp32 inside
    assert torch.allclose(got_bf16, module.reference(x.bfloat16().float()), atol=2e-2, rtol=1e-2)


X86 = platform.machine() in ("x86_64", "AMD64")


@pytest.mark.skipif(not X86, reason="the AVX-512 / AVX2 paths are x86's")
@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "fp8-block"])
def test_every_instruction_set_path_matches(name):
    """The same source built three ways (-march=native: VNNI where the CPU has it; without AVX-512:
    AVX2's shuffle and maddubs; without AVX2 either: the plain loop), each against both references
    (the paths this CPU can run). FP8 in blocks of 128 x 128: its weights decoded exactly, x in fp32."""
    if not format_cpu_available():
        pytest.skip("no C++ compiler with OpenMP here")
    weight = torch.randn(200, 576, generator=torch.Generator().manual_seed(3)) * 0.05
    if name == "fp8-block":
        module = Fp8BlockLinear.from_weight(weight, block=128)  # 576 inputs: the last block 64
    else:
        module = FORMAT_MODULES[name].from_weight(weight)
    w = format_step_bytes(module)
    kernel = f"matmul_{module.name}"
    signature = {kernel: [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4}
    for extra in ((), ("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2")):
        flags = (*STEP_CXX_FLAGS, *extra)
        f = load_kernels(build_cpu_kernels(FORMAT_CPU_SOURCE, flags=flags), signature)
        for rows in (1, 6, 11):
            x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
            y = torch.empty(rows, 200)
            matmul = f[kernel, torch.float32]
            matmul(w.data_ptr(), x.data_ptr(), y.data_ptr(), rows, 576, 200, module.group)
            if name == "fp8-block":
                assert torch.allclose(y, module.reference(x), atol=1e-5, rtol=1e-5), (extra, rows)
            else:
                check(y, module, x)


@pytest.mark.parametrize("block, n_in", [(32, 256), (128, 256), (128, 576)])
@pytest.mark.parametrize("rows", [1, 3, 9, 17])
def test_block_fp8_cpu_kernel_matches_the_reference(block, n_in, rows):
    """FP8 with one scale per block x block weights (DeepSeek-V3's 128), fused from parts of 44 rows (their last row
    blocks cut short; with 576 inputs the last block of each row too): decoded exactly, x in fp32; in bf16 x and y
    rounded, fp32 inside."""
    if not format_cpu_available():
        pytest.skip("no C++ compiler with OpenMP here")
    torch.manual_seed(rows)
    module = fuse_scaled([Fp8BlockLinear.from_weight(torch.randn(44, n_in) * 0.05, block) for _ in range(2)])
    assert module.group == block and module.group_scales.shape == (88, -(-n_in // block))
    assert FORMAT_KERNELS.pick(module, torch.zeros(1, n_in)) is FORMAT_KERNELS["cpu"]
    x = torch.randn(rows, n_in)
    assert torch.allclose(format_cpu_matmul(module, x), module.reference(x), atol=1e-5, rtol=1e-5)
    got_bf16 = format_cpu_matmul(module, x.bfloat16()).float()
    assert torch.allclose(got_bf16, module.reference(x.bfloat16().float()), atol=2e-2, rtol=1e-2)


def test_pack_fp4x8_layout_by_hand():
    """Chapter 08a's code order (byte 4j + t of 8 inputs: row j's code for input t in the low
    nibble, 4 + t in the high one), then per block and group the 16 rows' scale codes, then the
    fp32 row scales; rows padded to a multiple of 16."""
    codes = (torch.arange(20)[:, None] + torch.arange(64)[None]) % 16  # row j, input k: j + k
    scales = torch.arange(40, dtype=torch.uint8).reshape(20, 2)       # row j, group g: 2j + g
    packed = pack_fp4x8(codes, scales, torch.arange(20.))
    assert packed.numel() == 32 * 64 // 2 + 32 * 2 + 32 * 4             # two blocks of 16 rows
    first = [((j + t) % 16) | (((j + 4 + t) % 16) << 4) for j in range(16) for t in range(4)]
    assert packed[:64].tolist() == first                                # block 0, inputs 0..7
    assert torch.all(packed[512 + 4 * 4:512 + 64] == 0)                 # block 1: rows 20.. = 0
    scale_bytes = packed[1024:1088]
    assert scale_bytes[:16].tolist() == [2 * j for j in range(16)]      # block 0, group 0
    assert scale_bytes[16:32].tolist() == [2 * j + 1 for j in range(16)]  # block 0, group 1
    assert scale_bytes[32:36].tolist() == [32, 34, 36, 38]              # block 1, group 0
    assert scale_bytes[36:48].tolist() == [0] * 12
    assert packed[1088:].view(torch.float32).tolist() == list(range(20)) + [0] * 12
    with pytest.raises(ValueError, match="a multiple of 32"):
        pack_fp4x8(codes[:, :48], scales[:, :1], torch.ones(20))


def test_inputs_not_a_multiple_of_32_take_the_reference():
    "NVFP4 groups 16 inputs, the CPU kernels read blocks of 32: 48 inputs take the definition."
    module = Nvfp4Linear.from_weight(torch.randn(32, 48) * 0.05)
    x = torch.randn(3, 48)
    assert torch.equal(module(x), module.reference(x))
    with pytest.raises(ValueError, match="not a multiple of 32") as e:
        module.step_weights()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["fp8", "mxfp4", "nvfp4", "fp8-block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernel_matches_the_reference(name, dtype):
    """Under TRITON_INTERPRET=1 on a CPU (fp32 and fp16 only: the interpreter computes bf16 wrongly); FP8 in blocks
    of 48 x 48 reads its fp32 scales directly, the others' scale codes through their format's table."""
    torch.manual_seed(0)
    if name == "fp8-block":
        module = Fp8BlockLinear.from_weight(torch.randn(40, 64) * 0.05, block=48)  # the last block 16 inputs
    else:
        module = FORMAT_MODULES[name].from_weight(torch.randn(40, 64) * 0.05)
    x = torch.randn(5, 64)
    ref = module.reference(x)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    device = "cuda" if torch.cuda.is_available() else "cpu"  # a GPU's Triton, else the interpreter
    got = scaled_gemm(x.to(device, dtype), module.to(device)).float().cpu()
    assert torch.allclose(got, ref, atol=tol, rtol=tol)


def test_each_kernel_runs_the_inputs_it_takes():
    """Chapter 08b's reference first, 08c's kernels after it under their own names; `forward` runs the last registered
    kernel that takes x: the CPU kernel for CPU rows in fp32 and bf16 (inputs a multiple of 32), the reference for the
    rest (fp16 on a CPU, 48 inputs), Triton for CUDA inputs only."""
    assert list(FORMAT_KERNELS)[:3] == ["reference", "cpu", "triton"]
    assert FORMAT_KERNELS["triton"].devices == ("cuda",) and FORMAT_KERNELS["cpu"].devices == ("cpu",)
    layer = Nvfp4Linear.from_weight(torch.randn(32, 64) * 0.05)
    narrow = Nvfp4Linear.from_weight(torch.randn(32, 48) * 0.05)
    x, x48 = torch.randn(3, 64), torch.randn(3, 48)
    cpu = "cpu" if format_cpu_available() else "reference"
    for x_in, lin, name in ((x, layer, cpu), (x.bfloat16(), layer, cpu), (x.half(), layer, "reference"),
                            (x48, narrow, "reference"), (x.to("meta"), layer, "reference")):
        assert FORMAT_KERNELS.pick(lin, x_in) is FORMAT_KERNELS[name], (x_in.dtype, x_in.device, lin.in_features)
    assert FORMAT_KERNELS.step_reads() and (cpu == "reference" or layer.step_weights()[1] == 16)


def test_a_kernel_never_replaces_another():
    "Add-only: a name taken by another kernel is refused in one line, and an entry must be an `AWQKernel`."
    with pytest.raises(ValueError) as e:
        FORMAT_KERNELS.register("reference", AWQKernel(lambda linear, x: linear.reference(x) * 2))
    assert "\n" not in str(e.value) and "'reference' is registered already" in str(e.value)
    with pytest.raises(TypeError, match="must be a AWQKernel"):
        FORMAT_KERNELS.register("toy", lambda linear, x: x)
    assert "toy" not in FORMAT_KERNELS


CHAPTER_08B_ALONE = """
import json, sys, torch
import minfer.formats as formats
from minfer.engine import EngineConfig, resolve_config
layer = formats.Nvfp4Linear.from_weight(torch.randn(64, 128) * 0.05)
x = torch.randn(3, 128)
try:
    layer.step_weights()
    step_error = None
except ValueError as e:
    step_error = str(e)
config = resolve_config(EngineConfig(model=sys.argv[1]))
alone = dict(kernels=list(formats.FORMAT_KERNELS), same=all(torch.equal(layer(t), layer.reference(t))
                                                            for t in (x, x.bfloat16())),
             step_reads=formats.FORMAT_KERNELS.step_reads(), step_error=step_error,
             config=[config.weights, config.kernels],
             later="minfer.format_kernels" in sys.modules)
import minfer.format_kernels as kernels
picked = [name for name, k in formats.FORMAT_KERNELS.items() if k is formats.FORMAT_KERNELS.pick(layer, x)]
with_kernels = dict(kernels=list(formats.FORMAT_KERNELS), picked=picked, available=kernels.format_cpu_available(),
                    error=(layer(x) - layer.reference(x)).abs().max().item(),
                    step_reads=formats.FORMAT_KERNELS.step_reads(),
                    same_as_cpu_kernel=kernels.format_cpu_available()
                    and torch.equal(layer(x), kernels.format_cpu_matmul(layer, x)))
print(json.dumps(dict(alone=alone, with_kernels=with_kernels)))
"""


def test_chapter_08b_alone_runs_the_reference(tiny_folder, tmp_path):
    """A fresh process that imports chapter 08b and not 08c: one kernel, the reference, which `forward` runs; no reader
    for the one-call step, so an NVFP4 folder's config resolves to kernels='cpu' (the modules), not 'step'. Importing
    08c in the same process registers its kernels: `forward` then runs the CPU kernel (where it builds), within x's
    8-bit rounding of the reference, and with every chapter loaded the folder resolves to 'step'."""
    folder = quantize_format_folder(tiny_folder, tmp_path / "nvfp4", "nvfp4")
    out = subprocess.run([sys.executable, "-c", CHAPTER_08B_ALONE, str(folder)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    alone, with_kernels = report["alone"], report["with_kernels"]
    assert alone["kernels"] == ["reference"] and alone["same"] and not alone["later"]
    assert not alone["step_reads"] and "\n" not in alone["step_error"] and "kernels='cpu'" in alone["step_error"]
    assert alone["config"] == ["nvfp4", "cpu"]
    assert with_kernels["kernels"] == ["reference", "cpu", "triton"] and with_kernels["step_reads"]
    assert with_kernels["picked"] == (["cpu"] if with_kernels["available"] else ["reference"])
    assert with_kernels["same_as_cpu_kernel"] == with_kernels["available"]  # `forward` runs what it picked
    assert with_kernels["error"] < 0.05  # x rounded to 8 bits per 32 inputs (the precise bound: `check` above)
    config = resolve_config(EngineConfig(model=str(folder)))  # this process: every chapter loaded (conftest)
    assert (config.weights, config.kernels) == ("nvfp4", "step" if format_cpu_available() else "cpu")
