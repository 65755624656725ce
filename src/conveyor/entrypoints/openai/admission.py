"""Admission control by sequences in flight: every completion or chat request reserves its
sequences (prompts x n) for as long as its response runs, and the server refuses work beyond
``--max-sequences-in-flight`` with 429 and ``Retry-After`` (a request larger than the whole
limit is a 400: retrying cannot help). Lives on the event loop only, so no lock."""

from __future__ import annotations

from conveyor.entrypoints.openai.errors import APIError, bad_request

RETRY_AFTER_S = 1


class Reservation:
    """Sequences held by one request; ``release()`` may be called any number of times."""

    def __init__(self, admission: SequenceAdmission, num_seqs: int) -> None:
        self._admission = admission
        self.num_seqs = num_seqs

    def release(self) -> None:
        if self.num_seqs:
            self._admission.in_flight -= self.num_seqs
            self.num_seqs = 0


class SequenceAdmission:
    def __init__(self, max_sequences: int | None = None) -> None:
        self.max_sequences = max_sequences  # None: no limit
        self.in_flight = 0

    def reserve(self, num_seqs: int) -> Reservation:
        limit = self.max_sequences
        if limit is not None:
            if num_seqs > limit:
                raise bad_request(f"This request asks for {num_seqs} sequences (prompts x n); "
                                  f"the server runs at most {limit} at once "
                                  f"(--max-sequences-in-flight).", param="n",
                                  code="too_many_sequences")
            if self.in_flight + num_seqs > limit:
                raise APIError(429, f"The server is running {self.in_flight} sequences and "
                               f"admits at most {limit} (--max-sequences-in-flight); this "
                               f"request asks for {num_seqs}. Retry after {RETRY_AFTER_S} s.",
                               code="too_many_sequences_in_flight",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
        self.in_flight += num_seqs
        return Reservation(self, num_seqs)
