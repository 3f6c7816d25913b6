"""docs/security.md says what the code does: its authorization table is harnessrl/authz.py's
RULES and SCOPED exactly, every RPC of the generated protos has a row (a new RPC cannot be added
without deciding who may call it), its identities are harnessrl/pki.py's, and its cert-manager
manifests name what harnessrl.pki names."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import yaml

from harnessrl import authz, authz_table, pki
from harnessrl import v1 as generated

DOC = Path(__file__).resolve().parent.parent / "docs" / "security.md"


def _table(text: str) -> list[list[str]]:
    """The rows (cells stripped) of the Markdown table that starts at the top of `text`."""
    rows = []
    for line in text.strip().splitlines():
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def doc_rules() -> tuple[dict[str, set[str]], set[str]]:
    """The authorization table of the docs: full method -> identities allowed, and the methods
    whose grader cell says 'scoped'."""
    text = DOC.read_text()
    start, end = text.index(authz_table.BEGIN), text.index(authz_table.END)
    header, rule, *rows = _table(text[start + len(authz_table.BEGIN):end])
    assert header[:2] == ["service", "RPC"] and set(rule) == {"---"}
    identities = header[2:]
    rules: dict[str, set[str]] = {}
    scoped: set[str] = set()
    for row in rows:
        assert len(row) == len(header), row
        method = f"/harnessrl.v1.{row[0]}/{row[1]}"
        assert method not in rules, f"two rows for {method}"
        rules[method] = set()
        for identity, cell in zip(identities, row[2:]):
            if cell == authz_table.ALLOWED:
                rules[method].add(identity)
            elif cell.startswith("scoped"):
                assert identity == authz.GRADER, f"{method}: only graders are scoped"
                rules[method].add(identity)
                scoped.add(method)
            else:
                assert cell == "", f"{method}, {identity}: {cell!r}"
    return rules, scoped


def proto_methods() -> set[str]:
    """Every RPC of every service in the generated protos (harnessrl/v1/*_pb2.py)."""
    out = set()
    for mod in pkgutil.iter_modules(generated.__path__):
        if not mod.name.endswith("_pb2"):
            continue
        module = importlib.import_module(f"harnessrl.v1.{mod.name}")
        for service in module.DESCRIPTOR.services_by_name.values():
            out |= {f"/{service.full_name}/{m.name}" for m in service.methods}
    return out


def test_the_docs_table_is_the_code_table() -> None:
    rules, scoped = doc_rules()
    assert rules == {m: set(who) for m, who in authz.RULES.items()}
    assert scoped == set(authz.SCOPED)


def test_every_rpc_of_the_protos_has_a_rule() -> None:
    methods = proto_methods()
    assert len(methods) >= 40  # the four services' RPCs were found at all
    assert methods - set(authz.RULES) == set(), "RPCs no rule names: add them to authz.RULES"
    assert set(authz.RULES) - methods == set(), "rules for RPCs the protos do not have"


def test_graders_are_allowed_nothing_unscoped() -> None:
    graded = {m for m, who in authz.RULES.items() if authz.GRADER in who}
    assert graded == set(authz.SCOPED)


def test_the_table_is_what_the_generator_writes() -> None:
    text = DOC.read_text()
    assert authz_table.replace(text) == text, \
        "run: python -m harnessrl.authz_table --write docs/security.md"


def test_the_identities_are_those_pki_issues() -> None:
    text = DOC.read_text()
    rows = _table(text[text.index("| identity | held by"):])[2:]
    assert [r[0].strip("`") for r in rows] == list(pki.ALL_IDENTITIES)
    assert set(authz_table.COLUMNS) | {"store", "admin"} == set(pki.ALL_IDENTITIES)


def test_the_cert_manager_manifests_match_pki(tmp_path: Path) -> None:
    block = re.search(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    assert block is not None
    docs = [d for d in yaml.safe_load_all(block.group(1)) if d]
    issuers = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Issuer"}
    certs = [d for d in docs if d["kind"] == "Certificate"]
    ca = next(c for c in certs if c["spec"].get("isCA"))
    assert issuers[ca["spec"]["issuerRef"]["name"]]["spec"] == {"selfSigned": {}}
    ca_issuer = next(i for i in issuers.values() if "ca" in i["spec"])
    assert ca_issuer["spec"]["ca"]["secretName"] == ca["spec"]["secretName"]
    # The Secret names and keys python -m harnessrl.pki kube-secrets writes.
    p = pki.Pki(tmp_path)
    p.ensure(("store",))
    secret = yaml.safe_load_all(pki.kube_secrets(tmp_path, ("store",), "harnessrl"))
    made = next(s for s in secret if s)
    (leaf,) = [c for c in certs if c is not ca]
    spec = leaf["spec"]
    name = spec["commonName"]
    assert name in pki.DEPLOYMENT_IDENTITIES
    assert spec["secretName"] == made["metadata"]["name"] == f"harnessrl-tls-{name}"
    assert leaf["metadata"]["namespace"] == made["metadata"]["namespace"]
    assert spec["dnsNames"] == [pki.server_name(name)]
    assert set(spec["usages"]) == {"server auth", "client auth"}
    assert spec["subject"]["organizations"] == ["harnessrl"]
    assert spec["privateKey"]["algorithm"] == "ECDSA"
    assert spec["issuerRef"]["name"] == ca_issuer["metadata"]["name"]
    assert set(made["data"]) == {"ca.crt", "tls.crt", "tls.key"}  # cert-manager's keys too
