"""List imports made inside functions (not at module level) in the package's folders: the layering
rule allows them only for optional heavy dependencies, each with a one-line reason."""
import ast
import sys
from pathlib import Path

FOLDERS = ("vlm_kv", "gates", "kernels", "train", "eval")


def function_imports(root: Path):
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for sub in ast.walk(node):
                        if isinstance(sub, ast.ImportFrom) and sub.module:
                            yield path.relative_to(root), sub.lineno, sub.module
                        elif isinstance(sub, ast.Import):
                            for alias in sub.names:
                                yield path.relative_to(root), sub.lineno, alias.name


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    seen = set()
    for path, line, module in function_imports(root):
        if (path, line) not in seen:
            seen.add((path, line))
            print(f"{path}:{line}: {module}")
