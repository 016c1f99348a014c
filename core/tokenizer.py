"""Tokenizer helpers: a tiny deterministic byte-level BPE for tests and the `tiny` preset, the
DeepSeek-style chat template, and atomic writing / loading of Hugging Face tokenizer files.

The tiny tokenizer is trained with the `tokenizers` library on `TINY_CORPUS` (a few KB of
English held in this module), so building it needs no download and gives the same
`tokenizer.json` on every call and in every process. Its 512 ids are laid out as:

* 0..8: the special tokens of `SPECIAL_TOKENS` (bos, eos, pad = `engram_pad_token_id` 2,
  DSpark noise 3 = tiny `dspark_noise_token_id`, image 4 = tiny `image_token_id`, `<think>`,
  `</think>`, `<｜User｜>`, `<｜Assistant｜>`);
* then the 256 byte-level alphabet symbols and the BPE merges;
* if training ever yields fewer than 512 ids, reserved special tokens `<｜reserved_k｜>` fill
  the rest (they are special, so they never match inside ordinary text).

No post-processor adds bos automatically: the chat template writes `bos_token` itself, and
raw `encode()` returns exactly the text's tokens.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TINY_VOCAB_SIZE = 512

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
NOISE_TOKEN = "<｜dspark_noise｜>"
IMAGE_TOKEN = "<｜image｜>"
THINK_START = "<think>"
THINK_END = "</think>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"

# Fixed ids 0..8 (index = id).
SPECIAL_TOKENS: list[str] = [
    BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, NOISE_TOKEN, IMAGE_TOKEN,
    THINK_START, THINK_END, USER_TOKEN, ASSISTANT_TOKEN,
]

DEFAULT_MODEL_MAX_LENGTH = 1048576

# Tool calls in DeepSeek-V4.1's DSML form (what vLLM's `deepseek_v41` tool-call parser reads).
DSML = "｜DSML｜"
TOOL_CALLS_OPEN, TOOL_CALLS_CLOSE = f"<{DSML} calls>", f"</{DSML} calls>"
INVOKE_OPEN, INVOKE_CLOSE = f"<{DSML} invoke name=", f"</{DSML} invoke>"
PARAM_OPEN, PARAM_CLOSE = f"<{DSML} parameter name=", f"</{DSML} parameter>"
TOOL_RESULT_OPEN, TOOL_RESULT_CLOSE = "<tool_result>", "</tool_result>"

# The system prompt's tool section (our wording of the released layout: a "## Tools" heading,
# how to write a call, then one JSON schema per line).
TOOLS_PROMPT_HEAD = f"""## Tools

You can call the tools below. To call one or more, write one block like this:

{TOOL_CALLS_OPEN}
{INVOKE_OPEN}"TOOL_NAME">
{PARAM_OPEN}"PARAMETER_NAME" string="true|false">VALUE{PARAM_CLOSE}
{INVOKE_CLOSE}
{TOOL_CALLS_CLOSE}

Write string values as they are, with string="true"; write numbers, booleans, arrays and objects as JSON, with string="false". In thinking mode, reason inside {THINK_START}...{THINK_END} before any call or answer; otherwise call or answer right after {THINK_END}.

### Tool schemas
"""
TOOLS_PROMPT_TAIL = "\n\nCall tools only by the names and with the parameters these schemas define."


def _jinja_str(text: str) -> str:
    """`text` as a Jinja string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


