"""Chapter 12e: Gemma 4's text model, whose last layers reuse earlier layers' K/V, equal to transformers.

No download: tiny Gemma 4 models built by transformers in the test (`tiny_random_model`, every weight re-randomised,
`layer_scalar` too), in configs where each feature bites: six layers alternating sliding (a window of 8, shorter than
the prompt) and full, the last two reusing layers 2 and 3; full layers turning part of each head (`proportional`
RoPE); soft-capped logits; values that are the keys (`attention_k_eq_v`) in one case. References: transformers' forward
in fp32 (prompt log-probabilities within 1e-4 over >= 48 tokens) and its greedy generation loop.
"""
import pytest, torch

from minfer.model import ModelConfig, NoCache, load_model
from minfer.families import tiny_random_model
from minfer.cpu_step import model_behaviours
from minfer.shared_kv import SharedKVAttention, SharedKVPool
from minfer.paged import PagedKVCache, kv_token_bytes
from minfer.roofline import kv_bytes_per_token, kv_traffic_per_token, param_counts
import minfer.kvquant  # chapter 09's kv_dtype switch, whose 'auto' picks a model's own format
from minfer.llm import LLM
from minfer.tokenizer import Tokenizer
from minfer.sequence import SamplingParams

KINDS = ["sliding_attention", "full_attention"] * 3
BASE = dict(num_hidden_layers=6, layer_types=KINDS, sliding_window=8, num_kv_shared_layers=2,
            hidden_size_per_layer_input=0, global_head_dim=16, final_logit_softcapping=30.0,
            tie_word_embeddings=False,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                "rope_theta": 1e6}})
CASES = {"shared kv, window 8": {}, "keys as values": dict(attention_k_eq_v=True)}
LONG = ("The three primary colors are red, yellow and blue, and every other colour a painter "
        "mixes comes from them: orange from red and yellow, green from yellow and blue, purple "
        "from blue and red. Light mixes the other way, and its primaries are red, green and blue.")
