"""Speculative decoding (chapter 10): prompt lookup with k in {1, 2, 4, 8} and adaptive k against no speculation, on a
copy-heavy workload (quote, edit or summarise a given paragraph of data/text/course.txt; code with repeated
identifiers) and an open-ended one (stories, explanations), at batch 1 (prompts one after another) and batch 8 (one
`generate` call), greedy, natural stops, chat template (as a user would call it). One process, every configuration in
turn within each repeat (A B C ... A B C ...), medians. Every output must equal the run without speculation.

    python benchmarks/bench_speculative.py [--repeats 2] [--max-tokens 64] [--record]
"""
import argparse, datetime, json, os, statistics, sys, time
from pathlib import Path

import torch
from minfer import LLM  # every chapter loaded: its weight formats, kernels and switches
from minfer.gguf import data_dir
from minfer.sequence import SamplingParams
from minfer.speculative import SPECULATORS, speculative_config
from minfer.step_times import machine_step_times
from minfer.roofline import measure_bandwidth, weight_bytes_per_step

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import machine

CODE = '''def total_price(items, tax_rate):
    total_price = 0
    for item in items:
        total_price = total_price + item.price * item.quantity
    total_price = total_price * (1 + tax_rate)
    return total_price
'''

def workloads():
    text = (data_dir() / "text" / "course.txt").read_text()
    paras = [p.strip() for p in text.split("\n\n") if 300 < len(p.strip()) < 700]
    copy = [f"Repeat the following text exactly, word for word:\n\n{paras[0]}",
            f"Rewrite this paragraph, replacing the word 'the' with 'THE' and changing nothing else:\n\n{paras[1]}",
            f"Summarise this text, quoting its key sentences:\n\n{paras[2]}",
            f"Rename the variable total_price to cost in this Python function and show the whole function:\n\n{CODE}",
            f"Quote the first three sentences of this text:\n\n{paras[3]}",
            f"Fix any grammar mistakes in this text and return it in full:\n\n{paras[4]}",
            f"Add a docstring to this function and return the whole code:\n\n{CODE}",
            f"Copy this text and then say how many sentences it has:\n\n{paras[5]}"]
    open_ended = ["Tell me a story about a dragon who learns to paint.", "Why is the sky blue? Explain it to a child.",
                  "Write a short poem about the sea.", "What are three good habits for staying healthy?",
                  "Describe your ideal weekend.", "How does a bicycle work?",
                  "Give me some ideas for a birthday party.", "What would happen if the moon disappeared?"]
    return {"copy-heavy": copy, "open-ended": open_ended}

CONFIGS = {"none": None,
           **{f"k={k}": {"method": "ngram", "num_speculative_tokens": k, "adaptive": False} for k in (1, 2, 4, 8)},
           "adaptive": {"method": "ngram", "num_speculative_tokens": 8, "adaptive": True},
           "default": "ngram"}  # named alone, as a user calls it: adaptive, k up to 4, on this machine's curve

def run(llm, prompts, batch, params):
    "-> (generated tokens, seconds, outputs): prompts in groups of `batch`, each group one `generate` call."
    t, outs = time.perf_counter(), []
    for i in range(0, len(prompts), batch): outs += llm.generate(prompts[i:i + batch], params)
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - t, outs