# DeepSeek-style chat template. Layout:
#   bos + (all system messages, concatenated) [+ reasoning effort] [+ the tool section] + for each turn:
#     user:      <｜User｜>{content}
#     assistant: <｜Assistant｜>{content}[\n\n<DSML calls block>]<｜end▁of▁sentence｜>
#     tool:      <｜User｜><tool_result>{content}</tool_result> (results that follow one another,
#                and a user message right after them, share one user turn, joined by a blank line)
#   + <｜Assistant｜> when add_generation_prompt.
# `tools` (OpenAI format; each one's "function" object, as JSON, one per line) adds the tool
# section to the system prompt. An assistant message's `tool_calls` render as one DSML calls
# block, each argument as a parameter: strings as they are (string="true"), other values as JSON
# (string="false"); `arguments` arrive as an object (vLLM parses the OpenAI JSON string), a
# string is passed as one "arguments" parameter.
# An optional `reasoning_effort` (an integer 1..100, else the template raises) adds the line
# `Reasoning Effort: {b}` to the system prompt (MODEL.md section 3).
# An optional `thinking` variable (when defined) appends `<think>` (true) or `</think>`
# (false) after the generation prompt, as the V3.1+ templates do for thinking / chat mode.
CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}"
    "{{ content }}"
    "{%- elif content is not none -%}"
    "{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') -%}{{ '<｜image｜>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{{ bos_token }}"
    "{%- set ns = namespace(system='', prev='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- if message['content'] is string -%}"
    "{%- set ns.system = ns.system + message['content'] -%}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{%- set ns.system = ns.system + part['text'] -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if reasoning_effort is defined and reasoning_effort is not none -%}"
    "{%- if reasoning_effort is not integer or reasoning_effort < 1 or reasoning_effort > 100 -%}"
    "{{ raise_exception('reasoning_effort must be an integer from 1 to 100, got ' ~ reasoning_effort) }}"
    "{%- endif -%}"
    "{%- set ns.system = ns.system + ('\\n' if ns.system else '') + 'Reasoning Effort: ' ~ reasoning_effort -%}"
    "{%- endif -%}"
    "{{ ns.system }}"
    # (printed, not concatenated: `tojson` gives markup, which would escape what it joins)
    "{%- if tools is defined and tools -%}"
    "{{ ('\\n\\n' if ns.system else '') + " + _jinja_str(TOOLS_PROMPT_HEAD) + " }}"
    "{%- for tool in tools -%}"
    "{{ '\\n' if not loop.first else '' }}{{ (tool['function'] if tool['function'] is defined else tool) | tojson }}"
    "{%- endfor -%}"
    "{{ " + _jinja_str(TOOLS_PROMPT_TAIL) + " }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{ '\\n\\n' if ns.prev == 'tool' else '<｜User｜>' }}"
    "{{ " + _jinja_str(TOOL_RESULT_OPEN) + " }}{{ render_content(message['content']) }}{{ " + _jinja_str(TOOL_RESULT_CLOSE) + " }}"
    "{%- set ns.prev = 'tool' -%}"
    "{%- elif message['role'] in ('user', 'assistant') -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{ '\\n\\n' if ns.prev == 'tool' else '<｜User｜>' }}"
    "{%- else -%}"
    "{{ '<｜Assistant｜>' }}"
    "{%- endif -%}"
    "{{ render_content(message['content']) }}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{{ '\\n\\n' + " + _jinja_str(TOOL_CALLS_OPEN) + " }}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{{ '\\n' + " + _jinja_str(INVOKE_OPEN) + " + '\"' + fn['name'] + '\">' }}"
    "{%- if fn['arguments'] is mapping -%}"
    "{%- for key, value in fn['arguments'].items() -%}"
    "{{ '\\n' + " + _jinja_str(PARAM_OPEN) + " + '\"' + key + '\" string=\"' }}"
    "{%- if value is string -%}{{ 'true\">' + value }}{%- else -%}{{ 'false\">' }}{{ value | tojson }}{%- endif -%}"
    "{{ " + _jinja_str(PARAM_CLOSE) + " }}"
    "{%- endfor -%}"
    "{%- elif fn['arguments'] is string -%}"
    "{{ '\\n' + " + _jinja_str(PARAM_OPEN) + " + '\"arguments\" string=\"true\">' + fn['arguments'] + "
    + _jinja_str(PARAM_CLOSE) + " }}"
    "{%- endif -%}"
    "{%- if not fn['arguments'] -%}{{ '\\n' }}{%- endif -%}"  # (no parameters: an empty line, as released)
    "{{ '\\n' + " + _jinja_str(INVOKE_CLOSE) + " }}"
    "{%- endfor -%}"
    "{{ '\\n' + " + _jinja_str(TOOL_CALLS_CLOSE) + " }}"
    "{%- endif -%}"
    "{{ eos_token if message['role'] == 'assistant' else '' }}"
    "{%- set ns.prev = message['role'] -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<｜Assistant｜>' }}"
    "{%- if thinking is defined -%}"
    "{{ '<think>' if thinking else '</think>' }}"
    "{%- endif -%}"
    "{%- endif -%}"
)

