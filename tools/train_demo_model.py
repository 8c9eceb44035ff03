"""Train quire-demo, the small model that ships inside quire-core.

Data: only text that ships with CPython and may be redistributed under the PSF licence: the pydoc
documentation topics (``pydoc_data.topics``) and the docstrings of the standard library's modules,
classes and functions, plus chat examples built from them (a user asks what a standard-library module,
class or function does; the assistant answers with its documented summary), and tool-calling chats in the
hermes format (the assistant calls ``lookup``, ``signature`` or ``list_members``, reads the result and
answers from it). A fixed twentieth of the items (chosen by a hash of their names) is held out for
evaluation.

Everything is seeded and torch runs in deterministic mode: the same command on the same CPython and
torch versions writes the same checkpoint.

    python tools/train_demo_model.py            # about an hour on 2 CPU cores
    python tools/train_demo_model.py --steps 20 --out /tmp/demo-smoke   # a quick smoke run
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import platform
import random
import re
import sys
import sysconfig
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "packages/core/src/quire/core/demo_model"
HELDOUT_CHAT_FILE = ROOT / "tests/data/quire_demo_heldout_chat.json"
HELDOUT_TOOLS_FILE = ROOT / "tests/data/quire_demo_heldout_tools.json"
SEED = 0
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML. With ``tools`` the system turn lists them and says how to call one; assistant ``tool_calls`` are
# written in the hermes format and tool results come back in a user turn, in <tool_response> tags (Qwen's
# convention). Without tools every message renders exactly as plain ChatML.
CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] + '\n\n' }}
    {%- endif %}
    {{- 'You may call these functions:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + ((tool['function'] if tool['function'] is defined else tool) | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\nTo call one, reply with <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'system' and loop.first and tools %}
    {%- elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}
        {{- '<|im_start|>assistant' }}
        {%- if message['content'] %}
            {{- '\n' + message['content'] }}
        {%- endif %}
        {%- for call in message['tool_calls'] %}
            {%- set function = call['function'] if call['function'] is defined else call %}
            {%- set arguments = function['arguments'] if function['arguments'] is string else function['arguments'] | tojson %}
            {{- '\n<tool_call>\n{"name": ' + (function['name'] | tojson) + ', "arguments": ' + arguments + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message['role'] == 'tool' %}
        {%- if loop.first or loop.previtem['role'] != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem['role'] != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501 (the template's lines are as long as they read best)
SYSTEM_PROMPT = "You are a helpful assistant who knows the Python standard library."
DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "turtledemo", "__pycache__", "ensurepip",
                "lib2to3", "pydoc_data"}
FUNCTION_QUESTIONS = [
    "What does `{name}` do?",
    "What is {name} in Python used for?",
    "Explain {name} briefly.",
    "Can you tell me what the {kind} {name} does?",
]
MODULE_QUESTIONS = [
    "What is the {name} module for?",
    "What does the Python module {name} provide?",
    "Explain the {name} module briefly.",
]
SIGNATURE_QUESTIONS = [
    "What arguments does `{name}` take?",
    "What is the signature of {name}?",
    "How do I call {name}?",
    "Which parameters does {name} accept?",
]
MEMBERS_QUESTIONS = [
    "What is defined in the {name} module?",
    "List the functions and classes of {name}.",
    "Which names does the module {name} define?",
]
UNAIDED_QUESTIONS = [
    "Without using a tool, what does `{name}` do?",
    "From memory, what is {name} for?",
]
# The tools of the tool-calling chats (examples/tool_calling.py implements them on the real library).
TOOLS = [
    {"type": "function", "function": {
        "name": "lookup", "description": "The docstring summary of a module, class or function.",
        "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}},
    {"type": "function", "function": {
        "name": "signature", "description": "The call signature of a function.",
        "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}},
    {"type": "function", "function": {
        "name": "list_members", "description": "The public classes and functions of a module.",
        "parameters": {"type": "object", "properties": {"module": {"type": "string"}}, "required": ["module"]}}},
]
MAX_MEMBERS = 12
NUM_HELDOUT_TOOL_REQUESTS = 10  # per tool
MODEL_SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=32, max_position_embeddings=1024)


# -- data ------------------------------------------------------------------------------------------

class Entry(NamedTuple):
    """A documented standard-library module, class or function."""

    key: str  # "module:json", "def:json.dumps": what the held-out split hashes
    name: str  # the dotted name
    kind: str  # "module", "class" or "function"
    signature: str  # "(obj, *, skipkeys=False, ...)" for functions, "" otherwise
    docstring: str
    is_public: bool  # no part of the name starts with "_"
    members: tuple[str, ...] = ()  # a module's public top-level classes and functions, in source order

    @property
    def summary(self) -> str:
        return _summary(self.docstring)


def stdlib_entries() -> list[Entry]:
    """Every documented module, class, function and method of the standard library, in path order."""
    entries = []
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        relative = path.relative_to(stdlib)
        if set(relative.parts[:-1]) & SKIPPED_DIRS:
            continue
        module = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        public_module = not any(part.startswith("_") for part in module.split("."))
        docstring = ast.get_docstring(tree)
        if docstring:
            members = tuple(dict.fromkeys(node.name for node in tree.body if isinstance(node, DEFINITIONS)
                                          and not node.name.startswith("_")))
            entries.append(Entry(f"module:{module}", module, "module", "", docstring, public_module, members))
        for qualname, node in _documented_definitions(tree):
            full_name = f"{module}.{qualname}"
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            is_public = public_module and not any(part.startswith("_") for part in qualname.split("."))
            entries.append(Entry(f"def:{full_name}", full_name, kind, _signature(node), ast.get_docstring(node),
                                 is_public))
    return entries


def stdlib_items(entries: list[Entry] | None = None) -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
    """Return ``(documents, chats)``: documents are ``(key, text)``, chats ``(key, question, answer)``."""
    import pydoc_data.topics

    documents = [(f"topic:{name}", text.strip()) for name, text in sorted(pydoc_data.topics.topics.items())]
    chats = []
    for entry in stdlib_entries() if entries is None else entries:
        if entry.kind == "module":
            documents.append((entry.key, f"Module {entry.name}\n\n{entry.docstring}"))
        else:
            documents.append((entry.key, f"{entry.name}{entry.signature}\n\n{entry.docstring}"))
        if entry.is_public:
            chats += [(entry.key, question, direct_answer(entry)) for question in _questions(entry)]
    return documents, [c for c in chats if c[2].strip()]


def _questions(entry: Entry) -> list[str]:
    if entry.kind == "module":
        return [q.format(name=entry.name) for q in _pick(MODULE_QUESTIONS, entry.name, 2)]
    return [q.format(name=entry.name, kind=entry.kind) for q in _pick(FUNCTION_QUESTIONS, entry.name, 1)]


def direct_answer(entry: Entry) -> str:
    """The answer of a plain chat: the documented summary (after the signature, for a class or function)."""
    return entry.summary if entry.kind == "module" else f"`{entry.name}{entry.signature}`: {entry.summary}"


def _documented_definitions(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, DEFINITIONS) and ast.get_docstring(node):
            yield node.name, node
        if isinstance(node, ast.ClassDef):
            for child in node.body:
                if isinstance(child, DEFINITIONS) and ast.get_docstring(child):
                    yield f"{node.name}.{child.name}", child


def _signature(node) -> str:
    if isinstance(node, ast.ClassDef):
        return ""
    return f"({ast.unparse(node.args)})"


def _summary(docstring: str, limit: int = 320) -> str:
    paragraph = docstring.strip().split("\n\n")[0]
    text = re.sub(r"\s+", " ", paragraph).strip()
    if len(text) <= limit:
        return text
    cut = text.rfind(". ", 0, limit)
    return text[:cut + 1] if cut > 40 else text[:limit].rsplit(" ", 1)[0] + " ..."


def _stable_hash(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")


def _pick(options: list[str], key: str, count: int) -> list[str]:
    start = _stable_hash(key) % len(options)
    return [options[(start + i) % len(options)] for i in range(count)]


def is_held_out(key: str) -> bool:
    return _stable_hash("heldout:" + key) % 20 == 0


def render_messages(messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = False) -> str:
    """``messages`` rendered by CHAT_TEMPLATE exactly as ``tokenizer.apply_chat_template`` renders them."""
    from transformers.utils.chat_template_utils import render_jinja_template

    [text], _ = render_jinja_template([messages], tools=tools, chat_template=CHAT_TEMPLATE,
                                      add_generation_prompt=add_generation_prompt)
    return text


def render_chat(question: str, answer: str | None, with_system: bool) -> str:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}] if with_system else []
    messages.append({"role": "user", "content": question})
    if answer is None:
        return render_messages(messages, add_generation_prompt=True)
    return render_messages(messages + [{"role": "assistant", "content": answer}])


# -- tool-calling chats ----------------------------------------------------------------------------

class ToolChat(NamedTuple):
    """A conversation with tools offered: a request, and (for training) the call, its result and the answer."""

    key: str
    messages: list[dict]
    tools: list[dict]
    tool: str | None = None  # the function the request needs (None: answered without a tool)
    arguments: dict | None = None


def tool_result(entry: Entry, tool: str) -> str:
    """What examples/tool_calling.py's implementation of ``tool`` returns for ``entry``."""
    if tool == "lookup":
        return entry.summary
    if tool == "signature":
        return f"{entry.name}{entry.signature}"
    more = ", ..." if len(entry.members) > MAX_MEMBERS else ""
    return ", ".join(entry.members[:MAX_MEMBERS]) + more


