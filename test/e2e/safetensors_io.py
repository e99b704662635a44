"""Minimal safetensors reader/writer built on numpy only.

File layout (https://github.com/huggingface/safetensors):
  * 8 bytes: little-endian uint64 N, the size of the JSON header;
  * N bytes: UTF-8 JSON object mapping tensor name -> {"dtype", "shape",
    "data_offsets": [begin, end]} (offsets relative to the end of the header),
    plus an optional "__metadata__" object of string -> string;
  * the raw little-endian tensor bytes.

Reading supports F32, F16, BF16 and F64 (returned as float32/float16/float32/float64
numpy arrays; BF16 is widened to float32 since numpy has no bfloat16).
Writing produces F32 (or F64 when asked for) tensors.
"""

import json
import struct

import numpy as np

_READ_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # converted below
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
}

_WRITE_DTYPES = {
    np.dtype("float32"): "F32",
    np.dtype("float64"): "F64",
}


def _bf16_to_f32(raw_u16):
    return (raw_u16.astype(np.uint32) << 16).view(np.float32)


def read_header(path):
    """Returns (header dict without __metadata__, metadata dict, data offset)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n).decode("utf-8"))
    metadata = header.pop("__metadata__", {}) or {}
    return header, metadata, 8 + n


def load_file(path):
    """Reads a safetensors file into an ordered dict name -> numpy array."""
    header, _, base = read_header(path)
    with open(path, "rb") as f:
        f.seek(base)
        blob = f.read()
    out = {}
    for name in sorted(header):
        info = header[name]
        dtype = info["dtype"]
        if dtype not in _READ_DTYPES:
            raise ValueError("%s: unsupported safetensors dtype %s" % (name, dtype))
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        npdt = _READ_DTYPES[dtype]
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if end - begin != count * npdt.itemsize:
            raise ValueError("%s: byte size %d does not match shape %s / %s"
                             % (name, end - begin, shape, dtype))
        arr = np.frombuffer(blob, dtype=npdt, count=count, offset=begin)
        if dtype == "BF16":
            arr = _bf16_to_f32(arr)
        out[name] = arr.reshape(shape).copy()
    return out


def load_metadata(path):
    return read_header(path)[1]


def save_file(tensors, path, metadata=None):
    """Writes name -> array (numpy or torch) as safetensors (F32 unless the array is
    float64 and kept as such). Tensors are laid out in sorted name order."""
    arrays = {}
    for name, t in tensors.items():
        if hasattr(t, "detach"):  # torch tensor
            t = t.detach().cpu().numpy()
        a = np.asarray(t)
        if a.dtype not in _WRITE_DTYPES:
            a = a.astype(np.float32)
        arrays[name] = np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<")))
    header = {}
    offset = 0
    names = sorted(arrays)
    for name in names:
        a = arrays[name]
        header[name] = {
            "dtype": _WRITE_DTYPES[a.dtype.newbyteorder("=")],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    if metadata is None:
        metadata = {"format": "pt"}
    header = dict(header)
    header_full = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    header_full.update(header)
    hbytes = json.dumps(header_full, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * ((8 - len(hbytes) % 8) % 8)  # align data to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for name in names:
            f.write(arrays[name].tobytes())
