"""Peer descriptors and notifications on the wire: round trips, size limits,
malformed input, socket frames with deadlines."""

import socket
import struct

import msgpack
import pytest

from pdcluster.transfer.deadline import Deadline
from pdcluster.transfer.errors import FrameTooLargeError, TransferError
from pdcluster.transfer.layout import KVLayout
from pdcluster.transfer.peer import (Notification, PeerDescriptor, decode_notification, encode_notification,
                           peer_id_of_agent)
from pdcluster.transfer.wire import MAX_DESCRIPTOR_BYTES, pack, recv_exactly, recv_frame, send_frame, unpack

LAYOUT = KVLayout(2, 2, 16, "bfloat16", 4, 99)


def descriptor(**overrides):
    fields = dict(backend="nixl", peer_id="prefill-0", epoch=0xABC, layout=LAYOUT, num_blocks=64,
                  pool_addr=0x7F0000001000, agent_metadata=b"\x00meta", endpoint="")
    return PeerDescriptor(**{**fields, **overrides})


def test_descriptor_round_trips():
    d = descriptor()
    assert PeerDescriptor.decode(d.encode()) == d
    assert d.agent_name == "prefill-0#0000000000000abc"
    assert peer_id_of_agent(d.agent_name) == "prefill-0"


def test_oversized_descriptor_is_refused_before_decoding():
    with pytest.raises(TransferError, match="over the 65536-byte limit"):
        PeerDescriptor.decode(b"\x00" * (MAX_DESCRIPTOR_BYTES + 1))


@pytest.mark.parametrize("data", [b"\xc1", b"not msgpack at all \xff\xff", pack([1, 2]), pack({"v": 2}),
                                  pack({"v": 1, "backend": "nixl"})])
def test_garbage_descriptors_raise_transfer_error(data):
    with pytest.raises(TransferError):
        PeerDescriptor.decode(data)


def test_descriptor_with_bad_field_values_is_refused():
    raw = msgpack.unpackb(descriptor().encode())
    for field, value in [("num_blocks", -1), ("epoch", "x"), ("mem_type", "DISK"), ("peer_id", "a b"),
                         ("layout", {"num_layers": 1})]:
        with pytest.raises(TransferError, match="malformed peer descriptor"):
            PeerDescriptor.decode(pack({**raw, field: value}))


def test_notifications_carry_the_lease_id():
    assert decode_notification("decode-1", encode_notification("req-42")) == Notification("decode-1", "req-42")
    with pytest.raises(TransferError, match="carries no lease id"):
        decode_notification("decode-1", pack({"other": 1}))
    with pytest.raises(TransferError, match="over the"):
        decode_notification("decode-1", b"\x00" * 10_000)
    with pytest.raises(ValueError):
        encode_notification("")


def test_unpack_limits_apply_inside_the_buffer():
    with pytest.raises(TransferError):
        unpack(pack({"blob": b"x" * 200}), 100, "test")


def test_frames_round_trip_over_a_socket():
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, {"op": "read", "runs": [[1, 2]]}, Deadline(1.0, "send"))
        assert recv_frame(b, Deadline(1.0, "recv"), "frame", max_bytes=64) == {"op": "read", "runs": [[1, 2]]}


def test_a_frame_over_the_readers_limit_is_refused_from_its_length_prefix():
    body = pack({"op": "read", "runs": [[1, 2]]})
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", len(body)) + body)
        with pytest.raises(FrameTooLargeError, match=f"announces {len(body)} bytes, over the {len(body) - 1}-byte"):
            recv_frame(b, Deadline(1.0, "recv"), "request", max_bytes=len(body) - 1)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", 1 << 30))  # no body follows: refused without waiting for (or allocating) it
        with pytest.raises(FrameTooLargeError, match="announces 1073741824 bytes, over the 4096-byte frame limit"):
            recv_frame(b, Deadline(1.0, "recv"), "request", max_bytes=4096)


def test_a_silent_peer_times_out_and_a_closed_one_is_reported():
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(TransferError, match="timed out after 0.05 s"):
            recv_exactly(b, memoryview(bytearray(4)), Deadline(0.05, "waiting"), "header")
        a.sendall(b"xy")
        a.close()
        with pytest.raises(TransferError, match=r"connection closed while reading header \(2 bytes missing\)"):
            recv_exactly(b, memoryview(bytearray(4)), Deadline(1.0, "waiting"), "header")
