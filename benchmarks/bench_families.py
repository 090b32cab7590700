"""Do the families stay on the fast path? Random-weight Qwen2 (q/k/v biases) and Qwen3 (q/k norms) of SmolLM2-135M's
shape against the Llama path (the default model, and a random-weight Llama of the same shape), each with `LLM`'s
default switches: batch-1 decode (one prompt, 128 tokens) and the 64-request decode-heavy mix of
bench_throughput.py. One process, the models alternating (A B C A B C ...), medians.

    python benchmarks/bench_families.py [--dtype float32] [--repeats 3] [--record]

Target (chapter 12a): each family within 10% of the Llama path on both measurements.
"""
import argparse, datetime, statistics, sys, tempfile, time
from pathlib import Path

import torch
from minfer import LLM  # every chapter loaded: its weight formats, kernels and switches
from minfer.gguf import default_model_dir
from minfer.sequential import make_workload
from minfer.families import tiny_random_model

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import machine, time_minfer
from bench_throughput import run_minfer

# SmolLM2-135M-Instruct's numbers (chapter 00a)
SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True,
             rope_theta=100000.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--record", action="store_true")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    folders = {"llama (default model)": str(default_model_dir())}
    for name in ("llama", "qwen2", "qwen3"):
        tiny_random_model(name, work / name, **SHAPE)
        folders[f"{name} (random, same shape)"] = str(work / name)
    llms = {k: LLM(f, dtype=a.dtype) for k, f in folders.items()}
    tok = llms["llama (default model)"].tokenizer
    prompt = tok.encode("The history of the printing press begins")
    mix = make_workload(tok, 64, seed=0)
    b1, mixed = {k: [] for k in llms}, {k: [] for k in llms}
    for name, llm in llms.items(): time_minfer(llm, prompt, 8)  # warm up
    for r in range(a.repeats):
        for name, llm in llms.items():
            total, tpot, _ = time_minfer(llm, prompt, 128)
            b1[name].append(1 / tpot)
            mixed[name].append(run_minfer(llm, mix))
            print(f"repeat {r}: {name:26s} batch 1 {b1[name][-1]:6.1f} tok/s   "
                  f"64-request mix {mixed[name][-1]:6.1f} tok/s", flush=True)
    med = lambda xs: statistics.median(xs)
    base = "llama (default model)"
    lines = ["| model | switches | batch-1 decode tok/s | vs Llama | 64-request mix tok/s | vs Llama |",
             "|---|---|---|---|---|---|"]
    for name, llm in llms.items():
        c = llm.config
        one, mix = med(b1[name]), med(mixed[name])
        lines.append(f"| {name} | kernels={c.kernels}, attention={c.attention}, weights={c.weights} | {one:.1f} | "
                     f"{one / med(b1[base]):.2f} | {mix:.1f} | {mix / med(mixed[base]):.2f} |")
    table = "\n".join(lines)
    print(table)
    if a.record:
        now = datetime.datetime.now()
        out = Path(__file__).parent / f"families-{now:%Y-%m-%d-%H%M}.md"
        out.write_text(f"# Model families on the fast path ({a.dtype}), medians of {a.repeats} alternating runs\n\n"
                       f"- date: {now:%Y-%m-%d %H:%M}\n- machine: {machine()}\n"
                       f"- command: `python benchmarks/bench_families.py {' '.join(sys.argv[1:])}`\n"
                       f"- batch 1: one prompt ({len(prompt)} tokens), 128 tokens, time per output token; 64-request "
                       f"mix: bench_throughput.py's decode-heavy mix (make_workload seed 0), useful tokens/s\n"
                       f"- models: SmolLM2-135M-Instruct, and random-weight Llama, Qwen2, Qwen3 of its shape "
                       f"(`tiny_random_model(..., **SHAPE)`), each with LLM's default switches\n\n{table}\n")
        print(f"\nrecorded in {out}")
    for llm in llms.values(): llm.close()


if __name__ == "__main__":
    main()
