"""Chapter 12c: gpt-oss (attention sinks, alternating windows, q/k/v/o biases, YaRN, clamped-SwiGLU experts with biases)
equal to transformers, through the model's forward and through `LLM(folder)`.

No download: a tiny gpt-oss built by transformers in the test (`tiny_gpt_oss`: every weight random, the sinks drawn with
standard deviation 2), in a config where each feature bites on a 48-token prompt: a window of 8 with both layer kinds
present, 6 experts top 2, YaRN with an original context of 16, a clamp of 1. References: transformers' forward in fp32
(log-probabilities within 1e-4) and its greedy tokens, one token per forward over its own KV cache. Each feature is
then broken on purpose, and the comparison must fail."""
import copy, json
import pytest, torch

from minfer.model import ModelConfig, NoCache, load_model
from minfer.cpu_step import model_behaviours, refused_behaviours
from minfer.families import layer_windows
from minfer.moe import mixture_layers
from minfer.sinks import tiny_gpt_oss, sink_layers, SinkAttention, ClampedExperts
from minfer.engine import EngineConfig
from minfer.llm import LLM
from minfer.sequence import SamplingParams
from minfer.cpu_step import STEP_PATH

CONFIG = dict(num_local_experts=6, num_experts_per_tok=2, intermediate_size=32, sliding_window=8, swiglu_limit=1.0,
              rope_parameters=dict(rope_type="yarn", factor=16.0, rope_theta=150000.0,
                                   original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
                                   truncate=False))
IDS = torch.randint(3, 2000, (48,), generator=torch.Generator().manual_seed(0))
TEXT = ("The three primary colors are red, yellow and blue, and every other colour a painter mixes comes from them: "
        "orange from red and yellow, green from yellow and blue, purple from blue and red, and brown from all three "
        "of them at once.")
