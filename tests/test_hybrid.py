"""Chapter 12g: Qwen3.5's hybrid of gated DeltaNet and gated full-attention layers, equal to transformers.

No download: tiny Qwen3.5 text models built by transformers in the test (`tiny_random_model`, every weight
re-randomised: the decays `A_log` and their `dt_bias`, the gates' norms, the convolutions), in configs where each
feature bites: linear and full layers alternating, twice as many value heads as key heads in the linear layers, RoPE on
a quarter of each full head, norms that scale by 1 + w. References: transformers' fp32 forward (prompt log-probabilities
within 1e-4 over >= 48 tokens) and its greedy generation loop over its own cache (the one-step rule in decode).
"""
import json
import pytest, torch

from minfer.model import ModelConfig, NoCache, load_model
from minfer.families import tiny_random_model
from minfer.cpu_step import model_behaviours
from minfer.hybrid import (GatedDeltaNet, HybridCache, HybridPool, delta_rule_chunked, delta_rule_recurrent, l2norm)
from minfer.roofline import param_counts
import minfer.kvquant  # chapter 09's kv_dtype switch, whose 'auto' picks a model's own format
from minfer.llm import LLM
from minfer.tokenizer import Tokenizer
from minfer.sequence import SamplingParams

BASE = dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
LONG = ("The three primary colors are red, yellow and blue, and every other colour a painter "
        "mixes comes from them: orange from red and yellow, green from yellow and blue, purple "
        "from blue and red. Light mixes the other way, and its primaries are red, green and blue.")
