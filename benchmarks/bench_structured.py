"""Structured outputs (chapter 14): what a constraint costs and what jump-forward saves.

- 16 concurrent requests for a JSON object of a 7-key schema, three ways, alternating (A B C A B C ..., medians):
  `free` (no constraint, each request's max_tokens set to the length its constrained twin produced, ignore_eos, so the
  same number of tokens is decoded), `masked` (the constraint, jump_forward=False: the mask's cost alone) and `jump`
  (the constraint with jump-forward). Throughput = output tokens / wall time of the whole batch; passes per output
  token = forward passes that produced a request's tokens / its tokens.
- compile time per schema (llguidance, uncached), mask time per step (median, one sequence).

usage: python benchmarks/bench_structured.py [--rounds 3] [--requests 16] [--out benchmarks/structured-DATE.md]
"""
import argparse, datetime, json, os, platform, statistics, subprocess, time
from pathlib import Path

import torch
from minfer import LLM, SamplingParams
from minfer import structured

FORM = {"type": "object", "additionalProperties": False, "properties": {
    "first_name": {"type": "string", "maxLength": 12}, "last_name": {"type": "string", "maxLength": 12},
    "city": {"type": "string", "maxLength": 12}, "country": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}, "is_student": {"type": "boolean"},
    "favourite_colour": {"enum": ["red", "green", "blue"]}},
    "required": ["first_name", "last_name", "city", "country", "age", "is_student", "favourite_colour"]}
SCHEMAS = {
    "person (2 keys)": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                        "required": ["name", "age"]},
    "form (7 keys)": FORM,
    "order (nested, pattern, enum)": {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "status": {"enum": ["pending", "shipped"]},
        "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer"}, "price": {"type": "number"}},
            "required": ["sku", "qty", "price"]}}}, "required": ["id", "status", "items"]},
    "recursive ($ref tree)": {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["value"]}}, "$ref": "#/$defs/node"},
}


def cpu_name():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name"))
        flags = next(l for l in out.splitlines() if l.startswith("Flags"))
        return f"{name}, {torch.get_num_threads()} threads, {'AVX-512' if 'avx512f' in flags else 'AVX2'}"
    except Exception:
        return platform.processor()


def forward_passes(m):
    "The forward passes that gave a request its tokens: the prompt's last chunk (first token), then each decode pass."
    return 1 + ((m["num_generated_tokens"] - 1) / m["tokens_per_pass"] if m["tokens_per_pass"] else 0)


MASK_SECONDS = [0.0]  # time spent in GrammarConstraint.mask, all rows: the constraint's own cost, robust to load


def _timed_mask(mask):
    def timed(self, logits):
        t = time.perf_counter()
        out = mask(self, logits)
        MASK_SECONDS[0] += time.perf_counter() - t
        return out
    return timed


def run(llm, convs, params):
    MASK_SECONDS[0] = 0.0
    t = time.perf_counter()
    outs = llm.chat(convs, params)
    wall = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    passes = sum(forward_passes(o.metrics) for o in outs)
    return dict(tok_s=tokens / wall, passes_per_token=passes / tokens, tokens=tokens, wall=wall,
                mask_share=MASK_SECONDS[0] / wall), outs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    llm = LLM(max_num_seqs=a.requests)
    structured.GrammarConstraint.mask = _timed_mask(structured.GrammarConstraint.mask)
    convs = [[{"role": "user", "content": f"Invent person number {i + 1} and describe them as JSON."}]
             for i in range(a.requests)]
    constrained = lambda jf: SamplingParams(max_tokens=120, structured_outputs={"json": FORM, "jump_forward": jf})
    _, twins = run(llm, convs, constrained(False))  # warm-up; the free runs decode as many tokens as these
    free = [SamplingParams(max_tokens=len(o.token_ids), ignore_eos=True) for o in twins]
    results = {"free": [], "masked": [], "jump": []}
    for _ in range(a.rounds):
        for name, params in (("free", free), ("masked", constrained(False)), ("jump", constrained(True))):
            r, outs = run(llm, convs, params)
            results[name].append(r)
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("tok_s", "passes_per_token", "tokens", "mask_share")}
           for k, v in results.items()}
    # compile and mask costs
    compile_ms, mask_us = {}, []
    for name, schema in SCHEMAS.items():
        grammar = structured.json_grammar(schema)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            structured._compile.__wrapped__("json", grammar, llm.tokenizer, llm.eos_ids)
            times.append(time.perf_counter() - t)
        compile_ms[name] = 1e3 * statistics.median(times)
    state = structured.STRUCTURED_OUTPUTS["json"](FORM, llm.tokenizer, llm.eos_ids, False)()
    logits = torch.zeros(llm.tokenizer.vocab_size)
    for t in llm.tokenizer.encode(json.dumps({"first_name": "Ada", "last_name": "Lovelace", "city": "London",
                                               "country": "England", "age": 36, "is_student": False,
                                               "favourite_colour": "blue"})):
        t0 = time.perf_counter()
        state.mask(logits)
        mask_us.append(1e6 * (time.perf_counter() - t0))
        state.accept(t)
    when = datetime.datetime.now()
    load = os.getloadavg()[0]
    lines = [f"# Structured outputs, {when:%Y-%m-%d %H:%M}", "",
             f"- load average (1 min) at the end: {load:.2f} on {os.cpu_count()} cores (other jobs share the machine)",
             f"- machine: {cpu_name()}; torch {torch.__version__}; llguidance {structured.llguidance.__version__}",
             f"- command: `python benchmarks/bench_structured.py --rounds {a.rounds} --requests {a.requests}`",
             f"- engine: `{llm!r}`",
             f"- workload: {a.requests} concurrent chat requests for a 7-key JSON object (greedy); `free` decodes the "
             "same number of tokens per request without a constraint; medians of "
             f"{a.rounds} alternating rounds", "",
             "| mode | tokens/s | vs free | forward passes per output token | output tokens | mask time / wall |",
             "| --- | --- | --- | --- | --- | --- |"]
    for k in ("free", "masked", "jump"):
        m = med[k]
        lines.append(f"| {k} | {m['tok_s']:.1f} | {m['tok_s'] / med['free']['tok_s']:.2f}x | "
                     f"{m['passes_per_token']:.2f} | {m['tokens']:.0f} | {100 * m['mask_share']:.1f}% |")
    lines += ["", "| schema | llguidance compile (ms, median of 5, uncached) |", "| --- | --- |"]
    lines += [f"| {k} | {v:.2f} |" for k, v in compile_ms.items()]
    lines += ["", f"Mask per step, one sequence, the 7-key schema: median {statistics.median(mask_us):.0f} µs, "
                  f"max {max(mask_us):.0f} µs over {len(mask_us)} steps (bitmask + unpack + masked_fill)."]
    lines += ["", "Raw rounds:", "```", json.dumps(results, indent=1), "```"]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(a.out or Path(__file__).parent / f"structured-{when:%Y-%m-%d-%H%M}.md")
    out.write_text(text)
    print("wrote", out)


if __name__ == "__main__":
    main()