def tool_answer(entry: Entry, tool: str, result: str) -> str:
    if tool == "lookup":
        return f"`{entry.name}`: {result}"
    if tool == "signature":
        return f"Call it as `{result}`."
    return f"The {entry.name} module defines {result}."


def needed_tool(entry: Entry) -> str | None:
    """The tool of the training chat about ``entry`` (None: no tool chat about it)."""
    bucket = _stable_hash("tool:" + entry.key) % 40
    if entry.kind == "module":
        if len(entry.members) >= 2 and bucket < 24:
            return "list_members"
        return "lookup" if bucket >= 32 else None
    if entry.kind == "function" and bucket < 5:
        return "signature"
    return "lookup" if 5 <= bucket < 11 else None


def tool_request(entry: Entry, tool: str, with_system: bool, tools: list[dict] = TOOLS) -> ToolChat:
    """A user's request about ``entry`` that needs ``tool``, with the tools offered."""
    questions = {"lookup": MODULE_QUESTIONS if entry.kind == "module" else FUNCTION_QUESTIONS,
                 "signature": SIGNATURE_QUESTIONS, "list_members": MEMBERS_QUESTIONS}[tool]
    [question] = _pick(questions, "tool:" + entry.name, 1)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}] if with_system else []
    messages.append({"role": "user", "content": question.format(name=entry.name, kind=entry.kind)})
    argument = "module" if tool == "list_members" else "name"
    return ToolChat(entry.key, messages, tools, tool, {argument: entry.name})


