"""The grammar engines chapter 14 chose between, on this machine and the default model's tokenizer: xgrammar, llguidance
and outlines-core. Per engine: compile time per JSON schema (median of 3, no cache), mask time per step (median and p99
over random walks through the mask: at each step a token drawn uniformly from the allowed ones, end-of-sequence taken
with probability 0.3 where allowed), and soundness: every completed walk must parse and validate with `jsonschema`
(3 schemas x 20 walks, then a coverage set of 22 schema features x 10 walks; a compile error is a refusal). Regex and
GBNF compile and mask times too.

The two engines minfer does not depend on are installed beside it, never into its environment (xgrammar requires torch,
transformers and triton; --no-deps keeps the local torch):
    pip install --no-deps --target /tmp/grammar-engines xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 \
        outlines-core==0.2.14
    python benchmarks/bench_grammar_engines.py --path /tmp/grammar-engines
"""
import argparse, datetime, json, time, random, sys, statistics, os
from pathlib import Path
import numpy as np, torch, jsonschema
ap = argparse.ArgumentParser()
ap.add_argument("--path", default="/tmp/grammar-engines", help="where xgrammar and outlines-core are installed")
ap.add_argument("--out", default=None)
ARGS = ap.parse_args()
sys.path.insert(0, ARGS.path)
from minfer.gguf import default_model_dir
FOLDER = str(default_model_dir())
tj = json.load(open(FOLDER + "/tokenizer.json"))
VOCAB = json.load(open(FOLDER + "/config.json"))["vocab_size"]
EOS = 2

def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs: bs.append(b); cs.append(256 + n); n += 1
    return dict(zip(bs, map(chr, cs)))
u2b = {c: b for b, c in bytes_to_unicode().items()}
special = {a["id"] for a in tj["added_tokens"] if a["special"]}
tok_bytes = [b""] * VOCAB
for s, i in tj["model"]["vocab"].items():
    if i not in special: tok_bytes[i] = bytes(u2b[c] for c in s)

SCHEMAS = {
 "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                             "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "maxLength": 24}}, "required": ["name", "age", "email"],
            "additionalProperties": False},
 "order": {"type": "object", "properties": {
     "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
     "status": {"enum": ["pending", "shipped", "delivered"]},
     "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "object", "properties": {
         "sku": {"type": "string", "maxLength": 8}, "qty": {"type": "integer"}, "price": {"type": "number"}},
         "required": ["sku", "qty", "price"], "additionalProperties": False}},
     "gift": {"type": "boolean"}}, "required": ["id", "status", "items", "gift"], "additionalProperties": False},
 "ref_anyof": {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                "required": ["x", "y"], "additionalProperties": False}},
               "type": "object", "properties": {"shape": {"anyOf": [
                   {"type": "object", "properties": {"kind": {"const": "circle"}, "c": {"$ref": "#/$defs/pt"},
                                                     "r": {"type": "number"}}, "required": ["kind", "c", "r"],
                    "additionalProperties": False},
                   {"type": "object", "properties": {"kind": {"const": "poly"}, "pts": {"type": "array",
                                                     "items": {"$ref": "#/$defs/pt"}}}, "required": ["kind", "pts"],
                    "additionalProperties": False}]}}, "required": ["shape"], "additionalProperties": False},
}
COVERAGE = {
 "enum": {"enum": ["a", "b", 3]}, "const": {"const": "x"},
 "oneOf": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
 "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                     {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
 "ref_recursive": {"$defs": {"n": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array",
                   "items": {"$ref": "#/$defs/n"}}}, "required": ["v"]}}, "$ref": "#/$defs/n"},
 "pattern": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
 "format_date": {"type": "string", "format": "date"}, "format_email": {"type": "string", "format": "email"},
 "format_uuid": {"type": "string", "format": "uuid"},
 "min_max_len": {"type": "string", "minLength": 2, "maxLength": 5},
 "min_max_items": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
 "int_range": {"type": "integer", "minimum": 10, "maximum": 99},
 "num_range": {"type": "number", "minimum": 0.5, "exclusiveMaximum": 2},
 "additional_schema": {"type": "object", "additionalProperties": {"type": "integer"}},
 "optional_props": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
 "type_list": {"type": ["string", "null"]},
 "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
 "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
 "multipleOf": {"type": "integer", "multipleOf": 5},
 "patternProperties": {"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
                       "additionalProperties": False},
 "if_then": {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
 "not": {"not": {"type": "string"}},
}
GBNF = r'''root ::= "(" expr ")"
expr ::= term (("+" | "-") term)*
term ::= [0-9]+ | "(" expr ")"'''
REGEX = r"(\+?1 )?\(\d{3}\) \d{3}-\d{4}"

