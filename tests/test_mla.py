"""Chapter 12d: DeepSeek-V3's multi-head latent attention and group-limited experts, equal to
transformers.

No download: tiny DeepSeek-V3 models built by transformers in the test (`tiny_random_model`,
every weight re-randomised, the routers' correction biases too), in configs where each feature
bites: a latent narrower than the heads' keys and values together, a query bottleneck (and
none), a RoPE part with YaRN scaling whose original context is shorter than the prompt, values
narrower than keys, a dense first layer then experts in groups. References: transformers'
forward in fp32 (prompt log-probabilities within 1e-4 over 48 tokens) and its greedy `generate`.
"""
from dataclasses import replace
import pytest, torch

from minfer.model import ModelConfig, NoCache, load_model
from minfer.cpu_step import model_behaviours
from minfer.families import tiny_random_model
from minfer.mla import LatentCache, LatentPool, GroupLimitedExperts
from minfer.paged import PagedKVCache, kv_token_bytes
from minfer.roofline import kv_bytes_per_token
from minfer.llm import LLM
from minfer.sequence import SamplingParams

BASE = dict(num_key_value_heads=4, head_dim=8, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=12, kv_lora_rank=32, q_lora_rank=24, n_routed_experts=8, n_group=4,
            topk_group=2, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
            first_k_dense_replace=1, routed_scaling_factor=2.5, num_mtp_layers=0,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                 original_max_position_embeddings=16, mscale=1.0,
                                 mscale_all_dim=0.7))
CASES = {
    "yarn, query bottleneck, experts": {},
    "no query bottleneck, plain rope, halves": dict(
        q_lora_rank=None, rope_interleave=False, norm_topk_prob=False,
        rope_parameters=dict(rope_type="default", rope_theta=500.0)),
    "all dense, values wider than keys": dict(first_k_dense_replace=4, v_head_dim=28),
}
IDS = torch.randint(3, 2000, (48,), generator=torch.Generator().manual_seed(0))
LONG = ("The three primary colors are red, yellow and blue, and every other colour a painter "
        "mixes comes from them: orange from red and yellow, green from yellow and blue, purple "
        "from blue and red. Light mixes the other way, and its primaries are red, green and blue.")