def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch1-prompts", type=int, default=4, help="prompts per workload at batch 1 (all 8 at batch 8)")
    ap.add_argument("--record", action="store_true")
    a = ap.parse_args(argv)
    params = SamplingParams(max_tokens=a.max_tokens)
    # one model and engine for every configuration (six copies of the model and its KV pool do not fit in memory
    # beside other jobs): each run switches the engine's speculator, what `LLM(speculative=...)` would have built
    llm = LLM()
    specs = {name: speculative_config(spec) for name, spec in CONFIGS.items()}
    speculators = {name: None if spec is None else SPECULATORS[spec.method](spec, llm.engine)
                   for name, spec in specs.items()}
    work = workloads()
    cases = [(w, b) for w in work for b in (1, 8)]
    times = {(c, w, b): [] for c in CONFIGS for w, b in cases}
    stats, want = {}, {}
    llm.generate("warm up", SamplingParams(max_tokens=4))
    for r in range(a.repeats):
        for w, b in cases:
            prompts = work[w] if b == 8 else work[w][:a.batch1_prompts]
            for name, speculator in speculators.items():
                llm.engine.lookahead = speculator
                n, dt, outs = run(llm, prompts, b, params)
                ids = [o.token_ids for o in outs]
                if name == "none": want.setdefault((w, b), ids)
                assert ids == want[(w, b)], f"{name} on {w} batch {b}: output differs from no speculation"
                times[(name, w, b)].append(n / dt)
                m = [o.metrics for o in outs]
                drafted = sum(x["acceptance_rate"] is not None for x in m)
                stats[(name, w, b)] = dict(
                    acceptance=statistics.mean([x["acceptance_rate"] for x in m
                                                if x["acceptance_rate"] is not None] or [0]),
                    tokens_per_pass=statistics.mean([x["tokens_per_pass"] for x in m if x["tokens_per_pass"]] or [1]),
                    requests_with_guesses=drafted, tokens=n)
                print(f"repeat {r}: {w:10s} batch {b}: {name:8s} {n / dt:7.2f} tok/s  acceptance "
                      f"{stats[(name, w, b)]['acceptance']:.2f}  "
                      f"tokens/pass {stats[(name, w, b)]['tokens_per_pass']:.2f}",
                      flush=True)
    res = {w: {str(b): {} for b in (1, 8)} for w in work}
    for (name, w, b), v in times.items():
        base = statistics.median(times[("none", w, b)])
        # each repeat against the plain run of the same repeat, a minute earlier: the VM's speed drifts between phases
        paired = [x / y for x, y in zip(v, times[("none", w, b)])]
        res[w][str(b)][name] = dict(tokens_per_s=statistics.median(v), speedup=statistics.median(v) / base,
                                    per_repeat=paired, **stats[(name, w, b)])
    bw = measure_bandwidth()
    curve, one_row = machine_step_times(llm.engine.runner)
    floor = bw / weight_bytes_per_step(llm.model_config, "float32")
    lines = [f"# Speculative decoding (prompt lookup), medians of {a.repeats} alternating runs", "",
             f"- date: {datetime.datetime.now():%Y-%m-%d %H:%M}",
             f"- machine: {machine()} (1-minute load average at the end: {os.getloadavg()[0]:.1f}; "
             "above the core count means other jobs shared it)",
             f"- command: `python benchmarks/bench_speculative.py --repeats {a.repeats} --max-tokens {a.max_tokens}"
             f"{' --record' if a.record else ''}`",
             f"- model: the default (SmolLM2-135M-Instruct), default switches ({llm.config.kernels} kernels, "
             f"{llm.config.dtype}), greedy, natural stops, max_tokens={a.max_tokens}, chat template",
             f"- batch 1: the first {a.batch1_prompts} prompts of each workload one after another; batch 8: all 8 "
             "prompts in one `generate` call",
             "- every speculative run's tokens were identical to the run without speculation (asserted)",
             f"- floor for scale: batch-1 decode cannot beat {bw / 1e9:.1f} GB/s / 538 MB of fp32 weights = "
             f"{floor:.0f} tok/s without speculation; speculation beats it by producing several tokens per "
             "weight stream",
             "- speedup: median tok/s over the plain run's median tok/s; per repeat: against the plain run of the same "
             "repeat",
             f"- this machine's verify-step curve, which adaptive k reads (rows: time in one-row steps; one row "
             f"{one_row * 1e3:.1f} ms): " + ", ".join(f"{r}: {t:.2f}" for r, t in curve),
             "", "| workload | batch | config | tok/s | speedup | per repeat | acceptance | tokens / target pass |",
             "|---|---|---|---|---|---|---|---|"]
    for w in work:
        for b in ("1", "8"):
            for name in CONFIGS:
                x = res[w][b][name]
                lines.append(f"| {w} | {b} | {name} | {x['tokens_per_s']:.1f} | {x['speedup']:.2f}x | "
                             f"{', '.join(f'{r:.2f}' for r in x['per_repeat'])} | "
                             f"{x['acceptance']:.2f} | {x['tokens_per_pass']:.2f} |")
    lines += ["", "Targets: n-gram >= 1.5x batch-1 tokens/s on the copy-heavy workload with identical greedy output; "
              "the default (`speculative=\"ngram\"`, adaptive) at least 0.98x of no speculation on the open-ended one, "
              "at batch 1 and 8."]
    report = "\n".join(lines) + "\n"
    print(report)
    if a.record:
        stamp = f"{datetime.datetime.now():%Y-%m-%d-%H%M}"
        out = Path(__file__).parent / f"speculative-{stamp}"
        out.with_suffix(".md").write_text(report)
        out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
        print("recorded", out.with_suffix(".md"))

if __name__ == "__main__":
    main()