def training_tool_chats(entries: list[Entry]) -> list[ToolChat]:
    """Round trips (request, call, result, answer) over the training entries, and a few requests that say
    to answer without a tool. Each offers the tool it needs and, usually, the others, in a varying order."""
    chats = []
    for entry in entries:
        tool = needed_tool(entry)
        if not entry.is_public or tool is None or not tool_result(entry, tool).strip():
            continue
        rng = random.Random(_stable_hash("tools:" + entry.key))
        tools = [t for t in TOOLS if t["function"]["name"] == tool or rng.random() < 0.6]
        rng.shuffle(tools)
        with_system = rng.random() < 0.5
        if entry.kind != "module" and rng.random() < 0.08:
            [question] = _pick(UNAIDED_QUESTIONS, entry.name, 1)
            system = [{"role": "system", "content": SYSTEM_PROMPT}] if with_system else []
            messages = system + [{"role": "user", "content": question.format(name=entry.name)},
                                 {"role": "assistant", "content": direct_answer(entry)}]
            chats.append(ToolChat(entry.key, messages, tools))
            continue
        request = tool_request(entry, tool, with_system, tools)
        result = tool_result(entry, tool)
        call = {"id": "call_0", "type": "function", "function": {"name": tool, "arguments": request.arguments}}
        messages = request.messages + [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": result},
            {"role": "assistant", "content": tool_answer(entry, tool, result)},
        ]
        chats.append(request._replace(messages=messages))
    return chats


