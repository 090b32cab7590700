"""Tensor parallelism (chapter 13) on this machine: decode step time and tokens/s at N = 1 (one process, all cores) and
N = 2 (two ranks, the cores shared out), batch 1 and batch 8, alternating N = 1, N = 2, ... and reporting medians;
for N = 2 the share of rank 0's time spent inside the collectives (`RankGroup.comm_seconds`: the all-reduces, the
step's broadcast, and rank 0's waits for the slower rank). Next to each row: bytes per token per rank from
`tp_bytes_per_token` (weights and wire) and the bandwidth floor (copy bandwidth / those bytes, one memory shared by
both ranks on one machine). Same model, switches (`kernels="cpu"`, fp32), prompts and token counts for both.

    python benchmarks/bench_tp.py [--tokens 64] [--repeats 3] [--record]
"""
import argparse, datetime, os, platform, statistics, sys, time
from pathlib import Path

import torch
from minfer import LLM, SamplingParams
from minfer.roofline import measure_bandwidth
from minfer.tp import tp_bytes_per_token

PROMPTS = ["Once upon a time, in a small village by the sea,", "The three primary colors are",
           "def fibonacci(n):", "List of European capitals: Paris, Berlin,", "Water boils at",
           "The mitochondria is the powerhouse of the cell.", "Q: What is the boiling point of water?\nA:", "1, 2, 3,"]


def machine():
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), platform.processor())
    flags = Path("/proc/cpuinfo").read_text()
    isa = "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else "no AVX2"
    return f"{cpu} ({isa}), {os.cpu_count()} cores, torch {torch.__version__}"


def run(llm, batch, n, group=None):
    "-> (seconds per step, generated tokens per second, share of rank 0's time in collectives or None)."
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=4), raw=True)
    comm = group.comm_seconds if group else 0.0
    t = time.perf_counter()
    outs = llm.generate(PROMPTS[:batch], SamplingParams(max_tokens=n, ignore_eos=True), raw=True)
    total = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    return total / n, tokens / total, ((group.comm_seconds - comm) / total if group else None)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--record", action="store_true")
    a = ap.parse_args(argv)
    threads = torch.get_num_threads()
    one = LLM(kernels="cpu")
    split = LLM(kernels="cpu", tensor_parallel_size=2)  # sets this process to its share of the threads
    results = {(n, b): [] for n in (1, 2) for b in (1, 8)}
    for _ in range(a.repeats):
        for b in (1, 8):
            torch.set_num_threads(threads)
            results[1, b].append(run(one, b, a.tokens))
            torch.set_num_threads(max(1, threads // 2))
            results[2, b].append(run(split, b, a.tokens, split.engine.group))
    split.close()
    torch.set_num_threads(threads)
    bw = measure_bandwidth()
    cfg = one.model_config
    lines = [f"# Tensor parallelism on one machine, {datetime.datetime.now():%Y-%m-%d %H:%M}", "",
             f"Machine: {machine()}. Command: `python benchmarks/bench_tp.py --tokens {a.tokens} --repeats "
             f"{a.repeats}`. fp32, kernels=cpu, the default model; medians of {a.repeats} alternating runs; copy "
             f"bandwidth {bw / 1e9:.1f} GB/s (one memory for both ranks).", "",
             "| ranks | batch | ms per step | tok/s | in collectives | weights/rank | wire/rank | floor tok/s |",
             "|---|---|---|---|---|---|---|---|"]
    for (n, b), r in results.items():
        step, tps = statistics.median(x[0] for x in r), statistics.median(x[1] for x in r)
        comm = statistics.median(x[2] for x in r) if n > 1 else None
        bytes_ = tp_bytes_per_token(cfg, n, "float32", batch=b)
        floor = bw / (bytes_["weights"] * n)  # tokens/s: n ranks read n slices of the step from the one memory
        lines.append(f"| {n} | {b} | {step * 1e3:.1f} | {tps:.1f} | {'-' if comm is None else f'{comm:.0%}'} | "
                     f"{bytes_['weights'] * b / 1e6:.0f} MB | {bytes_['wire'] * b / 1e3:.0f} kB | {floor:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.record:
        out = Path(__file__).parent / f"tp-{datetime.datetime.now():%Y-%m-%d-%H%M}.md"
        out.write_text(text)
        print("recorded", out)


if __name__ == "__main__":
    main()
