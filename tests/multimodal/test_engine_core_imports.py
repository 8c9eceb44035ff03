"""The engine core decodes no image and touches no tokenizer: it runs a request with images, rendered by the
front end, in a fresh interpreter where importing an image library, tokenizers or transformers fails."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import msgspec

from quire.core.engine.front_end import FrontEnd
from quire.core.engine_args import EngineArgs
from quire.core.sampling_params import SamplingParams
from quire.core.testing.multimodal_checkpoints import sample_image

FORBIDDEN = ("PIL", "tokenizers", "transformers", "quire.core.multimodal", "quire.core.tokenizer")

ENGINE_CORE = textwrap.dedent("""
    import importlib.abc, sys

    FORBIDDEN = {forbidden!r}

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name in FORBIDDEN or name.startswith(tuple(f + "." for f in FORBIDDEN)):
                raise ImportError(f"the engine core imported {{name}}")

    sys.meta_path.insert(0, Blocker())
    import msgspec
    from quire.core.engine.core import EngineCore
    from quire.core.engine_args import EngineArgs
    from quire.core.wire import EngineCoreRequest

    request = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=EngineCoreRequest)
    core = EngineCore(EngineArgs(model={model!r}, dtype="float32", max_model_len=256).create_engine_config())
    core.add_request(request)
    tokens = []
    for _ in range(100):
        if not core.has_unfinished_requests():
            break
        for output in core.step().outputs:
            tokens += output.new_token_ids
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN or m.startswith(FORBIDDEN))
    print(len(tokens), loaded)
""")


def test_the_engine_core_runs_an_image_request_without_image_or_tokenizer_libraries(llava_checkpoint):
    config = EngineArgs(model=str(llava_checkpoint), dtype="float32", max_model_len=256).create_engine_config()
    front_end = FrontEnd(config, config.model.max_model_len)
    prompt = {"prompt": "<|im_start|>user\n<image>def f():<|im_end|>\n<|im_start|>assistant\n",
              "multi_modal_data": {"image": sample_image(40, 28, 1)}}
    request, _ = front_end.input_processor.process("r0", prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    assert request.mm_features and request.mm_features[0].length == 16
    script = ENGINE_CORE.format(forbidden=FORBIDDEN, model=str(llava_checkpoint))
    result = subprocess.run([sys.executable, "-c", script], input=msgspec.msgpack.encode(request),
                            capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    assert result.stdout.decode().split("\n")[-2] == "5 []"
