"Correctness contract 1: minfer.model logits == transformers' LlamaForCausalLM on the same folder, fp32, max abs <= 1e-4."
import pytest, torch
from minfer.model import NoCache, find_default_gguf, load_model, default_model_dir

LONG = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog while counting sheep." for i in range(40))
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:", "1, 1, 2, 3, 5, 8,", LONG]

@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

def ours(model, ids):
    with torch.inference_mode(): return model(torch.tensor(ids), torch.arange(len(ids)), NoCache())

@pytest.mark.parametrize("prompt", PROMPTS, ids=["capital", "code", "numbers", "long"])
def test_logits_match_transformers(model, tokenizer, hf_model, prompt):
    ids = tokenizer.encode(prompt)
    if prompt is LONG: assert len(ids) >= 500, len(ids)
    with torch.inference_mode(): ref = hf_model(torch.tensor([ids])).logits[0]
    err = (ours(model, ids) - ref).abs().max().item()
    assert err <= 1e-4, f"max abs logit difference {err:.2e} on a {len(ids)}-token prompt"

def test_packed_weights_match_transformers(model_dir, tokenizer, hf_model):
    "oneDNN-packed weights (LLM's default for fp32 on CPU) only reorder the sums: within 1e-3 of transformers, same argmax."
    from minfer.model import can_pack, pack_weights
    if not can_pack("float32", "cpu"): pytest.skip("oneDNN is not available")
    packed, ids = pack_weights(load_model(model_dir)), tokenizer.encode(LONG)
    with torch.inference_mode(): ref = hf_model(torch.tensor([ids])).logits[0]
    got = ours(packed, ids)
    err = (got - ref).abs().max().item()
    assert err <= 1e-3, f"max abs logit difference {err:.2e} with packed weights"
    assert torch.equal(got.argmax(-1), ref.argmax(-1))

def test_converted_folder_matches_gguf_read_by_transformers(model, tokenizer):
    "The conversion (dequantize + undo the RoPE row permutation) agrees with transformers' own GGUF loader."
    from transformers import AutoModelForCausalLM
    g = find_default_gguf()
    ref = AutoModelForCausalLM.from_pretrained(g.parent, gguf_file=g.name, dtype=torch.float32).eval()
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog")
    with torch.inference_mode(): r = ref(torch.tensor([ids])).logits[0]
    assert (ours(model, ids) - r).abs().max().item() <= 1e-4

def test_tokenizer_matches_gguf_tokenizer(tokenizer):
    from transformers import AutoTokenizer
    g = find_default_gguf()
    ref = AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name)
    for text in ["Hello world, how are you?", "def f(x):\n\treturn x**2  # 42", "Ünïcödé — ☃ 日本語", "<|im_start|>user\nhi<|im_end|>"]:
        assert tokenizer.encode(text) == ref.encode(text, add_special_tokens=False), text
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text
    conv = [{"role": "user", "content": "What is 2+2?"}]
    assert tokenizer.encode(tokenizer.apply_chat_template(conv)) == ref.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)

@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_close_to_fp32(model_dir, tokenizer, model, dtype):
    "bf16/fp16 weights give the same next-token ranking head as fp32 on a plain prompt (loose: these are lossy)."
    low = load_model(model_dir, dtype)
    ids = tokenizer.encode("The capital of France is")
    a, b = ours(model, ids)[-1], ours(low, ids)[-1]
    assert b.dtype == torch.float32 and a.argmax() == b.argmax()
    assert (a - b).abs().max().item() < 1.0

def test_packed_bf16_wide_steps_are_fp32_arithmetic_on_bf16_weights(model_dir, tokenizer):
    """A packed bf16 model runs forwards of several tokens in fp32 activations (chapter 00a's `wide_dtype`): its logits
    are those of an fp32 model holding the same bf16-rounded weights; a single token still runs in bf16."""
    from minfer.model import can_pack, pack_weights
    if not can_pack("bfloat16", "cpu"): pytest.skip("oneDNN is not available")
    low = pack_weights(load_model(model_dir, "bfloat16"))
    widened = load_model(model_dir, "float32")
    for p, q in zip(widened.parameters(), load_model(model_dir, "bfloat16").parameters()): p.copy_(q.float())
    widened = pack_weights(widened)
    ids = tokenizer.encode(LONG)[:40]
    assert low.wide_dtype == torch.float32 and widened.wide_dtype is None
    assert torch.equal(ours(low, ids), ours(widened, ids))
    one = ours(low, ids[:1])  # one token: bf16 activations and the half-size bf16 weights, a rounding away
    assert not torch.equal(one, ours(widened, ids[:1])) and one.argmax() == ours(widened, ids[:1]).argmax()
