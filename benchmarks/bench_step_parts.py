"""Where a one-call decode step's time goes as its rows grow (chapter 05c's `StepLlama.timings`), in the steps a real
run makes: plain decoding (one row per step), EAGLE with k = 2 (three-row verifies) and static token trees of 4 and 8
nodes (5 and 9 rows), greedy on chapter 10a's 4 first open-ended prompts, 64 tokens each, batch 1. For each number of
rows: the median wall time of the model's forward and the mean seconds the call charged to each part (layer products,
LM head, norms, RoPE + KV write + attention, SiLU x up). Needs the default EAGLE head (`minfer train-eagle`).

    python benchmarks/bench_step_parts.py [--record]
"""
import argparse, datetime, statistics, sys, time
from pathlib import Path
import torch
from minfer import LLM  # every chapter loaded: its weight formats, kernels and switches
from minfer.sequence import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import machine
from bench_speculative import workloads

PARTS = ("products", "LM head", "norms", "attention", "SiLU x up")
SPECS = {"plain": None, "eagle k=2": {"method": "eagle", "num_speculative_tokens": 2, "adaptive": False},
         "static tree 4": {"method": "eagle", "tree": "static", "num_speculative_tokens": 4},
         "static tree 8": {"method": "eagle", "tree": "static", "num_speculative_tokens": 8}}

def timed_steps(llm, prompts, params):
    "-> {rows: [(wall seconds, parts [5])]} for every one-call forward of the target while `prompts` run."
    model, steps = llm.model, {}
    forward = type(model).forward
    def timed(self, tokens, positions, attention, logits_rows=None):
        self.timings = torch.zeros(5, dtype=torch.float64)
        t = time.perf_counter()
        out = forward(self, tokens, positions, attention, logits_rows)
        wall = time.perf_counter() - t
        if self.timings.sum() > 0: steps.setdefault(tokens.shape[0], []).append((wall, self.timings.clone()))
        self.timings = None
        return out
    model.forward = timed.__get__(model)
    try:
        for p in prompts: llm.generate([p], params)
    finally:
        del model.forward
    return steps

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--record", action="store_true")
    a = ap.parse_args()
    prompts, params = workloads()["open-ended"][:4], SamplingParams(max_tokens=64, temperature=0, seed=0)
    lines = ["# Where a one-call decode step's time goes as its rows grow (chapter 05c's `StepLlama.timings`)", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- machine: {machine()}", "- command: `python benchmarks/bench_step_parts.py`",
             "- steps: those of greedy runs of chapter 10a's first 4 open-ended prompts, 64 tokens, batch 1, default "
             "switches (fp32, kernels='step'); rows seen fewer than 10 times are left out",
             "- wall: the median of the forward's time; parts: the mean ms the call charged to each", "",
             "| run | rows | steps | wall (ms) | wall / one-row step | " + " | ".join(PARTS) + " |",
             "|---|---|---|---|---|" + "---|" * len(PARTS)]
    one_row = None
    for name, spec in SPECS.items():
        llm = LLM(speculative=spec) if spec else LLM()
        llm.generate(prompts[:1], SamplingParams(max_tokens=8))  # warm-up: kernels built, pages touched
        for rows, seen in sorted(timed_steps(llm, prompts, params).items()):
            if len(seen) < 10: continue
            wall = statistics.median(w for w, _ in seen) * 1000
            parts = sum(t for _, t in seen) / len(seen) * 1000
            if name == "plain" and rows == 1: one_row = wall
            lines.append(f"| {name} | {rows} | {len(seen)} | {wall:.2f} | {wall / one_row:.2f} | "
                         + " | ".join(f"{x:.2f}" for x in parts.tolist()) + " |")
        del llm
    text = "\n".join(lines) + "\n"
    print(text)
    if a.record:
        out = Path(__file__).parent / f"step-parts-{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d-%H%M}.md"
        out.write_text(text)
        print("recorded", out)

if __name__ == "__main__":
    main()
