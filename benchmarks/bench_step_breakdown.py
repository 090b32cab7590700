"""Where a batched decode step's time goes: the decode-heavy 64-request mix (bench_throughput's) through minfer's
default `LLM`, every engine step timed in its parts, for each dtype asked.

Parts of a step: the scheduler's `schedule`, the runner's batch preparation (`prepare`), the model's forward (split by
forward hooks into each projection's GEMM, the LM head, attention without its projections, the norms, the MLP's
activation, the embedding and what is left of the forward), sampling, the ledger, and the scheduler's `postprocess`
(token append, detokenize, stop checks). vLLM's CPU build (benchmarks/peers.py) runs the same token ids under its own
torch profiler for `--vllm-steps` engine steps after its first `--vllm-delay` (all 64 sequences decoding), its ops'
self CPU time sorted into the same kinds of work. Reported for the wide decode steps (every sequence decoding, at least
`--min-seqs` of them) as ms per step and as a share, with each GEMM's achieved GFLOP/s beside this machine's measured
matmul peak (chapter 00b's `measure_matmul_flops`) and the step's weight bytes against copy bandwidth.

    python benchmarks/bench_step_breakdown.py [--dtypes float32 bfloat16] [--record]
    python benchmarks/bench_step_breakdown.py --json-from benchmarks/step-breakdown-DATE.md

With --record it writes the record (.md) and, beside it, the same kinds of work as numbers (.json: per dtype the wide
step's median ms and sequences, and ms per step of each kind for minfer and vLLM) for chapter 05c's picture;
--json-from writes that .json from a record written before the .json existed.
"""
import argparse, collections, datetime, json, re, statistics, sys, tempfile, time
from pathlib import Path
import torch
from minfer import LLM  # every chapter loaded: its weight formats, kernels and switches
from minfer.gguf import default_model_dir
from minfer.sequential import make_workload
from minfer.sequence import SamplingParams
from minfer.roofline import measure_bandwidth, measure_matmul_flops, weight_bytes_per_step

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import machine
from peers import Peer, PeerMissing

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# the parts chapter 05c's one-call step adds up itself, in its order (it does not split the projections)
ONE_CALL_PARTS = ("projections (one call)", "LM head", "norms", "attention (one call)", "MLP activation")
STEP_PARTS = ("schedule", "prepare", "forward", "sample", "account", "postprocess")


class StepClock:
    "Times every engine step of `llm` in parts (instance attributes wrap the parts; `close` removes them)."
    def __init__(self, llm):
        self.engine, self.model = llm.engine, llm.model
        self.steps = []  # per step: {part: seconds}, plus 'rows', 'seqs', 'decode'
        self.current = None
        self.hooks = []
        self._wrap(self.engine.scheduler, "schedule")
        self._wrap(self.engine.scheduler, "postprocess")
        for name in ("prepare", "forward", "sample", "account"):
            self._wrap(self.engine.runner, name)
        self._wrap_step()
        self._hook_modules()

    def _wrap(self, owner, name):
        inner = getattr(owner, name)
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.current is not None:
                    self.current[name] += time.perf_counter() - t
        setattr(owner, name, timed)
        self.hooks.append(lambda: delattr(owner, name))

    def _wrap_step(self):
        engine, inner = self.engine, self.engine.step
        one_call = torch.zeros(5, dtype=torch.float64)  # chapter 05c's one-call step times its own parts
        def step():
            self.current = collections.Counter()
            if hasattr(self.model, "timings"):
                one_call.zero_()
                self.model.timings = one_call
            t = time.perf_counter()
            out = inner()
            self.current["step"] = time.perf_counter() - t
            for name, seconds in zip(ONE_CALL_PARTS, one_call.tolist()):
                self.current[name] += seconds
            self.steps.append(self.current)
            self.current = None
            return out
        engine.step = step
        self.hooks.append(lambda: delattr(engine, "step"))
        if hasattr(self.model, "timings"):
            self.hooks.append(lambda: setattr(self.model, "timings", None))
        run = engine.runner.run
        def runner_run(batch, copies):
            if self.current is not None:
                self.current["seqs"] = len(batch)
                self.current["rows"] = sum(n for _, n in batch)
                self.current["decode"] = all(s.num_computed == len(s) - 1 for s, _ in batch)
            return run(batch, copies)
        engine.runner.run = runner_run
        self.hooks.append(lambda: delattr(engine.runner, "run"))

    def _hook_modules(self):
        starts = {}
        def timed(module, part):
            def pre(m, args):
                starts[m] = time.perf_counter()
            def post(m, args, out):
                if self.current is not None:
                    self.current[part] += time.perf_counter() - starts[m]
            self.hooks += [module.register_forward_pre_hook(pre).remove, module.register_forward_hook(post).remove]
        model = self.model
        timed(model.embed_tokens, "embedding")
        for layer in model.layers:
            timed(layer.self_attn, "attention+")
            timed(layer.mlp, "mlp+")
            timed(layer.input_layernorm, "norms")
            timed(layer.post_attention_layernorm, "norms")
            for name in PROJECTIONS:
                owner = layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp
                timed(getattr(owner, name), name)
        timed(model.norm, "norms")
        timed(model.lm_head, "LM head")

    def close(self):
        for undo in reversed(self.hooks):
            undo()


