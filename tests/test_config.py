"""`EngineConfig.resolve()`: what the user sets is kept, and every "auto" fills in around it. For every field and every
allowed value, set alone, the config resolves keeping the value, or refuses because of this machine (no CUDA, no C++
compiler) or the model folder, never because of another "auto"; for pairs of values, a refusal names a conflict
between the two; no refusal suggests "auto". The resolved defaults are the fastest switches, as before."""
import os, re
import pytest, torch

from minfer.engine import EngineConfig, SWITCHES, all_rules
from minfer.speculative import SpeculativeConfig
from minfer.cpu_kernels import cxx_compiler

PAIRED = ("kv", "dtype", "device", "weights", "kernels", "attention", "kv_dtype", "speculative", "pd_split",
            "prefix_cache", "chunked_prefill", "tensor_parallel_size")

# why a value set alone may still be refused here: this machine, or what the model folder holds
MACHINE_OR_FOLDER = [r"no CUDA device", r"C\+\+ compiler", r"Triton's interpreter", r"holds plain weights",
                     r"needs a draft model folder", r"set pd_split=True", r"cannot be split in whole heads",
                     r"the folder's \w+ model has none"]


def values(f):
    "The values a user may give switch `f` (every allowed one where the switch has a list)."
    choices = f.allowed()
    if choices is not None: return [v for v in choices if v != "auto"]
    if f.type is bool: return [True, False]
    if f.name == "tensor_parallel_size": return [1, 2, 3, 4]  # 4 does not split SmolLM2's 3 KV heads
    if f.type is int: return [1, 16, 4096]
    return {"speculative": ["ngram", "draft", {"method": "ngram", "num_speculative_tokens": 2, "adaptive": True}],
            "prefill_cores": ["0"], "decode_cores": ["0"], "model": [None]}[f.name]


def kept(resolved, name, value):
    got = getattr(resolved, name)
    if name == "speculative":
        method = value["method"] if isinstance(value, dict) else value
        return isinstance(got, SpeculativeConfig) and got.method == method
    if name == "model": return got is not None
    return got == value


SINGLE = [(f.name, v) for f in SWITCHES.values() for v in values(f)]


@pytest.mark.parametrize("name,value", SINGLE, ids=[f"{n}={v!r}"[:40] for n, v in SINGLE])
def test_one_value_set_alone_resolves_or_the_machine_refuses(name, value):
    try: resolved = EngineConfig(**{name: value}).resolve()
    except ValueError as e:
        msg = str(e)
        assert "'auto'" not in msg and "\n" not in msg, msg
        assert any(re.search(r, msg) for r in MACHINE_OR_FOLDER), f"{name}={value!r} refused by another 'auto': {msg}"
        return
    assert kept(resolved, name, value), (name, value, resolved)
    assert resolved.resolve() == resolved  # idempotent: what it says is what runs
    for auto in ("device", "dtype", "weights", "kernels", "attention", "kv_dtype"):
        assert getattr(resolved, auto) != "auto"


PAIR_VALUES = [(f.name, v) for f in SWITCHES.values() if f.name in PAIRED and f.name != "device"
               for v in values(f) if not isinstance(v, dict)]
PAIRS = [(a, b) for i, a in enumerate(PAIR_VALUES) for b in PAIR_VALUES[i + 1:] if a[0] != b[0]]


def mentions(msg, name, value):
    return name in msg or repr(value) in msg or (isinstance(value, str) and value in msg)


def test_two_values_set_together_resolve_or_their_conflict_is_named():
    "Every pair of switch values: resolved with both kept, or one line that names both (or the machine or folder)."
    refused = 0
    for (n1, v1), (n2, v2) in PAIRS:
        try: resolved = EngineConfig(**{n1: v1, n2: v2}).resolve()
        except ValueError as e:
            msg, refused = str(e), refused + 1
            assert "'auto'" not in msg and "\n" not in msg, msg
            machine = any(re.search(r, msg) for r in MACHINE_OR_FOLDER)
            assert machine or (mentions(msg, n1, v1) and mentions(msg, n2, v2)), (n1, v1, n2, v2, msg)
            continue
        assert kept(resolved, n1, v1) and kept(resolved, n2, v2), (n1, v1, n2, v2, resolved)
    assert 0 < refused < len(PAIRS)


