"""Tensor parallelism (chapter 13) on this machine: decode step time and tokens/s at N = 1 (one process, all cores) and
N = 2 (two ranks, the cores shared out) with the embedding and LM head replicated and split by vocabulary
(`minfer.tp.VOCAB_PARALLEL`), batch 1 and batch 8, alternating the three and reporting medians; for N = 2 the share
of rank 0's time spent inside the collectives (`RankGroup.comm_seconds`: the all-reduces, the step's broadcast, the
logits' gather, and rank 0's waits for the slower rank). Next to each row: bytes per token per rank from
`tp_bytes_per_token` (weights and wire), the collectives per step, the weight bytes rank 0 holds (its parameters and
oneDNN's packed copies, counted once each) and the bandwidth floor (copy bandwidth / the weight bytes, one memory
shared by both ranks on one machine). Same model, switches (`kernels="cpu"`, fp32), prompts and token counts for all.

    python benchmarks/bench_tp.py [--tokens 64] [--repeats 3] [--record]
"""
import argparse, datetime, os, platform, statistics, sys, time
from pathlib import Path

import torch
import minfer.tp
from minfer import LLM, SamplingParams
from minfer.roofline import PackedLinear
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


def held_bytes(model):
    "Bytes of weights `model` holds: every parameter once (a tied pair is one) and every packed copy."
    tensors = {p.data_ptr(): p for p in model.parameters()}
    tensors.update({id(m.packed): m.packed for m in model.modules() if hasattr(m, "packed")})  # oneDNN: no pointer
    return sum(t.numel() * t.element_size() for t in tensors.values())


def head_ms(head, batch, repeats=20):
    "Milliseconds of one LM head product alone on one thread (fastest of `repeats`): what a rank computes per step."
    x, times = torch.randn(batch, head.in_features), []
    for _ in range(repeats):
        t = time.perf_counter()
        head(x)
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


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
    engines = {(1, "whole"): one}
    for vocab_parallel in (False, True):  # each sets this process to its share of the threads
        minfer.tp.VOCAB_PARALLEL = vocab_parallel
        engines[2, "split" if vocab_parallel else "replicated"] = LLM(kernels="cpu", tensor_parallel_size=2)
    minfer.tp.VOCAB_PARALLEL = True
    results = {(key, b): [] for key in engines for b in (1, 8)}
    for _ in range(a.repeats):
        for b in (1, 8):
            for (n, head), llm in engines.items():
                torch.set_num_threads(threads if n == 1 else max(1, threads // n))
                results[(n, head), b].append(run(llm, b, a.tokens, llm.engine.group if n > 1 else None))
    held = {key: held_bytes(llm.engine.model) for key, llm in engines.items()}
    for key, llm in engines.items():
        if key[0] > 1: llm.close()
    torch.set_num_threads(1)  # as a rank of two has: the head whole against its half, the compute the split saves
    whole_head = one.engine.model.lm_head
    half_head = PackedLinear(whole_head.weight[:one.model_config.vocab_size // 2])
    head = {b: (head_ms(whole_head, b), head_ms(half_head, b)) for b in (1, 8)}
    torch.set_num_threads(threads)
    bw = measure_bandwidth()
    cfg = one.model_config
    lines = [f"# Tensor parallelism on one machine, {datetime.datetime.now():%Y-%m-%d %H:%M}", "",
             f"Machine: {machine()}. Command: `python benchmarks/bench_tp.py --tokens {a.tokens} --repeats "
             f"{a.repeats}`. fp32, kernels=cpu, the default model; medians of {a.repeats} alternating runs; copy "
             f"bandwidth {bw / 1e9:.1f} GB/s (one memory for both ranks). LM head: the embedding and the LM head "
             f"(tied: one {cfg.vocab_size} x {cfg.hidden_size} table, "
             f"{cfg.vocab_size * cfg.hidden_size * 4 / 1e6:.1f} MB of fp32) whole on every rank or split by "
             "vocabulary. The LM head's product alone, one thread, fastest of "
             "20: " + ", ".join(f"batch {b}: {w:.1f} ms whole, {h:.1f} ms half" for b, (w, h) in head.items()) + ".",
             "",
             "| ranks | LM head | batch | ms per step | tok/s | in collectives | collectives/step (+ broadcast) "
             "| weights read/rank "
             "| weights held/rank | wire/rank | floor tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for ((n, head), b), r in results.items():
        step, tps = statistics.median(x[0] for x in r), statistics.median(x[1] for x in r)
        comm = statistics.median(x[2] for x in r) if n > 1 else None
        bytes_ = tp_bytes_per_token(cfg, n, "float32", batch=b, vocab_parallel=head == "split")
        floor = bw / (bytes_["weights"] * n)  # tokens/s: n ranks read n slices of the step from the one memory
        lines.append(f"| {n} | {head} | {b} | {step * 1e3:.1f} | {tps:.1f} | {'-' if comm is None else f'{comm:.0%}'} "
                     f"| {bytes_['collectives']} | {bytes_['weights'] * b / 1e6:.0f} MB | {held[n, head] / 1e6:.0f} MB "
                     f"| {bytes_['wire'] * b / 1e3:.0f} kB | {floor:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.record:
        out = Path(__file__).parent / f"tp-{datetime.datetime.now():%Y-%m-%d-%H%M}.md"
        out.write_text(text)
        print("recorded", out)


if __name__ == "__main__":
    main()