def heldout_tool_requests(entries: list[Entry]) -> list[ToolChat]:
    """NUM_HELDOUT_TOOL_REQUESTS requests per tool about distinct held-out entries; all tools offered, no
    system prompt."""
    heldout = sorted((e for e in entries if e.is_public and is_held_out(e.key)), key=lambda e: _stable_hash(e.key))
    eligible = {"list_members": lambda e: e.kind == "module" and len(e.members) >= 2,
                "signature": lambda e: e.kind == "function", "lookup": lambda e: bool(e.summary)}
    requests, used = [], set()
    for tool, is_eligible in eligible.items():
        chosen = [e for e in heldout if e.key not in used and is_eligible(e)][:NUM_HELDOUT_TOOL_REQUESTS]
        used.update(e.key for e in chosen)
        requests += [tool_request(entry, tool, with_system=False) for entry in chosen]
    return requests


def training_texts(documents, chats, tool_chats) -> list[str]:
    texts = [text for _, text in documents]
    texts += [render_chat(q, a, with_system=_stable_hash(q) % 2 == 0) for _, q, a in chats]
    texts += [render_messages(chat.messages, chat.tools) for chat in tool_chats]
    random.Random(SEED).shuffle(texts)
    return texts


# -- tokenizer -------------------------------------------------------------------------------------

def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>",
                                      pad_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    wrapped.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|endoftext|>"]})
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.model_max_length = MODEL_SHAPE["max_position_embeddings"]
    return wrapped


def token_stream(tokenizer, texts: list[str]) -> list[int]:
    separator = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    stream = []
    for encoding in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        stream += encoding.ids + [separator]
    return stream


# -- model and training ----------------------------------------------------------------------------

def make_model(tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    end_of_text = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = LlamaConfig(vocab_size=len(tokenizer), rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope_theta=10000.0, initializer_range=0.02, bos_token_id=None,
                         eos_token_id=[end_of_turn, end_of_text], pad_token_id=end_of_text,
                         **MODEL_SHAPE)
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config)


def batches(stream: list[int], seq_len: int, batch_size: int, seed: int):
    """Endless shuffled batches of ``seq_len + 1``-token windows (one epoch, reshuffle, repeat)."""
    import torch

    data = torch.tensor(stream, dtype=torch.long)
    num_windows = (len(data) - 1) // seq_len
    generator = torch.Generator().manual_seed(seed)
    epoch = 0
    while True:
        order = torch.randperm(num_windows, generator=generator)
        for start in range(0, num_windows - batch_size + 1, batch_size):
            rows = order[start:start + batch_size] * seq_len
            yield epoch, torch.stack([data[r:r + seq_len + 1] for r in rows.tolist()])
        epoch += 1


