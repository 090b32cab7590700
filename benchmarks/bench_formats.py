"""Weight formats side by side (chapters 08 and 08b): bytes per token, batch-1 and 64-request decode tok/s, and quality
(perplexity and KL divergence to the fp32 model on the held-out text) for fp32, bf16, fp8 per tensor, fp8 per
channel, fp8 per 128x128 block, AWQ int4 g64, MXFP4 and NVFP4, on the default model, in one table.

Each quantized folder is written once under data/models/ (`minfer quantize`'s code; the AWQ folder chapter 08's slow
cells write is used where it exists, else RTN g64, and the row says which). Quality runs every format in fp32
activations on windows of 256 tokens of data/text/evaluation.txt through the modules' reference path (the numbers
the kernels are checked against); bytes per token count what a decode step reads: every projection's codes and scales,
the norms and the LM head (the embedding only as the rows looked up). Timing runs each format through `LLM` with its
own defaults (`dtype`, `kernels="auto"`), formats alternating (A B C ... A B C), medians.

    python benchmarks/bench_formats.py [--tokens 2048] [--out 64] [--requests 64] [--repeats 3] [--no-timing]
        [--record] [--folders DIR]
"""
import argparse, datetime, json, math, statistics, sys, time
from pathlib import Path

import torch
from minfer.model import NoCache, load_model
from minfer.gguf import default_model_dir, data_dir
from minfer.tokenizer import Tokenizer
from minfer.awq import quantize_folder, load_awq_model
from minfer.formats import quantize_format_folder, load_format_model
from minfer import LLM  # every chapter loaded: its weight formats, kernels and switches
from minfer.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import machine

FORMATS = {  # label -> (weights=, folder maker or None for the source folder, dtype for quality)
    "fp32": ("plain", None, "float32"),
    "bf16": ("plain", None, "bfloat16"),
    "fp8 per tensor": ("fp8", ("fp8", "tensor"), "float32"),
    "fp8 per channel": ("fp8", ("fp8", "channel"), "float32"),
    "fp8 per 128x128 block": ("fp8", ("fp8", "block"), "float32"),
    "AWQ int4 g64": ("awq-int4", ("awq", None), "float32"),
    "MXFP4": ("mxfp4", ("mxfp4", None), "float32"),
    "NVFP4": ("nvfp4", ("nvfp4", None), "float32"),
}


def folder_for(src, maker, models):
    "The quantized folder of `maker` = (method, fp8 strategy), written under `models` on first use."
    if maker is None:
        return src, ""
    method, strategy = maker
    if method == "awq":
        awq = models / "smollm2-135m-instruct-awq-g64"
        if (awq / "config.json").exists():
            return awq, "AWQ search"
        rtn = models / "smollm2-135m-instruct-rtn-g64"
        if not (rtn / "config.json").exists():
            quantize_folder(src, rtn, method="rtn", group_size=64)
        return rtn, "RTN (no AWQ folder found)"
    dst = models / f"smollm2-135m-instruct-{method}{'-' + strategy if strategy else ''}"
    if not (dst / "config.json").exists():
        quantize_format_folder(src, dst, method, strategy or "channel")
    return dst, ""


def load_for_quality(weights, folder, dtype):
    if weights == "plain":
        return load_model(folder, dtype)
    if weights == "awq-int4":
        return load_awq_model(folder, dtype)
    return load_format_model(folder, weights, dtype)


def step_bytes(model):
    "Bytes one decode step reads: every tensor of the layers, the final norm and the LM head (not the embedding)."
    tensors = {id(t): t for t in [*model.layers.parameters(), *model.layers.buffers(), model.norm.weight,
                                  model.lm_head.weight]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@torch.no_grad()
def log_probs(model, ids, window=256):
    "Per window of `window` predictions: the model's log-probabilities [window, vocab] in fp32."
    out = []
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window + 1]
        out.append(model(chunk[:-1], torch.arange(len(chunk) - 1), NoCache()).float().log_softmax(-1))
    return out


def quality(model, ids, reference):
    "(perplexity, mean KL(fp32 || model) in nats per token) on `ids`; `reference`: fp32's `log_probs`."
    nll, kl, count = 0.0, 0.0, 0
    for start, (lp, ref) in enumerate(zip(log_probs(model, ids), reference)):
        targets = ids[start * 256 + 1:start * 256 + 1 + len(lp)]
        nll -= lp.gather(-1, targets[:, None]).sum().item()
        kl += (ref.exp() * (ref - lp)).sum().item()
        count += len(lp)
    return math.exp(nll / count), kl / count


