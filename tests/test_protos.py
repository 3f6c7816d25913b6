"""The generated gRPC code is never edited by hand: regenerate it and compare."""

from pathlib import Path

from harnessrl import protogen


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    fresh = protogen.generate(tmp_path)
    assert fresh, "protoc generated nothing"
    committed_dir = protogen.REPO / "harnessrl" / "v1"
    names = {p.name for p in fresh}
    committed = {p.name for p in committed_dir.glob("*_pb2*")}
    assert names == committed, f"generated {sorted(names)} but committed {sorted(committed)}"
    for p in fresh:
        assert p.read_text() == (committed_dir / p.name).read_text(), (
            f"{p.name} differs from protos/: run `python -m harnessrl.protogen` and commit"
        )
