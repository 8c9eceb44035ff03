"""The persistent batch: which row each request holds after requests leave."""

import itertools

from quire.core.sampling_params import SamplingParams
from quire.core.sched.output import NewRequestData
from quire.core.worker.input_batch import InputBatch


def batch_of(request_ids) -> InputBatch:
    batch = InputBatch(max_num_reqs=8, max_model_len=16, max_blocks_per_req=4)
    for number, request_id in enumerate(request_ids):
        batch.add(NewRequestData(request_id=request_id, token_ids=[number, number + 1], num_prompt_tokens=2,
                                 sampling_params=SamplingParams(), eos_token_ids=[], bad_words_token_ids=[],
                                 block_ids=[number], num_computed_tokens=0))
    return batch


def test_rows_after_removing_several_do_not_depend_on_their_order():
    """Tensor-parallel ranks get the same set of finished requests, iterated in a process-specific order;
    their rows must still agree, or the ranks' all-reduce would add up different requests."""
    ids = ["r0", "r1", "r2", "r3", "r4"]
    results = set()
    for finished in itertools.permutations(["r0", "r1", "r3"]):
        batch = batch_of(ids)
        batch.remove_many(list(finished) + ["unknown"])
        assert sorted(batch.req_ids) == ["r2", "r4"]
        for request_id, row in batch.index.items():  # each row still holds its own request's state
            number = ids.index(request_id)
            assert batch.req_ids[row] == request_id
            assert batch.token_ids[row, :2].tolist() == [number, number + 1]
            assert batch.block_table[row, 0] == number
        results.add(tuple(batch.req_ids))
    assert len(results) == 1
