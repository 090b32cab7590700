"""The stack (chapter 15): the engine's attacks on bytes per token switched on one after another (`minfer.stack.STACK`),
each configuration measured four ways on the default model: decode tok/s at batch 1 (64 tokens of a chat reply),
tok/s over the 64 requests of chapter 02d's decode-heavy mix (an engine that runs one request at a time gets the
first two), the median time to first token of eight questions asked one after another after the same 256-token
system prompt, and the ledger's bytes per generated token. Configurations alternate (1 2 ... 8 1 2 ... 8), medians.

    python benchmarks/bench_stack.py [--repeats 2] [--record]
"""
import argparse, datetime, json, statistics, sys
from pathlib import Path

from minfer.stack import STACK, stack_workload, measure_attack, int4_folder
from minfer.gguf import default_model_dir
from minfer.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import machine

MEASURED = ("batch1_tok_s", "batch_tok_s", "ttft_s", "batch1_bytes_per_token", "batch_bytes_per_token")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--record", action="store_true")
    a = ap.parse_args()
    workload = stack_workload(Tokenizer(default_model_dir()))
    int4 = int4_folder()  # written before the timing starts
    runs = {upto: [] for upto in range(1, len(STACK) + 1)}
    for repeat in range(a.repeats):
        for upto in runs:
            runs[upto].append(measure_attack(upto, workload))
            r = runs[upto][-1]
            print(f"repeat {repeat + 1}, {upto}. {r['attack']}: batch 1 {r['batch1_tok_s']:.1f} tok/s, "
                  f"{r['requests']} requests {r['batch_tok_s']:.1f} tok/s, TTFT {r['ttft_s'] * 1e3:.0f} ms, "
                  f"{r['batch1_bytes_per_token'] / 1e6:.1f} MB/token", flush=True)
    rows = [{**runs[upto][0], **{k: statistics.median(r[k] for r in runs[upto]) for k in MEASURED}}
            for upto in runs]
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = ["# The stack: the engine's attacks switched on one after another", "",
             f"- date: {now:%Y-%m-%d %H:%M}", f"- machine: {machine()}",
             f"- command: `python benchmarks/bench_stack.py --repeats {a.repeats}{' --record' if a.record else ''}`",
             f"- 4-bit folder: {int4.name}; medians of {a.repeats} alternating runs", "",
             "| attacks on | batch 1 tok/s | requests | tok/s | TTFT ms (shared prompt) | MB/token batch 1 | "
             "MB/token mix |", "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        lines.append(f"| {i}. {r['attack']} | {r['batch1_tok_s']:.1f} | {r['requests']} | {r['batch_tok_s']:.1f} | "
                     f"{r['ttft_s'] * 1e3:.0f} | {r['batch1_bytes_per_token'] / 1e6:.1f} | "
                     f"{r['batch_bytes_per_token'] / 1e6:.1f} |")
    print("\n".join(lines))
    if a.record:
        path = Path(__file__).parent / f"stack-{now:%Y-%m-%d-%H%M}.md"
        path.write_text("\n".join(lines) + "\n")
        record = {"machine": machine(), "date": f"{now:%Y-%m-%d %H:%M}", "int4_folder": int4.name, "rows": rows}
        path.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"recorded {path}")


if __name__ == "__main__":
    main()
