"""Shared test infrastructure: device markers, the Triton-interpreter and hub-offline switches, tiny-model fixtures.

Triton decides between compiling and interpreting when a kernel is *decorated*, i.e. when the module
defining it is imported, and ``transformers`` imports triton as soon as a model class is imported. So
``TRITON_INTERPRET=1`` is set here, at conftest import, before any test module imports either: on a
machine without CUDA the whole session runs the kernels through Triton's interpreter on CPU tensors;
with CUDA the same tests run the compiled kernels on the GPU.
"""

from __future__ import annotations

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# No test needs the network, and huggingface_hub reads this once, at import: set before transformers loads
# it, so that a name which is no local folder fails at once instead of after connection timeouts (46 s
# and 70 s for two tests on a machine without internet). CLI tests' subprocesses inherit it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# bm25s (imported by the mining tests at collection) runs a JAX op at import: on a GPU machine with JAX,
# each test process would hold 75% of the first GPU (as gradcache_sparton.mining avoids for users).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402
from engine_helpers import make_tiny_bert_config  # noqa: E402
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, PreTrainedTokenizerBase  # noqa: E402

from gradcache_sparton.resources import default_tokenizer_path  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu`-marked tests, with the reason, where CUDA is absent."""
    if CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; torch.cuda.is_available() is False here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A run in which no test passed is a failure, even if everything was skipped or deselected."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    passed = len(reporter.stats.get("passed", [])) if reporter is not None else 0
    if exitstatus == 0 and passed == 0:
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED


# torch.backends' fp32 precision settings (torch >= 2.9), the process-wide one first: restoring it resets
# the backend ones under it, which are then restored each to its own value.
_FP32_PRECISION_SETTINGS = (
    "fp32_precision",
    "cuda.matmul.fp32_precision",
    "cudnn.fp32_precision",
    "cudnn.conv.fp32_precision",
    "cudnn.rnn.fp32_precision",
    "mkldnn.fp32_precision",
    "mkldnn.matmul.fp32_precision",
    "mkldnn.conv.fp32_precision",
    "mkldnn.rnn.fp32_precision",
)


def _backend_setting(path: str) -> tuple[object, str]:
    *owners, name = path.split(".")
    owner = torch.backends
    for part in owners:
        owner = getattr(owner, part)
    return owner, name


@pytest.fixture(autouse=True)
def _restore_fp32_precision():
    """Each test starts from the session's fp32 precision settings. On an Ampere or newer GPU,
    ``TrainingArguments(torch_compile=True, bf16=True)`` turns TF32 on process-wide
    (``torch.backends.fp32_precision = "tf32"``): later fp32 references then rounded their products and
    torch.compile's precision query raised ("mix of legacy and new APIs"), failing kernel tests run in
    the same process after the trainer's."""
    settings = [_backend_setting(path) for path in _FP32_PRECISION_SETTINGS]
    saved = [(owner, name, getattr(owner, name)) for owner, name in settings if hasattr(owner, name)]
    yield
    for owner, name, value in saved:
        if getattr(owner, name) != value:
            setattr(owner, name, value)


@pytest.fixture(scope="session")
def kernel_device() -> torch.device:
    """Where Triton kernel tests put their tensors: the GPU if there is one, else CPU (interpreter)."""
    if CUDA:
        return torch.device("cuda")
    assert os.environ.get("TRITON_INTERPRET") == "1", "kernel tests on CPU need TRITON_INTERPRET=1"
    return torch.device("cpu")


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerBase:
    """The real bert-base-uncased tokenizer shipped inside the package (no hub, no ../shared)."""
    return AutoTokenizer.from_pretrained(default_tokenizer_path())


@pytest.fixture
def tiny_bert_config(tokenizer: PreTrainedTokenizerBase) -> BertConfig:
    """A 2-layer, 32-wide BERT config over the real 30,522-token vocabulary (fast on CPU)."""
    return make_tiny_bert_config(tokenizer)


@pytest.fixture
def tiny_bert_mlm(tiny_bert_config: BertConfig) -> BertForMaskedLM:
    """A freshly seeded random-init tiny BERT masked-LM (built from the config, never from a hub)."""
    torch.manual_seed(0)
    return BertForMaskedLM(tiny_bert_config).eval()
