"""EAGLE (chapter 10b) against plain decoding, prompt lookup and a draft model: chapter 10a's held-out workloads
(copy-heavy and open-ended chat prompts; the head was trained on its target's answers to prompts about words of its
vocabulary, none of these), batch 1 (all 8 prompts one after another) and batch 8 (one `generate` call), natural stops,
chat template. One process, every configuration in turn within each repeat (A B C ... A B C ...), medians. At
temperature 0 every output must equal the run without speculation. Records tokens per target pass, acceptance per depth
(of the guesses made at depth j, the fraction the target accepted) and the head's milliseconds per guess (the proposer's
time over its guesses).

`--trees`: chains against static and dynamic token trees at equal node budgets (4 and 8 guesses per step), all on the
default switches (a tree's rows read their own key lists in the one-call C++ step, or, past its 16 rows, on the layers
with attention='cpu'); `--layers` adds a second engine with kernels='cpu' and attention='torch' (chapter 03's
attention on PyTorch's layers) running plain decoding and the static tree of 4 there; every speedup is against plain
decoding on the default switches. Acceptance per depth for a tree:
of the verifies whose tree reached depth j, the fraction that kept a path of j nodes or more; draft ms per step: the
proposer's time per call. Records benchmarks/eagle-tree-<date>.md and .json.

    python benchmarks/bench_eagle.py [--repeats 2] [--max-tokens 64] [--temperature 0] [--trees [--layers]]
        [--configs 'eagle k=2,eagle adaptive'] [--record] [--quiet]
"""
import argparse, datetime, json, os, statistics, sys, time
from pathlib import Path

from minfer import LLM  # every chapter loaded: its weight formats, kernels and switches
from minfer.sequence import SamplingParams
from minfer.speculative import SPECULATORS, speculative_config
from minfer.step_times import machine_step_times
from minfer.eagle import default_head_dir
from minfer.trees import tree_depths, TreeDraft

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import machine
from bench_speculative import workloads

CONFIGS = {"none": None, "ngram adaptive": {"method": "ngram", "num_speculative_tokens": 8, "adaptive": True},
           "ngram": {"method": "ngram"},  # prompt lookup as a user turns it on: the switch's defaults
           "eagle": {"method": "eagle"},  # as a user turns it on: the switch's defaults (k = 4, adaptive)
           **{f"eagle k={k}": {"method": "eagle", "num_speculative_tokens": k, "adaptive": False} for k in (2, 3, 4)},
           "eagle adaptive": {"method": "eagle", "num_speculative_tokens": 6, "adaptive": True},
           # chapter 10a's draft model: with the default target, its AWQ-int4 copy (`minfer quantize`), as large as the
           # target (the default model is the smallest of its family); left out, with a line, where that copy is missing
           "draft k=2": {"method": "draft", "num_speculative_tokens": 2, "adaptive": False},
           "draft adaptive": {"method": "draft", "num_speculative_tokens": 4, "adaptive": True}}
# --trees: (engine, speculative) per configuration; --layers adds LAYERS_CONFIGS on kernels='cpu', attention='torch'
TREE_CONFIGS = {"none": ("default", None),
                **{f"chain {n}": ("default", {"method": "eagle", "num_speculative_tokens": n, "adaptive": False})
                   for n in (4, 8)},
                **{f"{t} tree {n}": ("default", {"method": "eagle", "num_speculative_tokens": n, "tree": t})
                   for n in (4, 8) for t in ("static", "dynamic")}}
LAYERS_CONFIGS = {"none (layers)": ("layers", None),
                  "static tree 4 (layers)": ("layers", {"method": "eagle", "num_speculative_tokens": 4,
                                                        "tree": "static"})}

