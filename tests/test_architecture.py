"""Architecture rules that keep the package honest (STYLE.md items 13-15): no import cycle, no
side effect at import, no per-call state on modules (so torch.compile captures a whole step)."""
import ast
import subprocess
import sys
from pathlib import Path

import torch

from space.adapter_layers import fuse_frozen_base, prepare_model
from space.masking import decode_layout, mask_rows, to_additive_4d
from space.models import load_model

PACKAGE = Path(__file__).resolve().parents[1] / "space"


def imports_of(path: Path) -> set[str]:
    """The space.* modules a file imports (relative imports resolved), at any depth of the file."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            name = ".".join(filter(None, [base, node.module]))
            found.add(name)
            found.update(f"{name}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {f.removesuffix(".__init__") for f in found if f.startswith("space")}


def test_no_import_cycle():
    files = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in PACKAGE.rglob("*.py")}
    graph = {m: {i for i in imports_of(p) if i in files and i != m} for m, p in files.items()}
    graph = {m: {i for i in deps if not m.startswith(i + ".")} for m, deps in graph.items()}  # a parent package

    def visit(m, path):
        assert m not in path, "import cycle: " + " -> ".join([*path, m])
        for dep in graph[m]:
            if not files[dep].name == "__init__.py":
                visit(dep, [*path, m])

    for m in graph:
        visit(m, [])


def test_modules_hold_one_level():
    """A module that defines nn.Modules does no file I/O and has no CLI (issue 46): the layers, the
    artifact's files (space.artifact) and the commands live apart."""
    io = {"argparse", "json", "safetensors", "shutil", "tempfile", "subprocess"}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        modules = [n.name for n in tree.body if isinstance(n, ast.ClassDef)
                   and any(ast.unparse(b) in ("nn.Module", "torch.nn.Module") for b in n.bases)]
        if not modules:
            continue
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                     and not n.level}
        assert not imported & io, f"{path.name} defines {modules} and imports {sorted(imported & io)}"
        assert "main" not in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, path.name


def test_import_leaves_transformers_registries_untouched():
    code = ("from transformers import AttentionInterface; from transformers.masking_utils import "
            "ALL_MASK_ATTENTION_FUNCTIONS as M; before = (set(AttentionInterface._global_mapping), set(M._global_mapping)); "
            "import space, space.cpu_kernels, space.decoding.backends, space.decoding.graphs, space.eval.__main__; "
            "after = (set(AttentionInterface._global_mapping), set(M._global_mapping)); print(before == after)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().endswith("True"), out.stderr[-2000:]


def test_torch_compile_captures_a_frozen_base_step_whole():
    """The gate is read from the ``mask_rows`` scope, not from state a module writes during
    forward, so dynamo captures the decoder forward as one graph (fullgraph=True raises on a
    graph break), for a SPACE block and for a plain AR block, with the eager outputs."""
    model, tok = load_model("tiny-random-llama")
    model, spec = prepare_model(model, tok, "frozen-base", 3)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    decoder = fuse_frozen_base(model).model
    compiled = torch.compile(decoder, backend="eager", fullgraph=True)
    lay = decode_layout(0, 2, 2, 3)
    ids = lay.input_ids(torch.tensor([5, 6, 7]), torch.tensor(spec.token_ids[:1]))[None]
    kwargs = dict(input_ids=ids, position_ids=lay.position_ids[None], attention_mask=to_additive_4d(lay.allowed))
    with torch.no_grad():
        with mask_rows(lay.num_real):
            want, got = decoder(**kwargs).last_hidden_state, compiled(**kwargs).last_hidden_state
        plain = compiled(**kwargs).last_hidden_state  # outside the scope: no LoRA anywhere
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.equal(plain[:, :3], want[:, :3]) and not torch.allclose(plain[:, 3:], want[:, 3:], atol=1e-3)
