"""OpenAI's Files and Batch APIs and ``conveyor run-batch``: request lines run through the
server's own routes (``dispatch``), checked and answered in OpenAI's JSONL shapes (``lines``),
uploaded and result files (``files``), and persistent, resumable batch jobs (``batches``)."""