class Probe:
    "Counts, for one speculator, guesses and acceptances per depth and the proposer's time."
    def __init__(self, speculator):
        self.reset()
        verify, propose = speculator.verify, speculator.proposer.propose
        def counted_verify(seq, logits):
            # a chain's guess j sits at depth j; a tree is made to its deepest node's depth
            draft, n = speculator.requests[seq.id].draft, len(logits) - 1  # the guesses the step ran
            k = max(tree_depths(draft.parents[:n]), default=0) if isinstance(draft, TreeDraft) else n
            out = verify(seq, logits)
            for j in range(k): self.made[j] = self.made.get(j, 0) + 1
            for j in range(len(out) - 1): self.kept[j] = self.kept.get(j, 0) + 1
            return out
        def timed_propose(seqs, ks):
            t = time.perf_counter()
            drafts = propose(seqs, ks)
            self.seconds += time.perf_counter() - t
            self.guesses += sum(len(d.ids) for d in drafts)
            self.calls += 1
            return drafts
        speculator.verify, speculator.proposer.propose = counted_verify, timed_propose
    def reset(self): self.made, self.kept, self.seconds, self.guesses, self.calls = {}, {}, 0.0, 0, 0
    def per_depth(self): return [round(self.kept.get(j, 0) / n, 3) for j, n in sorted(self.made.items())]

def calibration_lines(llm, speculators):
    """What adaptive k read on this machine (chapter 10's curve, as cached; each adaptive speculator's pass and row
    costs, timed when it was built), as record lines."""
    curve, one_row = machine_step_times(llm.engine.runner)
    lines = [f"- calibration (what adaptive k reads): the verify-step curve, rows: time in one-row steps (one row "
             f"{one_row * 1e3:.1f} ms when the curve was measured): " + ", ".join(f"{r}: {t:.2f}" for r, t in curve)]
    for name, sp in speculators.items():
        if sp is not None and sp.config.adaptive:
            lines.append(f"- calibration of '{name}': a guessing pass {sp.pass_cost:.3f} one-row steps whatever its "
                         f"rows, {sp.row_cost:.4f} a row; a first guess after 16 tokens without one re-runs 16 "
                         f"positions: {sp.pass_cost + 17 * sp.row_cost:.3f}")
    return lines

def run(llm, prompts, batch, params):
    "-> (generated tokens, seconds, outputs): prompts in groups of `batch`, each group one `generate` call."
    t, outs = time.perf_counter(), []
    for i in range(0, len(prompts), batch): outs += llm.generate(prompts[i:i + batch], params)
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - t, outs

