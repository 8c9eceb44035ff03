"""Speculative decoding in the scheduler: a running request verifies its proposed tokens in one step (1 + k
tokens within the budget and its limits), rolls back past the rejected ones, reuses their slots, and only
blocks of known tokens enter the prefix cache."""

from quire.core.sched.output import ModelRunnerOutput
from tests.core.sched.helpers import make_request, make_scheduler, run_step


def decoding(scheduler, request, prompt_steps=1):
    scheduler.add_request(request)
    for _ in range(prompt_steps):
        run_step(scheduler, token=50)
    assert request.num_tokens - request.num_computed_tokens == 1
    return request


def verify(scheduler, request, proposal, accepted):
    """One step verifying ``proposal``, of which the runner accepts ``accepted`` and adds a token of its own."""
    request.spec_token_ids = list(proposal)
    out = scheduler.schedule()
    scheduled = out.scheduled_spec_decode_tokens.get(request.request_id, [])
    tokens = [*scheduled[:accepted], 90 + accepted]
    outputs = scheduler.update_from_output(out, ModelRunnerOutput({request.request_id: tokens}))
    return out, outputs


def test_proposals_are_scheduled_after_the_last_token_and_rejected_ones_roll_back():
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=64)
    request = decoding(scheduler, make_request("a", 6, max_tokens=32))
    num_tokens = request.num_tokens  # 7: prompt and one sampled token
    out, outputs = verify(scheduler, request, [11, 12, 13, 14], accepted=2)
    assert out.num_scheduled_tokens == {"a": 5}  # the last known token and the 4 proposals
    assert out.scheduled_spec_decode_tokens == {"a": [11, 12, 13, 14]}
    assert outputs[0].new_token_ids == [11, 12, 92]
    assert request.num_tokens == num_tokens + 3
    # computed: everything but the newest token; the two rejected proposals' slots are held for reuse
    assert request.num_computed_tokens == request.num_tokens - 1
    assert request.spec_token_ids == []
    blocks = len(scheduler.kv_cache_manager.get_block_ids("a"))
    out, _ = verify(scheduler, request, [], accepted=0)
    assert out.num_scheduled_tokens == {"a": 1} and out.scheduled_spec_decode_tokens == {}
    assert len(scheduler.kv_cache_manager.get_block_ids("a")) == blocks  # the held slots were reused


def test_all_accepted_plus_the_bonus_token():
    scheduler = make_scheduler(block_size=4)
    request = decoding(scheduler, make_request("a", 5, max_tokens=32))
    _, outputs = verify(scheduler, request, [21, 22, 23], accepted=3)
    assert outputs[0].new_token_ids == [21, 22, 23, 93]
    assert request.num_computed_tokens == request.num_tokens - 1


def test_proposals_are_cut_to_the_budget_and_to_max_tokens():
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=3)
    request = decoding(scheduler, make_request("a", 3, max_tokens=32))
    out, _ = verify(scheduler, request, [1, 2, 3, 4, 5], accepted=0)
    assert out.num_scheduled_tokens == {"a": 3} and out.scheduled_spec_decode_tokens == {"a": [1, 2]}
    scheduler = make_scheduler(block_size=4)
    request = decoding(scheduler, make_request("b", 3, max_tokens=3))  # 1 output so far, 2 more at most
    out, outputs = verify(scheduler, request, [1, 2, 3, 4], accepted=1)
    assert out.scheduled_spec_decode_tokens == {"b": [1]}  # the step also samples one token
    assert outputs[0].new_token_ids == [1, 91] and outputs[0].finish_reason is not None


def test_a_prefilling_request_does_not_speculate():
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=4)
    request = make_request("a", 10, max_tokens=8)
    scheduler.add_request(request)
    run_step(scheduler)
    request.spec_token_ids = [1, 2]
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 4} and out.scheduled_spec_decode_tokens == {}


def test_only_blocks_of_known_tokens_are_cached():
    scheduler = make_scheduler(block_size=4, enable_caching=True)
    request = decoding(scheduler, make_request("a", 6, max_tokens=32))  # 7 known tokens
    manager = scheduler.kv_cache_manager
    request.spec_token_ids = [31, 32, 33, 34, 35, 36]  # slots up to 13 tokens: 3 full blocks of slots
    scheduler.schedule()
    assert manager._num_hashed_blocks["a"] == 1  # only the first block holds known tokens only
    hashed = [block for block in manager.req_to_blocks["a"] if block.block_hash is not None]
    assert len(hashed) == 1


def test_a_proposal_that_does_not_fit_is_dropped_rather_than_preempting():
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64)  # 4 usable blocks
    first = decoding(scheduler, make_request("a", 6, max_tokens=32))
    second = decoding(scheduler, make_request("b", 6, max_tokens=32))  # 2 blocks each: none free
    assert (first.num_tokens, second.num_tokens) == (8, 7)  # both decode within their blocks
    first.spec_token_ids = [1, 2, 3, 4, 5, 6, 7, 8]
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1} and out.scheduled_spec_decode_tokens == {}
    assert scheduler.num_preemptions == 0 and first.spec_token_ids == [] and second.num_preemptions == 0


def test_preemption_drops_the_proposal():
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64)  # 4 usable blocks
    first = decoding(scheduler, make_request("a", 7, max_tokens=32))
    second = decoding(scheduler, make_request("b", 6, max_tokens=32))  # 2 blocks each: none free
    assert first.num_tokens == 9  # its next token needs a third block
    second.spec_token_ids = [1, 2]
    scheduler.schedule()  # a takes the last free block; b has none left for its 9th token: preempted
    assert second.num_preemptions == 1 and second.spec_token_ids == []
