"""Chapter 00b's packed weights in bf16: oneDNN's product of a bf16 copy against fp32 arithmetic on the same values,
a bf16 model packed in bf16 against fp32 arithmetic on its weights (contract 4, `lossy`), and the measured choice
between the two packings, kept once per machine."""
import json
import pytest, torch
from minfer.model import NoCache, load_model
from minfer.roofline import (PackedLinear, bf16_products_pay, can_pack, machine_name, machine_path,
                             pack_weights, packed_compute_dtype)
from lossy import assert_near_fp32

pytestmark = pytest.mark.skipif(not can_pack("bfloat16", "cpu"), reason="oneDNN is not available")
BF16_PACKS = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # oneDNN's bf16 path: AVX-512 (bw, vl, dq) or AVX-NE-CONVERT
needs_bf16_path = pytest.mark.skipif(not BF16_PACKS, reason="oneDNN has no bf16 path on this CPU (fp32 packing only)")
BF16_UNIT = 2.0 ** -8  # a bf16 result's rounding: half the spacing of bf16 numbers, relative


@needs_bf16_path
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_packed_product_is_fp32_arithmetic_rounded_once(rows, bias):
    """A product packed in bf16 sums in fp32 and rounds each result to bf16 once: within half a bf16 unit of
    |y| of the fp32 product of the same bf16 values, plus fp32's own summation error (n_in units of 2**-24 of the
    sum of |x w| terms)."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(320, 576, generator=g).bfloat16()
    b = torch.randn(320, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 576, generator=g).bfloat16()
    got = PackedLinear(w, b, torch.bfloat16)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 320)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    terms = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    allowed = BF16_UNIT * ref.abs() + 576 * 2.0 ** -24 * terms
    assert ((got.double() - ref).abs() <= allowed).all()


@needs_bf16_path
def test_bf16_packed_model_is_close_to_fp32_arithmetic(model_dir, tokenizer):
    """A bf16 model packed in bf16 runs a forward of several tokens in fp32 activations (`wide_dtype`) with bf16
    products; against an fp32 model holding the same bf16-rounded weights (contract 4): logits within E = 8 bf16 eps
    of the largest |logit|, logits minus that of fp32's top token within D = 6, over a 40-token prompt (measured 2.7
    and 1.6 on AMD EPYC family 26 model 2, AVX-512 with bf16; the plain bf16 model, bf16 activations throughout:
    2.7 and 2.4)."""
    low = pack_weights(load_model(model_dir, "bfloat16"), torch.bfloat16)
    assert low.wide_dtype == torch.float32 and low.layers[0].mlp.down_proj.compute_dtype == torch.bfloat16
    widened = load_model(model_dir, "float32")
    for p, q in zip(widened.parameters(), load_model(model_dir, "bfloat16").parameters()):
        p.copy_(q.float())
    ids = torch.tensor(tokenizer.encode("The capital of France is Paris. " * 6)[:40])
    with torch.inference_mode():
        got = low(ids, torch.arange(len(ids)), NoCache())
        ref = widened(ids, torch.arange(len(ids)), NoCache())
    assert_near_fp32(got, ref, 8, 6, "bf16 packed in bf16")


def test_the_choice_is_measured_once_and_kept(tmp_path, monkeypatch, model_dir):
    """`bf16_products_pay` measures both packings once and keeps the rates under this machine's name; later calls read
    them (an entry edited by hand decides), `remeasure` measures again, and a table that cannot be read is measured
    again rather than trusted. Where oneDNN has no bf16 path the answer is no, with nothing measured."""
    monkeypatch.setenv("MINFER_HOME", str(tmp_path))
    if not BF16_PACKS:
        assert not bf16_products_pay() and packed_compute_dtype("bfloat16") == torch.float32
        assert not machine_path().exists()
        return
    first = bf16_products_pay()
    table = json.loads(machine_path().read_text())
    key = f"{machine_name()} | packed products"
    assert set(table[key]) == {"float32", "bfloat16", "measured"}
    assert first == (table[key]["bfloat16"] > 1.2 * table[key]["float32"])
    assert packed_compute_dtype("bfloat16") == (torch.bfloat16 if first else torch.float32)
    assert packed_compute_dtype("float32") == torch.float32
    table[key].update(float32=1.0, bfloat16=2.0)  # as if bf16 paid here
    machine_path().write_text(json.dumps(table))
    assert bf16_products_pay() and packed_compute_dtype(torch.bfloat16) == torch.bfloat16
    table[key].update(float32=2.0, bfloat16=1.0)
    machine_path().write_text(json.dumps(table))
    assert not bf16_products_pay() and pack_weights(load_model(model_dir, "bfloat16")).wide_dtype == torch.float32
    bf16_products_pay(remeasure=True)  # the hand-made entry is replaced by a measurement
    assert json.loads(machine_path().read_text())[key]["float32"] > 1e6
    table[key].update(float32="fast", bfloat16=None)  # an entry of the wrong shape is measured again, not trusted
    machine_path().write_text(json.dumps(table))
    bf16_products_pay()
    assert json.loads(machine_path().read_text())[key]["float32"] > 1e6
    machine_path().write_text("{not json")
    bf16_products_pay()
    assert json.loads(machine_path().read_text())[key]["bfloat16"] > 1e6