PROMPTS = [LONG, "Paris is", "def fibonacci(n):\n    if n < 2:\n        return n\n    return"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    "case -> (folder, transformers model), built once per module."
    from transformers.utils import logging as hf_logging
    root, built = tmp_path_factory.mktemp("gemma4"), {}
    def get(case):
        if case not in built:
            folder = root / str(len(built))
            ref = tiny_random_model("gemma4_text", folder, **{**BASE, **CASES[case]})
            with torch.no_grad():  # a buffer in transformers, so the default init leaves it at 1
                for name, b in ref.named_buffers():
                    if name.endswith("layer_scalar"):
                        b.copy_(1 + 0.3 * torch.randn_like(b))
            hf_logging.disable_progress_bar()
            ref.save_pretrained(folder)
            hf_logging.enable_progress_bar()
            built[case] = folder, ref
        return built[case]
    return get


def reference_logprobs(ref, ids):
    "transformers' log-probs; `output_hidden_states`: its shortcut past the shared layers needs per-layer inputs."
    with torch.inference_mode():
        return torch.log_softmax(ref(torch.as_tensor(ids)[None], output_hidden_states=True).logits[0].float(), -1)


def reference_greedy(ref, ids, n):
    "transformers greedy as its `generate` runs it: the prompt in one forward, then one token per forward."
    out, past = list(ids), None
    with torch.inference_mode():
        x = torch.tensor([out])
        for _ in range(n):
            r = ref(x, cache=past, use_cache=True, output_hidden_states=True)
            past = r.cache
            out.append(int(r.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
    return out[len(ids):]


def assert_logprobs_equal_transformers(ref, outs):
    "Each output's prompt log-probs (where asked) and generated tokens' log-probs, as transformers'."
    for o in outs:
        ids = o.prompt_token_ids + o.token_ids
        theirs = reference_logprobs(ref, ids)
        got = [d[t] for d, t in zip(o.samples[0].logprobs, o.token_ids)]
        if o.prompt_logprobs is not None:
            got = [next(iter(d.values())) for d in o.prompt_logprobs[1:]] + got
        want = theirs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[-len(got):, 0]
        assert (torch.tensor(got) - want).abs().max() < 1e-4, o.prompt_token_ids


def test_the_config_makes_every_feature_bite(tiny):
    folder, ref = tiny("shared kv, window 8")
    cfg = ModelConfig.from_folder(folder)
    assert ref.config.kv_sharing_modes[-2:] == ["reuse", "reuse"]
    assert cfg.attention_spec.sources == (0, 1, 2, 3, 2, 3) and cfg.attention_spec.cached_layers == 4
    assert {"shared_kv", "layer_scalar", "sliding_window", "final_softcap", "local_rope"} <= set(model_behaviours(cfg))
    assert len(Tokenizer(folder).encode(LONG)) > 48 > BASE["sliding_window"]
    scalars = [float(b) for n, b in ref.named_buffers() if n.endswith("layer_scalar")]
    assert len(set(scalars)) == 6 and 1.0 not in scalars
    assert not hasattr(ref.model.layers[5].self_attn, "k_proj")  # transformers' own reusing layer: no K/V weights


@pytest.mark.parametrize("case", CASES)
def test_the_forward_equals_transformers(tiny, case):
    folder, ref = tiny(case)
    model = load_model(folder)
    ids = torch.randint(3, 2000, (48,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ours = torch.log_softmax(model(ids, torch.arange(48), NoCache()), -1)
    assert (ours - reference_logprobs(ref, ids)).abs().max() < 1e-4


SWITCHES = {"default": {},
            "chunked prefill of 8 tokens": dict(kernels="torch", max_num_batched_tokens=8),
            "every layer's pool, C++ attention": dict(kv_dtype="float32")}


@pytest.mark.parametrize("switches", SWITCHES)
def test_the_engine_equals_transformers(tiny, switches):
    folder, ref = tiny("shared kv, window 8")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    with LLM(str(folder), dtype="float32", **SWITCHES[switches]) as llm:
        outs = llm.generate(PROMPTS, params, raw=True)
    assert len(outs[0].prompt_token_ids) >= 48
    assert_logprobs_equal_transformers(ref, outs)
    for o in outs:
        assert o.token_ids == reference_greedy(ref, o.prompt_token_ids, 8)
    assert len(set(outs[0].token_ids)) > 1  # not one token repeated: greedy has something to match


def test_the_prefix_cache_serves_the_shared_layers(tiny):
    folder, ref = tiny("keys as values")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    with LLM(str(folder), dtype="float32", prefix_cache=True, kernels="torch", max_num_batched_tokens=16) as llm:
        assert isinstance(llm.engine.cache, SharedKVPool)
        first = llm.generate(LONG, params, raw=True)[0]
        again = llm.generate(LONG + " So do printers.", params, raw=True)[0]
    assert first.metrics["num_cached_tokens"] == 0 and again.metrics["num_cached_tokens"] >= 32
    assert_logprobs_equal_transformers(ref, [first, again])
    for o in (first, again):
        assert o.token_ids == reference_greedy(ref, o.prompt_token_ids, 4)


def test_the_shared_layers_have_no_blocks(tiny):
    """The pool's bytes per token: K and V of the 4 layers that cache, against chapter 03's pool of all 6 (kv_dtype
    set to the model's dtype); more blocks fit the same budget. The ledger charges the same traffic either way: all 6
    layers read K/V per token of context, the 4 that cache write; chapter 00b's count of the cache says 4 layers."""
    folder, ref = tiny("shared kv, window 8")
    cfg = ModelConfig.from_folder(folder)
    per_layer = 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    pools = {}
    for kv_dtype in ("auto", "float32"):
        with LLM(str(folder), dtype="float32", kernels="torch", kv_dtype=kv_dtype, kv_cache_bytes=2**22) as llm:
            pool, ledger = llm.engine.cache, llm.engine.ledger
            llm.generate(LONG, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
            pools[kv_dtype] = (type(pool), pool.nbytes / (pool.num_blocks * pool.block_size), pool.num_blocks,
                               kv_traffic_per_token(cfg, layer_bytes=ledger.kv_layer_bytes),
                               (ledger.kv_read_bytes, ledger.kv_write_bytes))
    assert pools["auto"][:2] == (SharedKVPool, 4 * per_layer) and pools["float32"][:2] == (PagedKVCache, 6 * per_layer)
    assert pools["auto"][2] >= pools["float32"][2] * 3 // 2
    assert pools["auto"][3] == pools["float32"][3] == (6 * per_layer, 4 * per_layer)
    assert pools["auto"][4] == pools["float32"][4] and pools["auto"][4][0] > 0
    assert kv_bytes_per_token(cfg, "float32") == 4 * per_layer == kv_token_bytes(cfg, "shared_kv", dtype="float32")
    assert kv_token_bytes(cfg, "shared_kv", dtype="bfloat16") == 2 * per_layer


def test_the_roofline_counts_the_model_s_own_weights(tiny):
    for case in CASES:
        folder, ref = tiny(case)
        held = sum(p.numel() for n, p in ref.named_parameters() if ".self_attn." in n and "norm" not in n)
        assert param_counts(ModelConfig.from_folder(folder))["attention"] == held


def test_a_broken_sharing_fails_the_comparison(tiny, monkeypatch):
    "A reusing layer that attends over its own layer index (an empty part of the pool): log-probs must move."
    folder, ref = tiny("shared kv, window 8")
    forward = SharedKVAttention.forward
    def own_index(self, x, cos, sin, layer, attention):
        self.source = self.layer if self.layer < 4 else self.layer - 4  # the wrong earlier layer
        return forward(self, x, cos, sin, layer, attention)
    monkeypatch.setattr(SharedKVAttention, "forward", own_index)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    with LLM(str(folder), dtype="float32", kernels="torch") as llm:
        outs = llm.generate(PROMPTS[:1], params, raw=True)
    with pytest.raises(AssertionError):
        assert_logprobs_equal_transformers(ref, outs)


@pytest.mark.parametrize("key, value, words", [
    ("hidden_size_per_layer_input", 256, "per-layer input embeddings are not supported"),
    ("enable_moe_block", True, "enable_moe_block=True is not supported"),
    ("global_head_dim", 32, "layers of two widths in one KV pool are not supported"),
    ("num_kv_shared_layers", 5, "has no earlier layer of its kind")])
def test_what_is_not_run_is_refused_in_one_line(tiny, key, value, words):
    import json
    folder, _ = tiny("shared kv, window 8")
    d = json.loads((folder / "config.json").read_text())
    d[key] = value
    if key == "global_head_dim":
        d.pop("per_layer_config", None)
    with pytest.raises(ValueError, match=words) as e:
        ModelConfig.from_config(d)
    assert "\n" not in str(e.value)


def test_other_paths_are_refused_in_one_line(tiny, model_dir):
    from minfer.engine import EngineConfig
    folder, _ = tiny("shared kv, window 8")
    with pytest.raises(ValueError, match="kernels='step' does not run gemma4_text") as e:
        EngineConfig(model=str(folder), dtype="float32", kernels="step").resolve()
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="does not read kv_dtype='shared_kv'") as e:
        EngineConfig(model=str(folder), dtype="float32", kv_dtype="shared_kv", attention="cpu").resolve()
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="kv_dtype='shared_kv' holds layers that share K/V") as e:
        EngineConfig(model=model_dir, kv_dtype="shared_kv", kernels="torch", attention="torch").resolve()
    assert "\n" not in str(e.value)


def test_a_model_without_reusing_layers_keeps_chapter_03_s_pool(tiny):
    "No layer reuses K/V: the shared pool would be chapter 03's, so 'auto' keeps that one (which every backend reads)."
    import json
    from minfer.paged import KV_FORMATS
    folder, _ = tiny("shared kv, window 8")
    d = json.loads((folder / "config.json").read_text())
    cfg = ModelConfig.from_config({**d, "num_kv_shared_layers": 0})
    assert cfg.attention_spec.cached_layers == 6 and not KV_FORMATS["shared_kv"].made_for(cfg)
    assert "the folder's gemma4_text model has none" in KV_FORMATS["shared_kv"].refuses(cfg)
    assert KV_FORMATS["shared_kv"].made_for(ModelConfig.from_folder(folder))


def test_building_models_leaves_nothing_behind(tiny, monkeypatch):
    """Two models built one after the other: each reusing layer reads its own model's source layer. A build that fails
    midway (the fifth layer's MLP cannot be made) leaves none of the layers it had made alive: nothing outside the
    model holds them."""
    import gc, weakref
    import minfer.model
    from minfer.model import Llama
    folder, _ = tiny("shared kv, window 8")
    cfg = ModelConfig.from_folder(folder)
    made, init = [], SharedKVAttention.__init__
    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))
    monkeypatch.setattr(SharedKVAttention, "__init__", tracked)
    with torch.device("meta"):
        first, second = Llama(cfg), Llama(cfg)
    for model in (first, second):
        for i, source in enumerate(cfg.attention_spec.sources):
            assert model.layers[i].self_attn.reads == ([] if source == i else [model.layers[source].self_attn])
    del first, second, model
    layer_mlp = minfer.model.layer_mlp
    def failing(cfg, layer):
        if layer == 4:
            raise RuntimeError("no memory left")
        return layer_mlp(cfg, layer)
    monkeypatch.setattr(minfer.model, "layer_mlp", failing)
    failed = False
    try:
        with torch.device("meta"):
            Llama(cfg)
    except RuntimeError:
        failed = True
    gc.collect()
    assert failed and len(made) == 6 + 6 + 5
    assert [r for r in made if r() is not None] == []
