"""The code-edit workload of speculative decoding (issue 20): a function of a Python source, an instruction to
write it again with one change (a rename, an added argument, every 0 replaced by 1) and the changed copy's first
line; the model goes on. ``answer`` is the rest of the copy that the instruction asks for: what an instruction
model writes, and what tools/train_small_model.py teaches the small model from other files than the workload's
(bench/speculate.py and bench/edit_replay.py run the cases)."""

from __future__ import annotations

import re

# committed, so that the cases never depend on the Python that runs them
EDIT_SOURCE = "tests/data/textwrap-cpython-3.11.7.py.txt"
# the small test model trained on the workload's format too (tools/train_small_model.py, its edit mix: other
# files than EDIT_SOURCE): 98 characters of the changed copy before its first difference, on average over the 24
# cases at 96 tokens, where tests/data/small-py, which never saw the format, writes 40
EDIT_MODEL = "tests/data/small-py-edit"
KINDS = ("rename", "argument", "constant")
ZERO = re.compile(r"(?<![\w.])0(?![\w.])")   # a literal 0 that is not part of a name or another number


def functions(text: str, max_chars: int = 2000) -> list[tuple[str, str, str, str]]:
    """(source, indent, name, arguments) of every def in ``text`` of at most ``max_chars`` (one-line heads)."""
    lines, out = text.splitlines(keepends=True), []
    for i, line in enumerate(lines):
        head = re.match(r"^( *)def (\w+)\((.*)\):$", line.rstrip("\n"))
        if not head:
            continue
        indent, j = head.group(1), i + 1
        while j < len(lines) and (not lines[j].strip() or lines[j].startswith(indent + " ")):
            j += 1
        body = "".join(lines[i:j]).rstrip() + "\n"
        if len(body) <= max_chars:
            out.append((body, indent, head.group(2), head.group(3)))
    return out


def edit(source: str, indent: str, name: str, args: str, kind: str) -> tuple[str, str]:
    """(prompt, answer) of one change of one function (``functions``' fields): the prompt ends with the
    changed copy's def line, the answer is the copy's other lines."""
    if kind == "rename":
        note, head = f"renamed to {name}_v2", f"def {name}_v2({args}):"
    elif kind == "argument":
        note, head = "with an added argument verbose=False", f"def {name}({args}, verbose=False):"
    elif kind == "constant":
        note, head = "with every 0 replaced by 1", f"def {name}({args}):"
    else:
        raise ValueError(f"an edit is one of {', '.join(KINDS)}, got {kind!r}")
    rest = source.split("\n", 1)[1]
    return (f"{source}\n{indent}# The same function {note}:\n{indent}{head}\n",
            ZERO.sub("1", rest) if kind == "constant" else rest)


def edit_cases(text: str, n: int = 24) -> list[tuple[str, str]]:
    """(prompt, kind of change) for n edits of the functions of ``text``, each change in turn per function."""
    return [(edit(*fn, kind)[0], kind) for fn in functions(text) for kind in KINDS][:n]
