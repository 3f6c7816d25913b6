"""Images through the gateway from Node (issue #45: "the OpenAI and Anthropic SDKs, in Python
and in Node"): examples/node_sdk/images.mjs sends one PNG with the official `openai` npm
package (chat completions `image_url`, Responses `input_image`) and `@anthropic-ai/sdk`
(Messages `image` block, base64), run by node as a subprocess against a real store, a real
gateway and the stub engine (tests/test_gateway_images.py's `ImageWorld`).

Read from outside: each call answered with the stub's text; recorded in the store with the
image's sha256, media type and size, the processor settings and a request body that holds
`sha256:<hex>` instead of the data; the image store holds the exact bytes sent (GetImages).

Needs node and the example's `node_modules` (scripts/setup.sh). Without node the test skips,
except with CI=true, where it fails (tests/test_node_sdk.py's `node_command`).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from harnessrl.v1 import common_pb2 as c
from test_gateway import SIGNER
from test_gateway_images import ImageWorld, b64, check_recorded, png, sha, world
from test_node_sdk import EXAMPLE, node_command

__all__ = ["world"]  # the module-scoped ImageWorld fixture, imported for this module's test

SCRIPT = EXAMPLE / "images.mjs"
STUB_TEXT = "Hello, world!"  # the stub engine's reply
IMAGE = png("#7f3fbf", 20)


@pytest.fixture(scope="module")
def node() -> str:
    """node (skips without it, except under CI=true), with the example's packages as locked:
    `openai` checked by `node_command`, `@anthropic-ai/sdk` here."""
    command = node_command()
    name = "@anthropic-ai/sdk"
    locked = json.loads((EXAMPLE / "package-lock.json").read_text())[
        "packages"][f"node_modules/{name}"]["version"]
    installed = EXAMPLE / "node_modules" / name / "package.json"
    have = json.loads(installed.read_text())["version"] if installed.exists() else None
    if have != locked:
        pytest.fail(f"examples/node_sdk/node_modules has {name} {have}, the lock {locked}: "
                    "run scripts/setup.sh (npm ci --omit=dev in examples/node_sdk)")
    return command


def run_script(node: str, world: ImageWorld, key: str, image: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OPENAI_", "ANTHROPIC_"))}
    env.update(OPENAI_BASE_URL=world.gateway.base_url, OPENAI_API_KEY=key,
               HARNESSRL_MODEL="tiny")
    out = subprocess.run([node, str(SCRIPT), str(image)], env=env, capture_output=True,
                         text=True, timeout=90, cwd=image.parent)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return result


def test_node_openai_and_anthropic_sdks_send_an_image_recorded_and_answered(
        node: str, world: ImageWorld, tmp_path: Path) -> None:
    image = tmp_path / "shape.png"
    image.write_bytes(IMAGE)
    rid = world.rollout()
    got = run_script(node, world, SIGNER.mint(rid, 1, 120), image)
    digest = sha(IMAGE)
    assert got["image"] == {"sha256": digest, "media_type": "image/png",
                            "size_bytes": len(IMAGE)}
    # answered: each SDK parsed the stub's reply
    assert (got["chat"]["content"], got["chat"]["finish_reason"]) == (STUB_TEXT, "stop")
    assert (got["responses"]["output_text"], got["responses"]["status"]) == (STUB_TEXT,
                                                                              "completed")
    assert (got["messages"]["text"], got["messages"]["stop_reason"]) == (STUB_TEXT, "end_turn")

    # recorded: three calls of the rollout, one per API, in the order sent
    calls = world.calls(rid)
    assert [call.api for call in calls] == ["chat.completions", "responses", "messages"]
    for call in calls:
        assert not call.aborted and call.completion_text == STUB_TEXT
        check_recorded(world, call, [IMAGE])  # hash, size, settings, segment, stored bytes
        assert [(i.sha256, i.media_type, i.size_bytes) for i in call.images] == [
            (digest, "image/png", len(IMAGE))]
        assert call.segment_start == c.SEGMENT_START_MEDIA
        assert b64(IMAGE) not in call.request_json.decode()
    [got_image] = world.store.get_images([digest]).images
    assert (got_image.found, got_image.data, got_image.media_type) == (True, IMAGE, "image/png")

    # the recorded bodies name the image by its hash where the SDK put its data
    ref = "sha256:" + digest
    chat, responses, messages = (json.loads(call.request_json) for call in calls)
    assert chat["messages"][0]["content"][1] == {"type": "image_url", "image_url": {"url": ref}}
    assert responses["input"][0]["content"][1] == {"type": "input_image", "image_url": ref,
                                                   "detail": "auto"}
    assert messages["messages"][0]["content"][0] == {
        "type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ref}}
