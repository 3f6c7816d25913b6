"""The tiny model's tokenizer: a byte-level BPE trained with `tokenizers` on text the project
generates, saved as a transformers `PreTrainedTokenizerFast` with a Qwen-style chat template.

- Pre-tokenization follows Qwen2/GPT-4: letters with one leading non-letter, punctuation runs,
  newlines; numbers are cut into chunks of at most three digits, and the corpus holds every
  number 0..999 so that each of them is one token (copying a number is copying one token).
- Special tokens: `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (EOS). `<tool_call>`,
  `</tool_call>`, `<tool_response>`, `</tool_response>` are added tokens that are not special
  (as in Qwen2.5): they survive `skip_special_tokens`, so vLLM's hermes tool parser sees them.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen-style ChatML. Tools are listed in the system turn, one JSON object a line; an assistant
# tool call is `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (hermes format);
# a tool result is a `tool` turn wrapped in <tool_response>. The text an assistant turn renders
# to is exactly what the model generates for it, so a later prompt extends an earlier
# prompt + completion token for token.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system{{ '\\n' }}"
    "{% if messages and messages[0].role == 'system' %}{{ messages[0].content + '\\n' }}{% endif %}"
    "# Tools{{ '\\n' }}<tools>{{ '\\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    "</tools>{{ '\\n' }}"
    "Call a tool as <tool_call>{{ '\\n' }}"
    "{\"name\": <name>, \"arguments\": <args>}{{ '\\n' }}</tool_call>"
    "<|im_end|>{{ '\\n' }}"
    "{% elif messages and messages[0].role == 'system' %}"
    "<|im_start|>system{{ '\\n' + messages[0].content }}<|im_end|>{{ '\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% if not loop.first %}"
    "<|im_start|>system{{ '\\n' + message.content }}<|im_end|>{{ '\\n' }}"
    "{% endif %}"
    "{% elif message.role == 'user' %}"
    "<|im_start|>user{{ '\\n' + message.content }}<|im_end|>{{ '\\n' }}"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant{{ '\\n' + (message.content or '') }}"
    "{% for tc in message.tool_calls or [] %}"
    "{% if tc.function is defined %}{% set tc = tc.function %}{% endif %}"
    "{% if message.content or not loop.first %}{{ '\\n' }}{% endif %}"
    "<tool_call>{{ '\\n' }}{\"name\": \"{{ tc.name }}\", \"arguments\": "
    "{% if tc.arguments is string %}{{ tc.arguments }}{% else %}{{ tc.arguments | tojson }}"
    "{% endif %}}{{ '\\n' }}</tool_call>"
    "{% endfor %}"
    "<|im_end|>{{ '\\n' }}"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>tool{{ '\\n' }}<tool_response>{{ '\\n' + message.content + '\\n' }}"
    "</tool_response><|im_end|>{{ '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)


def numbers_corpus(repeat: int = 4) -> list[str]:
    """Every number 0..999, so that each becomes a single token."""
    return [" ".join(str(n) for n in range(1000))] * repeat


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 2048,
                    model_max_length: int = 32768) -> PreTrainedTokenizerFast:
    """Trains the byte-level BPE on `corpus` (plus the numbers 0..999) and wraps it."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator([*corpus, *numbers_corpus()], trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT, bos_token=None,
        unk_token=None, model_max_length=model_max_length, clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    missing = [n for n in range(1000) if len(fast.encode(str(n))) != 1]
    if missing:
        raise RuntimeError(f"tokenizer: {len(missing)} numbers in 0..999 are not single tokens "
                           f"(e.g. {missing[:5]}); raise vocab_size")
    return fast