PROMPTS = [TEXT, "def fibonacci(n):\n    if n < 2:\n        return n\n    return", "Paris is"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    "(folder, transformers model) of the tiny gpt-oss."
    folder = tmp_path_factory.mktemp("gpt_oss") / "m"
    return folder, tiny_gpt_oss(folder, **CONFIG)


def logprob_error(model, ref, ids=IDS):
    with torch.inference_mode():
        ours = torch.log_softmax(model(ids, torch.arange(len(ids)), NoCache()), -1)
        theirs = torch.log_softmax(ref(ids[None]).logits[0].float(), -1)
    return (ours - theirs).abs().max().item()


def reference_greedy(ref, ids, n):
    "transformers greedy as its `generate` runs it: the prompt in one forward, then one token per forward."
    out, past = list(ids), None
    with torch.inference_mode():
        x = torch.tensor([out])
        for _ in range(n):
            r = ref(x, cache=past, use_cache=True)
            past = r.cache
            out.append(int(r.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
    return out[len(ids):]


def test_the_config_makes_every_feature_bite(tiny):
    folder, ref = tiny
    cfg = ModelConfig.from_folder(folder)
    assert layer_windows(cfg) == (8, None, 8, None) and 8 < len(IDS)
    assert sink_layers(cfg) == (0, 1, 2, 3)
    assert all(isinstance(a, SinkAttention) for a in cfg.layer_attention)
    assert cfg.rope.rope_type == "yarn" and cfg.rope.original_max_position_embeddings < len(IDS)
    assert cfg.qkv_bias and cfg.o_bias
    spec = cfg.layer_mlps[0]
    assert isinstance(spec, ClampedExperts) and spec.num_experts > spec.per_token and spec.limit == 1.0
    assert mixture_layers(cfg) == (0, 1, 2, 3)
    sinks = torch.cat([layer.self_attn.sinks for layer in ref.model.layers])
    assert sinks.std() > 1.0, "sinks too small to matter"
    assert {"sinks", "clamped_experts", "experts", "sliding_window", "qkv_bias", "o_bias"} <= set(model_behaviours(cfg))


def test_prompt_logprobs_equal_transformers(tiny):
    folder, ref = tiny
    err = logprob_error(load_model(folder), ref)
    assert err < 1e-4, f"max |d log p| = {err:.2e}"


def test_the_older_config_spelling_reads_the_same(tiny):
    "Folders written before transformers 5: `rope_scaling` + `rope_theta`, no `layer_types` (sliding on even layers)."
    folder, _ = tiny
    new = json.loads((folder / "config.json").read_text())
    old = copy.deepcopy(new)
    rope = old.pop("rope_parameters")
    old["rope_theta"] = rope.pop("rope_theta")
    old["rope_scaling"] = rope
    del old["layer_types"]
    assert ModelConfig.from_config(old) == ModelConfig.from_config(new)


# ---- broken on purpose: each comparison must fail ------------------------------------------------------------
BREAKS = {  # what is broken -> how, on each layer of a loaded model
    "sinks ignored": lambda layer: layer.self_attn.sinks.fill_(float("-inf")),
    "clamp removed": lambda layer: setattr(layer.mlp, "limit", float("inf")),
    "router softmax over all experts (not renormalised over the top k)": lambda layer: setattr(
        layer.mlp, "renormalise", False),
    "router bias dropped": lambda layer: layer.mlp.router.bias.zero_(),
    "expert biases dropped": lambda layer: (layer.mlp.gate_up_bias.zero_(), layer.mlp.down_bias.zero_()),
    "plain SiLU gate (alpha ignored)": lambda layer: setattr(layer.mlp, "alpha", 1.0),
}


@pytest.mark.parametrize("what", BREAKS)
def test_a_broken_feature_fails_the_comparison(tiny, what):
    folder, ref = tiny
    model = load_model(folder)
    with torch.no_grad():
        for layer in model.layers:
            BREAKS[what](layer)
    err = logprob_error(model, ref)
    assert err > 1e-3, f"{what}: still within {err:.1e} of transformers, so the test would not catch it"


ENGINE_PATHS = {  # switches -> what they exercise
    "auto": dict(),
    "torch": dict(kernels="torch", attention="torch", weights="plain"),
    "chunked prefill of 8 tokens, prefix cache": dict(kernels="torch", max_num_batched_tokens=8, block_size=4,
                                                      prefix_cache=True),
    "contiguous KV (no paging)": dict(kv="contiguous", kernels="torch"),
}


@pytest.mark.parametrize("switches", ENGINE_PATHS)
def test_through_llm_equal_transformers(tiny, switches):
    "Prompt log-probabilities of a 48-token prompt within 1e-4 and greedy tokens equal, through `LLM(folder)`."
    folder, ref = tiny
    with LLM(str(folder), dtype="float32", **ENGINE_PATHS[switches]) as llm:
        prompts = PROMPTS[:1] if "contiguous" in switches else PROMPTS
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
        outs = llm.generate(prompts, params, raw=True)
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference_greedy(ref, o.prompt_token_ids, 12), p
    ids = outs[0].prompt_token_ids
    assert len(ids) >= 48
    with torch.inference_mode():
        theirs = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1)
    entries = outs[0].prompt_logprobs[1:]  # row i predicts token i + 1
    err = max(abs(e[t] - theirs[i, t].item()) for i, (e, t) in enumerate(zip(entries, ids[1:])))
    assert err < 1e-4, f"{switches}: prompt log-probabilities off by {err:.2e}"


def test_the_one_call_step_refuses_and_auto_steps_aside(tiny):
    folder, _ = tiny
    cfg = ModelConfig.from_folder(folder)
    assert {"sinks", "clamped_experts"} <= set(refused_behaviours(cfg, STEP_PATH))
    with pytest.raises(ValueError, match="kernels='step' does not run gpt_oss models' .*sinks"):
        EngineConfig(model=str(folder), dtype="float32", kernels="step").resolve()
    assert EngineConfig(model=str(folder), dtype="float32").resolve().kernels != "step"


def test_tensor_parallelism_refuses_gpt_oss(tiny):
    folder, _ = tiny
    with pytest.raises(ValueError, match="mixture of experts"):
        EngineConfig(model=str(folder), dtype="float32", kernels="torch", tensor_parallel_size=2).resolve()