class XG:
    name = "xgrammar"
    def __init__(self):
        import xgrammar as xgr
        self.x = xgr
        self.info = xgr.TokenizerInfo([b if b or i in special else b"" for i, b in enumerate(tok_bytes)],
                                      xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[EOS])
    def compiler(self): return self.x.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
    def compile_json(self, schema): return self.compiler().compile_json_schema(json.dumps(schema), any_whitespace=False)
    def compile_regex(self, r): return self.compiler().compile_regex(r)
    def compile_gbnf(self, g): return self.compiler().compile_grammar(g)
    def matcher(self, c): return self.x.GrammarMatcher(c)
    def mask(self, m, buf): m.fill_next_token_bitmask(buf, 0)
    def accept(self, m, t): return m.accept_token(t)
    def done(self, m): return m.is_terminated()
    def ff(self, m): return m.find_jump_forward_string()

class LLG:
    name = "llguidance"
    def __init__(self):
        import llguidance, llguidance.torch
        self.l = llguidance
        self.tok = llguidance.LLTokenizer(json.dumps(tj), n_vocab=VOCAB, eos_token=EOS)
    def _m(self, grammar):
        m = self.l.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error(): raise ValueError(m.get_error())
        return m
    def compile_json(self, schema):
        return self._m(self.l.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False}))
    def compile_regex(self, r): return self._m(self.l.LLMatcher.grammar_from_regex(r))
    def compile_gbnf(self, g):
        from llguidance.gbnf_to_lark import gbnf_to_lark
        return self._m(self.l.LLMatcher.grammar_from_lark(gbnf_to_lark(g)))
    def matcher(self, c): return c.deep_copy()
    def mask(self, m, buf):
        v = buf[0]
        m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)
    def accept(self, m, t): return m.consume_token(t)
    def done(self, m): return m.is_stopped()
    def ff(self, m): return m.compute_ff_bytes()

class OC:
    name = "outlines-core"
    def __init__(self):
        import outlines_core as oc
        self.oc = oc
        vmap = {}
        for i, b in enumerate(tok_bytes):
            if b: vmap.setdefault(b, []).append(i)
        self.vocab = oc.Vocabulary(EOS, vmap)
    def compile_json(self, schema):
        return self.oc.Index(self.oc.json_schema.build_regex_from_schema(json.dumps(schema)), self.vocab)
    def compile_regex(self, r): return self.oc.Index(r, self.vocab)
    def compile_gbnf(self, g): raise NotImplementedError("no context-free grammars")
    def matcher(self, c): return self.oc.Guide(c)
    def mask(self, m, buf):
        v = buf[0]
        m.write_mask_into(v.data_ptr(), v.numel(), 4)
    def accept(self, m, t): m.advance(t, return_tokens=False); return True
    def done(self, m): return m.is_finished()
    def ff(self, m): return None

def allowed(buf):
    bits = buf[0].numpy().view(np.uint32)
    ids = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))
    return ids[ids < VOCAB]

def walk(eng, compiled, rng, max_steps=300):
    "random walk through the mask; -> (text bytes, per-step mask seconds, accept seconds, finished)"
    m = eng.matcher(compiled)
    buf = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    out, tm, ta = [], [], []
    for _ in range(max_steps):
        t0 = time.perf_counter(); eng.mask(m, buf); tm.append(time.perf_counter() - t0)
        ids = allowed(buf)
        if EOS in ids and (len(ids) == 1 or rng.random() < 0.3): return b"".join(out), tm, ta, True
        ids = ids[ids != EOS]
        # bias toward short tokens ending structures: pick uniformly
        t = int(ids[rng.randrange(len(ids))])
        t0 = time.perf_counter(); ok = eng.accept(m, t); ta.append(time.perf_counter() - t0)
        if ok is False: return b"".join(out), tm, ta, "reject"
        out.append(tok_bytes[t])
        if eng.done(m): return b"".join(out), tm, ta, True
    return b"".join(out), tm, ta, False