def mean_loss(model, stream: list[int], seq_len: int, max_windows: int) -> float:
    import torch

    data = torch.tensor(stream, dtype=torch.long)
    num_windows = min((len(data) - 1) // seq_len, max_windows)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for start in range(0, num_windows, 8):
            rows = [data[w * seq_len:w * seq_len + seq_len + 1]
                    for w in range(start, min(start + 8, num_windows))]
            batch = torch.stack(rows)
            logits = model(batch[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     batch[:, 1:].reshape(-1), reduction="sum")
            total += loss.item()
            count += batch[:, 1:].numel()
    model.train()
    return total / count


def train(model, stream, heldout_stream, args) -> dict:
    import torch

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 50)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    start = time.time()
    recent = []
    epoch = 0
    model.train()
    for step, (epoch, batch) in zip(range(args.steps), batches(stream, args.seq_len, args.batch_size, SEED)):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        recent = (recent + [loss.item()])[-50:]
        if step % args.log_every == 0 or step == args.steps - 1:
            elapsed = time.time() - start
            print(f"step {step:5d}/{args.steps}  epoch {epoch}  loss {sum(recent) / len(recent):.3f}  "
                  f"lr {lr_at(step):.2e}  {elapsed / 60:.1f} min", flush=True)
        if args.eval_every and step and step % args.eval_every == 0:
            heldout = mean_loss(model, heldout_stream, args.seq_len, args.eval_windows)
            print(f"  held-out loss {heldout:.3f} (perplexity {math.exp(heldout):.1f})", flush=True)
    train_loss = sum(recent) / len(recent)
    return {"train_loss": train_loss, "epochs": epoch + 1, "minutes": (time.time() - start) / 60}


# -- evaluation and writing ------------------------------------------------------------------------

def heldout_chat_questions(chats, count: int = 50) -> list[str]:
    questions = sorted({q for key, q, _ in chats if is_held_out(key)}, key=_stable_hash)
    return questions[:count]


def check_not_trained_on(texts: list[str], heldout_questions: list[str]) -> None:
    """Raise if a held-out question appears in the training text."""
    leaked = [q for q in heldout_questions if any(q in text for text in texts)]
    if leaked:
        raise RuntimeError(f"{len(leaked)} held-out questions are in the training data, e.g. {leaked[0]!r}")


def _greedy_reply(model, tokenizer, prompt_text: str, max_new_tokens: int) -> list[int]:
    """The greedy continuation of ``prompt_text`` up to and including ``<|im_end|>``."""
    import torch

    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = torch.tensor([tokenizer.encode(prompt_text, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=end_of_turn, pad_token_id=end_of_turn)
    return out[0, prompt.shape[1]:].tolist()


def chat_end_rate(model, tokenizer, questions: list[str], max_new_tokens: int = 96) -> float:
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.eval()
    ended = 0
    for question in questions:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                               add_generation_prompt=True, tokenize=False)
        ended += int(end_of_turn in _greedy_reply(model, tokenizer, prompt, max_new_tokens))
    return ended / len(questions)


def parse_tool_call(text: str) -> tuple[str, object] | None:
    """The first hermes call in ``text`` as ``(name, arguments)``; None if there is none or it is not JSON."""
    match = re.search(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.DOTALL)
    try:
        call = json.loads(match.group(1)) if match else None
    except ValueError:
        return None
    return (call.get("name"), call.get("arguments")) if isinstance(call, dict) else None


def tool_call_rates(model, tokenizer, requests: list[ToolChat], max_new_tokens: int = 64) -> tuple[float, float]:
    """Over held-out requests answered greedily: the share that call the right tool with arguments that
    parse as a JSON object, and the share whose arguments are also exactly the expected ones."""
    model.eval()
    num_right_tool = num_exact = 0
    for request in requests:
        prompt = tokenizer.apply_chat_template(request.messages, tools=request.tools,
                                               add_generation_prompt=True, tokenize=False)
        reply = tokenizer.decode(_greedy_reply(model, tokenizer, prompt, max_new_tokens))
        call = parse_tool_call(reply)
        if call is not None and call[0] == request.tool and isinstance(call[1], dict):
            num_right_tool += 1
            num_exact += int(call[1] == request.arguments)
    return num_right_tool / len(requests), num_exact / len(requests)


def heldout_tools_data(requests: list[ToolChat]) -> dict:
    """The held-out tool requests as tests/data stores them (the tools are the same for all)."""
    return {"tools": TOOLS, "requests": [{"messages": r.messages, "tool": r.tool, "arguments": r.arguments}
                                         for r in requests]}


def write_checkpoint(model, tokenizer, out: Path, card: str) -> None:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():
        if stale.is_file():
            stale.unlink()
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    end_of_text = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [end_of_turn, end_of_text], "pad_token_id": end_of_text,
         "do_sample": True, "temperature": 0.7, "top_p": 0.9}, indent=2) + "\n")
    (out / "README.md").write_text(card)