def step_parts(step):
    "-> {part: seconds} for one step, the forward split into its modules and 'forward, other'."
    attention = step["attention+"] - step["qkv_proj"] - step["o_proj"]
    activation = step["mlp+"] - step["gate_up_proj"] - step["down_proj"]
    inner = {**{p: step[p] for p in PROJECTIONS}, "projections (one call)": step["projections (one call)"],
             "LM head": step["LM head"], "attention": attention + step["attention (one call)"],
             "norms": step["norms"], "MLP activation": activation, "embedding": step["embedding"]}
    parts = {**inner, "forward, other": step["forward"] - sum(inner.values())}
    parts.update({p: step[p] for p in STEP_PARTS if p != "forward"})
    parts["step, other"] = step["step"] - sum(step[p] for p in STEP_PARTS)
    return parts


def projection_flops(cfg, rows):
    "-> {projection: FLOPs} of one step of `rows` tokens through every layer."
    h, d = cfg.hidden_size, cfg.head_dim
    out = {"qkv_proj": (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d, "o_proj": h,
           "gate_up_proj": 2 * cfg.intermediate_size, "down_proj": h}
    inputs = {"qkv_proj": h, "o_proj": cfg.num_attention_heads * d, "gate_up_proj": h,
              "down_proj": cfg.intermediate_size}
    flops = {p: 2 * rows * inputs[p] * out[p] * cfg.num_hidden_layers for p in PROJECTIONS}
    flops["projections (one call)"] = sum(flops.values())
    flops["LM head"] = 2 * rows * h * cfg.vocab_size
    return flops


def run(dtype, work, min_seqs):
    llm = LLM(default_model_dir(), dtype=dtype)
    prompts = [llm.tokenizer.decode(ids) for _, ids, _ in work]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for *_, n in work]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    clock = StepClock(llm)
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, raw=True)
    total = time.perf_counter() - t
    clock.close()
    wide = [s for s in clock.steps if s["decode"] and s["seqs"] >= min_seqs]
    return llm, total, clock.steps, wide


def table(dtype, llm, total, steps, wide, peaks, bandwidth):
    cfg = llm.model.cfg
    parts = [step_parts(s) for s in wide]
    names = list(parts[0])
    median = {n: statistics.median(p[n] for p in parts) * 1e3 for n in names}
    step_ms = statistics.median(s["step"] for s in wide) * 1e3
    rows = statistics.median(s["rows"] for s in wide)
    flops = projection_flops(cfg, rows)
    weight_mb = weight_bytes_per_step(cfg, dtype) / 1e6
    lines = [f"### {dtype}: {len(wide)} wide decode steps (median {rows:.0f} sequences), median step {step_ms:.1f} ms",
             "", f"- whole run: {len(steps)} steps, {total:.1f} s; the steps' own time {sum(s['step'] for s in steps):.1f}"
             f" s (the rest: tokenizing, outputs); {rows / step_ms * 1e3:.0f} tok/s in a wide step",
             f"- the step reads {weight_mb:.0f} MB of weights: {weight_mb / 1e3 / bandwidth * 1e3:.1f} ms at copy "
             f"bandwidth {bandwidth:.1f} GB/s (the bytes roof); the projections and LM head do "
             f"{sum(flops.values()) / 1e9:.1f} GFLOP: {sum(flops.values()) / peaks[dtype] * 1e3:.1f} ms at this "
             f"machine's {dtype} matmul peak {peaks[dtype] / 1e9:.0f} GFLOP/s (the compute roof)", "",
             "| part | ms per step (median) | share | GFLOP/s achieved | % of matmul peak |", "|---|---|---|---|---|"]
    for n in names:
        rate = ""
        if n in flops and median[n] > 0:
            gflops = flops[n] / (median[n] / 1e3) / 1e9
            rate = f"{gflops:.0f} | {gflops * 1e9 / peaks[dtype]:.0%}"
        else:
            rate = " | "
        lines.append(f"| {n} | {median[n]:.2f} | {median[n] / step_ms:.0%} | {rate} |")
    lines = [line for line in lines if not line.endswith("| 0.00 | 0% |  |  |")]
    lines.append(f"| **step** | **{step_ms:.2f}** | 100% | | |")
    return lines, median


