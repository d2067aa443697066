"""Clauses of speculative decoding under graphs (``SPEC``): the target's verify graph, the
draft's decode and extend graphs, each guarding a field bug of the draft and verify runners."""

from .clauses import define

define(
    "speculative",
    [
        ("SPEC-1", """Widths: a fixed-width graph (target verify, draft extend) serves steps of
            exactly its width W tokens per request; a step of another width is declined and runs
            eagerly, never replayed in a graph of another width.""",
         """Replaying a step of another width through the ladder's replay() raises ValueError
            naming the kind and the captured sizes."""),
        ("SPEC-2", """Accept lengths are data: the draft extend graph has width W whatever the
            accept lengths, and for every accept vector in [1, W]^bs (all ones and all W
            included) the rows gathered at i * W + accept[i] - 1 (the next draft token and
            hidden state) equal eager's."""),
        ("SPEC-3", """Padding rows: a speculative step padded to a captured batch size reads only
            the registry's fill values in its padded rows and writes no live request's KV slot:
            after a step of fewer requests than an earlier one, every live request's KV is
            unchanged except at the positions the step wrote (vLLM #47066, stale padded rows of
            a draft mapping writing a live request's rows); every padded request of every
            replay of one graph gives the same output, whatever request last held its row
            (vLLM #43682, padded rows' lengths raised from 0 to 1 reading a live block-table
            row)."""),
        ("SPEC-4", """Worst-case buffers: every speculative input buffer is sized for the largest
            captured batch at the largest width (the draft decode's cache locations for bs * K - 1
            steps), so a round of the most requests is served by its graphs with the eager
            result (SGLang #27338, a draft buffer sized without the steps factor written past
            its rows)."""),
        ("SPEC-5", """Pools: the draft's graphs may share the target's pool and capture stream:
            what one graph's replay returns is the caller's own memory, never a view of the pool
            another capture or replay reuses, so the round's tokens equal eager's (SGLang
            #22930, a draft capture re-using the target graphs' live pool memory)."""),
        ("SPEC-6", """No host flags: a speculative graph bakes no host value (a draft length, a
            step index, a validity flag set during warm-up); the sanitizer covers every
            speculative runner, its capture probes and replay shadows, and names one that does
            (TensorRT-LLM #15775)."""),
        ("SPEC-7", """Equivalence: greedy speculative decoding with graphs gives the target's own
            greedy tokens (eager, without speculation) and the same acceptance counts, round by
            round, as eager speculative decoding, with requests joining and leaving and batch
            sizes crossing the captured sizes (SGLang #6081: acceptance dropping with graphs on;
            vLLM #37639: a draft-logits buffer the graph never writes)."""),
        ("SPEC-8", """Graphs used: when speculative graphs are captured, every round's verify,
            draft decode and draft extend step that fits a captured size is replayed from them:
            each kind's stats count a replay per round and no declined step (vLLM #47460,
            #23679: draft graphs captured and never dispatched)."""),
    ],
)
