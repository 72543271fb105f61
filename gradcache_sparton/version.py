"""The package version (one place: the package root, pyproject.toml and the saved model files read it)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