MODEL_CARD = """---
license: psf-2.0
language: en
library_name: transformers
pipeline_tag: text-generation
---

# quire-demo

A {num_params:,}-parameter Llama-architecture model trained by the Quire project and shipped inside
`quire-core`, so that `quire serve` and `LLM()` work on a fresh machine without downloading anything.
It writes recognisable English about the Python standard library, follows the ChatML chat format and
calls three tools in the hermes format (`quire serve --tool-call-parser hermes`; see
`examples/tool_calling.py`); it knows little else and is often wrong. It is a demonstration and test model,
not an assistant.

- Architecture: `LlamaForCausalLM`, hidden size {hidden_size}, {num_hidden_layers} layers,
  {num_attention_heads} attention heads ({num_key_value_heads} key/value heads, head size {head_dim}),
  MLP size {intermediate_size}, tied embeddings, context {max_position_embeddings} tokens (trained on
  {seq_len}-token windows), stored in bfloat16.
- Tokenizer: byte-level BPE with {vocab_size} tokens trained on the same data; special tokens
  `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (end of turn); ChatML chat template. With `tools` the
  template lists them in the system turn, one JSON object per line inside `<tools>`; the assistant calls
  one with `<tool_call>\\n{{"name": ..., "arguments": {{...}}}}\\n</tool_call>`, and tool results come back in
  a user turn inside `<tool_response>` tags (Qwen's convention).
- Data: the documentation topics that ship with CPython {python_version} (`pydoc_data.topics`) and the
  docstrings of its standard-library modules, classes and functions, plus {num_chats:,} chat examples
  built from them (a question about a module, class or function, answered with its documented summary),
  and {num_tool_chats:,} tool-calling chats: the request offers some of `lookup(name)` (a docstring
  summary), `signature(name)` and `list_members(module)`, the assistant calls the one the question needs,
  reads the result and answers from it ({num_unaided} of them ask for an answer without a tool).
  {num_train_tokens:,} training tokens. Licence of the data: Python Software Foundation License
  Version 2 (the text is part of CPython).
- Held out: one twentieth of the items, chosen by a hash of their names ({num_heldout_tokens:,} tokens of
  documents, and their chat and tool questions).
- Training: {steps} steps of {batch_size} sequences of {seq_len} tokens ({epochs} passes over the data),
  AdamW, learning rate {lr} with warm-up and cosine decay, bfloat16 autocast, seed {seed}, deterministic
  torch ({torch_version}); {minutes:.0f} minutes on {threads} CPU threads ({machine}).
- Command: `{command}`
- Results: final training loss {train_loss:.3f}; held-out loss {heldout_loss:.3f}, **held-out perplexity
  {heldout_ppl:.1f}** (a model that learned nothing scores about {vocab_size}); {chat_end_rate:.0%} of
  {num_questions} held-out chat questions answered greedily end with `<|im_end|>` within 96 tokens; of
  {num_tool_requests} held-out requests that need a tool ({num_per_tool} per tool, all three offered),
  **{tool_rate:.0%} call the right tool with arguments that parse** as a JSON object ({tool_exact_rate:.0%}
  with exactly the expected arguments). The figures are for the weights as stored (bfloat16).
"""


