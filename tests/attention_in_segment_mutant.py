"""pytest plugin: the ``MODEL-4`` mutant. The reference attention backend no longer knows when a
breakable segment records, so the naive glue's extend attention is captured into the segment
(the placeholder's one request frozen in) and nothing is raised."""

from impl.models import _attention

_attention.is_recording_segment = lambda: False
