"""Contract 4 on one machine: the project's CI machines have AVX-512 (Intel Xeon) or only AVX2 (some AMD EPYC). On a CPU
with AVX-512 the kernel tests run again in a subprocess as an AVX2-only CPU would run them: the C++ kernels built
without AVX-512 (`MINFER_NO_AVX512=1`, chapter 05b) and PyTorch's own kernels held to AVX2 (ATen's dispatch, oneDNN's
and MKL's instruction sets). On a CPU without AVX-512 the native build already is the AVX2 one, so it is skipped.

The four variables are honoured: ATen reports its capability (checked in the subprocess), oneDNN prints its ISA with
`ONEDNN_VERBOSE=1` ("Intel AVX2" instead of "AVX-512 with ... bfloat16 support"), and the C++ build's macros are checked
below. MKL reads `MKL_ENABLE_INSTRUCTIONS` on Intel CPUs; on AMD ones it dispatches by rules of its own (it reports a
non-Intel CPU on the AMD EPYC here), so that variable matters on the Xeons."""
import ctypes, os, subprocess, sys
from pathlib import Path
import pytest, torch

from minfer.cpu_kernels import build_cpu_kernels, cpu_kernels_available, _cpu_features

AVX2_ONLY = {"MINFER_NO_AVX512": "1", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
STAND_IN = os.environ.get("MINFER_NO_AVX512") == "1"  # this process is the subprocess
FILES = ["test_cpu_kernels.py", "test_cpu_step.py", "test_awq_step.py", "test_awq_q4x8.py", "test_parity.py",
         "test_other_cpu.py"]
# what runs again: every test of these files but slow ones whose arithmetic is checked by another that runs: fp32
# parity with transformers on a 500-token prompt is kept once (the step, after the fused modules' prefill), fp32
# greedy tokens through LLM are left to those logits; the GGUF conversion, the tokenizer and the switch's resolution
# hold no arithmetic of ours. About 65 s on one thread (as under `pytest -n 2`), 45 s on two
SKIP = ["converted_folder_matches_gguf", "tokenizer_matches_gguf", "kernels_switch_defaults", "llm_step_equals_naive",
        "llm_cpu_kernels_equal_naive", "fused_model_matches_transformers_fp32", "packed_weights_match_transformers",
        "(logits_match_transformers and long)"]
AVX512_SOURCE = 'extern "C" int avx512() {\n#if defined(__AVX512F__)\n  return 1;\n#else\n  return 0;\n#endif\n}\n'


def has_avx512(): return " avx512f" in _cpu_features()


def built_with_avx512(out_dir):
    "Whether build_cpu_kernels, as the environment sets it now, compiles AVX-512 code."
    return ctypes.CDLL(str(build_cpu_kernels(AVX512_SOURCE, out_dir))).avx512() == 1


@pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ compiler")
def test_the_switch_builds_without_avx512(tmp_path, monkeypatch):
    "MINFER_NO_AVX512=1 builds without AVX-512 (a library of its own); without it, -march=native uses AVX-512 if any."
    monkeypatch.setenv("MINFER_NO_AVX512", "1")
    assert not built_with_avx512(tmp_path)
    monkeypatch.delenv("MINFER_NO_AVX512")
    assert built_with_avx512(tmp_path) == has_avx512() and len(list(tmp_path.glob("*.so"))) == 2


@pytest.mark.skipif(not STAND_IN, reason="runs inside the AVX2 stand-in only")
def test_the_stand_in_is_in_force():
    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert all(os.environ.get(k) == v for k, v in AVX2_ONLY.items())


@pytest.mark.skipif(STAND_IN or not has_avx512(), reason="needs AVX-512 (on an AVX2-only CPU the native run is this)")
def test_kernel_tests_pass_as_on_an_avx2_only_cpu():
    """The kernel tests (FILES, but SKIP) in a subprocess with the four variables: the step, the modules and their bf16
    and int4 comparisons with fp32, as an AVX2-only CPU computes them."""
    tests = Path(__file__).parent
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rfE",
           *[str(tests / f) for f in FILES], "-k", " and ".join(f"not {s}" for s in SKIP)]
    r = subprocess.run(cmd, cwd=tests.parent, env={**os.environ, **AVX2_ONLY}, capture_output=True, text=True,
                       timeout=600)
    summary = "\n".join(r.stdout.splitlines()[-40:])
    assert r.returncode == 0, f"as on an AVX2-only CPU:\n{summary}\n{r.stderr[-2000:]}"
    assert " passed" in summary and "failed" not in summary
