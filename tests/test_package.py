"""The package installs, imports without a GPU, ships its tokenizer and exposes its console entry point."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import torch

import gradcache_sparton
from gradcache_sparton.cli import main


def test_import_exposes_public_api() -> None:
    """Every name in __all__ exists, and importing the package does not import triton eagerly."""
    for name in gradcache_sparton.__all__:
        assert hasattr(gradcache_sparton, name), name
    assert isinstance(gradcache_sparton.__version__, str)
    code = "import sys, gradcache_sparton; sys.exit('triton' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_cli_help_and_version(capsys) -> None:
    """`gradcache-sparton --help` and `--version` print and exit 0 (in-process and as `python -m`); the console
    script is declared."""
    for flag, expected in (
        ("--help", "usage: gradcache-sparton"),
        ("--version", gradcache_sparton.__version__),
    ):
        try:
            main([flag])
        except SystemExit as exc:
            assert exc.code == 0
        assert expected in capsys.readouterr().out
    # Through this interpreter, not PATH: the test must not depend on an activated venv.
    command = [sys.executable, "-m", "gradcache_sparton.cli", "--help"]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    assert "usage: gradcache-sparton" in out
    entry_points = importlib.metadata.entry_points(group="console_scripts", name="gradcache-sparton")
    assert [ep.value for ep in entry_points] == ["gradcache_sparton.cli:main"], "console script not installed"


def test_shipped_tokenizer_tokenises(tokenizer) -> None:
    """The bundled tokenizer is the real bert-base-uncased WordPiece (30,522 tokens)."""
    assert len(tokenizer) == 30522
    enc = tokenizer("Sparse retrieval with SPLADE.", return_tensors="pt")
    tokens = tokenizer.convert_ids_to_tokens(enc["input_ids"][0])
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]"
    assert "sparse" in tokens and "retrieval" in tokens


def test_tiny_model_fixture_runs(tiny_bert_mlm, tokenizer) -> None:
    """The tiny random-init masked-LM fixture runs a forward over a tokenised batch."""
    batch = tokenizer(
        ["a short query", "a somewhat longer document about proteins"], padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        logits = tiny_bert_mlm(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def test_shipped_pretrained_model_loads_by_name_and_is_sparse() -> None:
    """`splade-tiny-msmarco` resolves to the checkpoint inside the package (bytes as documented in NOTICE.md,
    no ../shared, no hub) and gives a real SPLADE rep: a few dozen terms led by the query's own words."""
    import hashlib

    from gradcache_sparton.arguments import ModelArguments
    from gradcache_sparton.model_loading import build_encoder, build_tokenizer, resolve_model_location
    from gradcache_sparton.resources import RESOURCES_DIR

    location = resolve_model_location("splade-tiny-msmarco")
    assert location == str(RESOURCES_DIR / "splade-tiny-msmarco")
    digest = hashlib.sha256(
        (RESOURCES_DIR / "splade-tiny-msmarco" / "model.safetensors").read_bytes()
    ).hexdigest()
    assert digest == "96e1dd8dbbc82439cf50677a15bcb9141172b289d20b41c9c28b621a0451a02a"
    assert "96e1dd8dbbc82439" in (RESOURCES_DIR / "NOTICE.md").read_text(encoding="utf-8")
    assert (RESOURCES_DIR / "splade-tiny-msmarco" / "LICENSE").is_file()
    model_args = ModelArguments(model_name_or_path="splade-tiny-msmarco")
    tokenizer = build_tokenizer(model_args)
    encoder = build_encoder(model_args, tokenizer).eval()
    with torch.no_grad():
        rep = encoder(**tokenizer(["what causes cancer in mice"], return_tensors="pt"))[0]  # [V]
    assert 10 <= int((rep > 0).sum()) <= 200  # measured 48 non-zeros per query on average
    top = tokenizer.convert_ids_to_tokens(rep.topk(8).indices.tolist())
    assert {"cancer", "mice"} <= set(top), top