@pytest.mark.skipif(cxx_compiler() is None or torch.cuda.is_available(), reason="the CPU defaults need a C++ compiler")
def test_auto_fills_in_around_explicit_values_on_a_cpu():
    "The cases the old order got wrong, and the defaults it got right."
    resolve = lambda **kw: EngineConfig(**kw).resolve()
    c = resolve()
    assert (c.device, c.dtype, c.weights, c.kernels, c.attention, c.kv_dtype) == \
        ("cpu", "float32", "packed", "step", "cpu", "float32")
    c = resolve(attention="torch")  # the one-call step runs its own attention: the kernels move, not the user
    assert (c.kernels, c.attention) == ("cpu", "torch")
    assert resolve(kernels="torch").attention == "torch"
    assert (resolve(kv_dtype="int8").kernels, resolve(kv_dtype="int8").attention) == ("step", "cpu")
    assert (resolve(kv_dtype="fp8").kernels, resolve(kv_dtype="fp8").attention) == ("cpu", "torch")
    c = resolve(kv_dtype="float16")  # an unquantized KV cache is in the model's dtype: the model follows
    assert (c.dtype, c.weights, c.kernels, c.attention) == ("float16", "plain", "torch", "torch")
    c = resolve(kv="contiguous")
    assert (c.kernels, c.attention) == ("cpu", "torch")
    assert resolve(dtype="bfloat16").kernels == "step"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU Triton compiles")
def test_triton_attention_resolves_in_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    c = EngineConfig(attention="triton").resolve()
    assert c.attention == "triton" and c.kernels != "step" and c.dtype in ("float32", "float16")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="Triton's interpreter"): EngineConfig(attention="triton").resolve()


def test_a_conflict_between_explicit_values_is_one_line_naming_both():
    with pytest.raises(ValueError) as e: EngineConfig(kernels="step", attention="torch").resolve()
    msg = str(e.value)
    assert "kernels='step'" in msg and "attention='torch'" in msg and "auto" not in msg


def test_every_rule_reads_what_it_says():
    "A rule that reads a field it does not declare could be checked before `resolve` decides that field."
    names = set(SWITCHES)
    for rule in all_rules():
        assert rule.reads and set(rule.reads) <= names, rule.reads
        src = rule.refuses.__code__.co_names + rule.message.__code__.co_names
        used = {n for n in src if n in names} - {"model"}
        assert used <= set(rule.reads), (rule.reads, used)


def test_llm_with_torch_attention_runs_on_a_cpu(model_dir):
    "The issue's case: LLM(attention='torch') on a CPU used to be refused."
    from minfer.llm import LLM
    from minfer.sampling import SamplingParams
    if torch.cuda.is_available(): pytest.skip("a CPU case")
    llm = LLM(model_dir, attention="torch")
    assert llm.attention == "torch" and type(llm.engine.attn).__name__ == "PagedAttention"
    assert "Paris" in llm.generate("What is the capital of France?", SamplingParams(max_tokens=16))[0].text


@pytest.mark.parametrize("pays", [True, False])
def test_auto_dtype_is_bf16_for_a_bf16_checkpoint_where_bf16_pays(model_dir, tmp_path, monkeypatch, pays):
    """`dtype="auto"` on a CPU: a checkpoint saved in bf16 runs in bf16 where this machine's packed bf16 products
    beat fp32's (chapter 00b's table, here written by hand), in fp32 where not or where oneDNN has no bf16 path; the
    default model (an fp32 checkpoint) stays fp32 either way."""
    import json
    from minfer.engine import resolve_config
    from minfer.roofline import machine_name, machine_path
    monkeypatch.setenv("MINFER_HOME", str(tmp_path / "home"))
    rates = {"float32": 2.0, "bfloat16": 1.0} if not pays else {"float32": 1.0, "bfloat16": 2.0}
    machine_path().parent.mkdir(parents=True)
    machine_path().write_text(json.dumps({f"{machine_name()} | packed products": rates}))
    folder = tmp_path / "bf16"
    folder.mkdir()
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (folder / f.name).symlink_to(f)
    config = json.loads((model_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    bf16_path = torch.ops.mkldnn._is_mkldnn_bf16_supported() and torch.backends.mkldnn.is_available()
    want = "bfloat16" if pays and bf16_path else "float32"
    assert resolve_config(EngineConfig(model=str(folder))).dtype == want
    assert resolve_config(EngineConfig(model=str(model_dir))).dtype == "float32"
    assert resolve_config(EngineConfig(model=str(folder), dtype="float32")).dtype == "float32"
