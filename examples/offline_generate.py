"""Generate text offline with ``quire.offline.LLM``.

    python examples/offline_generate.py --model PATH/TO/HF/CHECKPOINT --prompt "def main():"

Without ``--model`` it builds a tiny random-weight Llama checkpoint (a few seconds, nothing downloaded),
so the command works on a fresh machine; its text is noise, but every step of the engine runs.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a local Hugging Face checkpoint folder")
    parser.add_argument("--prompt", action="append", help="repeatable; default: two code prompts")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    from quire.offline import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as scratch:
        model = args.model
        if model is None:
            from quire.core.testing.checkpoints import TinyModelSpec, build_checkpoint

            print("no --model given: building a tiny random-weight checkpoint (its text is noise)")
            model = build_checkpoint(Path(scratch) / "tiny-llama", TinyModelSpec(logit_std=4.0))
        llm = LLM(model, dtype=args.dtype)
        prompts = args.prompt or ["def main():", "import os\n"]
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
        for output in llm.generate(prompts, params):
            completion = output.outputs[0]
            print(f"--- {output.prompt!r} ({len(completion.token_ids)} tokens, "
                  f"{completion.finish_reason})\n{completion.text}")


if __name__ == "__main__":
    main()