# vLLM's ops (the names in its profiler's table) -> the kind of work they are; the first pattern that matches wins
VLLM_KINDS = (("GEMMs", r"onednn_mm|aten::mm$|aten::addmm|aten::linear|aten::matmul"),
              ("attention", r"cpu_attention|cpu_attn|kv_cache_update"),
              ("norms, RoPE, activation (compiled)", r"^<built-in function kernel>$"),
              ("sampling", r"argmax|sampl|topk|top_k|softmax"),
              ("batch preparation", r"slot_mapping|_prepare_input"),
              ("waiting (not work)", r"threading.py.*wait|sched_yield"))
UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def vllm_kinds(table, steps):
    "vLLM's key-averages table -> {kind: ms per step} from each op's self CPU time."
    kinds, total = collections.Counter(), 0.0
    for line in table.splitlines():
        # the last six columns are numbers without spaces; the name (which may hold spaces) is the rest
        fields = line.split()
        if len(fields) < 7 or not fields[-6].endswith("%"):
            continue
        name, self_time = " ".join(fields[:-6]), re.fullmatch(r"([\d.]+)([a-z]+)", fields[-5])
        if self_time is None:
            continue
        seconds = float(self_time[1]) * UNITS[self_time[2]]
        kind = next((k for k, pattern in VLLM_KINDS if re.search(pattern, name)), "other")
        kinds[kind] += seconds
    total_line = re.search(r"Self CPU time total: ([\d.]+)(\w+)", table)
    if total_line:
        total = float(total_line[1]) * UNITS[total_line[2]]
        kinds["other"] += total - sum(kinds.values())
    return {k: v / steps * 1e3 for k, v in kinds.items()}


def run_vllm(dtype, work, delay, steps):
    "-> ({kind: ms per step}, its key-averages table) over `steps` steps of vLLM's generate over `work`."
    prompts, max_tokens = [ids for _, ids, _ in work], [n for *_, n in work]
    with tempfile.TemporaryDirectory() as folder:
        peer = Peer("vllm", model=str(default_model_dir()), dtype=dtype, threads=torch.get_num_threads(),
                    max_len=1024, profile_dir=folder)
        try:
            peer.call("generate", prompts=prompts[:4], max_tokens=max_tokens[:4])  # warm-up
            r = peer.call("profile", prompts=prompts, max_tokens=max_tokens, delay=delay, steps=steps)
        finally:
            peer.close()
    return vllm_kinds(r["table"], steps), r["table"]


def minfer_kinds(parts):
    "minfer's parts (ms per step) -> the kinds vLLM's are sorted into."
    gemm = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "projections (one call)", "LM head")
    kinds = {"GEMMs": sum(parts.get(p, 0.0) for p in gemm), "attention": parts["attention"],
             "norms, RoPE, activation (compiled)": parts["norms"] + parts["MLP activation"] + parts["embedding"],
             "sampling": parts["sample"],
             "batch preparation": parts["schedule"] + parts["prepare"] + parts["account"] + parts["postprocess"]}
    kinds["other"] = sum(parts.values()) - sum(kinds.values())
    return kinds


