"""Clauses of tensor-parallel graphs (``TP``): ranks that issue the same collectives in the same
order, whether eager, captured or replayed. Core: each rule, broken, hangs a real process group
(the field bug is named in the text). Strict: the reference's guards (a batch or ladder that
differs between ranks is refused, where an engine might pad instead) and the multi-rank fake's
promise to name the disagreement instead of hanging."""

from .clauses import define

define(
    "parallel",
    [
        ("TP-1", """A tensor-parallel model (column-parallel q/k/v and gate/up, row-parallel
            output and down projections each followed by an all-reduce, KV heads split across
            ranks, a vocab-parallel head gathered) under the runners, with its collectives
            recorded inside decode graphs and breakable segments (attention staying a break),
            gives on every rank the tokens and, within the dtype's tolerance, the logits of the
            same model on one rank."""),
        ("TP-2", """Every rank replays the same padded size for a step: the size is decided
            from host values with no device sync, the same way on every rank (a rank that pads
            by its own count while another's count differs replays another graph: vLLM
            #25906).""", """The reference requires every rank to hold the same batch: each
            step's batch (kind, requests, tokens) and chosen size are exchanged on the host,
            and ranks that differ get DecisionMismatch on every rank before anything launches,
            the refused step's KV slots given back."""),
        ("TP-3", """Captures are symmetric: every rank captures every size of the ladder, with
            placeholder batches of the same shapes (a rank that captures with another batch,
            or none, issues other collectives: TensorRT-LLM #14986).""", """The reference
            checks at construction that every rank's capture ladder, warm-ups and sanitizer
            level are equal: DecisionMismatch on every rank otherwise, before any capture."""),
        ("TP-4", """Captures are aligned: every rank captures the sizes in the same order with a
            barrier before each size, and a breakable capture calls the communicator's barrier
            at every break (capture orders that differ by rank: pegainfer #496)."""),
        ("TP-5", """The replay-or-eager choice is part of the checked decision: every rank
            replays or every rank runs the step eagerly, and no rank overrides the checked
            choice with a condition of its own (one rank falling back to eager while the others
            replay: pegainfer #498)."""),
        ("TP-6", """Warm-up is symmetric: every rank runs the same warm-up forwards before each
            capture, so the eager collectives they issue match (a collective in some ranks'
            warm-up only: ScaleLLM #131)."""),
        ("TP-7", "", """The multi-rank fake matches each rank's k-th communicator call and,
            when ranks disagree (kind, shape, dtype, or eager / capture / replay) or a rank
            leaves the group while others wait for it, raises CollectiveMismatch on every rank
            with each rank's sequence up to the disagreement and the graph or step that issued
            it; it never waits on a rank that cannot arrive."""),
        ("TP-8", "", """A model runner's close() releases every graph of its runners (the
            communicator's process group is destroyed after it), and the ranks' graphs replay
            their collectives from one collective capture: a tensor-parallel runner without a
            communicator, or with one of another world size than the model's, is refused."""),
    ],
)