PROMPTS = [LONG, "Paris is", "def fibonacci(n):\n    if n < 2:\n        return n\n    return"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    "case -> (folder, transformers model), built once per module."
    from transformers.utils import logging as hf_logging
    root, built = tmp_path_factory.mktemp("mla"), {}
    def get(case):
        if case not in built:
            folder = root / str(len(built))
            ref = tiny_random_model("deepseek_v3", folder, **{**BASE, **CASES[case]})
            with torch.no_grad():  # a buffer in transformers, so the default init leaves it at 0
                for name, b in ref.named_buffers():
                    if name.endswith("e_score_correction_bias"):
                        b.copy_(0.3 * torch.randn_like(b))
            hf_logging.disable_progress_bar()
            ref.save_pretrained(folder)
            hf_logging.enable_progress_bar()
            built[case] = folder, ref
        return built[case]
    return get


def logprob_error(model, ref, ids=IDS):
    with torch.inference_mode():
        ours = torch.log_softmax(model(ids, torch.arange(len(ids)), NoCache()), -1)
        theirs = torch.log_softmax(ref(ids[None]).logits[0].float(), -1)
    return (ours - theirs).abs().max().item()


@pytest.mark.parametrize("case", CASES)
def test_prompt_logprobs_equal_transformers(tiny, case):
    folder, ref = tiny(case)
    err = logprob_error(load_model(folder), ref)
    assert err < 1e-4, f"{case}: max |d log p| = {err:.2e}"


def test_the_configs_make_each_feature_bite(tiny):
    folder, _ = tiny("yarn, query bottleneck, experts")
    cfg = ModelConfig.from_folder(folder)
    spec = cfg.attention_spec
    assert spec.kv_lora_rank < cfg.num_attention_heads * (spec.qk_head_dim + spec.v_head_dim)
    assert spec.v_head_dim != spec.qk_head_dim and spec.q_lora_rank and spec.qk_rope_head_dim > 0
    assert cfg.rope.rope_type == "yarn" and cfg.rope.original_max_position_embeddings < len(IDS)
    assert cfg.layer_mlps[0] is None
    assert all(isinstance(s, GroupLimitedExperts) for s in cfg.layer_mlps[1:])
    assert "latent_attention" in model_behaviours(cfg)
    dense = ModelConfig.from_folder(tiny("all dense, values wider than keys")[0])
    assert dense.layer_mlps == (None,) * dense.num_hidden_layers and dense.head_dim == 28


@pytest.mark.parametrize("broken", ["softmax scale", "rope layout", "correction bias"])
def test_a_broken_piece_fails_the_comparison(tiny, broken):
    "Each piece the comparison must see, changed on purpose: the log-probs must move past 1e-4."
    folder, ref = tiny("yarn, query bottleneck, experts")
    model = load_model(folder)
    attn = model.layers[1].self_attn
    if broken == "softmax scale":  # without YaRN's mscale²
        attn.spec = replace(attn.spec, softmax_scale=attn.spec.qk_head_dim ** -0.5)
    elif broken == "rope layout":  # the pairs read as halves
        attn.spec = replace(attn.spec, rope_interleave=False)
    else:
        model.layers[1].mlp.e_score_correction_bias.zero_()
    assert logprob_error(model, ref) > 1e-4


@pytest.mark.parametrize("case", CASES)
def test_absorbed_path_equals_naive(tiny, case):
    "The prompt in chunks through a `LatentCache`, then one token at a time, against naive."
    folder, _ = tiny(case)
    model = load_model(folder)
    more = torch.randint(3, 2000, (8,), generator=torch.Generator().manual_seed(1))
    seq = torch.cat([IDS, more])
    cache, out, start = LatentCache(model.cfg.num_hidden_layers), [], 0
    with torch.inference_mode():
        for n in [20, 28] + [1] * 8:
            out.append(model(seq[start:start + n], torch.arange(start, start + n), cache))
            start += n
        naive = model(seq, torch.arange(len(seq)), NoCache())
    err = (torch.log_softmax(torch.cat(out), -1) - torch.log_softmax(naive, -1)).abs().max().item()
    assert err < 1e-4, f"{case}: absorbed vs naive max |d log p| = {err:.2e}"
    spec = model.cfg.attention_spec
    floor = (spec.kv_lora_rank + spec.qk_rope_head_dim) * 4 * model.cfg.num_hidden_layers
    # chapter 00b's count of the model's own cache is the floor; chapter 03's pool of K and V per head holds more
    assert cache.nbytes == len(seq) * floor == len(seq) * kv_bytes_per_token(model.cfg)
    assert floor < kv_token_bytes(model.cfg, "float32")


def reference_greedy(ref, prompt_ids, n):
    with torch.inference_mode():
        out = ref.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False)[0]
    return out[len(prompt_ids):].tolist()


SWITCHES = {"default": {},
            "torch, chunked prefill of 8 tokens": dict(kernels="torch", max_num_batched_tokens=8)}


def assert_logprobs_equal_transformers(ref, outs):
    """Each output's generated tokens' log-probs (the first from the prompt's last row, the others from decode steps)
    and its prompt's, where it asked for them, as transformers'."""
    for o in outs:
        ids = torch.tensor(o.prompt_token_ids + o.token_ids)
        with torch.inference_mode():
            theirs = torch.log_softmax(ref(ids[None]).logits[0].float(), -1)
        got = [d[t] for d, t in zip(o.samples[0].logprobs, o.token_ids)]
        if o.prompt_logprobs is not None:  # a request for them computes its whole prompt, cache or not
            got = [next(iter(d.values())) for d in o.prompt_logprobs[1:]] + got
        want = theirs[:-1].gather(1, ids[1:, None])[-len(got):, 0]
        assert (torch.tensor(got) - want).abs().max() < 1e-4, o.prompt_token_ids


