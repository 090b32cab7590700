"""Chapter 08a's 8-bit-activation kernel (`matmul_q4x8`, what `AWQLinear` runs for bf16 on a CPU) against two fp64
references: the weight dequantised (AutoAWQ's definition, `dequantize_awq`) times x rounded to 8 bits per block of 32
inputs as the kernel defines it (computed here in PyTorch: equal up to float rounding), and the same weight times x
itself (within the most 8-bit rounding can move a product: half a step per input). Each instruction set's path."""
import ctypes, platform
import pytest, torch

from minfer.awq import AWQLinear, unpack_awq_int4
from minfer.awq_kernels import AWQ_CPU_SOURCE, awq_cpu_available, matmul_q4x8, pack_q4x8, q4x8_codes
from minfer.cpu_kernels import build_cpu_kernels, load_kernels
from minfer.cpu_step import STEP_CXX_FLAGS

pytestmark = pytest.mark.skipif(not awq_cpu_available(), reason="no C++ compiler with OpenMP to build the kernel")
SIGNATURE = {"matmul_q4x8": [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4}


def random_awq(n_out, n_in, group_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    return AWQLinear.from_weight(torch.randn(n_out, n_in, generator=g) * 0.05 + 0.01, group_size)


def q4x8_weights(lin):
    return pack_q4x8(unpack_awq_int4(lin.qweight).T, lin.scales.T, unpack_awq_int4(lin.qzeros).T)


def q8_round(x, block=32):
    "x as the kernel multiplies it: each block of 32 inputs of a row rounded to a multiple of max |x| / 127."
    xb = x.float().reshape(x.shape[0], -1, block)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0)  # a true division, as the kernel's
    # (`127 / amax` would be PyTorch's reciprocal times 127: another rounding)
    return (torch.round(xb * inv) * (amax / 127)).reshape(x.shape)


def q8_bound(w, x, block=32):
    "Half a step per input, times |w|, summed: the most rounding x to 8 bits can move each output of x Wᵀ."
    steps = x.double().reshape(x.shape[0], -1, block).abs().amax(-1) / 127
    return steps / 2 @ w.double().abs().reshape(w.shape[0], -1, block).sum(-1).T


def check(got, lin, x):
    "`got` = the kernel's x Wᵀ against both references (bf16: plus one rounding of each output)."
    w = lin.dequantize().double()
    as_rounded, exact = q8_round(x).double() @ w.T, x.double() @ w.T
    size = q8_round(x).double().abs() @ w.abs().T
    rounding = 1e-6 * size + (as_rounded.abs() * 2**-8 if x.dtype == torch.bfloat16 else 0)
    assert ((got.double() - as_rounded).abs() <= rounding).all(), (got.double() - as_rounded).abs().max()
    assert ((got.double() - exact).abs() <= q8_bound(w, x) + rounding).all()


def test_pack_q4x8_layout_by_hand():
    "Byte 4j + t of 8 inputs: row j's code for input t (low nibble) and 4 + t (high); then 16 fp16 scales and zeros."
    codes = (torch.arange(16)[:, None] + torch.arange(32)[None]) % 16      # row j, input k: (j + k) mod 16
    scales, zeros = torch.full((16, 1), 0.5), torch.arange(16.)[:, None]
    packed = pack_q4x8(codes, scales, zeros)
    assert packed.numel() == 16 * 32 // 2 + 16 * 4
    first = [((j + t) % 16) | (((j + 4 + t) % 16) << 4) for j in range(16) for t in range(4)]
    assert packed[:64].tolist() == first                                       # inputs 0..7
    second = [((j + 8 + t) % 16) | (((j + 12 + t) % 16) << 4) for j in range(16) for t in range(4)]
    assert packed[64:128].tolist() == second                                   # inputs 8..15
    tail = packed[256:].view(torch.float16)
    assert tail[:16].tolist() == [0.5] * 16 and tail[16:].tolist() == list(range(16))


@pytest.mark.parametrize("n_out, n_in, group_size", [(960, 576, 64), (576, 1536, 64), (48, 64, 32), (16, 256, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_q4x8_matches_both_references(n_out, n_in, group_size, dtype):
    lin = random_awq(n_out, n_in, group_size)
    w = q4x8_weights(lin)
    for rows in (1, 3, 8, 9, 17, 64):
        x = torch.randn(rows, n_in, generator=torch.Generator().manual_seed(rows)).to(dtype)
        x[0, :32] = 0  # an all-zero block: step 0, codes 0
        check(matmul_q4x8(w, x, n_out, group_size), lin, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_awq_linear_runs_it_on_a_cpu(dtype):
    "AWQLinear on CPU inputs of any leading shape, fp32 or bf16, is the kernel, on codes repacked at the first call."
    lin = random_awq(64, 128, 64)
    x = torch.randn(2, 5, 128).to(dtype)
    got = lin(x)
    assert got.shape == (2, 5, 64) and got.dtype == dtype
    # the codes were repacked by that first call and kept (no `pack` is needed to fetch them)
    assert lin.layout("q4x8", pack=None) is q4x8_codes(lin) and torch.equal(q4x8_codes(lin), q4x8_weights(lin))
    check(got.reshape(10, 64), lin, x.reshape(10, 128))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the AVX-512 / AVX2 paths are x86's")
def test_every_instruction_set_path_matches():
    """The same source built three ways (-march=native: VNNI where the CPU has it; without AVX-512: maddubs; without
    AVX2 either: the plain loop), each against both references (only the paths this CPU can run)."""
    lin = random_awq(96, 192, 64, seed=3)
    w = q4x8_weights(lin)
    for extra in ((), ("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2")):
        f = load_kernels(build_cpu_kernels(AWQ_CPU_SOURCE, flags=(*STEP_CXX_FLAGS, *extra)), SIGNATURE)
        for rows in (1, 6, 11):
            x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows))
            y = torch.empty(rows, 96)
            f["matmul_q4x8", torch.float32](w.data_ptr(), x.data_ptr(), y.data_ptr(), rows, 192, 96, 64)
            check(y, lin, x)


def test_bad_input_is_one_line():
    lin = random_awq(32, 64, 32)
    w = q4x8_weights(lin)
    for call, word in [(lambda: matmul_q4x8(w, torch.randn(2, 64), 48, 32), "x must be"),
                       (lambda: matmul_q4x8(w, torch.randn(2, 3, 64), 32, 32), "x must be"),
                       (lambda: matmul_q4x8(w.float(), torch.randn(2, 64), 32, 32), "x must be"),
                       (lambda: matmul_q4x8(w, torch.randn(2, 64).half(), 32, 32), "float32 and bfloat16"),
                       (lambda: pack_q4x8(torch.zeros(16, 64), torch.ones(16, 4), torch.zeros(16, 4)),
                        "multiple of 32")]:
        with pytest.raises(ValueError) as e: call()
        assert "\n" not in str(e.value) and word in str(e.value)
