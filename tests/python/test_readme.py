"""The README's Python examples are valid Python (they are fragments, so they are compiled,
not run; its Rust examples are doctests and its C examples are compiled by
tests/readme.rs)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def blocks(lang):
    """(line, body) of each ```lang block of the README."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1))
            for m in re.finditer(rf"^```{lang}\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)]


def test_python_examples_compile():
    examples = blocks("python")
    assert examples, "the README has no ```python block"
    for line, body in examples:
        compile(body, f"README.md (the example at line {line})", "exec")
