"Bad input: one clear line at the API boundary, nothing started, the LLM usable afterwards."
import json, shutil
import pytest
from minfer.llm import LLM
from minfer.sampling import SamplingParams
from minfer.model import load_model, ModelConfig

def one_line(e): return "\n" not in str(e) and len(str(e)) < 300

BAD_CALLS = {
    "empty prompt": (lambda llm: llm.generate(""), "empty"),
    "whitespace prompt": (lambda llm: llm.generate("   \n"), "empty"),
    "empty list": (lambda llm: llm.generate([]), "non-empty"),
    "non-string prompt": (lambda llm: llm.generate([42]), "string"),
    "too long": (lambda llm: llm.generate("hello " * 9000, raw=True), "context"),
    "params count": (lambda llm: llm.generate(["a", "b"], [SamplingParams()] * 3), "SamplingParams"),
    "bad chat role": (lambda llm: llm.chat([{"role": "robot", "content": "hi"}]), "role"),
    "stream n>1": (lambda llm: list(llm.stream("hi", SamplingParams(n=2))), "one sample"),
}

@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_call_is_one_line_and_llm_survives(llm, name):
    call, word = BAD_CALLS[name]
    with pytest.raises(ValueError) as e: call(llm)
    assert one_line(e.value) and word in str(e.value), str(e.value)
    assert not llm.engine.has_unfinished()
    assert "Paris" in llm.generate("What is the capital of France?", SamplingParams(max_tokens=16))[0].text

@pytest.mark.parametrize("kw,word", [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
                                     (dict(top_k=-5), "top_k"), (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n="),
                                     (dict(seed=-3), "seed"), (dict(stop=[""]), "stop"), (dict(temperature="hot"), "temperature")])
def test_bad_sampling_params(kw, word):
    with pytest.raises(ValueError) as e: SamplingParams(**kw)
    assert one_line(e.value) and word in str(e.value) and "use" in str(e.value)

def test_mutated_params_are_rechecked(llm):
    p = SamplingParams(); p.max_tokens = -1
    with pytest.raises(ValueError, match="max_tokens"): llm.generate("hi", p)

@pytest.mark.parametrize("kw,word", [(dict(kv="infinite"), "kv="), (dict(dtype="int3"), "dtype="), (dict(device="tpu"), "device="),
                                     (dict(weights="int4"), "weights=")])
def test_unknown_switch_values(model_dir, kw, word):
    with pytest.raises(ValueError) as e: LLM(model_dir, **kw)
    assert one_line(e.value) and word in str(e.value) and "allowed" in str(e.value)

def test_packed_weights_need_fp32_or_bf16_on_cpu(model_dir):
    with pytest.raises(ValueError) as e: LLM(model_dir, weights="packed", dtype="float16")
    assert one_line(e.value) and "weights='packed'" in str(e.value) and "use weights='plain'" in str(e.value)

def test_missing_model_folder(tmp_path):
    with pytest.raises(FileNotFoundError) as e: LLM(tmp_path / "nope")
    assert one_line(e.value) and "does not exist" in str(e.value)

@pytest.mark.parametrize("what", ["no config", "bad json", "no weights", "no tokenizer", "wrong arch", "missing tensor"])
def test_malformed_model_folder(model_dir, tmp_path, what):
    d = tmp_path / "m"; d.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"): shutil.copy(model_dir / f, d / f)
    (d / "model.safetensors").symlink_to(model_dir / "model.safetensors")
    if what == "no config": (d / "config.json").unlink()
    if what == "bad json": (d / "config.json").write_text("{not json")
    if what == "no weights": (d / "model.safetensors").unlink()
    if what == "no tokenizer": (d / "tokenizer.json").unlink()
    if what == "wrong arch": (d / "config.json").write_text(json.dumps({**json.loads((model_dir / "config.json").read_text()), "model_type": "gpt2"}))
    if what == "missing tensor":
        from safetensors.torch import load_file, save_file
        sd = load_file(model_dir / "model.safetensors"); sd.pop("model.layers.3.mlp.up_proj.weight")
        (d / "model.safetensors").unlink(); save_file(sd, d / "model.safetensors")
    with pytest.raises((ValueError, FileNotFoundError)) as e: LLM(d)
    assert one_line(e.value), str(e.value)
