"""Kernel lab: split-KV paged decode attention (`minfer.flash.decode_attention`, chapter 05a).

Checks the kernel against PyTorch's SDPA, then benchmarks it with `triton.testing.do_bench` against
`torch.nn.functional.scaled_dot_product_attention` on contiguous K/V and the naive PyTorch paged path (gather K/V through
the block table, then softmax(q k^T) v), across context lengths and batch sizes; prints achieved GB/s next to the device's
datasheet memory bandwidth. Decode is bandwidth bound: the figure of merit is bytes of K/V read per second.

    python kernels/paged_decode.py                               # on a GPU (make bench-kernels runs every script here)
    python kernels/paged_decode.py --heads 9 --kv-heads 3 --head-dim 64   # the default model's attention shape
    TRITON_INTERPRET=1 python kernels/paged_decode.py --small    # CPU smoke check in Triton's interpreter

Bytes counted: K and V of every cached token once (Hkv heads), plus q and o.
"""
import argparse, os, sys, time
import torch
import torch.nn.functional as F

# dense datasheet peaks: (name fragment, fp16/bf16 tensor TFLOP/s, fp32 TFLOP/s, memory TB/s)
PEAKS = [("H200 NVL", 835, 60, 4.8), ("H200", 989, 67, 4.8), ("H100 NVL", 835, 60, 3.9), ("H100 PCIe", 756, 51, 2.0),
         ("H100", 989, 67, 3.35), ("A100 80GB PCIe", 312, 19.5, 1.935), ("A100-SXM4-80GB", 312, 19.5, 2.039),
         ("A100", 312, 19.5, 1.555)]

def device_bandwidth():
    "(device name, datasheet memory bandwidth in GB/s or None)."
    if not torch.cuda.is_available(): return "CPU (Triton interpreter)", None
    name = torch.cuda.get_device_name()
    for frag, _, _, tbs in PEAKS:
        if frag in name: return name, tbs * 1000
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
        sys.exit("paged_decode.py benchmarks a GPU kernel and found no CUDA device. For a CPU smoke check run:\n"
                 "    TRITON_INTERPRET=1 python kernels/paged_decode.py --small")
    if args.dtype == "bf16": sys.exit("the Triton interpreter computes bf16 wrongly: use --dtype fp16 or fp32 on CPU")

import triton
from minfer.flash import decode_attention, random_paged_batch, default_num_splits

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
dev = "cuda" if torch.cuda.is_available() else "cpu"
dtypes = [DTYPES[args.dtype]] if args.dtype else ([torch.bfloat16] if dev == "cuda" else [torch.float32, torch.float16])
Hq, Hkv, D, BS = args.heads, args.kv_heads, args.head_dim, args.block_size
if args.small and dev == "cpu": Hq, Hkv, D = 4, 2, 32       # the interpreter runs every program in Python


def bench_ms(fn):
    if dev == "cuda": return triton.testing.do_bench(fn, warmup=25, rep=100)
    fn(); t = time.perf_counter(); fn(); return (time.perf_counter() - t) * 1e3   # interpreter: one run, for show

def naive_paged(q, k_cache, v_cache, block_tables, n):
    "Chapter 03's PyTorch path for equal lengths n: gather K/V through the block table, materialise the scores."
    pos = torch.arange(n, device=q.device)
    slots = block_tables[:, pos // BS].long() * BS + pos % BS                     # [B, n]
    k = k_cache.view(-1, Hkv, D)[slots].repeat_interleave(Hq // Hkv, 2)            # [B, n, Hq, D] copies
    v = v_cache.view(-1, Hkv, D)[slots].repeat_interleave(Hq // Hkv, 2)
    s = torch.einsum("bhd,bnhd->bhn", q, k) * D ** -0.5
    return torch.einsum("bhn,bnhd->bhd", torch.softmax(s.float(), -1).to(q.dtype), v)

def run(b, **kw): return decode_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, **kw)


def check(dtype):
    cases = [[1, 40, 75, 16], [100, 3]] if args.small else [[1, 17, 4096, 3000, 129, 8191, 64, 2], [32768]]
    for lens in cases:
        b = random_paged_batch(lens, [1] * len(lens), Hq, Hkv, D, BS, dtype=dtype, device=dev, seed=1)
        for splits in (None, 1, 3):
            err = (run(b, num_splits=splits).float() - b.reference()).abs().max().item()
            status = "ok" if err <= TOL[dtype] else "FAILED"
            print(f"check {str(dtype):15s} seq_lens={lens} num_splits={splits or 'auto'}: max abs err {err:.1e} "
                  f"(tol {TOL[dtype]}) {status}")
            if status != "ok": sys.exit(1)


def benchmark(dtype):
    name, peak = device_bandwidth()
    print(f"\n{name}: {Hq} q heads, {Hkv} KV heads, head dim {D}, {dtype}, KV blocks of {BS}; "
          f"peak {peak or '?'} GB/s (datasheet)")
    print(f"{'batch':>5} {'context':>7} {'splits':>6} | {'triton ms':>9} {'GB/s':>7} {'%peak':>6} | {'SDPA ms':>8} {'GB/s':>7} | "
          f"{'naive ms':>9} {'GB/s':>7}")
    sizes = [(1, 64), (3, 100)] if args.small and dev == "cpu" else \
            [(1, 512), (4, 1024)] if args.small else \
            [(b, n) for b in (1, 8, 32, 128) for n in (512, 2048, 8192, 32768) if b * n <= 2**20]
    esize = torch.finfo(dtype).bits // 8
    for batch, n in sizes:
        b = random_paged_batch([n] * batch, [1] * batch, Hq, Hkv, D, BS, dtype=dtype, device=dev)
        nbytes = (2 * batch * n * Hkv * D + 2 * batch * Hq * D) * esize
        splits = default_num_splits(batch, Hkv, b.block_tables.shape[1] * BS, 64 if dev == "cuda" else 32, b.q.device)
        t_tri = bench_ms(lambda: run(b))
        q4 = b.q[:, :, None, :]                                                   # [B, Hq, 1, D]
        k4, v4 = (torch.stack(x).transpose(1, 2).contiguous() for x in (b.k, b.v))  # [B, Hkv, n, D] contiguous
        try: t_sdpa = bench_ms(lambda: F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True))
        except RuntimeError: t_sdpa = float("nan")                                 # no GQA-capable backend here
        big = batch * n * Hq * D * esize * 2 > 8e9                                 # naive's expanded copies
        t_naive = float("nan") if big else bench_ms(lambda: naive_paged(b.q, b.k_cache, b.v_cache, b.block_tables, n))
        if not big:  # the naive path is a benchmark peer, so check it too
            err = (naive_paged(b.q, b.k_cache, b.v_cache, b.block_tables, n).float() - run(b).float()).abs().max().item()
            assert err <= 2 * TOL[dtype], f"naive and triton disagree by {err:.1e}"
        gbs = lambda t: nbytes / t / 1e6
        pct = f"{100 * gbs(t_tri) / peak:5.1f}%" if peak else "     ?"
        print(f"{batch:5d} {n:7d} {splits:6d} | {t_tri:9.3f} {gbs(t_tri):7.4g} {pct:>6} | {t_sdpa:8.3f} {gbs(t_sdpa):7.4g} | "
              f"{t_naive:9.3f} {gbs(t_naive):7.4g}")
        del b, q4, k4, v4


if __name__ == "__main__":
    if dev == "cpu": print("CPU: Triton interpreter, tiny shapes; timings below only show the script runs, they mean nothing")
    for dt in dtypes:
        check(dt)
        benchmark(dt)
