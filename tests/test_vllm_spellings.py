"""vLLM's spellings of the same switches, as a learner copies them from vLLM's documentation: mapped to minfer's, or
refused in one line naming minfer's way; and vLLM's progress bar over a list of prompts (`use_tqdm`)."""
import pytest

from minfer import LLM, SamplingParams


def test_a_vllm_snippet_runs_as_written(model_dir):
    llm = LLM(model=str(model_dir), enable_prefix_caching=True, enable_chunked_prefill=False)
    assert llm.prefix_cache is True and llm.chunked_prefill is False
    outputs = llm.generate(["Hello, my name is", "The capital of France is"], SamplingParams(temperature=0.0,
                                                                                           max_tokens=4))
    assert [len(o.token_ids) for o in outputs] == [4, 4]


@pytest.mark.parametrize("argument, names", [
    (dict(gpu_memory_utilization=0.9), "kv_cache_bytes"),
    (dict(max_model_len=2048), "max_tokens"),
    (dict(trust_remote_code=True), "never runs"),
    (dict(quantization="gptq"), "quantization='awq'"),
])
def test_what_minfer_has_no_switch_for_is_refused_naming_its_way(model_dir, argument, names):
    with pytest.raises(ValueError, match=names) as e:
        LLM(model=str(model_dir), **argument)
    assert "\n" not in str(e.value)


def test_quantization_awq_is_the_awq_weight_format(model_dir):
    "A plain folder asked to load as AWQ is refused by chapter 08's rule, which names the format it maps to."
    with pytest.raises(ValueError, match="weights='awq-int4'"):
        LLM(model=str(model_dir), quantization="awq")


def test_a_progress_bar_over_a_list_of_prompts(model_dir, capsys):
    llm = LLM(model=str(model_dir))
    params = SamplingParams(max_tokens=2)
    llm.generate(["one", "two", "three"], params)
    assert "3/3" in capsys.readouterr().err
    llm.generate(["one", "two", "three"], params, use_tqdm=False)
    llm.generate("one", params)  # a single prompt: no bar
    assert "prompts" not in capsys.readouterr().err
