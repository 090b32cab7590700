"""Kernel lab: FlashAttention prefill/extend over a paged KV cache (`minfer.flash.prefill_attention`, chapter 05a).

Checks the kernel against PyTorch's SDPA, then benchmarks it with `triton.testing.do_bench` against
`torch.nn.functional.scaled_dot_product_attention` (contiguous K/V) and a naive PyTorch attention that materialises the
scores, across sequence lengths and batch sizes; prints achieved TFLOP/s next to the device's datasheet peak.

    python kernels/flash_prefill.py                               # on a GPU (make bench-kernels runs every script here)
    python kernels/flash_prefill.py --heads 9 --kv-heads 3 --head-dim 64   # the default model's attention shape
    TRITON_INTERPRET=1 python kernels/flash_prefill.py --small    # CPU smoke check in Triton's interpreter

FLOPs are the useful causal work: 4 * Hq * D * (query-key pairs), pairs = N (N + 1) / 2 per sequence.
"""
import argparse, os, sys, time
import torch
import torch.nn.functional as F

# dense (no sparsity) datasheet peaks: (name fragment, fp16/bf16 tensor TFLOP/s, fp32 TFLOP/s, memory TB/s)
PEAKS = [("H200 NVL", 835, 60, 4.8), ("H200", 989, 67, 4.8), ("H100 NVL", 835, 60, 3.9), ("H100 PCIe", 756, 51, 2.0),
         ("H100", 989, 67, 3.35), ("A100 80GB PCIe", 312, 19.5, 1.935), ("A100-SXM4-80GB", 312, 19.5, 2.039),
         ("A100", 312, 19.5, 1.555)]

def device_peak(dtype):
    "(device name, peak TFLOP/s for dtype or None) from the datasheet table."
    if not torch.cuda.is_available(): return "CPU (Triton interpreter)", None
    name = torch.cuda.get_device_name()
    for frag, tc, fp32, _ in PEAKS:
        if frag in name: return name, fp32 if dtype == torch.float32 else tc
    return name, None

def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="tiny shapes: a quick smoke check (required on CPU)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default bf16 on GPU, fp32+fp16 on CPU")
    p.add_argument("--heads", type=int, default=32); p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128); p.add_argument("--block-size", type=int, default=16)
    return p.parse_args()

args = parse_args()
if not torch.cuda.is_available():
    if os.environ.get("TRITON_INTERPRET") != "1" or not args.small:
        sys.exit("flash_prefill.py benchmarks a GPU kernel and found no CUDA device. For a CPU smoke check run:\n"
                 "    TRITON_INTERPRET=1 python kernels/flash_prefill.py --small")
    if args.dtype == "bf16": sys.exit("the Triton interpreter computes bf16 wrongly: use --dtype fp16 or fp32 on CPU")

import triton
from minfer.flash import prefill_attention, random_paged_batch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
dev = "cuda" if torch.cuda.is_available() else "cpu"
dtypes = [DTYPES[args.dtype]] if args.dtype else ([torch.bfloat16] if dev == "cuda" else [torch.float32, torch.float16])
Hq, Hkv, D, BS = args.heads, args.kv_heads, args.head_dim, args.block_size
if args.small and dev == "cpu": Hq, Hkv, D = 4, 2, 32       # the interpreter runs every program in Python


def bench_ms(fn):
    if dev == "cuda": return triton.testing.do_bench(fn, warmup=25, rep=100)
    fn(); t = time.perf_counter(); fn(); return (time.perf_counter() - t) * 1e3   # interpreter: one run, for show

def naive_attention(q, k, v):
    "[B, H, N, D] causal attention with the [B, H, N, N] scores materialised (softmax in fp32)."
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    return torch.softmax(s.masked_fill(~mask, float("-inf")).float(), -1).to(q.dtype) @ v

def run(b):
    return prefill_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.cu_seqlens_q, b.seq_lens, b.max_seqlen_q)


def check(dtype):
    cases = ([[45, 17, 1], [45, 5, 1]], [[300, 130, 64, 7], [300, 1, 40, 7]]) if args.small else \
            ([[1000, 2055, 513, 1], [1000, 300, 513, 1]], [[4096, 77], [4096, 77]])
    for seq_lens, q_lens in cases:
        b = random_paged_batch(seq_lens, q_lens, Hq, Hkv, D, BS, dtype=dtype, device=dev)
        err = (run(b).float() - b.reference()).abs().max().item()
        status = "ok" if err <= TOL[dtype] else "FAILED"
        print(f"check {str(dtype):15s} seq_lens={seq_lens} q_lens={q_lens}: max abs err {err:.1e} (tol {TOL[dtype]}) {status}")
        if status != "ok": sys.exit(1)


def benchmark(dtype):
    name, peak = device_peak(dtype)
    print(f"\n{name}: {Hq} q heads, {Hkv} KV heads, head dim {D}, {dtype}, KV blocks of {BS}; "
          f"peak {peak or '?'} TFLOP/s (datasheet, dense)")
    print(f"{'batch':>5} {'N':>6} | {'triton ms':>9} {'TFLOP/s':>8} {'%peak':>6} | {'SDPA ms':>8} {'TFLOP/s':>8} | "
          f"{'naive ms':>9} {'TFLOP/s':>8}")
    sizes = [(1, 64), (2, 100)] if args.small and dev == "cpu" else \
            [(1, 256), (2, 256)] if args.small else \
            [(b, n) for b in (1, 4, 16) for n in (512, 1024, 2048, 4096, 8192, 16384) if b * n <= 65536]
    g = Hq // Hkv
    for batch, n in sizes:
        b = random_paged_batch([n] * batch, None, Hq, Hkv, D, BS, dtype=dtype, device=dev)
        flops = 4 * Hq * D * batch * n * (n + 1) / 2
        t_tri = bench_ms(lambda: run(b))
        # contiguous [B, H, N, D] for SDPA; K/V expanded to all query heads (outside the timing) so every backend applies
        q4 = b.q.view(batch, n, Hq, D).transpose(1, 2).contiguous()
        k4, v4 = (torch.stack(x).transpose(1, 2).repeat_interleave(g, 1).contiguous() for x in (b.k, b.v))
        t_sdpa = bench_ms(lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True))
        t_naive = bench_ms(lambda: naive_attention(q4, k4, v4)) if batch * Hq * n * n * 12 <= 16e9 else float("nan")
        if t_naive == t_naive:  # the naive version is a benchmark peer, so check it too
            err = (naive_attention(q4, k4, v4).transpose(1, 2).reshape(-1, Hq, D).float() - run(b).float()).abs().max().item()
            assert err <= 2 * TOL[dtype], f"naive and triton disagree by {err:.1e}"
        tf = lambda t: flops / t / 1e9
        pct = f"{100 * tf(t_tri) / peak:5.1f}%" if peak else "     ?"
        print(f"{batch:5d} {n:6d} | {t_tri:9.3f} {tf(t_tri):8.3g} {pct:>6} | {t_sdpa:8.3f} {tf(t_sdpa):8.3g} | "
              f"{t_naive:9.3f} {tf(t_naive):8.3g}")
        del b, q4, k4, v4


if __name__ == "__main__":
    if dev == "cpu": print("CPU: Triton interpreter, tiny shapes; timings below only show the script runs, they mean nothing")
    for dt in dtypes:
        check(dt)
        benchmark(dt)
