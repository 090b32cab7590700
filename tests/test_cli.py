"End-to-end: the installed `minfer` command, in a real subprocess."
import shutil, subprocess, sys
import pytest

from pathlib import Path
# the console script installed next to this interpreter, i.e. what `pip install` put on the user's PATH
MINFER = [str(Path(sys.executable).parent / "minfer")]

def run(*args, input=None):
    return subprocess.run([*MINFER, *args], capture_output=True, text=True, input=input, timeout=300)

def test_generate_answers():
    r = run("generate", "What is the capital of France?", "--max-tokens", "24", "--metrics")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "ttft=" in r.stderr

def test_chat_interactive_keeps_history():
    r = run("chat", "--max-tokens", "24", input="What is the capital of France?\nAnd of Italy?\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("assistant>") == 2 and "Paris" in r.stdout and "Rome" in r.stdout

@pytest.mark.parametrize("args,word", [(["generate", ""], "empty"), (["generate", "hi", "--kv", "nope"], "kv="),
                                       (["generate", "hi", "--temperature", "-2"], "temperature"),
                                       (["generate", "hi", "--model", "/no/such/dir"], "does not exist"),
                                       (["generate", "hi", "--kernels", "step", "--attention", "torch"], "attention='cpu'"),
                                       (["generate", "hi", "--max-num-seqs", "0"], "max_num_seqs=0"),
                                       (["serve", "--kv", "nope"], "kv=")])
def test_errors_are_one_line_exit_2(args, word):
    r = run(*args)
    assert r.returncode == 2 and word in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr

def test_bench_prints_speed_floor_and_where_the_step_goes():
    r = run("bench", "--max-tokens", "16")
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stdout and "bandwidth ceiling" in r.stdout
    line = next(l for l in r.stdout.splitlines() if l.startswith("where a step goes"))
    parts = dict(p.rsplit(" ", 1) for p in line.split(": ", 1)[1].split(", "))
    assert set(parts) == {"layer matvecs", "LM head matvec", "RMSNorm", "RoPE + KV write + attention", "SiLU × up", "the rest"}
    # every kind of work was seen by its hooks, and none was counted twice (the rest, by difference, is not negative)
    assert all(float(v) > 0 for v in parts.values()), line

def test_engine_flags_come_from_the_config():
    "Every engine switch, later chapters' too, is a flag; the limits reach the engine (repr(llm) shows the config)."
    from minfer.engine import SWITCHES
    r = run("generate", "--help")
    assert "--kv-dtype" in r.stdout and "--tensor-parallel-size" in r.stdout
    assert all("--" + name.replace("_", "-") in r.stdout for name in SWITCHES), r.stdout
    r = run("bench", "--max-tokens", "4", "--block-size", "8", "--max-num-seqs", "3", "--max-num-batched-tokens", "32",
            "--kv-cache-bytes", str(2**24), "--kernels", "cpu", "--no-chunked-prefill")
    assert r.returncode == 0, r.stderr
    for part in ("block_size=8", "max_num_seqs=3", "max_num_batched_tokens=32", f"kv_cache_bytes={2**24}",
                 "kernels='cpu'", "chunked_prefill=False", "attention='cpu'"):
        assert part in r.stdout, (part, r.stdout)