@pytest.mark.parametrize("switches", SWITCHES)
def test_llm_matches_transformers(tiny, switches):
    """Through `LLM(folder)`, its latent pool chosen by itself: three prompts of different lengths in one batch,
    greedy tokens and the log-probs of prompt and output tokens as transformers'."""
    folder, ref = tiny("yarn, query bottleneck, experts")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    with LLM(str(folder), dtype="float32", **SWITCHES[switches]) as llm:
        assert llm.kv_dtype == "latent" and isinstance(llm.engine.cache, LatentPool)
        outs = llm.generate(PROMPTS, params, raw=True)
    for o in outs:
        assert o.token_ids == reference_greedy(ref, o.prompt_token_ids, 8), o.prompt_token_ids
    assert_logprobs_equal_transformers(ref, outs)
    assert len(outs[0].prompt_token_ids) >= 48


@pytest.mark.parametrize("case", CASES)
def test_a_prefix_cache_hit_on_the_latent_pool(tiny, case):
    "A second prompt that shares the first's opening blocks reads their cached rows, and still equals transformers."
    folder, ref = tiny(case)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    with LLM(str(folder), dtype="float32", prefix_cache=True, kernels="torch", max_num_batched_tokens=16) as llm:
        first = llm.generate(LONG, params, raw=True)[0]
        again = llm.generate(LONG + " So do printers.", params, raw=True)[0]
    assert first.metrics["num_cached_tokens"] == 0 and again.metrics["num_cached_tokens"] >= 32
    assert_logprobs_equal_transformers(ref, [first, again])
    for o in (first, again):
        assert o.token_ids == reference_greedy(ref, o.prompt_token_ids, 4)


def test_the_latent_pool_holds_only_latent_and_rope_key(tiny):
    """The pool's bytes per token: (kv_lora_rank + qk_rope_head_dim) x layers x the dtype's bytes, against the naive
    path's decompressed K and V in chapter 03's pool (kv_dtype set to the model's dtype)."""
    folder, _ = tiny("yarn, query bottleneck, experts")
    cfg = ModelConfig.from_folder(folder)
    spec, layers = cfg.attention_spec, cfg.num_hidden_layers
    floor = (spec.kv_lora_rank + spec.qk_rope_head_dim) * layers
    with LLM(str(folder), dtype="float32", kernels="torch") as llm:
        pool = llm.engine.cache
        latent = pool.nbytes / (pool.num_blocks * pool.block_size)
        ledger = llm.engine.ledger.kv_layer_bytes * layers
    assert latent == floor * 4 == ledger == kv_bytes_per_token(cfg, "float32")
    # the format says its bytes for the model's dtype
    assert kv_token_bytes(cfg, "latent", dtype="bfloat16") == floor * 2 == kv_bytes_per_token(cfg, "bfloat16")
    assert kv_token_bytes(cfg, "latent", dtype="float32") == floor * 4
    with LLM(str(folder), dtype="float32", kernels="torch", kv_dtype="float32") as llm:
        naive = llm.engine.cache.nbytes / (llm.engine.cache.num_blocks * llm.engine.cache.block_size)
        assert type(llm.engine.cache) is PagedKVCache
        assert llm.engine.ledger.kv_layer_bytes * layers == naive  # the ledger counts the pool the engine holds
    assert naive == kv_token_bytes(cfg, "float32") > 4 * latent


def test_the_roofline_counts_latent_attention_s_own_weights(tiny):
    "Chapter 00b's parameter count, through the attention module's `parameter_count`: the tiny model's own tensors."
    from minfer.roofline import param_counts
    folder, ref = tiny("yarn, query bottleneck, experts")
    cfg = ModelConfig.from_folder(folder)
    held = sum(p.numel() for n, p in ref.named_parameters() if ".self_attn." in n and "norm" not in n)
    assert param_counts(cfg)["attention"] == held


