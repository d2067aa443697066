"""Clauses of the model contract (``MODEL``): what a model must provide for the runners to drive
it, stated as the protocols of :mod:`spec.contracts` and :class:`spec.RunnerConfig`."""

from .clauses import define

define(
    "models",
    [
        ("MODEL-1", """A model the runners drive provides model(batch), the float logits
            [bs, vocab] of each request's last token, and compute_logits(hidden, batch), the
            same logits from the hidden states [T, hidden] of the batch's tokens, and a
            RunnerConfig (model.runner_config, or the model_config given to the runner): a model
            with these names only runs under the runners as it runs eagerly.""", """The
            runners read nothing else of the model (never model.config), and a model whose
            runner config is neither is refused with a TypeError naming
            impl.from_transformers; a RunnerConfig with inconsistent fields is a ValueError
            (a TypeError for a dtype that is not a torch.dtype)."""),
        ("MODEL-2", """A model reads the step from the batch's fields (spec.ForwardBatchLike)
            and attends through batch.attn_backend; the same batch run eagerly and through a
            graph gives the same logits."""),
        ("MODEL-3", """get_layer_stack() returns a callable stack(input_ids [T], positions [T],
            hidden_states [T, hidden] | None) -> [T, hidden], called positionally; a breakable
            prefill graph captures it alone, and compute_logits on its real rows equals
            model(batch)."""),
        ("MODEL-4", """A model's attention, called through impl.paged_attention(q, k, v, layer_id,
            scale=, softcap=), gives eager's results in every mode: eager, a decode graph, and
            a breakable capture (the KV write recorded in the segment, attention as a break that
            reads the live batch), for any number of requests.""", """Batch-dependent
            attention that runs inside a breakable segment outside any break (the reference
            backend's extend attention, or a read of the host-side per-request fields of its
            metadata) raises spec.AttentionInSegment naming the layer or field at capture, on
            every backend, instead of replaying the placeholder batch's attention."""),
    ],
)