# `content` is a string or a list of OpenAI-style parts ({"type": "text", "text"} and
# {"type": "image"} / {"type": "image_url"}, rendered as one image token each, in place), so vLLM
# keeps images where they are in a message (its "openai" content format) and the prompt equals
# `dsv41 run --messages`'s.

# A few KB of varied English: prose, dialogue, numbers, code-ish lines, punctuation.
TINY_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time, in a small village by the sea, there lived an old fisherman and his wife.
Every morning he rowed his little boat out past the rocks, and every evening he came home tired.
"What did you catch today?" she asked. "Nothing but the wind," he said, and they both laughed.
Science is a way of thinking much more than it is a body of knowledge.
The mitochondria is the powerhouse of the cell; chloroplasts turn sunlight into sugar.
Water boils at 100 degrees Celsius at sea level, and freezes at 0 degrees.
In 1969, two astronauts walked on the Moon while a third orbited above them.
The train leaves at 7:45 in the morning and arrives at 12:30 in the afternoon.
Please remember to bring your passport, your ticket, and a warm jacket for the evening.
def add(a, b):
    return a + b

for i in range(10):
    print(i * i)

if x > 0 and y < 5:
    result = {"key": "value", "count": 42}
Mathematics: 2 + 2 = 4, 3 * 7 = 21, 10 / 4 = 2.5, and the square root of 81 is 9.
The recipe calls for two cups of flour, one egg, half a cup of milk, and a pinch of salt.
Mix the dry ingredients first, then slowly add the wet ones while stirring gently.
Bake for twenty-five minutes, or until the top is golden brown and smells wonderful.
User: Can you explain how a neural network learns?
Assistant: A neural network learns by adjusting its weights to reduce the error on examples.
Each layer transforms its input, and gradients flow backwards to tell every weight how to change.
User: What is the capital of France?
Assistant: The capital of France is Paris, a city famous for its museums, cafes and bridges.
The weather today is cloudy with a chance of rain in the north and sunshine in the south.
Stock markets rose slightly on Monday as investors waited for news about interest rates.
She opened the window, and the cool air carried the smell of pine trees and wet earth.
Children were playing in the park, chasing a red ball across the green grass.
The library closes at nine o'clock; books must be returned within three weeks.
Why do birds sing in the morning? Some say they are marking territory, others say they are happy.
It was the best of times, it was the worst of times, it was the age of wisdom.
All happy families are alike; each unhappy family is unhappy in its own way.
To be, or not to be, that is the question: whether it is nobler in the mind to suffer.
The history of computing stretches from the abacus to the smartphone in your pocket.
Early computers filled entire rooms, used vacuum tubes, and could add only a few thousand numbers a second.
Today a small chip can perform billions of operations every second while using very little power.
Good software is written for people to read, and only incidentally for machines to execute.
Errors should never pass silently, unless explicitly silenced.
Simple is better than complex, and complex is better than complicated.
He said: "I'll be there at noon, don't worry!" She replied: "You're always late..."
Numbers like 3.14159, 2.71828 and 1.41421 appear again and again in nature and in mathematics.
Email: someone@example.com, website: https://www.example.org/path?query=1&lang=en
The mountains were covered in snow, and the river below ran fast and cold through the valley.
A farmer planted wheat, corn and potatoes, hoping for a good harvest before the winter.
Music has the power to bring people together, to heal, and to remind us of who we are.
The meeting was moved to Thursday because several members of the team were travelling.
Reading every day improves vocabulary, concentration, and the ability to think clearly.
Technology changes quickly, but curiosity, patience and kindness never go out of style.
Questions? Answers! Lists: apples, oranges, bananas; colours: red, green, blue, yellow.
THE END OF THE STORY IS NOT THE END OF THE BOOK. Turn the page and read the notes.
"""


def build_tiny_tokenizer() -> Tokenizer:
    """The tiny byte-level BPE: exactly `TINY_VOCAB_SIZE` (512) ids, specials at ids 0..8.

    Deterministic: the corpus, trainer settings and the `tokenizers` trainer's tie-breaking
    (by count, then by pair ids, which follow the sorted byte alphabet) are all fixed, so every
    call gives the same `to_str()`. The ByteLevel pre-tokenizer (no prefix space) and decoder
    make `decode(encode(text))` return `text` exactly for any string.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        min_frequency=0,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TINY_CORPUS.splitlines(keepends=True), trainer=trainer)
    n = tok.get_vocab_size(with_added_tokens=True)
    if n < TINY_VOCAB_SIZE:
        tok.add_special_tokens([f"<｜reserved_{k}｜>" for k in range(TINY_VOCAB_SIZE - n)])
    n = tok.get_vocab_size(with_added_tokens=True)
    if n != TINY_VOCAB_SIZE:  # pragma: no cover - the trainer never exceeds vocab_size
        raise RuntimeError(f"tiny tokenizer has {n} ids, expected {TINY_VOCAB_SIZE}")
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:  # pragma: no cover - trainer puts specials first
            raise RuntimeError(f"special token {t!r} got id {tok.token_to_id(t)}, expected {i}")
    return tok


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to a temp file in the same directory, fsync, then rename over `path`. The
    file is created by `open` (mode 0666 less the umask, like any written file; `mkstemp` would
    make it 0600, unreadable to a serving user other than the writer)."""
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_tokenizer_files(
    tokenizer: Tokenizer,
    out_dir: str | os.PathLike,
    *,
    model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
    chat_template: str = CHAT_TEMPLATE,
) -> tuple[Path, Path]:
    """Write `tokenizer.json` and `tokenizer_config.json` into `out_dir` (created if needed).

    Each file goes to a temp name in `out_dir` and is then renamed, so a reader never sees a
    half-written file. `tokenizer_config.json` names the bos / eos / pad tokens, the chat
    template, `model_max_length` and `tokenizer_class` "PreTrainedTokenizerFast" (no automatic
    bos / eos: the chat template adds bos). Returns the two paths.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_path = out / "tokenizer.json"
    cfg_path = out / "tokenizer_config.json"
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(model_max_length),
        "chat_template": chat_template,
    }
    atomic_write_text(tok_path, tokenizer.to_str(pretty=True))
    atomic_write_text(cfg_path, json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return tok_path, cfg_path


def load_tokenizer(path_or_dir: str | os.PathLike) -> Tokenizer:
    """Load a `tokenizers.Tokenizer` from a `tokenizer.json` file or a directory holding one.

    Raises ValueError naming the path when there is no such file (or it does not parse).
    """
    p = Path(path_or_dir)
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        if p.is_dir():
            raise ValueError(f"{p}: directory has no tokenizer.json (file not found: {f})")
        raise ValueError(f"{p}: no such tokenizer file or directory (file not found)")
    try:
        return Tokenizer.from_file(str(f))
    except Exception as e:  # the Rust side raises a bare Exception on malformed JSON
        raise ValueError(f"{f}: cannot load tokenizer ({e})") from None
