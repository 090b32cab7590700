"""Chapter 00c: `minfer.tokenizer.Tokenizer` gives the ids, the text and the chat prompt transformers' own tokenizer of
the same folder gives (read offline from the default model folder)."""
import pytest

from minfer.tokenizer import Tokenizer

TEXTS = ["The capital of France is", "Hello world, how are you?", "def f(x):\n\treturn x**2  # 42",
         "Ünïcödé — ☃ 日本語", "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>two<|im_end|> specials",
         "  leading spaces and\n\nblank lines  "]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And <b>3+3</b>? ü"}],
]


@pytest.fixture(scope="module")
def pair(model_dir):
    from transformers import AutoTokenizer
    return Tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_text_equal_transformers(pair, text):
    ours, ref = pair
    ids = ours.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_special_tokens_equal_transformers(pair):
    ours, ref = pair
    assert (ours.eos_token, ours.eos_token_id) == (ref.eos_token, ref.eos_token_id)
    assert ours.vocab_size == len(ref)
    for name, token in ours.special_tokens.items():
        assert getattr(ref, name) == token, name


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_prompt_equals_transformers(pair, conversation, add_generation_prompt):
    ours, ref = pair
    expected = ref.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == expected
