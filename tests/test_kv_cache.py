"""Chapter 12f: the KV bytes each architecture caches, from `config.json` alone, against the engine's own counts.

No download: public configs typed in (the fields the formulas read), and tiny random models of the families the
engine runs, built by transformers in the test (chapter 12a's `tiny_random_model`), run through `LLM`: the pool's
bytes per slot must equal the formula for every family; the ledger's KV bytes per token too, except for latent
attention, whose ledger count is not the latent's (see chapter 12f).
"""
import json

import pytest, torch

from minfer.model import ModelConfig
from minfer.roofline import kv_bytes_per_token
from minfer.mla import LatentPool
from minfer.families import tiny_random_model
from minfer.sinks import tiny_gpt_oss
from minfer.llm import LLM
from minfer.sequence import SamplingParams
from minfer.kv_cache import (layer_token_bytes, kv_sequence_bytes, latent_sequence_bytes, windowed_sequence_bytes,
                             shared_sequence_bytes, linear_state_bytes, hybrid_sequence_bytes)
import minfer.kvquant  # noqa: F401  (chapter 09's kv_dtype switch: 'auto' picks 12d's latent pool for MLA)

LLAMA_31_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8)
DEEPSEEK_V3 = dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                   num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512,
                   q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
GEMMA_4_E2B = dict(hidden_size=1536, num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
                   global_head_dim=512, sliding_window=512, num_kv_shared_layers=20,
                   layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7)
QWEN35_9B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                 layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8, linear_num_key_heads=16,
                 linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                 linear_conv_kernel_dim=4, mamba_ssm_dtype="float32")


def test_heads_and_latent_by_hand_and_as_the_engine_counts():
    assert kv_sequence_bytes(LLAMA_31_8B, 1) == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert kv_sequence_bytes(LLAMA_31_8B, 1) == kv_bytes_per_token(ModelConfig.from_config(LLAMA_31_8B), "bfloat16")
    mqa = dict(LLAMA_31_8B, num_key_value_heads=1)
    assert kv_sequence_bytes(mqa, 131072) * 8 == kv_sequence_bytes(LLAMA_31_8B, 131072)
    assert latent_sequence_bytes(DEEPSEEK_V3, 1) == 61 * (512 + 64) * 2 == 70272
    v3 = ModelConfig.from_config(DEEPSEEK_V3)
    assert latent_sequence_bytes(DEEPSEEK_V3, 1) == LatentPool.block_bytes(v3, 1, torch.bfloat16)


def test_windows_keep_their_window_and_full_layers_everything():
    kinds = ["sliding_attention", "full_attention"] * 2
    d = dict(LLAMA_31_8B, num_hidden_layers=4, sliding_window=16, layer_types=kinds)
    per_layer = layer_token_bytes(d)
    assert windowed_sequence_bytes(d, 10) == kv_sequence_bytes(d, 10)  # shorter than the window: nothing dropped
    assert windowed_sequence_bytes(d, 100) == per_layer * (2 * 16 + 2 * 100)
    assert windowed_sequence_bytes(dict(d, sliding_window=None), 100) == kv_sequence_bytes(d, 100)


def test_shared_layers_cache_nothing_and_global_layers_their_own_width():
    own = 12 * 2 * 1 * 256 * 2 * 512 + 3 * 2 * 1 * 512 * 2 * 131072  # 12 sliding, 3 full (width 512) own a cache
    assert shared_sequence_bytes(GEMMA_4_E2B, 131072) == own
    unshared = dict(GEMMA_4_E2B, num_kv_shared_layers=0)
    assert shared_sequence_bytes(unshared, 131072) == windowed_sequence_bytes(GEMMA_4_E2B, 131072)
    assert layer_token_bytes(GEMMA_4_E2B, "full_attention") == 2 * layer_token_bytes(GEMMA_4_E2B, "sliding_attention")


def test_linear_layers_hold_a_constant_state():
    state = 32 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 32 * 128) * 2  # fp32 matrices, bf16 convolution inputs
    assert linear_state_bytes(QWEN35_9B) == state
    full_token = 2 * 4 * 256 * 2
    for tokens in (1, 4096, 131072):
        assert hybrid_sequence_bytes(QWEN35_9B, tokens) == 24 * state + 8 * tokens * full_token


TINY = {  # name -> (model_type, overrides of 12a's TINY): each a family the engine runs, its KV feature present
    "llama_mha": ("llama", dict(num_key_value_heads=4)),
    "llama_mqa": ("llama", dict(num_key_value_heads=1)),
    "gemma3_windows": ("gemma3_text", dict(num_hidden_layers=6, sliding_window=8)),
    "gpt_oss_sinks": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                      sliding_window=8)),
    "deepseek_latent": ("deepseek_v3", dict(head_dim=8, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                                            kv_lora_rank=32, q_lora_rank=24, n_routed_experts=0,
                                            first_k_dense_replace=4, num_mtp_layers=0)),
}


def build_tiny(model_type, folder, **config):
    "A tiny random model saved to `folder` (gpt-oss with its sinks redrawn large, chapter 12c)."
    if model_type == "gpt_oss":
        return tiny_gpt_oss(folder, **config)
    return tiny_random_model(model_type, folder, **config)


@pytest.mark.parametrize("name", list(TINY))
def test_the_engine_counts_what_the_formula_says(name, tmp_path):
    model_type, config = TINY[name]
    folder = tmp_path / name
    build_tiny(model_type, folder, **config)
    d = json.loads((folder / "config.json").read_text())
    latent = "kv_lora_rank" in d
    formula = latent_sequence_bytes(d, 1, "float32") if latent else kv_sequence_bytes(d, 1, "float32")
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with LLM(str(folder), dtype="float32", kernels="torch", kv_cache_bytes=2**20) as llm:
        llm.generate(["The three primary colours are red, yellow and blue"], greedy, use_tqdm=False)
        pool, ledger = llm.engine.cache, llm.engine.ledger
        assert pool.nbytes / (pool.num_blocks * pool.block_size) == formula
        assert (type(pool) is LatentPool) == latent
        if not latent:
            assert ledger.kv_write_bytes / ledger.tokens_in == formula
        tokens = ledger.tokens_in
    if "sliding_window" in d and not latent:  # the pool keeps every layer's tokens; the windows would keep fewer
        assert windowed_sequence_bytes(d, tokens, "float32") < formula * tokens
