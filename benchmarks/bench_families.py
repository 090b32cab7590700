"""Do the families stay on the fast path? Random-weight Qwen2 (q/k/v biases) and Qwen3 (q/k norms) of SmolLM2-135M's
shape against the Llama path (the default model, and a random-weight Llama of the same shape), each with `LLM`'s
default switches: batch-1 decode (one prompt, 128 tokens) and the 64-request decode-heavy mix of
bench_throughput.py. Then DeepSeek-style latent attention (chapter 12d) and Qwen3.5's hybrid of gated DeltaNet and
full layers (12g) at the same shape, each through the fastest paths it runs: for every faster path `LLM` did not pick,
the engine's one-line reason is printed. One process, the models alternating (A B C A B C ...), medians.

    python benchmarks/bench_families.py [--dtype float32] [--repeats 3] [--requests 64] [--record]

Target (chapter 12a): each family within 10% of the Llama path on both measurements.
"""
import argparse, datetime, statistics, sys, tempfile, time
from pathlib import Path

import torch
from minfer import LLM  # every chapter loaded: its weight formats, kernels and switches
from minfer.engine import EngineConfig
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
# the same shape with other attention: DeepSeek-V2-Lite's proportions of latent attention (a 128-wide latent, keys of
# 48 + 16 RoPE dimensions, no query bottleneck, every MLP dense), and Qwen3.5's (a full layer every 4th, the linear
# ones with 4 key heads and 8 value heads of 64)
OTHER_ATTENTION = {
    "deepseek_v3": dict(num_key_value_heads=9, kv_lora_rank=128, q_lora_rank=None, qk_nope_head_dim=48,
                        qk_rope_head_dim=16, v_head_dim=64, first_k_dense_replace=30, n_routed_experts=8,
                        num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=256,
                        num_mtp_layers=0),
    "qwen3_5_text": dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                         linear_value_head_dim=64)}
# the fastest switches on a CPU, which `LLM` picks where a model runs them (chapters 05b and 05c)
FASTEST = (("kernels", "step"), ("attention", "cpu"))


def path_and_why(folder, llm, dtype):
    "-> the switches `LLM` picked, then for each faster one it did not pick, the engine's one-line reason."
    c = llm.config
    lines = [f"kernels={c.kernels}, attention={c.attention}, kv_dtype={c.kv_dtype}, weights={c.weights}"]
    for key, value in FASTEST:
        if getattr(c, key) == value:
            continue
        try:
            EngineConfig(model=folder, dtype=dtype, **{key: value}).resolve()
            lines.append(f"{key}={value!r} runs too, and was not picked")
        except ValueError as e:
            lines.append(f"not {key}={value!r}: {e}")
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64, help="requests in the decode-heavy mix")
    ap.add_argument("--tokens", type=int, default=128, help="tokens of the batch-1 decode")
    ap.add_argument("--record", action="store_true")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    folders = {"llama (default model)": str(default_model_dir())}
    for name in ("llama", "qwen2", "qwen3"):
        tiny_random_model(name, work / name, **SHAPE)
        folders[f"{name} (random, same shape)"] = str(work / name)
    for name, attention in OTHER_ATTENTION.items():
        tiny_random_model(name, work / name, **{**SHAPE, **attention})
        folders[f"{name} (random, same shape)"] = str(work / name)
    llms = {k: LLM(f, dtype=a.dtype) for k, f in folders.items()}
    paths = {k: path_and_why(folders[k], llm, a.dtype) for k, llm in llms.items()}
    for name, said in paths.items():
        print(f"{name}: " + "\n    ".join(said), flush=True)
    tok = llms["llama (default model)"].tokenizer
    prompt = tok.encode("The history of the printing press begins")
    mix = make_workload(tok, a.requests, seed=0)
    b1, mixed = {k: [] for k in llms}, {k: [] for k in llms}
    for name, llm in llms.items(): time_minfer(llm, prompt, 8)  # warm up
    for r in range(a.repeats):
        for name, llm in llms.items():
            total, tpot, _ = time_minfer(llm, prompt, a.tokens)
            b1[name].append(1 / tpot)
            mixed[name].append(run_minfer(llm, mix))
            print(f"repeat {r}: {name:33s} batch 1 {b1[name][-1]:6.1f} tok/s   "
                  f"{a.requests}-request mix {mixed[name][-1]:6.1f} tok/s", flush=True)
    med = lambda xs: statistics.median(xs)
    base = "llama (default model)"
    lines = [f"| model | switches | batch-1 decode tok/s | vs Llama | {a.requests}-request mix tok/s | vs Llama |",
             "|---|---|---|---|---|---|"]
    for name, llm in llms.items():
        c = llm.config
        one, mix = med(b1[name]), med(mixed[name])
        lines.append(f"| {name} | kernels={c.kernels}, attention={c.attention}, kv_dtype={c.kv_dtype}, "
                     f"weights={c.weights} | {one:.1f} | {one / med(b1[base]):.2f} | {mix:.1f} | "
                     f"{mix / med(mixed[base]):.2f} |")
    table = "\n".join(lines)
    why = "\n".join(f"- {name}: " + "; ".join(said[1:]) for name, said in paths.items() if len(said) > 1)
    print(table)
    if a.record:
        now = datetime.datetime.now()
        out = Path(__file__).parent / f"families-{now:%Y-%m-%d-%H%M}.md"
        out.write_text(f"# Model families on the fast path ({a.dtype}), medians of {a.repeats} alternating runs\n\n"
                       f"- date: {now:%Y-%m-%d %H:%M}\n- machine: {machine()}\n"
                       f"- command: `python benchmarks/bench_families.py {' '.join(sys.argv[1:])}`\n"
                       f"- batch 1: one prompt ({len(prompt)} tokens), {a.tokens} tokens, time per output token; "
                       f"{a.requests}-request mix: bench_throughput.py's decode-heavy mix (make_workload seed 0), "
                       f"useful tokens/s\n"
                       f"- models: SmolLM2-135M-Instruct, and random-weight Llama, Qwen2, Qwen3, DeepSeek-V3 (latent "
                       f"attention) and Qwen3.5 (hybrid) of its shape (`tiny_random_model(..., **SHAPE)`), each with "
                       f"LLM's default switches\n\n{table}\n\nFaster paths not taken, and why:\n\n{why or '- none'}\n")
        print(f"\nrecorded in {out}")
    for llm in llms.values(): llm.close()


if __name__ == "__main__":
    main()
