"""The control protocol between the dynprof CLI and the in-process agent.

``dynprof.proto`` defines the messages; :mod:`dynprof.proto.framing` moves them over a socket
as length-prefixed frames. See the .proto file for the rules of the wire.
"""

from typing import Any

from dynprof.proto import dynprof_pb2 as _pb2
from dynprof.proto.framing import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    FrameError,
    recv_frame,
    send_frame,
)

# The generated module builds its classes at import time; to the type checker they are Any.
pb: Any = _pb2

__all__ = ["pb", "MAX_FRAME_BYTES", "PROTOCOL_VERSION", "FrameError", "recv_frame", "send_frame"]
