"""The views every round-trip test sends: a tensor's layouts that a transport must carry
exactly (shared by tests/python and tests/gpu/gpu_tests.py)."""


def views_of(base, empty=True):
    """Views of a 2-D `base` (at least 6 x 9): contiguous, transposed, a strided slice with
    a storage offset, a stride-0 expand, a 0-dim element and (unless `empty` is False, for
    tests that write into each view) an empty view."""
    views = {
        "contiguous": base,
        "transposed": base.t(),
        "slice": base[1::2, 3:],
        "expand": base[2:3, :5].expand(4, 5),
        "scalar": base[1, 2],
    }
    if empty:
        views["empty"] = base[:, 8:]
    return views
