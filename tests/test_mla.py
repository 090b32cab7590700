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
from minfer.families import tiny_random_model
from minfer.mla import LatentCache, GroupLimitedExperts
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
    assert "latent_attention" in cfg.behaviours()
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
    assert cache.nbytes == len(seq) * floor < len(seq) * kv_bytes_per_token(model.cfg)


def reference_greedy(ref, prompt_ids, n):
    with torch.inference_mode():
        out = ref.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False)[0]
    return out[len(prompt_ids):].tolist()


SWITCHES = {"default": {},
            "torch, chunked prefill of 8 tokens": dict(kernels="torch", max_num_batched_tokens=8)}


@pytest.mark.parametrize("switches", SWITCHES)
def test_llm_matches_transformers(tiny, switches):
    "Through `LLM(folder)`: greedy tokens and prompt log-probs as transformers'."
    folder, ref = tiny("yarn, query bottleneck, experts")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    with LLM(str(folder), dtype="float32", **SWITCHES[switches]) as llm:
        outs = llm.generate(PROMPTS, params, raw=True)
    for o in outs:
        assert o.token_ids == reference_greedy(ref, o.prompt_token_ids, 8), o.prompt_token_ids
        ids = torch.tensor(o.prompt_token_ids)
        with torch.inference_mode():
            theirs = torch.log_softmax(ref(ids[None]).logits[0].float(), -1)
        want = theirs[:-1].gather(1, ids[1:, None])[:, 0]
        got = torch.tensor([next(iter(d.values())) for d in o.prompt_logprobs[1:]])
        assert (got - want).abs().max() < 1e-4
    assert len(outs[0].prompt_token_ids) >= 48


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
