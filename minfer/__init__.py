"""Learn and use the techniques behind fast LLM inference: a literate, step-by-step inference engine."""

__version__ = "0.1.0"
"minfer: learn and use the techniques behind fast LLM inference. The public API is `LLM` and `SamplingParams`."
import importlib

# The chapters' modules, in course order. The package loads lazily: `import minfer.<chapter>` loads that chapter and
# the ones before it, nothing later, so a reader of chapter 03 runs chapter 03's engine. The public names below load
# every chapter first (`load_all`), so that `from minfer import LLM` sees every registry's entries: weight formats,
# KV formats and their readers, attention backends, speculative methods, worker engines, model families, output
# constraints, subcommands, server routes, and the switches each chapter adds to the engine's config.
CHAPTERS = ("gguf", "model", "roofline", "tokenizer", "naive", "kvcache", "sampling", "sequence", "sequential",
            "paged", "radix", "flash", "cpu_kernels", "cpu_step", "scheduler", "engine", "llm", "protocol",
            "engine_loop", "serve", "cli", "chat", "awq", "awq_kernels", "formats", "format_kernels", "kvquant",
            "kivi", "step_times", "speculative", "eagle", "trees", "workers", "disagg", "families", "moe", "sinks",
            "mla", "shared_kv", "kv_cache", "hybrid", "tp", "cluster", "structured", "stack")
PUBLIC = {"LLM": "llm", "RequestOutput": "llm", "Completion": "llm", "SamplingParams": "sampling"}


def load_all():
    "Import every chapter's module, in course order, so that every extension point holds every chapter's entries."
    for name in CHAPTERS:
        importlib.import_module(f"{__name__}.{name}")


def __getattr__(name):
    if name in PUBLIC:
        load_all()
        return getattr(importlib.import_module(f"{__name__}.{PUBLIC[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *PUBLIC])


def main(argv=None):
    "The `minfer` command: every chapter loaded (each brings its subcommands and switches), then chapter 07e's CLI."
    load_all()
    return importlib.import_module(f"{__name__}.cli").main(argv)
