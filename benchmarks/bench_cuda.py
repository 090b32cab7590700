"""The engine on a GPU, end to end: `LLM(folder)` as a user calls it on CUDA (bf16, chapter 05a's Triton attention)
beside its PyTorch attention and transformers' `generate`, at batch 1 and batch 64, next to the bandwidth floor.

The model has the default model's shape (its config.json) and random weights: the default model's weights do not travel
to a lent GPU machine, and decode's bytes and time do not depend on the weights' values (greedy tokens are forced to
`--tokens` by `ignore_eos` on both sides). Runs alternate (minfer triton, minfer torch, transformers, ...), medians.
The floor per token: (weight bytes / batch + the token's KV reads) / the measured device-to-device copy bandwidth.

    python benchmarks/bench_cuda.py [--tokens 128] [--batches 1 64] [--repeats 3] [--layers N] [--out FILE]
"""
import argparse, json, shutil, statistics, tempfile, time
from pathlib import Path

import torch
from minfer import LLM
from minfer.gguf import data_dir
from minfer.roofline import decode_bytes_per_token, measure_bandwidth
from minfer.sampling import SamplingParams

PROMPT = "Once upon a time, in a small village by the sea, there lived"

def random_model_folder(layers=None):
    "A folder with the default model's config (optionally fewer layers), random bf16 weights and its tokenizer files."
    from transformers import LlamaConfig, LlamaForCausalLM
    source = data_dir() / "models" / "smollm2-135m-instruct"  # its config and tokenizer files only
    config = json.loads((source / "config.json").read_text())
    if layers:
        config["num_hidden_layers"] = layers
    folder = Path(tempfile.mkdtemp(prefix="minfer-cuda-"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config)).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    return folder

def prompts(batch):
    "Distinct prompts (no shared prefix beyond the first words), so the prefix cache does not shorten anyone's prefill."
    return [f"{i}. {PROMPT}" for i in range(batch)]

def time_minfer(llm, batch, n):
    "-> (seconds for the whole batch, median time per output token of a sequence)."
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    sync = torch.cuda.synchronize if torch.device(llm.device).type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    outs = llm.generate(prompts(batch), params, raw=True)
    sync()
    seconds = time.perf_counter() - start
    assert all(len(o.token_ids) == n for o in outs)
    return seconds, statistics.median(o.metrics["tpot"] for o in outs)

class TransformersPeer:
    "transformers' `generate` on the same folder, same device, bf16, greedy, a static left-padded batch."
    def __init__(self, folder, device):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        import transformers
        self.version = transformers.__version__
        self.tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
        self.device = device

    def time(self, batch, n):
        enc = self.tokenizer(prompts(batch), return_tensors="pt", padding=True).to(self.device)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)
        sync()
        assert out.shape[1] == enc["input_ids"].shape[1] + n
        return time.perf_counter() - start, None

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the default model (a quick try)")
    ap.add_argument("--out", default=None, help="also write the table to this file")
    args = ap.parse_args()
    folder = random_model_folder(args.layers)
    default = LLM(folder, dtype="bfloat16")
    engines = {f"minfer bf16 (default: attention={default.config.attention})": default,
               "minfer bf16, attention=torch": LLM(folder, dtype="bfloat16", attention="torch")}
    device = torch.device(default.device)
    peer = TransformersPeer(folder, device)
    runs = {name: (lambda b, llm=llm: time_minfer(llm, b, args.tokens)) for name, llm in engines.items()}
    runs[f"transformers {peer.version} bf16 generate"] = lambda b: peer.time(b, args.tokens)
    cfg = default.model_config
    bandwidth = measure_bandwidth(device=device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    lines = [f"{name}, torch {torch.__version__}; random weights of the default model's shape "
             f"({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}); {args.tokens} tokens per sequence, "
             f"prompt of ~16 tokens; copy bandwidth {bandwidth / 1e9:.0f} GB/s (measured, read + write)",
             "", "| batch | engine | tok/s (all sequences) | ms per step | floor tok/s | % of floor |",
             "|---|---|---|---|---|---|"]
    for batch in args.batches:
        for run in runs.values():
            run(min(batch, 2))  # warm-up: Triton compiles, cuBLAS picks its kernels
        times = {label: [] for label in runs}
        for _ in range(args.repeats):
            for label, run in runs.items():
                times[label].append(run(batch)[0])
        bytes_per_token = decode_bytes_per_token(cfg, "bfloat16", context=16 + args.tokens // 2, batch=batch)
        floor = bandwidth / bytes_per_token
        for label, seconds in times.items():
            tok_s = batch * args.tokens / statistics.median(seconds)
            step_ms = 1e3 * statistics.median(seconds) / args.tokens
            share = 100 * tok_s / floor
            lines.append(f"| {batch} | {label} | {tok_s:.0f} | {step_ms:.2f} | {floor:.0f} | {share:.1f}% |")
        print("\n".join(lines[-len(times):]), flush=True)
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    shutil.rmtree(folder)

if __name__ == "__main__":
    main()
