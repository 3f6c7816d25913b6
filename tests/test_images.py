"""scripts/images.py's input hash, without a daemon: what an image copies decides it, what
.dockerignore leaves out of the context does not, and every compose image is in its list."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent


def load(name: str) -> ModuleType:
    """scripts/images.py as a module of its own (it is a script, not a package module)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / "images.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def images(tmp_path: Path) -> ModuleType:
    """scripts/images.py on a copy of the files the store image takes (so a test can change
    them)."""
    mod = load(f"images_under_test_{tmp_path.name}")
    for rel in ("services", "harnessrl", "locks", "deploy", "examples/calc"):
        shutil.copytree(REPO / rel, tmp_path / rel,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for rel in ("pyproject.toml", "README.md", ".dockerignore"):
        shutil.copy(REPO / rel, tmp_path / rel)
    mod.REPO = tmp_path
    return mod


def store_hash(mod: ModuleType) -> str:
    img = next(i for i in mod.images("cpu") if i.name == "store")
    return str(mod.inputs_hash(img, "python:3.11.14-slim-bookworm", "sha256:base"))


def test_a_copied_file_changes_the_hash_an_ignored_one_does_not(images: ModuleType) -> None:
    h0 = store_hash(images)
    assert store_hash(images) == h0  # deterministic
    root = images.REPO
    (root / "harnessrl" / "testing" / "new_double.py").write_text("x = 1\n")
    (root / "harnessrl" / "__pycache__").mkdir(exist_ok=True)
    (root / "harnessrl" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    assert store_hash(images) == h0, "a file .dockerignore leaves out changed the hash"
    (root / "examples" / "calc" / "tasks.jsonl").write_text("{}\n")  # not in the store image
    assert store_hash(images) == h0
    (root / "harnessrl" / "rpc.py").write_text((root / "harnessrl" / "rpc.py").read_text() + "#")
    h1 = store_hash(images)
    assert h1 != h0, "a copied file changed and the hash did not"
    (root / "locks" / "store.txt").write_text((root / "locks" / "store.txt").read_text() + "\n")
    assert store_hash(images) not in (h0, h1)
    img = next(i for i in images.images("cpu") if i.name == "store")
    assert images.inputs_hash(img, "python:3.11.14-slim-bookworm", "sha256:other") != \
        store_hash(images), "a new base image must rebuild"


def test_the_hash_follows_dockerignore(images: ModuleType) -> None:
    pats = images.dockerignore()
    assert images.ignored("harnessrl/testing/chaos.py", pats)
    assert images.ignored("services/store/__pycache__/a.pyc", pats)
    assert not images.ignored("harnessrl/rpc.py", pats)
    assert not images.ignored("services/store/Dockerfile", pats)


def test_every_compose_and_job_image_is_built() -> None:
    mod = load("images_list")
    tags = {i.tag for i in mod.images("cpu")} | {i.tag for i in mod.images("gpu")}
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    for name, svc in compose["services"].items():
        if "build" in svc:
            assert svc["image"] in tags, name
    job = yaml.safe_load((REPO / "examples" / "calc" / "k8s-job-template.yaml").read_text())
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] in tags
    assert compose["services"]["redis"]["image"] == "${REDIS_IMAGE:-%s}" % mod.REDIS_IMAGE
