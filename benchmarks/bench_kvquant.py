"""KV-cache quantization (chapter 09): tokens per GB, requests that fit, and throughput on a KV-bound workload.

Every format runs on the same model with kernels=cpu (the one-call decode step of chapter 05c reads only the model's
dtype) and `--attention`: torch (chapter 03's reference, which reads every format) or auto (each format's own: the C++
decode kernel of chapter 05b for the model's dtype and int8, the reference for fp8 and int4), with the same fixed
`kv_cache_bytes`, sized so the model's own dtype holds only `--fit` of the requests at once: the others wait, or are
preempted and recomputed when the pool runs out. Formats alternate (A B C A B C ...), medians. max_num_seqs is the
number of requests, so int4 reserves its residual window (a block in the model's dtype per running sequence) for
that many out of the same budget.

    python benchmarks/bench_kvquant.py [--requests 16] [--prompt 256] [--out 32] [--fit 4] [--repeats 2] [--dtype float32]
        [--attention torch|auto] [--record]
"""
import argparse, datetime, statistics, sys, time
from pathlib import Path

import torch
from minfer.engine import EngineConfig, build_model, build_engine
from minfer.sequential import workload_sequence
from minfer.paged import KV_FORMATS, kv_token_bytes
from minfer.gguf import default_model_dir, data_dir
from minfer.tokenizer import Tokenizer
from minfer.roofline import MODELS

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import machine

def run(config, model, work, tok):
    "-> (output tokens/s, preemptions, most sequences running at once) of the whole workload through a fresh engine."
    eng = build_engine(config, model)
    seqs = [workload_sequence(ids, n, tok) for ids, n in work]
    for s in seqs: eng.add(s)
    t, most = time.perf_counter(), 0
    while eng.has_unfinished():
        eng.step()
        most = max(most, len(eng.scheduler.running))
    dt = time.perf_counter() - t
    assert all(len(s.output_ids) == n for s, (_, n) in zip(seqs, work))
    return sum(n for _, n in work) / dt, eng.stats["preemptions"], most

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16); ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--out", type=int, default=32); ap.add_argument("--fit", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2); ap.add_argument("--record", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--attention", default="torch", choices=["torch", "auto"])
    a = ap.parse_args()
    tok = Tokenizer(default_model_dir())
    ids = tok.encode((data_dir() / "text" / "evaluation.txt").read_text())
    work = [(ids[i * a.prompt:(i + 1) * a.prompt], a.out) for i in range(a.requests)]
    base = EngineConfig(kernels="cpu", attention=a.attention, device="cpu", dtype=a.dtype).resolve()
    model = build_model(base)
    per_request_blocks = -(-(a.prompt + a.out) // base.block_size)
    budget = a.fit * per_request_blocks * base.block_size * kv_token_bytes(model.cfg, base.dtype)
    formats = ["auto", *KV_FORMATS]
    configs = {f: EngineConfig(kernels="cpu", attention=a.attention, device="cpu", dtype=a.dtype, kv_dtype=f,
                               kv_cache_bytes=budget, max_num_seqs=a.requests).resolve()
               for f in formats}
    results = {f: [] for f in formats}
    for r in range(a.repeats):
        for f in formats:
            results[f].append(run(configs[f], model, work, tok))
            print(f, r, results[f][-1], flush=True)
    lines = [f"# KV-cache quantization: throughput on a KV-bound workload, medians of {a.repeats} alternating runs", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- machine: {machine()} (shared: other engineers' jobs were running)",
             f"- command: `python benchmarks/bench_kvquant.py --requests {a.requests} --prompt {a.prompt} --out {a.out} "
             f"--fit {a.fit} --repeats {a.repeats} --dtype {a.dtype} --attention {a.attention}{' --record' if a.record else ''}`",
             f"- model: SmolLM2-135M-Instruct, {base.dtype}, kernels=cpu, attention: "
             + ", ".join(f"{f} -> {c.attention}" for f, c in configs.items()),
             f"- workload: {a.requests} requests at t=0, prompts of {a.prompt} tokens of data/text/evaluation.txt, "
             f"{a.out} greedy output tokens each; kv_cache_bytes = {budget / 2**20:.1f} MiB, which holds {a.fit} "
             f"requests ({per_request_blocks} blocks of {base.block_size} tokens each) in {base.dtype}", "",
             "| kv_dtype | bytes/token (scales incl.) | blocks in the pool | requests that fit | most running at once | preemptions | output tok/s | vs auto |",
             "|---|---|---|---|---|---|---|---|"]
    auto = statistics.median(x[0] for x in results["auto"])
    for f in formats:
        eng = build_engine(configs[f], model)
        tps = statistics.median(x[0] for x in results[f])
        lines.append(f"| {f} ({configs[f].kv_dtype}) | {kv_token_bytes(model.cfg, configs[f].kv_dtype):,} | {eng.cache.num_blocks} | "
                     f"{eng.cache.num_blocks // per_request_blocks} | {max(x[2] for x in results[f])} | "
                     f"{statistics.median(x[1] for x in results[f]):.0f} | {tps:.1f} | {tps / auto:.2f}x |")
    lines += ["", "Tokens per GiB of KV pool (arithmetic, scales included):", "",
              "| model | " + " | ".join(["float32", "bfloat16", *KV_FORMATS]) + " |", "|---|" + "---|" * (2 + len(KV_FORMATS))]
    for name in ("SmolLM2-135M", "Llama-3.1-8B", "Llama-3.1-70B"):
        lines.append(f"| {name} | " + " | ".join(f"{2**30 // kv_token_bytes(MODELS[name], f):,}"
                                                   for f in ["float32", "bfloat16", *KV_FORMATS]) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.record:
        path = Path(__file__).parent / f"kvquant-{a.dtype}-{a.attention}-{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d-%H%M}.md"
        path.write_text(text); print("recorded", path)

if __name__ == "__main__": main()