PROMPTS = [LONG, "Paris is", "def fibonacci(n):\n    if n < 2:\n        return n\n    return"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    "-> (folder, transformers model), built once per module."
    folder = tmp_path_factory.mktemp("qwen3_5") / "tiny"
    return folder, tiny_random_model("qwen3_5_text", folder, **BASE)


def reference_logprobs(ref, ids):
    with torch.inference_mode():
        return torch.log_softmax(ref(torch.as_tensor(ids)[None]).logits[0].float(), -1)


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


def assert_logprobs_equal_transformers(ref, outs):
    "Each sample's prompt log-probs (where asked) and generated tokens' log-probs, as transformers'."
    for o in outs:
        for sample in o.samples:
            ids = o.prompt_token_ids + sample.token_ids
            got = [d[t] for d, t in zip(sample.logprobs, sample.token_ids)]
            if o.prompt_logprobs is not None:
                got = [next(iter(d.values())) for d in o.prompt_logprobs[1:]] + got
            want = reference_logprobs(ref, ids)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[-len(got):, 0]
            assert (torch.tensor(got) - want).abs().max() < 1e-4, o.prompt_token_ids


def test_the_config_makes_every_feature_bite(tiny):
    folder, ref = tiny
    cfg = ModelConfig.from_folder(folder)
    spec = cfg.attention_spec
    assert [spec.is_linear(i) for i in range(4)] == [True, False, True, False]
    assert spec.value_heads == 2 * spec.key_heads and cfg.rope.rotated_dims(cfg.head_dim) == cfg.head_dim // 4
    assert {"recurrent_layers", "norm_offset", "partial_rotary"} <= set(model_behaviours(cfg))
    assert len(Tokenizer(folder).encode(LONG)) >= 48
    decays = [p for n, p in ref.named_parameters() if n.endswith(("A_log", "dt_bias"))]
    assert all(len(set(p.tolist())) == len(p) for p in decays)  # re-randomised, not transformers' init


def test_chunked_rule_equals_one_token_at_a_time():
    torch.manual_seed(0)
    B, T, H, dk, dv = 2, 37, 4, 16, 8
    q, k = (l2norm(torch.randn(B, T, H, dk)) for _ in range(2))
    v, g, beta = torch.randn(B, T, H, dv), -torch.rand(B, T, H), torch.rand(B, T, H)
    start = torch.randn(B, H, dk, dv)
    one, s1 = delta_rule_recurrent(q, k, v, g, beta, start)
    for chunk in (4, 16, 64):
        chunked, s2 = delta_rule_chunked(q, k, v, g, beta, start, chunk=chunk)
        assert (one - chunked).abs().max() < 1e-5 and (s1 - s2).abs().max() < 1e-5


def test_the_forward_equals_transformers(tiny):
    "One forward, and a 48-token prefill then one-token decode steps in `HybridCache`, against one reference forward."
    folder, ref = tiny
    model = load_model(folder)
    ids = torch.randint(3, 2000, (64,), generator=torch.Generator().manual_seed(0))
    theirs = reference_logprobs(ref, ids)
    with torch.inference_mode():
        whole = torch.log_softmax(model(ids, torch.arange(64), NoCache()), -1)
        cache = HybridCache()
        rows = [model(ids[:48], torch.arange(48), cache)]
        rows += [model(ids[t:t + 1], torch.tensor([t]), cache) for t in range(48, 64)]
        stepped = torch.log_softmax(torch.cat(rows), -1)
    prompt = lambda lp: lp[:-1].gather(1, ids[1:, None])
    for ours in (whole, stepped):
        assert (prompt(ours) - prompt(theirs)).abs().max() < 1e-4
        assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    assert cache.nbytes > 0 and set(cache.states) == {0, 1} and set(cache.k) == {0, 1}


SWITCHES = {"default": {},
            "chunked prefill of 8 tokens": dict(max_num_batched_tokens=8),
            "chunked prefill of 5, blocks of 4": dict(max_num_batched_tokens=5, block_size=4)}


@pytest.mark.parametrize("switches", SWITCHES)
def test_the_engine_equals_transformers(tiny, switches):
    "Three prompts at once (batched decode), through the pool's states; chunks that start and end inside blocks."
    folder, ref = tiny
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    with LLM(str(folder), dtype="float32", **SWITCHES[switches]) as llm:
        assert isinstance(llm.engine.cache, HybridPool)
        outs = llm.generate(PROMPTS, params, raw=True)
    assert len(outs[0].prompt_token_ids) >= 48
    assert_logprobs_equal_transformers(ref, outs)
    for o in outs:
        assert o.token_ids == reference_greedy(ref, o.prompt_token_ids, 8)
    assert len(set(outs[0].token_ids)) > 1  # not one token repeated: greedy has something to match


def test_a_prefix_cache_hit_resumes_from_the_deepest_checkpoint(tiny):
    """A longer prompt sharing LONG; LONG again (its whole blocks cached); a prompt of exactly two blocks again (all of
    it cached: it resumes at the boundary before its last block, not one token short of the end, where no state was
    saved); a prompt shorter than two blocks sharing one: each resumes at a block boundary, with transformers' tokens."""
    folder, ref = tiny
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    tok = Tokenizer(folder)
    n = len(tok.encode(LONG))
    short, two_blocks = LONG[:90], LONG[:150]  # 19 tokens (one whole block, shared with LONG), 32 tokens
    assert len(tok.encode(two_blocks)) == 32 and len(tok.encode(short + " and")) < 32
    with LLM(str(folder), dtype="float32", prefix_cache=True, max_num_batched_tokens=16) as llm:
        first = llm.generate([LONG, two_blocks], params, raw=True)
        again = llm.generate([LONG + " So do printers.", LONG, two_blocks, short + " and"], params, raw=True)
    cached = [o.metrics["num_cached_tokens"] for o in first + again]
    assert cached == [0, 0, n // 16 * 16, n // 16 * 16, 16, 16] and n % 16
    assert_logprobs_equal_transformers(ref, first + again)
    for o in first + again:
        assert o.token_ids == reference_greedy(ref, o.prompt_token_ids, 4)


def test_a_bf16_model_runs_its_fp32_prefill(tiny):
    """bf16 weights: a prefill computes in fp32 (chapter 00a's `wide_dtype`), decode in bf16, the states in fp32; the
    convolution follows the activations' dtype. Lossy: only that it runs here (fp32 is what is compared)."""
    folder, _ = tiny
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(str(folder), dtype="bfloat16", max_num_batched_tokens=16) as llm:
        assert llm.engine.cache.state.dtype == torch.float32 and llm.engine.cache.conv.dtype == torch.bfloat16
        outs = llm.generate(PROMPTS, params, raw=True)
    assert all(len(o.token_ids) == 4 for o in outs)


def test_samples_of_one_prompt_copy_the_state_on_write(tiny):
    "n = 3 samples fork after the prompt: each block they share, its state with it, is copied before one writes it."
    folder, ref = tiny
    params = SamplingParams(temperature=1.0, n=3, seed=3, max_tokens=6, ignore_eos=True, logprobs=0)
    with LLM(str(folder), dtype="float32", block_size=4) as llm:
        out = llm.generate(PROMPTS[1], params, raw=True)[0]
    assert len({tuple(s.token_ids) for s in out.samples}) > 1  # different samples: their states must differ
    assert_logprobs_equal_transformers(ref, [out])


def test_the_roofline_counts_the_model_s_own_weights(tiny):
    folder, ref = tiny
    held = sum(p.numel() for n, p in ref.named_parameters() if (".self_attn." in n or ".linear_attn." in n)
               and not n.endswith(("q_norm.weight", "k_norm.weight")))
    assert param_counts(ModelConfig.from_folder(folder))["attention"] == held


def test_a_dropped_decay_fails_the_comparison(tiny, monkeypatch):
    "The linear layers without their gate's decay (g = 0: the state never forgets): log-probs must move."
    folder, ref = tiny
    mix = GatedDeltaNet.mix
    monkeypatch.setattr(GatedDeltaNet, "mix", lambda self, qkv, g, beta, *state: mix(self, qkv, g * 0, beta, *state))
    model = load_model(folder)
    ids = torch.randint(3, 2000, (48,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ours = torch.log_softmax(model(ids, torch.arange(48), NoCache()), -1)
    assert (ours - reference_logprobs(ref, ids)).abs().max() > 1e-2


@pytest.mark.parametrize("key, value, words", [
    ("layer_types", ["linear_attention", "sliding_attention"] * 2, "are not supported"),
    ("linear_num_value_heads", 3, "is not a multiple of linear_num_key_heads"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 2.0, "mrope_section": [1, 1, 0]},
     "mrope_section with rope_type=.yarn. is not supported")])
def test_what_is_not_run_is_refused_in_one_line(tiny, key, value, words):
    folder, _ = tiny
    d = json.loads((folder / "config.json").read_text())
    with pytest.raises(ValueError, match=words) as e:
        ModelConfig.from_config({**d, key: value})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("switches, words", [
    (dict(kv_dtype="float32"), "runs only in kv_dtype='hybrid'"),
    (dict(kv="contiguous"), "runs only in kv_dtype='hybrid'"),
    (dict(kv_dtype="int8"), "runs only in kv_dtype='hybrid'"),
    (dict(speculative="ngram"), "which speculative decoding needs: its blocks carry the linear"),
    (dict(pd_split=True), "pd_split=True sends whole blocks"),
    (dict(kernels="step"), "does not run qwen3_5_text models' .*recurrent_layers"),
    (dict(attention="cpu"), "does not read kv_dtype='hybrid'")])
def test_other_paths_are_refused_in_one_line(tiny, switches, words):
    from minfer.engine import EngineConfig
    import minfer.speculative, minfer.disagg  # noqa: F401 (their switches)
    folder, _ = tiny
    with pytest.raises(ValueError, match=words) as e:
        EngineConfig(model=str(folder), dtype="float32", **switches).resolve()
    assert "\n" not in str(e.value)


def test_other_models_keep_their_pools(model_dir):
    from minfer.engine import EngineConfig
    from minfer.paged import KV_FORMATS
    assert "has none" in KV_FORMATS["hybrid"].refuses(ModelConfig.from_folder(model_dir))
    assert EngineConfig(model=model_dir, dtype="float32").resolve().kv_dtype == "float32"


def tiny_traffic():
    """-> (K/V bytes per token, state bytes per sequence) of `tiny` in fp32, from its config's numbers: K and V in
    each full layer; in each linear layer the rule's matrices (fp32) and the convolution's window of 4 - 1 inputs."""
    kv_heads, head_dim = 2, 16  # chapter 12a's TINY
    key_heads, value_heads, key_dim, value_dim = 2, 4, 16, 16  # BASE
    full, linear = 2, 2
    kv_per_token = full * 2 * kv_heads * head_dim * 4
    conv_window = (2 * key_heads * key_dim + value_heads * value_dim) * (4 - 1) * 4
    return kv_per_token, linear * (value_heads * key_dim * value_dim * 4 + conv_window)


def test_the_ledger_charges_linear_layers_their_state_once_per_sequence(tiny):
    """A prompt of n tokens, then 3 decode steps (4 tokens out). Full layers: K and V per cached token read and per new
    token written, as any model. Linear layers: no K/V per token; their state (the rule's matrices in fp32, the
    convolution's window in the model's dtype) read once per sequence per step that has one, written once per step."""
    folder, _ = tiny
    kv_per_token, state = tiny_traffic()
    with LLM(str(folder), dtype="float32") as llm:
        out = llm.generate(LONG, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), raw=True)[0]
        ledger = llm.engine.ledger
    n = len(out.prompt_token_ids)
    assert ledger.steps == 4 and ledger.tokens_in == n + 3
    assert ledger.kv_write_bytes == (n + 3) * kv_per_token + 4 * state
    assert ledger.kv_read_bytes == (n + n + 1 + n + 2) * kv_per_token + 3 * state


def test_recomputing_without_a_cache_equals_transformers(tiny):
    """What kv='none' runs (chapter 01: every step the whole sequence again over `NoCache`, each linear layer's state
    from zero) gives transformers' greedy tokens."""
    from minfer.naive import naive_generate
    folder, ref = tiny
    ids = Tokenizer(folder).encode(LONG)
    assert naive_generate(load_model(folder), ids, 8) == reference_greedy(ref, ids, 8)



def test_a_request_s_bytes_count_its_state(tiny):
    """A request's `bytes_moved` (and so its bytes per token): the weights, its K/V read and written, and its state,
    read in each step after the first and written in each (4 steps: the prompt, then 3 decode steps), as the ledger
    charges them; alone in the engine, the ledger's whole count."""
    folder, _ = tiny
    kv_per_token, state = tiny_traffic()
    with LLM(str(folder), dtype="float32") as llm:
        out = llm.generate(LONG, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), raw=True)[0]
        ledger = llm.engine.ledger
    n, sample = len(out.prompt_token_ids), out.samples[0]
    kv = (n + n + 1 + n + 2 + n + 3) * kv_per_token  # each step's context and new token
    want = ledger.weight_bytes + kv + (3 + 4) * state
    assert sample.metrics["bytes_per_token"] * 4 == pytest.approx(want, rel=1e-12)
    assert want == ledger.weight_bytes + ledger.kv_read_bytes + ledger.kv_write_bytes


def test_no_cache_runs_in_the_engine_as_transformers(tiny):
    "kv='none' keeps no pool, so the model's own one is not needed: `LLM` runs it, with transformers' greedy tokens."
    folder, ref = tiny
    with LLM(str(folder), dtype="float32", kv="none") as llm:
        out = llm.generate(LONG, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), raw=True)[0]
    assert out.token_ids == reference_greedy(ref, out.prompt_token_ids, 8)

