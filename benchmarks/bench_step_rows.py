"""Where chapter 05c's one-call decode step stops paying, on this CPU: plain decoding of B sequences (the default
model and switches, in `--dtype`) with every decode step one `decode_step` call against every step on 05b's modules
(oneDNN's packed GEMM for the products), for each batch size B, alternating, medians; decode tok/s = B / the batch's
median time per output token. `STEP_MAX_ROWS[dtype]` should sit where the two cross.

    python benchmarks/bench_step_rows.py [--dtype float32] [--batches 1 2 3 4 5 6 8 12 16] [--repeats 3]
        [--max-tokens 48] [--record]
"""
import argparse, datetime, os, statistics, sys
from pathlib import Path
import torch
from minfer import LLM  # every chapter loaded: its weight formats, kernels and switches
from minfer.cpu_step import STEP_MAX_ROWS
from minfer.gguf import data_dir
from minfer.sequence import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import machine

WAYS = {"one call": 64, "05b modules": 0}  # the model's `max_rows` for each way: every step one call, or none

def prompts(tokenizer, n, length=24):
    "n prompts of `length` tokens of the course text, spread evenly over it."
    ids = tokenizer.encode((data_dir() / "text" / "course.txt").read_text())
    stride = len(ids) // n
    return [ids[i * stride:i * stride + length] for i in range(n)]

def decode_rate(llm, batch, max_tokens):
    "Decode tok/s of one `generate` of `batch`: B / the median over the batch of its time per output token."
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([llm.tokenizer.decode(p) for p in batch], params, raw=True)
    return len(batch) / statistics.median(o.metrics["tpot"] for o in outs)

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 12, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--record", action="store_true")
    a = ap.parse_args()
    llm, dtype = LLM(dtype=a.dtype), getattr(torch, a.dtype)
    model = llm.engine.model
    default = dict(model.max_rows)
    work = prompts(llm.tokenizer, max(a.batches))
    decode_rate(llm, work[:2], 4)  # warm up: kernels built, pools touched
    rates = {}
    for _ in range(a.repeats):
        for b in a.batches:
            for way, limit in WAYS.items():
                model.max_rows = {dtype: limit}
                rates.setdefault((b, way), []).append(decode_rate(llm, work[:b], a.max_tokens))
    model.max_rows = default
    flags = Path("/proc/cpuinfo").read_text()
    isa = "AVX-512" if " avx512f" in flags else "AVX2"
    lines = ["# Where the one-call decode step stops paying (chapter 05c)\n",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- machine: {machine()}, {isa}; PyTorch's CPU capability: {torch.backends.cpu.get_cpu_capability()}",
             f"- command: `python benchmarks/bench_step_rows.py {' '.join(sys.argv[1:])}`"
             f" (load average {os.getloadavg()[0]:.2f} at the end)",
             f"- model: the default ({a.dtype}, weights packed, kernels='step'; packed products in "
             f"{llm.engine.model.layers[0].mlp.down_proj.compute_dtype}); `STEP_MAX_ROWS[{a.dtype}]` here: "
             f"{STEP_MAX_ROWS[dtype]}",
             "- decode tok/s: B / median time per output token, medians of the repeats (alternating)\n",
             "| sequences | one call (tok/s) | 05b modules (tok/s) | one call / modules | per repeat |",
             "|---|---|---|---|---|"]
    for b in a.batches:
        one, mods = (statistics.median(rates[b, w]) for w in WAYS)
        per = ", ".join(f"{x / y:.2f}" for x, y in zip(rates[b, "one call"], rates[b, "05b modules"]))
        lines.append(f"| {b} | {one:.1f} | {mods:.1f} | {one / mods:.2f}x | {per} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.record:
        out = Path(__file__).parent / f"step-rows-{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d-%H%M}.md"
        out.write_text(text)
        print("recorded", out)

if __name__ == "__main__":
    main()
