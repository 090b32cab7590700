"""The roofline explorer of chapter 00b, headless: the bound, the drawing, and the ipywidgets wrapper."""
import math

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from minfer.model import ModelConfig
from minfer.roofline import (DEVICES, MODELS, BATCHES, CONTEXTS, Device, decode_roofline, kv_bytes_per_token,
                             measured_device, param_counts, plot_decode_roofline, roofline_explorer, weight_bytes_per_step)

H100, H200 = DEVICES["H100 SXM"], DEVICES["H200"]


def test_datasheet_devices():
    assert (H100.bandwidth, H100.peak("bfloat16")) == (3.35e12, 989e12)
    assert (H200.bandwidth, H200.peak("bfloat16")) == (4.8e12, 989e12)
    assert H100.peak("int4") == H100.peak("float16") == 989e12  # integer weights are multiplied in bf16
    assert H100.peak("float32") < H100.peak("bfloat16")


def test_batch_one_is_memory_bound_at_bandwidth_over_bytes():
    r = decode_roofline(8e9, "bfloat16", batch=1, device="H100 SXM")
    assert r.regime == "memory-bound"
    assert r.step_bytes == 16e9 and r.step_flops == 16e9 and r.intensity == pytest.approx(1.0)
    assert r.tokens_per_s == pytest.approx(3.35e12 / 16e9)  # ~209 tokens/s
    assert r.ridge == pytest.approx(989e12 / 3.35e12)


def test_large_batch_is_compute_bound_at_peak_over_flops():
    r = decode_roofline(8e9, "bfloat16", batch=1024, device="H100 SXM")
    assert r.regime == "compute-bound"
    assert r.tokens_per_s == pytest.approx(989e12 / (2 * 8e9))
    assert r.t_compute > r.t_memory


def test_regime_flips_at_the_ridge():
    ridge_batch = H100.peak("bfloat16") / H100.bandwidth * 2 / 2  # bf16: 2 bytes and 2 FLOPs per parameter
    assert decode_roofline(1e9, "bfloat16", math.floor(ridge_batch), device=H100).regime == "memory-bound"
    assert decode_roofline(1e9, "bfloat16", math.ceil(ridge_batch), device=H100).regime == "compute-bound"


def test_devices_and_dtypes_scale_the_bound():
    b = lambda **kw: decode_roofline(**{"model": 8e9, "dtype": "bfloat16", "batch": 1, "device": "H100 SXM", **kw}).tokens_per_s
    assert b(device="H200") / b() == pytest.approx(4.8 / 3.35)          # memory-bound: bandwidth ratio
    assert b(dtype="int4") / b() == pytest.approx(4.0)                   # a quarter of the bytes
    assert b(batch=4096, device="H200") == pytest.approx(b(batch=4096))  # compute-bound: same tensor cores
    tps = [b(batch=n) for n in BATCHES]
    assert tps == sorted(tps), "weights-only tokens/s never drop as the batch grows"


def test_model_config_counts_the_kv_cache():
    cfg = MODELS["Llama-3.1-8B"]
    assert 8.0e9 < sum(param_counts(cfg).values()) < 8.1e9  # the preset really is Llama-3.1-8B's shape
    # a step reads every matrix but only the looked-up rows of the embedding
    assert weight_bytes_per_step(cfg, "float32") / 4 == pytest.approx(sum(param_counts(cfg).values()) - 128256 * 4096)
    r = decode_roofline(cfg, "bfloat16", batch=8, context=4096, device=H100)
    assert r.step_bytes == weight_bytes_per_step(cfg, "bfloat16") + 8 * 4096 * kv_bytes_per_token(cfg, "bfloat16")
    assert kv_bytes_per_token(cfg, "bfloat16") == 128 * 1024
    # a long context keeps even a large batch memory-bound: the KV reads grow with the batch
    assert decode_roofline(cfg, "bfloat16", batch=1024, context=131072, device=H100).regime == "memory-bound"
    assert decode_roofline(cfg, "bfloat16", batch=1024, context=0, device=H100).regime == "compute-bound"
    assert decode_roofline(cfg, "bfloat16", 1, 0, H100).tokens_per_s > decode_roofline(cfg, "bfloat16", 1, 8192, H100).tokens_per_s


def test_bad_input_is_one_clear_error():
    with pytest.raises(ValueError, match="device 'A10' is unknown; use one of .*H100 SXM, H200"):
        decode_roofline(8e9, device="A10")
    with pytest.raises(ValueError, match="dtype 'fp6' is not supported"):
        decode_roofline(8e9, dtype="fp6")
    with pytest.raises(ValueError, match="batch must be >= 1"):
        decode_roofline(8e9, batch=0)


def test_measured_device_uses_given_numbers():
    cpu = measured_device("this CPU", bandwidth=20e9, flops={"float32": 100e9, "bfloat16": 5e9})
    assert isinstance(cpu, Device) and cpu.peak("int4") == 5e9
    r = decode_roofline(135e6, "float32", 1, 0, cpu)
    assert r.tokens_per_s == pytest.approx(20e9 / (135e6 * 4))


def test_drawing_shows_the_setting():
    fig = plot_decode_roofline("Llama-3.1-8B", "bfloat16", batch=64, context=2048, device="H100 SXM")
    try:
        ax1, ax2 = fig.axes
        r = decode_roofline(MODELS["Llama-3.1-8B"], "bfloat16", 64, 2048, H100)
        assert r.regime in ax2.get_title() and f"{r.tokens_per_s:,.0f} tok/s" in ax2.get_title()
        assert "H100 SXM" in ax1.get_title()
        assert ax2.get_xscale() == "log" and ax1.get_xscale() == "log"
        curve = ax2.get_lines()[0]
        assert list(curve.get_xdata()) == BATCHES
        point = ax2.collections[-1].get_offsets()[0]  # the chosen batch, on the curve
        assert point[0] == 64 and point[1] == pytest.approx(r.tokens_per_s)
        fig.canvas.draw()  # renders without error
    finally:
        plt.close(fig)


def test_drawing_accepts_a_parameter_count_and_a_device_object():
    fig = plot_decode_roofline(70e9, "int4", batch=1, context=0, device=H200)
    try: assert "70B parameters" in fig.axes[1].get_title() and "memory-bound" in fig.axes[1].get_title()
    finally: plt.close(fig)


def test_explorer_widgets_drive_the_bound():
    import ipywidgets
    devices = {**DEVICES, "this CPU": measured_device("this CPU", 20e9, {"float32": 1e11, "bfloat16": 5e9})}
    w = roofline_explorer(devices)
    try:
        assert isinstance(w, ipywidgets.interactive)
        controls = {c.description: c for c in w.children if hasattr(c, "description") and c.description}
        assert set(controls) == {"model", "dtype", "batch", "context", "device"}
        assert list(controls["model"].options) == list(MODELS) and list(controls["device"].options) == list(devices)
        assert list(controls["batch"].options) == BATCHES and list(controls["context"].options) == CONTEXTS
        assert w.result.regime == "memory-bound"  # the default: one sequence
        controls["device"].value = "H100 SXM"
        controls["context"].value = 0
        controls["batch"].value = 4096
        assert w.result.regime == "compute-bound"
        assert w.result.tokens_per_s == pytest.approx(decode_roofline(MODELS["Llama-3.1-8B"], "bfloat16", 4096, 0, H100).tokens_per_s)
        controls["device"].value = "this CPU"
        assert w.result.tokens_per_s < 1e4
    finally:
        w.close_all() if hasattr(w, "close_all") else w.close()
        plt.close("all")
