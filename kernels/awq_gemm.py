"""Kernel lab: the W4A16 AWQ GEMM (`minfer.awq_kernels.awq_gemm`, chapter 08a).

Checks the Triton kernel against its PyTorch reference (dequantise the AutoAWQ GEMM tensors, then `F.linear`), then
benchmarks it with `triton.testing.do_bench` against the dense fp16/bf16 matmul of the same (dequantised) weight and the
reference path, over the default model's projection shapes and a Llama-3-8B layer's, at 1, 16 and 256 rows of x.
Prints the achieved GB/s next to the device's datasheet memory bandwidth: at a few rows the kernel is bandwidth bound,
and the figure of merit is bytes of packed weights (+ scales, zeros, x and y) per second.

    python kernels/awq_gemm.py                              # on a GPU (make bench-kernels runs every script here)
    TRITON_INTERPRET=1 python kernels/awq_gemm.py --small   # CPU smoke check in Triton's interpreter
"""
import argparse, os, sys, time
import torch
import torch.nn.functional as F

PEAK_TBS = [("H200", 4.8), ("H100 NVL", 3.9), ("H100 PCIe", 2.0), ("H100", 3.35), ("A100 80GB PCIe", 1.935),
            ("A100-SXM4-80GB", 2.039), ("A100", 1.555)]

def device_bandwidth():
    "(device name, datasheet memory bandwidth in GB/s or None)."
    if not torch.cuda.is_available(): return "CPU (Triton interpreter)", None
    name = torch.cuda.get_device_name()
    return name, next((tbs * 1000 for frag, tbs in PEAK_TBS if frag in name), None)

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--small", action="store_true", help="tiny shapes: a quick smoke check (required on CPU)")
p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
               help="default bf16 and fp16 on GPU, fp32+fp16 on CPU")
p.add_argument("--group-size", type=int, default=None,
               help="default 64 for the default model's shapes, 128 for Llama-3-8B's")
args = p.parse_args()
if not torch.cuda.is_available():
    if os.environ.get("TRITON_INTERPRET") != "1" or not args.small:
        sys.exit("awq_gemm.py benchmarks a GPU kernel and found no CUDA device. For a CPU smoke check run:\n"
                 "    TRITON_INTERPRET=1 python kernels/awq_gemm.py --small")
    if args.dtype == "bf16": sys.exit("the Triton interpreter computes bf16 wrongly: use --dtype fp16 or fp32 on CPU")

import triton
from minfer.awq import AWQLinear
from minfer.awq_kernels import awq_gemm

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
dev = "cuda" if torch.cuda.is_available() else "cpu"
default_dtypes = [torch.bfloat16, torch.float16] if dev == "cuda" else [torch.float32, torch.float16]
dtypes = [DTYPES[args.dtype]] if args.dtype else default_dtypes
# (name, in K, out N, group size)
SHAPES = [("SmolLM2 q/k/v", 576, 960, 64), ("SmolLM2 gate/up", 576, 3072, 64), ("SmolLM2 down", 1536, 576, 64),
          ("Llama-3-8B q/k/v", 4096, 6144, 128), ("Llama-3-8B gate/up", 4096, 28672, 128),
          ("Llama-3-8B down", 14336, 4096, 128)]
if args.small: SHAPES = [("tiny", 128, 64, 32), ("tiny ragged", 192, 40, 64)]
ROWS = [1, 3] if args.small else [1, 16, 256]


def bench_ms(fn):
    if dev == "cuda": return triton.testing.do_bench(fn, warmup=25, rep=100)
    fn(); t = time.perf_counter(); fn(); return (time.perf_counter() - t) * 1e3   # interpreter: one run, for show


def main():
    name, peak = device_bandwidth()
    if dev == "cpu":
        print("CPU: Triton interpreter, tiny shapes; timings below only show the script runs, they mean nothing")
    failed = False
    for dtype in dtypes:
        print(f"\n{name}, x in {dtype}; peak {peak or '?'} GB/s (datasheet)")
        print(f"{'shape':20s} {'K':>6} {'N':>6} {'rows':>5} | {'max err':>8} | "
              f"{'awq ms':>8} {'GB/s':>7} {'%peak':>6} | "
              f"{'dense ms':>8} {'GB/s':>7} | {'ref ms':>8}")
        for label, K, N, G in SHAPES:
            G = args.group_size or G
            layer = AWQLinear.from_weight(torch.randn(N, K) * 0.02, G).to(dev)
            w_dense = layer.dequantize(dtype)
            for M in ROWS:
                x = torch.randn(M, K, device=dev, dtype=dtype)
                got = awq_gemm(x, layer.qweight, layer.qzeros, layer.scales, G)
                want = F.linear(x.float(), layer.dequantize())
                err = (got.float() - want).abs().max().item() / want.abs().max().item()
                tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
                failed |= err > tol
                t_awq = bench_ms(lambda: awq_gemm(x, layer.qweight, layer.qzeros, layer.scales, G))
                t_dense = bench_ms(lambda: F.linear(x, w_dense))
                t_ref = bench_ms(lambda: layer.reference(x))
                esize = x.element_size()
                awq_bytes = K * N // 2 + (K // G) * N * 2 + (K // G) * N // 2 + (M * K + M * N) * esize
                dense_bytes = K * N * esize + (M * K + M * N) * esize
                gbs = lambda nbytes, ms: nbytes / ms / 1e6
                pct = f"{100 * gbs(awq_bytes, t_awq) / peak:5.1f}%" if peak else "     ?"
                print(f"{label:20s} {K:6d} {N:6d} {M:5d} | {err:8.1e}{'!' if err > tol else ' '}| {t_awq:8.4f} "
                      f"{gbs(awq_bytes, t_awq):7.4g} {pct:>6} | {t_dense:8.4f} {gbs(dense_bytes, t_dense):7.4g} | "
                      f"{t_ref:8.4f}")
    if failed: sys.exit("FAILED: the kernel disagrees with the reference beyond the tolerance (marked !)")


if __name__ == "__main__":
    main()
