"""SPACE for ``model.generate(..., custom_generate="<path of this repo>", trust_remote_code=True)``.

transformers looks for ``custom_generate/generate.py`` in the folder it is given and calls its
``generate(model, ...)`` with every argument of ``model.generate``. This shim hands them to
:func:`space.hf.generate`, so it needs the package installed (``pip install -e <repo>``);
``mask_num`` / ``num_groups`` / ``lookup_tokens`` choose the SPACE layout.
"""
from space.hf import generate

__all__ = ["generate"]
