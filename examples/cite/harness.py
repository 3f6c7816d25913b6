"""A document-question agent: answers one question from a small document set, citing the
document it used as [dN]. The reward comes from a judge alone (no test can check free text):
`harnessrl up --judge --judge-config examples/cite/judge.json` (docs/judge.md;
docs/getting-started.md, "Judge rewards and group graders").

Like the calc harness it knows nothing about harnessrl: the official `openai` SDK, configured by
`OPENAI_BASE_URL`, `OPENAI_API_KEY`, `HARNESSRL_MODEL` and `HARNESSRL_TASK_JSON`. One call;
writes `answer.txt`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from openai import OpenAI

DOCS = json.loads((Path(__file__).with_name("docs.json")).read_text())
SYSTEM = ("Answer the question from these documents only, in one sentence, and cite the "
          "document you used as [dN].\n" + "\n".join(f"[{k}] {v}" for k, v in DOCS.items()))


def main() -> int:
    task = json.loads(os.environ["HARNESSRL_TASK_JSON"])
    client = OpenAI()
    resp = client.chat.completions.create(
        model=os.environ.get("HARNESSRL_MODEL", "tiny"), max_tokens=48, temperature=1.0,
        messages=[{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": task["question"]}])
    answer = resp.choices[0].message.content or ""
    Path("answer.txt").write_text(answer)
    print(answer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
