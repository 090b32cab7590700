"""The extension points, used from outside the library as a later chapter (or a user) would: a toy entry of each kind is
registered here, in a test, and the engine runs with it without any library file knowing its name. Registries are
add-only: a different entry under a taken name is refused, the same definition run again (a notebook cell re-run) is
not."""
import json

import pytest
import torch

from minfer.model import Registry
from minfer.paged import KV_FORMATS, KV_READERS, PagedAttention, PagedKVCache
from minfer.engine import SWITCHES, EngineConfig, Rule, Switch
from minfer.cli import COMMANDS, Command, main as cli_main
from minfer.llm import LLM
from minfer.sampling import SamplingParams


def test_a_taken_name_is_refused_and_a_rerun_is_not():
    reg = Registry("toy", kind=object)

    class Entry:
        pass
    reg.register("a", Entry)

    class Entry:  # the same definition, run again: no conflict
        pass
    reg.register("a", Entry)

    class Other:
        pass
    with pytest.raises(ValueError, match="registered already"):
        reg.register("a", Other)
    with pytest.raises(ValueError, match="registered already"):
        reg["a"] = Other
    with pytest.raises(TypeError, match="must be a"):
        Registry("typed", kind=int).register("x", "not an int")


def test_no_later_chapter_replaces_an_earlier_entry():
    "Chapter 09 reads its pools through KV_READERS: chapters 05a/05b's backends are still theirs."
    from minfer.cpu_kernels import CpuAttention
    from minfer.paged import ATTENTION_BACKENDS
    assert ATTENTION_BACKENDS["cpu"] is CpuAttention and ATTENTION_BACKENDS["torch"] is PagedAttention
    from minfer.flash import TritonAttention
    assert ATTENTION_BACKENDS["triton"] is TritonAttention


class HalfPool(PagedKVCache):
    "A toy KV format: K and V stored in float16 whatever the model's dtype (half of fp32's bytes, no scales)."
    format_name = "toy-half"

    def __init__(self, cfg, num_blocks, block_size=16, dtype=torch.float32, device="cpu"):
        super().__init__(cfg, num_blocks, block_size, torch.float16, device)


class HalfFormat:
    name, truncatable, movable, runs = "toy-half", True, True, None

    def block_bytes(self, cfg, block_size):
        return PagedKVCache.block_bytes(cfg, block_size, torch.float16)

    def from_budget(self, cfg, budget_bytes, block_size, dtype, device, max_seqs):
        return HalfPool(cfg, int(budget_bytes // self.block_bytes(cfg, block_size)), block_size, dtype, device)


@pytest.fixture
def toy_format(monkeypatch):
    monkeypatch.setitem(KV_FORMATS, "toy-half", HalfFormat())
    monkeypatch.setitem(KV_READERS, ("torch", "toy-half"), PagedAttention)


def test_a_toy_kv_format_runs_in_the_engine(model_dir, toy_format):
    "Registered from here, chosen by the kv_dtype switch (chapter 09's), read by chapter 03's backend."
    ref = LLM(model_dir, kernels="cpu", attention="torch")
    toy = LLM(model_dir, kv_dtype="toy-half", kernels="cpu", attention="torch")
    assert isinstance(toy.engine.cache, HalfPool) and toy.engine.cache.k.dtype == torch.float16
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompt = "The capital of France is"
    want, got = ref.generate(prompt, params)[0], toy.generate(prompt, params)[0]
    assert got.finish_reason == "length" and len(got.token_ids) == 8
    # half the KV bytes of fp32 per token: the ledger counts the format's own block size
    assert got.metrics["bytes_per_token"] < want.metrics["bytes_per_token"]
    with pytest.raises(ValueError, match="does not read kv_dtype='toy-half'"):
        EngineConfig(model_dir, kv_dtype="toy-half", attention="cpu").resolve()


def test_a_toy_switch_with_its_rule(model_dir, monkeypatch):
    "A switch registered from here is a keyword of LLM, a field of the config, and its rule refuses in one line."
    attached = []
    toy = Switch("toy_trace", False, "record that the engine was built", type=bool,
                 rules=(Rule(("toy_trace", "kv"), lambda c: c.toy_trace and c.kv != "paged",
                             lambda c: f"toy_trace=True needs kv='paged' (got kv={c.kv!r})"),),
                 attach=lambda engine, config: attached.append(config.toy_trace))
    monkeypatch.setitem(SWITCHES, "toy_trace", toy)
    llm = LLM(model_dir, toy_trace=True)
    assert llm.toy_trace is True and "toy_trace=True" in repr(llm) and attached == [True]
    with pytest.raises(ValueError, match="toy_trace=True needs kv='paged'"):
        EngineConfig(model_dir, toy_trace=True, kv="contiguous").resolve()


def test_a_toy_subcommand(monkeypatch, capsys):
    monkeypatch.setitem(COMMANDS, "toy-hello", Command(
        "say hello", lambda p: p.add_argument("--name", default="world"),
        lambda args: print(f"hello, {args.name}")))
    assert cli_main(["toy-hello", "--name", "reader"]) == 0
    assert capsys.readouterr().out.strip() == "hello, reader"


def test_a_toy_model_family(tmp_path, monkeypatch):
    """A model_type registered from here: its checkpoint names tensors its own way (`renames` map them to Llama's) and
    its config spells the RMSNorm epsilon differently (`describe` reads it). Checked against transformers' forward of
    the same weights, loaded by the engine, and refused in one line once unregistered."""
    from safetensors.torch import load_file, save_file
    from minfer.model import MODEL_FAMILIES, Family, ModelConfig, NoCache, describe_llama, load_model
    from minfer.families import tiny_random_model
    ref = tiny_random_model("llama", tmp_path / "llama", rms_norm_eps=1e-2)
    toy = tmp_path / "toy"
    toy.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (toy / f).write_bytes((tmp_path / "llama" / f).read_bytes())
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    config.update(model_type="toy_llama", toy_norm_eps=config.pop("rms_norm_eps"))
    (toy / "config.json").write_text(json.dumps(config))
    tensors = load_file(tmp_path / "llama" / "model.safetensors")
    save_file({k.replace("model.layers.", "blocks."): v for k, v in tensors.items()}, toy / "model.safetensors")

    def describe_toy(d):
        return dict(describe_llama(d), rms_norm_eps=d["toy_norm_eps"])
    monkeypatch.setitem(MODEL_FAMILIES, "toy_llama", Family(describe_toy, renames=((r"^blocks\.", "model.layers."),)))
    assert ModelConfig.from_folder(toy).rms_norm_eps == 1e-2
    ids = torch.randint(3, 1000, (24,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ours = torch.log_softmax(load_model(toy)(ids, torch.arange(len(ids)), NoCache()), -1)
        theirs = torch.log_softmax(ref(ids[None]).logits[0].float(), -1)
    assert (ours - theirs).abs().max().item() < 1e-4
    got = LLM(str(toy), kernels="torch").generate("The capital of France is", SamplingParams(max_tokens=6,
                                                  ignore_eos=True), raw=True, use_tqdm=False)[0]
    prompt = torch.tensor([got.prompt_token_ids])
    want = ref.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, prompt.shape[1]:]
    assert got.token_ids == want.tolist()
    monkeypatch.delitem(MODEL_FAMILIES, "toy_llama")
    with pytest.raises(ValueError, match="model_type='toy_llama' is not supported"):
        ModelConfig.from_config(config)
