"""SWE-smith-style bugs made on purpose: AST mutations of one function at a time.

`find_mutations(source, path)` lists every place in a module where one of the `KINDS` applies,
each as a `Mutation` that names its file, function and the exact piece of text it replaces.
`apply_mutation(source, m)` makes that one edit. Edits are splices of the original text at the
node's position (only the mutated expression or statement changes; the rest of the file keeps
its formatting and comments), and every mutated module must still parse.

Kinds (one site each):
- `flip_comparison`: a single comparison turned around (`<` ↔ `>`, `<=` ↔ `>=`, `==` ↔ `!=`,
  `in` ↔ `not in`, `is` ↔ `is not`);
- `off_by_one`: the stop of a `range(...)`, or a slice bound, moved by one;
- `swap_arguments`: the first two positional arguments of a call swapped;
- `drop_statement`: an assignment, augmented assignment or call statement removed from a block
  of two or more statements;
- `invert_condition`: the test of an `if`, `while` or conditional expression negated;
- `wrong_constant`: an integer constant changed by one.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import asdict, dataclass

KINDS = ("flip_comparison", "off_by_one", "swap_arguments", "drop_statement",
         "invert_condition", "wrong_constant")

_FLIP: dict[type, str] = {ast.Lt: ">", ast.Gt: "<", ast.LtE: ">=", ast.GtE: "<=",
                          ast.Eq: "!=", ast.NotEq: "==", ast.In: "not in",
                          ast.NotIn: "in", ast.Is: "is not", ast.IsNot: "is"}


@dataclass(frozen=True)
class Mutation:
    """One edit: in `file` (a path relative to the repository), inside `function` (its
    qualified name), the text from (`line`, `col`) to (`end_line`, `end_col`) (1-based lines,
    0-based character columns) is `original` and becomes `replacement`."""

    file: str
    function: str
    kind: str
    line: int
    col: int
    end_line: int
    end_col: int
    original: str
    replacement: str

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Mutation:
        try:
            m = cls(**data)  # type: ignore[arg-type]
        except TypeError as exc:
            raise ValueError(f"not a mutation record: {exc}") from None
        if m.kind not in KINDS:
            raise ValueError(f"unknown mutation kind {m.kind!r} (known: {', '.join(KINDS)})")
        return m


class MutationMismatch(ValueError):
    """The source does not hold the text a mutation replaces (another snapshot)."""


def _offsets(lines: list[str]) -> list[int]:
    out, total = [0], 0
    for line in lines:
        total += len(line)
        out.append(total)
    return out


def _char_col(line: str, byte_col: int) -> int:
    """ast's columns count UTF-8 bytes; ours count characters."""
    return len(line.encode()[:byte_col].decode(errors="replace"))