def test_a_broken_latent_pool_fails_the_comparison(tiny, monkeypatch):
    "The rows stored without their RoPE key part: the engine's log-probs must move past 1e-4."
    folder, ref = tiny("yarn, query bottleneck, experts")
    store = LatentPool.store
    def store_latent_only(self, layer, slots, rows):
        store(self, layer, slots, torch.cat([rows[:, :self.values], torch.zeros_like(rows[:, self.values:])], -1))
    monkeypatch.setattr(LatentPool, "store", store_latent_only)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    with LLM(str(folder), dtype="float32", kernels="torch") as llm:
        outs = llm.generate(PROMPTS[:1], params, raw=True)
    with pytest.raises(AssertionError):
        assert_logprobs_equal_transformers(ref, outs)


def test_the_latent_pool_refuses_other_models_in_one_line(model_dir):
    with pytest.raises(ValueError, match="kv_dtype='latent' stores latent attention's rows") as e:
        LLM(model_dir, kv_dtype="latent", kernels="torch", attention="torch")
    assert "\n" not in str(e.value)


def test_the_latent_pool_is_refused_when_the_config_resolves(model_dir):
    "By the format's `refuses`, checked by chapter 09's rules: no model is loaded, no engine built."
    from minfer.engine import EngineConfig
    with pytest.raises(ValueError, match="kv_dtype='latent' stores latent attention's rows") as e:
        EngineConfig(model=model_dir, kv_dtype="latent", kernels="torch", attention="torch").resolve()
    assert "\n" not in str(e.value)


def test_the_other_attention_backends_are_refused_in_one_line(tiny):
    "They read chapter 03's pool of K and V; the latent pool has a torch reader only."
    folder, _ = tiny("yarn, query bottleneck, experts")
    from minfer.engine import EngineConfig
    with pytest.raises(ValueError, match="does not read kv_dtype='latent'") as e:
        EngineConfig(model=str(folder), dtype="float32", kernels="cpu", attention="cpu").resolve()
    assert "\n" not in str(e.value)
    naive = EngineConfig(model=str(folder), dtype="float32", kernels="cpu", attention="cpu", kv_dtype="float32")
    assert naive.resolve().kv_dtype == "float32"


def test_the_one_call_step_refuses_latent_attention(tiny):
    folder, _ = tiny("yarn, query bottleneck, experts")
    with pytest.raises(ValueError, match="latent_attention"):
        with LLM(str(folder), dtype="float32", kernels="step"):
            pass


def test_deepseek_v2_is_refused_in_one_line(tiny):
    "DeepSeek-V2 routes by softmax with other top-k methods and turns RoPE as complex numbers."
    import json
    d = json.loads((tiny("yarn, query bottleneck, experts")[0] / "config.json").read_text())
    with pytest.raises(ValueError, match="model_type='deepseek_v2' is not supported") as e:
        ModelConfig.from_config({**d, "model_type": "deepseek_v2"})
    assert "\n" not in str(e.value)


def test_a_config_without_the_latent_numbers_is_refused_in_one_line(tiny):
    import json
    d = json.loads((tiny("yarn, query bottleneck, experts")[0] / "config.json").read_text())
    del d["kv_lora_rank"], d["v_head_dim"]
    with pytest.raises(ValueError, match="lacks kv_lora_rank, v_head_dim") as e:
        ModelConfig.from_config(d)
    assert "\n" not in str(e.value)


def test_tensor_parallelism_refuses_latent_attention_in_one_line(tiny):
    "Chapter 13 splits q/k/v heads of 00a's attention; a dense DeepSeek has no experts to trip the MoE rule."
    from minfer.engine import EngineConfig
    folder, _ = tiny("all dense, values wider than keys")
    with pytest.raises(ValueError, match="latent attention") as e:
        EngineConfig(model=str(folder), dtype="float32", kernels="torch", tensor_parallel_size=2).resolve()
    assert "\n" not in str(e.value)
