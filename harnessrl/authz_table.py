"""docs/security.md's authorization table, written from harnessrl/authz.py's `RULES`.

    python -m harnessrl.authz_table                        # prints the table (Markdown)
    python -m harnessrl.authz_table --write docs/security.md   # replaces it between the markers

The table in the docs is this module's output; tests/test_auth_docs.py parses it back and checks
it equals `RULES` and `SCOPED` exactly, and that every RPC of the generated protos has a row.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from harnessrl.authz import (CONTROLLER, GATEWAY, GRADER, OPERATOR, READER, RULES, SCOPED,
                             TRAINER)

# The identities that call services, as the table's columns (the store calls nobody; admin is
# allowed everything and has no column).
COLUMNS = (CONTROLLER, GATEWAY, TRAINER, OPERATOR, READER, GRADER)
# What the scope token of a grader lets it reach, per scoped RPC (authz.SCOPED in words).
SCOPE_TEXT = {
    "/harnessrl.v1.Store/GetRollout": "scoped: its own rollouts",
    "/harnessrl.v1.Store/ListRollouts": "scoped: its own group",
    "/harnessrl.v1.Store/GetState": "scoped: its run's judge cache",
    "/harnessrl.v1.Store/PutState": "scoped: its run's judge cache",
}
ALLOWED = "✓"
BEGIN = "<!-- authz table: python -m harnessrl.authz_table --write docs/security.md -->"
END = "<!-- end authz table -->"


def markdown() -> str:
    """The table: one row per RPC of RULES, in its order, one column per calling identity."""
    if set(SCOPE_TEXT) != set(SCOPED):
        raise ValueError("SCOPE_TEXT must describe exactly the RPCs of authz.SCOPED")
    lines = ["| service | RPC | " + " | ".join(COLUMNS) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]
    for method, who in RULES.items():
        unknown = set(who) - set(COLUMNS)
        if unknown:
            raise ValueError(f"{method}: identities {sorted(unknown)} have no column")
        service, name = method.strip("/").split("/")
        cells = []
        for identity in COLUMNS:
            if identity not in who:
                cells.append("")
            elif identity == GRADER and method in SCOPED:
                cells.append(SCOPE_TEXT[method])
            else:
                cells.append(ALLOWED)
        lines.append(f"| {service.rpartition('.')[2]} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def replace(text: str) -> str:
    """`text` with the table between BEGIN and END written anew."""
    pattern = re.compile(re.escape(BEGIN) + r"\n.*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"no {BEGIN!r} ... {END!r} markers")
    return pattern.sub(lambda _m: f"{BEGIN}\n{markdown()}{END}", text, count=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harnessrl.authz_table", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", type=Path, metavar="DOC",
                    help="replace the table between the markers in DOC")
    a = ap.parse_args(argv)
    if a.write is None:
        sys.stdout.write(markdown())
        return 0
    a.write.write_text(replace(a.write.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
