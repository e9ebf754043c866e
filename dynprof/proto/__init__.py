"""The control protocol between the dynprof CLI and the in-process agent.

``dynprof.proto`` defines the messages; :mod:`dynprof.proto.framing` moves them over a socket
as length-prefixed frames. See the .proto file for the rules of the wire.
"""

from dynprof.proto import dynprof_pb2 as pb
from dynprof.proto.framing import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    FrameError,
    recv_frame,
    send_frame,
)

__all__ = ["pb", "MAX_FRAME_BYTES", "PROTOCOL_VERSION", "FrameError", "recv_frame", "send_frame"]
