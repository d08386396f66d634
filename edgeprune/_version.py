"""The edgeprune version (here, not in ``edgeprune/__init__.py``, so that modules can read it
without importing the package's public names; keep it equal to ``pyproject.toml``)."""

__version__ = "0.1.0"