def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    # all 8 by default: on the first 4 open-ended prompts the head's first guess was kept 37% of the time, on all 8 46%
    ap.add_argument("--batch1-prompts", type=int, default=8, help="prompts per workload at batch 1 (all 8 at batch 8)")
    ap.add_argument("--trees", action="store_true", help="chains against static and dynamic token trees")
    ap.add_argument("--layers", action="store_true", help="with --trees: plain and a tree on PyTorch's layers too")
    ap.add_argument("--configs", help="comma-separated configurations to run (plain decoding always runs)")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--quiet", action="store_true", help="say in the record that nothing else ran beside it")
    a = ap.parse_args(argv)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, seed=0)
    layers = a.trees and a.layers
    configs = ({**TREE_CONFIGS, **(LAYERS_CONFIGS if layers else {})} if a.trees
               else {name: ("default", spec) for name, spec in CONFIGS.items()})
    if a.configs:
        wanted = {"none", *a.configs.split(",")}
        if wanted - set(configs): ap.error(f"unknown configurations {sorted(wanted - set(configs))}; "
                                           f"known: {', '.join(configs)}")
        configs = {name: c for name, c in configs.items() if name in wanted}
    # one model and engine for every configuration (two with --trees); each run switches the engine's speculator,
    # what `LLM(speculative=...)` would have built
    llm = LLM()
    llms = {"default": llm, **({"layers": LLM(kernels="cpu", attention="torch")} if layers else {})}
    speculators, probes = {}, {}
    for name, (engine, spec) in configs.items():
        host = llms[engine]
        try:
            spec = None if spec is None else SPECULATORS[spec["method"]].resolve(speculative_config(spec),
                                                                                  host.model_dir)
        except ValueError as e:  # the draft model's folder is not built here
            print(f"{name}: left out ({e})", flush=True)
            continue
        speculators[name] = None if spec is None else SPECULATORS[spec.method](spec, host.engine)
        if speculators[name] is not None: probes[name] = Probe(speculators[name])
    configs = {name: c for name, c in configs.items() if name in speculators}
    print("\n".join(calibration_lines(llm, speculators)), flush=True)
    work = workloads()
    cases = [(w, b) for w in work for b in (1, 8)]
    times = {(c, w, b): [] for c in configs for w, b in cases}
    stats, want = {}, {}
    for host in llms.values(): host.generate("warm up", SamplingParams(max_tokens=4))
    for r in range(a.repeats):
        for w, b in cases:
            prompts = work[w] if b == 8 else work[w][:a.batch1_prompts]
            for name, speculator in speculators.items():
                host = llms[configs[name][0]]
                host.engine.lookahead = speculator
                if name in probes: probes[name].reset()
                n, dt, outs = run(host, prompts, b, params)
                ids = [o.token_ids for o in outs]
                if name == "none": want.setdefault((w, b), ids)
                if a.temperature == 0:
                    assert ids == want[(w, b)], f"{name} on {w} batch {b}: output differs from no speculation"
                times[(name, w, b)].append(n / dt)
                m = [o.metrics for o in outs]
                probe = probes.get(name)
                stats[(name, w, b)] = dict(
                    acceptance=statistics.mean([x["acceptance_rate"] for x in m
                                                if x["acceptance_rate"] is not None] or [0]),
                    tokens_per_pass=statistics.mean([x["tokens_per_pass"] for x in m if x["tokens_per_pass"]] or [1]),
                    acceptance_per_depth=probe.per_depth() if probe else None,
                    head_ms_per_guess=(1000 * probe.seconds / probe.guesses if probe and probe.guesses
                                       and name != "ngram adaptive" else None),
                    draft_ms_per_step=1000 * probe.seconds / probe.calls if probe and probe.calls else None,
                    tokens=n)
                s = stats[(name, w, b)]
                print(f"repeat {r}: {w:10s} batch {b}: {name:15s} {n / dt:7.2f} tok/s  acceptance "
                      f"{s['acceptance']:.2f}  tokens/pass {s['tokens_per_pass']:.2f}  per depth "
                      f"{s['acceptance_per_depth']}  head ms/guess {s['head_ms_per_guess']}  draft ms/step "
                      f"{s['draft_ms_per_step']}", flush=True)
    rows = []
    for w, b in cases:
        for name in configs:
            v = times[(name, w, b)]
            ratios = [x / y for x, y in zip(v, times[("none", w, b)])]  # each against plain of its own repeat
            rows.append(dict(workload=w, batch=b, config=name, tok_s=statistics.median(v),
                             speedup=statistics.median(ratios), per_repeat=ratios, **stats[(name, w, b)]))
    head_config = json.loads((default_head_dir() / "config.json").read_text())
    calibration = calibration_lines(llm, speculators)
    title = "EAGLE chains against token trees" if a.trees else "EAGLE against plain decoding and prompt lookup"
    lines = [f"# {title}, medians of {a.repeats} alternating runs", "",
             f"- date: {datetime.datetime.now():%Y-%m-%d %H:%M}",
             f"- machine: {machine()}; " + ("quiet: nothing else ran beside it" if a.quiet else
                                             "shared machine: other jobs ran beside this one") +
             f" (1-minute load average at the end: {os.getloadavg()[0]:.1f} on 2 cores, its own 2 threads included)",
             f"- command: `python benchmarks/bench_eagle.py --repeats {a.repeats} --max-tokens {a.max_tokens} "
             f"--temperature {a.temperature} --batch1-prompts {a.batch1_prompts}{' --trees' if a.trees else ''}"
             f"{' --layers' if layers else ''}"
             f"{' --configs ' + repr(a.configs) if a.configs else ''}"
             f"{' --record' if a.record else ''}"
             f"{' --quiet' if a.quiet else ''}`",
             f"- model: the default (SmolLM2-135M-Instruct), default switches ({llm.config.kernels} kernels, "
             f"{llm.config.dtype}), temperature {a.temperature}, natural stops, max_tokens={a.max_tokens}, "
             "chat template",
             f"- head: `{default_head_dir().name}` (`minfer train-eagle`, schedule {head_config['eagle']['schedule']}, "
             f"{head_config['eagle']['minutes']} min to build; draft vocabulary {head_config['draft_vocab_size']}, "
             f"held-out coverage {head_config['eagle']['held_out_coverage']:.3f})",
             f"- prompts: chapter 10a's workloads (held out: the head never saw them); batch 1: the first "
             f"{a.batch1_prompts} of each one after another; batch 8: all 8 in one `generate` call",
             "- " + ("every speculative run's tokens were identical to the run without speculation (asserted)"
                     if a.temperature == 0 else "sampled: outputs differ between configurations, their law does not"),
             "- speedup: the median over repeats of tok/s against the plain run of the same repeat (run just before "
             "it: a slow minute of the machine slows both; medians of tok/s apart do not pair them, and read 0.99x "
             "where every repeat but one read 1.17-1.29x in eagle-2026-11-25-1832.md); per repeat: those ratios; "
             "acceptance per depth: of the guesses made at depth j (1, 2, ...), the fraction accepted"
             + ("; for a tree, of the verifies whose tree reached depth j, the fraction that kept j nodes or more; "
                "acceptance: kept guesses over guesses made (a tree's nodes); engine: the default switches"
                + (", and kernels='cpu' + attention='torch' for the '(layers)' rows" if layers else "")
                + "; draft ms per step: the proposer's time per call" if a.trees else ""),
             *(["- draft rows: chapter 10a's draft model, the target's AWQ-int4 copy (`minfer quantize`), as large as "
                "the target; their 'head ms / guess' is the draft model's"]
               if any(n.startswith("draft") for n in configs) else []),
             *calibration,
             "", "| workload | batch | config | tok/s | speedup | per repeat | acceptance | tokens / target pass | "
             "acceptance per depth | head ms / guess | draft ms / step |", "|---" * 11 + "|"]
    for r in rows:
        depth = ", ".join(f"{x:.2f}" for x in r["acceptance_per_depth"]) if r["acceptance_per_depth"] else "-"
        head_ms = f"{r['head_ms_per_guess']:.2f}" if r["head_ms_per_guess"] else "-"
        step_ms = f"{r['draft_ms_per_step']:.1f}" if r.get("draft_ms_per_step") else "-"
        lines.append(f"| {r['workload']} | {r['batch']} | {r['config']} | {r['tok_s']:.1f} | {r['speedup']:.2f}x | "
                     f"{', '.join(f'{x:.2f}' for x in r['per_repeat'])} | {r['acceptance']:.2f} | "
                     f"{r['tokens_per_pass']:.2f} | {depth} | {head_ms} | {step_ms} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if a.record:
        stamp = f"{datetime.datetime.now():%Y-%m-%d-%H%M}"
        out = Path(__file__).parent / f"eagle-{'tree-' if a.trees else ''}{stamp}"
        out.with_suffix(".md").write_text(report)
        record = dict(temperature=a.temperature, trees=a.trees, rows=rows,
                      head={k: v for k, v in head_config["eagle"].items()})
        out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
        print("recorded", out.with_suffix(".md"))

if __name__ == "__main__":
    main()
