"""Builds every image docker-compose.yml uses (and the example harness image the Kubernetes Job
template names), each labelled with the hash of its inputs; an image whose inputs are
unchanged is reused, not rebuilt. Run through `scripts/images.sh`.

    bash scripts/images.sh                # bases pulled from the registry (the defaults)
    bash scripts/images.sh --offline      # no registry: Debian stand-ins for the bases
    bash scripts/images.sh --only gateway store --report images.json

With a registry, every Dockerfile's `ARG BASE` default (the pinned official image) is used.
`--offline` builds stand-ins instead, from Debian's packages only:
  - `harnessrl/debian-standin:bookworm`: `debootstrap --variant=minbase` imported as an image;
  - `harnessrl/python-standin:3.11-bookworm` (deploy/offline/python.Dockerfile): Debian's
    Python 3.11 with `python`, `pip` and `venv` where the official image has them;
  - `harnessrl/redis-standin:7-bookworm` (deploy/offline/redis.Dockerfile): Debian's Redis.
and passes them as `--build-arg BASE=...`. Python packages then come from a wheelhouse
(`~/.cache/harnessrl/wheelhouse`) that `pip download` fills on the host from the hashed locks,
served to the builds on 127.0.0.1 (`--network host`; pip in a build sees `PIP_NO_INDEX=1`
and `PIP_FIND_LINKS`), so pip needs no network inside a build and every wheel is still checked
against its lock's hash. Apt steps (the engine's) reach Debian's mirror over http.

Needs a Docker daemon: DOCKER_HOST, or `python -m harnessrl.testing.dockerd start`.
Stdlib only (it runs before any virtual environment exists).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import fnmatch
import functools
import hashlib
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LABEL = "dev.harnessrl.inputs"
VERSION = "0.1.0"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "harnessrl"
DEBIAN_MIRROR = os.environ.get("HARNESSRL_DEBIAN_MIRROR", "http://deb.debian.org/debian")
DEBIAN_STANDIN = "harnessrl/debian-standin:bookworm"
PYTHON_STANDIN = "harnessrl/python-standin:3.11-bookworm"
REDIS_IMAGE = "redis:7.4.2-bookworm"  # docker-compose.yml's default (REDIS_IMAGE)
REDIS_STANDIN = "harnessrl/redis-standin:7-bookworm"
WHEELHOUSE_PORT = int(os.environ.get("HARNESSRL_WHEELHOUSE_PORT", "47321"))
"""Where the builds' pip finds the wheelhouse. Fixed: the URL is a build argument, part of the
layer cache's key, so a new port would rebuild every image's dependency layer."""


@dataclasses.dataclass(frozen=True)
class Image:
    name: str
    dockerfile: str
    tag: str
    target: str | None = None
    args: tuple[tuple[str, str], ...] = ()
    locks: tuple[str, ...] = ()
    """locks/*.txt its pip steps install (the wheelhouse needs them offline)."""
    offline_base: str = PYTHON_STANDIN


def images(accel: str) -> list[Image]:
    """Every image docker-compose.yml's `accel` profile uses, plus the runtime controller
    (k8s/) and the example harness (the Job template's image)."""
    acc = (("ACCEL", accel),)
    return [
        Image("redis", "deploy/offline/redis.Dockerfile", REDIS_STANDIN,
              offline_base=DEBIAN_STANDIN),
        Image("store", "services/store/Dockerfile", f"harnessrl/store:{VERSION}",
              locks=("build", "store")),
        Image("gateway", "services/gateway/Dockerfile", f"harnessrl/gateway:{VERSION}",
              locks=("build", "gateway")),
        Image("controller", "services/controller/Dockerfile", f"harnessrl/controller:{VERSION}",
              target="runtime", locks=("build", "controller", "example")),
        Image("controller-example", "services/controller/Dockerfile",
              f"harnessrl/controller-example:{VERSION}", target="with-example",
              locks=("build", "controller", "example")),
        Image("example", "examples/calc/Dockerfile", f"harnessrl/example-harness:{VERSION}",
              locks=("example",)),
        Image("trainer", "services/trainer/Dockerfile", f"harnessrl/trainer:{VERSION}-{accel}",
              args=acc, locks=("build", f"trainer-{accel}")),
        Image("engine", "services/engine/Dockerfile", f"harnessrl/engine:{VERSION}-{accel}",
              args=acc, locks=("build", f"engine-{accel}")),
    ]


def docker(*args: str, check: bool = True, capture: bool = True) -> str:
    out = subprocess.run(["docker", *args], text=True, check=False,
                         stdout=subprocess.PIPE if capture else None,
                         stderr=subprocess.PIPE if capture else None)
    if check and out.returncode != 0:
        raise SystemExit(f"images: docker {' '.join(args[:3])} ... failed:\n{out.stderr}")
    return (out.stdout or "").strip()


def image_id(ref: str) -> str | None:
    out = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", ref],
                         capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def label_of(ref: str) -> str | None:
    out = subprocess.run(["docker", "image", "inspect", "--format",
                          f'{{{{index .Config.Labels "{LABEL}"}}}}', ref],
                         capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def base_default(dockerfile: Path) -> str:
    """The default of the Dockerfile's `ARG BASE=...` (its pinned official base)."""
    m = re.search(r"^ARG BASE=(\S+)", dockerfile.read_text(), re.M)
    if not m:
        raise SystemExit(f"images: {dockerfile} has no `ARG BASE=<image>`")
    return m[1]


def dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [x.strip().rstrip("/") for x in lines if x.strip() and not x.startswith("#")]


def ignored(rel: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps `rel` (a path in the context) out of the context: a
    pattern matches the path or a folder above it; `**/` matches at any depth."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pat in patterns:
        if pat.startswith("**/"):
            if any(fnmatch.fnmatch(part, pat[3:]) for part in parts):
                return True
        elif any(fnmatch.fnmatch(p, pat) for p in prefixes):
            return True
    return False


def copied_files(dockerfile: Path, args: dict[str, str]) -> list[Path]:
    """The files of the build context that the Dockerfile's COPY steps take (not
    `COPY --from`), folders expanded, what .dockerignore leaves out left out."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    files: set[Path] = set()
    patterns = dockerignore()
    for line in text.splitlines():
        words = line.split()
        if not words or words[0].upper() != "COPY" or any(w.startswith("--from") for w in words):
            continue
        srcs = [w for w in words[1:-1] if not w.startswith("--")]
        for src in srcs:
            src = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m[1], ""), src)
            path = REPO / src
            if not path.exists():
                raise SystemExit(f"images: {dockerfile} copies {src}, which is not there")
            for p in ([path] if path.is_file() else sorted(path.rglob("*"))):
                if p.is_file() and not ignored(str(p.relative_to(REPO)), patterns):
                    files.add(p)
    return sorted(files)


def inputs_hash(img: Image, base: str, base_id: str) -> str:
    """sha256 over what decides the image: its Dockerfile, target, build args, the base's
    image id and every file it copies (path and content)."""
    h = hashlib.sha256()
    dockerfile = REPO / img.dockerfile
    for part in (dockerfile.read_bytes(), str(img.target).encode(), repr(img.args).encode(),
                 base.encode(), base_id.encode()):
        h.update(hashlib.sha256(part).digest())
    for f in copied_files(dockerfile, dict(img.args)):
        h.update(str(f.relative_to(REPO)).encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def debian_standin() -> str:
    """`harnessrl/debian-standin:bookworm`: debootstrap minbase, imported (made once)."""
    if image_id(DEBIAN_STANDIN):
        return DEBIAN_STANDIN
    if shutil.which("debootstrap") is None:
        raise SystemExit("images: --offline needs debootstrap (scripts/setup.sh installs it)")
    with tempfile.TemporaryDirectory(prefix="hrl-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        print(f"images: debootstrap bookworm from {DEBIAN_MIRROR} (about a minute)", flush=True)
        subprocess.run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs),
                        DEBIAN_MIRROR], check=True, stdout=subprocess.DEVNULL)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["docker", "import", "--change", 'CMD ["bash"]', "-", DEBIAN_STANDIN],
                       stdin=tar.stdout, check=True, stdout=subprocess.DEVNULL)
        if tar.wait() != 0:
            raise SystemExit("images: tar of the debootstrap root failed")
    return DEBIAN_STANDIN


def fill_wheelhouse(locks: set[str]) -> Path:
    """Downloads every wheel the `locks` pin into the wheelhouse (hash-checked; present ones
    are kept)."""
    house = CACHE / "wheelhouse"
    house.mkdir(parents=True, exist_ok=True)
    for lock in sorted(locks):
        text = (REPO / "locks" / f"{lock}.txt").read_bytes()
        stamp = house / f".{lock}-{hashlib.sha256(text).hexdigest()[:16]}"
        if stamp.exists():  # this lock's wheels are there (pip would ask the index again)
            continue
        print(f"images: wheelhouse <- locks/{lock}.txt", flush=True)
        out = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                              "--require-hashes", "--only-binary", ":all:", "--retries", "1",
                              "-r", str(REPO / "locks" / f"{lock}.txt"), "-d", str(house)],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"images: pip download of locks/{lock}.txt failed:\n"
                             f"{out.stderr[-4000:]}")
        stamp.touch()
    return house


@contextlib.contextmanager
def serve(folder: Path) -> Iterator[str]:
    """An HTTP server for `folder` on 127.0.0.1 (a free port), for the builds' pip."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(folder))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEELHOUSE_PORT), handler)
    except OSError as exc:
        print(f"images: 127.0.0.1:{WHEELHOUSE_PORT} is taken ({exc}); the wheelhouse goes on "
              "another port, so dependency layers are rebuilt (HARNESSRL_WHEELHOUSE_PORT "
              "moves it)", file=sys.stderr)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()


def build(img: Image, base: str, digest: str, extra: list[str], log: Path) -> None:
    cmd = ["docker", "build", "-f", str(REPO / img.dockerfile), "-t", img.tag,
           "--label", f"{LABEL}={digest}", "--build-arg", f"BASE={base}", *extra]
    if img.target:
        cmd += ["--target", img.target]
    for key, val in img.args:
        cmd += ["--build-arg", f"{key}={val}"]
    with open(log, "w") as out:
        rc = subprocess.run([*cmd, str(REPO)], stdout=out, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise SystemExit(f"images: {img.name} failed to build (log {log}):\n{tail}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/images.sh", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--offline", action="store_true",
                   help="no registry: Debian stand-ins for the bases, wheels from a wheelhouse")
    p.add_argument("--accel", choices=("cpu", "gpu"), default="cpu",
                   help="which trainer and engine images (the compose profile's)")
    p.add_argument("--only", nargs="+", metavar="NAME",
                   help="build only these (names: the first column of the report)")
    p.add_argument("--report", type=Path, help="also write the report here (JSON)")
    ns = p.parse_args(argv)
    if subprocess.run(["docker", "version"], capture_output=True).returncode != 0:
        print("images: no Docker daemon answers (set DOCKER_HOST, or start one: "
              "python3 -m harnessrl.testing.dockerd start)", file=sys.stderr)
        return 1
    CACHE.mkdir(parents=True, exist_ok=True)
    one_at_a_time = open(CACHE / "images.lock", "w")  # held until exit; the next one reuses
    try:
        fcntl.flock(one_at_a_time, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("images: another scripts/images.sh is building; waiting for it", flush=True)
        fcntl.flock(one_at_a_time, fcntl.LOCK_EX)
    todo = images(ns.accel)
    if ns.only:
        unknown = set(ns.only) - {i.name for i in todo}
        if unknown:
            p.error(f"unknown image(s) {sorted(unknown)}; known: {[i.name for i in todo]}")
        todo = [i for i in todo if i.name in ns.only]
    logs = CACHE / "image-logs"
    logs.mkdir(parents=True, exist_ok=True)
    report = []
    before = {img.tag: image_id(img.tag) for img in todo}  # what a rebuild replaces
    with contextlib.ExitStack() as stack:
        extra: list[str] = []

        def offline_args() -> list[str]:
            """The wheelhouse, filled and served on the first build that needs it."""
            if not extra:
                house = fill_wheelhouse({lock for i in todo for lock in i.locks} | {"build"})
                url = stack.enter_context(serve(house))
                extra.extend(["--network", "host", "--build-arg", "PIP_NO_INDEX=1",
                              "--build-arg", f"PIP_FIND_LINKS={url}"])
            return extra

        if ns.offline:
            debian_standin()
            # The Python stand-in is an image like the others (hashed, reused).
            todo = [Image("python-standin", "deploy/offline/python.Dockerfile", PYTHON_STANDIN,
                          offline_base=DEBIAN_STANDIN), *todo]
        for img in todo:
            if img.name == "redis" and not ns.offline:
                if not image_id(REDIS_IMAGE):
                    docker("pull", REDIS_IMAGE, capture=False)
                report.append({"name": "redis", "tag": REDIS_IMAGE, "built": False,
                               "seconds": 0.0, "size_mb": size_mb(REDIS_IMAGE)})
                continue
            base = img.offline_base if ns.offline else base_default(REPO / img.dockerfile)
            base_id = image_id(base)
            if base_id is None:
                if ns.offline:
                    raise SystemExit(f"images: base {base} is missing")
                docker("pull", base, capture=False)
                base_id = image_id(base) or ""
            digest = inputs_hash(img, base, base_id)
            t0 = time.monotonic()
            built = label_of(img.tag) != digest
            if built:
                args = offline_args() if ns.offline else []
                print(f"images: building {img.name} -> {img.tag}", flush=True)
                t0 = time.monotonic()
                build(img, base, digest, args, logs / f"{img.name}.log")
            row = {"name": img.name, "tag": img.tag, "built": built,
                   "seconds": round(time.monotonic() - t0, 1), "size_mb": size_mb(img.tag),
                   "inputs": digest[:16]}
            report.append(row)
            print(f"images: {img.name:<18} {img.tag:<40} {row['size_mb']:>7.0f} MB  "
                  f"{'built in %.0f s' % row['seconds'] if built else 'reused (same inputs)'}",
                  flush=True)
    # The images these builds replaced, now untagged, or a machine that rebuilds (CI) fills
    # its disk (the trainer and engine are ~4 GB each): each removed by its id, with the layers
    # no other image uses. Not `docker image prune`: a multi-stage build's `build` stage ends
    # in an untagged leaf, so a prune of dangling images deleted that stage's layers too (the
    # dependency venv among them) and the next change to the source reinstalled every
    # dependency of the trainer and the engine (4-6 minutes each here, instead of seconds).
    replaced = [old for tag, old in before.items() if old and image_id(tag) != old]
    removed = [old for old in replaced if subprocess.run(
        ["docker", "rmi", old], capture_output=True).returncode == 0]
    if replaced:  # one still used by a container stays
        print(f"images: removed {len(removed)} of {len(replaced)} replaced images", flush=True)
    if ns.report:
        ns.report.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def size_mb(ref: str) -> float:
    return int(docker("image", "inspect", "--format", "{{.Size}}", ref)) / 1e6


if __name__ == "__main__":
    sys.exit(main())
