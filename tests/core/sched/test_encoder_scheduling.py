"""Images in the scheduler: encoder inputs scheduled with their placeholder tokens, the encoder budget, the
encoder cache's references and evictions, and image hashes in the prefix-cache block hashes."""

from quire.core.request import Request
from quire.core.sampling_params import SamplingParams
from quire.core.sched.block_hash import extend_block_hashes
from quire.core.sched.encoder_cache import EncoderCacheManager
from quire.core.wire import MultiModalFeature
from tests.core.sched.helpers import EOS, fake_runner_output, make_scheduler

IMAGE = 9  # the placeholder token id


def image_request(request_id, images, num_text_tokens=4, num_prompt_tokens=None, **params):
    """A prompt of ``num_text_tokens`` text tokens before each image (``(identifier, length)``) and after
    the last; returns the request."""
    prompt, features = [], []
    for identifier, length in images:
        prompt += list(range(100, 100 + num_text_tokens))
        features.append(MultiModalFeature("image", identifier, len(prompt), length))
        prompt += [IMAGE] * length
    prompt += list(range(200, 200 + num_text_tokens))
    params.setdefault("max_tokens", 4)
    return Request(request_id, prompt, SamplingParams(**params), eos_token_ids=(EOS,), mm_features=features)


def step(scheduler):
    output = scheduler.schedule()
    scheduler.update_from_output(output, fake_runner_output(scheduler, output))
    return output


def test_an_image_is_encoded_in_the_step_that_reaches_its_placeholders():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = image_request("a", [("img-a", 6)], num_text_tokens=5)  # image at [5, 11), prompt of 16 tokens
    scheduler.add_request(request)
    first = step(scheduler)
    assert first.num_scheduled_tokens == {"a": 8} and first.scheduled_encoder_inputs == {"a": [0]}
    assert first.new_requests[0].mm_features == request.mm_features
    second = step(scheduler)  # the chunk ends inside the image: its rest uses the cached output
    assert second.num_scheduled_tokens == {"a": 8} and second.scheduled_encoder_inputs == {}
    assert scheduler.make_stats().mm_cache_queries == 1 and scheduler.make_stats().mm_cache_hits == 0
    assert scheduler.encoder_cache.num_referenced == 0  # computed: the output may go, but stays cached


def test_an_image_over_the_step_budget_waits_for_the_next_step():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    scheduler.add_request(image_request("a", [("img-a", 10)], num_text_tokens=2))
    scheduler.add_request(image_request("b", [("img-b", 10)], num_text_tokens=2))
    first = step(scheduler)
    # a encodes its 10 placeholder tokens; b's image does not fit the remaining budget: b computes up to it
    assert first.scheduled_encoder_inputs == {"a": [0]}
    assert first.num_scheduled_tokens == {"a": 14, "b": 2}
    second = step(scheduler)
    assert second.scheduled_encoder_inputs == {"b": [0]}


def test_an_image_larger_than_the_budget_runs_alone():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(image_request("a", [("img-a", 20)], num_text_tokens=2))
    first = step(scheduler)
    assert first.scheduled_encoder_inputs == {"a": [0]} and first.num_scheduled_tokens == {"a": 8}
    for _ in range(2):
        step(scheduler)
    assert scheduler.requests["a"].num_computed_tokens == 24  # the whole prompt, in chunks of 8


def test_the_same_image_twice_is_encoded_once():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    scheduler.add_request(image_request("a", [("img-x", 6)]))
    scheduler.add_request(image_request("b", [("img-x", 6)], num_text_tokens=3))
    output = step(scheduler)
    assert output.scheduled_encoder_inputs == {"a": [0]}  # b takes a's output in the same step
    stats = scheduler.make_stats()
    assert (stats.mm_cache_queries, stats.mm_cache_hits) == (2, 1)
    while scheduler.has_unfinished_requests():
        step(scheduler)
    scheduler.add_request(image_request("c", [("img-x", 6)], num_text_tokens=5))
    assert step(scheduler).scheduled_encoder_inputs == {}  # still cached after a and b finished
    assert scheduler.make_stats().mm_cache_hits == 2


def test_unreferenced_outputs_are_evicted_oldest_first_and_reported():
    cache = EncoderCacheManager(capacity=10)
    owner = image_request("a", [])
    cache.allocate(owner, "x", 4)
    cache.allocate(owner, "y", 4)
    assert not cache.can_allocate(4)  # both referenced
    cache.release(owner, "x")
    cache.release(owner, "y")
    assert cache.can_allocate(8)
    cache.allocate(owner, "z", 6)  # evicts x only
    assert cache.take_freed() == ["x"] and cache.is_cached("y") and cache.take_freed() == []
    cache.release(owner, "z")
    assert cache.num_referenced == 0
    cache.allocate(owner, "big", 25)  # nothing referenced: an item over capacity is held alone
    assert cache.take_freed() == ["y", "z"] and cache.num_used == 25


def test_preemption_releases_the_images_and_recomputes_them():
    # 8 usable blocks of 4 tokens: each request (16 prompt + 10 output tokens) fits alone, not both
    scheduler = make_scheduler(num_blocks=9, block_size=4, max_num_batched_tokens=64)
    scheduler.add_request(image_request("a", [("img-a", 8)], max_tokens=10))
    scheduler.add_request(image_request("b", [("img-b", 8)], max_tokens=10))
    encoded = []
    for _ in range(100):
        if not scheduler.has_unfinished_requests():
            break
        encoded += list(step(scheduler).scheduled_encoder_inputs)
    assert not scheduler.has_unfinished_requests() and scheduler.num_preemptions > 0
    assert scheduler.encoder_cache.num_referenced == 0
    # the victim recomputes its prompt from its cached image output (capacity 64 evicts nothing here)
    assert sorted(encoded) == ["a", "b"]
    assert scheduler.make_stats().mm_cache_hits == scheduler.num_preemptions


def test_block_hashes_tell_two_images_with_the_same_placeholders_apart():
    prompt = [1, 2, IMAGE, IMAGE, IMAGE, IMAGE, 3, 4]
    first = extend_block_hashes([], prompt, 4, mm_features=[MultiModalFeature("image", "aaa", 2, 4)])
    second = extend_block_hashes([], prompt, 4, mm_features=[MultiModalFeature("image", "bbb", 2, 4)])
    same = extend_block_hashes([], prompt, 4, mm_features=[MultiModalFeature("image", "aaa", 2, 4)])
    assert first == same
    assert first[0] != second[0] and first[1] != second[1]
    text = [1, 2, 5, 6, 7, 8, 3, 4]
    assert extend_block_hashes([], text, 4)[0] == extend_block_hashes([], text, 4, mm_features=[])[0]


def test_a_prefix_hit_inside_an_image_needs_the_rest_of_it():
    scheduler = make_scheduler(max_num_batched_tokens=64, enable_caching=True)
    scheduler.add_request(image_request("a", [("img-a", 8)], num_text_tokens=2))
    while scheduler.has_unfinished_requests():
        step(scheduler)
    # same text and image up to the image's last tokens, then other text: blocks [0, 8) hit (block size 4)
    request = image_request("b", [("img-a", 8)], num_text_tokens=2)
    request.prompt_token_ids[-1] = request.all_token_ids[-1] = 999
    scheduler.add_request(request)
    output = step(scheduler)
    assert scheduler.make_stats().prefix_cache_hits == 8
    assert output.scheduled_encoder_inputs == {}  # the output of img-a is still cached: a hit
    assert scheduler.make_stats().mm_cache_hits == 1
