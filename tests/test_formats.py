"""Chapter 08b's weight formats: bit layouts against the OCP Microscaling spec's tables and hand-built vectors, each
checkpoint layout loaded from a tiny folder equal to an independent dequantise-then-dense model, quantize -> save ->
load round trips (the `minfer quantize` command included), and unsupported variants refused in one line.
(Chapter 08c's kernels, and how they plug into `FORMAT_KERNELS`: tests/test_format_kernels.py.)"""
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minfer.model import NoCache, load_model
from minfer.cli import main as cli_main
from minfer.llm import LLM
from minfer.sampling import SamplingParams
from minfer.formats import (FORMAT_MODULES, Fp8Linear, Mxfp4Linear, Nvfp4Linear, e2m1_decode, e2m1_encode,
                            e4m3_decode, e8m0_decode, load_format_model, pack_nibbles, quantize_format_folder,
                            unpack_nibbles)
from test_awq import tiny_folder, tiny_config, tiny_model  # noqa: F401 (a fixture and its helpers)

# the OCP Microscaling Formats spec v1.0, section 5.3.3: the FP4 (E2M1) values of codes 0000 .. 1111
OCP_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_e2m1_values_are_the_spec_table():
    got = e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert got.tolist() == OCP_E2M1
    assert torch.signbit(got[8]) and not torch.signbit(got[0])  # 1000 is -0


def test_e2m1_rounds_to_nearest_even_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, 0.74, 5.1, 7.0, 100.0, -0.5, -6.0, -2.6, 0.0])
    want = [0, 2, 2, 4, 4, 6, 6, 1, 1, 7, 7, 7, 9, 15, 13, 0]  # ties to the even code (mantissa bit 0)
    assert e2m1_encode(x).tolist() == want
    assert e2m1_encode(e2m1_decode(torch.arange(16, dtype=torch.uint8))).tolist() == list(range(16))


def test_e8m0_is_a_biased_power_of_two_and_255_is_nan():
    got = e8m0_decode(torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8))
    assert got[:6].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert torch.isnan(got[6])


def test_e4m3_bytes():
    codes = torch.tensor([0x00, 0x01, 0x07, 0x08, 0x38, 0x7E, 0xB8, 0xC4], dtype=torch.uint8)
    # subnormals m x 2^-9, 2^-6 the smallest normal, 1.0, 448 the largest, -1.0, -1.5 x 2
    assert e4m3_decode(codes).tolist() == [0.0, 2.0**-9, 7 * 2.0**-9, 2.0**-6, 1.0, 448.0, -1.0, -3.0]


def test_nibbles_low_first():
    codes = torch.tensor([[1, 2, 3, 4], [15, 0, 0, 15]])
    assert pack_nibbles(codes).tolist() == [[0x21, 0x43], [0x0F, 0xF0]]
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes.to(torch.uint8))


def test_mxfp4_block_by_hand():
    "A block whose largest magnitude is 3: scale 2^(floor(log2 3) - 2) = 2^-1 (E8M0 126); 3 / 0.5 = 6 is code 7."
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([3.0, -1.5, 0.25, 0.2])
    t = Mxfp4Linear.checkpoint_tensors(w)
    assert t["weight_scales"].tolist() == [[126]]
    # codes: 3/0.5 = 6 -> 7; -1.5/0.5 = -3 -> 8|5 = 13; 0.5 -> 1; 0.4 -> 0.5 -> 1; then zeros
    assert t["weight_blocks"][0, 0, :2].tolist() == [7 | 13 << 4, 1 | 1 << 4]
    assert t["weight_blocks"][0, 0, 2:].tolist() == [0] * 14


def test_nvfp4_group_by_hand():
    "max |W| 6: global scale 448 x 6 / 6 = 448; a group with max 6 gets scale 448 (E4M3 0x7E), one with max 3 224."
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 16] = 6.0, -1.0, 3.0
    t = Nvfp4Linear.checkpoint_tensors(w)
    assert t["weight_global_scale"].tolist() == [448.0]
    assert t["weight_scale"].view(torch.uint8).tolist() == [[0x7E, 0x76]]  # 448 = 1.75 x 2^8, 224 = 1.75 x 2^7
    assert t["weight_packed"][0, 0].item() == 7 | (8 | 2) << 4  # 6 -> code 7, -1 -> code 10
    assert t["weight_packed"][0, 8].item() == 7  # 3 / (224 / 448) = 6


