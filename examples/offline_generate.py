"""Generate text offline with ``quire.offline.LLM``.

    python examples/offline_generate.py                      # the embedded quire-demo model
    python examples/offline_generate.py --model PATH --prompt "def main():"
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local Hugging Face checkpoint folder (default: quire-demo)")
    parser.add_argument("--prompt", action="append", help="repeatable; default: two chat questions")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    from quire.offline import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    if args.prompt:
        outputs = llm.generate(args.prompt, params)
    else:
        questions = ["What does `os.path.join` do?", "What is the json module for?"]
        outputs = llm.chat([[{"role": "user", "content": q}] for q in questions], params)
    for output in outputs:
        completion = output.outputs[0]
        prompt = output.prompt or llm.get_tokenizer().decode(output.prompt_token_ids)
        print(f"--- {prompt!r} ({len(completion.token_ids)} tokens, {completion.finish_reason})\n"
              f"{completion.text}")


if __name__ == "__main__":
    main()
