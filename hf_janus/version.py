"""The package version, in one place: ``pyproject.toml`` reads it (``[tool.setuptools.dynamic]``), and so do the
package, the command line and the published records."""

__version__ = "0.1.0"
