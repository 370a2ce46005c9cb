"""The package's import graph follows its layering (docs/layering.md): arrows only point down, no circles.

    entry (run.py) -> pipeline -> stages -> prepare -> sensitivity / eval / calibration / serving / plan -> transforms
    -> models -> cache -> quant -> kernels (and artifacts, beside them);  record, tracking, tasks, stats, memory, checks and audit are side modules any
    layer may use, and they use no layer.
Every import counts, also those inside functions (deferred for speed, still a dependency)."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "mla_quant"
LEVELS = {"kernels": 0, "artifacts": 0, "quant": 1, "cache": 2, "models": 3, "toy": 3, "transforms": 4, "sensitivity": 5,
          "eval": 5, "calibration": 5, "serving": 5, "plan": 5, "prepare": 6, "stages": 7, "runner": 8, "pipeline": 9}
SIDE = {"record", "tracking", "tasks", "stats", "memory", "checks", "audit", "metrics"}
SAME_LEVEL_ALLOWED = {("toy", "models"), ("models", "toy")}  # the shipped toy is one of the models' sources


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(name: str, modules: set[str]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    modules = set(files)
    graph = {m: set() for m in modules}
    for mod, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mla_quant"):
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("mla_quant")]
            for t in targets:
                r = resolve(t, modules)
                if r and r != mod and r != "mla_quant":
                    graph[mod].add(r)
    return graph


def layer_of(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def test_every_package_has_a_layer():
    packages = {layer_of(m) for m in import_graph() if m != "mla_quant"}
    assert packages <= set(LEVELS) | SIDE, f"packages without a layer: {packages - set(LEVELS) - SIDE}"


def test_imports_only_point_down():
    bad = []
    for mod, deps in import_graph().items():
        a = layer_of(mod)
        for dep in deps:
            b = layer_of(dep)
            if a == b or b in SIDE and (a not in SIDE or a == b):
                continue
            if a in SIDE or b in SIDE:
                bad.append(f"{mod} -> {dep} (side modules use no layer)")
            elif LEVELS[a] < LEVELS[b] or (LEVELS[a] == LEVELS[b] and (a, b) not in SAME_LEVEL_ALLOWED):
                bad.append(f"{mod} ({a}, level {LEVELS[a]}) -> {dep} ({b}, level {LEVELS[b]})")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_no_import_circles():
    graph = import_graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                circles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_kernels_import_nothing_above_them():
    graph = import_graph()
    above = {m: sorted(d for d in deps if layer_of(d) != "kernels") for m, deps in graph.items()
             if layer_of(m) == "kernels"}
    assert not any(above.values()), f"kernel modules import from above: {above}"


# (module outside quant/, literal): a string that happens to spell a codec's name but names something else there
NOT_A_CODEC = {
    ("kernels/latent_decode.py", "bf16"): "the dtype of the kernel's dot products",
    ("models/fp8.py", "fp8"): "a checkpoint's quantization_config.quant_method",
    ("serving/shape.py", "fp8"): "a checkpoint's quantization_config.quant_method",
}


def _name_literals(node: ast.AST) -> list[str]:
    """The string constants a comparison or subscript tests against (`x == "a"`, `x in ("a", "b")`, `D["a"]`)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def test_no_codec_or_quantizer_name_compared_outside_quant():
    """What a format is lives with its codec (quant/): no module outside quant/ (the analysis package included)
    compares a codec, quantizer or peer library name, or looks a codec up by a literal name."""
    from mla_quant.quant.codecs import CODECS
    from mla_quant.quant.peers import LIBRARIES
    from mla_quant.quant.quantizers import QUANTIZERS

    names = set(CODECS) | set(QUANTIZERS) | set(LIBRARIES)
    found = []
    for path in sorted([*PKG.rglob("*.py"), *(PKG.parent / "analysis").rglob("*.py")]):
        rel = path.relative_to(PKG).as_posix() if path.is_relative_to(PKG) else path.relative_to(PKG.parent).as_posix()
        if rel.startswith("quant/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                literals = [s for operand in [node.left, *node.comparators] for s in _name_literals(operand)]
            elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "CODECS":
                literals = _name_literals(node.slice)
            else:
                continue
            found += [f"{rel}:{node.lineno} {s!r}" for s in literals if s in names and (rel, s) not in NOT_A_CODEC]
    assert not found, "codec / quantizer names compared outside quant/:\n" + "\n".join(found)
