// A harness in JavaScript on the official `openai` npm package (pinned in package.json and
// package-lock.json), trained by harnessrl as it is. It knows nothing about harnessrl; the
// environment configures it:
//
// - OPENAI_BASE_URL, OPENAI_API_KEY: read by the SDK's client itself (the controller sets them
//   to the gateway and this rollout attempt's credential);
// - HARNESSRL_MODEL: the model name;
// - HARNESSRL_TASK_JSON: the task, e.g. {"id": "add", "question": "What is 2 + 3?", "expected": "5"}.
//
// It asks the model the task's question once (chat completions) and writes the reply to
// answer.txt in its working directory, and what it received (id, content, finish reason,
// usage) to response.json. An empty reply still ends with exit code 0; an API error exits
// non-zero (the controller retries the attempt with a new credential).
//
// Run: node /abs/path/examples/node_sdk/harness.mjs  (after `npm ci --omit=dev` in this folder)

import { writeFileSync } from "node:fs";
import OpenAI from "openai";

const MAX_TOKENS = 32;
const TEMPERATURE = 1.0;

const task = JSON.parse(process.env.HARNESSRL_TASK_JSON);
const client = new OpenAI(); // OPENAI_BASE_URL and OPENAI_API_KEY from the environment

const reply = await client.chat.completions.create({
  model: process.env.HARNESSRL_MODEL,
  temperature: TEMPERATURE,
  max_tokens: MAX_TOKENS,
  messages: [{ role: "user", content: task.question }],
});
const choice = reply.choices[0];
const answer = choice.message.content ?? "";
writeFileSync("answer.txt", answer);
writeFileSync("response.json", JSON.stringify({
  id: reply.id, content: answer, finish_reason: choice.finish_reason, usage: reply.usage,
}) + "\n");
console.log(`${task.id ?? "task"}: ${JSON.stringify(answer)} (${choice.finish_reason})`);
