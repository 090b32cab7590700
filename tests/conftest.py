import ctypes, ctypes.util, gc, os
import pytest, torch
import minfer

# the tests use minfer as a library user does (`from minfer import LLM`): every chapter loaded, every entry registered;
# tests/test_one_idea.py checks in fresh processes that a chapter alone loads nothing after it
minfer.load_all()

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # two workers on two cores: one thread each avoids oversubscription

def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords: item.add_marker(skip)

@pytest.fixture(scope="module", autouse=True)
def collect_after_module():
    """Free what a test module's engines leave in reference cycles before the next module loads its own: an xdist worker
    runs many modules in one process, and the cyclic collector, woken by object counts, does not see gigabytes of
    tensors held by a few objects (a worker grew to 12 GB and was killed for memory). Then glibc gives the freed heap
    back to the system (`malloc_trim`): freed tensors otherwise stay in the worker's resident memory, and two workers
    at 7 and 9 GB beside a test's own worker processes were killed for memory on a 24 GB machine."""
    yield
    gc.collect()
    if LIBC is not None:
        LIBC.malloc_trim(0)

def _glibc():
    "glibc, for `malloc_trim`; None where the C library is another (macOS, musl)."
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim
        return libc
    except (OSError, AttributeError):
        return None

LIBC = _glibc()

@pytest.fixture(scope="session")
def model_dir():
    from minfer.gguf import default_model_dir
    return default_model_dir()

@pytest.fixture(scope="session")
def model(model_dir):
    from minfer.model import load_model
    return load_model(model_dir, "float32")

@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from minfer.tokenizer import Tokenizer
    return Tokenizer(model_dir)

@pytest.fixture(scope="session")
def llm(model_dir):
    from minfer.llm import LLM
    return LLM(model_dir)
