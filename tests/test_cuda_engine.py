"""The engine on a GPU: what `LLM()` resolves to on CUDA, and the Triton attention backend against the PyTorch one and
against transformers, on a small random Llama that is written here (the default model's folder does not travel to a
lent GPU machine). Skipped without CUDA."""
import pytest, torch

pytestmark = pytest.mark.gpu

@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    "A 2-layer Llama with the default model's tokenizer and random weights (std 0.02, as transformers initialises)."
    from transformers import LlamaConfig, LlamaForCausalLM
    from minfer.gguf import data_dir
    import shutil
    model_dir = data_dir() / "models" / "smollm2-135m-instruct"  # only its tokenizer files are needed here
    if not (model_dir / "tokenizer.json").exists(): pytest.skip("the default model's tokenizer files are not here")
    folder = tmp_path_factory.mktemp("tiny-llama")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                      rope_theta=100000.0,
                      tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"): shutil.copy(model_dir / name, folder / name)
    return folder

def test_auto_switches_on_cuda(tiny_folder):
    from minfer.llm import LLM
    from minfer.sequence import SamplingParams
    llm = LLM(tiny_folder)
    c = llm.config
    assert (c.device, c.dtype, c.weights, c.kernels, c.attention) == ("cuda", "bfloat16", "plain", "torch", "triton"), c
    assert llm.generate("Hello", SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_engine_equals_torch_engine_and_transformers(tiny_folder, dtype):
    "Same greedy tokens through attention='triton' and 'torch' (a batch, chunked prefill); logprobs near transformers'."
    from minfer.llm import LLM
    from minfer.sequence import SamplingParams
    from transformers import LlamaForCausalLM
    prompts = ["The capital of France is", "def fibonacci(n):", "One two three four five six seven eight nine ten " * 8]
    p = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    outs = {a: LLM(tiny_folder, dtype=dtype, attention=a, max_num_batched_tokens=32).generate(prompts, p, raw=True)
            for a in ("torch", "triton")}
    hf = LlamaForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).cuda().eval()
    lp = lambda o, ids: [e[t] for e, t in zip(o.prompt_logprobs[1:] + o.samples[0].logprobs, ids[1:])]
    for o_torch, o_triton in zip(outs["torch"], outs["triton"]):
        assert o_torch.token_ids == o_triton.token_ids
        ids = o_triton.prompt_token_ids + o_triton.token_ids
        # the two attention backends agree closely with each other ...
        tol = 1e-4 if dtype == "float32" else 0.05
        assert max(abs(a - b) for a, b in zip(lp(o_torch, ids), lp(o_triton, ids))) < tol
        # ... and with transformers within a looser bound: on the H100 both engines' fp32 logprobs sat up to 6.6e-3 from
        # transformers' fp32 on the longest prompt (the same for both backends, so not the attention; not traced yet)
        with torch.inference_mode(): ref = torch.log_softmax(hf(torch.tensor([ids]).cuda()).logits[0].double(), -1)
        want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
        assert max(abs(a - b) for a, b in zip(lp(o_triton, ids), want)) < 2e-2