MROPE = dict(BASE, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                   "mrope_section": [2, 1, 1], "mrope_interleaved": True})


@pytest.fixture(scope="module")
def tiny_mrope(tmp_path_factory):
    """-> (folder, transformers model) of a config that writes multimodal RoPE's sections, as Qwen3.5's folders do.
    Seed 1: in this family fp32 rounding moves the log-prob of a token near -35 by up to about 1e-4 whatever the
    sections (plain RoPE alike); seed 1's worst prompt token sits further inside the bound than seed 0's."""
    folder = tmp_path_factory.mktemp("qwen3_5_mrope") / "tiny"
    return folder, tiny_random_model("qwen3_5_text", folder, seed=1, **MROPE)


def test_multimodal_rope_on_text_equals_transformers(tiny_mrope):
    "`mrope_section` over 4 frequencies (8 of each head's 16 dimensions turn): one forward and the engine's tokens."
    folder, ref = tiny_mrope
    p = json.loads((folder / "config.json").read_text())["rope_parameters"]
    assert p["mrope_section"] == [2, 1, 1] and p["mrope_interleaved"]
    cfg = ModelConfig.from_folder(folder)
    assert cfg.rope.rope_type == "mrope" and cfg.rope.rotated_dims(cfg.head_dim) == 8
    ids = torch.randint(3, 2000, (64,), generator=torch.Generator().manual_seed(1))
    theirs = reference_logprobs(ref, ids)
    with torch.inference_mode():
        ours = torch.log_softmax(load_model(folder)(ids, torch.arange(64), NoCache()), -1)
    prompt = lambda lp: lp[:-1].gather(1, ids[1:, None])
    assert (prompt(ours) - prompt(theirs)).abs().max() < 1e-4
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    with LLM(str(folder), dtype="float32") as llm:
        outs = llm.generate(PROMPTS, params, raw=True)
    assert len(outs[0].prompt_token_ids) >= 48
    assert_logprobs_equal_transformers(ref, outs)
    for o in outs:
        assert o.token_ids == reference_greedy(ref, o.prompt_token_ids, 8)


def test_sections_turned_by_another_position_fail_the_comparison(tiny_mrope, monkeypatch):
    "The height and width sections turned by position 0, as an image's first patch would be: log-probs must move."
    from minfer.hybrid import TextMRope
    folder, ref = tiny_mrope
    frequencies = TextMRope.frequencies
    def time_only(self, dim):  # interleaved sections: height at frequency 1, width at 2
        inv, scale = frequencies(self, dim)
        return inv.index_fill(0, torch.tensor([1, 2]), 0.0), scale
    monkeypatch.setattr(TextMRope, "frequencies", time_only)
    ids = torch.randint(3, 2000, (48,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ours = torch.log_softmax(load_model(folder)(ids, torch.arange(48), NoCache()), -1)
    assert (ours - reference_logprobs(ref, ids)).abs().max() > 1e-2
