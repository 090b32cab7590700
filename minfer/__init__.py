__version__ = "0.1.0"
"minfer: learn and use the techniques behind fast LLM inference. The public API is `LLM` and `SamplingParams`."
from .sampling import SamplingParams
from .llm import LLM, RequestOutput, Completion