def test_fp8_scales_map_the_largest_weight_to_448():
    w = torch.tensor([[1.0, -2.0], [0.5, 0.25]])
    channel = Fp8Linear.checkpoint_tensors(w, strategy="channel")
    assert torch.equal(channel["weight_scale"].flatten(), torch.tensor([2.0, 0.5]) / 448)
    assert channel["weight"].float().tolist() == [[224.0, -448.0], [448.0, 224.0]]
    tensor = Fp8Linear.checkpoint_tensors(w, strategy="tensor")
    assert tensor["weight_scale"].shape == (1,) and torch.equal(tensor["weight_scale"], torch.tensor([2.0]) / 448)


# independent dequantisations of each checkpoint layout, written from the formats' definitions (and, for MXFP4,
# transformers' own gpt-oss converter), not from minfer.formats
def dequantize_fp8(t, name):
    return t[f"{name}.weight"].float() * t[f"{name}.weight_scale"].float().reshape(-1, 1)


def dequantize_mxfp4(t, name):
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors
    blocks, scales = t[f"{name}.weight_blocks"], t[f"{name}.weight_scales"]
    return _convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)[0].T


def dequantize_nvfp4(t, name):
    packed = t[f"{name}.weight_packed"]
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1).long()
    values = torch.tensor(OCP_E2M1)[codes]
    scale = t[f"{name}.weight_scale"].float() / t[f"{name}.weight_global_scale"].float()
    return values * scale.repeat_interleave(16, 1)


DEQUANTIZE = {"fp8": dequantize_fp8, "mxfp4": dequantize_mxfp4, "nvfp4": dequantize_nvfp4}
FORMATS = [("fp8", "tensor"), ("fp8", "channel"), ("mxfp4", None), ("nvfp4", None)]


def read_tensors(folder):
    with safe_open(folder / "model.safetensors", framework="pt") as st:
        return {k: st.get_tensor(k) for k in st.keys()}


