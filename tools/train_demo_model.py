"""Train quire-demo, the small model that ships inside quire-core.

Data: only text that ships with CPython and may be redistributed under the PSF licence: the pydoc
documentation topics (``pydoc_data.topics``) and the docstrings of the standard library's modules,
classes and functions, plus chat examples built from them (a user asks what a standard-library module,
class or function does; the assistant answers with its documented summary). A fixed twentieth of the
items (chosen by a hash of their names) is held out for evaluation.

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

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "packages/core/src/quire/core/demo_model"
HELDOUT_CHAT_FILE = ROOT / "tests/data/quire_demo_heldout_chat.json"
SEED = 0
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SYSTEM_PROMPT = "You are a helpful assistant who knows the Python standard library."
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
MODEL_SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=32, max_position_embeddings=1024)


# -- data ------------------------------------------------------------------------------------------

def stdlib_items() -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
    """Return ``(documents, chats)``: documents are ``(key, text)``, chats ``(key, question, answer)``."""
    import pydoc_data.topics

    documents = [(f"topic:{name}", text.strip()) for name, text in sorted(pydoc_data.topics.topics.items())]
    chats = []
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
            documents.append((f"module:{module}", f"Module {module}\n\n{docstring}"))
            if public_module:
                chats += [(f"module:{module}", q.format(name=module), _summary(docstring))
                          for q in _pick(MODULE_QUESTIONS, module, 2)]
        for qualname, node in _documented_definitions(tree):
            text = ast.get_docstring(node)
            full_name = f"{module}.{qualname}"
            documents.append((f"def:{full_name}", f"{full_name}{_signature(node)}\n\n{text}"))
            if public_module and not any(part.startswith("_") for part in qualname.split(".")):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                answer = f"`{full_name}{_signature(node)}`: {_summary(text)}"
                chats += [(f"def:{full_name}", q.format(name=full_name, kind=kind), answer)
                          for q in _pick(FUNCTION_QUESTIONS, full_name, 1)]
    return documents, [c for c in chats if c[2].strip()]


def _documented_definitions(tree: ast.Module):
    definitions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for node in tree.body:
        if isinstance(node, definitions) and ast.get_docstring(node):
            yield node.name, node
        if isinstance(node, ast.ClassDef):
            for child in node.body:
                if isinstance(child, definitions) and ast.get_docstring(child):
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


def render_chat(question: str, answer: str | None, with_system: bool) -> str:
    text = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n" if with_system else ""
    text += f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return text if answer is None else text + f"{answer}<|im_end|>\n"


def training_texts(documents, chats) -> list[str]:
    texts = [text for _, text in documents]
    texts += [render_chat(q, a, with_system=_stable_hash(q) % 2 == 0) for _, q, a in chats]
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


def chat_end_rate(model, tokenizer, questions: list[str], max_new_tokens: int = 96) -> float:
    import torch

    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ended = 0
    model.eval()
    with torch.no_grad():
        for question in questions:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                add_generation_prompt=True, tokenize=False)
            prompt = torch.tensor([tokenizer.encode(ids, add_special_tokens=False)])
            out = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=end_of_turn, pad_token_id=end_of_turn)
            ended += int(end_of_turn in out[0, prompt.shape[1]:].tolist())
    return ended / len(questions)


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
It writes recognisable English about the Python standard library and follows the ChatML chat format; it
knows little else and is often wrong. It is a demonstration and test model, not an assistant.

- Architecture: `LlamaForCausalLM`, hidden size {hidden_size}, {num_hidden_layers} layers,
  {num_attention_heads} attention heads ({num_key_value_heads} key/value heads, head size {head_dim}),
  MLP size {intermediate_size}, tied embeddings, context {max_position_embeddings} tokens (trained on
  {seq_len}-token windows), stored in bfloat16.
- Tokenizer: byte-level BPE with {vocab_size} tokens trained on the same data; special tokens
  `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (end of turn); ChatML chat template.
- Data: the documentation topics that ship with CPython {python_version} (`pydoc_data.topics`) and the
  docstrings of its standard-library modules, classes and functions, plus {num_chats:,} chat examples
  built from them (a question about a module, class or function, answered with its documented summary).
  {num_train_tokens:,} training tokens. Licence of the data: Python Software Foundation License
  Version 2 (the text is part of CPython).
- Held out: one twentieth of the items, chosen by a hash of their names ({num_heldout_tokens:,} tokens of
  documents, and their chat questions).
- Training: {steps} steps of {batch_size} sequences of {seq_len} tokens ({epochs} passes over the data),
  AdamW, learning rate {lr} with warm-up and cosine decay, bfloat16 autocast, seed {seed}, deterministic
  torch ({torch_version}); {minutes:.0f} minutes on {threads} CPU threads ({machine}).
- Command: `{command}`
- Results: final training loss {train_loss:.3f}; held-out loss {heldout_loss:.3f}, **held-out perplexity
  {heldout_ppl:.1f}** (a model that learned nothing scores about {vocab_size}); {chat_end_rate:.0%} of
  {num_questions} held-out chat questions answered greedily end with `<|im_end|>` within 96 tokens.
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
                        help=f"also write the held-out chat questions to {HELDOUT_CHAT_FILE.relative_to(ROOT)}")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    import torch

    torch.manual_seed(SEED)
    random.seed(SEED)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(args.threads)
    started = time.time()

    documents, chats = stdlib_items()
    train_docs = [d for d in documents if not is_held_out(d[0])]
    heldout_docs = [d for d in documents if is_held_out(d[0])]
    train_chats = [c for c in chats if not is_held_out(c[0])]
    texts = training_texts(train_docs, train_chats)
    tokenizer = train_tokenizer(texts)
    stream = token_stream(tokenizer, texts)
    heldout_stream = token_stream(tokenizer, [text for _, text in heldout_docs])
    questions = heldout_chat_questions(chats)
    print(f"{len(train_docs)} documents and {len(train_chats)} chats for training ({len(stream):,} tokens); "
          f"{len(heldout_docs)} documents held out ({len(heldout_stream):,} tokens); "
          f"{len(questions)} held-out chat questions", flush=True)

    model = make_model(tokenizer)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params:,} parameters", flush=True)
    stats = train(model, stream, heldout_stream, args)
    heldout_loss = mean_loss(model, heldout_stream, args.seq_len, max_windows=10**9)
    end_rate = chat_end_rate(model, tokenizer, questions)
    print(f"final training loss {stats['train_loss']:.3f}; held-out loss {heldout_loss:.3f}, perplexity "
          f"{math.exp(heldout_loss):.1f}; chat answers ending with <|im_end|>: {end_rate:.0%}", flush=True)

    command = "python " + " ".join([str(Path(sys.argv[0]).as_posix())] + sys.argv[1:])
    card = MODEL_CARD.format(
        num_params=num_params, vocab_size=len(tokenizer), python_version=platform.python_version(),
        num_chats=len(train_chats), num_train_tokens=len(stream), num_heldout_tokens=len(heldout_stream),
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, epochs=stats["epochs"],
        lr=args.lr, seed=SEED, torch_version=torch.__version__, minutes=(time.time() - started) / 60,
        threads=args.threads, machine=platform.machine(), command=command,
        train_loss=stats["train_loss"], heldout_loss=heldout_loss, heldout_ppl=math.exp(heldout_loss),
        chat_end_rate=end_rate, num_questions=len(questions), **MODEL_SHAPE,
    )
    write_checkpoint(model, tokenizer, args.out, card)
    if args.write_heldout_questions:
        HELDOUT_CHAT_FILE.parent.mkdir(parents=True, exist_ok=True)
        HELDOUT_CHAT_FILE.write_text(json.dumps(questions, indent=1) + "\n")
    print(f"wrote {args.out} in {(time.time() - started) / 60:.1f} minutes", flush=True)


if __name__ == "__main__":
    main()