class _Finder:
    def __init__(self, source: str, path: str):
        self.source, self.path = source, path
        self.lines = source.splitlines(keepends=True)
        self.found: list[Mutation] = []

    def segment(self, node: ast.AST) -> str:
        return ast.get_source_segment(self.source, node) or ""

    def add(self, func: str, kind: str, node: ast.AST, replacement: str,
            whole_lines: bool = False) -> None:
        line, end_line = node.lineno, node.end_lineno  # type: ignore[attr-defined]
        if whole_lines:
            col, end_col = 0, 0
            end_line += 1
            original = "".join(self.lines[line - 1:end_line - 1])
        else:
            col = _char_col(self.lines[line - 1], node.col_offset)  # type: ignore[attr-defined]
            end_col = _char_col(self.lines[end_line - 1],
                                node.end_col_offset)  # type: ignore[attr-defined]
            original = self.segment(node)
        if not original or original == replacement:
            return
        self.found.append(Mutation(self.path, func, kind, line, col, end_line, end_col,
                                   original, replacement))

    # -- the kinds ------------------------------------------------------------------------
    def visit_function(self, qualname: str, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.statement_sites(qualname, fn)
        for node in _walk_own(fn):
            if isinstance(node, ast.Compare) and len(node.ops) == 1:
                op = _FLIP.get(type(node.ops[0]))
                left, right = self.segment(node.left), self.segment(node.comparators[0])
                if op and left and right and "\n" not in left + right:
                    self.add(qualname, "flip_comparison", node, f"{left} {op} {right}")
            elif isinstance(node, ast.Call):
                self.call_sites(qualname, node)
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice):
                bound = node.slice.upper or node.slice.lower
                if bound is not None:
                    self.add(qualname, "off_by_one", bound, self.moved(bound))
            elif isinstance(node, (ast.If, ast.While, ast.IfExp)):
                self.add(qualname, "invert_condition", node.test,
                         _negated(self.segment(node.test), node.test))
            elif (isinstance(node, ast.Constant) and type(node.value) is int
                  and not _is_default(fn, node)):
                self.add(qualname, "wrong_constant", node, str(node.value + 1))
            if isinstance(node, (ast.For, ast.While, ast.If, ast.With, ast.Try)):
                self.statement_sites(qualname, node)

    def call_sites(self, qualname: str, node: ast.Call) -> None:
        args = node.args
        if (isinstance(node.func, ast.Name) and node.func.id == "range" and args
                and not any(isinstance(a, ast.Starred) for a in args)):
            stop = args[0] if len(args) == 1 else args[1]
            self.add(qualname, "off_by_one", stop, self.moved(stop))
        elif len(args) >= 2 and not any(isinstance(a, ast.Starred) for a in args[:2]):
            first, second = self.segment(args[0]), self.segment(args[1])
            between = self._between(args[0], args[1])
            if first and second and first != second and between is not None:
                span = ast.Tuple(elts=[], ctx=ast.Load())
                ast.copy_location(span, args[0])
                span.end_lineno, span.end_col_offset = args[1].end_lineno, args[1].end_col_offset
                self.add(qualname, "swap_arguments", span, f"{second}{between}{first}")

    def moved(self, node: ast.AST) -> str:
        """A bound one off: `n + 1` → `n`, `n - 1` → `n`, a constant plus one, else `n + 1`."""
        text = self.segment(node)
        if (isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub))
                and isinstance(node.right, ast.Constant) and node.right.value == 1):
            return self.segment(node.left) or ast.unparse(node.left)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return str(node.value + 1)
        if isinstance(node, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)):
            return f"{text} + 1"
        return f"({text}) + 1"

    def _between(self, a: ast.AST, b: ast.AST) -> str | None:
        if a.end_lineno != b.lineno:  # type: ignore[attr-defined]
            return None
        raw = self.lines[b.lineno - 1].encode()  # type: ignore[attr-defined]
        text = raw[a.end_col_offset:b.col_offset].decode()  # type: ignore[attr-defined]
        return text if text.strip() == "," else None

    def statement_sites(self, qualname: str, node: ast.AST) -> None:
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if not isinstance(block, list) or len(block) < 2:
                continue
            for stmt in block:
                droppable = isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign)) or (
                    isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call))
                if droppable and self._alone_on_its_lines(stmt):
                    self.add(qualname, "drop_statement", stmt, "", whole_lines=True)

    def _alone_on_its_lines(self, stmt: ast.stmt) -> bool:
        first = self.lines[stmt.lineno - 1]
        last = self.lines[stmt.end_lineno - 1]  # type: ignore[operator]
        return (first[:_char_col(first, stmt.col_offset)].strip() == ""
                and last[_char_col(last, stmt.end_col_offset or 0):].strip() in ("", "\\")
                and ";" not in last[_char_col(last, stmt.end_col_offset or 0):])


def _walk_own(fn: ast.AST) -> Iterator[ast.AST]:
    """The nodes of `fn` itself (its decorators, defaults and nested functions excluded)."""
    stack = list(reversed(getattr(fn, "body", [])))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _is_default(fn: ast.AST, node: ast.AST) -> bool:
    args = getattr(fn, "args", None)
    return args is not None and any(node is d for d in [*args.defaults, *args.kw_defaults])


def _negated(text: str, node: ast.AST) -> str:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        inner = node.operand
        simple = isinstance(inner, (ast.Name, ast.Attribute, ast.Call, ast.Subscript))
        body = ast.unparse(inner)
        return body if simple else f"({body})"
    if isinstance(node, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)):
        return f"not {text}"
    return f"not ({text})"


def find_mutations(source: str, path: str) -> list[Mutation]:
    """Every mutation site of every function in `source` (the module at `path`), in file
    order; a function nested in another is named with its own qualified name."""
    tree = ast.parse(source)
    finder = _Finder(source, path)

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qualname = f"{prefix}{child.name}"
                finder.visit_function(qualname, child)
                visit(child, qualname + ".<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return sorted(set(finder.found), key=lambda m: (m.line, m.col, m.kind, m.replacement))


def apply_mutation(source: str, m: Mutation) -> str:
    """`source` with `m` made; `MutationMismatch` if the text at its place is not
    `m.original`, `ValueError` if the result does not parse."""
    lines = source.splitlines(keepends=True)
    if not 1 <= m.line <= m.end_line <= len(lines) + 1:
        raise MutationMismatch(f"{m.file}: lines {m.line}-{m.end_line} are outside the file")
    offsets = _offsets(lines)
    start = offsets[m.line - 1] + m.col
    end = offsets[m.end_line - 1] + m.end_col
    if source[start:end] != m.original:
        raise MutationMismatch(f"{m.file}:{m.line}: expected {m.original!r} there, found "
                               f"{source[start:end]!r} (another version of the file?)")
    out = source[:start] + m.replacement + source[end:]
    try:
        ast.parse(out)
    except SyntaxError as exc:
        raise ValueError(f"{m.file}: the mutation {m.kind} at line {m.line} does not parse: "
                         f"{exc}") from None
    return out
