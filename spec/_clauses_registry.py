"""Clauses of the graph input-buffer registry and of the shared input-buffer pool."""

from .clauses import define

define(
    "registry",
    [
        ("REG-1", """GraphSlot raises ValueError for an unknown axis, for axis 'none' with a policy
            other than KEEP_PAD or FOREACH_COPY, and for FILL_SENTINEL or FILL_ONCE without a
            pad_value."""),
        ("REG-2", """Registration creates the slot's buffer with shape shape_fn(max_bs,
            max_num_tokens) on the slot's device (else the registry's): zeros, or pad_value
            everywhere for FILL_SENTINEL and FILL_ONCE. The buffer never moves afterwards, and the
            slot's declaration is fixed (setting a field raises AttributeError). A duplicate name
            raises ValueError."""),
        ("REG-3", """On a fill with raw < padded, the pad region [raw:padded] along the slot's
            axis is re-zeroed (ZERO), re-filled with pad_value (FILL_SENTINEL), or left as it is
            (KEEP_PAD, FOREACH_COPY, FILL_ONCE). Rows at or beyond padded are never touched by the
            pad reset or the copies."""),
        ("REG-4", """A fill runs pad reset on every enabled slot, then the head copies, then the
            post_fill hooks in registration order, each hook given the whole buffer."""),
        ("REG-5", """The head [0:raw] of a slot is copied from the batch attribute of the slot's
            name (skipped when missing or None, or with copy_from_fb False); with source_fn, from
            its result into the source-length prefix (skipped when None). Copies into dense
            device destinations are grouped by (destination dtype, source dtype) into one foreach
            copy per group, strided ones are copied on their own, and host destinations of a
            device registry are copied after all of them."""),
        ("REG-6", """slot.slice_for(padded_bs, padded_num_tokens) returns a view, never a copy,
            of the padded prefix (slice_fn's when given; the whole buffer for axis 'none'); before
            the slot has a buffer it raises RuntimeError."""),
        ("REG-7", """A fill raises ValueError naming the problem, and writes nothing, when raw >
            padded, when padded exceeds the registry's maximum, when a plain source's length along
            the slot's axis differs from the raw count, or when a source_fn source is longer than
            the buffer."""),
        ("REG-8", """extract_buffer returns a new batch object (the template is not mutated)
            whose slot fields are the padded views and whose batch_size is padded_bs; a plain slot
            whose template field is None stays None; computed slots (post_fill, or copy_from_fb
            False) are always exposed; dotted slot names are not passed to replace."""),
        ("REG-9", """build_decode_registry declares input_ids (FOREACH_COPY), positions,
            out_cache_loc, req_pool_indices, mrope_positions (ZERO), seq_lens and seq_lens_cpu
            (FILL_SENTINEL, the latter on the host), out_cache_loc_swa (int32, ZERO) for hybrid
            SWA, mamba tracking slots (ZERO) and encoder_lens (int32, FILL_ONCE) when enabled."""),
        ("REG-10", """build_prefill_registry declares input_ids, positions, out_cache_loc (and
            out_cache_loc_swa, int32, for hybrid SWA) with ZERO, mrope_positions (ZERO) and
            input_embeds (ZERO, reset only) for multimodal models, and FOREACH_COPY mamba tracking
            slots."""),
        ("REG-11", """register_slot(slot, bind=t) adopts t after checking shape, dtype and
            device; a bound tensor is never pooled and never re-filled at registration. With
            source=, the builders bind every slot to the source's field of that name, and a
            missing field raises ValueError."""),
        ("REG-12", """A disabled slot is kept (get_slot finds it) but gets no buffer, is not
            reported by has_slot or slot_names, and is neither filled nor exposed."""),
        ("POOL-1", """share_input_buffer keys the process-wide pool by (name, numel, dtype,
            device): two requests share memory if and only if all four parts are equal."""),
        ("POOL-2", """The first registrant for a key is canonical; later requests get a view of it
            (same data_ptr) shaped like their own tensor. A request with a different key never
            displaces the canonical buffer, whatever the order of requests."""),
        ("POOL-3", """clear_input_buffer_pool empties the pool: the next request for a key becomes
            canonical again."""),
        ("POOL-4", """A registry with share_pool=True takes its buffers from the pool and applies
            the sentinel fill after pooling; joining an existing pooled buffer never re-zeroes
            it, and a rejected registration changes no pooled buffer."""),
    ],
)
