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
                                       (["generate", "hi", "--model", "/no/such/dir"], "does not exist")])
def test_errors_are_one_line_exit_2(args, word):
    r = run(*args)
    assert r.returncode == 2 and word in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
