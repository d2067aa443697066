"""The CPU fake device: a drop-in device module shaped like ``torch.cuda`` that simulates
CUDA-graph capture (recording, not executing), replay, memory pools and their hazards.

``FakeDevice()`` is the entry point; importing this package registers it as ``"fake"`` in
``spec.devices`` (``spec.get_device("fake")``).
"""

import spec as _spec
from spec import GraphState
from spec import __version__ as __version__

from . import _handlers  # noqa: F401  (registers the built-in op handlers)
from ._allocator import FakePool, is_poisoned, poison_value
from ._collectives import FakeCommunicator, FakeProcessGroup, RankContext, run_ranks
from ._device import FakeDevice, FakeDeviceInfo, WeakTensorRef
from ._graph import FakeCUDAGraph
from ._mode import Recorder
from ._ops import OpInfo, OpKind, classify_op, register_op_handler
from ._scratch import FakeCaptureScratch
from ._streams import FakeEvent, FakeStream

_spec.register_device("fake", FakeDevice)

__all__ = [
    "FakeCUDAGraph",
    "FakeCaptureScratch",
    "FakeCommunicator",
    "FakeDevice",
    "FakeDeviceInfo",
    "FakeEvent",
    "FakePool",
    "FakeProcessGroup",
    "FakeStream",
    "GraphState",
    "OpInfo",
    "OpKind",
    "RankContext",
    "Recorder",
    "WeakTensorRef",
    "classify_op",
    "is_poisoned",
    "poison_value",
    "register_op_handler",
    "run_ranks",
]