def decode_rate(llm, prompts, n):
    "Output tokens/s of greedy decoding `n` tokens for each of `prompts` (token id lists), all submitted at once."
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    texts = [llm.tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
    t = time.perf_counter()
    outs = llm.generate(texts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048, help="held-out tokens for perplexity and KL")
    ap.add_argument("--out", type=int, default=64, help="output tokens per request when timing")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-timing", action="store_true", help="bytes and quality only")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--folders", type=Path, default=None, help="where the quantized folders go (data/models/)")
    a = ap.parse_args()
    models = a.folders or data_dir() / "models"
    src = default_model_dir()
    tok = Tokenizer(src)
    ids = torch.tensor(tok.encode((data_dir() / "text" / "evaluation.txt").read_text())[:a.tokens])
    folders = {label: folder_for(src, maker, models) for label, (_, maker, _) in FORMATS.items()}
    reference = log_probs(load_model(src, "float32"), ids)
    rows = {}
    for label, (weights, _, dtype) in FORMATS.items():
        model = load_for_quality(weights, folders[label][0], dtype)
        timing_model = model if weights == "plain" else load_for_quality(weights, folders[label][0], "bfloat16")
        rows[label] = dict(bytes=step_bytes(timing_model), quality=quality(model, ids, reference))
        print(label, rows[label], flush=True)
        del model, timing_model
    if not a.no_timing:
        prompt = ids[:128].tolist()
        prompts = [ids[i * 32:i * 32 + 128].tolist() for i in range(a.requests)]
        timing_dtype = {"fp32": "float32", "bf16": "bfloat16"}  # the formats: the dtype their step runs fastest in
        llms = {label: LLM(str(folders[label][0]), weights=w, dtype=timing_dtype.get(label, "auto"))
                for label, (w, _, _) in FORMATS.items()}
        rates = {label: ([], []) for label in FORMATS}
        for r in range(a.repeats):
            for label, llm in llms.items():
                rates[label][0].append(decode_rate(llm, [prompt], a.out))
                rates[label][1].append(decode_rate(llm, prompts, a.out))
                print(label, r, rates[label][0][-1], rates[label][1][-1], flush=True)
        for label, (one, many) in rates.items():
            rows[label].update(batch1=statistics.median(one), batch64=statistics.median(many),
                               config=repr(llms[label]))
    lines = [f"# Weight formats: bytes, speed and quality on SmolLM2-135M-Instruct", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- machine: {machine()}",
             f"- command: `python benchmarks/bench_formats.py --tokens {a.tokens} --out {a.out} --requests "
             f"{a.requests} --repeats {a.repeats}{' --no-timing' if a.no_timing else ''}"
             f"{' --record' if a.record else ''}`",
             f"- quality: {len(ids)} tokens of data/text/evaluation.txt in windows of 256, fp32 activations; "
             "KL(fp32 || format) in nats per token",
             f"- timing: a {a.out}-token greedy decode of one 128-token prompt, and of {a.requests} such prompts "
             "submitted at once; medians of alternating runs" if not a.no_timing else "- timing: not run", "",
             "| weights | bytes per token (MB) | batch-1 tok/s | 64-request tok/s | perplexity | KL to fp32 |",
             "|---|---|---|---|---|---|"]
    for label, row in rows.items():
        note = folders[label][1]
        ppl, kl = row["quality"]
        speed = ("-", "-") if a.no_timing else (f"{row['batch1']:.1f}", f"{row['batch64']:.1f}")
        lines.append(f"| {label}{' (' + note + ')' if note else ''} | {row['bytes'] / 1e6:.1f} | {speed[0]} | "
                     f"{speed[1]} | {ppl:.3f} | {kl:.4f} |")
    if not a.no_timing:
        lines += ["", "Engine configurations:", ""] + [f"- {label}: `{row['config']}`" for label, row in rows.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.record:
        path = Path(__file__).parent / f"formats-{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d-%H%M}.md"
        path.write_text(text)
        table = {label: dict(bytes_per_token=row["bytes"], perplexity=row["quality"][0], kl=row["quality"][1],
                             batch1_tokens_per_s=row.get("batch1"), batch64_tokens_per_s=row.get("batch64"))
                 for label, row in rows.items()}
        path.with_suffix(".json").write_text(json.dumps({"machine": machine(), "formats": table}, indent=1) + "\n")
        print("recorded", path, "and", path.with_suffix(".json").name)


if __name__ == "__main__":
    main()
