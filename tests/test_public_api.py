"""The package's public names: every one in ``__all__`` resolves to the object its module defines, and importing
the package (or its command line's parser) loads none of the heavy libraries before a name that needs them is used."""

from __future__ import annotations

import importlib
import subprocess
import sys

import hf_janus

HEAVY = ("torch", "transformers", "peft", "bitsandbytes", "accelerate")


def test_every_public_name_resolves_to_its_modules_object():
    for name in hf_janus.__all__:
        value = getattr(hf_janus, name)
        if name == "__version__":
            continue
        module = importlib.import_module(value.__module__)
        assert getattr(module, name) is value, name
    assert set(hf_janus.__all__) <= set(dir(hf_janus))


def _loaded_after(statement: str) -> list[str]:
    code = f"import sys; {statement}; print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_importing_the_package_loads_no_heavy_library():
    assert _loaded_after("import hf_janus") == []
    assert "torch" in _loaded_after("from hf_janus import JanusConfig")  # loaded once a name needs it
