"""One real SmolLM2 engine shared by the engine tests (loading it is the slow part).

Kept small so the tests stay fast: few KV blocks, short context, a small batch.
"""

import pytest

BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 96
MAX_MODEL_LEN = 256


@pytest.fixture(scope="session")
def llm():
    from conveyor.engine.llm import LLM

    return LLM(num_gpu_blocks=NUM_GPU_BLOCKS, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
               max_num_seqs=8, max_num_batched_tokens=512, seed=0,
               dtype="float32")  # float32: greedy comparisons across batch shapes are exact


@pytest.fixture
def engine(llm):
    """The shared engine; each test must leave it idle with every KV block free again."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    yield engine
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats.scheduler.num_free_blocks == stats.scheduler.num_total_blocks == engine.num_gpu_blocks == NUM_GPU_BLOCKS


@pytest.fixture(scope="session")
def tokenizer(llm):
    return llm.get_tokenizer()