def main():
    engines = []
    t0 = time.perf_counter(); e = XG(); print("xgrammar tokenizer info", time.perf_counter() - t0); engines.append(e)
    t0 = time.perf_counter(); e = LLG(); print("llguidance tokenizer", time.perf_counter() - t0); engines.append(e)
    t0 = time.perf_counter(); e = OC(); print("outlines-core vocabulary", time.perf_counter() - t0); engines.append(e)
    res = {}
    for eng in engines:
        r = res[eng.name] = {}
        for name, schema in SCHEMAS.items():
            times = []
            for _ in range(3):
                t0 = time.perf_counter(); c = eng.compile_json(schema); times.append(time.perf_counter() - t0)
            rng = random.Random(0)
            tms, valid, n = [], 0, 0
            for k in range(20):
                text, tm, ta, fin = walk(eng, c, rng)
                tms += tm
                if fin is True:
                    n += 1
                    try: jsonschema.validate(json.loads(text), schema); valid += 1
                    except Exception as ex: print(eng.name, name, "INVALID", text[:200], ex.__class__.__name__)
            r[name] = dict(compile_ms=1e3 * statistics.median(times), mask_us=1e6 * statistics.median(tms),
                           mask_p99_us=1e6 * sorted(tms)[int(.99 * len(tms))], walks_finished=n, valid=valid)
            print(eng.name, name, r[name], flush=True)
        cov = []
        for name, schema in COVERAGE.items():
            try:
                c = eng.compile_json(schema)
            except Exception as ex:
                cov.append((name, "compile error: " + str(ex)[:60])); continue
            rng = random.Random(1); bad = 0; fin_n = 0
            for k in range(10):
                text, tm, ta, fin = walk(eng, c, rng, 120)
                if fin is True:
                    fin_n += 1
                    try: jsonschema.validate(json.loads(text), schema)
                    except Exception as ex: bad += 1; last = text[:80]
            cov.append((name, f"{fin_n - bad}/{fin_n} valid" + (f" e.g. {last!r}" if bad else "")))
        r["coverage"] = cov
        r["other"] = []
        for c in cov: print(eng.name, *c)
        for kind, src, f in (("regex", REGEX, eng.compile_regex), ("gbnf", GBNF, eng.compile_gbnf)):
            try:
                t0 = time.perf_counter(); c = f(src); ms = 1e3 * (time.perf_counter() - t0)
                rng = random.Random(2); tms = []
                for _ in range(5): tms += walk(eng, c, rng)[1]
                r["other"].append(f"{kind} compile {ms:.1f} ms, mask {1e6*statistics.median(tms):.0f} µs")
            except Exception as ex: r["other"].append(f"{kind}: {str(ex)[:60]}")
    report(res)

def report(res):
    import llguidance, xgrammar, outlines_core, importlib.metadata as md, subprocess
    when = datetime.datetime.now()
    cpu = next((l.split(":", 1)[1].strip() for l in subprocess.run(["lscpu"], capture_output=True, text=True)
                .stdout.splitlines() if l.startswith("Model name")), "?")
    lines = [f"# Grammar engines, {when:%Y-%m-%d %H:%M}", "",
             f"- machine: {cpu}, {os.cpu_count()} cores (shared with other jobs); torch {torch.__version__}",
             f"- versions: xgrammar {md.version('xgrammar')}, llguidance {md.version('llguidance')}, "
             f"outlines-core {md.version('outlines-core')}",
             f"- command: `python benchmarks/bench_grammar_engines.py --path {ARGS.path}`",
             f"- tokenizer: {FOLDER} ({VOCAB} tokens)", "",
             "| engine | schema | compile ms | mask µs (median) | mask µs (p99) | walks completed | valid |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for eng, r in res.items():
        for name, v in r.items():
            if name in ("coverage", "other"): continue
            lines.append(f"| {eng} | {name} | {v['compile_ms']:.2f} | {v['mask_us']:.1f} | {v['mask_p99_us']:.0f} | "
                         f"{v['walks_finished']} | {v['valid']} |")
    lines += ["", "Coverage (10 walks per feature; `k/n valid` of the completed walks):", "",
              "| feature | " + " | ".join(res) + " |", "| --- |" + " --- |" * len(res)]
    for i, (name, _) in enumerate(next(iter(res.values()))["coverage"]):
        cells = (" ".join(r["coverage"][i][1].replace("|", "/").split())[:70] for r in res.values())
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Regex and GBNF:", ""] + [f"- {eng}: {'; '.join(r['other'])}" for eng, r in res.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(ARGS.out or Path(__file__).parent / f"grammar-engines-{when:%Y-%m-%d-%H%M}.md")
    out.write_text(text)
    print("wrote", out)

main()
