// One image through the gateway with the official SDKs in Node: the `openai` package (chat
// completions with an `image_url` data URL, then Responses with an `input_image`) and the
// `@anthropic-ai/sdk` package (Messages with a base64 `image` block). Both are pinned in
// package.json and package-lock.json. It prints what the gateway answered, as one JSON object on
// stdout; an API error exits non-zero.
//
// Run: node /abs/path/examples/node_sdk/images.mjs IMAGE  (a PNG, JPEG, GIF or WebP file)
//
// Configured by the environment, as a harness under the controller is:
// - OPENAI_BASE_URL, OPENAI_API_KEY: read by the openai client itself (the gateway's
//   `http://host:port/v1` and this rollout attempt's credential);
// - ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY: the Anthropic client's, when both are set; else
//   OPENAI_BASE_URL without its `/v1` (the SDK adds `/v1/messages`) and OPENAI_API_KEY (sent
//   as `x-api-key`, which the gateway takes as it takes `Authorization: Bearer`);
// - HARNESSRL_MODEL: the model name.

import { createHash } from "node:crypto";
import { readFileSync } from "node:fs";
import { extname } from "node:path";
import Anthropic from "@anthropic-ai/sdk";
import OpenAI from "openai";

const MAX_TOKENS = 16;
const TYPES = { ".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg",
                ".gif": "image/gif", ".webp": "image/webp" };

const path = process.argv[2];
if (!path) {
  console.error("usage: node images.mjs IMAGE");
  process.exit(2);
}
const mediaType = TYPES[extname(path).toLowerCase()] ?? "image/png";
const bytes = readFileSync(path);
const data = bytes.toString("base64");
const dataUrl = `data:${mediaType};base64,${data}`;
const model = process.env.HARNESSRL_MODEL;
const question = "What colour is this image?";

const openai = new OpenAI({ maxRetries: 0, timeout: 30_000 });
// The Anthropic key is used only with the Anthropic base URL: a shell's real key must not go
// to the gateway of OPENAI_BASE_URL.
const ownAnthropic = Boolean(process.env.ANTHROPIC_BASE_URL && process.env.ANTHROPIC_API_KEY);
const anthropic = new Anthropic({
  baseURL: ownAnthropic ? process.env.ANTHROPIC_BASE_URL : openai.baseURL.replace(/\/v1\/?$/, ""),
  apiKey: ownAnthropic ? process.env.ANTHROPIC_API_KEY : openai.apiKey,
  maxRetries: 0,
  timeout: 30_000,
});

const chat = await openai.chat.completions.create({
  model,
  max_tokens: MAX_TOKENS,
  messages: [{ role: "user", content: [
    { type: "text", text: question },
    { type: "image_url", image_url: { url: dataUrl } },
  ] }],
});

const response = await openai.responses.create({
  model,
  max_output_tokens: MAX_TOKENS,
  input: [{ role: "user", content: [
    { type: "input_text", text: question },
    { type: "input_image", image_url: dataUrl, detail: "auto" },
  ] }],
});

const message = await anthropic.messages.create({
  model,
  max_tokens: MAX_TOKENS,
  messages: [{ role: "user", content: [
    { type: "image", source: { type: "base64", media_type: mediaType, data } },
    { type: "text", text: question },
  ] }],
});

console.log(JSON.stringify({
  image: { sha256: createHash("sha256").update(bytes).digest("hex"), media_type: mediaType,
           size_bytes: bytes.length },
  chat: { id: chat.id, content: chat.choices[0].message.content,
          finish_reason: chat.choices[0].finish_reason },
  responses: { id: response.id, output_text: response.output_text, status: response.status },
  messages: { id: message.id, text: message.content.filter((b) => b.type === "text")
    .map((b) => b.text).join(""), stop_reason: message.stop_reason },
}));