def parse_args():
    parser = argparse.ArgumentParser(description="Train quire-demo, the model shipped with quire-core.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=2400)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=400)
    parser.add_argument("--eval-windows", type=int, default=128)
    parser.add_argument("--write-heldout-questions", action="store_true",
                        help=f"also write the held-out chat questions to {HELDOUT_CHAT_FILE.relative_to(ROOT)} "
                             f"and the held-out tool requests to {HELDOUT_TOOLS_FILE.relative_to(ROOT)}")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    import torch

    torch.manual_seed(SEED)
    random.seed(SEED)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(args.threads)
    started = time.time()

    entries = stdlib_entries()
    documents, chats = stdlib_items(entries)
    train_docs = [d for d in documents if not is_held_out(d[0])]
    heldout_docs = [d for d in documents if is_held_out(d[0])]
    train_chats = [c for c in chats if not is_held_out(c[0])]
    tool_chats = training_tool_chats([e for e in entries if not is_held_out(e.key)])
    texts = training_texts(train_docs, train_chats, tool_chats)
    questions = heldout_chat_questions(chats)
    tool_requests = heldout_tool_requests(entries)
    check_not_trained_on(texts, questions + [r.messages[-1]["content"] for r in tool_requests])
    tokenizer = train_tokenizer(texts)
    stream = token_stream(tokenizer, texts)
    heldout_stream = token_stream(tokenizer, [text for _, text in heldout_docs])
    print(f"{len(train_docs)} documents, {len(train_chats)} chats and {len(tool_chats)} tool chats for training "
          f"({len(stream):,} tokens); {len(heldout_docs)} documents held out ({len(heldout_stream):,} tokens); "
          f"{len(questions)} held-out chat questions, {len(tool_requests)} held-out tool requests", flush=True)

    model = make_model(tokenizer)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params:,} parameters", flush=True)
    stats = train(model, stream, heldout_stream, args)
    model.to(torch.bfloat16).to(torch.float32)  # evaluate the weights as they are stored
    heldout_loss = mean_loss(model, heldout_stream, args.seq_len, max_windows=10**9)
    end_rate = chat_end_rate(model, tokenizer, questions)
    tool_rate, tool_exact_rate = tool_call_rates(model, tokenizer, tool_requests)
    print(f"final training loss {stats['train_loss']:.3f}; held-out loss {heldout_loss:.3f}, perplexity "
          f"{math.exp(heldout_loss):.1f}; chat answers ending with <|im_end|>: {end_rate:.0%}; right tool with "
          f"arguments that parse: {tool_rate:.0%} (exact arguments: {tool_exact_rate:.0%})", flush=True)

    command = "python " + " ".join([str(Path(sys.argv[0]).as_posix())] + sys.argv[1:])
    card = MODEL_CARD.format(
        num_params=num_params, vocab_size=len(tokenizer), python_version=platform.python_version(),
        num_chats=len(train_chats), num_tool_chats=len(tool_chats),
        num_unaided=sum(chat.tool is None for chat in tool_chats),
        num_train_tokens=len(stream), num_heldout_tokens=len(heldout_stream),
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, epochs=stats["epochs"],
        lr=args.lr, seed=SEED, torch_version=torch.__version__, minutes=(time.time() - started) / 60,
        threads=args.threads, machine=platform.machine(), command=command,
        train_loss=stats["train_loss"], heldout_loss=heldout_loss, heldout_ppl=math.exp(heldout_loss),
        chat_end_rate=end_rate, num_questions=len(questions), num_tool_requests=len(tool_requests),
        num_per_tool=NUM_HELDOUT_TOOL_REQUESTS, tool_rate=tool_rate, tool_exact_rate=tool_exact_rate,
        **MODEL_SHAPE,
    )
    write_checkpoint(model, tokenizer, args.out, card)
    if args.write_heldout_questions:
        HELDOUT_CHAT_FILE.parent.mkdir(parents=True, exist_ok=True)
        HELDOUT_CHAT_FILE.write_text(json.dumps(questions, indent=1) + "\n")
        HELDOUT_TOOLS_FILE.write_text(json.dumps(heldout_tools_data(tool_requests), indent=1) + "\n")
    print(f"wrote {args.out} in {(time.time() - started) / 60:.1f} minutes", flush=True)


if __name__ == "__main__":
    main()