def kinds_from_record(text):
    """A record's (.md) kinds-of-work tables -> {dtype: {"seqs", "step_ms", "minfer": {kind: ms}, "vllm": {kind: ms}}}:
    what --record writes as .json, for records written before it did."""
    out = {}
    heading = r"^### (\w+): \d+ wide decode steps \(median (\d+) sequences\), median step ([\d.]+) ms"
    for head in re.finditer(heading, text, re.M):
        dtype = head[1]
        section = text[head.end():].split("\n### ")[0]
        rows = re.findall(r"^\| ([^|]+) \| ([\d.]+|-) \| ([\d.]+) \| [^|]+ \|$", section, re.M)
        minfer = {k: float(m) for k, m, _ in rows if m != "-"}
        out[dtype] = {"seqs": int(head[2]), "step_ms": float(head[3]), "minfer": minfer,
                      "vllm": {k: float(v) for k, _, v in rows} if rows else None}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-seqs", type=int, default=48)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--vllm-delay", type=int, default=6, help="vLLM engine steps before its profiler starts")
    ap.add_argument("--vllm-steps", type=int, default=10, help="vLLM engine steps its profiler records")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--json-from", type=Path, help="write the .json of this earlier record (.md) and stop")
    a = ap.parse_args()
    if a.json_from:
        a.json_from.with_suffix(".json").write_text(json.dumps(kinds_from_record(a.json_from.read_text()), indent=1))
        print("wrote", a.json_from.with_suffix(".json"))
        return
    work, kinds = None, {}
    bandwidth = measure_bandwidth() / 1e9
    peaks = {d: measure_matmul_flops(dtype=d) for d in a.dtypes}
    out = [f"# Where a batched decode step's time goes: {a.requests} requests, decode-heavy mix", "",
           f"- date: {datetime.datetime.now():%Y-%m-%d %H:%M}", f"- machine: {machine()}",
           f"- command: `python benchmarks/bench_step_breakdown.py {' '.join(sys.argv[1:])}`",
           "- minfer's default `LLM(<default model>, dtype=...)`; parts timed by wrappers and forward hooks "
           "(about a microsecond each); wide steps: every sequence decoding, at least "
           f"{a.min_seqs} sequences", ""]
    for dtype in a.dtypes:
        llm = LLM(default_model_dir(), dtype=dtype)
        work = make_workload(llm.tokenizer, a.requests, seed=0)
        del llm
        lines, median = table(dtype, *run(dtype, work, a.min_seqs), peaks, bandwidth)
        out += lines + [""]
        print("\n".join(lines), flush=True)
        ours = minfer_kinds({k: v for k, v in median.items()})
        seqs, step_ms = re.search(r"median (\d+) sequences\), median step ([\d.]+) ms", lines[0]).groups()
        kinds[dtype] = {"seqs": int(seqs), "step_ms": float(step_ms), "minfer": ours, "vllm": None}
        if a.no_vllm:
            continue
        try:
            vllm, vllm_table = run_vllm(dtype, work, a.vllm_delay, a.vllm_steps)
        except PeerMissing as e:
            out += [f"vLLM: PEER MISSING: {e}", ""]
            continue
        kinds[dtype]["vllm"] = {kind: vllm.get(kind, 0.0) for kind in [k for k, _ in VLLM_KINDS] + ["other"]}
        out += [f"#### {dtype}: the same kinds of work, minfer's wide steps against vLLM's profiled steps "
                f"({a.vllm_steps} steps after its first {a.vllm_delay}; its ops' self CPU time)", "",
                "| kind of work | minfer ms per step | vLLM ms per step | minfer / vLLM |", "|---|---|---|---|"]
        for kind in [k for k, _ in VLLM_KINDS] + ["other"]:
            mine, theirs = ours.get(kind), vllm.get(kind, 0.0)
            ratio = f"{mine / theirs:.2f}x" if mine is not None and theirs > 0 else "-"
            mine_text = "-" if mine is None else f"{mine:.2f}"
            out.append(f"| {kind} | {mine_text} | {theirs:.2f} | {ratio} |")
        out += ["", "<details><summary>vLLM's profiler table</summary>", "", "```", vllm_table.strip(), "```",
                "", "</details>", ""]
        print("\n".join(out[-40:]), flush=True)
    text = "\n".join(out)
    print(text)
    if a.record:
        path = Path(__file__).parent / f"step-breakdown-{datetime.datetime.now():%Y-%m-%d-%H%M}.md"
        path.write_text(text + "\n")
        path.with_suffix(".json").write_text(json.dumps(kinds, indent=1))  # the tables as numbers, for chapter 05c
        print("recorded", path, "and its .json")


if __name__ == "__main__":
    main()
