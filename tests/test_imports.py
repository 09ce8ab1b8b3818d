"""poot's modules import each other without a cycle, read from their source (every import
statement, those inside functions too): each layer knows only the ones below it. A package's
__init__ that re-exports its own modules is the one exception."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def modules():
    """{module name: (path, whether it is a package's __init__)} of poot/ and drivers/."""
    found = {}
    for path in sorted([*ROOT.glob("poot/**/*.py"), *ROOT.glob("drivers/*.py")]):
        parts = path.relative_to(ROOT).with_suffix("").parts
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def imports(name, path, package, known):
    """The modules of `known` that the module `name` imports."""
    here = name if package else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = here.split(".")[:len(here.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + [node.module] if node.module else base)
            out |= {module} | {f"{module}.{a.name}" for a in node.names}
    return {m for m in out if m in known and m != name}


def within_its_package(a, b):
    return a.startswith(b + ".") or b.startswith(a + ".")


def test_no_module_imports_one_that_imports_it_back():
    known = modules()
    graph = {name: imports(name, *known[name], known) for name in known}
    cycles = []

    def walk(name, trail):
        for other in graph[name]:
            if other in trail:
                cycle = trail[trail.index(other):] + [other]
                if not all(within_its_package(a, b) for a, b in zip(cycle, cycle[1:])):
                    cycles.append(" -> ".join(cycle))
            elif other not in done:
                walk(other, trail + [other])
        done.add(name)

    done = set()
    for name in known:
        if name not in done:
            walk(name, [name])
    assert cycles == []
