"""Chapter 15: the stack's switches turn on what each attack names, in a process that imports only `minfer.stack`
(as the chapter and `benchmarks/bench_stack.py` do), and the price per million tokens is the arithmetic it says."""
import json, subprocess, sys

from minfer.stack import cost_per_million_tokens

RESOLVE = """
import json
from minfer.engine import EngineConfig
from minfer.stack import STACK, stack_switches
rows = []
for upto in range(1, len(STACK) + 1):
    c = EngineConfig(**stack_switches(upto)).resolve()
    rows.append(dict(kv=c.kv, kernels=c.kernels, weights=c.weights, kv_dtype=c.kv_dtype, seqs=c.max_num_seqs,
                     prefix=c.prefix_cache, speculative=None if c.speculative is None else c.speculative.method))
print(json.dumps(rows))
"""


def test_each_attack_is_on_where_the_stack_says():
    out = subprocess.run([sys.executable, "-c", RESOLVE], capture_output=True, text=True, check=True).stdout
    naive, kv, paged, batched, fused, int4, int8, spec = json.loads(out.splitlines()[-1])
    assert (naive["kv"], naive["kernels"], naive["weights"], naive["seqs"]) == ("none", "torch", "plain", 1)
    assert kv["kv"] == "contiguous" and paged["kv"] == "paged" and paged["prefix"] and paged["seqs"] == 1
    assert batched["seqs"] == 64 and batched["kernels"] == "torch"
    assert fused["kernels"] == "step" and fused["weights"] == "packed"
    # the 4-bit codes read by the one-call step: chapter 08a's kernels loaded by minfer.stack itself
    assert int4["weights"] == "awq-int4" and int4["kernels"] == "step"
    assert int8["kv_dtype"] == "int8" and spec["speculative"] == "ngram" and spec["kv_dtype"] == "int8"
    # the int8 pool read by the one-call step beside the 4-bit codes (chapter 09's `STEP_POOLS` entry)
    assert int8["kernels"] == "step" and spec["kernels"] == "step"


def test_cost_per_million_tokens():
    assert abs(cost_per_million_tokens(100.0, 0.36) - 1.0) < 1e-12  # 360,000 tokens an hour for 36 cents