@pytest.fixture(scope="module", params=FORMATS, ids=lambda f: "-".join(filter(None, f)))
def written(request, tiny_folder, tmp_path_factory):
    "(format, the tiny model quantized in its real layout, the same model dense: each tensor dequantised here)"
    name, strategy = request.param
    folder = quantize_format_folder(tiny_folder, tmp_path_factory.mktemp(name), name, strategy or "channel")
    tensors = read_tensors(folder)
    projections = sorted({k.rsplit(".", 1)[0] for k in tensors if "_proj." in k})
    dense = {k: v for k, v in tensors.items() if "_proj." not in k}
    dense.update({f"{p}.weight": DEQUANTIZE[name](tensors, p).contiguous() for p in projections})
    dense_folder = tmp_path_factory.mktemp(f"{name}-dense")
    save_file(dense, dense_folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config")
    (dense_folder / "config.json").write_text(json.dumps(config))
    (dense_folder / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    return name, folder, dense_folder


def test_the_written_folder_is_the_real_layout(written):
    name, folder, _ = written
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    tensors = read_tensors(folder)
    p = "model.layers.0.mlp.down_proj"
    if name == "mxfp4":
        assert config["quant_method"] == "mxfp4"
        assert tensors[p + ".weight_blocks"].shape == (128, 256 // 32, 16)
        assert tensors[p + ".weight_scales"].dtype == torch.uint8
    elif name == "nvfp4":
        assert config["format"] == "nvfp4-pack-quantized"
        assert tensors[p + ".weight_packed"].shape == (128, 128)
        assert tensors[p + ".weight_scale"].dtype == torch.float8_e4m3fn
    else:
        assert config["format"] == "float-quantized"
        assert tensors[p + ".weight"].dtype == torch.float8_e4m3fn
    assert "lm_head.weight" not in tensors  # tied


def test_loading_the_layout_equals_dequantise_then_dense(written):
    name, folder, dense_folder = written
    tokens = torch.randint(0, 49152, (12,))
    positions = torch.arange(12)
    quantized = load_format_model(folder, name)
    for module in quantized.layers[0].self_attn.qkv_proj, quantized.layers[1].mlp.down_proj:
        assert type(module) is FORMAT_MODULES[name]
    for m in quantized.modules():  # the definition: the 4-bit kernels' 8-bit x would blur it
        if getattr(m, "value_bits", 0) == 4:
            m.forward = m.reference
    got = quantized(tokens, positions, NoCache())
    want = load_model(dense_folder)(tokens, positions, NoCache())
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-5), (got - want).abs().max()


def test_round_trip_module_and_folder(written, tiny_folder):
    "quantize -> save -> load gives the codes `from_weight` makes from the same dense weight."
    name, folder, _ = written
    strategy = json.loads((folder / "config.json").read_text())["quantization_config"]
    strategy = (strategy.get("config_groups") or {}).get("group_0", {}).get("weights", {}).get("strategy")
    options = {"strategy": strategy} if name == "fp8" else {}
    dense = load_model(tiny_folder).layers[1].mlp.down_proj.weight
    loaded = load_format_model(folder, name).layers[1].mlp.down_proj
    made = FORMAT_MODULES[name].from_weight(dense, **options)
    assert torch.equal(loaded.codes, made.codes) and torch.equal(loaded.row_scales, made.row_scales)
    assert torch.equal(loaded.dequantize(), made.dequantize())


def test_quantize_command_and_llm(tiny_folder, tmp_path, capsys):
    "minfer quantize --method nvfp4 writes a folder that LLM picks the format of by itself and runs."
    dst = tmp_path / "nvfp4"
    assert cli_main(["quantize", str(tiny_folder), str(dst), "--method", "nvfp4"]) in (0, None)
    assert "wrote" in capsys.readouterr().out
    llm = LLM(str(dst), dtype="float32")
    assert llm.config.weights == "nvfp4"
    out = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    reference = load_format_model(dst, "nvfp4")
    ids = list(out[0].prompt_token_ids)
    for token in out[0].token_ids:  # greedy: each token the reference's argmax after the ones before it
        logits = reference(torch.tensor(ids), torch.arange(len(ids)), NoCache())[-1]
        top2 = logits.topk(2).values
        assert token == logits.argmax().item() or top2[0] - top2[1] < 1e-3
        ids.append(token)


def test_unsupported_variants_are_refused_in_one_line(written, tmp_path):
    name, folder, _ = written
    if name == "mxfp4":
        pytest.skip("one mxfp4 layout")
    config = json.loads((folder / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    for file_name in ("model.safetensors", "tokenizer.json"):
        (bad / file_name).write_bytes((folder / file_name).read_bytes())
    group = config["quantization_config"]["config_groups"]["group_0"]
    group["weights"]["strategy"] = "block"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="are not supported; supported: compressed-tensors"):
        load_format_model(bad, name)
    group["weights"]["strategy"] = "tensor" if name == "fp8" else "tensor_group"
    group["input_activations"] = dict(num_bits=8, type="float", strategy="tensor", dynamic=False)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="static activation scales"):
        load_format_model(bad, name)


def test_a_missing_tensor_is_named(written, tmp_path):
    name, folder, _ = written
    tensors = read_tensors(folder)
    gone = next(k for k in sorted(tensors) if k.startswith("model.layers.1.mlp.up_proj."))
    del tensors[gone]
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(tensors, bad / "model.safetensors")
    (bad / "config.json").write_text((folder / "config.json").read_text())
    (bad / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match=f"'{gone}' is missing"):
        load_format_model(bad, name)


def test_tensors_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="do not fit together"):
        Mxfp4Linear(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8), torch.ones(4))
    with pytest.raises(ValueError, match="not a multiple of 32"):
        Mxfp4Linear.from_weight(torch.randn(4, 48))


def test_fp16_on_a_cpu_is_refused_by_rule(written):
    from minfer.engine import EngineConfig
    name, folder, _ = written
    with pytest.raises(ValueError, match="multiplies float32 or bfloat16 activations"):
        EngineConfig(model=str(folder), dtype="float16", device="cpu").resolve()
