#!/usr/bin/env python3
"""Write a few valid inputs per fuzz target into fuzz/corpus/<target>/seed-* so each
campaign starts from inputs that get past the first checks. The layouts mirror how each
target in fuzz_targets/ reads its bytes (see the doc comment at the top of each).
Idempotent: rewrites only seed-* files.

    python3 fuzz/seed-corpus.py [CORPUS_DIR]     (default: fuzz/corpus next to this file)
"""
import json, os, struct, sys

out_root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
u8 = lambda v: struct.pack("<B", v)
u16 = lambda v: struct.pack("<H", v)
u32 = lambda v: struct.pack("<I", v)
u64 = lambda v: struct.pack("<Q", v)


def put(target, name, data):
    d = os.path.join(out_root, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


# --- desc_decode: whole descriptors (400 bytes) -----------------------------------------
MAGIC, VERSION, MAX_NDIM = int.from_bytes(b"TWD1", "little"), 1, 16


def desc(sizes, strides, dtype=6, size=4, offset=0, nbytes=None, kind=1, lease=(0, 0)):
    extent = 0
    if all(s > 0 for s in sizes):
        extent = (offset + sum((s - 1) * st for s, st in zip(sizes, strides)) + 1) * size
    nbytes = extent if nbytes is None else nbytes
    head = struct.pack("<IHBBBBBBIq", MAGIC, VERSION, dtype, len(sizes), 0, 0, kind, 0, 0, offset)
    pad = [0] * (MAX_NDIM - len(sizes))
    geo = struct.pack("<16q", *sizes, *pad) + struct.pack("<16q", *strides, *pad)
    storage = struct.pack("<QQQII64sIIQQ", 7, 0, nbytes, lease[0], lease[1], bytes(64), 0, 0, 0, 0)
    b = head + geo + storage
    assert len(b) == 400, len(b)
    return b


put("desc_decode", "f32-2x3", desc([2, 3], [3, 1]))
put("desc_decode", "f32-3x2-transposed", desc([3, 2], [1, 3]))
put("desc_decode", "i64-1000x5-expanded", desc([1000, 5], [0, 1], dtype=4, size=8))
put("desc_decode", "u8-sliced", desc([4, 2], [6, 2], dtype=0, size=1, offset=1))
put("desc_decode", "f64-scalar", desc([], [], dtype=7, size=8, offset=5))
put("desc_decode", "bf16-empty", desc([0, 4], [4, 1], dtype=15, size=2))
put("desc_decode", "c128-ring", desc([8], [1], dtype=10, size=16, kind=2, nbytes=4096))

# --- ring_ops: 3-byte ops (push 0/1, publish 2, pop 3/4, release 5, scribble a byte 6,
# --- a hostile record 7, a hostile tail 8, check ready 9) -----------------------------
put("ring_ops", "push-publish-pop", bytes([0, 10, 1, 2, 0, 0, 3, 0, 0]))
put("ring_ops", "many", bytes([0, 40, 0, 1, 200, 3, 2, 0, 0, 3, 0, 0, 4, 1, 0, 5, 0, 0, 0, 255, 1, 2, 0, 0, 3, 0, 0]))
put("ring_ops", "wrap", bytes([0, 150, 0, 2, 0, 0, 3, 0, 0] * 6))
put("ring_ops", "ready", bytes([9, 0, 0, 0, 10, 1, 9, 0, 0, 3, 0, 0, 9, 0, 0]))
put("ring_ops", "hostile-record", bytes([0, 10, 1, 3, 0, 0, 7, 8, 0, 3, 0, 0]))
put("ring_ops", "laps-then-stale-stamp", bytes([0, 150, 0, 3, 0, 0] * 8 + [7, 5, 2, 3, 0, 0]))

# --- rpc frames and values ------------------------------------------------------------
msgs = [
    {"kind": "call", "object_id": "echo", "call_id": 1, "parent_call_id": None, "method": "add", "args": [1, 2], "kwargs": {}},
    {"kind": "response", "call_id": 1, "result": 3, "error": None},
    {"kind": "callback", "callback_id": "cb1", "call_id": 2, "parent_call_id": 1, "args": [], "kwargs": {"x": 1.5}},
]


def frame(obj):
    t = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return struct.pack(">I", len(t)) + t


put("rpc_frame_decode", "three-messages", b"\x07" + b"".join(frame(m) for m in msgs))
put("rpc_frame_decode", "closing", b"\x00" + frame(b"null"))
put("rpc_frame_decode", "byte-by-byte", b"\x00" + frame(msgs[0]))

values = {
    "call": json.dumps(msgs[0]).encode(),
    "bytes": b'{"__pyisolate_bytes__": true, "data": "aGVsbG8gd29ybGQ="}',
    "exception": b'{"__pyisolate_exception__": true, "type": "ValueError", "module": "builtins", "args": ["bad"], "message": "bad", "traceback": ""}',
    "enum": b'{"__pyisolate_enum__": true, "type": "Color", "module": "m", "name": "RED", "value": 1}',
    "handle": b'{"__type__": "RemoteObjectHandle", "object_id": "o1", "type_name": "Model"}',
    "callable": b'{"__pyisolate_callable__": true, "type": "function", "name": "f", "signature": [], "callback_id": "c1"}',
    "tensorref": b'{"__type__": "TensorRef", "device": "cpu", "strategy": "file_system", "manager_path": "/torch_1", "storage_key": "k", "storage_size": 64, "dtype": "torch.float32", "tensor_size": [4, 4], "tensor_stride": [4, 1], "tensor_offset": 0, "requires_grad": false}',
    "python-floats": b"[NaN, Infinity, -Infinity, 1.0, -0.0, 1e300, 5e-324]",
    "bigint": b"[123456789012345678901234567890, -9223372036854775809, 18446744073709551615]",
    "strings": '["\\u00e9\\ud83d\\ude00", "tab\\tnl\\n", "\u00fc\u4e2d", "\\ud800"]'.encode(),
    "nested": b'{"a": [1, {"b": [true, false, null]}], "a": 2, "c": {}}',
}
for k, v in values.items():
    put("rpc_value_decode", k, v)
    put("rpc_json_diff", k, v)
put("rpc_json_diff", "numbers", b"[0, -0, 1, -1, 9223372036854775807, -9223372036854775808, 0.1, 1e22, 1.7976931348623157e308, 2.2250738585072014e-308, 123.456e-7]")
put("rpc_json_diff", "escapes", b'"\\"\\\\\\/\\b\\f\\n\\r\\t\\u0000\\u001f\\u007f\\u2028"')

# rpc_tagged: selector byte (tag = TAGS[sel % 8]; fields from sel >> 5), then pieces split
# by NUL bytes: the tag's value, then field values.
put("rpc_tagged", "bytes", b"\x00true\x00\"aGVsbG8=\"")
put("rpc_tagged", "exception", b"\x01true\x00\"ValueError\"\x00\"builtins\"\x00\"bad\"")
put("rpc_tagged", "remote-object", b"\x05\x00\"o1\"\x00\"Model\"")
put("rpc_tagged", "callable", b"\x03true\x00\"c1\"")
for k in ("bytes", "exception", "enum", "handle", "callable", "tensorref"):
    put("rpc_tagged", "json-" + k, b"\x07" + values[k])

# --- conn_hello: mode, max_message (u16), [hello fields], count, messages -------------
# mode 0: a well-formed hello; reads its max_message field (u32).
put("conn_hello", "hello-only", u8(0) + u16(1024) + u32(65536) + u8(0))
put("conn_hello", "hello-two-messages",
    u8(0) + u16(1024) + u32(65536) + u8(2)
    + u8(0x01) + u16(20) + u8(3) + b"twelve bytes"        # framed, kind 1 + 3
    + u8(0x21) + u16(8) + u8(0))                          # framed, empty, 1 fd
put("conn_hello", "at-the-limit", u8(0) + u16(100) + u32(100) + u8(1) + u8(0x05) + u8(1) + u8(2))
put("conn_hello", "raw-hello", u8(1) + u16(64) + u16(24) + b"TWM1" + u32(0) + b"TWHELLO1" + u32(1) + u32(64) + u8(0))

# --- peer_setup: flags, table capacity, ring size, setup fields, fds, messages --------
# flags 0: KIND_TABLE from setup_payload with our capacity; then ring-size selector
# (1: the real ring), fd selector (bits 0-1 table: 1 = real; bits 2-3 ring: 1 = real).
def setup(flags=0, cap=4, ring_shift=0, rb_sel=0, fd_sel=1):
    return u8(flags) + u8(cap - 1) + u8(ring_shift) + u8(rb_sel) + u8(fd_sel)


def user(payload):
    return u8(4) + u16(len(payload)) + payload


def tensor(n=100, seg_len=4096):
    # what = 0x30: plausible descriptor, lease granted by the raw side.
    return (u8(0x30) + u64(7) + bytes(400) + u16(seg_len - 1)
            + u16(n) + u8(0) + u16(0) + u16(n) + u8(0))


put("peer_setup", "table-only", setup() + u8(0))
put("peer_setup", "table-and-ring", setup(rb_sel=1, fd_sel=1 | 1 << 2) + u8(0))
put("peer_setup", "user-and-tensor", setup() + u8(3) + user(b"hello") + tensor() + user(b"bye"))
put("peer_setup", "forget", setup() + u8(1) + u8(3) + u64(5))
put("peer_setup", "cuda-events", setup() + u8(1) + u8(2) + u8(1) + u32(0))
# flags 0x24: the setup announces a GPU ring and one follows: structured (0), 1 slot,
# device 0, 4 KiB slots, 64 KiB descriptor ring, one handle per slot, 2 fds.
put("peer_setup", "cuda-ring", setup(flags=0x24) + u8(0) + u8(1) + u32(0) + u8(0) + u8(0) + u64(65536) + u8(0)
    + u8(2) + u8(0) + u8(4) + u8(0))

# --- lease_table ------------------------------------------------------------------------
# mode 0: ImportTable::open on a header we write: claimed (u8), max capacity (u16), size
# selector (0: exact).
put("lease_table", "open-good", u8(0) + u8(4) + u16(64) + u8(0))
put("lease_table", "open-short", u8(0) + u8(4) + u16(64) + u8(2) + u8(0))
# mode 1: a script over one real table (capacity byte, then ops: 0 grant, 2 check,
# 3 release, 4 scribble, 5 reap, 6 stats).
G = lambda: u8(0) + u8(16)                 # grant 17 bytes, no window
CHK = lambda k=0: u8(2) + u8(k)            # check granted[k >> 1]
REL = lambda k=0: u8(3) + u8(k)
REAP = lambda ms=1: u8(5) + u8(ms)
STATS = u8(6)
put("lease_table", "grant-release-reap", u8(1) + u8(3) + G() + CHK() + REL() + REAP() + STATS + G() + STATS)
put("lease_table", "window-expiry", u8(1) + u8(1) + u8(0x10) + u8(5) + u8(16) + REAP(10) + STATS + CHK())
put("lease_table", "scribble", u8(1) + u8(3) + G() + G() + u8(4) + u8(0) + u8(1) + u8(1) + u8(2) + REL(2) + REAP() + STATS)
put("lease_table", "full", u8(1) + u8(1) + G() + G() + STATS + REL() + REAP() + G() + STATS)

# --- cuda_setup: selector, then a RingSetup payload (even) or event pool fields (odd) ----
def ring_setup(slots=2, slot_bytes=4096, device=0, desc_ring=65536):
    return u32(device) + u32(slots) + u64(slot_bytes) + u64(desc_ring) + bytes(64) + bytes(64 * slots)


put("cuda_setup", "ring-2-slots", u8(0) + ring_setup())
put("cuda_setup", "ring-8-slots-1m", u8(0) + ring_setup(8, 1 << 20, 1))
put("cuda_setup", "events-3", u8(1) + u8(3) + u8(0) + u32(0))
put("cuda_setup", "events-short-acks", u8(1) + u8(3) + u8(1) + u8(0) + u32(0))
